"""SIPREC recording sessions against `ttg serve`: each party of a recorded call is its own leg.

Offers are shaped like each vendor's (tools/replay/siprec.py, from the research notes' captures) and
sent over UDP and TCP by `ttg replay --siprec`, with different espeak-ng speech on the two legs. For
each leg, the finals the gateway publishes must be the ones `ttg transcribe`'s engine gives for that
leg's audio alone (segment ids, text and media times, as in test_serve_transcripts.py); for that the
gateway runs without idle fill (no timing-dependent silence), with encoder batches of one and the
per-stream decoder, so that no leg's arithmetic depends on what the other leg or call is doing.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from asr_core.api import TranscriptEvent
from asr_core.model import AsrModel
from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import STREAM, Serve, gateway_pcm, port_block
from tools.replay import LoadConfig, MediaConfig, ReplayConfig, run_replay_async
from tools.replay.siprec import VENDORS
from tools.transcribe import transcribe

pytestmark = [pytest.mark.redis, pytest.mark.slow]

# The leg's arithmetic alone (see the module docstring); no silence that depends on timing.
EXACT = {"TTG_RTP__IDLE_FILL_AFTER_MS": "0", "TTG_ENCODER__MAX_BATCH": "1", "TTG_DECODER__MODE": "workers"}


def replay_config(gw: Serve, tmp_path: Path, redis_url: str, **kw: Any) -> ReplayConfig:
    calls = kw.pop("calls", 3)
    total = kw.pop("total", len(VENDORS))
    rtp_base = port_block(4 * calls + 4)
    return ReplayConfig(
        target=("127.0.0.1", gw.sip_port),
        generate=4,  # four espeak-ng clips: the two legs of a call get different ones
        audio_dir=tmp_path / "audio",
        media=MediaConfig(lead_ms=200, tail_ms=1500),
        load=LoadConfig(calls=calls, total=total, cps=5),
        rtp_port_min=rtp_base,
        rtp_port_max=rtp_base + 4 * calls + 2,
        redis_url=redis_url,
        stream=STREAM,
        metrics_url=None,
        drain_s=30.0,
        siprec="all",
        out_dir=tmp_path / "report",
        **kw,
    )


def reference_finals(model: AsrModel, pcm: np.ndarray, path: Path) -> list[tuple[int, str, int, int]]:
    """The finals of one stream of exactly this audio through the engine, alone."""
    sf.write(str(path), pcm, 16000, subtype="FLOAT")
    (events,) = transcribe(model, [path], [pcm], language="en-US", lookahead=None, decoder_mode="workers")
    return [
        (e.segment_id, e.text, e.start_ms, e.end_ms)
        for e in events
        if isinstance(e, TranscriptEvent) and e.kind == "final"
    ]


# Both transports, and both event loops the daemon runs on (uvloop, and asyncio's own).
@pytest.mark.parametrize(("transport", "uvloop"), [("udp", "true"), ("tcp", "false")])
async def test_every_vendors_recording_session_gives_each_leg_the_transcript_of_its_own_audio(
    serve: Callable[..., Serve],
    tiny_bundle: Path,
    redis_url: str,
    tmp_path: Path,
    transport: str,
    uvloop: str,
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env={**EXACT, "TTG_DAEMON__UVLOOP": uvloop})
    await asyncio.to_thread(gw.start)
    holder: list[Any] = []
    cfg = replay_config(gw, tmp_path, redis_url, transport=transport, call_id_prefix=f"rec-{transport}")
    rep = await run_replay_async(cfg, on_run=holder.append)
    run = holder[0]
    s = rep.summary
    assert (s.calls, s.completed, s.legs) == (len(VENDORS), len(VENDORS), 2 * len(VENDORS)), [
        (c.vendor, c.outcome, c.detail) for c in rep.calls if c.outcome != "completed"
    ]
    assert s.calls_without_call_end == 0 and s.events_on_other_legs == 0

    entries = read_stream(redis_url, STREAM)
    report = audit(entries)
    assert not report.problems, report.problems
    starts = {f["sip_call_id"]: f for _, f in entries if f["type"] == "call_start"}
    per_call = Counter((f["sip_call_id"], f["type"]) for _, f in entries)
    model = AsrModel.load(tiny_bundle, "auto")
    for rec in run.records:
        start = starts[rec.sip_call_id]
        call_id = start["call_id"]
        names = [leg.name for leg in rec.legs]
        # One call_start and one call_end per call, on the first leg; the legs as the metadata says.
        assert per_call[(rec.sip_call_id, "call_start")] == per_call[(rec.sip_call_id, "call_end")] == 1
        assert json.loads(start["legs"]) == names and start["leg"] == names[0]
        assert start["recording"] == "siprec"
        people = {p["id"]: p for p in json.loads(start["participants"])}
        for leg in rec.legs:
            sender = next(p for p in people.values() if leg.name in p["legs"])
            assert sender["name"].startswith(("Customer", "Agent")) and sender["aor"]
        end = report.calls[(call_id, names[0])][-1]
        assert end["type"] == "call_end" and end["reason"] == "bye"
        stats = json.loads(end["legs"])
        assert sorted(stats) == sorted(names)
        for leg in rec.legs:
            stream = leg.stream
            assert stream is not None and stream.done
            mine = stats[leg.name]
            # The leg's packets reached the leg in order, nothing concealed, no chunk dropped. The last
            # few (silence) may still be on their way when the BYE closes the port on a loaded machine:
            # the reference is then the packets that did arrive.
            received = int(mine["rtp_packets"])
            assert stream.sent == stream.n_packets and stream.n_packets - 5 <= received <= stream.n_packets
            assert (mine["rtp_lost"], mine["rtp_concealed_ms"], mine["asr"], mine["asr_dropped_chunks"]) == (
                "0", "0", "finished", "0",
            ), (rec.vendor, leg.name)  # fmt: skip
            codes = b"".join(stream.payload(k) for k in range(received))
            pcm = gateway_pcm(codes, rec.codec)
            expected = await asyncio.to_thread(
                reference_finals, model, pcm, tmp_path / f"{rec.index}-{leg.label}.wav"
            )
            served = [
                (int(f["segment_id"]), f["text"], int(f["start_ms"]), int(f["end_ms"]))
                for f in report.calls[(call_id, leg.name)]
                if f["type"] == "final"
            ]
            assert expected, f"{rec.vendor}/{leg.name}: the reference gave no final"
            assert served == expected, (rec.vendor, leg.name)
        assert int(end["rtp_packets"]) == sum(int(stats[n]["rtp_packets"]) for n in names)
    assert gw.stop() == 0


async def test_replay_of_twenty_recording_sessions_transcribes_forty_legs(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, tmp_path: Path
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, max_calls=40)
    await asyncio.to_thread(gw.start)
    cfg = replay_config(gw, tmp_path, redis_url, calls=20, total=20, call_id_prefix="rec20")
    rep = await run_replay_async(cfg)
    s = rep.summary
    assert (s.calls, s.completed, s.legs, s.legs_with_finals) == (20, 20, 40, 40), [
        (c.vendor, c.leg, c.outcome, c.detail, c.finals)
        for c in rep.calls
        if c.outcome != "completed" or not c.finals
    ]
    assert s.calls_without_call_end == 0 and s.events_on_other_legs == 0
    for leg in rep.calls:
        # Each leg's own counters came back (call_end's legs object). How many of its datagrams the
        # gateway read depends on the machine keeping up with 40 real-time streams; a starved gateway
        # loses some in the kernel, and the report shows how many.
        assert leg.rtp_sent == leg.rtp_planned and leg.gateway_rtp_packets is not None, (leg.vendor, leg.leg)
        assert 0 < leg.gateway_rtp_packets <= leg.rtp_sent, (leg.vendor, leg.leg)
        assert len(leg.utterances) == 2 and leg.reference  # two sentences per clip, with a reference
    assert s.wer is not None and s.wer_ref_words == sum(len((c.reference or "").split()) for c in rep.calls)
    assert gw.metric("ttg_calls_total", result="admitted") == 20
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Legs" in markdown and "legs: **40**, with finals 40" in markdown
    assert gw.stop() == 0
