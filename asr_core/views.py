"""Array views where MLX's plain indexing would make a copy."""

from __future__ import annotations

import mlx.core as mx


def at(stacked: mx.array, n: int) -> mx.array:
    """`stacked[n]` as a view: MLX indexes with an integer through a gather, i.e. a copy kernel of the
    whole plane (a layer's cache or recurrent state, the K or V half of one)."""
    return mx.squeeze(stacked[n : n + 1], 0)
