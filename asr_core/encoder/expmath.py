"""exp, sigmoid and softmax as MLX array ops fused by `mx.compile`, for the CPU of an x86-64 machine.

MLX's CPU backend evaluates `exp` (and `sigmoid`, `softmax`, which use it) one float at a time on
x86-64: its SIMD layer has vector types for ARM NEON only, and its scalar polynomial calls libm's
`fmaf` for every term (~24 ns a float; a sigmoid over one feed-forward's (256, 704) hidden units took
4.3 ms). Here the polynomial is written as array ops and `mx.compile` fuses them into a few loops that
MLX's CPU JIT builds with g++ (~0.8 ms there). The encoder's sigmoids and softmaxes take up to a third
of a CPU step; with these a demo-model step takes 19-28 % less from B = 4 on (docs/benchmarks.md).

Used where both hold (`array_exp_default`): the CPU device of an x86-64 machine, and g++ on PATH. Without
g++ MLX runs the compiled function's ops one by one: correct, but slower than its own kernels on small
batches, so the encoder keeps those; it also does where the JIT fails to build them at warm-up
(`StreamingEncoder.warmup`). A GPU always keeps them (fused there by its own compile).

exp(x) = 2**n * e**r with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two
parts, Cody-Waite: n * LN2_HI is exact for |n| < 2**12, so r keeps its low bits), e**r by a degree-6
polynomial, 2**n built in the exponent field. Within 1 ulp of the exact value on [-87, 88] (MLX's own
CPU exp: 63 ulp at the ends of that range). Inputs are clamped to [-88, 88]: below, the result is 0
(exactly 0 from -87.68 on, where n = -127 makes the exponent field 0); above, 2**127 * e**r ~ 1.65e38
instead of overflowing. NaN stays NaN.
"""

from __future__ import annotations

import platform
import shutil

import mlx.core as mx
import numpy as np
from numpy.polynomial import chebyshev

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 to 9 significant bits
_LN2_LO = float(np.log(2.0) - _LN2_HI)
_CLAMP = 88.0
_DEGREE = 6


def _exp_coefficients(degree: int) -> tuple[float, ...]:
    """Power-basis coefficients of e**r on [-ln2/2, ln2/2], highest first: the Chebyshev interpolant
    (near-minimax; its error at degree 6 is ~2e-9, far below float32's 6e-8), in float64."""
    half = float(np.log(2.0)) / 2
    nodes = np.cos(np.pi * (np.arange(degree + 1) + 0.5) / (degree + 1))  # Chebyshev points on [-1, 1]
    in_t = chebyshev.cheb2poly(chebyshev.chebfit(nodes, np.exp(nodes * half), degree))
    return tuple(float(c / half**i) for i, c in enumerate(in_t))[::-1]


_COEFFS = _exp_coefficients(_DEGREE)


def array_exp_default() -> bool:
    """Whether the encoder should use these here: the CPU device of an x86-64 machine with g++ (which
    MLX's CPU JIT runs) on PATH."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and mx.default_device() == mx.cpu
        and shutil.which("g++") is not None
    )


def exp(x: mx.array) -> mx.array:
    """e**x elementwise, computed in float32 (see the module docstring for range and accuracy)."""
    dtype = x.dtype
    x = mx.clip(x.astype(mx.float32), -_CLAMP, _CLAMP)
    n = mx.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _COEFFS[0] * r + _COEFFS[1]
    for c in _COEFFS[2:]:
        p = p * r + c
    scale = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    return (p * scale).astype(dtype)


def _gated(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.reciprocal(1.0 + exp(-gate))


def _softmax(x: mx.array) -> mx.array:
    x32 = x.astype(mx.float32)
    e = exp(x32 - mx.max(x32, axis=-1, keepdims=True))
    return (e / mx.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


# Traced once per input shape; the kernels MLX generates from them do not depend on the shape, so a
# process compiles each once (about a dozen, some seconds in all, cached across processes).
_gated_fused = mx.compile(_gated)
_softmax_fused = mx.compile(_softmax)


def gated(x: mx.array, gate: mx.array, array_ops: bool) -> mx.array:
    """x * sigmoid(gate) (SiLU when gate is x, a GLU's output otherwise): with `exp` above when
    `array_ops`, else MLX's kernels."""
    return _gated_fused(x, gate) if array_ops else x * mx.sigmoid(gate)


def softmax(x: mx.array, array_ops: bool) -> mx.array:
    """Softmax over the last axis, accumulated in float32 (MLX's `precise`); -inf entries give 0."""
    return _softmax_fused(x) if array_ops else mx.softmax(x, axis=-1, precise=True)
