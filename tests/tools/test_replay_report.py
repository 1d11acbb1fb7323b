"""The report's numbers as pure functions: percentiles, time-to-final and time-to-first-partial from
sent speech and received events, partial stability, WER, the summary, capacity search, /metrics
parsing, and the writers (JSON, Markdown, PNG)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.replay import metrics_endpoint
from tools.replay import analysis, capacity, plots, report
from tools.replay.analysis import ReceivedEvent, UtteranceResult, UtteranceTiming
from tools.replay.scrape import Scrape, batch_series, parse_metrics


def ev(
    type: str,
    seq: int,
    arrival: float,
    text: str = "",
    span: tuple[int, int] | None = None,
    seg: int | None = None,
) -> ReceivedEvent:
    start, end = span if span else (None, None)
    return ReceivedEvent(
        type=type, seq=seq, arrival=arrival, segment_id=seg, text=text, start_ms=start, end_ms=end
    )


# Two utterances: speech 500–2000 ms and 3500–5000 ms of the call, their edge packets sent at these times.
UTTS = [UtteranceTiming(500, 2000, 10.5, 12.0, "a.wav#0"), UtteranceTiming(3500, 5000, 13.5, 15.0, "a.wav#1")]


def test_stats_gives_numpy_linear_percentiles_and_ignores_missing_values() -> None:
    s = analysis.stats([0.1, 0.2, 0.3, 0.4, float("nan")])
    assert s.n == 4 and s.p50 == pytest.approx(0.25) and s.p95 == pytest.approx(0.385)
    assert s.p99 == pytest.approx(0.397) and s.min == 0.1 and s.max == 0.4 and s.mean == pytest.approx(0.25)
    assert analysis.stats([]) == analysis.Stats(0)


def test_time_to_final_runs_from_the_last_speech_packet_to_the_final_arrival() -> None:
    events = [
        ev("call_start", 1, 10.0),
        ev("partial", 2, 10.9, "hel", (400, 900), 1),
        ev("partial", 3, 11.4, "hello", (400, 1500), 1),
        ev("final", 4, 12.35, "hello there", (400, 2100), 1),
        ev("partial", 5, 14.1, "how", (3400, 4000), 2),
        ev("final", 6, 15.2, "how are you", (3400, 5100), 2),
    ]
    got = analysis.match_utterances(UTTS, events)
    assert got[0] == UtteranceResult(500, 2000, pytest.approx(0.4), pytest.approx(0.35), 1, "a.wav#0")  # type: ignore[arg-type]
    assert got[1] == UtteranceResult(3500, 5000, pytest.approx(0.6), pytest.approx(0.2), 1, "a.wav#1")  # type: ignore[arg-type]


def test_time_to_final_as_published_runs_to_the_finals_xadd_not_to_when_the_replay_read_it() -> None:
    """A busy load generator reads late: the time redis-server stored the final (its entry ID, on the
    replay's clock) gives what the gateway took; unknown for an event without it."""
    late_read = ReceivedEvent("final", 4, 12.9, text="hello", start_ms=400, end_ms=2100, published=12.3)
    unknown = ev("final", 6, 15.2, "how are you", (3400, 5100))
    got = analysis.match_utterances(UTTS, [late_read, unknown])
    assert got[0].ttf_s == pytest.approx(0.9) and got[0].ttf_published_s == pytest.approx(0.3)
    assert got[1].ttf_s == pytest.approx(0.2) and got[1].ttf_published_s is None


def test_a_final_that_merges_two_utterances_counts_for_both_so_a_missed_endpoint_shows_as_latency() -> None:
    events = [ev("final", 1, 15.3, "hello there how are you", (400, 5100))]
    got = analysis.match_utterances(UTTS, events)
    assert got[0].ttf_s == pytest.approx(3.3) and got[1].ttf_s == pytest.approx(0.3)


def test_a_final_in_the_silence_past_an_utterances_margin_covers_none_and_is_counted() -> None:
    """A late last word the gateway sent as its own final 300 ms after the speech (or words made up
    in the silence): TTF cannot see it, so the report counts it."""
    events = [
        ev("final", 1, 12.3, "hello", (400, 2000), 1),
        ev("final", 2, 13.9, "there", (2300, 2400), 2),
        ev("final", 3, 15.2, "how are you", (3400, 5100), 3),
        ev("partial", 4, 15.5, "um", (6000, 6100), 4),
    ]
    got = analysis.match_utterances(UTTS, events)
    assert [u.ttf_s for u in got] == [pytest.approx(0.3), pytest.approx(0.2)]  # "there" not seen
    assert analysis.finals_outside(UTTS, events) == 1
    assert analysis.finals_outside(UTTS, events, margin_ms=300) == 0
    untimed = [ev("final", 1, 12.3, "hello"), ev("final", 2, 13.9, "there")]
    assert analysis.finals_outside(UTTS, untimed) == 0  # matched by order instead


def test_an_utterance_without_a_final_has_no_time_to_final() -> None:
    events = [ev("final", 1, 12.3, "hello", (400, 2100)), ev("partial", 2, 14.0, "how", (3400, 4000))]
    got = analysis.match_utterances(UTTS, events)
    assert got[1].ttf_s is None and got[1].ttfp_s == pytest.approx(0.5) and got[1].finals == 0


def test_events_that_arrived_before_the_utterance_started_do_not_count_for_it() -> None:
    # The first final's span reaches into the second utterance's margin, but it arrived before that speech.
    events = [ev("final", 1, 12.3, "hello", (400, 3400)), ev("final", 2, 15.4, "how", (3450, 5000))]
    got = analysis.match_utterances(UTTS, events)
    assert got[1].ttf_s == pytest.approx(0.4) and got[1].finals == 1


def test_without_media_spans_the_kth_final_closes_the_kth_utterance() -> None:
    events = [
        ev("partial", 1, 11.0, "hel"),
        ev("final", 2, 12.5, "hello"),
        ev("partial", 3, 14.0, "ho"),
        ev("final", 4, 15.1, "how"),
    ]
    got = analysis.match_utterances(UTTS, events)
    assert [g.ttf_s for g in got] == [pytest.approx(0.5), pytest.approx(0.1)]
    assert [g.ttfp_s for g in got] == [pytest.approx(0.5), pytest.approx(0.5)]


def test_utterances_the_call_never_sent_have_no_numbers() -> None:
    got = analysis.match_utterances(
        [UtteranceTiming(500, 2000, None, None)], [ev("final", 1, 3.0, "x", (0, 9))]
    )
    assert got == [UtteranceResult(500, 2000, None, None, 0)]


def test_partials_that_are_prefixes_of_their_successor_are_stable_and_revisions_are_not() -> None:
    events = [
        ev("partial", 1, 1, "he", seg=1),
        ev("partial", 2, 2, "hello", seg=1),
        ev("partial", 3, 3, "hello  word", seg=1),  # revised to "world" in the final: unstable
        ev("final", 4, 4, "hello world", seg=1),
        ev("partial", 5, 5, "how", seg=2),
        ev("final", 6, 6, "how", seg=2),
        ev("partial", 7, 7, "dangling", seg=3),  # no successor: not counted
    ]
    assert analysis.partial_stability(events) == (1, 4)


def test_stability_without_segment_ids_groups_partials_up_to_each_final() -> None:
    events = [
        ev("partial", 1, 1, "a"),
        ev("final", 2, 2, "b"),
        ev("partial", 3, 3, "c"),
        ev("final", 4, 4, "cd"),
    ]
    assert analysis.partial_stability(events) == (1, 2)


def test_word_errors_ignore_case_and_punctuation() -> None:
    assert analysis.word_errors("Hello, World! How are you?", "hello world how are you") == (0, 5)
    assert analysis.word_errors("Hello world", "hello there world") == (1, 2)
    assert analysis.word_errors("hello world", "") == (2, 2)
    assert analysis.word_errors("Добрий день!", "добрий день") == (0, 2)


def test_final_text_joins_finals_in_sequence_order() -> None:
    events = [ev("final", 3, 0, "world"), ev("partial", 1, 0, "hel"), ev("final", 2, 0, "hello")]
    assert analysis.final_text(events) == "hello world"


def test_received_events_are_parsed_from_schema_v1_fields() -> None:
    fields = {"v": "1", "type": "final", "seq": "4", "segment_id": "2", "text": "hi", "start_ms": "10",
              "end_ms": "", "ts": "1700000000.5", "sip_call_id": "x"}  # fmt: skip
    e = ReceivedEvent.from_fields(fields, 3.0, "1-0")
    assert (e.type, e.seq, e.segment_id, e.start_ms, e.end_ms, e.ts, e.arrival) == (
        "final", 4, 2, 10, None, 1700000000.5, 3.0
    )  # fmt: skip


# --- summary and report --------------------------------------------------------------------------


def call(index: int, outcome: str = "completed", **kw: object) -> report.CallResult:
    base = {
        "index": index,
        "sip_call_id": f"c{index}",
        "lang": "en-US",
        "clips": ("a.wav",),
        "outcome": outcome,
    }
    return report.CallResult(**base, **kw)  # type: ignore[arg-type]


def test_summary_counts_outcomes_latencies_and_corpus_wer() -> None:
    u = UtteranceResult
    first = {
        "partials": 3,
        "finals": 3,
        "finals_outside": 1,
        "unstable_partials": 1,
        "partials_with_successor": 2,
    }
    calls = [
        call(0, setup_s=0.002, utterances=(u(0, 1, 0.2, 0.3, 1), u(2, 3, 0.1, 0.5, 1)), rtp_sent=100,
             rtp_planned=100, word_errors=1, ref_words=10, call_end_received=True, **first),
        call(1, setup_s=0.004, utterances=(u(0, 1, 0.3, None, 0),), rtp_sent=50, rtp_planned=50,
             word_errors=3, ref_words=10),
        call(2, "rejected", status=503, retry_after_s=5.0),
        call(3, "rejected", status=503, retry_after_s=9.0),
        call(4, "failed", detail="timeout"),
    ]  # fmt: skip
    s = report.summarize(calls, peak_active=3)
    assert (s.calls, s.completed, s.rejected, s.failed) == (5, 2, 2, 1)
    assert s.rejected_by_status == {"503": 2} and s.max_retry_after_s == 9.0
    assert s.ttf_s.n == 2 and s.ttf_s.p50 == pytest.approx(0.4) and s.ttfp_s.n == 3
    assert s.setup_s.n == 2 and s.utterances == 3 and s.utterances_without_final == 1
    assert (s.finals, s.finals_outside) == (3, 1)
    assert s.partial_instability == pytest.approx(0.5) and s.wer == pytest.approx(4 / 20)
    assert (s.rtp_sent, s.rtp_planned, s.calls_without_call_end, s.peak_active_calls) == (150, 150, 1, 3)


def test_summary_without_readback_does_not_claim_missing_finals() -> None:
    s = report.summarize(
        [call(0, setup_s=0.001, utterances=(UtteranceResult(0, 1, None, None, 0),))], readback=False
    )
    assert s.utterances_without_final is None and s.calls_without_call_end is None


def test_report_writers_produce_valid_json_markdown_and_png(tmp_path: Path) -> None:
    u = UtteranceResult
    calls = (
        call(0, setup_s=0.002, utterances=(u(0, 1, 0.2, 0.3, 1), u(2, 3, 0.25, 0.45, 1))),
        call(1, "failed"),
    )
    harness = report.HarnessStats(
        wall_s=10, cpu_s=0.5, cpu_percent=5, packets_sent=1000, packets_per_s=100,
        send_lateness_ms=analysis.Stats(1000, 0.2, 0.1, 0.5, 0.9, 0, 2.0), send_jitter_ms_mean=0.3,
        send_jitter_ms_max=0.6, sip_sent=6, sip_received=6, sip_parse_errors=0, sip_stray=0,
        sip_transport_errors=0, redis_entries_read=5, redis_errors=0, scrape_errors=0, event_loop="asyncio",
    )  # fmt: skip
    rep = report.Report(
        config={"target": "127.0.0.1:5060"}, started_at="now", summary=report.summarize(calls, 2),
        harness=harness, calls=calls, concurrency_series=((0.0, 1), (1.0, 2), (9.0, 0)),
    )  # fmt: skip
    report.write_json(rep, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["ttf_s"]["p50"] == pytest.approx(0.375) and len(data["calls"]) == 2
    assert not rep.ok
    assert plots.latency_cdf(rep, tmp_path / "cdf.png") and plots.batch_over_time(rep, tmp_path / "b.png")
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_markdown(rep, tmp_path / "r.md", ["cdf.png"])
    md = (tmp_path / "r.md").read_text()
    assert "| time to final | 2 | 375 |" in md and "![cdf.png](cdf.png)" in md and "`c1`" in md


# --- /metrics ------------------------------------------------------------------------------------

METRICS_A = """# TYPE ttg_encoder_batch_size histogram
ttg_encoder_batch_size_bucket{le="1.0"} 4
ttg_encoder_batch_size_bucket{le="+Inf"} 10
ttg_encoder_batch_size_sum 30
ttg_encoder_batch_size_count 10
# TYPE ttg_active_calls gauge
ttg_active_calls 3
# TYPE ttg_rtp_packets_received_total counter
ttg_rtp_packets_received_total{codec="PCMU"} 100
ttg_rtp_packets_received_total{codec="PCMA"} 50
"""


def test_metrics_are_parsed_and_labelled_samples_summed() -> None:
    v = parse_metrics(METRICS_A)
    assert v["ttg_encoder_batch_size_sum"] == 30 and v["ttg_active_calls"] == 3
    assert v["ttg_rtp_packets_received_total"] == 150


def test_batch_series_is_the_mean_batch_between_scrapes() -> None:
    a = Scrape(100.0, {"ttg_encoder_batch_size_sum": 30, "ttg_encoder_batch_size_count": 10})
    b = Scrape(
        102.0, {"ttg_encoder_batch_size_sum": 110, "ttg_encoder_batch_size_count": 30, "ttg_active_calls": 4}
    )
    c = Scrape(103.0, {"ttg_encoder_batch_size_sum": 110, "ttg_encoder_batch_size_count": 30})
    pts = batch_series([a, b, c], t0=99.0)
    assert (
        pts[0].t == 3.0
        and pts[0].mean_batch == 4.0
        and pts[0].steps_per_s == 10.0
        and pts[0].active_calls == 4
    )
    assert pts[1].mean_batch is None and pts[1].steps_per_s == 0.0


# --- capacity ------------------------------------------------------------------------------------


def test_capacity_levels_double_until_a_failure_then_bisect() -> None:
    assert capacity.next_level(1, None, 256, 1) == 2
    assert capacity.next_level(128, None, 200, 1) == 200
    assert capacity.next_level(200, None, 200, 1) is None
    assert capacity.next_level(32, 64, 256, 1) == 48
    assert capacity.next_level(47, 48, 256, 1) is None
    assert capacity.next_level(40, 48, 256, 8) is None


def test_a_level_starts_once_no_call_is_up_and_the_engine_takes_calls_again() -> None:
    assert capacity.settled({"ttg_active_calls": 0.0, "ttg_engine_overloaded": 0.0})
    assert not capacity.settled({"ttg_active_calls": 3.0, "ttg_engine_overloaded": 0.0})
    # The previous level's calls are gone but the overload guard still refuses new ones.
    assert not capacity.settled({"ttg_active_calls": 0.0, "ttg_engine_overloaded": 1.0})
    assert capacity.settled({})  # a gateway without these series is not waited for


async def test_the_wait_for_a_quiet_gateway_polls_its_metrics_until_the_overload_guard_clears() -> None:
    """A real /metrics endpoint that says "overloaded" twice, then not; then one that stays busy."""
    busy = "ttg_active_calls 0\nttg_engine_overloaded 1\n"
    pages = [busy, busy, busy.replace("overloaded 1", "overloaded 0")]
    polls = 0

    def page() -> str:
        nonlocal polls
        polls += 1
        return pages[min(polls, len(pages)) - 1]

    async with metrics_endpoint(page) as url:
        quiet, _ = await capacity.wait_until_settled(url, timeout_s=10.0, poll_s=0.01)
        assert quiet and polls == 3
        pages = ["ttg_active_calls 5\n"]
        quiet, waited = await capacity.wait_until_settled(url, timeout_s=0.1, poll_s=0.01)
        assert not quiet and waited >= 0.1
    # Nothing listening any more: no wait at all.
    quiet, _ = await capacity.wait_until_settled(url, timeout_s=10.0, poll_s=0.01)
    assert not quiet


def level_report(ttfs: list[float | None], failed: int = 0) -> report.Report:
    u = tuple(UtteranceResult(0, 1, 0.1, t, 1 if t is not None else 0) for t in ttfs)
    calls = [call(0, setup_s=0.001, utterances=u)] + [call(i + 1, "failed") for i in range(failed)]
    h = report.HarnessStats(0, 0, 0, 0, 0, analysis.Stats(0), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, "asyncio")
    return report.Report({}, "", report.summarize(calls), h, tuple(calls))


def test_a_level_holds_when_p95_is_within_the_bound_and_every_call_completed() -> None:
    ttfs: list[float | None] = [0.3] * 19 + [0.9]
    assert capacity.p95_with_missing(level_report(ttfs)) == pytest.approx(0.3)
    assert capacity.judge(level_report(ttfs), 0.5) == (True, "")
    assert capacity.judge(level_report([0.6] * 20), 0.5)[0] is False
    assert capacity.judge(level_report(ttfs, failed=1), 0.5) == (False, "1 of 2 calls not completed")


def test_missing_finals_count_as_infinitely_late_in_the_capacity_p95() -> None:
    ttfs: list[float | None] = [0.3] * 18 + [None, None]
    assert math.isinf(capacity.p95_with_missing(level_report(ttfs)))
    held, why = capacity.judge(level_report(ttfs), 10.0)
    assert not held and "without a final" in why
    assert capacity.p95_with_missing(level_report([0.3] * 19 + [None])) == pytest.approx(0.3)
    # Over the bound with a final missing: the reason says the missing one counted, since the report's p95
    # column (over the finals that came) reads lower than the p95 judged.
    assert capacity.judge(level_report([0.6] * 19 + [None]), 0.5) == (
        False,
        "p95 600 ms > bound (1 of 20 utterances without a final, counted as late)",
    )
    assert capacity.judge(level_report([0.6] * 20), 0.5) == (False, "p95 600 ms > bound")


def test_capacity_plot_is_written(tmp_path: Path) -> None:
    levels = tuple(
        report.CapacityLevel(n, level_report([0.2 + 0.01 * n] * 20).summary, n < 8, "") for n in (1, 2, 4, 8)
    )
    cap = report.CapacityReport(bound_s=0.5, baseline_p95_s=0.2, capacity=4, levels=levels)
    assert plots.latency_vs_concurrency(cap, tmp_path / "c.png")
    report.write_capacity_markdown(cap, tmp_path / "c.md")
    assert "Highest concurrency that held: **4**" in (tmp_path / "c.md").read_text()
    assert np.isfinite(json.loads(json.dumps(cap.to_dict()))["bound_s"])


def test_live_view_renders_the_run_counters() -> None:
    import io

    from rich.console import Console

    from tools.replay.progress import LiveView, Snapshot

    out = io.StringIO()
    with LiveView(Console(file=out, width=160, force_terminal=False)) as view:
        view.update(Snapshot(12.0, 7, 9, 20, 2, 1, 0, 350.0, 14, 5, 1.5))
    text = out.getvalue()
    assert "active" in text and "RTP pps" in text and "350" in text and "9/20" in text and "1.5 ms" in text
