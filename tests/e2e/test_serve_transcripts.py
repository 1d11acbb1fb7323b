"""Issue 6, acceptance 2: a call through SIP/RTP/G.711 into `ttg serve` yields the final transcripts
that `ttg transcribe` gives for the same G.711-decoded audio with the same bundle.

What must match for the comparison to be exact, and how the test makes it so:
- The audio handed to the engine. The gateway decodes each packet's µ-law and upsamples 8 → 16 kHz
  with `gateway.audio.pipeline.AudioPipeline` (soxr, overlap-save, 80 ms blocks), one `append_codes`
  per packet. soxr's output depends on the segment lengths it is run over at the level of float
  rounding (~1e-7), so the reference audio is made by the same pipeline fed packet by packet — the
  same path, bit for bit — and handed to `ttg transcribe` as a 32-bit float WAV (no requantization).
- Silence the gateway adds. Concealment of lost packets and idle fill (silence in real time while no
  packet arrives) put timing-dependent silence into the timeline; on loopback nothing is lost, and idle
  fill is off in this test (TTG_RTP__IDLE_FILL_AFTER_MS=0), so a sender stall on a loaded machine cannot
  add any. call_end proves it: `rtp_lost` 0, `rtp_concealed_ms` 0, `audio_ms` = the file's length.
  At hang-up the gateway appends nothing but the resampler's tail (the signal continued by zeros,
  exactly 2x the input samples), which the reference pipeline's `finish()` produces the same way.
- Segmentation. Both run the engine with the same endpointing settings (the defaults), so the same
  audio gives the same segments: the test compares every final's segment id, text and media times,
  not just the concatenated text. Tokens: Redis events carry text, not token ids; equal text per
  segment from the same vocabulary is the observable form of equal tokens.
- No chunk dropped: the daemon keeps up with one call in real time (call_end `asr_dropped_chunks` 0).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import REPO, SIPP_DATA, STREAM, Serve, Speech, gateway_pcm, sipp_calls, until

pytestmark = [pytest.mark.sipp, pytest.mark.redis, pytest.mark.slow]


def transcribe_finals(bundle: Path, wav: Path) -> list[dict[str, object]]:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway", "transcribe", "--model", str(bundle), "--json", str(wav)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["event"] == "StreamEnded" and events[-1]["reason"] == "finished"
    return [e for e in events if e["event"] == "TranscriptEvent" and e["kind"] == "final"]


@pytest.mark.parametrize("intake_tick_ms", ["0", "5"], ids=["loop-readers", "rtp-intake"])
async def test_a_sip_call_yields_the_finals_ttg_transcribe_gives_for_the_same_decoded_audio(
    serve: Callable[..., Serve],
    tiny_bundle: Path,
    redis_url: str,
    two_sentences: Speech,
    tmp_path: Path,
    intake_tick_ms: str,
) -> None:
    """Also with the batched RTP intake (TTG_RTP__INTAKE_TICK_MS): the same timeline, the same finals."""
    speech = two_sentences
    env = {"TTG_RTP__IDLE_FILL_AFTER_MS": "0", "TTG_RTP__INTAKE_TICK_MS": intake_tick_ms}
    gw = serve(bundle=tiny_bundle, redis_url=redis_url, env=env)
    await asyncio.to_thread(gw.start)
    result = await asyncio.to_thread(
        sipp_calls, gw.sip_port, SIPP_DATA / "uac_stream.xml", tmp_path / "sipp", speech=speech,
        hold_ms=speech.ms + 1500, timeout_s=speech.ms / 1000 + 30,
    )  # fmt: skip
    assert result.stats.get("SuccessfulCall(C)") == 1, result.stderr + result.errors

    def ended() -> bool:
        return any(f["type"] == "call_end" for _, f in read_stream(redis_url, STREAM))

    await until(ended, "call_end in Redis", timeout_s=30)
    entries = read_stream(redis_url, STREAM)
    report = audit(entries)
    assert not report.problems, report.problems
    ((call_id, _),) = report.calls
    events = report.calls[(call_id, "caller")]
    end = events[-1]
    assert end["type"] == "call_end" and end["reason"] == "bye" and end["asr"] == "finished"
    # The timeline is exactly the file: nothing lost, concealed or dropped on the way.
    assert (end["rtp_packets"], end["rtp_lost"], end["rtp_concealed_ms"]) == (
        str(speech.samples // 160),
        "0",
        "0",
    )
    assert end["audio_ms"] == end["rtp_audio_ms"] == str(speech.ms)
    assert end["asr_dropped_chunks"] == "0"
    served = [(int(f["segment_id"]), f["text"], int(f["start_ms"]), int(f["end_ms"])) for f in events
              if f["type"] == "final"]  # fmt: skip

    pcm = gateway_pcm(speech.codes)
    assert len(pcm) == 2 * speech.samples
    wav = tmp_path / "decoded.wav"
    sf.write(str(wav), pcm, 16000, subtype="FLOAT")
    assert np.array_equal(sf.read(str(wav), dtype="float32")[0], pcm)  # the file holds these exact floats
    finals = await asyncio.to_thread(transcribe_finals, tiny_bundle, wav)
    expected = [(int(f["segment_id"]), str(f["text"]), int(f["start_ms"]), int(f["end_ms"])) for f in finals]  # type: ignore[call-overload]

    assert len(expected) >= 2, "two sentences with a pause between them should give two segments"
    assert served == expected
    assert [f["lang"] for f in events if f["type"] == "final"] == [
        f["detected_language"] or "en-US" for f in finals
    ]
