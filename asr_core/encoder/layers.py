"""The encoder's math in MLX as pure functions over batched arrays (model_spec.md §3, §5.3).

Shapes: B rows, T new encoder frames per row, D = hidden, H heads of dh, Lc cached frames, K conv
taps. The streaming entry points (`subsample`, `encoder_stack`) are traced by `mx.compile` once per input
shape; everything elementwise between two matmuls fuses into one kernel there.

Every linear layer's weight is a `Linear`: dense (in, out), or packed affine codes that stay packed
(`asr_core.quant`: one `mx.quantized_matmul` per product, per-module bits and group size).
Convolutions, norms and biases are always dense.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from asr_core.bundle import EncoderConfig
from asr_core.encoder import expmath
from asr_core.quant import Linear, QuantizedLinear, addmm, concat_rows, linear
from asr_core.views import at


@dataclass(frozen=True)
class LayerParams:
    ff1_norm: tuple[mx.array, mx.array]
    ff1_w1: Linear  # D -> FF
    ff1_w2: Linear  # FF -> D
    att_norm: tuple[mx.array, mx.array]
    # D -> 3D = [q | k | v] in one product (one part), or three products when the packed parts differ
    # in bits or group size. q is pre-scaled by 1/sqrt(dh) when dense; packed codes keep their scales
    # and the queries are scaled after the product (`q_scale`), so no extra rounding touches them.
    w_qkv: tuple[Linear, ...]
    q_scale: float  # 1.0 (folded into dense weights and b_u/b_v) or 1/sqrt(dh)
    b_u: mx.array  # (D,) bias_u (/ sqrt(dh) when folded)
    b_v: mx.array  # (D,) bias_v (/ sqrt(dh) when folded)
    w_o: Linear  # D -> D
    w_pos: Linear  # relative_k_proj, for tables built at run time (offline)
    # (H, dh, NP): projected relative positions for distances d_max down to d_min (reverse order, so
    # the rel-shift is a strided view, see `_attention`), precomputed once for streaming steps.
    pos_rev: mx.array
    conv_norm: tuple[mx.array, mx.array]
    w_pw1: mx.array  # (D, 2D): GLU value | gate
    w_dw: tuple[mx.array, ...]  # K taps of (D,), oldest frame first
    dw_norm: tuple[mx.array, mx.array]
    w_pw2: mx.array  # (D, D)
    ff2_norm: tuple[mx.array, mx.array]
    ff2_w1: Linear
    ff2_w2: Linear
    out_norm: tuple[mx.array, mx.array]


@dataclass(frozen=True)
class SubsamplingParams:
    w_in: mx.array  # (k*k, C) conv_in taps, kt-major (one input channel): a matmul over patches
    b_in: mx.array  # (C,)
    w_dw: tuple[tuple[mx.array, ...], ...]  # per later stage: taps (C,), kt-major
    b_dw: tuple[mx.array, ...]
    w_pw: tuple[mx.array, ...]  # (C_in, C_out)
    b_pw: tuple[mx.array, ...]
    w_out: Linear  # C*F -> D, input index c*F + f
    b_out: mx.array


@dataclass(frozen=True)
class HeadParams:
    w1_x: Linear  # D -> P: prompt_projector.linear_1's inputs from the encoder output
    w1_prompt: mx.array  # (num_prompts, P): its one-hot block as a table, plus linear_1.bias
    w2: Linear  # P -> D
    b2: mx.array
    w_proj: Linear  # D -> J encoder_projector
    b_proj: mx.array


@dataclass(frozen=True)
class EncoderParams:
    cfg: EncoderConfig
    dtype: mx.Dtype
    sub: SubsamplingParams
    layers: tuple[LayerParams, ...]
    head: HeadParams
    t_max: int  # largest chunk (encoder frames) the precomputed position tables cover
    # the layers' sigmoid and softmax as array ops rather than MLX's kernels (`expmath`: x86-64 CPU)
    array_exp: bool = False

    @property
    def input_scale(self) -> float:
        return float(np.sqrt(self.cfg.hidden_size)) if self.cfg.scale_input else 1.0


def relative_position_embedding(distances: np.ndarray, d_model: int) -> np.ndarray:
    """Transformer-XL sinusoids for relative distances (query minus key), interleaved sin/cos.

    Computed in float32 exactly like the reference (NeMo RelPositionalEncoding, HF
    NemotronAsrStreamingEncoderRelPositionalEncoding), which is also how the model was trained.
    """
    inv_freq = np.float32(1.0) / (
        np.float32(10000.0) ** (np.arange(0, d_model, 2, dtype=np.float32) / np.float32(d_model))
    )
    angles = distances.astype(np.float32)[:, None] * inv_freq[None, :]
    pe = np.empty((len(distances), d_model), dtype=np.float32)
    pe[:, 0::2] = np.sin(angles)
    pe[:, 1::2] = np.cos(angles)
    return pe


def dense_in_out(w: Linear) -> mx.array:
    """The (in, out) float32 matrix of a linear weight (packed codes dequantized)."""
    return w.dequantize(mx.float32).T if isinstance(w, QuantizedLinear) else w.astype(mx.float32)


def project_positions(w_pos: Linear, distances: np.ndarray, n_heads: int, dtype: mx.Dtype) -> mx.array:
    """(H, dh, len(distances)) = relpos(distances) @ relative_k_proj, in float64 then cast; the columns
    follow `distances` (callers pass them largest first). A table computed once, so packed codes are
    dequantized for it."""
    w = np.array(dense_in_out(w_pos), dtype=np.float64)
    d_model = w.shape[0]
    pe = relative_position_embedding(distances, d_model).astype(np.float64)
    proj = (pe @ w).reshape(len(distances), n_heads, d_model // n_heads)
    return mx.array(np.ascontiguousarray(proj.transpose(1, 2, 0)).astype(np.float32)).astype(dtype)


def build_params(
    weights: Mapping[str, Linear],
    cfg: EncoderConfig,
    dtype: mx.Dtype,
    unpack: bool = False,
    array_exp: bool | None = None,
) -> EncoderParams:
    """Bundle weights (HF names; dense in MLX layouts, or packed) -> fused arrays in `dtype`; packed
    codes stay packed, their scales and biases in `dtype`, unless `unpack` (then they are
    dequantized once, here: the same values as dense weights). `array_exp` (None: where it is
    faster, `expmath.array_exp_default`): the layers' sigmoid and softmax as array ops."""
    if array_exp is None:
        array_exp = expmath.array_exp_default()
    if unpack:
        weights = {n: dense_in_out(w) if isinstance(w, QuantizedLinear) else w for n, w in weights.items()}

    def w(name: str) -> mx.array:
        return _dense(weights[name], name).astype(dtype)

    def lin(name: str) -> Linear:
        return weights[name].astype(dtype)

    def w32(name: str) -> mx.array:
        return _dense(weights[name], name).astype(mx.float32)

    def taps(kernel: mx.array) -> tuple[mx.array, ...]:  # OHWI (C, kt, kf, 1) -> kt-major taps
        return tuple(kernel[:, kt, kf, 0] for kt in range(kernel.shape[1]) for kf in range(kernel.shape[2]))

    def norm(prefix: str) -> tuple[mx.array, mx.array]:
        return w(prefix + ".weight"), w(prefix + ".bias")

    H, dh, Lc = cfg.num_attention_heads, cfg.head_dim, cfg.left_context_frames
    t_max = max(cfg.supported_lookaheads) + 1
    # Distances a streaming query (Lc + i) sees to keys 0 .. Lc + T - 1, for every T <= t_max, largest
    # first: d_max = Lc + t_max - 1 down to d_min = -(t_max - 1).
    distances = np.arange(Lc + t_max - 1, -t_max, -1)

    layers = []
    for n in range(cfg.num_hidden_layers):
        p = f"encoder.layers.{n}."
        a = p + "self_attn."
        w_qkv, q_scale = _qkv(weights, a, dh**-0.5, dtype)
        b_u, b_v = (w32(a + name).reshape(-1) * (dh**-0.5 / q_scale) for name in ("bias_u", "bias_v"))
        layers.append(
            LayerParams(
                ff1_norm=norm(p + "norm_feed_forward1"),
                ff1_w1=lin(p + "feed_forward1.linear1.weight"),
                ff1_w2=lin(p + "feed_forward1.linear2.weight"),
                att_norm=norm(p + "norm_self_att"),
                w_qkv=w_qkv,
                q_scale=q_scale,
                b_u=b_u.astype(dtype),
                b_v=b_v.astype(dtype),
                w_o=lin(a + "o_proj.weight"),
                w_pos=lin(a + "relative_k_proj.weight"),
                pos_rev=project_positions(weights[a + "relative_k_proj.weight"], distances, H, dtype),
                conv_norm=norm(p + "norm_conv"),
                w_pw1=w(p + "conv.pointwise_conv1.weight"),
                w_dw=tuple(w(p + "conv.depthwise_conv.weight")),
                dw_norm=norm(p + "conv.norm"),
                w_pw2=w(p + "conv.pointwise_conv2.weight"),
                ff2_norm=norm(p + "norm_feed_forward2"),
                ff2_w1=lin(p + "feed_forward2.linear1.weight"),
                ff2_w2=lin(p + "feed_forward2.linear2.weight"),
                out_norm=norm(p + "norm_out"),
            )
        )

    s = "encoder.subsampling."
    n_later = cfg.n_subsampling_stages - 1
    sub = SubsamplingParams(
        w_in=mx.stack(list(taps(w(s + "conv_in.weight")))),
        b_in=w(s + "conv_in.bias"),
        w_dw=tuple(taps(w(s + f"layers.{i}.depthwise_conv.weight")) for i in range(n_later)),
        b_dw=tuple(w(s + f"layers.{i}.depthwise_conv.bias") for i in range(n_later)),
        w_pw=tuple(w(s + f"layers.{i}.pointwise_conv.weight")[:, 0, 0, :].T for i in range(n_later)),
        b_pw=tuple(w(s + f"layers.{i}.pointwise_conv.bias") for i in range(n_later)),
        w_out=lin(s + "linear.weight"),
        b_out=w(s + "linear.bias"),
    )
    D = cfg.hidden_size
    w1 = weights["prompt_projector.linear_1.weight"]  # D + num_prompts -> P
    # one-hot(p) @ W1[D:] is row p of W1[D:]: a table; folding the bias in saves an add per step.
    w1_prompt = dense_in_out(w1)[D:] + w32("prompt_projector.linear_1.bias")
    head = HeadParams(
        # Packed codes split on a group boundary: (D + num_prompts) % group == 0 and num_prompts is
        # a multiple of every MLX group size, so D is too.
        w1_x=w1.columns(0, D).astype(dtype) if isinstance(w1, QuantizedLinear) else w1[:D].astype(dtype),
        w1_prompt=w1_prompt.astype(dtype),
        w2=lin("prompt_projector.linear_2.weight"),
        b2=w("prompt_projector.linear_2.bias"),
        w_proj=lin("encoder_projector.weight"),
        b_proj=w("encoder_projector.bias"),
    )
    # Materialize contiguous copies now so no step pays for a slice, transpose or cast.
    params = EncoderParams(cfg, dtype, sub, tuple(layers), head, t_max, array_exp)
    return _rebuild_contiguous(params)


def _dense(w: Linear, name: str) -> mx.array:
    if isinstance(w, QuantizedLinear):
        raise ValueError(f"{name}: packed codes where the encoder needs a dense tensor")
    return w


def _qkv(
    weights: Mapping[str, Linear], prefix: str, scale: float, dtype: mx.Dtype
) -> tuple[tuple[Linear, ...], float]:
    """The [q | k | v] projection as one product where the parts allow it, and the query scale left
    to apply after it (see LayerParams.w_qkv)."""
    parts = [weights[prefix + f"{x}_proj.weight"] for x in ("q", "k", "v")]
    dense = [x for x in parts if not isinstance(x, QuantizedLinear)]
    packed = [x for x in parts if isinstance(x, QuantizedLinear)]
    if len(dense) == 3:
        wq, wk, wv = (x.astype(mx.float32) for x in dense)
        return (mx.concatenate([wq * scale, wk, wv], axis=1).astype(dtype),), 1.0
    fused = concat_rows(packed) if len(packed) == 3 else None
    if fused is not None:
        return (fused.astype(dtype),), scale
    return tuple(x.astype(dtype) for x in parts), scale


def weight_nbytes(params: EncoderParams) -> int:
    """Bytes of every weight the encoder keeps on the device (packed codes at their packed size)."""
    return sum(int(a.nbytes) for a in _leaves((params.layers, params.sub, params.head)))


def _contiguous(value: Any) -> Any:
    """Copy of a params tree with every array contiguous (and evaluated by the caller)."""
    if isinstance(value, mx.array):
        return mx.contiguous(value)
    if isinstance(value, QuantizedLinear):
        w, scales, biases = (mx.contiguous(a) for a in value.arrays())
        return QuantizedLinear(w, scales, biases, value.bits, value.group_size)
    if isinstance(value, tuple):
        return tuple(_contiguous(v) for v in value)
    if isinstance(value, LayerParams | SubsamplingParams | HeadParams):
        return type(value)(**{k: _contiguous(v) for k, v in vars(value).items()})
    return value


def _leaves(value: Any) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, QuantizedLinear):
        return list(value.arrays())
    if isinstance(value, tuple):
        return [a for v in value for a in _leaves(v)]
    if isinstance(value, LayerParams | SubsamplingParams | HeadParams):
        return [a for v in vars(value).values() for a in _leaves(v)]
    return []


def _rebuild_contiguous(params: EncoderParams) -> EncoderParams:
    layers, sub, head = _contiguous(params.layers), _contiguous(params.sub), _contiguous(params.head)
    mx.eval(_leaves(layers) + _leaves(sub) + _leaves(head))
    return dataclasses.replace(params, layers=layers, sub=sub, head=head)


# --------------------------------------------------------------------------------------------------
# Subsampling: causal time-freq strided convs, each stage with its own one-row time cache


def _tap_views(x: mx.array, k: int, s: int, t_out: int, f_out: int) -> list[mx.array]:
    """The k*k strided views (kt-major) a stride-s k x k convolution multiplies its taps with."""
    return [
        x[:, kt : kt + s * (t_out - 1) + 1 : s, kf : kf + s * (f_out - 1) + 1 : s]
        for kt in range(k)
        for kf in range(k)
    ]


def _depthwise_taps(views: list[mx.array], taps: Sequence[mx.array]) -> mx.array:
    """Depthwise conv as a sum of tap-weighted views: one fused kernel under mx.compile, and on the
    CPU still faster than a grouped conv2d."""
    acc = views[0] * taps[0]
    for view, tap in zip(views[1:], taps[1:], strict=True):
        acc = acc + view * tap
    return acc


def subsample(
    p: EncoderParams,
    mel: mx.array,
    caches: list[mx.array] | None,
    first: bool,
    last: bool,
    chain: tuple[mx.array, mx.array] | None = None,
    lengths: mx.array | None = None,
) -> tuple[mx.array, list[mx.array]]:
    """mel (B, n, n_mels) -> (B, T, D) and each stage's new cached input row.

    `caches[i]` is stage i's cached input row ((B, F_i) for the mel stage, (B, F_i, C) later), ignored
    on a first chunk, which gets the offline causal padding (2 zero rows) instead. A last chunk gets
    the offline right padding (1 zero row) at every stage (model_spec.md §5.3).

    `chain` (later chunks): (parent (B,) row indices, follows (B,) bool): a row that follows takes its
    caches from its parent row's input in this same call instead of `caches`, i.e. it is the chunk
    after its parent's (the second chunk of a flush). A parent must not follow another row.

    `lengths` (later chunks): (B,) mel rows that are real; the rest of a row is zero padding (a stream's
    short last chunk in a call of full-length ones). Each stage's outputs past the real ones are zeroed,
    so the next stage reads zeros there, as the offline right padding; a row's real frames are then
    those of the row alone with `last` (the padded ones are not, and its cache rows are not either).
    """
    cfg = p.cfg
    k, s = cfg.subsampling_conv_kernel_size, cfg.subsampling_conv_stride
    x = mel.astype(p.dtype)
    new_rows: list[mx.array] = []
    for i in range(cfg.n_subsampling_stages):
        if x.shape[1] == 0:
            raise ValueError("an empty chunk reached the subsampling")
        extra = [(0, 0)] * (x.ndim - 3)  # channels, after the first stage
        x = mx.pad(x, [(0, 0), (0, 0), (k - 1, s - 1), *extra])  # causal frequency padding
        if first:
            x = mx.pad(x, [(0, 0), (k - 1, 0), (0, 0), *extra])
        else:
            assert caches is not None
            cache = caches[i]
            if chain is not None:
                parent, follows = chain
                lead = mx.take(x[:, -1], parent, axis=0)  # the parent's last input row of this stage
                cache = mx.where(follows.reshape((-1,) + (1,) * (cache.ndim - 1)), lead, cache)
            x = mx.concatenate([cache[:, None], x], axis=1)
        # The row a later chunk needs is this chunk's last input row (before the right padding).
        new_rows.append(x[:, -1])
        if last:
            x = mx.pad(x, [(0, 0), (0, s - 1), (0, 0), *extra])
        t_in, f_in = x.shape[1], x.shape[2]
        t_out, f_out = (t_in - k) // s + 1, (f_in - k) // s + 1
        views = _tap_views(x, k, s, t_out, f_out)
        if i == 0:
            # One input channel: patches (B, T, F, k*k) @ taps (k*k, C), not k*k full-size products.
            x = mx.maximum(mx.stack(views, axis=-1) @ p.sub.w_in + p.sub.b_in, 0)
        else:
            x = _depthwise_taps(views, p.sub.w_dw[i - 1]) + p.sub.b_dw[i - 1]
            x = mx.maximum(x @ p.sub.w_pw[i - 1] + p.sub.b_pw[i - 1], 0)
        if lengths is not None:
            lengths = (lengths + (s - 1)) // s  # the stage's real outputs: as if right-padded at the end
            real = mx.arange(t_out, dtype=lengths.dtype)[None] < lengths[:, None]
            x = x * real[:, :, None, None].astype(x.dtype)
    # (B, T, F, C) -> (B, T, C*F): feature index c*F + f, as PyTorch's (B, C, T, F) flattening.
    x = x.swapaxes(2, 3).flatten(2, 3)
    x = linear(x, p.sub.w_out) + p.sub.b_out
    if p.cfg.scale_input:
        x = x * p.input_scale
    return x, new_rows


# --------------------------------------------------------------------------------------------------
# Conformer block with external caches


def _ln(x: mx.array, wb: tuple[mx.array, mx.array], eps: float) -> mx.array:
    return mx.fast.layer_norm(x, wb[0], wb[1], eps)


def _ff(
    x: mx.array, norm: tuple[mx.array, mx.array], w1: Linear, w2: Linear, eps: float, array_exp: bool
) -> mx.array:
    h = linear(_ln(x, norm, eps), w1)
    h = expmath.gated(h, h, array_exp)
    # residual + 0.5 * FF(x) in the matmul's epilogue
    return addmm(x, h, w2, alpha=0.5)


def _attention(
    qkv: mx.array,
    kv_cache: mx.array | None,
    mask: mx.array,
    pos_rev: mx.array,
    shift: int,
    cfg: EncoderConfig,
    lp: LayerParams,
    B: int,
    T: int,
    parent: mx.array | None = None,
    *,
    array_exp: bool,
) -> tuple[mx.array, mx.array]:
    """Relative-position attention of T new frames over [cache | new] keys, head-major (H, B, ...)
    throughout, with every matmul operand already in the layout the GEMM takes and no copy of the
    cache: the cached keys and the new ones are separate blocks of the scores (one product each,
    concatenated only as scores), so the cache is read where it was gathered and never joined to the
    new frames.

    * the bias add writes q+u as (H, B, T, dh) and q+v as (H, B*T, dh) (one fused kernel, two outputs);
    * the position term is H GEMMs of (B*T, dh) x (dh, NP) against the distance columns in reverse
      order, so the rel-shift of the reference is a strided view: query i's key j (cache first) sits at
      column shift - i + j of its row, i.e. a row stride of NP - 1 (`shift` = d_max minus the cached
      frames).
    * `parent` (B,) (chained calls): a row that continues another row of the call (a flush's second
      chunk) sees, as its newest T cached frames, its parent's new frames: a third block of keys between
      the cache and the new ones, at the cache's last T positions, whose cache slots the mask hides for
      such rows (`streaming_mask`); for the other rows the block is masked. Gathering T frames per row
      is what this costs, not a copy of every row's cache.

    qkv (B*T, 3D); kv_cache (2, H, B, Lc, dh) or None (offline: the keys are the new frames); mask
    additive, broadcastable to (H, B, T, keys); `array_exp`: the softmax's way (`expmath`).
    Returns (B*T, D) output rows and the new K|V (2, H, B, T, dh)."""
    D, H, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    NP = pos_rev.shape[-1]
    q = qkv[:, :D].reshape(B, T, H, dh).transpose(2, 0, 1, 3)  # (H, B, T, dh), a view
    q_u = q + lp.b_u.reshape(H, 1, 1, dh)
    q_v = (q + lp.b_v.reshape(H, 1, 1, dh)).reshape(H, B * T, dh)
    if lp.q_scale != 1.0:
        q_u, q_v = q_u * lp.q_scale, q_v * lp.q_scale
    kv_new = mx.contiguous(qkv[:, D:].reshape(B, T, 2, H, dh).transpose(2, 3, 0, 1, 4))
    Lc = 0 if kv_cache is None else kv_cache.shape[3]
    pos = q_v @ pos_rev  # (H, B*T, NP), contiguous
    rel = mx.as_strided(pos, (H, B, T, Lc + T), (B * T * NP, T * NP, NP - 1, 1), shift)
    blocks = [(kv_new, rel[..., Lc:])]  # (K|V of the keys, their position term)
    if kv_cache is not None:
        if parent is not None:
            blocks.insert(0, (mx.take(kv_new, parent, axis=2), rel[..., Lc - T : Lc]))
        blocks.insert(0, (kv_cache, rel[..., :Lc]))
    scores = mx.concatenate([q_u @ at(kv, 0).swapaxes(-1, -2) + r for kv, r in blocks], axis=-1) + mask
    p = expmath.softmax(scores, array_exp)
    o, start = None, 0
    for kv, _ in blocks:
        n = kv.shape[3]
        weights = p[..., start : start + n]
        o = weights @ at(kv, 1) if o is None else mx.addmm(o, weights, at(kv, 1))
        start += n
    assert o is not None
    return o.transpose(1, 2, 0, 3).reshape(B * T, D), kv_new


def conformer_layer(
    x: mx.array,
    kv_cache: mx.array | None,
    conv_cache: mx.array,
    mask: mx.array,
    pos_rev: mx.array,
    shift: int,
    lp: LayerParams,
    cfg: EncoderConfig,
    chain: tuple[mx.array, mx.array] | None = None,
    *,
    array_exp: bool,
) -> tuple[mx.array, mx.array, mx.array]:
    """One block over T new frames of B rows.

    x (B, T, D); kv_cache (2, H, B, Lc, dh) projected K|V of the cached frames, oldest first (None: no
    cache, as offline); conv_cache (B, K-1, D) last GLU outputs; mask additive, broadcastable to
    (H, B, T, keys) (`streaming_mask`); `pos_rev`/`shift`: the position table and where query 0's key 0
    sits in it (`_attention`); `chain` (parent (B,), conv context indices): rows that continue another
    row of the call (`_attention`, `chain_indices`); `array_exp`: how its sigmoids and softmax run
    (`EncoderParams.array_exp`).
    Returns x, this chunk's K|V (2, H, B, T, dh) and the new conv cache (B, K-1, D).
    """
    eps = cfg.layer_norm_eps
    D = cfg.hidden_size
    B, T = x.shape[0], x.shape[1]
    K = len(lp.w_dw)
    # The residual stream as (B*T, D) rows: every dense matmul is then one 2-D GEMM (MLX runs a
    # batched addmm as B small ones: 4x slower on the CPU, and B launches' worth on a GPU).
    x = x.reshape(B * T, D)

    x = _ff(x, lp.ff1_norm, lp.ff1_w1, lp.ff1_w2, eps, array_exp)

    h = _ln(x, lp.att_norm, eps)
    parts = [linear(h, w) for w in lp.w_qkv]
    qkv = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    parent, conv_ctx = chain if chain is not None else (None, None)
    o, kv_new = _attention(qkv, kv_cache, mask, pos_rev, shift, cfg, lp, B, T, parent, array_exp=array_exp)
    x = addmm(x, o, lp.w_o)

    # Convolution module: pw1 -> GLU -> causal depthwise over [cache | new] -> LN -> SiLU -> pw2.
    g = _ln(x, lp.conv_norm, eps) @ lp.w_pw1
    glu = expmath.gated(g[:, :D], g[:, D:], array_exp).reshape(B, T, D)
    if conv_ctx is not None:
        conv_cache = _continued(conv_cache, glu, conv_ctx)
    seq = mx.concatenate([conv_cache, glu], axis=1)  # (B, K-1+T, D)
    y = seq[:, 0:T] * lp.w_dw[0]
    for tap in range(1, K):
        y = y + seq[:, tap : tap + T] * lp.w_dw[tap]
    y = _ln(y.reshape(B * T, D), lp.dw_norm, eps)
    y = expmath.gated(y, y, array_exp)
    x = mx.addmm(x, y, lp.w_pw2)

    x = _ff(x, lp.ff2_norm, lp.ff2_w1, lp.ff2_w2, eps, array_exp)
    x = _ln(x, lp.out_norm, eps)
    return x.reshape(B, T, D), kv_new, seq[:, T:]


def head(p: EncoderParams, x: mx.array, prompt_ids: mx.array) -> mx.array:
    """Prompt fusion after the encoder, then encoder_projector: (B, T, D) -> (B, T, J) float32."""
    hp = p.head
    prompt = mx.take(hp.w1_prompt, prompt_ids, axis=0)[:, None, :]  # (B, 1, P)
    z = mx.maximum(linear(x, hp.w1_x) + prompt, 0)
    z = linear(z, hp.w2) + hp.b2
    return (linear(z, hp.w_proj) + hp.b_proj).astype(mx.float32)


def streaming_mask(
    valid: mx.array, Lc: int, T: int, dtype: mx.Dtype, seen: mx.array, follows: mx.array | None = None
) -> mx.array:
    """(1, B, T, keys) additive mask over [cache (Lc) | new (T)] keys: per query, the newest `valid`
    (B, T) of the Lc cache slots (the older ones hold no frame yet, or lie beyond its chunk's left
    context) and the first `seen` (B, T) new frames (its chunk's end, or the row's last real frame).

    With `follows` (B,) bool (a chained call, `_attention`), the keys are [cache | parent's new (T) |
    new]: a following row's newest T cache slots are its parent's new frames, so it sees them in the
    middle block and not in its own (whose rows there hold nothing yet); the other rows never see the
    middle block."""
    k = mx.arange(Lc + T)
    ok = (k >= Lc - valid[..., None]) & (k < Lc + seen[..., None])  # (B, T, Lc + T)
    if follows is not None:
        f = follows[:, None, None]
        newest = (k[:Lc] >= Lc - T)[None, None]
        ok = mx.concatenate([ok[..., :Lc] & ~(f & newest), ok[..., Lc - T : Lc] & f, ok[..., Lc:]], axis=-1)
    return mx.where(ok, mx.array(0, dtype), mx.array(-np.inf, dtype))[None]


def encoder_stack(
    p: EncoderParams,
    x: mx.array,
    kv_cache: Sequence[mx.array],
    conv_cache: mx.array,
    valid: mx.array,
    prompt_ids: mx.array,
    seen: mx.array,
    chain: tuple[mx.array, mx.array, mx.array] | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """All conformer layers plus the head for B rows of T frames (one streaming step).

    kv_cache (groups of consecutive layers, each (layers, 2, H, B, Lc, dh), in layer order) and
    conv_cache (layers, B, K-1, D) are the rows' gathered caches. `valid`, `seen`: per-query
    visibility (`streaming_mask`). `chain` (parent (B,) row indices, follows (B,) bool, conv context
    indices from `chain_indices`): rows that continue another row of the call.
    Returns frames (B, T, J) float32, new K|V (layers, 2, H, B, T, dh) and new conv caches
    (layers, B, K-1, D).
    """
    cfg = p.cfg
    T = x.shape[1]
    follows = chain[1] if chain is not None else None
    mask = streaming_mask(valid, cfg.left_context_frames, T, x.dtype, seen, follows)
    layer_chain = (chain[0], chain[2]) if chain is not None else None
    shift = p.t_max - 1  # d_max - Lc: query Lc + i and key j are Lc + i - j apart
    kv_layers = [at(group, j) for group in kv_cache for j in range(group.shape[0])]
    kv_out, conv_out = [], []
    for n, lp in enumerate(p.layers):
        x, kv_new, conv_new = conformer_layer(
            x,
            kv_layers[n],
            at(conv_cache, n),
            mask,
            lp.pos_rev,
            shift,
            lp,
            cfg,
            layer_chain,
            array_exp=p.array_exp,
        )
        kv_out.append(kv_new)
        conv_out.append(conv_new)
    frames = head(p, x, prompt_ids)
    return frames, mx.stack(kv_out), mx.stack(conv_out)


def chain_indices(parent: np.ndarray, T: int, K: int) -> np.ndarray:
    """Where each row's conv cache comes from when some rows of a call continue another row of it
    (`parent[r] != r`: row r is the chunk after row parent[r], a flush's second chunk).

    Per layer, a row's conv context is [its cache | its new GLU rows] (K - 1 + T rows); a row that
    continues its parent takes, as its cache, the last K - 1 of its parent's context: what the parent's
    step would have left in the pool. Returns flat row indices into those contexts (B, K - 1); a row
    that continues nothing reads its own cache. (The attention's chain needs no indices: `_attention`.)"""
    own = np.arange(len(parent)) == parent
    conv = parent[:, None] * (K - 1 + T) + np.where(own, 0, T)[:, None] + np.arange(K - 1)[None, :]
    return conv.astype(np.int32)


def _continued(cache: mx.array, new: mx.array, ctx: mx.array) -> mx.array:
    """cache (B, C, W) with each row replaced by the rows `ctx` (B, C) picks from every row's
    [cache | new] (B, C + T, W) context, flattened: one gather."""
    B, C, W = cache.shape
    context = mx.concatenate([cache, new], axis=1).reshape(-1, W)
    return mx.take(context, ctx.reshape(-1), axis=0).reshape(B, C, W)


def offline_forward(p: EncoderParams, mel: mx.array, lookahead: int, prompt_id: int) -> mx.array:
    """Whole utterance at once with the chunked_limited mask (the reference's offline mode)."""
    cfg = p.cfg
    if mel.shape[0] == 0:
        return mx.zeros((0, cfg.output_size))
    x, _ = subsample(p, mel[None], None, first=True, last=True)
    N = x.shape[1]
    chunk = lookahead + 1
    left_chunks = cfg.left_context_frames // chunk
    ci = np.arange(N) // chunk
    diff = ci[:, None] - ci[None, :]
    allowed = (diff >= 0) & (diff <= left_chunks)
    mask = mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32)).astype(p.dtype)[None, None]
    distances = np.arange(N - 1, -N, -1)  # every query-key distance, largest first
    conv_cache = mx.zeros((1, cfg.conv_kernel_size - 1, cfg.hidden_size), dtype=p.dtype)
    for lp in p.layers:
        pos_rev = project_positions(lp.w_pos, distances, cfg.num_attention_heads, p.dtype)
        x, _, _ = conformer_layer(x, None, conv_cache, mask, pos_rev, N - 1, lp, cfg, array_exp=p.array_exp)
    return head(p, x, mx.array([prompt_id]))[0]
