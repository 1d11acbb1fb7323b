"""What one replay run does: a frozen description built by the CLI (or a test) and read by the runner.

Nothing here reads the environment; `tools.replay.cli` fills the defaults from `gateway.config.Settings`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tools.replay.siprec import VENDORS

Codec = Literal["PCMU", "PCMA"]
Transport = Literal["udp", "tcp"]

# --find-capacity: the longest wait before a level for a quiet gateway (tools.replay.capacity).
DEFAULT_SETTLE_S = 60.0


@dataclass(frozen=True, slots=True)
class Impairments:
    """Network impairments applied per RTP packet (independent draws, seeded per call)."""

    loss: float = 0.0  # probability a packet is never sent
    jitter_ms: float = 0.0  # extra send delay, uniform in [0, jitter_ms]; above ptime it also reorders
    reorder: float = 0.0  # probability a packet is held back and sent after the next one
    duplicate: float = 0.0  # probability a packet is sent twice

    def __post_init__(self) -> None:
        for name in ("loss", "reorder", "duplicate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
        if self.jitter_ms < 0:
            raise ValueError(f"jitter_ms must be >= 0, got {self.jitter_ms}")

    @property
    def any(self) -> bool:
        return bool(self.loss or self.jitter_ms or self.reorder or self.duplicate)


@dataclass(frozen=True, slots=True)
class LanguageMix:
    """Call languages with weights, e.g. `en-US:0.7,uk-UA:0.3`; calls get them in exact proportion."""

    weights: tuple[tuple[str, float], ...] = (("en-US", 1.0),)

    @classmethod
    def parse(cls, text: str) -> LanguageMix:
        items: list[tuple[str, float]] = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lang, sep, weight = part.rpartition(":")
            if not sep:
                lang, weight = part, "1"
            lang = lang.strip()
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", lang):
                raise ValueError(f"bad language tag {lang!r} in {text!r}")
            try:
                w = float(weight)
            except ValueError:
                raise ValueError(f"bad weight {weight!r} for {lang} in {text!r}") from None
            if w <= 0:
                raise ValueError(f"weight of {lang} must be > 0 in {text!r}")
            items.append((lang, w))
        if not items:
            raise ValueError("empty language list")
        return cls(tuple(items))

    def assign(self, n_calls: int) -> list[str]:
        """Languages for calls 0..n-1 by smooth weighted round robin: every prefix of the list is as
        close to the weights as whole calls allow (7 of 10 calls en-US for 0.7, not 'about 7')."""
        total = sum(w for _, w in self.weights)
        current = [0.0] * len(self.weights)
        out: list[str] = []
        for _ in range(n_calls):
            for i, (_, w) in enumerate(self.weights):
                current[i] += w
            best = max(range(len(current)), key=lambda i: current[i])
            current[best] -= total
            out.append(self.weights[best][0])
        return out

    def __str__(self) -> str:
        return ",".join(f"{lang}:{w:g}" for lang, w in self.weights)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How calls arrive. `calls` is the concurrency target; `total` calls are placed in all
    (default: `calls`); with `duration_s` the run keeps placing calls until then instead."""

    calls: int = 1
    total: int | None = None
    cps: float = 10.0  # new calls per second at most
    ramp_s: float = 0.0  # concurrency target rises linearly from 1 to `calls` over this time
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.calls < 1:
            raise ValueError("calls must be >= 1")
        if self.total is not None and self.total < 1:
            raise ValueError("total must be >= 1")
        if self.cps <= 0:
            raise ValueError("cps must be > 0")
        if self.ramp_s < 0:
            raise ValueError("ramp must be >= 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration must be > 0")


@dataclass(frozen=True, slots=True)
class MediaConfig:
    codec: Codec = "PCMU"  # offered first; the other G.711 law is offered too
    ptime_ms: int = 20
    call_seconds: float = 0.0  # repeat audio files until a call carries this much; 0 = one file per call
    lead_ms: int = 200  # silence before the first file (a phone's line noise before the caller talks)
    gap_ms: int = 1200  # silence between files within a call
    tail_ms: int = 2000  # silence after the last file, before BYE, so the gateway can end the utterance
    pause_ms: int = 600  # a silence at least this long ends an utterance (VAD rule; see docs/replay.md)

    def __post_init__(self) -> None:
        if self.ptime_ms not in (10, 20, 30, 40, 50, 60):
            raise ValueError(f"ptime must be one of 10/20/30/40/50/60 ms, got {self.ptime_ms}")
        for name in ("lead_ms", "gap_ms", "tail_ms", "pause_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.call_seconds < 0:
            raise ValueError("call_seconds must be >= 0")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay run. Every field has a default that works against a local `ttg serve`."""

    target: tuple[str, int] = ("127.0.0.1", 5060)
    transport: Transport = "udp"
    local_ip: str = "127.0.0.1"
    sip_port: int = 0  # 0 = any free port
    rtp_port_min: int = 40000
    rtp_port_max: int = 49998
    from_user: str = "replay"
    to_user: str = "ttg"
    headers: tuple[tuple[str, str], ...] = ()  # extra headers on every INVITE
    lang: LanguageMix = field(default_factory=LanguageMix)
    lang_header: str = "X-Language"
    call_id_prefix: str = ""  # "" = a random one per run; Call-IDs are `{prefix}-{n:06d}@{local_ip}`
    # SIPREC recording sessions instead of trunk calls: a vendor of tools.replay.siprec.VENDORS, or
    # "all" (call n takes the n-th vendor, round robin); "" = plain calls.
    siprec: str = ""
    leg_offset_ms: int = 1500  # SIPREC: each further leg starts speaking this much later (turn taking)

    audio_dir: Path | None = None
    generate: int = 0  # generate this many espeak-ng files (into audio_dir, or a temp dir)
    media: MediaConfig = field(default_factory=MediaConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    impairments: Impairments = field(default_factory=Impairments)
    seed: int = 1

    redis_url: str | None = "redis://127.0.0.1:6379/0"  # None = do not read events (SIP/RTP load only)
    stream: str = "ttg:transcripts"
    drain_s: float = 15.0  # after a call hangs up, how long to wait for its call_end event
    metrics_url: str | None = "http://127.0.0.1:9108/metrics"  # None = do not scrape
    scrape_interval_s: float = 1.0

    setup_timeout_s: float = 32.0  # INVITE → final response (Timer B at T1 = 500 ms)
    t1_s: float = 0.5  # RFC 3261 T1
    t2_s: float = 4.0  # RFC 3261 T2
    run_timeout_s: float | None = None  # hard stop for the whole run (None = derived from the load)

    out_dir: Path | None = None  # write report.json, report.md and plots here
    progress: bool = False  # rich live view

    def __post_init__(self) -> None:
        if not 0 < self.rtp_port_min <= self.rtp_port_max < 65536:
            raise ValueError("bad RTP port range")
        if self.siprec and self.siprec != "all" and self.siprec not in VENDORS:
            raise ValueError(f"unknown SIPREC vendor {self.siprec!r} (one of all, {', '.join(VENDORS)})")
        if self.audio_dir is None and self.generate <= 0:
            raise ValueError("give an audio folder or --generate N")
