"""The media of one call leg, from UDP datagrams to 16 kHz PCM blocks and DTMF digits (pure core).

`MediaCore` owns no socket, task or clock. It is driven by:
  `datagram(data, addr, now)`       every datagram on the RTP port (RTCP there too, with rtcp-mux)
  `rtcp_datagram(data, addr, now)`  every datagram on the RTCP port
  `update(plan, now)`               a new offer/answer (re-INVITE: hold/resume, codec or address change)
  `handle_timer(now)`               at (or after) `next_deadline()`
  `goodbye(now)`                    before `close`: the last RTCP report, with a BYE
  `close(now)`                      once, at the end: flushes everything
Each returns the events produced: `AudioBlock`, `DtmfDigit`, `MediaTimeout`, `RtcpReport`. The asyncio
adapter (`gateway.rtp.receiver.CallMedia`) hands the first three to a `MediaSink` and sends the reports.

Theory of operation (the invariants the tests check):

1. The media timeline is in 8 kHz samples from the first released packet (position 0 = the first
   sample of the first packet). It only grows, and output block k always starts at k·block_ms.
2. Order comes from sequence numbers (jitter buffer), spacing from RTP timestamps: a released packet
   lands at `timestamp + offset`; a jump forward (loss, DTX without CN, the time a DTMF key was held, a
   CN period) is filled with silence, capped at `max_gap_ms`. An in-order packet whose timestamp falls
   behind what was already emitted (an idle-fill overshoot, a timestamp reset) re-anchors the offset so
   no audio is dropped. Both count as `timeline_adjustments` when they change the mapping. Nothing
   (silence for a gap, an RFC 4733 event's place and extent, the idle-fill anchor) ever lands beyond
   `max_gap_ms` ahead of the wall clock since the first media packet, so a source whose timestamps
   race ahead (audio, CN or DTMF) cannot make the ASR transcribe hours of silence per second.
3. A new SSRC (or an RFC 3550 A.1 sequence restart) starts a new source once two of its packets came in
   sequence (A.1's MIN_SEQUENTIAL; a lone packet of another SSRC is a straggler, counted late, or a
   stray, counted invalid): the old source is flushed, and the new one's first packet lands where the
   timeline is now. The timeline never restarts.
4. Loss concealment is silence (zeros), not repetition: for ASR, repeating a 20 ms frame can invent a
   phoneme, while silence at worst splits one, and it keeps energy-based endpointing honest. CN
   (RFC 3389) periods are silence too (the noise level is not synthesized: a model fed zeros there
   behaves as in the digital silence of a muted phone).
5. RFC 4733 events go to the DTMF decoder only, never to audio; the time they cover reaches the audio
   timeline as silence (by the timestamp gap, or at close).
6. Idle fill: while the stream is up (not on hold) but no packet arrives, silence is emitted keeping
   pace with the clock, `idle_fill_after_s` behind it, so that ASR sees a pause in real time (finals
   come out during DTX silence). Packets arriving after that re-anchor (rule 2).
7. Symmetric RTP latching (RFC 4961): the first valid RTP packet (parsed, negotiated payload type) fixes
   the remote address; datagrams from anywhere else are dropped as `wrong_source`. The latch moves only
   (a) after `update()` with a different remote address (re-INVITE), or (b) when the latched source has
   been silent for `relatch_after_s` (0 disables) and a valid packet from elsewhere *continues the
   stream*: the current SSRC, its sequence number ahead by less than MAX_DROPOUT (RFC 3550 A.1). That is
   what a NAT rebinding looks like (the same sender, a new public port), and what an off-path third
   party cannot produce: it sees neither the 32-bit SSRC nor the sequence. A new SSRC from a new
   address never takes over without signalling. The trade-off: a peer that moves *and* restarts its
   stream without a re-INVITE (RFC 3550 §8.2 asks a sender that changes its transport address to pick
   a new SSRC) is not followed; its audio is counted `wrong_source` and the call ends by the
   inactivity timeout, visibly, instead of being silently replaced by whoever sends next.
   Keep-alives are not media: STUN (RFC 7983 demux, RFC 6263) from the latched host counts as liveness
   like RTCP, and reduced-size RTCP (APP, SDES alone) is valid RTCP.
8. Inactivity: no valid RTP/RTCP for `inactivity_timeout_s` → one `MediaTimeout`. While on hold
   (sendonly/inactive/recvonly offer or c=0.0.0.0) `hold_timeout_s` applies instead (0 = never).
9. RTCP receiver reports (RFC 3550 §6.4.2, `gateway.rtp.rtcp`; `rtcp_reports`): once the peer is heard
   (latched RTP, or RTCP from the latched host), a compound RR + SDES every 2–6 s (§6.3.1 around the 5 s
   minimum), on hold too (RFC 3264 §5.1 keeps RTCP flowing), with a report block on the current source.
   They go only to the latched host: where its RTCP comes from (symmetric RTCP, RFC 4961), else with
   rtcp-mux to the latched RTP address, else to the SDP's RTCP port there. A stream that reported says
   goodbye with a BYE (§6.3.7).
"""

from __future__ import annotations

import base64
import logging
import random
import secrets
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
from numpy.typing import NDArray

from gateway.addresses import is_unspecified
from gateway.audio.pipeline import SAMPLES_PER_MS, AudioBlock, AudioPipeline, PendingBlocks
from gateway.audio.resample import UpsampleBatch
from gateway.rtp.dtmf import DtmfDecoder, DtmfEvent, TelephoneEvent
from gateway.rtp.jitter_buffer import DUPLICATE, LATE, JitterBuffer
from gateway.rtp.packet import RtpParseError, is_stun, parse_rtcp, parse_rtp
from gateway.rtp.rtcp import Reception, compound, delay_since, report_interval, sr_middle
from gateway.rtp.seq import MAX_DROPOUT, MAX_MISORDER, SEQ_MOD, Unwrapper
from gateway.rtp.stats import JitterEstimator, MediaStats
from gateway.sdp import MediaPlan

logger = logging.getLogger(__name__)

__all__ = [
    "PENDING_PLAN",
    "AudioBlock",
    "DtmfDigit",
    "MediaConfig",
    "MediaCore",
    "MediaEvent",
    "MediaSink",
    "MediaStats",
    "MediaTimeout",
    "RtcpReport",
]

CLOCK_RATE = 8000
KIND_AUDIO = 0
KIND_CN = 1
KIND_DTMF = 2
PROBATION_S = 1.0
_SEQ_TS_SSRC = struct.Struct("!HII")  # a new SSRC's second packet must follow its first within this


class MediaSink(Protocol):
    """Where one call leg's media goes (implemented by the call session)."""

    def on_audio(self, pcm16k: NDArray[np.float32], start_ms: int) -> None:
        """A block of 16 kHz mono float32 in [-1, 1]; blocks are contiguous on the media timeline."""

    def on_dtmf(self, digit: str, start_ms: int, duration_ms: int) -> None:
        """One RFC 4733 key press, exactly once, with its place on the media timeline."""

    def on_inactive(self) -> None:
        """No RTP/RTCP for the (hold-aware) inactivity timeout; the call should end."""


@dataclass(frozen=True, slots=True)
class DtmfDigit:
    digit: str
    start_ms: int
    duration_ms: int


@dataclass(frozen=True, slots=True)
class MediaTimeout:
    idle_s: float
    on_hold: bool


@dataclass(frozen=True, slots=True)
class RtcpReport:
    """A compound RTCP packet for the peer at `addr`, sent from our RTP port (`rtp_port`: rtcp-mux, or
    where the peer's RTCP comes in) or else from our RTCP port."""

    data: bytes
    addr: tuple[str, int]
    rtp_port: bool


MediaEvent = AudioBlock | DtmfDigit | MediaTimeout | RtcpReport


@dataclass(frozen=True, slots=True)
class MediaConfig:
    """Receive-side knobs (built from `RtpSettings` at the edge)."""

    playout_delay_s: float = 0.06  # how long a gap waits for a reordered packet
    block_ms: int = 80  # size of the 16 kHz blocks handed to the sink
    max_gap_ms: int = 5000  # cap on silence inserted for one timestamp jump
    idle_fill_after_s: float = 0.5  # 0 disables idle fill
    inactivity_timeout_s: float = 30.0  # 0 disables
    hold_timeout_s: float = 300.0  # 0 disables
    relatch_after_s: float = 2.0  # 0: only a re-INVITE address change moves the latch
    resample_quality: str = "HQ"
    jitter_capacity: int = 256  # packets waiting behind gaps, at most
    rtcp_reports: bool = True  # send RTCP receiver reports (rule 9)


_NO_EVENTS: tuple[MediaEvent, ...] = ()

# The plan of a stream opened before its SDP is agreed (we made the offer; the answer comes in the ACK):
# no payload type is accepted and the hold timeout applies until `update()` brings the real plan.
PENDING_PLAN = MediaPlan(
    index=0,
    codec="PCMU",
    payload_type=-1,
    remote_host="0.0.0.0",
    remote_port=0,
    remote_rtcp_port=0,
    direction="inactive",
    on_hold=True,
)


class MediaCore:
    def __init__(
        self,
        plan: MediaPlan,
        config: MediaConfig,
        now: float,
        rng: random.Random | None = None,
        upsample_batch: UpsampleBatch | None = None,
    ) -> None:
        """`rng` draws our SSRC, CNAME and report intervals (default: the OS's randomness).

        `upsample_batch`: the process's calls resample together (`UpsampleBatch`); a block then comes
        out once the batch has run (`audio_pending`, `take_events`), and the events after it wait with
        it, so every event keeps its place."""
        self.config = config
        self._plan = plan
        self._kinds: dict[int, int] = {}
        self._holding = False
        self._remote = (plan.remote_host, plan.remote_port)
        self._apply_plan(plan)
        self._max_gap = config.max_gap_ms * SAMPLES_PER_MS
        self._idle_after = config.idle_fill_after_s
        self._idle_quantum = config.block_ms * SAMPLES_PER_MS

        self._events: list[MediaEvent | PendingBlocks] = []
        self._batched = upsample_batch is not None
        self._ready: list[tuple[int, int, bytes, float]] = []
        self._pipeline = AudioPipeline(plan.codec, config.block_ms, config.resample_quality, upsample_batch)
        self._jb: JitterBuffer[tuple[int, int, bytes, float]] = JitterBuffer(
            config.playout_delay_s, config.jitter_capacity
        )
        self._jitter = JitterEstimator()

        # Latching.
        self._latched: tuple[str, int] | None = None
        self._last_from_source = now
        self._last_activity = now

        # Current source (SSRC) and its sequence state (RFC 3550 A.1).
        self._ssrc: int | None = None
        self._max_seq = 0
        self._max_ext = 0
        # A packet after a sequence jump, kept in case the source restarted: (seq, kind, ts, payload, t).
        self._stashed: tuple[int, int, int, bytes, float] | None = None
        # A packet of another SSRC, on probation (RFC 3550 A.1: a source is valid after MIN_SEQUENTIAL = 2
        # packets in sequence): (ssrc, seq, kind, ts, payload, arrival).
        self._candidate: tuple[int, int, int, int, bytes, float] | None = None
        self._old_sources: deque[int] = deque(maxlen=4)  # SSRCs we switched away from

        # Timeline mapping of the current source.
        self._ts = Unwrapper(32)
        self._offset: int | None = None
        self._dtmf = DtmfDecoder()
        self._dtmf_extent = 0  # end of the latest DTMF event on the timeline
        # Idle fill anchor: timeline position known to be covered, and when its packet arrived.
        self._anchor_pos = 0
        self._anchor_time: float | None = None
        self._started_at: float | None = None  # arrival of the first media packet (audio, CN or DTMF)

        # Counters.
        self.packets_received = 0
        self.bytes_received = 0
        self.duplicate = 0
        self.late = 0
        self.invalid: dict[str, int] = {}
        self.ssrc_changes = 0
        self.seq_restarts = 0
        self.timeline_adjustments = 0
        self.dtmf_events = 0
        self.rtcp_packets = 0
        self.keepalives = 0  # STUN binding requests/indications (RFC 6263 keep-alives)
        self.concealed = 0
        self.cn_level: int | None = None
        self._first_packet_at: float | None = None
        self._timed_out = False
        self._closed = False

        # RTCP reports (rule 9): our SSRC and CNAME (RFC 7022 §5: 96 cryptographically random bits, per
        # session), the current source's reception, the last sender report from the peer (its SSRC,
        # LSR, arrival), where the peer's RTCP comes from (address, on our RTP port), the next report.
        self._rng = rng or random.Random()
        self._own_ssrc = self._rng.getrandbits(32)
        self._cname = base64.urlsafe_b64encode(self._rng.randbytes(12) if rng else secrets.token_bytes(12))
        self._reception: Reception | None = None
        self._last_sr: tuple[int, int, float] | None = None
        self._rtcp_from: tuple[tuple[str, int], bool] | None = None
        self._report_at: float | None = None
        self.reports_sent = 0

    # --- inputs ----------------------------------------------------------------------------------

    def datagram(self, data: bytes, addr: tuple[str, int], now: float) -> Sequence[MediaEvent]:
        if len(data) >= 2 and 192 <= data[1] <= 223:
            return self._rtcp(data, addr, now, rtp_port=True)  # RFC 5761 §4 demux (rtcp-mux)
        if self._closed:
            return _NO_EVENTS
        if data[:1] < b"\x04" and is_stun(data):
            return self._keepalive(addr, now)
        if len(data) > 12 and data[0] == 0x80:
            # Fast path for the common header (V=2, no padding, extension or CSRCs): 1 µs cheaper.
            b1 = data[1]
            pt = b1 & 0x7F
            seq, timestamp, ssrc = _SEQ_TS_SSRC.unpack_from(data, 2)
            payload = data[12:]
        else:
            try:
                pkt = parse_rtp(data)
            except RtpParseError as exc:
                self._count_invalid(exc.reason)
                return _NO_EVENTS
            pt, seq, timestamp, ssrc, payload = pkt[:5]
        kind = self._kinds.get(pt)
        if kind is None:
            self._count_invalid("unknown_pt")
            return _NO_EVENTS
        if addr != self._latched and not self._latch(addr, ssrc, seq, now):
            self._count_invalid("wrong_source")
            return _NO_EVENTS
        self._last_from_source = now
        self._last_activity = now
        self.packets_received += 1
        self.bytes_received += len(data)
        if self._first_packet_at is None:
            self._first_packet_at = now

        if ssrc != self._ssrc:
            if self._ssrc is None:
                self._new_source(ssrc, seq, now, restart=False)
                ext = seq
            else:
                # Rule 3: a new SSRC takes over once two of its packets came in sequence, so a stray or
                # very late packet of an old source does not flip the stream back and forth.
                cand = self._candidate
                if (
                    cand is not None
                    and cand[0] == ssrc
                    and seq == (cand[1] + 1) & 0xFFFF
                    and now - cand[5] <= PROBATION_S
                ):
                    self._candidate = None
                    self._new_source(ssrc, cand[1], now, restart=False)
                    self._accept(cand[1], cand[2], cand[3], cand[4], cand[5])
                    ext = cand[1] + 1
                    self._max_seq = seq
                    self._max_ext = ext
                else:
                    if cand is not None:
                        self._drop_candidate()
                    self._candidate = (ssrc, seq, kind, timestamp, payload, now)
                    return self._take()
        else:
            # RFC 3550 App. A.1 (update_seq), with MAX_DROPOUT = 3000 and MAX_MISORDER = 100.
            udelta = (seq - self._max_seq) & 0xFFFF
            if udelta < MAX_DROPOUT:
                ext = self._max_ext + udelta
                self._max_seq = seq
                self._max_ext = ext
                if self._stashed is not None:
                    self._drop_stash()
            elif udelta <= SEQ_MOD - MAX_MISORDER:
                # "the sequence number made a very large jump": hold the packet back; if the next one
                # follows it, the source restarted (A.1: two sequential packets) and both are used.
                stashed = self._stashed
                if stashed is not None and seq == (stashed[0] + 1) & 0xFFFF:
                    self._stashed = None
                    self._new_source(ssrc, stashed[0], now, restart=True)
                    self._accept(stashed[0], *stashed[1:])
                    ext = stashed[0] + 1
                    self._max_seq = seq
                    self._max_ext = ext
                else:
                    if stashed is not None:
                        self._drop_stash()
                    self._stashed = (seq, kind, timestamp, payload, now)
                    return self._take()
            else:
                ext = self._max_ext - (SEQ_MOD - udelta)  # reordered or duplicate, within 100 behind
        self._accept(ext, kind, timestamp, payload, now)
        return self._take()

    def rtcp_datagram(self, data: bytes, addr: tuple[str, int], now: float) -> Sequence[MediaEvent]:
        return self._rtcp(data, addr, now, rtp_port=False)

    def update(self, plan: MediaPlan, now: float) -> Sequence[MediaEvent]:
        """Apply a new negotiation outcome for this stream (re-INVITE)."""
        if self._closed:
            return _NO_EVENTS
        if plan.codec != self._plan.codec:
            self._pipeline.set_codec(plan.codec, self._events)
        remote = (plan.remote_host, plan.remote_port)
        if not is_unspecified(plan.remote_host) and remote != self._remote:
            # RFC 4961 leaves it to signalling: a new address in the SDP means a new media source.
            logger.info("remote RTP address changed %s -> %s: re-latching", self._remote, remote)
            self._remote = remote
            self._latched = None
            self._rtcp_from = None
        self._plan = plan
        self._apply_plan(plan)
        self._last_activity = now  # a re-INVITE restarts the inactivity clock (e.g. a resume)
        self._timed_out = False
        return self._take()

    def handle_timer(self, now: float) -> Sequence[MediaEvent]:
        if self._closed:
            return _NO_EVENTS
        self._jb.handle_timer(now, self._ready)
        if self._ready:
            self._release(now)
        for ev in self._dtmf.handle_timer(now):
            self._emit_dtmf(ev)
        self._idle_fill(now)
        if not self._timed_out:
            timeout = self._timeout()
            if timeout and now - self._last_activity >= timeout:
                self._timed_out = True
                self._events.append(MediaTimeout(now - self._last_activity, self._holding))
        if self._report_at is not None and now >= self._report_at:
            self._report(now)
        return self._take()

    def next_deadline(self) -> float | None:
        if self._closed:
            return None
        best = self._jb.next_deadline()
        d = self._dtmf.next_deadline()
        if d is not None and (best is None or d < best):
            best = d
        d = self._idle_deadline()
        if d is not None and (best is None or d < best):
            best = d
        if not self._timed_out:
            timeout = self._timeout()
            if timeout:
                d = self._last_activity + timeout
                if best is None or d < best:
                    best = d
        d = self._report_at
        if d is not None and (best is None or d < best):
            best = d
        return best

    def goodbye(self, now: float) -> RtcpReport | None:
        """The last report, with a BYE (RFC 3550 §6.3.7), for a stream that has sent reports (one that
        never sent RTP or RTCP "MUST NOT send a BYE"): before `close`, while the ports are open."""
        if self._closed or not self.reports_sent:
            return None
        destination = self._rtcp_destination()
        if destination is None:
            return None
        self._report_at = None
        self.reports_sent += 1
        return RtcpReport(self._compound(now, b"call ended"), *destination)

    def close(self, now: float) -> Sequence[MediaEvent]:
        """Flush the jitter buffer, an open DTMF event and the resampler tail. Idempotent."""
        if self._closed:
            return _NO_EVENTS
        self._drop_stash()
        self._drop_candidate()
        self._end_source(now)
        if self._dtmf_extent > self._pipeline.position:
            # The last key press ends after the last audio: the timeline covers it with silence.
            n = self._dtmf_extent - self._pipeline.position
            self.concealed += n
            self._pipeline.append_silence(n, self._events)
        self._pipeline.finish(self._events)
        self._closed = True
        return self._take()

    # --- state -----------------------------------------------------------------------------------

    @property
    def plan(self) -> MediaPlan:
        return self._plan

    @property
    def latched(self) -> tuple[str, int] | None:
        return self._latched

    @property
    def holding(self) -> bool:
        return self._holding

    @property
    def timeline_samples(self) -> int:
        """8 kHz samples on the media timeline so far (delivered or waiting in the resampler)."""
        return self._pipeline.position

    @property
    def audio_pending(self) -> bool:
        """Audio waits for the `UpsampleBatch` to run (and the events after it with it)."""
        return self._pipeline.pending

    def take_events(self) -> Sequence[MediaEvent]:
        """The events held behind audio that the batch has resampled since (or none)."""
        return self._take()

    def resample_alone(self) -> Sequence[MediaEvent]:
        """Resample the audio that waits for the batch now, alone (the batch could not run it)."""
        self._pipeline.resample_alone()
        return self._take()

    @property
    def lost_settled(self) -> int:
        """Losses that can no longer turn into late arrivals (what the metrics count)."""
        return self._jb.lost

    def stats(self) -> MediaStats:
        return MediaStats(
            codec=self._plan.codec,
            packets_received=self.packets_received,
            bytes_received=self.bytes_received,
            lost=self._jb.lost_total,
            late=self.late,
            duplicate=self.duplicate,
            invalid=sum(self.invalid.values()),
            invalid_reasons=dict(self.invalid),
            ssrc_changes=self.ssrc_changes,
            seq_restarts=self.seq_restarts,
            timeline_adjustments=self.timeline_adjustments,
            dtmf_events=self.dtmf_events,
            rtcp_packets=self.rtcp_packets,
            rtcp_reports_sent=self.reports_sent,
            jitter_ms=self._jitter.jitter / (CLOCK_RATE / 1000),
            audio_ms=self._pipeline.samples_out // (2 * SAMPLES_PER_MS),
            concealed_ms=self.concealed // SAMPLES_PER_MS,
            source=f"{self._latched[0]}:{self._latched[1]}" if self._latched else "",
            first_packet_at=self._first_packet_at,
            timed_out=self._timed_out,
        )

    # --- internals -------------------------------------------------------------------------------

    def _take(self) -> Sequence[MediaEvent]:
        events = self._events
        if not events:
            return _NO_EVENTS
        if not self._batched:  # no PendingBlocks among them
            self._events = []
            return cast(list[MediaEvent], events)
        out: list[MediaEvent] = []
        for i, ev in enumerate(events):
            if isinstance(ev, PendingBlocks):
                if not ev.done:  # this and what follows wait for the batch
                    self._events = events[i:]
                    return out
                out.extend(ev.blocks)
            else:
                out.append(ev)
        self._events = []
        return out

    def _apply_plan(self, plan: MediaPlan) -> None:
        kinds = {plan.payload_type: KIND_AUDIO}
        if plan.cn_payload_type is not None:
            kinds[plan.cn_payload_type] = KIND_CN
        if plan.dtmf_payload_type is not None:
            kinds[plan.dtmf_payload_type] = KIND_DTMF
        self._kinds = kinds
        self._holding = plan.on_hold or not plan.media_expected

    def _timeout(self) -> float:
        return self.config.hold_timeout_s if self._holding else self.config.inactivity_timeout_s

    def _latch(self, addr: tuple[str, int], ssrc: int, seq: int, now: float) -> bool:
        """Rule 7: the first valid packet latches; later only the same stream, moved, after a silence."""
        if self._latched is None:
            logger.debug("RTP latched to %s:%d", addr[0], addr[1])
            self._latched = addr
            self._arm_reports(now)
            return True
        relatch = self.config.relatch_after_s
        if not relatch or now - self._last_from_source < relatch:
            return False
        if ssrc != self._ssrc or not 0 < (seq - self._max_seq) & 0xFFFF < MAX_DROPOUT:
            return False
        logger.info(
            "RTP stream %08x silent for %.1f s continues from %s:%d: re-latching from %s:%d",
            ssrc, now - self._last_from_source, *addr, *self._latched,
        )  # fmt: skip
        self._latched = addr
        return True

    def _rtcp(
        self, data: bytes, addr: tuple[str, int], now: float, *, rtp_port: bool
    ) -> Sequence[MediaEvent]:
        if data[:1] < b"\x04" and is_stun(data):
            return self._keepalive(addr, now)
        try:
            info = parse_rtcp(data)
        except RtpParseError as exc:
            self._count_invalid(exc.reason)
            return _NO_EVENTS
        self.rtcp_packets += 1
        # RTCP from the latched host (any port: RTCP comes from port+1 or a NATed port) is liveness, and
        # where our reports go (symmetric RTCP).
        if self._latched is not None and addr[0] == self._latched[0]:
            self._last_activity = now
            self._rtcp_from = (addr, rtp_port)
            if info.sr_ntp is not None:
                self._last_sr = (info.sender_ssrc, sr_middle(info.sr_ntp), now)
            self._arm_reports(now)
        return _NO_EVENTS

    def _arm_reports(self, now: float) -> None:
        """The peer is heard: the first report is due (§6.3.1's initial, halved interval)."""
        if self.config.rtcp_reports and self._report_at is None and not self._closed:
            self._report_at = now + report_interval(self._rng, initial=True)

    def _rtcp_destination(self) -> tuple[tuple[str, int], bool] | None:
        """Where reports go (rule 9), and whether from our RTP port; None before the peer is heard."""
        if self._rtcp_from is not None:
            return self._rtcp_from
        latched = self._latched
        if latched is None:
            return None
        if self._plan.rtcp_mux:
            return latched, True
        return (latched[0], self._plan.remote_rtcp_port or latched[1] + 1), False

    def _report(self, now: float) -> None:
        destination = self._rtcp_destination()
        if destination is None:  # the latch moved (re-INVITE): the next latch arms the reports again
            self._report_at = None
            return
        self._events.append(RtcpReport(self._compound(now), *destination))
        self.reports_sent += 1
        self._report_at = now + report_interval(self._rng, initial=False)

    def _compound(self, now: float, bye: bytes | None = None) -> bytes:
        """RR (a block on the current source once one is heard) + SDES CNAME [+ BYE]."""
        rec = self._reception
        if rec is None:
            return compound(self._own_ssrc, self._cname, bye=bye)
        lsr = dlsr = 0
        sr = self._last_sr
        if sr is not None and sr[0] == rec.ssrc:
            lsr, dlsr = sr[1], delay_since(now - sr[2])
        block = rec.block(self._max_ext, self._jitter.jitter, lsr, dlsr)
        return compound(self._own_ssrc, self._cname, (block,), bye)

    def _keepalive(self, addr: tuple[str, int], now: float) -> Sequence[MediaEvent]:
        """A STUN keep-alive: not media, not invalid; from the latched host it shows the peer is there."""
        self.keepalives += 1
        if self._latched is not None and addr[0] == self._latched[0]:
            self._last_activity = now
        return _NO_EVENTS

    def _count_invalid(self, reason: str) -> None:
        self.invalid[reason] = self.invalid.get(reason, 0) + 1

    def _drop_candidate(self) -> None:
        cand = self._candidate
        if cand is not None:
            self._candidate = None
            if cand[0] in self._old_sources:
                self.late += 1  # a straggler of a source we already left
            else:
                self._count_invalid("stray_ssrc")

    def _drop_stash(self) -> None:
        if self._stashed is not None:
            self._stashed = None
            self._count_invalid("seq_jump")

    def _new_source(self, ssrc: int, seq: int, now: float, *, restart: bool) -> None:
        if self._ssrc is not None:
            if restart:
                self.seq_restarts += 1
            else:
                self.ssrc_changes += 1
                self._old_sources.append(self._ssrc)
            self._end_source(now)
            self._jb.reset()
            self._jitter.reset()
            self._ts = Unwrapper(32)
            self._offset = None
            self._dtmf = DtmfDecoder()
        self._ssrc = ssrc
        self._max_seq = seq
        self._max_ext = seq
        self._reception = Reception(ssrc, seq)

    def _end_source(self, now: float) -> None:
        self._jb.flush(self._ready)
        if self._ready:
            self._release(now)
        for ev in self._dtmf.finish():
            self._emit_dtmf(ev)

    def _accept(self, ext: int, kind: int, timestamp: int, payload: bytes, now: float) -> None:
        if self._reception is not None:
            self._reception.received += 1  # RFC 3550 A.3 counts duplicates and late packets too
        status = self._jb.push(ext, (kind, timestamp, payload, now), now, self._ready)
        if status == DUPLICATE:
            if kind != KIND_DTMF:  # RFC 4733 §2.5.1.4 end packets are sent three times on purpose
                self.duplicate += 1
            return
        if status == LATE:
            self.late += 1
            return
        if kind != KIND_DTMF:  # events repeat one timestamp for ~50 ms steps: not a clock sample
            self._jitter.update(now * CLOCK_RATE, timestamp)
        if self._ready:
            self._release(now)

    def _release(self, now: float) -> None:
        ready = self._ready
        self._ready = []
        pipeline = self._pipeline
        events = self._events
        for kind, timestamp, payload, arrival in ready:
            ext_ts = self._ts.unwrap(timestamp)
            if self._offset is None:
                self._offset = pipeline.position - ext_ts  # a new source continues the timeline
            pos = ext_ts + self._offset
            if kind == KIND_AUDIO:
                if not payload:
                    continue  # an empty packet (keepalive) carries no samples
                if self._started_at is None:
                    self._started_at = arrival
                if pos != pipeline.position:
                    self._place(pos, arrival)
                pipeline.append_codes(payload, events)
                self._anchor_pos = pipeline.position
                self._anchor_time = arrival
            elif kind == KIND_CN:
                # RFC 3389: the CN packet starts a silence period that lasts until the next packet.
                self._place(pos, arrival)
                if payload:
                    self.cn_level = payload[0] & 0x7F
                self._anchor_pos = pipeline.position
                self._anchor_time = arrival
            else:
                try:
                    tev = TelephoneEvent.parse(payload)
                except ValueError:
                    self._count_invalid("bad_dtmf")
                    continue
                if self._started_at is None:
                    self._started_at = arrival
                # An event's place and extent are bounded like any timestamp jump, and by the wall clock
                # (rule 2): event timestamps racing ahead must not pull the idle fill, or close(), past
                # real time, whatever the number of events.
                limit = min(pipeline.position + self._max_gap, self._wall_limit(arrival))
                pos = min(max(pos, 0), limit)
                for ev in self._dtmf.packet(ext_ts, pos, tev, now):
                    self._emit_dtmf(ev)
                end = min(pos + tev.duration, limit)
                if end > self._dtmf_extent:
                    self._dtmf_extent = end
                self._anchor_pos = max(self._anchor_pos, end)
                self._anchor_time = arrival

    def _place(self, pos: int, arrival: float) -> None:
        """Move the timeline to `pos` (rule 2): fill a gap with silence, or re-anchor an overlap."""
        assert self._offset is not None
        position = self._pipeline.position
        gap = pos - position
        if gap > 0:
            # Silence is capped per jump, and so that the timeline never runs more than max_gap ahead
            # of the clock since the first packet: timestamps racing ahead cannot flood the ASR.
            if self._started_at is None:
                self._started_at = arrival
            allowed = max(0, min(self._max_gap, self._wall_limit(arrival) - position))
            if gap > allowed:
                self._offset -= gap - allowed
                gap = allowed
                self.timeline_adjustments += 1
            self.concealed += gap
            self._pipeline.append_silence(gap, self._events)
        elif gap < 0:
            self._offset -= gap
            self.timeline_adjustments += 1

    def _wall_limit(self, arrival: float) -> int:
        """The furthest timeline position media arriving at `arrival` may reach (rule 2)."""
        assert self._started_at is not None
        return int((arrival - self._started_at) * CLOCK_RATE) + self._max_gap

    def _emit_dtmf(self, ev: DtmfEvent) -> None:
        self.dtmf_events += 1
        self._events.append(
            DtmfDigit(ev.digit, ev.start // SAMPLES_PER_MS, round(ev.duration / SAMPLES_PER_MS))
        )

    def _idle_deadline(self) -> float | None:
        if not self._idle_after or self._holding or self._anchor_time is None or not self._jb.idle:
            return None
        due = self._pipeline.position + self._idle_quantum - self._anchor_pos
        return self._anchor_time + self._idle_after + due / CLOCK_RATE

    def _idle_fill(self, now: float) -> None:
        if not self._idle_after or self._holding or self._anchor_time is None or not self._jb.idle:
            return
        target = self._anchor_pos + round((now - self._anchor_time - self._idle_after) * CLOCK_RATE)
        n = target - self._pipeline.position
        if n >= self._idle_quantum:
            n -= n % self._idle_quantum
            self.concealed += n
            self._pipeline.append_silence(n, self._events)
