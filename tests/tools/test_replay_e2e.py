"""The whole tool in process, as the gateway's acceptance test will drive it: calls to a sipp UAS, the
events a gateway would publish written into a real Redis by a stand-in that watches what the replay
sent, and the report checked number by number against what the calls did. Plus the `ttg replay`
command line, run as a subprocess."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.events import CallEvent, to_fields
from tests.fixtures.replay import SippUas, metrics_endpoint, write_burst_wav
from tools.ports import free_port
from tools.replay import LoadConfig, MediaConfig, ReplayConfig, ReplayError, run_replay_async
from tools.replay import cli as replay_cli

pytestmark = [pytest.mark.sipp, pytest.mark.redis]
STREAM = "ttg:transcripts"
DELAY_S = 0.15  # the stand-in publishes each final this long after the utterance's last packet


async def fake_gateway(
    run_holder: list[Any],
    url: str,
    wrong_word_call: int = -1,
    delay: Callable[[Any], float] = lambda run: DELAY_S,
) -> None:
    """Publishes call_start, a partial and a final per utterance, and call_end, like the gateway's sink,
    for every run put in `run_holder`; a final goes out `delay(run)` after the utterance's last packet.
    Call `wrong_word_call` gets one substituted word in its first final (a known WER)."""
    r = redis.Redis.from_url(url, decode_responses=True)
    seqs: dict[tuple[str, str], int] = {}
    done: set[tuple[str, str, int | str]] = set()

    def publish(sip_call_id: str, leg: str, **kw: Any) -> None:
        key = (sip_call_id, leg)
        seqs[key] = seqs.get(key, 0) + 1
        ev = CallEvent(call_id="gw-" + sip_call_id, sip_call_id=sip_call_id, leg=leg, **kw)
        r.xadd(STREAM, to_fields(ev, seqs[key]))  # type: ignore[arg-type]

    while True:
        now = time.monotonic()
        for run, rec in [(r, rec) for r in run_holder for rec in r.records]:
            cid = rec.sip_call_id
            first = rec.legs[0].name or "caller"
            if rec.legs[0].stream is None:
                continue
            if (cid, first, "start") not in done:
                done.add((cid, first, "start"))
                publish(cid, first, type="call_start", lang=rec.lang)
            for leg in rec.legs:
                name, stream = leg.name or "caller", leg.stream
                if stream is None:
                    continue
                words = (leg.clips[0].reference or "").split()
                for i, (u, mark) in enumerate(zip(stream.plan.utterances, stream.marks, strict=True)):
                    if mark.start_t is not None and (cid, name, f"p{i}") not in done:
                        done.add((cid, name, f"p{i}"))
                        publish(
                            cid,
                            name,
                            type="partial",
                            segment_id=i,
                            text=words[i][:2],
                            start_ms=u.start_ms,
                            end_ms=u.start_ms + 200,
                        )
                    if (
                        mark.end_t is not None
                        and now >= mark.end_t + delay(run)
                        and (cid, name, i) not in done
                    ):
                        done.add((cid, name, i))
                        text = "wrong" if (rec.index == wrong_word_call and i == 0) else words[i]
                        publish(
                            cid,
                            name,
                            type="final",
                            segment_id=i,
                            text=text,
                            start_ms=u.start_ms,
                            end_ms=u.end_ms + 100,
                        )
            if rec.outcome != "pending" and (cid, first, "end") not in done:
                done.add((cid, first, "end"))
                sent = rec.legs[0].stream.sent
                stats = {"reason": "bye", "rtp_packets": str(sent), "rtp_lost": "0"}
                publish(cid, first, type="call_end", extra=stats)
        await asyncio.sleep(0.005)


@pytest.fixture
def audio_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "audio"
    folder.mkdir()
    write_burst_wav(folder / "a.wav", [(200, 900), (1700, 2300)], 2500, "alpha bravo")
    return folder


async def test_report_numbers_match_what_the_calls_did(
    sipp_uas: Callable[..., SippUas], redis_url: str, audio_dir: Path, tmp_path: Path
) -> None:
    uas = sipp_uas(calls=2)
    cfg = ReplayConfig(
        target=("127.0.0.1", uas.port),
        audio_dir=audio_dir,
        media=MediaConfig(lead_ms=100, tail_ms=400),
        load=LoadConfig(calls=2, cps=20),
        redis_url=redis_url,
        metrics_url=None,
        drain_s=5.0,
        call_id_prefix="e2e",
        out_dir=tmp_path / "out",
    )
    holder: list[Any] = []
    gateway = asyncio.create_task(fake_gateway(holder, redis_url, wrong_word_call=1))
    try:
        rep = await run_replay_async(cfg, on_run=holder.append)
    finally:
        gateway.cancel()
    run = holder[0]
    s = rep.summary
    assert (s.calls, s.completed, s.failed, s.calls_without_call_end) == (2, 2, 0, 0)
    assert s.utterances == 4 and s.utterances_without_final == 0 and s.finals == 4 and s.partials == 4
    for c, rec in zip(rep.calls, run.records, strict=True):
        assert c.sip_call_id == f"e2e-{c.index:06d}@127.0.0.1" and c.call_end_received
        assert c.gateway_rtp_packets == c.rtp_sent == c.rtp_planned and c.gateway_lang == c.lang == "en-US"
        finals = [e for e in run.reader.events[c.sip_call_id] if e.type == "final"]
        partials = [e for e in run.reader.events[c.sip_call_id] if e.type == "partial"]
        for u, mark, fin, part in zip(c.utterances, rec.legs[0].stream.marks, finals, partials, strict=True):
            # TTF is exactly the final's arrival minus when the last speech packet left...
            assert u.ttf_s == pytest.approx(fin.arrival - mark.end_t, abs=1e-9)
            assert u.ttfp_s == pytest.approx(part.arrival - mark.start_t, abs=1e-9)
            assert u.ttf_s >= DELAY_S  # ...and no final can beat the stand-in's delay
    assert s.ttf_s.n == 4 and s.ttf_s.min is not None and s.ttf_s.min >= DELAY_S
    assert s.gateway_rtp_packets == s.rtp_sent_to_reporting_calls == s.rtp_sent and s.lang_mismatches == 0
    assert s.wer == pytest.approx(1 / 4)  # one substituted word in 2 calls × 2 reference words
    assert [c.word_errors for c in rep.calls] == [0, 1]
    assert s.partial_instability == 0.25  # the partial "al" of the final "wrong" was not a prefix of it
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["summary"]["completed"] == 2 and len(data["calls"]) == 2
    assert (tmp_path / "out" / "latency_cdf.png").stat().st_size > 1000
    assert "| time to final | 4 |" in (tmp_path / "out" / "report.md").read_text()
    assert uas.wait() == 0, uas.errors()


async def test_an_unreachable_redis_is_a_clear_error_before_any_call(audio_dir: Path) -> None:
    cfg = ReplayConfig(
        target=("127.0.0.1", 5060),
        audio_dir=audio_dir,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        metrics_url=None,
    )
    with pytest.raises(ReplayError, match="not reachable"):
        await run_replay_async(cfg)


async def test_find_capacity_reports_the_highest_concurrency_that_held(
    sipp_uas: Callable[..., SippUas], redis_url: str, audio_dir: Path, tmp_path: Path
) -> None:
    """A stand-in gateway that answers in 50 ms up to 2 concurrent calls and in 600 ms above: levels
    1 and 2 hold, 4 fails, bisection tries 3 (fails), so the capacity is 2."""
    from tools.replay.audio import load_library
    from tools.replay.capacity import find_capacity_async

    uas = sipp_uas(calls=1 + 2 + 4 + 3)
    cfg = ReplayConfig(
        target=("127.0.0.1", uas.port),
        audio_dir=audio_dir,
        media=MediaConfig(lead_ms=100, tail_ms=400),
        load=LoadConfig(calls=1, cps=50),
        redis_url=redis_url,
        metrics_url=None,
        drain_s=5.0,
    )
    holder: list[Any] = []
    gateway = asyncio.create_task(
        fake_gateway(holder, redis_url, delay=lambda run: 0.05 if run.cfg.load.calls <= 2 else 0.6)
    )
    try:
        cap = await find_capacity_async(
            cfg, load_library(audio_dir, 600), margin_s=0.2, out_dir=tmp_path / "cap", log=lambda _: None,
            on_run=holder.append,
        )  # fmt: skip
    finally:
        gateway.cancel()
    assert [lv.concurrency for lv in cap.levels] == [1, 2, 3, 4]
    assert [lv.held for lv in cap.levels] == [True, True, False, False] and cap.capacity == 2
    assert cap.baseline_p95_s is not None and cap.bound_s == pytest.approx(cap.baseline_p95_s + 0.2)
    assert all(lv.summary.completed == lv.concurrency for lv in cap.levels)
    assert (tmp_path / "cap" / "latency_vs_concurrency.png").exists()
    assert json.loads((tmp_path / "cap" / "capacity.json").read_text())["capacity"] == 2
    assert (tmp_path / "cap" / "level-0004" / "report.json").exists()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_command_line_options_become_the_run_config(tmp_path: Path) -> None:
    args = parse(
        "--target", "sip:ttg@10.0.0.5:5080", "--generate", "3", "--calls", "8", "--cps", "2", "--ramp", "10",
        "--lang", "en-US:0.7,uk-UA:0.3", "--loss", "0.02", "--jitter-ms", "30", "--reorder", "0.01",
        "--duplicate", "0.005", "--codec", "pcma", "--ptime", "30", "--header", "X-Tenant: acme",
        "--rtp-ports", "30000-30100", "--out", str(tmp_path), "--no-metrics", "--transport", "tcp",
    )  # fmt: skip
    cfg = replay_cli.config_from_args(args)
    assert cfg.target == ("10.0.0.5", 5080) and cfg.transport == "tcp"
    assert (cfg.load.calls, cfg.load.cps, cfg.load.ramp_s) == (8, 2.0, 10.0)
    assert cfg.lang.assign(10).count("uk-UA") == 3 and cfg.headers == (("X-Tenant", "acme"),)
    assert (cfg.impairments.loss, cfg.impairments.jitter_ms, cfg.impairments.reorder) == (0.02, 30.0, 0.01)
    assert (cfg.media.codec, cfg.media.ptime_ms) == ("PCMA", 30)
    assert (cfg.rtp_port_min, cfg.rtp_port_max, cfg.metrics_url) == (30000, 30100, None)
    assert cfg.audio_dir == tmp_path / "audio" and cfg.generate == 3


def test_command_line_rejects_bad_values() -> None:
    with pytest.raises(SystemExit):
        parse("--lang", "en-US:-1")
    with pytest.raises(SystemExit):
        parse("--target", "host:port")


def test_ttg_replay_command_runs_calls_and_writes_the_report(
    sipp_uas: Callable[..., SippUas], audio_dir: Path, tmp_path: Path
) -> None:
    uas = sipp_uas(calls=1)
    out = tmp_path / "cli-out"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "replay", "--target", f"127.0.0.1:{uas.port}", "--audio",
         str(audio_dir), "--no-redis", "--no-metrics", "--tail-ms", "200", "--out", str(out)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "completed 1" in proc.stdout
    assert json.loads((out / "report.json").read_text())["summary"]["completed"] == 1


async def test_the_scraper_follows_a_live_metrics_endpoint() -> None:
    from tools.replay.scrape import MetricsScraper, batch_series

    state = {"steps": 0}

    def page() -> str:
        state["steps"] += 10  # ten encoder steps of 4 chunks between scrapes
        n = state["steps"]
        return f"ttg_encoder_batch_size_sum {4 * n}\nttg_encoder_batch_size_count {n}\nttg_active_calls 4\n"

    async with metrics_endpoint(page) as url:
        scraper = MetricsScraper(url, 0.05, time.monotonic)
        task = asyncio.create_task(scraper.run())
        try:
            while len(scraper.scrapes) < 4:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    points = batch_series(scraper.scrapes, scraper.scrapes[0].t)
    assert len(points) >= 3 and all(p.mean_batch == 4.0 and p.active_calls == 4 for p in points)
    assert scraper.errors == 0


async def test_an_unreachable_metrics_endpoint_is_counted_not_fatal() -> None:
    from tools.replay.scrape import MetricsScraper

    scraper = MetricsScraper(f"http://127.0.0.1:{free_port()}/metrics", 0.05, time.monotonic)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await scraper.scrape_once(session)
    assert scraper.errors == 1 and scraper.scrapes == []
