"""Affine-quantized linear weights kept packed on the device (MLX's format, as mlx-audio writes it).

A quantized (out, in) weight is `weight` uint32 (out, in * bits / 32): each row is a little-endian,
LSB-first bit stream of `in` codes q; `scales` and `biases` (out, in / group_size) give every run of
`group_size` codes of a row its affine map w = scale * q + bias. `linear(x, w)` multiplies with
`mx.quantized_matmul` (the codes are unpacked inside the kernel, never materialized as floats), or
with `x @ w` for a dense (in, out) weight, so one code path serves both.

MLX supports affine bits 2, 3, 4, 5, 6, 8 and group sizes 32, 64, 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

QUANT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True, slots=True)
class QuantizedLinear:
    """One packed (out, in) weight matrix (module docstring); `y = x @ W.T` like a PyTorch Linear."""

    weight: mx.array  # uint32 (out, in * bits / 32)
    scales: mx.array  # (out, in / group_size), float
    biases: mx.array  # (out, in / group_size), float
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1]) * 32 // self.bits

    @property
    def nbytes(self) -> int:
        return int(self.weight.nbytes + self.scales.nbytes + self.biases.nbytes)

    def arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.weight, self.scales, self.biases

    def astype(self, dtype: mx.Dtype) -> QuantizedLinear:
        """The same codes with scales and biases in `dtype` (the activations' dtype: MLX would
        otherwise promote the product to the wider of the two)."""
        return QuantizedLinear(
            self.weight, self.scales.astype(dtype), self.biases.astype(dtype), self.bits, self.group_size
        )

    def scaled(self, factor: float) -> QuantizedLinear:
        """factor * W: scales and biases times `factor` (computed in float32, cast back)."""
        dtype = self.scales.dtype
        return QuantizedLinear(
            self.weight,
            (self.scales.astype(mx.float32) * factor).astype(dtype),
            (self.biases.astype(mx.float32) * factor).astype(dtype),
            self.bits,
            self.group_size,
        )

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The (out, in) matrix as floats (for tables computed once, never for a step's matmul)."""
        w = mx.dequantize(
            self.weight,
            self.scales.astype(mx.float32),
            self.biases.astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
        )
        return w.astype(dtype)

    def columns(self, start: int, stop: int) -> QuantizedLinear:
        """Input features start..stop; both ends must fall on group boundaries."""
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"columns {start}:{stop} do not fall on {g}-wide groups")
        per_word = 32 // _gcd(32, self.bits)  # codes that fill whole uint32 words
        if start % per_word or stop % per_word:
            raise ValueError(f"columns {start}:{stop} split a packed word ({self.bits}-bit codes)")
        w0, w1 = start * self.bits // 32, stop * self.bits // 32
        return QuantizedLinear(
            self.weight[:, w0:w1],
            self.scales[:, start // g : stop // g],
            self.biases[:, start // g : stop // g],
            self.bits,
            self.group_size,
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def concat_rows(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """The parts stacked along the output axis (one matmul for several projections of the same input),
    or None when their bits or group sizes differ."""
    if len({(p.bits, p.group_size, p.in_features) for p in parts}) != 1:
        return None
    return QuantizedLinear(
        mx.concatenate([p.weight for p in parts]),
        mx.concatenate([p.scales for p in parts]),
        mx.concatenate([p.biases for p in parts]),
        parts[0].bits,
        parts[0].group_size,
    )


Linear = mx.array | QuantizedLinear  # dense (in, out) or packed (out, in)


def linear(x: mx.array, w: Linear) -> mx.array:
    """x @ W for a dense (in, out) weight, or the quantized product for a packed one."""
    if isinstance(w, QuantizedLinear):
        return mx.quantized_matmul(
            x, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
        )
    return x @ w


def addmm(c: mx.array, x: mx.array, w: Linear, alpha: float = 1.0) -> mx.array:
    """c + alpha * (x @ W): one fused kernel for a dense weight (the add in the GEMM's epilogue)."""
    if isinstance(w, QuantizedLinear):
        y = linear(x, w)
        return c + (y * alpha if alpha != 1.0 else y)
    return mx.addmm(c, x, w, alpha=alpha, beta=1.0)


def linear_nbytes(w: Linear) -> int:
    return w.nbytes if isinstance(w, QuantizedLinear) else int(w.nbytes)
