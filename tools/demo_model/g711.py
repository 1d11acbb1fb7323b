"""G.711 µ-law / A-law for the demo corpus and its augmentation, on float audio and numpy code arrays.

The tables are the gateway's own (`gateway.audio.g711`, numpy only, so the training script can import
them on the GPU machine too); this module adds the float <-> int16 step and the array-shaped calls the
corpus and the telephone channel use.
"""

from __future__ import annotations

import numpy as np

from gateway.audio import g711 as line

ULAW_DECODE = line.ULAW_TO_INT16
ALAW_DECODE = line.ALAW_TO_INT16


def to_int16(audio: np.ndarray) -> np.ndarray:
    """float in [-1, 1] -> int16 with clipping (a hot line clips at the codec, as on a real phone)."""
    return np.clip(np.round(audio * 32768.0), -32768, 32767).astype(np.int16)


def _index(pcm16: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(pcm16, dtype=np.int16).view(np.uint16)  # the encode tables' index


def ulaw_encode(pcm16: np.ndarray) -> np.ndarray:
    return line.ULAW_ENCODE[_index(pcm16)]


def ulaw_decode(code: np.ndarray) -> np.ndarray:
    return ULAW_DECODE[code]


def alaw_encode(pcm16: np.ndarray) -> np.ndarray:
    return line.ALAW_ENCODE[_index(pcm16)]


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
