"""`ttg bench gateway`'s merge of the load generators' reports: a level's numbers."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest

from gateway.metrics import init_metrics
from tools.bench.gateway import (
    ADMISSION_SERIES,
    QUANTILE_HISTOGRAMS,
    _admission_lines,
    _daemon_env,
    _machine,
    _merge_reports,
    add_arguments,
    admission_window,
    bucket_quantile,
    engine_extremes,
    machine_window,
    media_extremes,
    port_range_problem,
    scrape_text,
)
from tools.replay.scrape import parse_metrics


def _report(folder: Path, utterances: list[dict[str, Any]], call_id: str = "c0", **more: int) -> Path:
    folder.mkdir()
    summary = {"calls": 1, "completed": 1, "rejected": 0, "rtp_sent_to_reporting_calls": 100, **more}
    summary["gateway_rtp_packets"] = 100
    harness = {"cpu_percent": 12.0, "send_lateness_ms": {"p99": 1.5}}
    (folder / "report.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "harness": harness,
                "calls": [{"sip_call_id": call_id, "finals": 2, "utterances": utterances}],
            }
        )
    )
    return folder


def test_sentences_the_model_says_nothing_for_are_named_from_the_replay_report_and_left_out_once(
    tmp_path: Path,
) -> None:
    """An utterance with neither a final nor a partial is a sentence the model emitted nothing for,
    named by the "clip#k" replay recorded; one with a partial but no final is a lost final. The first
    p95 counts every missing final as infinitely late (the capacity rule), the second leaves out only
    the silent sentences."""
    said = [{"ttf_s": 0.1 * k, "ttfp_s": 0.05, "sentence": f"a.wav#{k}"} for k in range(1, 18)]
    silent = {"ttf_s": None, "ttfp_s": None, "sentence": "b.wav#1"}
    lost = {"ttf_s": None, "ttfp_s": 0.3, "sentence": "a.wav#0"}
    folders = [
        _report(tmp_path / "r0", [*said[:9], silent]),
        _report(tmp_path / "r1", [*said[9:], silent, lost]),
    ]
    level = _merge_reports(folders)
    assert level["utterances"] == 20 and level["without_final"] == 3
    assert level["without_any_transcript"] == 2
    assert level["without_any_transcript_by_sentence"] == {"b.wav#1": 2}
    assert level["ttf_p95_s"] == "inf"  # rank 19 of 20: a missing final
    # Without the silent sentence: 18 utterances, rank 18 is the lost final.
    assert level["ttf_p95_spoken_s"] == "inf"
    folders[1].joinpath("report.json").unlink()
    _report(tmp_path / "r2", [*said[9:], silent])
    level = _merge_reports([folders[0], tmp_path / "r2"])
    assert level["ttf_p95_spoken_s"] == round(1.7, 3)  # 17 spoken, all with finals: the largest
    assert math.isclose(level["ttfp_p50_s"], 0.05)


def test_a_levels_p95_to_the_finals_xadd_follows_the_capacity_rule_and_is_absent_from_older_reports(
    tmp_path: Path,
) -> None:
    """Each final's TTF to its XADD (the load generator's reading lag left out), a missing final counted
    as infinitely late as in the first p95; reports written before the field existed give none."""
    said = [{"ttf_s": 0.1 * k + 0.2, "ttf_published_s": 0.1 * k, "ttfp_s": 0.05} for k in range(1, 21)]
    level = _merge_reports([_report(tmp_path / "r0", said)])
    assert level["ttf_p95_s"] == round(2.1, 3) and level["ttf_p95_published_s"] == round(1.9, 3)
    lost = {"ttf_s": None, "ttfp_s": 0.3}
    level = _merge_reports([_report(tmp_path / "r1", [*said[:10], lost])])
    assert level["ttf_p95_published_s"] == "inf"
    older = [{"ttf_s": u["ttf_s"], "ttfp_s": 0.05} for u in said]
    assert _merge_reports([_report(tmp_path / "r2", older)])["ttf_p95_published_s"] is None


def test_a_levels_finals_outside_every_utterance_add_up_and_are_unknown_from_older_reports(
    tmp_path: Path,
) -> None:
    said = [{"ttf_s": 0.2, "ttfp_s": 0.05}]
    both = [
        _report(tmp_path / "r0", said, finals_outside=2),
        _report(tmp_path / "r1", said, finals_outside=1),
    ]
    assert _merge_reports(both)["finals_outside"] == 3
    older = _report(tmp_path / "r2", said)
    assert _merge_reports([*both, older])["finals_outside"] is None


def test_a_level_measures_the_engine_with_the_adaptive_call_limit_off_unless_asked_for() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plain = _daemon_env(parser.parse_args(["--levels", "10"]), max_calls=10)
    assert plain["TTG_SIP__CALL_LIMIT_LAG_MS"] == "0" and plain["TTG_SIP__MAX_CALLS"] == "10"
    asked = _daemon_env(
        parser.parse_args(["--levels", "10", "--env", "TTG_SIP__CALL_LIMIT_LAG_MS=1000"]), max_calls=10
    )
    assert asked["TTG_SIP__CALL_LIMIT_LAG_MS"] == "1000"


def test_a_sentence_most_calls_transcribe_but_one_call_does_not_is_named_with_that_call(
    tmp_path: Path,
) -> None:
    """A sentence that half the calls or more got nothing for is the model's; one that most calls did
    get a transcript for, missing in one call, is a lead into that call's log: its Call-ID."""
    got = {"ttf_s": 0.3, "ttfp_s": 0.1, "sentence": "a.wav#0"}
    lost = {"ttf_s": None, "ttfp_s": None, "sentence": "a.wav#0", "start_ms": 500, "end_ms": 2100}
    silent = {"ttf_s": None, "ttfp_s": None, "sentence": "b.wav#1"}
    folders = [
        _report(tmp_path / "r0", [got, silent], call_id="fine"),
        _report(tmp_path / "r1", [got, silent], call_id="also-fine"),
        _report(tmp_path / "r2", [lost, silent], call_id="the-odd-one"),
    ]
    level = _merge_reports(folders)
    assert level["without_any_transcript_by_sentence"] == {"a.wav#0": 1, "b.wav#1": 3}
    [example] = level["without_any_transcript_examples"]
    assert example["sip_call_id"] == "the-odd-one" and example["sentence"] == "a.wav#0"
    assert example["span_ms"] == [500, 2100] and example["finals"] == 2


def test_the_machine_s_busy_cores_are_its_busy_jiffies_share_times_its_cores() -> None:
    """Four cores: 2 s of samples with 600 of 800 jiffies busy is 3 cores on average, 100 of them stolen
    by the hypervisor half a core; the busiest second (350 of 400) 3.5; the runnable tasks' mean and
    maximum as sampled."""
    samples = [
        {"t": 0.0, "machine": (1000, 2000, 3, 10)},
        {"t": 1.0, "machine": (1250, 2400, 5, 60)},
        {"t": 2.0, "machine": (1600, 2800, 4, 110)},
        {"t": 2.5},  # a sample without /proc/stat does not count
    ]
    assert machine_window(samples, ncpu=4) == {
        "machine_cores": 4,
        "machine_busy_cores_mean": 3.0,
        "machine_busy_cores_max": 3.5,
        "machine_steal_cores_mean": 0.5,
        "runnable_mean": 4.0,
        "runnable_max": 5,
    }
    assert machine_window(samples[:1], ncpu=4) == {}


def test_this_machine_s_proc_stat_gives_busy_within_total_and_a_runnable_count() -> None:
    sample = _machine()
    assert sample is not None
    busy, total, runnable, steal = sample
    assert 0 < busy < total and runnable >= 1  # this test itself is running
    assert 0 <= steal <= busy


def test_the_admission_series_sampled_each_second_are_the_gateways_own() -> None:
    """Each name the bench reads from /metrics is one the daemon exports (a renamed metric would leave
    the timeline empty, not fail the run)."""
    init_metrics()
    page = generate_latest(REGISTRY).decode()
    assert sorted(parse_metrics(page, ADMISSION_SERIES)) == sorted(ADMISSION_SERIES)


def test_a_levels_p95_delays_come_from_the_daemons_own_histogram_buckets() -> None:
    """Where a level's chunks were late: the bucket that holds the 95th percentile of their wait for a
    step and of their whole delay, from the difference of two scrapes of real histograms."""
    registry = CollectorRegistry()
    wait = Histogram("ttg_asr_queue_wait_seconds", "", buckets=(0.128, 0.256, 0.512), registry=registry)
    latency = Histogram("ttg_transcript_latency_seconds", "", ["type"], buckets=(0.5, 1.0), registry=registry)
    wait.observe(3.0)  # before the level: not in its numbers
    before = scrape_text(generate_latest(registry).decode())
    for _ in range(95):
        wait.observe(0.1)
        latency.labels("partial").observe(0.4)
    for _ in range(5):
        wait.observe(0.3)
        latency.labels("final").observe(0.8)
    after = scrape_text(generate_latest(registry).decode())
    assert bucket_quantile(before, after, "ttg_asr_queue_wait_seconds", 0.95) == 0.128
    assert (
        bucket_quantile(before, after, "ttg_asr_queue_wait_seconds", 0.96) == 0.512
    )  # 0.3 s: (0.256, 0.512]
    assert bucket_quantile(before, after, "ttg_transcript_latency_seconds", 0.99) == 1.0  # both types
    wait.observe(9.0)
    wait.observe(9.0)
    wait.observe(9.0)
    beyond = scrape_text(generate_latest(registry).decode())
    assert bucket_quantile(after, beyond, "ttg_asr_queue_wait_seconds", 0.95) == math.inf
    assert bucket_quantile(after, after, "ttg_asr_queue_wait_seconds", 0.95) is None  # nothing observed


def test_the_histograms_whose_buckets_the_bench_reads_are_the_gateways_own() -> None:
    init_metrics()
    page = scrape_text(generate_latest(REGISTRY).decode())
    for name in QUANTILE_HISTOGRAMS:
        assert any(k.startswith(f"{name}_bucket{{") for k in page), name


def test_a_levels_admission_timeline_counts_503s_from_its_start_and_keeps_the_extremes() -> None:
    def sample(
        t: float, active: float, limit: float, load: float, lag: float, refused: float
    ) -> dict[str, Any]:
        values = (active, limit, load, lag, refused)
        return {"t": t, "series": dict(zip(ADMISSION_SERIES, values, strict=True))}

    level = admission_window(
        [
            sample(100.0, 0, 32, 0.0, 0.0, 40),  # 40 refused in an earlier level
            {"t": 101.0, "cpu": {}},  # /metrics not answering that second
            sample(102.0, 30, 64, 0.2, 0.1, 45),
            sample(103.0, 60, 120, 0.5, 0.4, 70),
            sample(104.0, 58, 110, 0.9, 0.2, 90),
        ]
    )
    assert level["admission_timeline"][1] == [2.0, 30, 64, 0.2, 0.1, 5]
    assert level["admission"] == {
        "active_calls_max": 60,
        "call_limit_first": 32,
        "call_limit_max": 120,
        "call_limit_last": 110,
        "engine_load_max": 0.9,
        "engine_lag_max_s": 0.4,
        "refused_503": 50,
    }
    assert admission_window([{"t": 1.0, "cpu": {}}]) == {}


def test_a_levels_engine_extremes_name_the_engine_that_fell_behind_and_its_load_then() -> None:
    def sample(
        t: float, lags: tuple[float, ...], loads: tuple[float, ...], busy: tuple[float, ...]
    ) -> dict[str, Any]:
        series = {f"ttg_engine_process_lag_seconds{{{k}}}": v for k, v in enumerate(lags)}
        series |= {f"ttg_engine_process_load{{{k}}}": v for k, v in enumerate(loads)}
        series |= {f"ttg_engine_process_busy{{{k}}}": v for k, v in enumerate(busy)}
        # the lag's first parts: a fifth of it on the way to the queue (a tenth until its process read the
        # chunk), half in the queue
        series |= {f"ttg_engine_process_receive_lag_seconds{{{k}}}": v / 5 for k, v in enumerate(lags)}
        series |= {f"ttg_engine_process_arrival_lag_seconds{{{k}}}": v / 10 for k, v in enumerate(lags)}
        series |= {f"ttg_engine_process_queue_wait_seconds{{{k}}}": v / 2 for k, v in enumerate(lags)}
        return {"t": t, "series": series}

    engines = engine_extremes(
        [
            sample(10.0, (0.2, 0.3), (0.5, 0.6), (0.6, 0.7)),
            {"t": 11.0, "cpu": {}},  # /metrics not answering that second
            # engine 0 a second behind at load 0.62 with its thread busy all the time
            sample(12.0, (1.4, 0.3), (0.62, 0.9), (1.0, 0.5)),
            sample(13.0, (0.9, 0.2), (0.7, 0.4), (0.95, 0.9)),
        ]
    )
    assert engines == {
        "0": {
            "lag_max_s": 1.4,
            "lag_max_at_s": 2.0,
            "load_at_lag_max": 0.62,
            "load_max": 0.7,
            "busy_at_lag_max": 1.0,
            "busy_max": 1.0,
            "receive_lag_at_lag_max_s": 0.28,
            "arrival_lag_at_lag_max_s": 0.14,
            "queue_wait_at_lag_max_s": 0.7,
        },
        "1": {
            "lag_max_s": 0.3,
            "lag_max_at_s": 0.0,
            "load_at_lag_max": 0.6,
            "load_max": 0.9,
            "busy_at_lag_max": 0.7,
            "busy_max": 0.9,
            "receive_lag_at_lag_max_s": 0.06,
            "arrival_lag_at_lag_max_s": 0.03,
            "queue_wait_at_lag_max_s": 0.15,
        },
    }
    assert engine_extremes([{"t": 1.0, "series": {"ttg_active_calls": 3.0}}]) == {}


def test_a_levels_summary_says_where_even_a_single_engines_lag_sat() -> None:
    """One engine (the one-process gateway's, or one engine process) gets its line too: its lag's peak,
    its load and busy share then, and the lag's parts on the way to its queue and in it."""
    engine = {
        "lag_max_s": 0.631,
        "lag_max_at_s": 10.0,
        "load_at_lag_max": 1.058,
        "load_max": 1.058,
        "busy_at_lag_max": 1.0,
        "busy_max": 1.0,
        "receive_lag_at_lag_max_s": 0.032,
        "arrival_lag_at_lag_max_s": 0.0,
        "queue_wait_at_lag_max_s": 0.434,
    }
    lines = _admission_lines([{"level": 64, "engines": {"0": engine}}]).splitlines()
    assert lines == [
        "- 64 calls, each engine's lag max (then: its load, busy share, the lag's parts to and in the queue, "
        "of the first the part until its process read the chunk; the load's and busy share's maxima): 0: "
        "0.631 s at 10.0 s (1.058, busy 1.0, 0.032 (read after 0.0) + 0.434 s; 1.058, busy 1.0)"
    ]


def test_the_media_workers_timing_says_how_much_of_an_engines_receive_lag_was_theirs() -> None:
    """Each media worker reports its event loop's lateness and its chunks' wait to be published; the bench
    keeps the largest of each (and whose), and at each engine's lag peak the largest of the workers then."""

    def sample(t: float, lag: float, loops: tuple[float, ...], flush: tuple[float, ...]) -> dict[str, Any]:
        series = {"ttg_engine_process_lag_seconds{0}": lag, "ttg_engine_process_receive_lag_seconds{0}": 0.7}
        series |= {f"ttg_media_worker_loop_lag_seconds{{{k}}}": v for k, v in enumerate(loops)}
        series |= {f"ttg_media_worker_flush_delay_seconds{{{k}}}": v for k, v in enumerate(flush)}
        return {"t": t, "series": series}

    samples = [
        sample(10.0, 0.4, (0.02, 0.03, 0.01), (0.01, 0.02, 0.01)),
        sample(11.0, 1.4, (0.05, 0.31, 0.04), (0.02, 0.28, 0.03)),  # engine 0's peak: worker 1 held up
        sample(12.0, 0.9, (0.45, 0.02, 0.03), (0.01, 0.02, 0.05)),  # worker 0's longest turn, later
    ]
    assert media_extremes(samples) == {
        "loop_lag_max_s": 0.45,
        "loop_lag_max_worker": 0,
        "flush_delay_max_s": 0.28,
        "flush_delay_max_worker": 1,
    }
    engine = engine_extremes(samples)["0"]
    assert (engine["media_loop_lag_at_lag_max_s"], engine["media_flush_delay_at_lag_max_s"]) == (0.31, 0.28)
    lines = _admission_lines([{"level": 2000, "media_workers": media_extremes(samples)}]).splitlines()
    assert lines == [
        "- 2000 calls, the media workers' event-loop lag max 0.45 s (worker 0), a chunk's wait to be "
        "published to its engine max 0.28 s (worker 1)"
    ]
    # the one-process gateway has no media workers: nothing about them
    assert media_extremes([{"t": 1.0, "series": {"ttg_engine_process_lag_seconds{0}": 0.2}}]) == {}
    assert (
        "media_loop_lag_at_lag_max_s"
        not in engine_extremes([{"t": 1.0, "series": {"ttg_engine_process_lag_seconds{0}": 0.2}}])["0"]
    )


def test_the_default_rtp_ranges_carry_the_default_levels_and_a_range_too_narrow_is_named_up_front() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert port_range_problem(defaults, [int(x) for x in defaults.levels.split(",")]) is None
    search = parser.parse_args(["--find-capacity", "--max-calls", "256"])
    assert port_range_problem(search, [256]) is None

    narrow = parser.parse_args(["--rtp-ports", "15100-15549"])
    assert port_range_problem(narrow, [225]) is None
    problem = port_range_problem(narrow, [226])
    assert problem is not None and "--rtp-ports 15100-15549 holds 225 calls" in problem

    # 2 000 calls at 700 a process: three replay processes of 667, 667 and 666 calls, each given a
    # third of the range: 16000-17332 has 667 even ports, 17333-18665 only 666.
    split = parser.parse_args(["--replay-rtp-ports", "16000-19999"])
    problem = port_range_problem(split, [2000])
    assert problem is not None and problem.endswith("leaves process 1 666 even ports for its 667 calls")


def test_the_gateway_measured_is_the_checkout_the_bench_was_imported_from_even_through_a_linked_tools(
    tmp_path: Path,
) -> None:
    # tools/device/ab.sh runs the code before from a checkout whose tools/ is a link to the kit's: the
    # default --repo must be that checkout, not where the link points (then both sides run one code).
    repo = Path(__file__).resolve().parents[2]
    other = tmp_path / "before"
    other.mkdir()
    (other / "tools").symlink_to(repo / "tools")
    out = subprocess.run(
        [sys.executable, "-c", "import tools.bench.gateway as g; print(g.REPO)"],
        cwd=other,
        env={**os.environ, "PYTHONPATH": f"{other}{os.pathsep}{repo}"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()).resolve() == other.resolve()  # tmp_path may sit behind a link itself


def test_a_capacity_search_reports_the_capacity_and_each_level_it_tried_not_a_level_of_its_own(
    tmp_path: Path,
) -> None:
    """`--find-capacity` runs one replay process that searches the levels itself: the summary shows its
    bound, capacity and per-level table (the replay's capacity.md), and the bench's own row is the whole
    search's (CPU, batches), labelled as such, with no latencies of a level it never ran as one."""
    from tests.tools.test_replay_report import level_report
    from tools.bench.gateway import _capacity_text, _table
    from tools.replay import report

    levels = tuple(
        report.CapacityLevel(n, level_report([0.2 + 0.01 * n] * 20).summary, n < 8, "" if n < 8 else "p95")
        for n in (1, 2, 4, 8)
    )
    cap = report.CapacityReport(bound_s=0.5, baseline_p95_s=0.2, capacity=4, levels=levels)
    report.write_capacity_markdown(cap, tmp_path / "capacity.md", ["latency_vs_concurrency.png"])
    row = {
        "level": 8,
        "capacity": cap.to_dict(),
        "capacity_report": str(tmp_path / "capacity.md"),
        "mean_batch": 5.5,
        "cpu_percent": {"gateway": 97.0},
    }

    text = _capacity_text([row])
    assert "Highest concurrency that held: **4**" in text and "Bound: p95 time-to-final ≤ **500 ms**" in text
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert rows == ["concurrency", "---", "1", "2", "4", "8"]
    assert "# ttg replay" not in text and ".png" not in text

    table = _table([row])
    assert "| search, 1 … 8 | - | - / - | - |" in table and "None" not in table and "gateway 97" in table

    row["capacity"] = None  # the replay wrote no result
    assert _capacity_text([row]) == "capacity search up to 8 calls: no result (see the replay's log)"
    assert _capacity_text([{"level": 8, "completed": 8}]) == ""  # a fixed level has no search
