"""G.711 µ-law and A-law (ITU-T G.711) as numpy lookup tables, for the demo corpus and its augmentation.

Numpy only, so that the training script can use it on the GPU machine too (no project imports there).
Encoding takes 16-bit linear PCM; decoding gives 16-bit linear PCM (µ-law: 14-bit range, A-law: 13-bit).
"""

from __future__ import annotations

import numpy as np

_ULAW_BIAS = 0x21  # 33 on the 14-bit scale (0x84 on 16 bits)
_ULAW_CLIP = 8159


def _ulaw_encode_scalar(sample: int) -> int:
    # G.711 on 14 bits (the Sun reference): sign, then a 3-bit segment and 4-bit mantissa of |x| + 33,
    # all bits inverted on the line.
    value = sample >> 2
    sign = 0x80 if value < 0 else 0
    magnitude = min(abs(value), _ULAW_CLIP) + _ULAW_BIAS
    segment = max(magnitude.bit_length() - 6, 0)
    if segment >= 8:  # beyond the top segment: the largest code of that sign
        return ~(sign | 0x7F) & 0xFF
    mantissa = (magnitude >> (segment + 1)) & 0x0F
    return ~(sign | (segment << 4) | mantissa) & 0xFF


def _ulaw_decode_scalar(byte: int) -> int:
    byte = ~byte & 0xFF
    segment = (byte >> 4) & 0x07
    magnitude = (((byte & 0x0F) << 3) + 0x84) << segment
    value = magnitude - 0x84
    return -value if byte & 0x80 else value


def _alaw_encode_scalar(sample: int) -> int:
    # A-law works on 13 bits; even bits are inverted on the line (XOR 0x55), the sign bit set for >= 0.
    value = sample >> 3
    if value >= 0:
        mask = 0xD5
    else:
        mask = 0x55
        value = -value - 1
    segment = max(value.bit_length() - 5, 0)
    if segment >= 8:
        return 0x7F ^ mask
    code = segment << 4
    code |= (value >> 1) & 0x0F if segment < 2 else (value >> segment) & 0x0F
    return code ^ mask


def _alaw_decode_scalar(byte: int) -> int:
    byte ^= 0x55
    value = (byte & 0x0F) << 4
    segment = (byte & 0x70) >> 4
    if segment == 0:
        value += 8
    else:
        value = (value + 0x108) << (segment - 1)
    return value if byte & 0x80 else -value


_PCM = range(-32768, 32768)
ULAW_ENCODE = np.array([_ulaw_encode_scalar(x) for x in _PCM], dtype=np.uint8)
ALAW_ENCODE = np.array([_alaw_encode_scalar(x) for x in _PCM], dtype=np.uint8)
ULAW_DECODE = np.array([_ulaw_decode_scalar(b) for b in range(256)], dtype=np.int16)
ALAW_DECODE = np.array([_alaw_decode_scalar(b) for b in range(256)], dtype=np.int16)


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> int16 with clipping (a hot line clips at the codec, as on a real phone)."""
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype(np.int16)


def ulaw_encode(pcm16: np.ndarray) -> np.ndarray:
    return ULAW_ENCODE[pcm16.astype(np.int32) + 32768]


def ulaw_decode(code: np.ndarray) -> np.ndarray:
    return ULAW_DECODE[code]


def alaw_encode(pcm16: np.ndarray) -> np.ndarray:
    return ALAW_ENCODE[pcm16.astype(np.int32) + 32768]


def alaw_decode(code: np.ndarray) -> np.ndarray:
    return ALAW_DECODE[code]


def round_trip(audio: np.ndarray, law: str) -> np.ndarray:
    """float audio -> G.711 `law` ("ulaw"/"alaw") -> float audio, what a phone line does to the samples."""
    pcm = to_int16(audio)
    if law == "ulaw":
        out = ulaw_decode(ulaw_encode(pcm))
    elif law == "alaw":
        out = alaw_decode(alaw_encode(pcm))
    else:
        raise ValueError(f"unknown G.711 law {law!r}")
    return out.astype(np.float32) / 32768.0
