"""A deterministic speech-like probe signal (16 kHz float32): voiced stretches (a harmonic source with
gliding pitch through two moving formant-like resonances), noise bursts (fricatives) and pauses.

Random-weight models barely react to their input; what matters here is that consecutive frames
differ the way speech frames do, so calibration and benchmarks see realistic encoder outputs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

SAMPLE_RATE = 16000


def _voiced(rng: np.random.Generator, n: int) -> NDArray[np.float64]:
    t = np.arange(n) / SAMPLE_RATE
    f0 = rng.uniform(90, 220) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1, 4) * t))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    formants = (rng.uniform(300, 900), rng.uniform(900, 2500))
    out = np.zeros(n)
    for k in range(1, int(4000 / f0.max())):
        fk = k * f0
        gain = sum(np.exp(-(((fk - fm) / 150.0) ** 2)) for fm in formants) + 0.05 / k
        out += gain * np.sin(k * phase)
    env = np.sin(np.pi * np.arange(n) / n) ** 0.5
    return out * env / max(1e-9, np.abs(out).max())


def _fricative(rng: np.random.Generator, n: int) -> NDArray[np.float64]:
    noise = rng.standard_normal(n)
    spec = np.fft.rfft(noise)
    freqs = np.fft.rfftfreq(n, 1 / SAMPLE_RATE)
    spec *= (freqs > rng.uniform(2500, 4500)).astype(np.float64)
    out = np.fft.irfft(spec, n)
    return out / max(1e-9, np.abs(out).max())


def probe_audio(seconds: float = 4.0, seed: int = 0) -> NDArray[np.float32]:
    rng = np.random.default_rng([seed, 7919])
    total = int(seconds * SAMPLE_RATE)
    parts: list[NDArray[np.float64]] = []
    n = 0
    while n < total:
        kind = rng.choice(["voiced", "voiced", "fricative", "pause"])
        length = int(rng.uniform(0.08, 0.35) * SAMPLE_RATE)
        if kind == "voiced":
            seg = 0.3 * _voiced(rng, length)
        elif kind == "fricative":
            seg = 0.08 * _fricative(rng, length)
        else:
            seg = np.zeros(length)
        parts.append(seg)
        n += length
    audio = np.concatenate(parts)[:total] + 3e-4 * rng.standard_normal(total)  # line noise floor
    return audio.astype(np.float32)
