"""Outgoing RTP for one call, as a pure core: packet k of the call's plan is due at t0 + k·ptime
(absolute deadlines, so pacing never drifts), impairments decide what leaves and when.

Driven by `emit(now)` at each packet's deadline (`next_deadline()`); it returns the datagrams to send
as (delay_s, bytes): delay 0 means now, a positive delay is an impairment (jitter, reordering).
It also records when the packets carrying each utterance's first and last speech sample were
processed: the reference times for time-to-first-partial and time-to-final.
"""

from __future__ import annotations

import bisect
import random
import struct
from dataclasses import dataclass

from gateway.audio import g711
from gateway.rtp.packet import RTP_VERSION
from tools.replay.audio import CallPlan
from tools.replay.config import Impairments

# RFC 3550 §5.1 fixed header (V=2, no padding/extension/CSRC). Packed directly: building a
# gateway.rtp.packet.RtpPacket and serializing it costs 2.1 µs a packet here against 0.23 µs, and
# this is the replay's hot path; the tests parse what is sent with gateway.rtp.packet.parse_rtp.
_HEADER = struct.Struct("!BBHII")
_B0 = RTP_VERSION << 6


class Impairer:
    """netem-like per-packet impairments with independent draws from a seeded generator."""

    def __init__(self, imp: Impairments, rng: random.Random, ptime_s: float) -> None:
        self.imp = imp
        self.rng = rng
        self.ptime_s = ptime_s
        self.lost = 0
        self.duplicated = 0
        self.reordered = 0
        self.delayed = 0

    def apply(self, data: bytes) -> list[tuple[float, bytes]]:
        imp, rng = self.imp, self.rng
        if imp.loss and rng.random() < imp.loss:
            self.lost += 1
            return []
        delay = rng.uniform(0.0, imp.jitter_ms / 1000.0) if imp.jitter_ms else 0.0
        if imp.reorder and rng.random() < imp.reorder:
            delay += 1.5 * self.ptime_s  # leaves after the next packet (due one ptime later)
            self.reordered += 1
        if delay > 0:
            self.delayed += 1
        out = [(delay, data)]
        if imp.duplicate and rng.random() < imp.duplicate:
            out.append((delay, data))
            self.duplicated += 1
        return out


class LatenessHistogram:
    """How late packets were processed relative to their deadline, in 0.1 ms bins up to 200 ms.
    Fixed memory whatever the run length (50k packets/s for an hour would not fit in a list)."""

    BIN_S = 0.0001
    N_BINS = 2000

    def __init__(self) -> None:
        self.counts = [0] * (self.N_BINS + 1)
        self.n = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def add(self, lateness_s: float) -> None:
        late = max(lateness_s, 0.0)
        self.counts[min(int(late / self.BIN_S + 1e-6), self.N_BINS)] += (
            1  # 1e-6: 4.9 ms is bin 49, not 48.999
        )
        self.n += 1
        self.total_s += late
        if late > self.max_s:
            self.max_s = late

    def merge(self, other: LatenessHistogram) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.n += other.n
        self.total_s += other.total_s
        self.max_s = max(self.max_s, other.max_s)

    def quantile(self, q: float) -> float:
        """Upper edge of the bin holding the q-quantile (0.1 ms resolution); 0 when empty."""
        if self.n == 0:
            return 0.0
        rank = q * self.n
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return min((i + 1) * self.BIN_S, self.max_s)
        return self.max_s


@dataclass(slots=True)
class SpeechMark:
    """Processing times (monotonic s) of the packets carrying an utterance's first and last speech."""

    start_t: float | None = None
    end_t: float | None = None


class RtpStream:
    def __init__(
        self,
        plan: CallPlan,
        codec: str,
        payload_type: int,
        t0: float,
        ptime_ms: int,
        impairments: Impairments,
        rng: random.Random,
        lateness: LatenessHistogram | None = None,
    ) -> None:
        """`lateness` may be shared by every call of a run (it is 16 KB; a run may have 100k calls)."""
        self.plan = plan
        self.codec = codec
        self.payload_type = payload_type
        self.t0 = t0
        self.ptime_s = ptime_ms / 1000.0
        self.spp = plan.samples_per_packet
        self.ssrc = rng.getrandbits(32)
        self.seq0 = rng.getrandbits(16)  # RFC 3550 §5.1: random initial sequence number and timestamp
        self.ts0 = rng.getrandbits(32)
        self.impairer = Impairer(impairments, rng, self.ptime_s)
        self._impaired = impairments.any
        self.k = 0  # next packet index
        self.sent = 0  # datagrams handed to the socket (the adapter counts send failures)
        self.lateness = lateness if lateness is not None else LatenessHistogram()
        self.lateness_max_s = 0.0  # this call's own worst lateness
        self.jitter_s = 0.0  # RFC 3550 §6.4.1 estimator over our own send times (0 network delay)
        self._prev_t: float | None = None
        self._silence = bytes([g711.SILENCE_CODE[codec]]) * self.spp
        self._clip_starts = [c.first_packet for c in plan.clips]
        self._clip_data = [c.clip.encoded(codec, self.spp) for c in plan.clips]
        self.marks = [SpeechMark() for _ in plan.utterances]
        self._mark_at: dict[int, list[tuple[int, bool]]] = {}
        for i, u in enumerate(plan.utterances):
            self._mark_at.setdefault(u.start_packet, []).append((i, True))
            self._mark_at.setdefault(u.end_packet, []).append((i, False))

    @property
    def n_packets(self) -> int:
        return self.plan.n_packets

    @property
    def done(self) -> bool:
        return self.k >= self.plan.n_packets

    def next_deadline(self) -> float | None:
        return None if self.done else self.t0 + self.k * self.ptime_s

    def payload(self, k: int) -> bytes:
        i = bisect.bisect_right(self._clip_starts, k) - 1
        if i >= 0:
            data = self._clip_data[i]
            off = (k - self._clip_starts[i]) * self.spp
            if off < len(data):
                return data[off : off + self.spp]
        return self._silence

    def emit(self, now: float) -> list[tuple[float, bytes]]:
        """Process packet k (due now or earlier): build it, apply impairments, record marks."""
        if self.done:
            return []
        k = self.k
        deadline = self.t0 + k * self.ptime_s
        late = now - deadline
        self.lateness.add(late)
        if late > self.lateness_max_s:
            self.lateness_max_s = late
        if self._prev_t is not None:
            d = (now - self._prev_t) - self.ptime_s
            self.jitter_s += (abs(d) - self.jitter_s) / 16.0
        self._prev_t = now
        for idx, is_start in self._mark_at.get(k, ()):
            if is_start:
                self.marks[idx].start_t = now
            else:
                self.marks[idx].end_t = now
        # RFC 3551 §4.1: the marker bit on a talkspurt's first packet (the stream is continuous).
        b1 = self.payload_type | (0x80 if k == 0 else 0)
        seq = (self.seq0 + k) & 0xFFFF
        ts = (self.ts0 + k * self.spp) & 0xFFFFFFFF
        data = _HEADER.pack(_B0, b1, seq, ts, self.ssrc) + self.payload(k)
        self.k = k + 1
        if not self._impaired:
            return [(0.0, data)]
        return self.impairer.apply(data)
