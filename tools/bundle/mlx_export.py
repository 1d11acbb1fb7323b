"""Any bundle ttg loads -> the mlx-audio layout (`config.json` + `model.safetensors`), quantized.

`ttg export SRC --out DIR --quantize {q8,q5,q4,mixed68} [--bitmap FILE] [--group-size 64] [--dtype D]`

The output is what mlx-audio's `nemotron_asr/convert.py` writes for a quantized conversion (and what
`asr_core.mlx_bundle` and `mlx_audio.stt.load` read): NeMo module names, MLX tensor layouts, the
non-quantized tensors in `--dtype` (default: the dtype the source stores, e.g. f16 for the published
fp16 bundle; mlx-community's conversions are bf16), and for every quantized linear layer (and the
embedding) its affine codes packed into uint32 with `scales`/`biases` in that dtype.
`config.json["quantization"]` records the bits and group size: the most common pair at the top level,
every other module by path (mlx-audio's fine-grained form). A quantized source is dequantized first
(its codes are not reused).

Which modules are quantized, and how:
- q8 / q5 / q4: every linear layer and the embedding, at 8 / 5 / 4 bits;
- mixed68: 6 bits, with 8 bits for the layers the mixed 6/8-bit build protects (its card: the RNN-T
  joint, the language-prompt projection and the final encoder layers' first feed-forward; here the
  joint's three linears, both prompt linears and FFN1 of the last sixth of the layers: 13 modules at
  full size, 210 at 6 bits);
- `--bitmap FILE` then overrides per module (format in `read_bitmap`); the plan is written to
  `quant_bitmap.json` beside the bundle;
- the group size: `--group-size` where it divides the module's input width, else the nearest MLX
  group size that does (32, 64, 128); a module no group size fits stays dense (e.g. the demo model's
  176-wide layers), and the summary says so.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from numpy.typing import NDArray

from asr_core.bundle import (
    LINEAR_KINDS,
    MLX_AUDIO_LAYOUT,
    PRECISIONS,
    Bundle,
    ModelConfig,
    encoder_tensor_kinds,
    expected_shape,
    load_bundle,
    to_pytorch_layout,
)
from asr_core.decoder.numpy_rnnt import RnntWeights
from asr_core.features import slaney_mel_filters
from asr_core.mlx_bundle import CONFIG_FILE, EMBED, JOINT_HEAD, JOINT_PRED, WEIGHTS_FILE, layout_name
from asr_core.quant import GROUP_SIZES, QUANT_BITS, QuantizedLinear

F32 = NDArray[np.float32]
SCHEMES: dict[str, int] = {"q8": 8, "q5": 5, "q4": 4, "mixed68": 6}  # default bits of each scheme
MIXED_PROTECTED_BITS = 8
BITMAP_FILE = "quant_bitmap.json"
NEMO_TARGET = "nemo.collections.asr.models.rnnt_bpe_models_prompt.EncDecRNNTBPEModelWithPrompt"


class MlxExportError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Choice:
    """One quantizable module's fate: (bits, group size), or dense with the reason."""

    in_features: int
    bits: int | None = None
    group_size: int | None = None
    reason: str = ""


def quantizable_modules(cfg: ModelConfig) -> dict[str, int]:
    """mlx-audio module path -> input width, for every linear layer and the embedding."""
    enc = cfg.encoder
    out: dict[str, int] = {}
    for hf, kind in encoder_tensor_kinds(enc.num_hidden_layers, enc.n_subsampling_stages).items():
        if kind in LINEAR_KINDS:
            out[layout_name(hf, MLX_AUDIO_LAYOUT).removesuffix(".weight")] = expected_shape(kind, enc)[1]
    hidden = cfg.decoder_hidden_size
    out |= {EMBED: hidden, JOINT_PRED: hidden, JOINT_HEAD: enc.output_size}
    return out


def mixed68_protected(cfg: ModelConfig) -> set[str]:
    """The modules mixed68 keeps at 8 bits (module docstring)."""
    layers = cfg.encoder.num_hidden_layers
    last = max(1, round(layers / 6))
    out = {JOINT_PRED, JOINT_HEAD, "joint.enc", "prompt_kernel.0", "prompt_kernel.2"}
    for n in range(layers - last, layers):
        out |= {f"encoder.layers.{n}.feed_forward1.linear1", f"encoder.layers.{n}.feed_forward1.linear2"}
    return out


def read_bitmap(path: Path, modules: Mapping[str, int]) -> dict[str, tuple[int, int | None] | None]:
    """Per-module overrides from a JSON file: module path -> bits, or {"bits": b, "group_size": g},
    or null/false to keep the module dense. The map may also be an mlx-audio `quantization` block
    (its top-level bits/group_size/mode keys are skipped: the scheme gives the default), or a whole
    config.json holding one. Paths are mlx-audio module paths (e.g. "joint.joint_net.2")."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MlxExportError(f"{path}: cannot read the bitmap ({e})") from None
    if isinstance(obj, dict) and isinstance(obj.get("quantization"), dict):
        obj = obj["quantization"]
    if not isinstance(obj, dict):
        raise MlxExportError(f"{path}: expected a JSON object {{module path: bits}}")
    out: dict[str, tuple[int, int | None] | None] = {}
    for name, value in obj.items():
        if name in ("bits", "group_size", "mode"):
            continue
        if name not in modules:
            raise MlxExportError(f"{path}: {name}: not a quantizable module of this model")
        group: int | None = None
        if value is None or value is False:
            out[name] = None
            continue
        if isinstance(value, dict):
            group = value.get("group_size")
            value = value.get("bits")
        if isinstance(value, bool) or not isinstance(value, int) or value not in QUANT_BITS:
            raise MlxExportError(f"{path}: {name}: bits {value!r} (MLX affine bits: {QUANT_BITS})")
        if group is not None and group not in GROUP_SIZES:
            raise MlxExportError(f"{path}: {name}: group_size {group!r} (MLX group sizes: {GROUP_SIZES})")
        out[name] = (value, group)
    return out


def plan(
    cfg: ModelConfig,
    scheme: str,
    bitmap: Mapping[str, tuple[int, int | None] | None] | None = None,
    group_size: int = 64,
) -> dict[str, Choice]:
    """Every quantizable module's bits and group size under `scheme` (+ `bitmap`), or why it stays dense."""
    if scheme not in SCHEMES:
        raise MlxExportError(f"unknown scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    if group_size not in GROUP_SIZES:
        raise MlxExportError(f"group size {group_size}: MLX has {GROUP_SIZES}")
    modules = quantizable_modules(cfg)
    protected = mixed68_protected(cfg) if scheme == "mixed68" else set()
    out: dict[str, Choice] = {}
    for name, width in modules.items():
        bits: int | None = MIXED_PROTECTED_BITS if name in protected else SCHEMES[scheme]
        wanted = group_size
        if bitmap is not None and name in bitmap:
            override = bitmap[name]
            if override is None:
                out[name] = Choice(width, reason="dense by the bitmap")
                continue
            bits, wanted = override[0], override[1] or group_size
        # The requested group size first, then the nearest others (smaller before larger).
        order = sorted(GROUP_SIZES, key=lambda g: (abs(math.log2(g / wanted)), g))
        group = next((g for g in order if width % g == 0), None)
        if group is None:
            why = f"input width {width} is not a multiple of any MLX group size {GROUP_SIZES}"
            out[name] = Choice(width, reason=why)
        else:
            out[name] = Choice(width, bits, group)
    return out


# --------------------------------------------------------------------------------------------------
# tensors and config in mlx-audio's form


def _mlx_layout(w: F32) -> F32:
    """PyTorch layout -> MLX's (conv2d OHWI, conv1d (O, K, I); linear unchanged)."""
    if w.ndim == 4:
        return np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    if w.ndim == 3:
        return np.ascontiguousarray(w.transpose(0, 2, 1))
    return w


def mlx_tensors(bundle: Bundle) -> Iterator[tuple[str, F32]]:
    """Every tensor of the model under mlx-audio's names and layouts, float32 (packed sources
    dequantized), one at a time."""
    enc = bundle.config.encoder
    for hf, kind in encoder_tensor_kinds(enc.num_hidden_layers, enc.n_subsampling_stages).items():
        w = bundle.encoder_weights[hf]
        if isinstance(w, QuantizedLinear):
            pt = np.array(w.dequantize(mx.float32), np.float32)
        else:
            pt = to_pytorch_layout(kind, np.array(w.astype(mx.float32), np.float32))
        yield layout_name(hf, MLX_AUDIO_LAYOUT), _mlx_layout(pt)
    rnnt = bundle.rnnt_weights if bundle.rnnt_weights is not None else bundle.rnnt_graphs().weights()
    yield from _decoder_tensors(rnnt).items()


def _decoder_tensors(w: RnntWeights) -> dict[str, F32]:
    out = {f"{EMBED}.weight": w.embedding}
    for i, layer in enumerate(w.lstm):
        p = f"decoder.prediction.dec_rnn.lstm.{i}."
        out |= {p + "Wx": layer.w_ih, p + "Wh": layer.w_hh, p + "bias": layer.bias}
    out |= {f"{JOINT_PRED}.weight": w.proj_w, f"{JOINT_PRED}.bias": w.proj_b}
    out |= {f"{JOINT_HEAD}.weight": w.head_w, f"{JOINT_HEAD}.bias": w.head_b}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def mlx_config(bundle: Bundle) -> dict[str, Any]:
    """config.json in the schema mlx-audio's convert.py writes (without `quantization`)."""
    cfg, enc, feat = bundle.config, bundle.config.encoder, bundle.config.features
    if cfg.blank_token_id != cfg.vocab_size - 1:
        raise MlxExportError(
            f"blank id {cfg.blank_token_id} is not the last of {cfg.vocab_size}: mlx-audio's is"
        )
    if enc.intermediate_size % enc.hidden_size:
        raise MlxExportError(
            f"feed-forward width {enc.intermediate_size} is not a multiple of d_model {enc.hidden_size}"
        )
    if feat.fmin != 0 or feat.fmax != feat.sampling_rate / 2:
        raise MlxExportError(f"mel range {feat.fmin}-{feat.fmax} Hz: the MLX layout implies 0 to Nyquist")
    formula = slaney_mel_filters(feat.sampling_rate, feat.n_fft, feat.n_mels, feat.fmin, feat.fmax)
    if not np.allclose(bundle.mel_filters, formula, rtol=0, atol=1e-6):
        raise MlxExportError("the bundle's filterbank is not the slaney formula the MLX layout implies")
    locales = [k for k, v in cfg.prompt_dictionary.items() if v == cfg.default_prompt_id]
    if not locales:
        raise MlxExportError(
            f"no locale of the prompt table has the default prompt id {cfg.default_prompt_id}"
        )
    default_language = "auto" if "auto" in locales else locales[0]
    return {
        "model_type": "nemotron_asr",
        "target": NEMO_TARGET,
        "preprocessor": {
            "sample_rate": feat.sampling_rate,
            "features": feat.n_mels,
            "n_fft": feat.n_fft,
            "window_size": feat.win_length / feat.sampling_rate,
            "window_stride": feat.hop_length / feat.sampling_rate,
            "window": "hann",
            "preemph": feat.preemphasis,
            "dither": 1e-05,
            "normalize": "NA",
            "log_zero_guard_value": feat.log_zero_guard,
            "pad_to": 0,
            "pad_value": 0.0,
        },
        "encoder": {
            "feat_in": feat.n_mels,
            "n_layers": enc.num_hidden_layers,
            "d_model": enc.hidden_size,
            "n_heads": enc.num_attention_heads,
            "ff_expansion_factor": enc.intermediate_size // enc.hidden_size,
            "subsampling_factor": enc.subsampling_factor,
            "subsampling_conv_channels": enc.subsampling_conv_channels,
            "conv_kernel_size": enc.conv_kernel_size,
            "causal_downsampling": True,
            "conv_context_size": "causal",
            "conv_norm_type": "layer_norm",
            "self_attention_model": "rel_pos",
            "att_context_style": "chunked_limited",
            "att_context_size": [[enc.left_context_frames, r] for r in enc.supported_lookaheads],
            "pos_emb_max_len": 5000,
            "use_bias": False,
            "xscaling": enc.scale_input,
        },
        "prompt": {
            "num_prompts": enc.num_prompts,
            "prompt_hidden": enc.prompt_intermediate_size,
            "prompt_dictionary": dict(cfg.prompt_dictionary),
        },
        "decoder": {
            "pred_hidden": cfg.decoder_hidden_size,
            "pred_rnn_layers": cfg.num_decoder_layers,
            "vocab_size": cfg.vocab_size - 1,
            "blank_as_pad": True,
        },
        "joint": {
            "joint_hidden": enc.output_size,
            "activation": "relu",
            "encoder_hidden": enc.hidden_size,
            "pred_hidden": cfg.decoder_hidden_size,
            "num_classes": cfg.vocab_size - 1,
        },
        "vocabulary": list(bundle.pieces[: cfg.blank_token_id]),
        "default_language": default_language,
        "default_att_context_size": [enc.left_context_frames, enc.default_lookahead],
        "max_symbols": cfg.max_symbols_per_step,
    }


def quantization_block(choices: Mapping[str, Choice]) -> dict[str, Any]:
    """The config's `quantization`: the most common (bits, group) pair on top, every other quantized
    module by path. The top-level group size is the smallest one used, because mlx-audio's loader
    skips a module whose width that group size does not divide before it reads the module's entry."""
    used = [(c.bits, c.group_size) for c in choices.values() if c.bits is not None]
    if not used:
        raise MlxExportError("no module can be quantized (see the widths in the plan)")
    top_bits = Counter(b for b, _ in used).most_common(1)[0][0]
    top_group = min(g for _, g in used if g is not None)
    block: dict[str, Any] = {"group_size": top_group, "bits": top_bits, "mode": "affine"}
    for name, c in choices.items():
        if c.bits is not None and (c.bits, c.group_size) != (top_bits, top_group):
            block[name] = {"group_size": c.group_size, "bits": c.bits, "mode": "affine"}
    return block


# --------------------------------------------------------------------------------------------------


def export_mlx(
    src: Path,
    out: Path,
    scheme: str,
    bitmap: Path | None = None,
    group_size: int = 64,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Load `src` (any layout), write the quantized mlx-audio layout to `out`; returns a summary.
    `dtype` of the tensors that stay dense and of the scales: the source's stored dtype by default
    (rounding an f16 model's dense weights to bf16 costs more accuracy than 8-bit codes do)."""
    if dtype is not None and dtype not in PRECISIONS:
        raise MlxExportError(f"dtype {dtype!r}: one of {', '.join(PRECISIONS)}")
    bundle = load_bundle(src, "f32")
    dtype = dtype or bundle.stored_precision
    overrides = read_bitmap(bitmap, quantizable_modules(bundle.config)) if bitmap is not None else None
    choices = plan(bundle.config, scheme, overrides, group_size)
    config = mlx_config(bundle)
    config["quantization"] = quantization_block(choices)
    config["quantization_config"] = config["quantization"]

    target = PRECISIONS[dtype]
    arrays: dict[str, mx.array] = {}
    # On the CPU whatever the default device: the same codes from any machine.
    with mx.stream(mx.cpu):
        for name, w in mlx_tensors(bundle):
            a = mx.array(w).astype(target)
            module = name.removesuffix(".weight")
            c = choices.get(module)
            if name.endswith(".weight") and c is not None and c.bits is not None:
                codes, scales, biases = mx.quantize(a, group_size=c.group_size, bits=c.bits)
                arrays |= {name: codes, f"{module}.scales": scales, f"{module}.biases": biases}
                mx.eval(codes, scales, biases)
            else:
                arrays[name] = a
                mx.eval(a)

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.tmp.safetensors"  # mx.save_safetensors wants the suffix
    mx.save_safetensors(str(tmp), arrays, metadata={"format": "mlx", "producer": "ttg export"})
    os.replace(tmp, out / WEIGHTS_FILE)
    _write_json(out / CONFIG_FILE, config)
    allocation = {
        n: ({"bits": c.bits, "group_size": c.group_size} if c.bits is not None else None)
        for n, c in choices.items()
    }
    _write_json(out / BITMAP_FILE, allocation)
    if bundle.sentencepiece_path is not None:
        shutil.copyfile(bundle.sentencepiece_path, out / "tokenizer.model")

    by_bits = Counter(str(c.bits) for c in choices.values() if c.bits is not None)
    by_group = Counter(str(c.group_size) for c in choices.values() if c.bits is not None)
    return {
        "dir": str(out),
        "source": str(src),
        "source_layout": bundle.layout,
        "layout": MLX_AUDIO_LAYOUT,
        "scheme": scheme,
        "dtype": dtype,
        "quantized_modules": sum(by_bits.values()),
        "by_bits": dict(sorted(by_bits.items())),
        "by_group_size": dict(sorted(by_group.items())),
        "dense_modules": {n: c.reason for n, c in choices.items() if c.bits is None},
        "bytes": (out / WEIGHTS_FILE).stat().st_size,
        "files": sorted(p.name for p in out.iterdir() if not p.name.startswith(".")),
    }


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
