"""Streaming voice-activity detection per stream: when did the caller stop speaking? Pure.

`SpeechEndDetector(VadConfig)` takes the stream's 16 kHz PCM in any push sizes and returns a
`SpeechEnd` each time speech stops: a run of speech (at least `min_speech_ms` of speech frames,
so a click does not count) followed by `hangover_ms` of non-speech frames. The decision is made on
the sample that completes the hang-over, so it depends only on the audio, never on push sizes or
wall time. The engine answers a `SpeechEnd` by flushing the stream's pending audio through the
encoder and closing the utterance (docs/architecture.md, "Endpointing").

Frame classifiers (10 ms frames):
- `webrtc` (default): the WebRTC VAD (GMM on band energies, `webrtcvad-wheels`, aggressiveness
  `webrtc_mode` 0-3) gated by energy: a frame is speech only when WebRTC says so and its power is at
  least `energy_db` dBFS. Chosen from measurements on telephone audio (docs/benchmarks.md, "Voice
  activity"): energy alone never closes on a line with noise above its threshold; WebRTC alone
  flags ~90 ms of the quiet tail after each utterance as speech; the gate cuts that tail on clean
  lines and stays open on noisy ones, where WebRTC decides.
- `energy`: frame power at least `energy_db` dBFS (the assembler's quiet-audio threshold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
from numpy.typing import NDArray

VadKind = Literal["webrtc", "energy", "off"]
VAD_KINDS: tuple[VadKind, ...] = ("webrtc", "energy", "off")
SAMPLE_RATE_HZ = 16_000
FRAME_MS = 10
FRAME_SAMPLES = SAMPLE_RATE_HZ * FRAME_MS // 1000

F32 = NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class VadConfig:
    """`kind="off"`: no audio-driven endpointing (the assembler's token-silence rules alone)."""

    kind: VadKind = "webrtc"
    # Non-speech after speech before the speech counts as ended. It adds directly to time to final;
    # shorter ends utterances at commas more often. Pipecat's default stop wait is 200 ms; 150 ms
    # leaves room for the media block and the flush inside a 250 ms time to final (docs/benchmarks.md).
    hangover_ms: int = 150
    # A run of speech frames must be this long to open an utterance (clicks, a cough of noise).
    min_speech_ms: int = 60
    webrtc_mode: int = 3
    energy_db: float = -45.0

    def __post_init__(self) -> None:
        if self.kind not in VAD_KINDS:
            raise ValueError(f"vad kind must be one of {VAD_KINDS}, got {self.kind!r}")
        if self.hangover_ms < FRAME_MS:
            raise ValueError(f"vad hangover_ms must be >= {FRAME_MS}, got {self.hangover_ms}")
        if self.min_speech_ms < FRAME_MS:
            raise ValueError(f"vad min_speech_ms must be >= {FRAME_MS}, got {self.min_speech_ms}")
        if not 0 <= self.webrtc_mode <= 3:
            raise ValueError(f"webrtc_mode must be 0..3, got {self.webrtc_mode}")

    @property
    def enabled(self) -> bool:
        return self.kind != "off"


@dataclass(frozen=True, slots=True)
class SpeechEnd:
    """Speech stopped at sample `speech_end` (end of its last speech frame); known at `decided_at`."""

    speech_end: int
    decided_at: int


class FrameClassifier(Protocol):
    def speech(self, frames: F32) -> NDArray[np.bool_]:
        """Which of the (n, 160) 10 ms frames of 16 kHz float PCM are speech, in order."""


class EnergyClassifier:
    def __init__(self, threshold_db: float) -> None:
        # Compare mean power with the threshold's linear value: no log per frame.
        self._min_power = 10.0 ** (threshold_db / 10.0)

    def speech(self, frames: F32) -> NDArray[np.bool_]:
        return np.einsum("ij,ij->i", frames, frames) >= self._min_power * frames.shape[1]


class WebRtcClassifier:
    """The WebRTC VAD, optionally gated by an energy classifier: a frame is speech only when both
    say so, and WebRTC only sees the frames the gate lets through. WebRTC keeps flagging the quiet
    tail after speech (its own hang-over), which the gate cuts; on a noisy line the gate stays open
    and WebRTC alone decides."""

    def __init__(self, mode: int, gate: FrameClassifier | None = None) -> None:
        import webrtcvad

        self._vad = webrtcvad.Vad(mode)
        self._gate = gate

    def speech(self, frames: F32) -> NDArray[np.bool_]:
        out = np.ones(len(frames), bool) if self._gate is None else self._gate.speech(frames)
        data = np.clip(np.rint(frames * 32768.0), -32768, 32767).astype("<i2").tobytes()
        size, is_speech = 2 * frames.shape[1], self._vad.is_speech
        for i in np.flatnonzero(out).tolist():
            out[i] = is_speech(data[i * size : (i + 1) * size], SAMPLE_RATE_HZ)
        return out


def make_classifier(config: VadConfig) -> FrameClassifier:
    if config.kind == "webrtc":
        return WebRtcClassifier(config.webrtc_mode, EnergyClassifier(config.energy_db))
    if config.kind == "energy":
        return EnergyClassifier(config.energy_db)
    raise ValueError("the VAD is off")


class SpeechEndDetector:
    """Driven by `push(pcm)` in stream order; returns the speech ends decided within that audio.

    Speech is a run of at least `min_speech_ms` of speech frames, both to open an utterance and to
    keep one open, so a click inside the hang-over neither opens nor extends one (as replay's rule
    ignores short runs). The end is the end of the last such run.
    """

    def __init__(self, config: VadConfig, classifier: FrameClassifier | None = None) -> None:
        self.config = config
        self._classify = classifier or make_classifier(config)
        self._hang_frames = -(-config.hangover_ms // FRAME_MS)
        self._onset_frames = -(-config.min_speech_ms // FRAME_MS)
        self._buf = np.zeros(0, np.float32)
        self._frame = 0  # index of the next frame to classify
        self._run = 0  # speech frames in a row, up to the last frame classified
        self._quiet = 0  # frames since the last frame of a run of speech (of min_speech_ms or more)
        self._in_speech = False
        self._last_speech_end = 0  # sample after the last speech frame of the open utterance
        self._onset = -1  # first sample of the speech run that opened the last utterance

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    def silent_since(self, sample: int) -> bool:
        """No utterance opened from `sample` to the end of the audio pushed so far, and none is
        opening: its last frame is not speech (a run too short to count yet may grow into one)."""
        return not self._in_speech and self._onset < sample and self._run == 0

    def push(self, pcm: F32) -> list[SpeechEnd]:
        x = np.asarray(pcm, np.float32).reshape(-1)
        buf = np.concatenate([self._buf, x]) if self._buf.size else x
        n = buf.size // FRAME_SAMPLES
        ends: list[SpeechEnd] = []
        frames = buf[: n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES)
        for speech in self._classify.speech(frames).tolist() if n else []:
            self._frame += 1
            self._run = self._run + 1 if speech else 0
            if self._run >= self._onset_frames:
                # A run long enough to be speech: it opens an utterance or keeps it open.
                if not self._in_speech:
                    self._onset = (self._frame - self._run) * FRAME_SAMPLES
                self._in_speech = True
                self._quiet = 0
                self._last_speech_end = self._frame * FRAME_SAMPLES
                continue
            if not self._in_speech:
                continue
            # Silence, or a run too short to be speech yet: a click counts as silence, but while a
            # run goes on the decision waits to see whether it grows into speech (which resets the
            # count above), so a pause shorter than the hang-over never ends an utterance.
            self._quiet += 1
            if self._quiet >= self._hang_frames and self._run == 0:
                self._in_speech = False
                self._quiet = 0
                ends.append(SpeechEnd(self._last_speech_end, self._frame * FRAME_SAMPLES))
        self._buf = buf[n * FRAME_SAMPLES :].copy()
        return ends
