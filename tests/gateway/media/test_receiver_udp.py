"""The asyncio adapter over real UDP on 127.0.0.1: the acceptance scenario, junk, ports, metrics — each
with the sockets on the event loop and with the batched intake (`intake_tick_s`)."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import REGISTRY

from gateway.rtp.media import MediaConfig
from gateway.rtp.packet import RTCP_BYE, RTCP_RR, RTCP_SDES, parse_rtcp
from gateway.rtp.receiver import CallMedia, MediaManager, PortsExhausted
from gateway.rtp.sender import Impairments, RtpSender, ScheduledPacket
from gateway.sdp import MediaPlan
from tests.fixtures import peers
from tests.gateway.media.helpers import assert_audio_matches, oracle, speech_like
from tools.ports import port_block

pytestmark = pytest.mark.timeout(60)

CONFIG = MediaConfig(playout_delay_s=0.25, idle_fill_after_s=0.0, inactivity_timeout_s=30.0)
PLAN = MediaPlan(0, "PCMU", 0, "127.0.0.1", 9, 10, dtmf_payload_type=101, cn_payload_type=13)
INTAKE_TICK_S = 0.0  # every test runs twice: each socket on the loop (0), and the intake every 5 ms


@pytest.fixture(autouse=True, params=[0.0, 0.005], ids=["loop-readers", "intake-5ms"])
def intake_tick(request: pytest.FixtureRequest) -> Iterator[float]:
    global INTAKE_TICK_S
    INTAKE_TICK_S = request.param
    yield request.param
    INTAKE_TICK_S = 0.0


class RecordingSink:
    def __init__(self, fail_first_audio: bool = False) -> None:
        self.blocks: list[tuple[int, np.ndarray]] = []
        self.digits: list[tuple[str, int, int]] = []
        self.inactive = 0
        self._fail = fail_first_audio

    def on_audio(self, pcm16k: np.ndarray, start_ms: int) -> None:
        if self._fail:
            self._fail = False
            raise RuntimeError("sink bug")
        self.blocks.append((start_ms, pcm16k.copy()))

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        self.digits.append((digit, start_ms, duration_ms))

    def on_inactive(self) -> None:
        self.inactive += 1

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([pcm for _, pcm in self.blocks]) if self.blocks else np.zeros(0, np.float32)


def manager(config: MediaConfig = CONFIG, pairs: int = 50, **kwargs: float) -> MediaManager:
    kwargs.setdefault("intake_tick_s", INTAKE_TICK_S)
    base = port_block(2 * pairs)
    return MediaManager(config, host="127.0.0.1", port_min=base, port_max=base + 2 * pairs - 1, **kwargs)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def paced(sock: socket.socket, port: int, packets: Sequence[ScheduledPacket], speed: float) -> None:
    """Send on the packets' own clock, `speed` times faster than real time."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for p in packets:
        delay = t0 + p.at / speed - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sock.sendto(p.data, ("127.0.0.1", port))


async def settle(media: CallMedia, packets: int, timeout: float = 10.0) -> None:
    """Wait until the receiver has seen `packets` RTP packets (datagrams are asynchronous)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while media.stats().packets_received < packets and loop.time() < end:
        await asyncio.sleep(0.01)


async def test_impaired_stream_over_udp_gives_an_exact_timeline_dtmf_and_counters() -> None:
    pcm = speech_like(16000, seed=5)
    sender = RtpSender("PCMU", ssrc=0xA, seq=65500, timestamp=2**32 - 4000)
    sender.audio(pcm[:9600]).silence(400, comfort_noise=True).audio(pcm[9600:12800])
    sender.dtmf("5", 200).audio(pcm[12800:16000])
    sender.change_ssrc(0xB, seq=1000, timestamp=123456).audio(pcm[:4800]).dtmf("#", 120).audio(pcm[4800:6400])
    late_index = 120  # an audio packet of the second source, arriving ~1 s after its playout deadline
    assert sender.packets[late_index].ssrc == 0xB and sender.packets[late_index].kind == "audio"
    net = Impairments.of(loss={10, 11, 45}, duplicate={20, 21}, delay={30: 0.03, 70: 0.035, late_index: 10.0})
    wire = net.apply(sender.packets)
    before = {
        "received": sample("ttg_rtp_packets_received_total", codec="PCMU"),
        "lost": sample("ttg_rtp_packets_lost_total"),
        "late": sample("ttg_rtp_packets_late_total"),
        "dup": sample("ttg_rtp_packets_duplicate_total"),
        "dtmf": sample("ttg_dtmf_events_total"),
        "jitter": sample("ttg_rtp_jitter_seconds_count"),
        "streams": sample("ttg_rtp_streams"),
    }
    mgr = manager()
    sink = RecordingSink()
    media = await mgr.open(PLAN, sink, name="udp-acceptance")
    assert media.port % 2 == 0 and media.rtcp_port == media.port + 1
    assert sample("ttg_rtp_streams") == before["streams"] + 1
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        await paced(tx, media.port, wire, speed=10.0)
        await settle(media, len(wire))
    finally:
        tx.close()
    await asyncio.sleep(0.3)  # past the playout delay of the last gap
    stats = media.close()

    expected = oracle([p for p in wire if p.index != late_index])
    assert_audio_matches(sink.audio, expected.pcm8k)
    assert [start for start, _ in sink.blocks] == [80 * k for k in range(len(sink.blocks))]
    assert sink.digits == expected.digits and [d for d, _, _ in sink.digits] == ["5", "#"]
    assert (stats.lost, stats.late, stats.duplicate, stats.ssrc_changes, stats.dtmf_events) == (3, 1, 2, 1, 2)
    assert stats.packets_received == len(wire) and stats.invalid == 0
    assert stats.source.startswith("127.0.0.1:")
    assert sample("ttg_rtp_packets_received_total", codec="PCMU") - before["received"] == len(wire)
    assert sample("ttg_rtp_packets_lost_total") - before["lost"] == 3
    assert sample("ttg_rtp_packets_late_total") - before["late"] == 1
    assert sample("ttg_rtp_packets_duplicate_total") - before["dup"] == 2
    assert sample("ttg_dtmf_events_total") - before["dtmf"] == 2
    assert sample("ttg_rtp_jitter_seconds_count") - before["jitter"] == 1
    assert sample("ttg_rtp_streams") == before["streams"]
    assert mgr.streams == 0 and mgr.pool.in_use == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_datagrams_queued_when_the_call_ends_are_received_before_the_sockets_close(loop: str) -> None:
    """The loop reads a socket one datagram per turn, so it can serve a hang-up (BYE, on the SIP
    socket) while the caller's last packets, sent before it, still wait in the kernel for this stream.
    They belong to the call: closing counts them and plays their audio out. Here the loop gets no turn
    at all between the sends and the close, for 8 s of audio: a loop that far behind loses no packet
    (the kernel's default receive buffer holds about 5 s of one call)."""
    sender = RtpSender("PCMU", ssrc=9, seq=1, timestamp=0).audio(speech_like(64000, 3))
    rr = struct.pack("!BBHI", 0x80, 201, 1, 9)

    async def hang_up_with_everything_queued() -> tuple[CallMedia, RecordingSink]:
        sink = RecordingSink()
        media = await manager().open(PLAN, sink)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for p in sender.packets:
                tx.sendto(p.data, ("127.0.0.1", media.port))
            tx.sendto(rr, ("127.0.0.1", media.rtcp_port))
            media.close()
        return media, sink

    factory = peers.module("uvloop").new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        media, sink = runner.run(hang_up_with_everything_queued())
    stats = media.stats()
    assert (stats.packets_received, stats.rtcp_packets, stats.lost) == (len(sender.packets), 1, 0)
    assert_audio_matches(sink.audio, oracle(sender.packets).pcm8k)


async def test_junk_on_both_ports_is_counted_and_the_call_is_unaffected() -> None:
    sender = RtpSender("PCMU", ssrc=7, seq=1, timestamp=0).audio(speech_like(4000, 1))
    junk = [b"", b"\x00", b"INVITE sip:x SIP/2.0\r\n\r\n", bytes(200), b"\x80\x60" + bytes(170)]
    reasons = {"too_short": 2, "bad_version": 2, "unknown_pt": 1}
    before = {r: sample("ttg_rtp_packets_invalid_total", reason=r) for r in [*reasons, "bad_rtcp"]}
    mgr = manager()
    sink = RecordingSink()
    media = await mgr.open(PLAN, sink)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i, p in enumerate(sender.packets):
            tx.sendto(p.data, ("127.0.0.1", media.port))
            if i < len(junk):
                tx.sendto(junk[i], ("127.0.0.1", media.port))
            if i % 5 == 0:
                await asyncio.sleep(0.002)
        tx.sendto(b"\x80\xc9\x00\x05" + bytes(4), ("127.0.0.1", media.rtcp_port))  # bad RTCP length
        tx.sendto(struct.pack("!BBHI", 0x80, 201, 1, 7), ("127.0.0.1", media.rtcp_port))  # a valid RR
        await settle(media, len(sender.packets))
        await asyncio.sleep(0.05)
    finally:
        tx.close()
    stats = media.close()
    assert stats.invalid_reasons == {**reasons, "bad_rtcp": 1}
    assert stats.rtcp_packets == 1 and stats.lost == 0
    assert_audio_matches(sink.audio, oracle(sender.packets).pcm8k)
    for reason, n in {**reasons, "bad_rtcp": 1}.items():
        assert sample("ttg_rtp_packets_invalid_total", reason=reason) - before[reason] == n


async def test_a_failing_sink_does_not_stop_the_media() -> None:
    sender = RtpSender("PCMU", ssrc=7, seq=1, timestamp=0).audio(speech_like(4000, 2))
    sink = RecordingSink(fail_first_audio=True)
    media = await manager().open(PLAN, sink)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        await paced(tx, media.port, sender.packets, speed=20.0)
        await settle(media, len(sender.packets))
    finally:
        tx.close()
    media.close()
    assert [start for start, _ in sink.blocks] == [
        80 * k for k in range(1, 7)
    ]  # block 0 was lost in the sink


@pytest.mark.parametrize("batch_fails", [False, True], ids=["batched", "batch-fails"])
async def test_calls_resampled_together_each_get_their_exact_audio_even_when_the_batch_fails(
    batch_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four calls' blocks resample in the manager's batch, once a loop turn; each call's audio is its
    own, sample for sample. A batch that raises is logged and each call then resamples its own."""
    mgr = manager()
    assert mgr.upsample_batch is not None
    if batch_fails:
        monkeypatch.setattr(mgr.upsample_batch, "run", lambda: 1 / 0)
    senders = [
        RtpSender("PCMU", ssrc=20 + i, seq=1, timestamp=0).audio(speech_like(4000, 10 + i)) for i in range(4)
    ]
    sinks = [RecordingSink() for _ in senders]
    medias = [await mgr.open(PLAN, sink) for sink in sinks]
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sending = (paced(tx, m.port, s.packets, speed=10.0) for m, s in zip(medias, senders, strict=True))
        await asyncio.gather(*sending)
        for media, sender in zip(medias, senders, strict=True):
            await settle(media, len(sender.packets))
        await asyncio.sleep(0.3)  # past the playout delay
    finally:
        tx.close()
    passes = mgr.upsample_batch.passes
    for media, sink, sender in zip(medias, sinks, senders, strict=True):
        assert len(sink.blocks) >= 6  # delivered while the call runs, not only by the close
        media.close()
        assert_audio_matches(sink.audio, oracle(sender.packets).pcm8k)
        assert [start for start, _ in sink.blocks] == [80 * k for k in range(len(sink.blocks))]
    assert (passes == 0) == batch_fails


async def test_packets_that_arrived_before_the_close_are_not_lost_with_the_socket() -> None:
    # A BYE handled before the last packets were read (the loop serves ready sockets in any order):
    # closing reads what the kernel holds first, so the call's last audio is in its stats and stream.
    sender = RtpSender("PCMU", ssrc=9, seq=100, timestamp=0).audio(speech_like(2400, 3))
    sink = RecordingSink()
    media = await manager().open(PLAN, sink)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for p in sender.packets:  # no await: the receiver has no chance to read any of them
            tx.sendto(p.data, ("127.0.0.1", media.port))
        stats = media.close()
    finally:
        tx.close()
    assert stats.packets_received == len(sender.packets) and stats.lost == 0
    assert sum(len(pcm) for _, pcm in sink.blocks) >= 2 * 2400  # the whole 8 kHz clip, at 16 kHz


async def test_inactivity_reaches_the_sink_once() -> None:
    sink = RecordingSink()
    media = await manager(replace(CONFIG, inactivity_timeout_s=0.2)).open(PLAN, sink)
    await asyncio.sleep(0.6)
    assert sink.inactive == 1 and media.stats().timed_out
    media.update(PLAN)  # a re-INVITE restarts the clock
    await asyncio.sleep(0.35)
    assert sink.inactive == 2
    media.close()


async def test_the_peer_gets_receiver_reports_from_our_rtcp_port_and_a_bye_at_the_close() -> None:
    peer_rtcp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer_rtcp.bind(("127.0.0.1", 0))
    peer_rtcp.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    before = sample("ttg_rtcp_reports_sent_total")
    media = await manager().open(replace(PLAN, remote_rtcp_port=peer_rtcp.getsockname()[1]), RecordingSink())
    loop = asyncio.get_running_loop()

    async def next_report(timeout: float = 5.0) -> tuple[tuple[int, ...], int]:
        data, addr = await asyncio.wait_for(loop.sock_recvfrom(peer_rtcp, 2048), timeout)
        return parse_rtcp(data).packet_types, addr[1]

    try:
        await paced(tx, media.port, RtpSender("PCMU", ssrc=0xB0B).audio(speech_like(1600)).packets, 10.0)
        types, port = await next_report()  # the first within ~3 s of the first packet
        assert types == (RTCP_RR, RTCP_SDES) and port == media.rtcp_port
        media.close()
        types, port = await next_report(1.0)
        assert types == (RTCP_RR, RTCP_SDES, RTCP_BYE) and port == media.rtcp_port
    finally:
        media.close()
        tx.close()
        peer_rtcp.close()
    assert media.stats().rtcp_reports_sent == 2 == sample("ttg_rtcp_reports_sent_total") - before


async def test_ports_are_freed_on_close_and_exhaustion_is_reported() -> None:
    base = port_block(4)
    mgr = MediaManager(CONFIG, host="127.0.0.1", port_min=base, port_max=base + 3,
                       quarantine_s=0.0, intake_tick_s=INTAKE_TICK_S)  # fmt: skip
    a = await mgr.open(PLAN, RecordingSink())
    await mgr.open(PLAN, RecordingSink())
    with pytest.raises(PortsExhausted):
        await mgr.open(PLAN, RecordingSink())
    port = a.port
    a.close()
    a.close()  # idempotent
    await asyncio.sleep(0)  # transports close on the next loop iteration
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", port))  # the port is really free
    probe.close()
    c = await mgr.open(PLAN, RecordingSink())
    assert c.port == port
    assert mgr.close_all() and mgr.streams == 0


async def test_a_port_taken_by_another_process_is_skipped() -> None:
    base = port_block(6)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    squatter.bind(("127.0.0.1", base + 1))  # the RTCP port of the first pair
    try:
        mgr = MediaManager(
            CONFIG, host="127.0.0.1", port_min=base, port_max=base + 5, intake_tick_s=INTAKE_TICK_S
        )
        media = await mgr.open(PLAN, RecordingSink())
        assert media.port == base + 2
        media.close()
    finally:
        squatter.close()


async def test_nothing_is_left_running_after_close() -> None:
    mgr = manager()
    medias = [await mgr.open(PLAN, RecordingSink()) for _ in range(5)]
    for m in medias:
        m.close()
    await asyncio.sleep(0)
    assert mgr.streams == 0 and mgr.pool.in_use == 0
    assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()
    assert all(m._timer is None for m in medias)
    assert mgr._intake is None or mgr._intake._timer is None  # the intake's tick stops with the last call


@peers.linux_only  # the kernel arrival times: SO_TIMESTAMPNS
async def test_the_intake_times_a_datagram_by_its_arrival_not_by_when_it_reads_it() -> None:
    """Five packets 100 ms apart on the RTP clock, sent 100 ms apart, read together by an intake that
    turns once a second: their arrival times are the kernel's, so the stream shows no jitter (read
    times would make every packet 100 ms early against the last: ~20 ms of RFC 3550 jitter), and none
    is late (the intake serves the call's playout after reading, in the same turn)."""
    sender = RtpSender("PCMU", ssrc=3, seq=1, timestamp=0, ptime_ms=100).audio(speech_like(4000, 4))
    assert len(sender.packets) == 5
    media = await manager(intake_tick_s=1.0).open(PLAN, RecordingSink())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        for p in sender.packets:
            tx.sendto(p.data, ("127.0.0.1", media.port))
            await asyncio.sleep(0.1)
        await settle(media, len(sender.packets), timeout=3.0)
    stats = media.close()
    assert stats.packets_received == 5 and stats.late == 0
    assert stats.jitter_ms < 10.0, stats.jitter_ms


async def test_a_stream_opened_before_its_answer_accepts_rtp_only_after_update() -> None:
    sender = RtpSender("PCMA", ssrc=7, seq=1, timestamp=0).audio(speech_like(1600, 3))
    sink = RecordingSink()
    media = await manager().open(None, sink)  # delayed offer: our offer is out, no answer yet
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tx.sendto(sender.packets[0].data, ("127.0.0.1", media.port))
        await settle_invalid(media, 1)
        media.update(replace(PLAN, codec="PCMA", payload_type=8))
        await paced(tx, media.port, sender.packets[1:], speed=20.0)
        await settle(media, len(sender.packets) - 1)
    finally:
        tx.close()
    stats = media.close()
    assert stats.invalid_reasons == {"unknown_pt": 1} and stats.codec == "PCMA"
    assert_audio_matches(sink.audio, oracle(sender.packets[1:], "PCMA").pcm8k)


async def settle_invalid(media: CallMedia, n: int) -> None:
    for _ in range(500):
        if media.stats().invalid >= n:
            return
        await asyncio.sleep(0.01)
