"""A plain numpy (float64) offline forward of the encoder, from HF-named PyTorch-layout weights.

Not the runtime encoder (that is MLX, asr_core/encoder): this one exists so the bundle writer can see
what real encoder frames look like for its random weights (blank calibration) and so the bench can
make realistic joiner inputs, without torch. Math per model_spec.md §3 (checked against HF's offline
`get_audio_features` in tests/tools/test_make_bundle.py): causal dw-striding subsampling, conformer
blocks with Transformer-XL relative attention under the `chunked_limited` mask, prompt fusion,
encoder_projector.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]
LEFT_CONTEXT = 56


def _layer_norm(x: F64, w: F64, b: F64, eps: float = 1e-5) -> F64:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _silu(x: F64) -> F64:
    return x / (1.0 + np.exp(-x))


def _causal_conv2d(x: F64, w: F64, b: F64, groups: int) -> F64:
    """x (C, T, F); kernel 3, stride 2, padding time (2, 1) and freq (2, 1)."""
    _, t, f = x.shape
    xp = np.pad(x, ((0, 0), (2, 1), (2, 1)))
    t_out, f_out = t // 2 + 1, f // 2 + 1
    patches = np.stack(
        [xp[:, kt : kt + 2 * t_out : 2, kf : kf + 2 * f_out : 2] for kt in range(3) for kf in range(3)],
        axis=-1,
    )  # (C_in, T_out, F_out, 9)
    kernels = w.reshape(w.shape[0], w.shape[1], 9)
    if groups == 1:
        out = np.einsum("itfk,oik->otf", patches, kernels)
    else:  # depthwise
        out = np.einsum("ctfk,ck->ctf", patches, kernels[:, 0])
    return out + b[:, None, None]


def _rel_positions(length: int, d: int) -> F64:
    pos = np.arange(length - 1, -length, -1, dtype=np.float64)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = pos[:, None] * inv_freq[None]
    out = np.empty((2 * length - 1, d))
    out[:, 0::2], out[:, 1::2] = np.sin(ang), np.cos(ang)
    return out


def _rel_shift(s: F64) -> F64:
    h, q, p = s.shape
    s = np.pad(s, ((0, 0), (0, 0), (1, 0))).reshape(h, p + 1, q)
    return s[:, 1:].reshape(h, q, p)


def chunked_limited_mask(t: int, lookahead: int, left: int = LEFT_CONTEXT) -> NDArray[np.bool_]:
    chunk = lookahead + 1
    c = np.arange(t) // chunk
    diff = c[:, None] - c[None, :]
    return (diff >= 0) & (diff <= left // chunk)


def encoder_forward(
    w: Mapping[str, NDArray[np.floating]], mel: NDArray[np.floating], num_heads: int, lookahead: int = 3
) -> F64:
    """mel (T_mel, n_mels) -> conformer output (T, d) (before the prompt)."""
    g = lambda name: np.asarray(w[name], dtype=np.float64)  # noqa: E731
    x = np.asarray(mel, dtype=np.float64)[None]  # (1, T, F)
    x = np.maximum(
        _causal_conv2d(x, g("encoder.subsampling.conv_in.weight"), g("encoder.subsampling.conv_in.bias"), 1),
        0,
    )
    i = 0
    while f"encoder.subsampling.layers.{i}.depthwise_conv.weight" in w:
        p = f"encoder.subsampling.layers.{i}"
        x = _causal_conv2d(x, g(f"{p}.depthwise_conv.weight"), g(f"{p}.depthwise_conv.bias"), x.shape[0])
        x = (
            np.einsum("ctf,oc->otf", x, g(f"{p}.pointwise_conv.weight")[:, :, 0, 0])
            + g(f"{p}.pointwise_conv.bias")[:, None, None]
        )
        x = np.maximum(x, 0)
        i += 1
    c, t, f = x.shape
    h = x.transpose(1, 0, 2).reshape(t, c * f) @ g("encoder.subsampling.linear.weight").T + g(
        "encoder.subsampling.linear.bias"
    )

    pos = _rel_positions(t, h.shape[1])
    allowed = chunked_limited_mask(t, lookahead)
    n = 0
    while f"encoder.layers.{n}.norm_out.weight" in w:
        h = _conformer_layer(g, f"encoder.layers.{n}", h, pos, allowed, num_heads)
        n += 1
    return h


def _conformer_layer(
    g: Callable[[str], F64], p: str, h: F64, pos: F64, allowed: NDArray[np.bool_], num_heads: int
) -> F64:
    t, d = h.shape
    dh = d // num_heads

    def ln(name: str, v: F64) -> F64:
        return _layer_norm(v, g(f"{p}.{name}.weight"), g(f"{p}.{name}.bias"))

    def ff(name: str, v: F64) -> F64:
        return _silu(v @ g(f"{p}.{name}.linear1.weight").T) @ g(f"{p}.{name}.linear2.weight").T

    h = h + 0.5 * ff("feed_forward1", ln("norm_feed_forward1", h))
    a = ln("norm_self_att", h)
    q, k, v = (
        (a @ g(f"{p}.self_attn.{m}_proj.weight").T).reshape(t, num_heads, dh).transpose(1, 0, 2)
        for m in "qkv"
    )
    rk = (pos @ g(f"{p}.self_attn.relative_k_proj.weight").T).reshape(-1, num_heads, dh).transpose(1, 2, 0)
    ac = (q + g(f"{p}.self_attn.bias_u")[:, None]) @ k.transpose(0, 2, 1)
    bd = _rel_shift((q + g(f"{p}.self_attn.bias_v")[:, None]) @ rk)[..., :t]
    scores = np.where(allowed[None], (ac + bd) / np.sqrt(dh), -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    attn = (scores / scores.sum(-1, keepdims=True)) @ v
    h = h + attn.transpose(1, 0, 2).reshape(t, d) @ g(f"{p}.self_attn.o_proj.weight").T

    u = ln("norm_conv", h) @ g(f"{p}.conv.pointwise_conv1.weight")[:, :, 0].T
    u = u[:, :d] / (1.0 + np.exp(-u[:, d:]))  # GLU: value * sigmoid(gate)
    dw = g(f"{p}.conv.depthwise_conv.weight")[:, 0, :]  # (d, K); tap K-1 = current frame
    kk = dw.shape[1]
    up = np.pad(u, ((kk - 1, 0), (0, 0)))
    u = np.sum([up[j : j + t] * dw[:, j] for j in range(kk)], axis=0)
    u = _silu(_layer_norm(u, g(f"{p}.conv.norm.weight"), g(f"{p}.conv.norm.bias")))
    h = h + u @ g(f"{p}.conv.pointwise_conv2.weight")[:, :, 0].T

    h = h + 0.5 * ff("feed_forward2", ln("norm_feed_forward2", h))
    return ln("norm_out", h)


def joiner_frames(
    w: Mapping[str, NDArray[np.floating]], hidden: F64, prompt_id: int, num_prompts: int
) -> NDArray[np.float32]:
    """Prompt fusion + encoder_projector: conformer output (T, d) -> joiner input (T, J)."""
    g = lambda name: np.asarray(w[name], dtype=np.float64)  # noqa: E731
    onehot = np.zeros((hidden.shape[0], num_prompts))
    onehot[:, prompt_id] = 1.0
    z = np.concatenate([hidden, onehot], axis=1)
    z = np.maximum(z @ g("prompt_projector.linear_1.weight").T + g("prompt_projector.linear_1.bias"), 0)
    z = z @ g("prompt_projector.linear_2.weight").T + g("prompt_projector.linear_2.bias")
    return (z @ g("encoder_projector.weight").T + g("encoder_projector.bias")).astype(np.float32)
