"""Chunk geometry of cache-aware streaming (model_spec.md §5.1): pure arithmetic, no MLX.

With subsampling factor f (8) and lookahead r, the first chunk carries 1 + f*r mel frames and every
later chunk f*(r+1); each yields r+1 encoder frames. A short final chunk of n mel frames yields
ceil(n/f) frames (the offline frame count), or 1 + ... for a stream shorter than its first chunk.
"""

from __future__ import annotations


def first_chunk_frames(lookahead: int, subsampling_factor: int = 8) -> int:
    return 1 + subsampling_factor * lookahead


def chunk_frames(lookahead: int, subsampling_factor: int = 8) -> int:
    return subsampling_factor * (lookahead + 1)


def conv_out_rows(n_in: int, kernel: int = 3, stride: int = 2) -> int:
    """Rows out of a time-strided conv over `n_in` rows (already padded), no padding of its own."""
    return max(0, (n_in - kernel) // stride + 1)


def stage_input_rows(n_rows: int, first: bool, last: bool, kernel: int = 3, stride: int = 2) -> int:
    """Rows a strided stage convolves for a chunk of `n_rows` new rows.

    First chunk: `kernel - 1` zero rows in front (the offline causal padding); later chunks: the
    `kernel - stride` rows cached from the previous chunk; final chunk: `stride - 1` zero rows behind
    (the offline right padding).
    """
    front = kernel - 1 if first else kernel - stride
    back = stride - 1 if last else 0
    return front + n_rows + back


def encoder_frames(n_mel: int, first: bool, last: bool, n_stages: int = 3) -> int:
    """Encoder frames one chunk of `n_mel` mel frames produces."""
    rows = n_mel
    for _ in range(n_stages):
        rows = conv_out_rows(stage_input_rows(rows, first, last))
    return rows


def offline_frames(n_mel: int, n_stages: int = 3) -> int:
    """Encoder frames of a whole utterance (NeMo calc_length with causal padding 2 left, 1 right)."""
    rows = n_mel
    for _ in range(n_stages):
        rows = rows // 2 + 1 if rows > 0 else 0
    return rows
