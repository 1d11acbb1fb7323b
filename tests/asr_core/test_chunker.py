"""Mel chunker: 1+8r frames first, 8(r+1) after, a short final chunk at the end."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr_core.chunker import MelChunker


def _mel(n: int) -> np.ndarray:
    return np.arange(n * 128, dtype=np.float32).reshape(n, 128)


@pytest.mark.parametrize(
    ("lookahead", "first", "later"), [(0, 1, 8), (1, 9, 16), (3, 25, 32), (6, 49, 56), (13, 105, 112)]
)
def test_chunk_sizes_follow_the_cache_aware_schedule(lookahead: int, first: int, later: int) -> None:
    chunker = MelChunker(lookahead)
    chunks = chunker.push(_mel(first + 3 * later))
    assert [c.shape[0] for c in chunks] == [first, later, later, later]
    assert chunker.finish() is None


def test_leftover_frames_become_a_short_final_chunk() -> None:
    chunker = MelChunker(3)
    mel = _mel(25 + 32 + 5)
    chunks = chunker.push(mel)
    last = chunker.finish()
    assert last is not None and last.shape == (5, 128)
    np.testing.assert_array_equal(np.concatenate([*chunks, last]), mel)
    assert chunker.chunks_emitted == 3


def test_a_stream_shorter_than_the_first_chunk_is_one_short_chunk() -> None:
    chunker = MelChunker(3)
    assert chunker.push(_mel(10)) == []
    last = chunker.finish()
    assert last is not None and last.shape[0] == 10


def test_no_frames_no_chunk_and_nothing_after_finish() -> None:
    chunker = MelChunker(3)
    assert chunker.push(np.zeros((0, 128), np.float32)) == []
    assert chunker.finish() is None
    with pytest.raises(RuntimeError):
        chunker.push(_mel(1))


def test_invalid_input_is_rejected() -> None:
    with pytest.raises(ValueError):
        MelChunker(-1)
    with pytest.raises(ValueError):
        MelChunker(3).push(np.zeros(128, np.float32))


@settings(max_examples=60, deadline=None)
@given(lookahead=st.sampled_from([0, 3, 6, 13]), sizes=st.lists(st.integers(0, 70), max_size=10))
def test_any_push_pattern_gives_the_same_chunks(lookahead: int, sizes: list[int]) -> None:
    mel = _mel(sum(sizes))
    whole = MelChunker(lookahead)
    expected = whole.push(mel)
    expected_last = whole.finish()
    chunker = MelChunker(lookahead)
    got: list[np.ndarray] = []
    start = 0
    for n in sizes:
        got += chunker.push(mel[start : start + n])
        start += n
    last = chunker.finish()
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.flags.c_contiguous and a.dtype == np.float32
    assert (last is None) == (expected_last is None)
    if last is not None and expected_last is not None:
        np.testing.assert_array_equal(last, expected_last)
