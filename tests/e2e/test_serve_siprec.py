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
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from asr_core.api import TranscriptEvent
from asr_core.model import AsrModel
from gateway.rtp.sender import RtpSender
from gateway.sink.audit import audit, read_stream
from tests.e2e.conftest import STREAM, Serve, Speech, gateway_pcm, until
from tools.ports import port_block
from tools.replay import LoadConfig, MediaConfig, ReplayConfig, run_replay_async, sdp, sipmsg
from tools.replay.siprec import VENDORS, build_offer
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


# Both transports, and both event loops the daemon runs on (uvloop, the default, carries TCP).
@pytest.mark.parametrize(("transport", "uvloop"), [("udp", "false"), ("tcp", "true")])
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


# --- what a broken or changing SRC gets ------------------------------------------------------------------


class RawSip:
    """A SIP client over one TCP connection, written out by hand: requests as text, responses parsed."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.local = self.sock.getsockname()
        self.buf = b""
        self.n = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, method: str, headers: dict[str, str], body: bytes = b"", cseq: int = 1) -> None:
        self.n += 1
        host, port = self.local
        lines = [
            f"{method} sip:ttg@127.0.0.1 SIP/2.0",
            f"Via: SIP/2.0/TCP {host}:{port};branch=z9hG4bK-raw-{self.n}-{time.monotonic_ns()}",
            "Max-Forwards: 70",
            f"CSeq: {cseq} {method}",
            *(f"{k}: {v}" for k, v in headers.items()),
            f"Content-Length: {len(body)}",
        ]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)

    def final(self) -> sipmsg.SipMessage:
        """The next final response (1xx skipped)."""
        while True:
            while b"\r\n\r\n" not in self.buf:
                self.buf += self.sock.recv(65536)
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            while len(rest) < length:
                rest += self.sock.recv(65536)
            message, self.buf = sipmsg.parse(head + b"\r\n\r\n" + rest[:length]), rest[length:]
            if message.status is not None and message.status >= 200:
                return message


def invite_headers(call_id: str, content_type: str, **extra: str) -> dict[str, str]:
    return {
        "From": f"<sip:src@127.0.0.1>;tag=src-{call_id.split('@')[0]}",
        "To": "<sip:ttg@127.0.0.1>",
        "Call-ID": call_id,
        "Contact": "<sip:src@127.0.0.1;transport=tcp>;+sip.src",
        "Require": "siprec",
        "Content-Type": content_type,
        **extra,
    }


async def test_a_broken_src_gets_4xx_and_a_changing_one_keeps_both_legs_and_their_finals(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, short_speech: Speech
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url)
    await asyncio.to_thread(gw.start)
    rtp = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for s in rtp:
        s.bind(("127.0.0.1", 0))
    offer = build_offer(
        "cisco", index=1, ip="127.0.0.1", ports=[s.getsockname()[1] for s in rtp], session_id=7
    )
    sdp_part = offer.body.split(b"--uniqueBoundary\r\n")[1]
    xml = offer.body.split(b"--uniqueBoundary\r\n")[2].split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
    sip = RawSip(gw.sip_port)
    try:
        entity = b'<!DOCTYPE r [<!ENTITY x "y">]><recording '
        required = b"signal;handling=required"
        refused = {
            "no boundary": ("multipart/mixed", offer.body, 400),
            "bad XML": (offer.content_type, offer.body.replace(b"</recording>", b"</recordin"), 400),
            "entities": (offer.content_type, offer.body.replace(b"<recording ", entity), 400),
            "no SDP": ("application/rs-metadata+xml", xml, 400),
            "required part": (
                offer.content_type,
                offer.body.replace(b"signal;handling=optional", required),
                415,
            ),
        }
        for n, (what, (ctype, body, status)) in enumerate(refused.items()):
            sip.request("INVITE", invite_headers(f"bad-{n}@h", ctype), body)
            answer = sip.final()
            assert answer.status == status, (what, answer.status, answer.reason, answer.get("Warning"))
            assert what != "no boundary" or "boundary" in (answer.get("Warning") or "")
            sip.request("ACK", invite_headers(f"bad-{n}@h", ctype) | {"To": answer.get("To") or ""}, cseq=1)

        # A session whose metadata names a stream that does not exist: taken, the legs named by what is known.
        ghost = offer.body.replace(
            f"<send>{offer.legs[1].stream_id}</send>".encode(), b"<send>ghost</send>", 1
        )
        call = "rec-1@h"
        sip.request("INVITE", invite_headers(call, offer.content_type), ghost)
        ok = sip.final()
        assert (
            ok.status == 200
            and ok.get("Require") == "siprec"
            and (ok.get("Contact") or "").endswith("+sip.srs")
        )
        dialog = invite_headers(call, offer.content_type) | {"To": ok.get("To") or ""}
        sip.request("ACK", {k: v for k, v in dialog.items() if k != "Content-Type"}, cseq=1)
        ports = [a.port for a in sdp.parse_answers(ok.body) if isinstance(a, sdp.MediaAnswer)]
        assert len(ports) == 2
        assert (gw.metric("ttg_active_calls"), gw.metric("ttg_active_streams")) == (1, 2)

        # Both parties speak; meanwhile the SRC sends a broken update, then a metadata-only one.
        sender = asyncio.create_task(speak(rtp, ports, short_speech.codes))
        await asyncio.sleep(1.0)
        sip.request("INVITE", dialog, sdp_part.replace(b"</", b"<"), cseq=2)  # neither SDP nor metadata
        assert sip.final().status == 400
        renamed = xml.replace(b"Agent 1", b"Agent Smith").replace(b"<datamode>complete", b"<datamode>partial")
        sip.request("INVITE", dialog | {"Content-Type": "application/rs-metadata+xml"}, renamed, cseq=3)
        update = sip.final()
        assert update.status == 200 and update.body.startswith(b"v=0")  # our SDP, as the offer
        sip.request("ACK", {k: v for k, v in dialog.items() if k != "Content-Type"}, cseq=3)
        await sender
        await asyncio.sleep(1.0)
        sip.request("BYE", {k: v for k, v in dialog.items() if k != "Content-Type"}, cseq=4)
        assert sip.final().status == 200
    finally:
        sip.close()
        for s in rtp:
            s.close()

    def ended() -> bool:
        return any(f["type"] == "call_end" for _, f in read_stream(redis_url, STREAM))

    await until(ended, "call_end in Redis", timeout_s=30, detail=gw.log_tail)
    entries = read_stream(redis_url, STREAM)
    report = audit(entries)
    assert not report.problems, report.problems
    (start,) = [f for _, f in entries if f["type"] == "call_start"]  # only the good session started
    (end,) = [f for _, f in entries if f["type"] == "call_end"]
    legs = json.loads(start["legs"])
    assert legs == [offer.legs[0].expected_leg, "stream-2"]  # the second stream's sender is unknown
    finals = Counter(f["leg"] for _, f in entries if f["type"] == "final")
    assert finals[legs[0]] >= 1 and finals[legs[1]] >= 1, finals
    names = {p["id"]: p["name"] for p in json.loads(end["participants"])}
    assert names[offer.legs[1].sender.id] == "Agent Smith"  # the metadata-only update was applied
    assert {leg: v["asr"] for leg, v in json.loads(end["legs"]).items()} == dict.fromkeys(legs, "finished")
    assert gw.running and gw.metric("ttg_calls_total", result="rejected_codec") == len(refused)
    assert gw.metric("ttg_active_streams") == 0
    assert gw.stop() == 0


async def speak(socks: list[socket.socket], ports: list[int], codes: bytes) -> None:
    """Both legs send the same µ-law speech in real time, 20 ms packets."""
    packets = [
        RtpSender("PCMU", ssrc=100 + i, seq=1, timestamp=0).audio(codes).packets for i in range(len(ports))
    ]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for k in range(len(packets[0])):
        for sock, port, leg in zip(socks, ports, packets, strict=True):
            sock.sendto(leg[k].data, ("127.0.0.1", port))
        await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.02 - loop.time()))
