"""The mel filterbank of the bundle (`melfilters.f32`): slaney mel scale, slaney area normalization.

Same construction as librosa's `filters.mel(norm="slaney")` / HF `mel_filter_bank(norm="slaney",
mel_scale="slaney")`: triangles between mel-spaced band edges over the rfft bin frequencies, each scaled
by 2 / (upper edge - lower edge) in Hz. Computed in float64, stored float32 (model_spec.md §4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import NDArray

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


def write_filters(path: Path, filters: NDArray[np.float32]) -> None:
    """Raw little-endian float32, row-major (n_mels, n_fft/2+1)."""
    path.write_bytes(np.ascontiguousarray(filters, dtype="<f4").tobytes())
