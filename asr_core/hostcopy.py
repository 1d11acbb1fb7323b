"""Host-memory copies that keep the interpreter lock.

numpy lets go of the interpreter lock around every copy of more than a few hundred elements
(somewhere between 256 and 512 in numpy 2.4), and takes it back afterwards. In a process whose other
threads want the lock (the engine's receiver, transcript assemblers and device decoder), each such
copy hands the lock to one of them, and the copying thread waits until that one lets go: up to the
interpreter's switch interval (5 ms) per copy, where the copy itself takes microseconds. A step that
copies a few hundred rows one at a time then spends most of its host time waiting. These copies are
one `memcpy` under the lock instead: a few microseconds, and no other thread runs between them.
"""

from __future__ import annotations

import numpy as np

_F32 = np.dtype("<f4")


def put(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, holding the interpreter lock (one memcpy) where both are C-contiguous arrays of
    one shape and dtype; numpy's assignment (casting, broadcasting) otherwise."""
    if (
        dst.shape == src.shape
        and dst.dtype == src.dtype
        and dst.flags.c_contiguous
        and src.flags.c_contiguous
        and dst.flags.writeable
    ):
        if dst.size:
            dst.data.cast("B")[:] = src.data.cast("B")
        return
    dst[...] = src


def copy(src: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `src` (such as the host view of a device array, whose memory the device
    reuses), made by `put`."""
    dst = np.empty(src.shape, src.dtype)
    put(dst, src)
    return dst


_zero_bytes = bytes(1 << 16)


def zero(dst: np.ndarray) -> None:
    """dst[...] = 0 for a C-contiguous writable array, holding the interpreter lock (one memcpy from a
    zero buffer kept for the purpose, grown to the largest array asked for)."""
    global _zero_bytes
    if not (dst.flags.c_contiguous and dst.flags.writeable):
        dst[...] = 0
        return
    if dst.nbytes > len(_zero_bytes):
        _zero_bytes = bytes(max(dst.nbytes, 2 * len(_zero_bytes)))
    if dst.nbytes:
        dst.data.cast("B")[:] = memoryview(_zero_bytes)[: dst.nbytes]


def floats(view: memoryview, offset: int, count: int) -> np.ndarray:
    """A writable copy of `count` little-endian float32 values at byte `offset` of `view` (a record in a
    shared ring, which goes back to its writer), copied holding the interpreter lock."""
    return np.frombuffer(bytearray(view[offset : offset + 4 * count]), _F32)
