"""Host copies that keep the interpreter lock (asr_core.hostcopy): the engine's per-row copies must
not hand the lock to its other threads once per row."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import pytest

from asr_core import hostcopy
from tools.bench.encoder import busy_interpreter


def turns_of_a_busy_thread(copy: Callable[[], None], interval: float) -> int:
    """How often a thread that always wants the interpreter lock ran while `copy` ran. The switch
    interval is `interval` meanwhile: long, so that it runs only when `copy` lets go of the lock (or
    this thread is off its core that long)."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        with busy_interpreter(1) as turns:
            time.sleep(0.001)  # it runs; this thread takes the lock back within one switch interval
            before = turns()
            copy()
            return turns() - before
    finally:
        sys.setswitchinterval(default)


def rows(n: int = 20, frames: int = 512) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rows long enough (256 KiB) that a thread woken by a release of the lock takes it before the
    copy ends."""
    rng = np.random.default_rng(0)
    return np.zeros((n, frames, 128), np.float32), [
        rng.standard_normal((frames, 128), np.float32) for _ in range(n)
    ]


def test_put_copies_rows_without_letting_another_thread_run() -> None:
    dst, src = rows()

    def copy() -> None:
        for k, s in enumerate(src):
            hostcopy.put(dst[k], s)

    assert turns_of_a_busy_thread(copy, interval=0.5) == 0
    np.testing.assert_array_equal(dst, np.stack(src))


def test_the_probe_sees_numpy_assignment_let_go_of_the_lock() -> None:
    # What `put` avoids (and proof the probe above can fail): numpy's assignment of more than a few
    # hundred elements releases the lock. Whether the busy thread gets it before the copy takes it back
    # depends on the OS waking it in time: copies of 16 MiB (milliseconds each) leave it that time even
    # on a loaded machine.
    dst, src = np.zeros(1 << 22, np.float32), np.ones(1 << 22, np.float32)

    def copy() -> None:
        for _ in range(10):
            dst[...] = src

    assert any(turns_of_a_busy_thread(copy, interval=0.05) > 0 for _ in range(5))


def test_put_copies_a_row_prefix_into_a_padded_buffer() -> None:
    dst = np.full((2, 5, 3), -1.0, np.float32)
    short = np.arange(6, dtype=np.float32).reshape(2, 3)
    hostcopy.put(dst[1, :2], short)
    np.testing.assert_array_equal(dst[1, :2], short)
    assert (dst[0] == -1).all() and (dst[1, 2:] == -1).all()


@pytest.mark.parametrize(
    "dst, src",
    [
        (np.zeros(4, np.int32), np.array([True, False, True, True])),  # cast
        (np.zeros((3, 4), np.float32)[:, 1], np.ones(3, np.float32)),  # strided destination
        (np.zeros((2, 3), np.float32), np.ones((3, 2), np.float32).T),  # strided source
        (np.zeros((2, 3), np.float32), np.float32(7.0) * np.ones(3, np.float32)),  # broadcast
        (np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)),  # empty
    ],
)
def test_put_is_numpy_assignment_where_one_memcpy_is_not(dst: np.ndarray, src: np.ndarray) -> None:
    expected = dst.copy()
    expected[...] = src
    hostcopy.put(dst, src)
    np.testing.assert_array_equal(dst, expected)


def test_copy_is_an_independent_copy_made_without_letting_another_thread_run() -> None:
    _, src = rows()
    out: list[np.ndarray] = []

    def copy() -> None:
        out.extend(hostcopy.copy(s) for s in src)

    assert turns_of_a_busy_thread(copy, interval=0.5) == 0
    np.testing.assert_array_equal(np.stack(out), np.stack(src))
    src[0][0, 0] += 1.0  # the source's memory is reused; the copy is not
    assert out[0][0, 0] != src[0][0, 0] and out[0].flags.c_contiguous and out[0].flags.writeable


def test_copy_of_a_strided_array_is_a_contiguous_equal_one() -> None:
    src = np.arange(12, dtype=np.int32).reshape(3, 4).T
    out = hostcopy.copy(src)
    np.testing.assert_array_equal(out, src)
    assert out.flags.c_contiguous and out.dtype == src.dtype


def test_zero_clears_a_large_buffer_without_letting_another_thread_run() -> None:
    # A step's padding rows of mel (rows x frames x mels) are cleared so.
    buffers = [np.ones(1 << 20, np.float32) for _ in range(10)]

    def clear() -> None:
        for b in buffers:
            hostcopy.zero(b)

    assert turns_of_a_busy_thread(clear, interval=0.5) == 0
    assert not any(b.any() for b in buffers)


@pytest.mark.parametrize(
    "dst",
    [
        np.ones((3, 4), np.float32)[:, 1],  # strided: numpy's assignment
        np.ones((2, 3), np.int32),
        np.ones((0, 3), np.float32),
        np.ones(9 << 20, np.uint8),  # larger than the buffers cleared above
    ],
)
def test_zero_sets_every_element_to_zero(dst: np.ndarray) -> None:
    hostcopy.zero(dst)
    assert dst.size == 0 or not dst.any()


def test_floats_is_a_writable_copy_of_little_endian_values() -> None:
    values = np.arange(10, dtype="<f4")
    ring = bytearray(values.tobytes())
    out = hostcopy.floats(memoryview(ring), 8, 3)
    np.testing.assert_array_equal(out, [2.0, 3.0, 4.0])
    out[0] = -1.0
    ring[8:12] = b"\0\0\0\0"  # the ring's record is reused; the copy is not
    assert out.flags.writeable and list(out) == [-1.0, 3.0, 4.0]
