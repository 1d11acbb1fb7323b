"""A stack call's per-query limits and cache write rows, as the device builds them from a few
numbers a row (asr_core.encoder.streaming: `_query_limits`, `_ring_writes`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from asr_core.encoder.streaming import _query_limits, _ring_writes


def test_each_query_sees_the_cache_its_chunk_reaches_and_the_new_frames_to_its_chunk_end() -> None:
    # Lc = 6 cache slots, chunks of 4 frames (so the left context reaches one whole chunk: 4), a call
    # of T = 8 frames: two chunks a row.
    queries = mx.array(
        [
            # a0 (frames before the row), chunk, reach, real frames
            [10, 2, 0],
            [4, 4, 8],
            [4, 4, 8],
            [6, 8, 8],
        ],
        dtype=mx.int32,
    )
    valid, seen = _query_limits(queries, T=8, Lc=6)
    np.testing.assert_array_equal(
        np.array(valid),
        [
            [4, 4, 4, 4, 0, 0, 0, 0],  # chunk 0 reaches 4 cached frames; chunk 1's context is chunk 0
            [2, 2, 2, 2, 0, 0, 0, 0],  # only 2 frames before the row
            [0] * 8,  # padding: no cache
        ],
    )
    np.testing.assert_array_equal(
        np.array(seen),
        [
            [4, 4, 4, 4, 6, 6, 6, 6],  # a short row: the second chunk ends at its last real frame
            [4, 4, 4, 4, 8, 8, 8, 8],
            [8] * 8,  # padding: every new frame (no query sees nothing)
        ],
    )


def test_a_committing_rows_frames_go_to_its_ring_rows_modulo_the_context() -> None:
    # Rings start at pool rows 1 and 7 (Lc = 6 each); frame f of a stream lives in ring row f % Lc.
    rows = mx.array([[1, 7], [10, 2]], dtype=mx.int32)
    np.testing.assert_array_equal(np.array(_ring_writes(rows, T=3, Lc=6)), [5, 6, 1, 9, 10, 11])
