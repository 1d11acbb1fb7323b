"""Strict loader of the model's MLX layouts (docs/architecture.md, "The model bundle").

Two layouts keep the whole model in one `model.safetensors` under NeMo's module names, MLX tensor
layouts (Linear (out, in), conv2d OHWI, conv1d (O, K, I), LSTM `Wx`/`Wh`/one `bias`), with no ONNX
graphs and no filterbank file:

- **mlx-audio** (mlx-community's BF16 conversion and the builds quantized from it, e.g. 8-bit or the
  mixed 6/8-bit one): `config.json` with `model_type` "nemotron_asr" as mlx-audio's
  `stt/models/nemotron_asr/convert.py` writes it (preprocessor, encoder, prompt, decoder, joint,
  vocabulary, default_language, default_att_context_size, max_symbols; `quantization` when packed:
  top-level bits/group_size/mode, overridden per module path). A module is packed when the file has
  its `.scales`, as mlx-audio's loader decides.
- **speech-swift** (the int8/int5 build for soniqo/speech-swift's NemotronStreamingASR, read as
  `NemotronMLX{Configuration,Network,Runtime}.swift` read it): `config.json` with `model_type`
  "nemotron_streaming_rnnt_mlx" (uniform affine `quantization`, `streaming` cache geometry),
  `vocab.json` (pieces), `languages.json` or `lang2slot.json` (prompt table). Two names differ from
  mlx-audio's (`encoder.pre_encode.conv.{0,2,5}.conv.*`, `prompt_kernel.layers.{0,2}.*`); every linear
  layer of the encoder and the joint is packed, the prompt MLP, embedding, LSTM and convolutions are
  not; its runtime scales the subsampling output by sqrt(d_model) (so `scale_input` is on).

Both are checked completely (config values, the tensor set, every shape, and the bits and group size
of every packed module against its packed shapes) before any weight is read; a problem is a one-line
`BundleError` naming the file and the key or tensor. Packed encoder weights stay packed
(`asr_core.quant.QuantizedLinear`); the prediction network and joint become float32 arrays for the
ONNX graphs built at load (`Bundle.rnnt_graphs`). The filterbank is the slaney formula; the prompt
table, language tags, lookaheads and features come from the layout's own files.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np

from asr_core.bundle import (
    LINEAR_KINDS,
    MLX_AUDIO_LAYOUT,
    PRECISIONS,
    SENTENCEPIECE_FILE,
    ST_PRECISIONS,
    SWIFT_LAYOUT,
    Bundle,
    EncoderConfig,
    JsonReader,
    ModelConfig,
    StEntry,
    check_encoder_shapes,
    derive_encoder_config,
    encoder_tensor_kinds,
    expected_shape,
    hf_to_nemo_name,
    on_gpu,
    read_json,
    read_safetensors_header,
    read_tensor,
    to_mlx_layout,
)
from asr_core.decoder.numpy_rnnt import LstmLayer, RnntWeights
from asr_core.decoder.onnx_build import build_decoder, build_joiner
from asr_core.errors import BundleError
from asr_core.features import FeatureConfig, slaney_mel_filters
from asr_core.quant import GROUP_SIZES, QUANT_BITS, Linear, QuantizedLinear

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SWIFT_VOCAB_FILE = "vocab.json"
SWIFT_LANGUAGE_FILES = ("languages.json", "lang2slot.json")  # wrapped {"promptDictionary": ...}, or flat
MODEL_TYPES = {"nemotron_asr": MLX_AUDIO_LAYOUT, "nemotron_streaming_rnnt_mlx": SWIFT_LAYOUT}
BLANK_PIECE = "<blank>"  # the joint's last output; the layouts list only the pieces before it

# mlx-audio quantizes any linear layer (asr_core.bundle.LINEAR_KINDS) whose input width its group
# size divides; the decoder's embedding and the joint's linears likewise.
# speech-swift builds these with QuantizedLinear, everything else plain (NemotronMLXNetwork.swift).
SWIFT_PACKED_KINDS = LINEAR_KINDS - {"prompt1", "prompt2"}
EMBED = "decoder.prediction.embed"
JOINT_PRED, JOINT_HEAD = "joint.pred", "joint.joint_net.2"
SWIFT_PACKED_DECODER = frozenset({JOINT_PRED, JOINT_HEAD})


def layout_name(hf_name: str, layout: str) -> str:
    """The layout's own name of an HF-named encoder tensor (NeMo's module names, plus speech-swift's
    two renames: a `.conv` level under the strided subsampling convs, `prompt_kernel.layers.N`)."""
    name = hf_to_nemo_name(hf_name)
    if layout == SWIFT_LAYOUT:
        name = re.sub(r"^encoder\.pre_encode\.conv\.(\d+)\.", _swift_conv, name)
        name = re.sub(r"^prompt_kernel\.(\d+)\.", r"prompt_kernel.layers.\1.", name)
    return name


def _swift_conv(m: re.Match[str]) -> str:
    index = int(m.group(1))
    strided = index == 0 or index % 3 == 2  # conv_in and each stage's depthwise conv
    return f"encoder.pre_encode.conv.{index}.{'conv.' if strided else ''}"


def decoder_names(layers: int) -> list[str]:
    """The prediction network and joint's tensors (layout names, both layouts)."""
    names = [f"{EMBED}.weight"]
    for i in range(layers):
        names += [f"decoder.prediction.dec_rnn.lstm.{i}.{x}" for x in ("Wx", "Wh", "bias")]
    for module in (JOINT_PRED, JOINT_HEAD):
        names += [f"{module}.weight", f"{module}.bias"]
    return names


# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True, slots=True)
class Quantization:
    """The `quantization` block: the default bits/group size and per-module overrides."""

    bits: int
    group_size: int
    modules: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # module path -> (bits, group)

    def of(self, module: str) -> tuple[int, int]:
        return self.modules.get(module, (self.bits, self.group_size))


@dataclass(frozen=True, slots=True)
class _Parsed:
    model: dict[str, Any]  # ModelConfig fields except `encoder`
    encoder: dict[str, Any]  # EncoderConfig fields the config gives (the rest from tensor shapes)
    quantization: Quantization | None
    pieces: tuple[str, ...]  # the pieces before blank
    ff_expansion: int


def _bits_group(r: JsonReader, key_bits: str = "bits", key_group: str = "group_size") -> tuple[int, int]:
    mode = r.obj.get("mode", "affine")
    if mode != "affine":
        raise r.fail("mode", f"unsupported quantization mode {mode!r} (affine is supported)")
    bits = r.int_(key_bits)
    if bits not in QUANT_BITS:
        raise r.fail(key_bits, f"unsupported value {bits} (MLX affine bits: {QUANT_BITS})")
    group = r.int_(key_group, default=64)
    if group not in GROUP_SIZES:
        raise r.fail(key_group, f"unsupported value {group} (MLX group sizes: {GROUP_SIZES})")
    return bits, group


def _quantization(r: JsonReader, key: str) -> Quantization:
    q = r.sub(key)
    bits, group = _bits_group(q)
    modules: dict[str, tuple[int, int]] = {}
    for name, value in q.obj.items():
        if name in ("bits", "group_size", "mode"):
            continue
        if not isinstance(value, dict):
            raise q.fail(name, f"expected a module's {{bits, group_size}}, got {value!r}")
        modules[name] = _bits_group(q.sub(name))
    return Quantization(bits, group, MappingProxyType(modules))


def _features(pre: JsonReader, sr_key: str = "sample_rate") -> FeatureConfig:
    """The preprocessor block as NeMo's featurizer reads it (window_size/window_stride in seconds)."""
    sr = pre.int_(sr_key, default=16000)
    if sr != 16000:
        raise pre.fail(sr_key, f"unsupported value {sr} (the model takes 16000 Hz)")
    win_s, hop_s = pre.float_("window_size", 0.025), pre.float_("window_stride", 0.01)
    win, hop = round(win_s * sr), round(hop_s * sr)
    if abs(win - win_s * sr) > 1e-6 or abs(hop - hop_s * sr) > 1e-6 or hop < 1:
        raise pre.fail(
            "window_stride", f"window {win_s} s / stride {hop_s} s is not a whole number of samples"
        )
    n_fft = pre.int_("n_fft", default=512, minimum=2)
    if win > n_fft:
        raise pre.fail("window_size", f"{win} samples exceed n_fft {n_fft}")
    pre.choice("window", "hann", ("hann",))
    # NeMo's "NA" (and mlx-audio's default) is no normalization; per-utterance statistics cannot stream.
    pre.choice("normalize", "NA", ("NA",))
    if pre.int_("pad_to", default=0) != 0:
        raise pre.fail("pad_to", "unsupported (streaming features are not padded to a length)")
    pre.choice("pad_mode", "reflect", ("reflect", "constant"))
    guard = pre.float_("log_zero_guard_value", 2.0**-24)
    if guard <= 0:
        raise pre.fail("log_zero_guard_value", f"must be > 0, got {guard}")
    return FeatureConfig(
        sampling_rate=sr,
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        n_mels=pre.int_("features", default=128, minimum=1),
        preemphasis=pre.float_("preemph", 0.97),
        log_zero_guard=guard,
        fmin=0.0,
        fmax=sr / 2,
    )


def _prompts(r: JsonReader, key: str, table: Any, num_prompts: int) -> dict[str, int]:
    if not isinstance(table, dict):
        raise r.fail(key, "expected an object {locale: prompt id}")
    out: dict[str, int] = {}
    for locale, pid in table.items():
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < num_prompts:
            raise r.fail(f"{key}.{locale}", f"prompt id {pid!r} not in [0, {num_prompts})")
        out[str(locale)] = pid
    return out


def _pieces(r: JsonReader, key: str, value: Any, count: int) -> tuple[str, ...]:
    if isinstance(value, dict):  # {"0": piece, ...} (speech-swift accepts it too)
        try:
            by_id = {int(k): v for k, v in value.items()}
        except ValueError:
            raise r.fail(key, "keys of the vocabulary object must be token ids") from None
        value = [by_id.get(i) for i in range(len(by_id))]
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise r.fail(key, "expected a list of pieces (strings) in id order")
    if len(value) != count:
        raise r.fail(key, f"{len(value)} pieces, but the decoder has vocab_size {count}")
    return tuple(value)


def _common_encoder(
    r: JsonReader, enc: JsonReader, features: FeatureConfig, lookaheads: list[int], left: int, default: int
) -> dict[str, Any]:
    factor = enc.int_("subsampling_factor", default=8, minimum=2)
    if factor & (factor - 1):
        raise enc.fail("subsampling_factor", f"unsupported value {factor} (a power of two is required)")
    hidden = enc.int_("d_model", default=1024, minimum=1)
    heads = enc.int_("n_heads", default=8, minimum=1)
    if hidden % heads:
        raise enc.fail("n_heads", f"{heads} does not divide d_model {hidden}")
    if enc.int_("feat_in", default=features.n_mels) != features.n_mels:
        raise enc.fail(
            "feat_in", f"{enc.obj['feat_in']} disagrees with the preprocessor's {features.n_mels} mels"
        )
    if enc.bool_("use_bias", False):
        raise enc.fail("use_bias", "unsupported value true (the model's conformer layers have no biases)")
    enc.choice("conv_norm_type", "layer_norm", ("layer_norm",))
    for la in lookaheads:
        if not 0 <= la < left:
            raise r.fail("encoder", f"unsupported lookahead {la} (0 <= r < {left})")
    if default not in lookaheads:
        raise r.fail("encoder", f"default lookahead {default} is not one of {lookaheads}")
    return dict(
        hidden_size=hidden,
        num_hidden_layers=enc.int_("n_layers", default=24, minimum=1),
        num_attention_heads=heads,
        subsampling_factor=factor,
        left_context_frames=left,
        supported_lookaheads=tuple(lookaheads),
        default_lookahead=default,
        n_mels=features.n_mels,
        frame_ms=factor * features.hop_length * 1000 / features.sampling_rate,
        conv_kernel_size=enc.int_("conv_kernel_size", default=9, minimum=1),
        subsampling_conv_channels=enc.int_("subsampling_conv_channels", default=256, minimum=1),
    )


def _parse_mlx_audio(path: Path, obj: Mapping[str, Any]) -> _Parsed:
    """config.json as mlx-audio's nemotron_asr ModelConfig.from_dict reads it (its defaults for
    absent keys), checked against what this implementation runs."""
    r = JsonReader(path, obj)
    features = _features(r.sub("preprocessor"))
    enc = r.sub("encoder")
    if not enc.bool_("causal_downsampling", True):
        raise enc.fail("causal_downsampling", "unsupported value false (the streaming model is causal)")
    ctx = enc.obj.get("conv_context_size", "causal")
    kernel = enc.int_("conv_kernel_size", default=9, minimum=1)
    if ctx != "causal" and ctx != [kernel - 1, 0]:
        raise enc.fail("conv_context_size", f"unsupported value {ctx!r} (causal is supported)")
    enc.choice("self_attention_model", "rel_pos", ("rel_pos",))
    enc.choice("att_context_style", "chunked_limited", ("chunked_limited",))
    contexts = enc.obj.get("att_context_size", [[56, 13]])
    if not isinstance(contexts, list) or not contexts or not all(_pair(c) for c in contexts):
        raise enc.fail("att_context_size", f"expected a list of [left, right] pairs, got {contexts!r}")
    lefts = {c[0] for c in contexts}
    if len(lefts) != 1:
        raise enc.fail("att_context_size", f"left contexts differ ({sorted(lefts)}): one is supported")
    left = lefts.pop()
    lookaheads = [c[1] for c in contexts]
    default_ctx = obj.get("default_att_context_size", [left, 13])
    if not _pair(default_ctx) or default_ctx[0] != left:
        raise r.fail("default_att_context_size", f"expected [{left}, lookahead], got {default_ctx!r}")
    encoder = _common_encoder(r, enc, features, lookaheads, left, default_ctx[1])
    encoder["scale_input"] = enc.bool_("xscaling", False)

    prompt = r.sub("prompt")
    num_prompts = prompt.int_("num_prompts", default=128)
    if num_prompts < 1:
        raise prompt.fail("num_prompts", "0: models without a language prompt are not supported")
    encoder["num_prompts"] = num_prompts
    encoder["prompt_intermediate_size"] = prompt.int_("prompt_hidden", default=2048, minimum=1)
    prompts = _prompts(prompt, "prompt_dictionary", prompt.obj.get("prompt_dictionary", {}), num_prompts)

    dec, joint = r.sub("decoder"), r.sub("joint")
    vocab = dec.int_("vocab_size", default=13087, minimum=1)
    if not dec.bool_("blank_as_pad", True):
        raise dec.fail("blank_as_pad", "unsupported value false (blank is the padding id of the embedding)")
    pred_hidden = dec.int_("pred_hidden", default=640, minimum=1)
    _check_joint(joint, vocab, encoder["hidden_size"], pred_hidden)
    encoder["output_size"] = joint.int_("joint_hidden", default=640, minimum=1)
    default_language = obj.get("default_language", "auto")
    if not isinstance(default_language, str):
        raise r.fail("default_language", f"expected a locale string, got {default_language!r}")
    # mlx-audio's rule: the default language's slot, else slot 0.
    default_prompt = prompts.get(default_language, 0)
    pieces = _pieces(r, "vocabulary", obj.get("vocabulary"), vocab)
    model = _model_fields(vocab, pred_hidden, dec.int_("pred_rnn_layers", default=2, minimum=1), features)
    model |= dict(
        max_symbols_per_step=r.int_("max_symbols", default=10, minimum=1),
        num_prompts=num_prompts,
        default_prompt_id=default_prompt,
        prompt_dictionary=MappingProxyType(prompts),
    )
    quant = None
    for key in ("quantization", "quantization_config"):  # mlx-audio reads the first it finds
        if key in obj:
            quant = _quantization(r, key)
            break
    return _Parsed(model, encoder, quant, pieces, enc.int_("ff_expansion_factor", default=4, minimum=1))


def _parse_swift(root: Path, path: Path, obj: Mapping[str, Any]) -> _Parsed:
    """config.json, vocab.json and the language map as NemotronMLXConfiguration.swift and
    NemotronStreamingASRMLXModel.fromDirectory read them (sizes from the config, not its fixed
    validate() geometry: smaller models of the same structure load too)."""
    r = JsonReader(path, obj)
    pre = r.sub("preprocessor")
    features = _features(pre)
    if r.int_("sample_rate") != features.sampling_rate:
        raise r.fail("sample_rate", "disagrees with preprocessor.sample_rate")
    enc, stream = r.sub("encoder"), r.sub("streaming")
    factor = enc.int_("subsampling_factor", minimum=2)
    out_frames = stream.int_("output_frames", minimum=1)
    left = stream.int_("attention_left_context", minimum=1)
    if stream.int_("mel_frames") != out_frames * factor:
        raise stream.fail("mel_frames", f"must be output_frames x subsampling_factor = {out_frames * factor}")
    if stream.int_("conv_cache_size") != enc.int_("conv_kernel_size") - 1:
        raise stream.fail("conv_cache_size", "must be conv_kernel_size - 1")
    frame_ms = factor * features.hop_length * 1000 / features.sampling_rate
    if abs(stream.int_("chunk_ms") - out_frames * frame_ms) > 1e-6:
        raise stream.fail("chunk_ms", f"must be output_frames x {frame_ms:g} ms")
    stream.int_("pre_cache_size")
    # One chunk size: output_frames encoder frames per step, i.e. lookahead output_frames - 1.
    encoder = _common_encoder(r, enc, features, [out_frames - 1], left, out_frames - 1)
    encoder["scale_input"] = True  # NemotronMLXEncoder.stream: hidden * sqrt(hiddenSize)

    pk = r.sub("prompt_kernel")
    num_prompts = pk.int_("num_prompts", minimum=1)
    if pk.int_("d_model") != encoder["hidden_size"]:
        raise pk.fail("d_model", "disagrees with encoder.d_model")
    encoder["num_prompts"] = num_prompts
    encoder["prompt_intermediate_size"] = pk.int_("hidden", minimum=1)

    dec, joint = r.sub("decoder"), r.sub("joint")
    vocab = r.int_("vocab_size", minimum=1)
    if dec.int_("vocab_size") != vocab:
        raise dec.fail("vocab_size", "disagrees with vocab_size")
    if not dec.bool_("blank_as_pad", True):
        raise dec.fail("blank_as_pad", "unsupported value false (blank is the padding id of the embedding)")
    prednet = dec.sub("prednet")
    pred_hidden = prednet.int_("pred_hidden", minimum=1)
    jointnet = joint.sub("jointnet")
    if joint.int_("num_classes") != vocab:
        raise joint.fail("num_classes", f"must equal vocab_size {vocab}")
    _check_joint(jointnet, None, encoder["hidden_size"], pred_hidden)
    encoder["output_size"] = jointnet.int_("joint_hidden", minimum=1)

    lang_path = next((root / n for n in SWIFT_LANGUAGE_FILES if (root / n).is_file()), None)
    if lang_path is None:
        raise BundleError(f"{root / SWIFT_LANGUAGE_FILES[0]}: missing file (or {SWIFT_LANGUAGE_FILES[1]})")
    lang_obj = read_json(lang_path)
    lr = JsonReader(lang_path, lang_obj)
    table = lang_obj.get("promptDictionary", lang_obj)
    prompts = _prompts(lr, "promptDictionary" if table is not lang_obj else "(map)", table, num_prompts)
    if "auto" not in prompts:
        raise lr.fail("auto", "missing: the language map must have an auto slot")
    vocab_path = root / SWIFT_VOCAB_FILE
    if not vocab_path.is_file():
        raise BundleError(f"{vocab_path}: missing file")
    try:
        vocab_obj = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{vocab_path}: cannot read a JSON vocabulary ({e})") from None
    pieces = _pieces(JsonReader(vocab_path, {}), "(pieces)", vocab_obj, vocab)

    model = _model_fields(vocab, pred_hidden, prednet.int_("pred_rnn_layers", minimum=1), features)
    model |= dict(
        max_symbols_per_step=10,  # NemotronMLXStreamingSession.processChunk: at most 10 per frame
        num_prompts=num_prompts,
        default_prompt_id=prompts["auto"],
        prompt_dictionary=MappingProxyType(prompts),
    )
    bits, group = _bits_group(r.sub("quantization"))
    return _Parsed(
        model, encoder, Quantization(bits, group), pieces, enc.int_("ff_expansion_factor", minimum=1)
    )


def _pair(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _check_joint(joint: JsonReader, vocab: int | None, hidden: int, pred_hidden: int) -> None:
    joint.choice("activation", "relu", ("relu",))
    if vocab is not None and joint.int_("num_classes", default=vocab) != vocab:
        raise joint.fail("num_classes", f"must equal decoder.vocab_size {vocab}")
    if joint.int_("encoder_hidden", default=hidden) != hidden:
        raise joint.fail("encoder_hidden", f"must equal encoder d_model {hidden}")
    if joint.int_("pred_hidden", default=pred_hidden) != pred_hidden:
        raise joint.fail("pred_hidden", f"must equal the decoder's pred_hidden {pred_hidden}")


def _model_fields(vocab: int, pred_hidden: int, layers: int, features: FeatureConfig) -> dict[str, Any]:
    return dict(
        vocab_size=vocab + 1,  # the pieces, then blank
        blank_token_id=vocab,
        pad_token_id=0,
        decoder_hidden_size=pred_hidden,
        num_decoder_layers=layers,
        features=features,
    )


# --------------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One encoder or decoder tensor of the file: dense, or a packed module's three tensors."""

    name: str  # the layout's name of the weight (or bias, norm, ...)
    kind: str  # encoder kind (asr_core.bundle), or "decoder"
    entry: StEntry  # the weight itself (uint32 codes when packed)
    packed: tuple[StEntry, StEntry, int, int] | None = None  # scales, biases, bits, group size

    def logical_shape(self) -> tuple[int, ...]:
        """The PyTorch-layout shape (what asr_core.bundle's shape checks expect)."""
        shape = self.entry.shape
        if self.packed is not None:
            bits = self.packed[2]
            return (shape[0], shape[1] * 32 // bits) if len(shape) == 2 else shape
        if len(shape) == 4:  # conv2d OHWI -> (O, I, H, W)
            return (shape[0], shape[3], shape[1], shape[2])
        if len(shape) == 3:  # conv1d (O, K, I) -> (O, I, K)
            return (shape[0], shape[2], shape[1])
        return shape


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _collect(
    path: Path,
    entries: Mapping[str, StEntry],
    layout: str,
    kinds: Mapping[str, str],
    decoder_layers: int,
    quant: Quantization | None,
) -> tuple[dict[str, _Tensor], dict[str, _Tensor]]:
    """Encoder tensors by HF name and decoder tensors by layout name, with their packing; the file's
    tensor set must be exactly the layout's."""
    want: dict[str, tuple[str, str]] = {layout_name(hf, layout): (hf, kind) for hf, kind in kinds.items()}
    want |= {n: (n, "decoder") for n in decoder_names(decoder_layers)}
    packed_modules = {_module(n) for n in entries if n.endswith(".scales")}
    expected = set(want)
    for module in packed_modules:
        expected |= {f"{module}.scales", f"{module}.biases"}
    missing = [n for n in want if n not in entries]
    extra = sorted(set(entries) - expected)
    for names, what in ((missing, "missing"), (extra, "unexpected")):
        if names:
            more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
            raise BundleError(f"{path}: {what} tensor {', '.join(names[:3])}{more}")

    for module in sorted(packed_modules):
        weight = f"{module}.weight"
        kind = want.get(weight, ("", ""))[1]
        quantizable = kind in LINEAR_KINDS or module in (EMBED, JOINT_PRED, JOINT_HEAD)
        if not quantizable:
            raise BundleError(f"{path}: tensor {module}.scales: {module} is not a linear layer or embedding")
        if f"{module}.biases" not in entries:
            raise BundleError(f"{path}: missing tensor {module}.biases (affine codes need scales and biases)")
    if packed_modules and quant is None:
        raise BundleError(
            f"{path}: packed tensors ({sorted(packed_modules)[0]}.scales) but config.json has no quantization"
        )
    if quant is not None:
        for module in quant.modules:
            if module not in packed_modules:
                cfg = path.parent / CONFIG_FILE
                raise BundleError(f"{cfg}: quantization.{module}: no such packed module in {path.name}")
    if layout == SWIFT_LAYOUT:
        swift = {_module(layout_name(hf, layout)) for hf, kind in kinds.items() if kind in SWIFT_PACKED_KINDS}
        swift |= SWIFT_PACKED_DECODER
        for module in sorted(swift ^ packed_modules):
            state = "packed" if module in packed_modules else "not packed"
            raise BundleError(
                f"{path}: {module} is {state}, but speech-swift's network packs exactly its linears"
            )

    encoder: dict[str, _Tensor] = {}
    decoder: dict[str, _Tensor] = {}
    for name, (hf, kind) in want.items():
        module, entry = _module(name), entries[name]
        packed = None
        if module in packed_modules and name == f"{module}.weight":
            assert quant is not None
            bits, group = quant.of(module)
            packed = (entries[f"{module}.scales"], entries[f"{module}.biases"], bits, group)
            if entry.dtype != "U32":
                raise BundleError(f"{path}: tensor {name}: packed codes must be U32, got {entry.dtype}")
        elif entry.dtype == "U32":
            raise BundleError(f"{path}: tensor {name}: U32 codes without {module}.scales")
        tensor = _Tensor(name, kind, entry, packed)
        if kind == "decoder":
            decoder[name] = tensor
        else:
            encoder[hf] = tensor
    return encoder, decoder


def _check_packed(path: Path, t: _Tensor, out_in: tuple[int, int]) -> None:
    """The packed weight, scales and biases hold exactly (out, in) codes of the configured bits and
    group size."""
    assert t.packed is not None
    scales, biases, bits, group = t.packed
    out, n_in = out_in
    module = _module(t.name)
    if n_in % group:
        raise BundleError(
            f"{path}: {module}: input width {n_in} is not a multiple of its group size {group} (config.json)"
        )
    want_w, want_s = (out, n_in * bits // 32), (out, n_in // group)
    if (n_in * bits) % 32 or t.entry.shape != want_w:
        raise BundleError(
            f"{path}: tensor {t.name}: packed shape {t.entry.shape} does not hold {out}x{n_in} {bits}-bit "
            f"codes {want_w}: the bits in config.json do not match the packed shapes"
        )
    for name, e in ((f"{module}.scales", scales), (f"{module}.biases", biases)):
        if e.dtype not in ST_PRECISIONS:
            raise BundleError(f"{path}: tensor {name}: expected a float dtype, got {e.dtype}")
        if e.shape != want_s:
            raise BundleError(
                f"{path}: tensor {name}: shape {e.shape}, expected {want_s} for group size {group}: "
                "the group size in config.json does not match the packed shapes"
            )


def _decoder_shapes(vocab: int, hidden: int, joint: int, layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {f"{EMBED}.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"decoder.prediction.dec_rnn.lstm.{i}."
        shapes |= {p + "Wx": (4 * hidden, hidden), p + "Wh": (4 * hidden, hidden), p + "bias": (4 * hidden,)}
    shapes |= {f"{JOINT_PRED}.weight": (joint, hidden), f"{JOINT_PRED}.bias": (joint,)}
    shapes |= {f"{JOINT_HEAD}.weight": (vocab, joint), f"{JOINT_HEAD}.bias": (vocab,)}
    return shapes


# --------------------------------------------------------------------------------------------------
# The loader


def load_mlx_bundle(root: Path, precision: str = "auto") -> Bundle:
    """Check every file of an MLX-layout bundle in `root`, then build the `Bundle` (module docstring).

    `precision` "auto": the file's dtype on a GPU (bf16 for mlx-community's), f32 on the CPU."""
    cfg_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not cfg_path.is_file():
        raise BundleError(
            f"{root}: not a model bundle: no nemotron_onnx_config.json + encoder.safetensors (the ONNX "
            f"bundle) and no {CONFIG_FILE} + {WEIGHTS_FILE} (an MLX bundle)"
        )
    obj = read_json(cfg_path)
    model_type = obj.get("model_type")
    layout = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if layout is None:
        hint = " (a transformers checkpoint: `ttg export` converts it)" if model_type else ""
        raise BundleError(
            f"{cfg_path}: model_type {model_type!r} is not a layout this loader reads "
            f"({', '.join(repr(t) for t in MODEL_TYPES)}){hint}"
        )
    if not weights_path.is_file():
        raise BundleError(f"{weights_path}: missing file")

    # 1. Validate everything (nothing heavy is read yet).
    parsed = _parse_swift(root, cfg_path, obj) if layout == SWIFT_LAYOUT else _parse_mlx_audio(cfg_path, obj)
    entries = read_safetensors_header(weights_path, packed=True)
    raw_enc = parsed.encoder
    n_stages = int(math.log2(raw_enc["subsampling_factor"]))
    kinds = encoder_tensor_kinds(raw_enc["num_hidden_layers"], n_stages)
    n_dec = parsed.model["num_decoder_layers"]
    enc_t, dec_t = _collect(weights_path, entries, layout, kinds, n_dec, parsed.quantization)
    shapes = {hf: t.logical_shape() for hf, t in enc_t.items()}
    raw_enc["intermediate_size"] = parsed.ff_expansion * raw_enc["hidden_size"]
    try:
        enc_cfg = derive_encoder_config(raw_enc, shapes, weights_path)
        _check_shapes(weights_path, enc_t, dec_t, enc_cfg, parsed)
    except BundleError as e:  # name the tensor as the file does
        text = str(e)
        for hf, t in enc_t.items():
            text = text.replace(f"tensor {hf}:", f"tensor {t.name}:")
        raise BundleError(text) from None
    config = ModelConfig(encoder=enc_cfg, **parsed.model)

    stored = Counter(t.entry.dtype for t in [*enc_t.values(), *dec_t.values()] if t.packed is None)
    stored_precision = ST_PRECISIONS[stored.most_common(1)[0][0]]
    if precision == "auto":
        precision = stored_precision if on_gpu() else "f32"
    dtype = PRECISIONS[precision]
    sp_path = root / SENTENCEPIECE_FILE

    # 2. Build: one tensor at a time.
    weights: dict[str, Linear] = {}
    for hf, kind in kinds.items():
        weights[hf] = _encoder_weight(weights_path, enc_t[hf], kind, dtype, precision)
    rnnt = _rnnt_weights(weights_path, dec_t, n_dec, config.blank_token_id)
    quantized = {
        _module(t.name): (t.packed[2], t.packed[3])
        for t in [*enc_t.values(), *dec_t.values()]
        if t.packed is not None
    }
    f = config.features
    return Bundle(
        dir=root,
        config=config,
        precision=precision,
        encoder_weights=MappingProxyType(weights),
        mel_filters=slaney_mel_filters(f.sampling_rate, f.n_fft, f.n_mels, f.fmin, f.fmax),
        pieces=(*parsed.pieces, BLANK_PIECE),
        decoder_path=None,
        joiner_path=None,
        sentencepiece_path=sp_path if sp_path.is_file() else None,
        tensor_naming="mlx",
        layout=layout,
        stored_precision=stored_precision,
        rnnt_weights=rnnt,
        rnnt_graphs_built=(build_decoder(rnnt), build_joiner(rnnt)),
        quantized=MappingProxyType(dict(sorted(quantized.items()))),
    )


def _check_shapes(
    path: Path,
    enc_t: Mapping[str, _Tensor],
    dec_t: Mapping[str, _Tensor],
    enc: EncoderConfig,
    parsed: _Parsed,
) -> None:
    kinds = encoder_tensor_kinds(enc.num_hidden_layers, enc.n_subsampling_stages)
    expected = {hf: expected_shape(kind, enc) for hf, kind in kinds.items()}
    for hf, t in enc_t.items():
        if t.packed is not None:
            want = expected[hf]
            _check_packed(path, t, (want[0], want[1]))
    check_encoder_shapes({hf: t.logical_shape() for hf, t in enc_t.items()}, enc, path)
    m = parsed.model
    dec_shapes = _decoder_shapes(
        m["vocab_size"], m["decoder_hidden_size"], enc.output_size, m["num_decoder_layers"]
    )
    for name, want in dec_shapes.items():
        t = dec_t[name]
        if t.packed is not None:
            _check_packed(path, t, (want[0], want[1]))
        elif t.entry.shape != want:
            raise BundleError(f"{path}: tensor {name}: expected shape {want}, got {t.entry.shape}")


def _to_float(path: Path, e: StEntry, name: str) -> np.ndarray:
    """A float tensor as float32 numpy (bf16 bits widened)."""
    data, is_bf16 = read_tensor(path, e)
    if is_bf16:
        return (np.asarray(data, np.uint32) << 16).view(np.float32)
    return np.asarray(data, np.float32)


def _mx_float(path: Path, e: StEntry) -> mx.array:
    data, is_bf16 = read_tensor(path, e)
    return mx.array(np.ascontiguousarray(data)).view(mx.bfloat16) if is_bf16 else mx.array(data)


def _finite(path: Path, name: str, a: mx.array, precision: str) -> None:
    if not bool(mx.all(mx.isfinite(a)).item()):
        raise BundleError(f"{path}: tensor {name}: non-finite values (in {precision})")


def _encoder_weight(path: Path, t: _Tensor, kind: str, dtype: mx.Dtype, precision: str) -> Linear:
    if t.packed is not None:
        scales_e, biases_e, bits, group = t.packed
        codes, _ = read_tensor(path, t.entry)
        scales, biases = (_mx_float(path, e).astype(dtype) for e in (scales_e, biases_e))
        q = QuantizedLinear(mx.array(np.ascontiguousarray(codes)), scales, biases, bits, group)
        mx.eval(*q.arrays())
        _finite(path, f"{_module(t.name)}.scales", scales, precision)
        _finite(path, f"{_module(t.name)}.biases", biases, precision)
        return q
    data, is_bf16 = read_tensor(path, t.entry)
    # MLX layout -> PyTorch layout -> this encoder's layout (asr_core.bundle.to_mlx_layout)
    if data.ndim == 4:
        data = data.transpose(0, 3, 1, 2)
    elif data.ndim == 3:
        data = data.transpose(0, 2, 1)
    host = to_mlx_layout(kind, data)
    w = (mx.array(host).view(mx.bfloat16) if is_bf16 else mx.array(host)).astype(dtype)
    mx.eval(w)
    _finite(path, t.name, w, precision)
    return w


def _rnnt_weights(path: Path, dec_t: Mapping[str, _Tensor], layers: int, blank: int) -> RnntWeights:
    """The prediction network and joint as float32 arrays (packed ones dequantized: the decoder runs
    on the CPU through onnxruntime in float32)."""

    def get(name: str) -> np.ndarray:
        t = dec_t[name]
        if t.packed is not None:
            scales_e, biases_e, bits, group = t.packed
            codes, _ = read_tensor(path, t.entry)
            w = mx.dequantize(
                mx.array(np.ascontiguousarray(codes)),
                _mx_float(path, scales_e).astype(mx.float32),
                _mx_float(path, biases_e).astype(mx.float32),
                group_size=group,
                bits=bits,
            )
            out = np.array(w, np.float32)
        else:
            out = np.ascontiguousarray(_to_float(path, t.entry, name))
        if not np.all(np.isfinite(out)):
            raise BundleError(f"{path}: tensor {name}: non-finite values")
        return out

    embedding = get(f"{EMBED}.weight").copy()
    # blank_as_pad: blank is the embedding's padding id, a zero vector (NeMo keeps that row zero; the
    # MLX runtimes feed zeros for it), whatever the stored row holds.
    embedding[blank] = 0.0
    lstm = tuple(
        LstmLayer(
            get(f"decoder.prediction.dec_rnn.lstm.{i}.Wx"),
            get(f"decoder.prediction.dec_rnn.lstm.{i}.Wh"),
            get(f"decoder.prediction.dec_rnn.lstm.{i}.bias"),
        )
        for i in range(layers)
    )
    return RnntWeights(
        embedding,
        lstm,
        get(f"{JOINT_PRED}.weight"),
        get(f"{JOINT_PRED}.bias"),
        get(f"{JOINT_HEAD}.weight"),
        get(f"{JOINT_HEAD}.bias"),
    )
