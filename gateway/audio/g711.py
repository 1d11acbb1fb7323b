"""ITU-T G.711 µ-law and A-law through lookup tables (no audioop: it is gone in Python 3.13).

Decoding is one 256-entry table per law, built from the G.711 decoder formulas and checked in the
tests against values of ITU-T G.711 Tables 1 and 2. Values are scaled to 16-bit: µ-law's 14-bit outputs
×4 (range ±32124), A-law's 13-bit outputs ×8 (range ±32256), as every telephony stack does.

Encoding (used by test senders and the replay tool, never on the receive path) is one 65536-entry table
per law, indexed by the int16 sample viewed as uint16. Both directions equal CPython's `audioop` (the
classic Sun/CCITT reference code) for every input; the tests check that where audioop still exists.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

Law = Literal["PCMU", "PCMA"]

# The code of digital silence: µ-law 0xFF decodes to exactly 0; A-law has no zero (0xD5 → +8).
SILENCE_CODE: dict[str, int] = {"PCMU": 0xFF, "PCMA": 0xD5}


def _ulaw_decode_table() -> NDArray[np.int16]:
    # G.711 §3 (µ-law): all bits of the character are inverted on the line, where bit 7 = 1 is a
    # positive value; after inversion bits 6..4 are the segment e and bits 3..0 the step m. Table 2
    # output value (14-bit): y = (2m + 33)·2^e − 33.
    codes = np.arange(256)
    inv = codes ^ 0xFF
    e = (inv >> 4) & 0x07
    m = inv & 0x0F
    y = ((2 * m + 33) << e) - 33
    y = np.where(inv & 0x80, -y, y)
    return (y * 4).astype(np.int16)


def _alaw_decode_table() -> NDArray[np.int16]:
    # G.711 §2 (A-law): even bits are inverted (XOR 0x55); bit 7 = 1 is positive. Table 1 output value
    # (13-bit): segment 0: 2m + 1; segment e ≥ 1: (2m + 33)·2^(e−1).
    codes = np.arange(256)
    v = codes ^ 0x55
    e = (v >> 4) & 0x07
    m = v & 0x0F
    y = np.where(e == 0, 2 * m + 1, (2 * m + 33) << np.maximum(e - 1, 0))
    y = np.where(v & 0x80, y, -y)
    return (y * 8).astype(np.int16)


ULAW_TO_INT16: NDArray[np.int16] = _ulaw_decode_table()
ALAW_TO_INT16: NDArray[np.int16] = _alaw_decode_table()
ULAW_TO_INT16.setflags(write=False)
ALAW_TO_INT16.setflags(write=False)
# Decoding straight to float32 in [-1, 1) (int16 / 32768) saves a conversion per block.
ULAW_TO_FLOAT32: NDArray[np.float32] = (ULAW_TO_INT16 / np.float32(32768.0)).astype(np.float32)
ALAW_TO_FLOAT32: NDArray[np.float32] = (ALAW_TO_INT16 / np.float32(32768.0)).astype(np.float32)
ULAW_TO_FLOAT32.setflags(write=False)
ALAW_TO_FLOAT32.setflags(write=False)

DECODE_INT16: dict[str, NDArray[np.int16]] = {"PCMU": ULAW_TO_INT16, "PCMA": ALAW_TO_INT16}
DECODE_FLOAT32: dict[str, NDArray[np.float32]] = {"PCMU": ULAW_TO_FLOAT32, "PCMA": ALAW_TO_FLOAT32}


def _ulaw_encode_table() -> NDArray[np.uint8]:
    x = np.arange(-32768, 32768, dtype=np.int64)
    # 16-bit → 14-bit by an arithmetic shift (as the Sun/CCITT reference code and CPython's audioop do,
    # so negative values round toward −∞), then the magnitude, clipped to the top of segment 7.
    shifted = x >> 2
    mag = np.minimum(np.where(shifted < 0, -shifted, shifted), 8158)
    biased = mag + 33  # the bias makes segment boundaries powers of two: segment e covers [32·2^e, 64·2^e)
    e = np.clip(np.floor(np.log2(biased)).astype(np.int64) - 5, 0, 7)
    m = (biased >> (e + 1)) & 0x0F
    code = (e << 4) | m
    code = np.where(x < 0, code | 0x80, code)  # inverted below: a positive value has bit 7 set
    table = (code ^ 0xFF).astype(np.uint8)
    # Reorder so the index is the int16 value viewed as uint16 (0..32767, then −32768..−1).
    return np.concatenate([table[32768:], table[:32768]])


def _alaw_encode_table() -> NDArray[np.uint8]:
    x = np.arange(-32768, 32768, dtype=np.int64)
    # Negative samples use the magnitude of the one's complement (G.711 §2: the characteristic is
    # symmetric about the 13-bit value −1/2, so −1 maps like 0 with the sign bit clear).
    mag = np.where(x < 0, -x - 1, x) >> 3  # 13-bit magnitude 0..4095
    e = np.where(mag < 32, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int64) - 4)
    e = np.clip(e, 0, 7)
    m = np.where(e == 0, mag >> 1, (mag >> np.maximum(e, 1)) & 0x0F)
    code = (e << 4) | m
    code = np.where(x >= 0, code | 0x80, code)
    table = (code ^ 0x55).astype(np.uint8)
    return np.concatenate([table[32768:], table[:32768]])


ULAW_ENCODE: NDArray[np.uint8] = _ulaw_encode_table()
ALAW_ENCODE: NDArray[np.uint8] = _alaw_encode_table()
ULAW_ENCODE.setflags(write=False)
ALAW_ENCODE.setflags(write=False)
ENCODE: dict[str, NDArray[np.uint8]] = {"PCMU": ULAW_ENCODE, "PCMA": ALAW_ENCODE}


def decode(payload: bytes | bytearray | memoryview, law: Law) -> NDArray[np.int16]:
    """G.711 bytes → int16 samples (one table lookup per sample)."""
    return DECODE_INT16[law][np.frombuffer(payload, dtype=np.uint8)]


def encode(pcm: NDArray[np.int16], law: Law) -> bytes:
    """int16 samples → G.711 bytes (nearest quantization step, ITU-T G.711 decision values)."""
    samples = np.ascontiguousarray(pcm, dtype=np.int16)
    return ENCODE[law][samples.view(np.uint16)].tobytes()
