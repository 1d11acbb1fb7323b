"""An encoder step's joiner frames left on the device, for a decoder on the same device and thread.

The device decoder judges every frame of a step's chunks; taking them from the host would copy each
chunk into a host buffer and send the whole batch back to the device (a managed allocation and a
synchronous copy under MLX's CUDA allocator). Instead the step keeps its frames in one device table
and says which table rows each chunk's frames are: the decoder gathers its padded input from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True, slots=True)
class DeviceFrames:
    """`table` (N + 1, J): every frame of a step, its last row zeros (what padding reads); `rows[i]`:
    the table rows of chunk i's frames, in order (int32)."""

    table: mx.array
    rows: list[np.ndarray]

    @property
    def zero_row(self) -> int:
        return int(self.table.shape[0]) - 1

    def select(self, picks: Sequence[tuple[int, int]]) -> DeviceFrames:
        """The chunks picks[j] = (i, skip): chunk i's frames from its skip-th on, over the same table."""
        return DeviceFrames(self.table, [self.rows[i][skip:] for i, skip in picks])
