"""The bundle's `melfilters.f32`: the slaney filterbank (`asr_core.features.slaney_mel_filters`) as raw
little-endian float32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from asr_core.features import slaney_mel_filters

__all__ = ["slaney_mel_filters", "write_filters"]


def write_filters(path: Path, filters: NDArray[np.float32]) -> None:
    """Raw little-endian float32, row-major (n_mels, n_fft/2+1)."""
    path.write_bytes(np.ascontiguousarray(filters, dtype="<f4").tobytes())
