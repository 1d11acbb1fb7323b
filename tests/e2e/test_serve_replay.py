"""`ttg replay --calls 20` (its in-process API) against `ttg serve` completes with zero failed calls and
writes its report files; the report's numbers are checked against what the calls did, as the gateway saw
them (its events in Redis and its /metrics)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import STREAM, Serve
from tools.ports import port_block
from tools.replay import LoadConfig, MediaConfig, ReplayConfig, run_replay_async

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]
CALLS = 20


def _config(gw: Serve, tmp_path: Path, redis_url: str, *, calls: int, cps: float, **kw: Any) -> ReplayConfig:
    """`calls` concurrent calls at `cps` against `gw`, of espeak-ng clips of two sentences each, 1.2 s
    apart, with their references."""
    rtp_base = port_block(4 * calls + 2)
    return ReplayConfig(
        target=("127.0.0.1", gw.sip_port),
        audio_dir=tmp_path / "audio",
        media=MediaConfig(lead_ms=200, tail_ms=1500),
        load=LoadConfig(calls=calls, cps=cps),
        rtp_port_min=rtp_base,
        rtp_port_max=rtp_base + 4 * calls,
        redis_url=redis_url,
        stream=STREAM,
        drain_s=20.0,
        **kw,
    )


async def test_replay_of_twenty_concurrent_calls_against_the_daemon_reports_what_happened(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, tmp_path: Path
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url)
    await asyncio.to_thread(gw.start)
    out = tmp_path / "report"
    metrics_url = f"http://127.0.0.1:{gw.http_port}/metrics"
    cfg = _config(
        gw, tmp_path, redis_url, calls=CALLS, cps=10, generate=4, metrics_url=metrics_url,
        call_id_prefix="e2e", out_dir=out,
    )  # fmt: skip
    rep = await run_replay_async(cfg)
    s = rep.summary

    # Zero failed calls; every call answered, carried its audio and got its call_end.
    assert (s.calls, s.completed, s.failed, s.rejected, s.stopped) == (CALLS, CALLS, 0, 0, 0), [
        (c.outcome, c.detail) for c in rep.calls if c.outcome != "completed"
    ]
    assert s.calls_without_call_end == 0 and s.lang_mismatches == 0
    assert s.peak_active_calls == CALLS
    assert s.setup_s.n == CALLS and s.setup_s.max is not None and s.setup_s.max < 5.0

    # The report's numbers against the gateway's own account of the same calls.
    entries = read_stream(redis_url, STREAM)
    by_sip = {f["sip_call_id"]: f["call_id"] for _, f in entries if f["type"] == "call_start"}
    assert sorted(by_sip) == sorted(c.sip_call_id for c in rep.calls)
    report = audit(entries, ended=by_sip.values())
    assert not report.problems, report.problems
    kinds = {sip: Counter(f["type"] for f in report.calls[(cid, "caller")]) for sip, cid in by_sip.items()}
    for c in rep.calls:
        end = report.calls[(by_sip[c.sip_call_id], "caller")][-1]
        assert c.call_end_received and end["type"] == "call_end" and end["reason"] == "bye"
        assert c.rtp_sent == c.rtp_planned == c.gateway_rtp_packets == int(end["rtp_packets"])
        assert c.gateway_rtp_lost == 0
        assert (c.finals, c.partials) == (kinds[c.sip_call_id]["final"], kinds[c.sip_call_id]["partial"])
        # Two sentences per clip, as sent, each named after its clip (the same sentence in every call).
        assert [u.sentence for u in c.utterances] == [f"{clip}#{k}" for clip in c.clips for k in (0, 1)]
    assert s.finals == report.counts["final"] and s.partials == report.counts["partial"]
    # A call whose audio waits more than the scheduler's queue bound before the encoder has chunks dropped:
    # the gateway's answer to a CPU it cannot keep up with. How many depends on what else the machine
    # runs, not on the calls, so every drop must be accounted for, whether there are any or not: in the
    # call_end of a call whose stream finished (one still finishing at the end, asr=timeout, has none).
    ends = [report.calls[(by_sip[c.sip_call_id], "caller")][-1] for c in rep.calls]
    assert {e["asr"] for e in ends} <= {"finished", "timeout"}
    reported = sum(int(e["asr_dropped_chunks"]) for e in ends if e["asr"] == "finished")
    dropped = gw.metric("ttg_asr_chunks_dropped_total")
    assert reported == dropped if all(e["asr"] == "finished" for e in ends) else reported <= dropped
    assert s.rtp_sent == s.gateway_rtp_packets == gw.metric("ttg_rtp_packets_received_total", codec="PCMU")
    assert gw.metric("ttg_calls_total", result="admitted") == CALLS
    # The offer's rtcp-mux was taken: each call heard the gateway's receiver reports on its RTP socket.
    assert s.completed_without_rtcp == 0
    assert CALLS <= s.rtcp_received <= gw.metric("ttg_rtcp_reports_sent_total")
    assert s.utterances == 2 * CALLS
    assert s.utterances_without_final is not None
    assert s.ttf_s.n + s.utterances_without_final == s.utterances
    assert s.wer is not None and s.wer_ref_words == sum(len((c.reference or "").split()) for c in rep.calls)
    assert rep.batch_series, "the replay scraped the gateway's /metrics"
    assert max(p.active_calls for p in rep.batch_series if p.active_calls is not None) <= CALLS

    # Report files written, and the JSON says what the object says.
    data = json.loads((out / "report.json").read_text())
    assert data["summary"]["completed"] == CALLS and len(data["calls"]) == CALLS
    assert data["summary"]["rtp_sent"] == s.rtp_sent
    assert [u["sentence"] for u in data["calls"][0]["utterances"]] == [
        u.sentence for u in rep.calls[0].utterances
    ]
    assert (out / "report.md").stat().st_size > 500
    assert (out / "latency_cdf.png").stat().st_size > 1000
    assert (out / "batch_size.png").stat().st_size > 1000
    assert gw.stop() == 0


async def test_a_ramp_past_the_adaptive_call_limit_is_answered_503_and_the_admitted_calls_are_whole(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, tmp_path: Path
) -> None:
    """A gateway whose call limit starts at 4 streams gets 12 calls in about a second: steered by the lag
    alone (no load bound, so no fast start), the limit opens by at most 2 streams a second while it is
    used, so part of the ramp is refused with 503 + Retry-After (counted as rejected_limit), and the calls
    it let in are transcribed whole."""
    calls = 12
    env = {"TTG_SIP__CALL_LIMIT_START": "4", "TTG_SIP__CALL_LIMIT_LOAD": "0"}
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env=env)
    await asyncio.to_thread(gw.start)
    assert gw.readyz()[1]["call_limit"] == 4
    cfg = _config(gw, tmp_path, redis_url, calls=calls, cps=12, generate=2, call_id_prefix="limit")
    rep = await run_replay_async(cfg)
    s = rep.summary
    assert s.rejected >= 1 and s.completed + s.rejected == calls and s.failed == 0, [
        (c.outcome, c.detail) for c in rep.calls
    ]
    assert gw.metric("ttg_calls_total", result="rejected_limit") == s.rejected
    assert gw.metric("ttg_calls_total", result="admitted") == s.completed
    assert gw.metric("ttg_asr_chunks_dropped_total") == 0
    assert s.calls_without_call_end == 0
    assert all(c.finals for c in rep.calls if c.outcome == "completed")
    assert gw.stop() == 0
