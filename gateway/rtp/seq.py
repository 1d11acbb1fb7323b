"""Wrap-around arithmetic for 16-bit sequence numbers and 32-bit timestamps (RFC 3550 §5.1, App. A.1).

An unwrapper turns the wire value into an unbounded integer by taking the nearest candidate to the
previous value (a step of less than half the modulus either way). Pure, no state beyond the last value.
"""

from __future__ import annotations

SEQ_MOD = 1 << 16
TS_MOD = 1 << 32

# RFC 3550 App. A.1 constants.
MAX_DROPOUT = 3000
MAX_MISORDER = 100


def uint16_add(a: int, b: int) -> int:
    return (a + b) & 0xFFFF


def uint32_add(a: int, b: int) -> int:
    return (a + b) & 0xFFFFFFFF


def seq_delta(a: int, b: int) -> int:
    """Signed distance from b to a in 16-bit sequence space, in [-32768, 32767]."""
    d = (a - b) & 0xFFFF
    return d - SEQ_MOD if d >= 0x8000 else d


def ts_delta(a: int, b: int) -> int:
    """Signed distance from b to a in 32-bit timestamp space, in [-2^31, 2^31)."""
    d = (a - b) & 0xFFFFFFFF
    return d - TS_MOD if d >= 0x80000000 else d


class Unwrapper:
    """Extends a wrapping counter (16-bit seq or 32-bit timestamp) to an unbounded integer."""

    __slots__ = ("_half", "_last", "_last_wire", "_mask", "_mod")

    def __init__(self, bits: int) -> None:
        self._mod = 1 << bits
        self._mask = self._mod - 1
        self._half = self._mod >> 1
        self._last: int | None = None
        self._last_wire = 0

    def unwrap(self, value: int) -> int:
        if self._last is None:
            self._last = value
        else:
            d = (value - self._last_wire) & self._mask
            if d >= self._half:
                d -= self._mod
            self._last += d
        self._last_wire = value
        return self._last

    def peek(self, value: int) -> int:
        """The extended value `value` would get, without moving the reference."""
        if self._last is None:
            return value
        d = (value - self._last_wire) & self._mask
        if d >= self._half:
            d -= self._mod
        return self._last + d

    @property
    def last(self) -> int | None:
        return self._last
