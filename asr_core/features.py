"""Exact streaming log-mel front end (model_spec.md §4; NeMo `FilterbankFeatures` / HF
`NemotronAsrStreamingFeatureExtractor`, which agree to 0.0).

Recipe: 16 kHz float PCM in [-1, 1] -> preemphasis y[n] = x[n] - 0.97 x[n-1] (y[0] = x[0]) -> STFT
(n_fft 512, hop 160, symmetric Hann of 400 taps centered in the 512 frame, `center=True` with zero
padding) -> power -> mel filterbank (bundle's melfilters.f32) -> log(mel + 2^-24). No dither, no
normalization. A stream of L samples has floor(L / 160) frames.

Streaming: frame t is centered on sample 160·t; its nonzero window taps cover samples 160t-200 …
160t+199, so it is final once sample 160t+199 has arrived (the other taps of the 512-point frame are
multiplied by window zeros). Every frame is computed from exactly those 400 samples whatever the push
pattern, so the frames are bit-identical for any split of the audio. At `finish()` the stream is
zero-padded after preemphasis (as the reference pads) and the remaining frame, if any, is emitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]


# Slaney mel filterbank: the same construction as librosa's `filters.mel(norm="slaney")` / HF
# `mel_filter_bank(norm="slaney", mel_scale="slaney")`: triangles between mel-spaced band edges over
# the rfft bin frequencies, each scaled by 2 / (upper edge - lower edge) in Hz. Computed in float64,
# returned float32 (model_spec.md §4). Bundles that ship no filterbank file get it from here.
_F_SP = 200.0 / 3.0  # Hz per mel in the linear part (below 1 kHz)
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP  # 15
_LOGSTEP = np.log(6.4) / 27.0  # mel step of the log part


def hz_to_mel(hz: NDArray[np.float64]) -> NDArray[np.float64]:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    log_part = hz >= _MIN_LOG_HZ
    mel[log_part] = _MIN_LOG_MEL + np.log(hz[log_part] / _MIN_LOG_HZ) / _LOGSTEP
    return mel


def mel_to_hz(mel: NDArray[np.float64]) -> NDArray[np.float64]:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * _F_SP
    log_part = mel >= _MIN_LOG_MEL
    hz[log_part] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel[log_part] - _MIN_LOG_MEL))
    return hz


def slaney_mel_filters(
    sampling_rate: int = 16000,
    n_fft: int = 512,
    n_mels: int = 128,
    fmin: float = 0.0,
    fmax: float | None = None,
) -> NDArray[np.float32]:
    """(n_mels, n_fft // 2 + 1) float32 filterbank."""
    fmax = sampling_rate / 2 if fmax is None else fmax
    fft_hz = np.linspace(0.0, sampling_rate / 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(
        np.linspace(hz_to_mel(np.array([fmin]))[0], hz_to_mel(np.array([fmax]))[0], n_mels + 2)
    )
    widths = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]
    return weights.astype(np.float32)


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """The bundle config's `features` block (the loader validates it; only slaney mels exist)."""

    sampling_rate: int = 16000
    n_fft: int = 512
    hop_length: int = 160
    win_length: int = 400
    n_mels: int = 128
    preemphasis: float = 0.97
    log_zero_guard: float = 2.0**-24
    mel_norm: str = "slaney"
    mel_scale: str = "slaney"
    fmin: float = 0.0
    fmax: float = 8000.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureConfig:
        """From the bundle config's `features` block (other keys ignored; validation is the loader's)."""
        ints = ("sampling_rate", "n_fft", "hop_length", "win_length", "n_mels")
        floats = ("preemphasis", "log_zero_guard", "fmin", "fmax")
        kw: dict[str, Any] = {k: int(d[k]) for k in ints if k in d}
        kw.update({k: float(d[k]) for k in floats if k in d})
        kw.update({k: str(d[k]) for k in ("mel_norm", "mel_scale") if k in d})
        return cls(**kw)

    @property
    def half_window(self) -> int:
        return self.win_length // 2

    @property
    def n_bins(self) -> int:
        return self.n_fft // 2 + 1


def _window(cfg: FeatureConfig) -> NDArray[np.float64]:
    # Symmetric Hann (torch.hann_window(periodic=False) == np.hanning)
    return np.hanning(cfg.win_length)


class MelFrames:
    """Frames (n, win_length) of preemphasized samples -> (n, n_mels) log-mel, in float64.

    Holds only read-only arrays (the window, the filterbank as float64), so one serves every stream
    of a model: the calls of a process share one filterbank (263 kB at 257 x 128) that stays in the
    core's cache, instead of a copy each to build, hold and take turns evicting.
    """

    def __init__(self, filters: F32, cfg: FeatureConfig | None = None) -> None:
        cfg = cfg or FeatureConfig()
        n_bins = cfg.n_fft // 2 + 1
        if filters.shape != (cfg.n_mels, n_bins):
            raise ValueError(f"mel filters must be ({cfg.n_mels}, {n_bins}), got {filters.shape}")
        self.cfg = cfg
        self.window = _window(cfg)
        self.filters_t = np.ascontiguousarray(filters.astype(np.float64).T)
        self.window.flags.writeable = False
        self.filters_t.flags.writeable = False
        self.offset = (cfg.n_fft - cfg.win_length) // 2  # window sits centered in the FFT frame

    def __call__(self, frames: NDArray[np.float64]) -> F32:
        cfg = self.cfg
        padded = np.zeros((frames.shape[0], cfg.n_fft))
        np.multiply(frames, self.window, out=padded[:, self.offset : self.offset + cfg.win_length])
        spec = np.fft.rfft(padded, axis=1)
        power = spec.real**2 + spec.imag**2
        return np.log(power @ self.filters_t + cfg.log_zero_guard).astype(np.float32)


def _preemphasize(x: NDArray[np.float64], prev: float, coef: float) -> NDArray[np.float64]:
    y = np.empty_like(x)
    y[0] = x[0] - coef * prev
    y[1:] = x[1:] - coef * x[:-1]
    return y


class StreamingLogMel:
    """Push any number of samples, get the frames that became final.

    Driven by `push(pcm)` (float32 in [-1, 1], any length) and `finish()` (end of stream). Returns
    (n, n_mels) float32 arrays; the frames of all calls together equal `log_mel(whole_audio)`. The
    frames' math (`MelFrames`) is the model's, shared by its streams; the stream holds only its audio.
    """

    def __init__(self, math: MelFrames) -> None:
        self.cfg = math.cfg
        self._math = math
        half = self.cfg.half_window
        # Preemphasized samples from absolute index `_start` on; starts with the left zero padding.
        self._buf = np.zeros(half)
        self._start = -half
        self._prev = 0.0  # last raw sample (preemphasis memory); 0 before the first sample
        self._next = 0  # next frame index to emit
        self._n_samples = 0
        self._finished = False

    @property
    def frames_emitted(self) -> int:
        return self._next

    @property
    def samples_seen(self) -> int:
        return self._n_samples

    def push(self, pcm: NDArray[np.floating]) -> F32:
        if self._finished:
            raise RuntimeError("push after finish")
        x = np.asarray(pcm, dtype=np.float64).reshape(-1)
        if x.size:
            self._buf = np.concatenate([self._buf, _preemphasize(x, self._prev, self.cfg.preemphasis)])
            self._prev = float(x[-1])
            self._n_samples += x.size
        hop, half = self.cfg.hop_length, self.cfg.half_window
        # Frame t is final once sample hop*t + half - 1 is in.
        ready = (self._n_samples - half) // hop + 1 if self._n_samples >= half else 0
        return self._emit(max(0, ready - self._next))

    def finish(self) -> F32:
        """End of stream: the frames still missing (at most one), computed over zero padding."""
        if self._finished:
            return np.zeros((0, self.cfg.n_mels), np.float32)
        self._finished = True
        total = self._n_samples // self.cfg.hop_length
        missing = total - self._next
        self._buf = np.concatenate([self._buf, np.zeros(self.cfg.half_window)])
        return self._emit(max(0, missing))

    def _emit(self, n: int) -> F32:
        cfg = self.cfg
        if n == 0:
            return np.zeros((0, cfg.n_mels), np.float32)
        hop, win = cfg.hop_length, cfg.win_length
        first = hop * self._next - cfg.half_window - self._start  # buffer offset of frame `_next`
        # The n windows as a read-only strided view of the buffer (what sliding_window_view()[::hop]
        # gives, without its checks: a few microseconds a call, per stream and block).
        buf = self._buf
        span = np.ndarray(
            (n, win), buf.dtype, buf, offset=first * buf.itemsize, strides=(hop * buf.itemsize, buf.itemsize)
        )
        span.flags.writeable = False
        out = self._math(span)
        self._next += n
        # Keep what the next frame needs.
        keep_from = hop * self._next - cfg.half_window
        self._buf = self._buf[keep_from - self._start :]
        self._start = keep_from
        return out


def log_mel(pcm: NDArray[np.floating], filters: F32, cfg: FeatureConfig | None = None) -> F32:
    """Offline log-mel of a whole utterance: floor(len / hop) frames, (n, n_mels) float32."""
    stream = StreamingLogMel(MelFrames(filters, cfg))
    head = stream.push(pcm)
    return np.concatenate([head, stream.finish()])
