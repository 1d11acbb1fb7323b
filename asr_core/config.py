"""Engine configuration: plain frozen dataclasses that the cores take (no environment reading here).

The edge builds an `EngineConfig` field by field from its own settings (the gateway: `engine_config` in
gateway/daemon.py; the CLI tools: their flags); model hyperparameters are not settings, they come from
the bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from asr_core.vad import VadConfig

DecoderMode = Literal["workers", "batched", "device"]
DECODER_MODES: tuple[DecoderMode, ...] = ("workers", "batched", "device")
WaitPolicy = Literal["adaptive", "fixed"]
WAIT_POLICIES: tuple[WaitPolicy, ...] = ("adaptive", "fixed")
WordsMode = Literal["off", "final", "all"]
WORDS_MODES: tuple[WordsMode, ...] = ("off", "final", "all")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Most chunks (one per stream) in one encoder step.
    max_batch: int = 64
    # A ready chunk waits at most this long for a fuller batch (0 = step as soon as anything is ready).
    max_wait_ms: float = 100.0
    # "adaptive": wait a few times the measured fixed cost of a step (capped by max_wait_ms), so that
    # an accelerator whose step costs the same for 1 or 128 rows steps on full batches while a CPU,
    # whose step cost grows with every row, hardly waits. "fixed": always max_wait_ms.
    wait_policy: WaitPolicy = "adaptive"
    # Chunks a stream may have queued before the encoder; beyond it the oldest droppable one is dropped
    # (16 x 320 ms = 5 s of audio at the default lookahead).
    max_queued_chunks: int = 16
    # Chunks of one stream that may be encoded but not yet decoded. Past it the stream is not scheduled,
    # so a slow decoder backs up into the bounded encoder queue, where the overflow is counted.
    max_undecoded_chunks: int = 2

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.wait_policy not in WAIT_POLICIES:
            raise ValueError(f"wait_policy must be one of {WAIT_POLICIES}, got {self.wait_policy!r}")
        if self.max_queued_chunks < 2:
            # The first and the last chunk of a stream are never dropped, so a bound of 1 could not hold.
            raise ValueError(f"max_queued_chunks must be >= 2, got {self.max_queued_chunks}")
        if self.max_undecoded_chunks < 1:
            raise ValueError(f"max_undecoded_chunks must be >= 1, got {self.max_undecoded_chunks}")


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    # "workers": each stream pinned to one of `workers` threads that decodes its chunks one by one.
    # "batched": each worker advances all its due streams in one batched greedy pass.
    # "device": every row of an encoder step is decoded on the accelerator (predictor states stay on the
    # device) by the device decoder's own thread while the MLX thread runs the next step; the workers
    # only assemble transcripts.
    mode: DecoderMode = "batched"
    workers: int = 2
    # Device mode only: decode a step's rows on a thread of their own, beside the next encoder step
    # (True), or on the MLX thread right after the step that made them (False: one MLX thread, each
    # step then decodes before the next one starts). False by default: a second MLX thread slowed the
    # encoder's steps more than the overlap gained (docs/benchmarks.md).
    device_thread: bool = False

    def __post_init__(self) -> None:
        if self.mode not in DECODER_MODES:
            raise ValueError(f"decoder mode must be one of {DECODER_MODES}, got {self.mode!r}")
        if self.workers < 1:
            raise ValueError(f"decoder workers must be >= 1, got {self.workers}")


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """When a segment (utterance) is closed with a final transcript, and how partials are throttled.

    A segment with text ends when no token came for `blank_ms` and the audio of those frames stayed
    below `energy_db` (dBFS) -- a pause. `max_blank_ms` closes it on the token silence alone (a noisy
    line whose floor never drops below `energy_db`); `energy_db=None` uses the token silence alone at
    `blank_ms` (so does 0 dBFS, which every frame is below). `max_segment_ms` bounds one segment in
    continuous speech: the segment is closed before the next word-initial token once it is that long.

    Defaults: 800 ms of pause sits among the end-of-utterance silences of deployed recognizers
    (AssemblyAI 700 ms, Microsoft SAPI `endsilence` 1000 ms; sherpa/Kaldi's rule 1.2 s after speech)
    and below the ~1 s gaps between a caller's sentences; the token silence alone needs longer
    (2 s; sherpa uses 2.4 s) because RNN-T tokens of a slow word can be far apart. -45 dBFS is ~20 dB
    under nominal telephone speech (ITU-T P.56: -26 dBov) and above the usual line floor (-55 to
    -70 dBov); a noisier line falls back to `max_blank_ms`. 30 s per segment keeps finals coming in
    monologues (sherpa: 20 s).
    """

    blank_ms: int = 800
    energy_db: float | None = -45.0
    max_blank_ms: int = 2000
    max_segment_ms: int = 30_000
    # Partials only when the text grew, at most one per this interval per stream (0 = every growth).
    partial_interval_ms: int = 300
    partials: bool = True
    # Which events carry `words` (times and confidence): finals only, partials too, or none.
    words: WordsMode = "final"

    def __post_init__(self) -> None:
        if self.blank_ms <= 0:
            raise ValueError(f"endpoint blank_ms must be > 0, got {self.blank_ms}")
        if self.max_blank_ms < self.blank_ms:
            raise ValueError(
                f"endpoint max_blank_ms ({self.max_blank_ms}) must be >= blank_ms ({self.blank_ms})"
            )
        if self.max_segment_ms <= 0:
            raise ValueError(f"max_segment_ms must be > 0, got {self.max_segment_ms}")
        if self.partial_interval_ms < 0:
            raise ValueError(f"partial_interval_ms must be >= 0, got {self.partial_interval_ms}")
        if self.words not in WORDS_MODES:
            raise ValueError(f"words must be one of {WORDS_MODES}, got {self.words!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # Audio-driven endpointing on each stream's front end (asr_core.vad); kind "off": token rules only.
    vad: VadConfig = field(default_factory=VadConfig)
    # StreamOptions.language "" / lookahead None fall back to these (None = the bundle's default).
    default_language: str = "auto"
    default_lookahead: int | None = None
    # Threads of the MLX CPU backend's matmuls (the preloaded OpenBLAS), set when the engine starts on
    # a CPU; None leaves them as the process has them. A step's matmuls are small (a few rows per
    # call), so more threads mostly spin on cores that the calls' audio and signalling need.
    cpu_threads: int | None = None
    # The streams this engine is expected to hold at once (its share of the gateway's call limit). A
    # compiled (GPU) encoder sizes its slot pools for them at warm-up, within its own limit: a pool grown
    # later makes every compiled call trace again at the new shape, during live steps. 0: the batch limit.
    streams: int = 0


def engine_config_to_json(config: EngineConfig) -> dict[str, Any]:
    """The config as plain data (for a process that runs the engine elsewhere)."""
    from dataclasses import asdict

    return asdict(config)


def engine_config_from_json(data: Mapping[str, Any]) -> EngineConfig:
    """Inverse of `engine_config_to_json`; unknown keys are errors (both ends are this code)."""
    return EngineConfig(
        scheduler=SchedulerConfig(**data["scheduler"]),
        decoder=DecoderConfig(**data["decoder"]),
        endpoint=EndpointConfig(**data["endpoint"]),
        vad=VadConfig(**data["vad"]),
        **{k: v for k, v in data.items() if k not in ("scheduler", "decoder", "endpoint", "vad")},
    )
