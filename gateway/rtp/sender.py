"""A pure RTP packetizer with an impairment model, for tests and load tools (the gateway never sends RTP).

`RtpSender` turns a script (audio, DTX silence, comfort noise, DTMF key presses, SSRC changes, junk)
into the nominal packet list a well-behaved endpoint would send, each with its send time on the media
clock. `Impairments.apply` then makes it look like a bad network: loss, duplicates, extra delay (which
reorders, or makes a packet late), random jitter — deterministic for a seed.

    sender = RtpSender("PCMU", seq=65500, timestamp=2**32 - 800)      # both wrap early
    sender.audio(pcm[:8000]).silence(400, comfort_noise=True).dtmf("5", 200).audio(pcm[8000:])
    sender.change_ssrc().audio(more)
    wire = Impairments(loss={10, 11}, duplicate={20}, delay={30: 0.05}).apply(sender.packets)
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Self

import numpy as np
from numpy.typing import NDArray

from gateway.audio import g711
from gateway.rtp.dtmf import DIGITS, TelephoneEvent
from gateway.rtp.packet import RtpPacket

PacketKind = Literal["audio", "cn", "dtmf", "junk"]
STATIC_PT = {"PCMU": 0, "PCMA": 8}
CLOCK_RATE = 8000


@dataclass(frozen=True, slots=True)
class ScheduledPacket:
    at: float  # send time, seconds from the start of the stream
    data: bytes
    index: int  # position in the nominal stream (before impairments)
    kind: PacketKind
    ssrc: int = 0
    seq: int = 0
    timestamp: int = 0
    payload: bytes = b""


class RtpSender:
    """Builds the nominal packets of one scripted RTP stream (pure; no sockets, no clock)."""

    def __init__(
        self,
        codec: Literal["PCMU", "PCMA"] = "PCMU",
        *,
        payload_type: int | None = None,
        ptime_ms: int = 20,
        ssrc: int | None = None,
        seq: int | None = None,
        timestamp: int | None = None,
        dtmf_payload_type: int = 101,
        cn_payload_type: int = 13,
        seed: int = 0,
    ) -> None:
        self._rng = random.Random(seed)
        self.codec = codec
        self.payload_type = STATIC_PT[codec] if payload_type is None else payload_type
        self.samples_per_packet = ptime_ms * CLOCK_RATE // 1000
        self.ptime_s = ptime_ms / 1000
        self.dtmf_payload_type = dtmf_payload_type
        self.cn_payload_type = cn_payload_type
        self.ssrc = self._rng.getrandbits(32) if ssrc is None else ssrc
        self.seq = self._rng.getrandbits(16) if seq is None else seq & 0xFFFF
        self.timestamp = self._rng.getrandbits(32) if timestamp is None else timestamp & 0xFFFFFFFF
        self.t = 0.0
        self.packets: list[ScheduledPacket] = []
        self._talkspurt = True  # the next audio packet starts a talkspurt (marker bit, RFC 3551 §4.1)

    # --- script ----------------------------------------------------------------------------------

    def audio(self, pcm: NDArray[np.int16] | bytes) -> Self:
        """Audio as int16 samples (encoded here) or ready G.711 codes; the last packet may be short."""
        codes = pcm if isinstance(pcm, bytes) else g711.encode(pcm, self.codec)
        spp = self.samples_per_packet
        for i in range(0, len(codes), spp):
            chunk = codes[i : i + spp]
            self._add("audio", self.payload_type, chunk, marker=self._talkspurt)
            self._talkspurt = False
            self._advance(len(chunk))
        return self

    def silence(self, ms: int, *, comfort_noise: bool = False, level: int = 60) -> Self:
        """A DTX pause: the timestamp and clock move on without audio packets. With `comfort_noise`, one
        RFC 3389 CN packet (noise level `level` −dBov) marks its start."""
        if comfort_noise:
            self._add("cn", self.cn_payload_type, bytes([level & 0x7F]), marker=False)
        self._advance(ms * CLOCK_RATE // 1000)
        self._talkspurt = True
        return self

    def dtmf(
        self,
        digit: str,
        duration_ms: int = 100,
        *,
        volume: int = 10,
        end_repeats: int = 3,
        repeat_same_seq: bool = True,
        drop_end: bool = False,
    ) -> Self:
        """One RFC 4733 key press: updates every ptime with a growing duration, then the end packet
        `end_repeats` times (§2.5.1.4; same sequence number by default, as Asterisk does). The audio
        clock moves on by the duration. `drop_end` leaves the end packets out (all of them lost)."""
        event = DIGITS.index(digit)
        total = duration_ms * CLOCK_RATE // 1000
        spp = self.samples_per_packet
        start_ts = self.timestamp
        t0 = self.t
        duration = 0
        first = True
        while duration + spp < total:
            duration += spp
            payload = TelephoneEvent(event, False, volume, duration).serialize()
            self._add("dtmf", self.dtmf_payload_type, payload, marker=first, ts=start_ts)
            first = False
            self.t += self.ptime_s
        if not drop_end:
            end = TelephoneEvent(event, True, volume, total).serialize()
            for k in range(end_repeats):
                same = repeat_same_seq and k > 0
                self._add("dtmf", self.dtmf_payload_type, end, marker=first, ts=start_ts, reuse_seq=same)
                first = False
                self.t += self.ptime_s
        self.t = t0 + total / CLOCK_RATE
        self.timestamp = (start_ts + total) & 0xFFFFFFFF
        self._talkspurt = True
        return self

    def change_ssrc(
        self, ssrc: int | None = None, *, seq: int | None = None, timestamp: int | None = None
    ) -> Self:
        """A new source (re-anchoring SBC, transfer): new SSRC, sequence and timestamp spaces."""
        self.ssrc = self._rng.getrandbits(32) if ssrc is None else ssrc
        self.seq = self._rng.getrandbits(16) if seq is None else seq & 0xFFFF
        self.timestamp = self._rng.getrandbits(32) if timestamp is None else timestamp & 0xFFFFFFFF
        self._talkspurt = True
        return self

    def jump_sequence(self, by: int) -> Self:
        """Skip sequence numbers without loss of media (a sender restart keeping its SSRC)."""
        self.seq = (self.seq + by) & 0xFFFF
        return self

    def junk(self, data: bytes) -> Self:
        """A datagram that is not RTP (or not for this stream), sent now."""
        self.packets.append(ScheduledPacket(self.t, data, len(self.packets), "junk"))
        return self

    # --- internals -------------------------------------------------------------------------------

    def _add(
        self,
        kind: PacketKind,
        pt: int,
        payload: bytes,
        *,
        marker: bool,
        ts: int | None = None,
        reuse_seq: bool = False,
    ) -> None:
        if reuse_seq:
            self.seq = (self.seq - 1) & 0xFFFF
        timestamp = self.timestamp if ts is None else ts
        data = RtpPacket(pt, self.seq, timestamp, self.ssrc, payload, marker).serialize()
        self.packets.append(
            ScheduledPacket(self.t, data, len(self.packets), kind, self.ssrc, self.seq, timestamp, payload)
        )
        self.seq = (self.seq + 1) & 0xFFFF

    def _advance(self, samples: int) -> None:
        self.timestamp = (self.timestamp + samples) & 0xFFFFFFFF
        self.t += samples / CLOCK_RATE


@dataclass(frozen=True, slots=True)
class Impairments:
    """What the network does to the nominal packets. Index sets refer to `ScheduledPacket.index`;
    rates draw independently per packet from `seed`. Extra delay reorders (or, beyond the receiver's
    playout delay, makes a packet late)."""

    loss: frozenset[int] = frozenset()
    duplicate: frozenset[int] = frozenset()
    delay: Mapping[int, float] = field(default_factory=dict)
    loss_rate: float = 0.0
    duplicate_rate: float = 0.0
    jitter_s: float = 0.0  # uniform extra delay in [0, jitter_s]
    seed: int = 0

    @classmethod
    def of(
        cls,
        *,
        loss: Iterable[int] = (),
        duplicate: Iterable[int] = (),
        delay: Mapping[int, float] | None = None,
        **rates: float,
    ) -> Impairments:
        seed = int(rates.pop("seed", 0))
        return cls(frozenset(loss), frozenset(duplicate), dict(delay or {}), seed=seed, **rates)

    def apply(self, packets: Iterable[ScheduledPacket]) -> list[ScheduledPacket]:
        """The packets as they leave, in sending order (stable for equal times)."""
        rng = random.Random(self.seed)
        out: list[tuple[float, int, ScheduledPacket]] = []
        order = 0
        for p in packets:
            if p.index in self.loss or (self.loss_rate and rng.random() < self.loss_rate):
                continue
            at = p.at + self.delay.get(p.index, 0.0)
            if self.jitter_s:
                at += rng.uniform(0.0, self.jitter_s)
            copies = (
                2
                if p.index in self.duplicate or (self.duplicate_rate and rng.random() < self.duplicate_rate)
                else 1
            )
            for _ in range(copies):
                out.append(
                    (
                        at,
                        order,
                        ScheduledPacket(at, p.data, p.index, p.kind, p.ssrc, p.seq, p.timestamp, p.payload),
                    )
                )
                order += 1
        out.sort(key=lambda x: (x[0], x[1]))
        return [p for _, _, p in out]
