"""Test helpers for the media core: a fake-clock driver and an independent timeline oracle."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import soxr
from numpy.typing import NDArray

from gateway.audio import g711
from gateway.audio.resample import UpsampleBatch
from gateway.rtp.dtmf import TelephoneEvent
from gateway.rtp.media import AudioBlock, DtmfDigit, MediaConfig, MediaCore, MediaEvent, MediaTimeout
from gateway.rtp.sender import ScheduledPacket
from gateway.rtp.seq import Unwrapper
from gateway.sdp import MediaPlan

SRC = ("192.0.2.7", 40000)
PLAN_PCMU = MediaPlan(0, "PCMU", 0, SRC[0], SRC[1], SRC[1] + 1, dtmf_payload_type=101, cn_payload_type=13)
PLAN_PCMA = MediaPlan(0, "PCMA", 8, SRC[0], SRC[1], SRC[1] + 1, dtmf_payload_type=101, cn_payload_type=13)


def speech_like(n: int, seed: int = 0) -> NDArray[np.int16]:
    """A deterministic non-trivial signal (tones + noise), well inside full scale."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 8000
    x = 6000 * np.sin(2 * np.pi * 440 * t) + 3000 * np.sin(2 * np.pi * 1230 * t) + rng.normal(0, 800, n)
    return x.astype(np.int16)


@dataclass
class Driver:
    """Feeds a MediaCore the way the asyncio adapter would, on a fake clock."""

    plan: MediaPlan = PLAN_PCMU
    config: MediaConfig = field(default_factory=MediaConfig)
    now: float = 0.0
    events: list[MediaEvent] = field(default_factory=list)
    batch: UpsampleBatch | None = None  # resample with other calls: `take()` after the batch runs

    def __post_init__(self) -> None:
        self.core = MediaCore(self.plan, self.config, self.now, upsample_batch=self.batch)

    def take(self) -> None:
        """The events held behind audio the batch has resampled since."""
        self.events += self.core.take_events()

    def run_until(self, t: float) -> None:
        while True:
            deadline = self.core.next_deadline()
            if deadline is None or deadline > t:
                break
            self.now = max(self.now, deadline)
            self.events += self.core.handle_timer(self.now)
            again = self.core.next_deadline()
            if again is not None and again <= self.now:
                raise AssertionError(f"core asks for a timer at {again} after handling {self.now}")
        self.now = max(self.now, t)

    def send(self, data: bytes, at: float, addr: tuple[str, int] = SRC) -> None:
        self.run_until(at)
        self.events += self.core.datagram(data, addr, self.now)

    def play(
        self, packets: Iterable[ScheduledPacket], start: float = 0.0, addr: tuple[str, int] = SRC
    ) -> None:
        for p in packets:
            self.send(p.data, start + p.at, addr)

    def close(self, at: float | None = None) -> None:
        if at is not None:
            self.run_until(at)
        self.events += self.core.close(self.now)

    @property
    def blocks(self) -> list[AudioBlock]:
        return [e for e in self.events if isinstance(e, AudioBlock)]

    @property
    def audio(self) -> NDArray[np.float32]:
        blocks = self.blocks
        return np.concatenate([b.pcm for b in blocks]) if blocks else np.zeros(0, np.float32)

    @property
    def digits(self) -> list[tuple[str, int, int]]:
        return [(e.digit, e.start_ms, e.duration_ms) for e in self.events if isinstance(e, DtmfDigit)]

    @property
    def timeouts(self) -> list[MediaTimeout]:
        return [e for e in self.events if isinstance(e, MediaTimeout)]


@dataclass
class Expected:
    pcm8k: NDArray[np.int16]
    digits: list[tuple[str, int, int]]


def oracle(delivered: Sequence[ScheduledPacket], codec: str = "PCMU") -> Expected:
    """The media timeline the contract promises for delivered packets without timing trouble:
    per source, positions follow timestamps from the source's first packet, which lands where the
    timeline ends; gaps are zeros; DTMF covers silence and is reported once with its first-seen start;
    the timeline is extended to the end of the last DTMF event at close."""
    out: list[NDArray[np.int16]] = []
    cursor = 0
    ssrc = None
    unwrap = Unwrapper(32)
    offset = 0
    seen: set[tuple[int, int]] = set()
    digits: dict[tuple[int, int], tuple[str, int, int]] = {}
    extent = 0
    for p in sorted(delivered, key=lambda p: p.index):  # the receiver undoes reordering
        if p.kind == "junk" or ((p.ssrc, p.seq) in seen and p.kind != "dtmf"):
            continue
        seen.add((p.ssrc, p.seq))
        if p.ssrc != ssrc:
            ssrc = p.ssrc
            unwrap = Unwrapper(32)
            offset = cursor - unwrap.unwrap(p.timestamp)
        pos = unwrap.unwrap(p.timestamp) + offset
        if p.kind == "dtmf":
            ev = TelephoneEvent.parse(p.payload)
            key = (p.ssrc, p.timestamp)
            start = pos // 8
            old = digits.get(key)
            dur = max(old[2] if old else 0, ev.duration)
            digits[key] = ("0123456789*#ABCD"[ev.event], start, dur)
            extent = max(extent, pos + ev.duration)
            continue
        if pos > cursor:
            out.append(np.zeros(pos - cursor, np.int16))
            cursor = pos
        if p.kind == "audio":
            out.append(g711.decode(p.payload, codec))  # type: ignore[arg-type]
            cursor += len(p.payload)
    if extent > cursor:
        out.append(np.zeros(extent - cursor, np.int16))
    pcm = np.concatenate(out) if out else np.zeros(0, np.int16)
    return Expected(pcm, [(d, s, round(n / 8)) for d, s, n in digits.values()])


def upsample(pcm8k: NDArray[np.int16]) -> NDArray[np.float32]:
    return np.clip(soxr.resample(pcm8k.astype(np.float32) / 32768, 8000, 16000, quality="HQ"), -1, 1)


def assert_audio_matches(got: NDArray[np.float32], pcm8k: NDArray[np.int16]) -> None:
    assert len(got) == 2 * len(pcm8k), f"timeline {len(got)} samples, expected {2 * len(pcm8k)}"
    diff = np.abs(got - upsample(pcm8k))
    assert diff.max() < 1e-5, f"max difference {diff.max()} at {int(diff.argmax())}"


def read_pcap_rtp(path: str) -> list[tuple[float, bytes]]:
    """(capture time, UDP payload) of every IPv4/UDP packet of a classic libpcap file (Ethernet)."""
    import struct
    from pathlib import Path

    data = Path(path).read_bytes()
    magic = struct.unpack("<I", data[:4])[0]
    endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    (linktype,) = struct.unpack(endian + "I", data[20:24])
    assert linktype == 1, f"{path}: link type {linktype}, expected Ethernet"
    out: list[tuple[float, bytes]] = []
    offset = 24
    while offset + 16 <= len(data):
        sec, usec, incl, _ = struct.unpack(endian + "IIII", data[offset : offset + 16])
        frame = data[offset + 16 : offset + 16 + incl]
        offset += 16 + incl
        ihl = (frame[14] & 0x0F) * 4
        out.append((sec + usec / 1e6, frame[14 + ihl + 8 :]))
    return out
