"""Strict loader of the published model bundle (docs/architecture.md, "The model bundle").

`load_bundle(dir, precision)` checks every file before it builds anything: the config's known keys
and values, the encoder tensor names (HF, or NeMo renamed at load), shapes and byte ranges, the mel
filterbank, tokens.txt and the ONNX graphs' input/output names and ranks. Any problem is a one-line
`BundleError` naming the file (and the tensor). Only then are the encoder weights read, one tensor
at a time, converted to MLX layouts in the chosen precision:

| PyTorch layout                       | MLX layout here                               |
| ------------------------------------ | --------------------------------------------- |
| Linear (out, in)                     | (in, out): `y = x @ w`                        |
| Conv2d (O, I/g, kH, kW)              | OHWI                                          |
| depthwise Conv1d (C, 1, K)           | (K, C): tap K-1 multiplies the newest frame   |
| pointwise Conv1d (O, I, 1)           | linear (in, out)                              |
| LayerNorm, biases, bias_u/v          | unchanged                                     |
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import mlx.core as mx
import numpy as np

from asr_core.errors import BundleError
from asr_core.features import FeatureConfig
from asr_core.quant import Linear

if TYPE_CHECKING:
    import onnx

    from asr_core.decoder.graphs import RnntGraphs
    from asr_core.decoder.numpy_rnnt import RnntWeights

Precision = Literal["f32", "f16", "bf16"]
PRECISIONS: dict[str, mx.Dtype] = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
ST_PRECISIONS = {"F32": "f32", "F16": "f16", "BF16": "bf16"}  # safetensors dtype -> precision

# Layouts the loader reads (docs/architecture.md, "The model bundle").
ONNX_LAYOUT = "onnx"  # the published fp16 five-file bundle: encoder.safetensors + ONNX decoder/joiner
MLX_AUDIO_LAYOUT = "mlx-audio"  # config.json + model.safetensors (mlx-community, its quantized builds)
SWIFT_LAYOUT = "speech-swift"  # the int8/int5 build for soniqo/speech-swift's NemotronStreamingASR
LAYOUTS = (ONNX_LAYOUT, MLX_AUDIO_LAYOUT, SWIFT_LAYOUT)

ENCODER_FILE = "encoder.safetensors"
DECODER_FILE = "decoder.onnx"
JOINER_FILE = "joiner.onnx"
TOKENS_FILE = "tokens.txt"
CONFIG_FILE = "nemotron_onnx_config.json"
MELFILTERS_FILE = "melfilters.f32"
SENTENCEPIECE_FILE = "tokenizer.model"
REQUIRED_FILES = (ENCODER_FILE, DECODER_FILE, JOINER_FILE, TOKENS_FILE, CONFIG_FILE, MELFILTERS_FILE)

# Published-model constants the config does not spell out (model_spec.md §1).
SUBSAMPLING_KERNEL = 3
SUBSAMPLING_STRIDE = 2
LAYER_NORM_EPS = 1e-5
DEFAULT_SUPPORTED_LOOKAHEADS = (3, 0, 6, 13)


# --------------------------------------------------------------------------------------------------
# Typed configuration


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """Every size the MLX encoder needs; the loader fills what the config omits from tensor shapes."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    conv_kernel_size: int
    subsampling_factor: int
    subsampling_conv_channels: int
    n_mels: int
    left_context_frames: int
    num_prompts: int
    prompt_intermediate_size: int
    output_size: int  # encoder_projector out = joiner "encoder_frame" width
    supported_lookaheads: tuple[int, ...] = DEFAULT_SUPPORTED_LOOKAHEADS
    default_lookahead: int = 3
    scale_input: bool = False
    frame_ms: float = 80.0
    subsampling_conv_kernel_size: int = SUBSAMPLING_KERNEL
    subsampling_conv_stride: int = SUBSAMPLING_STRIDE
    layer_norm_eps: float = LAYER_NORM_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def n_subsampling_stages(self) -> int:
        return int(math.log2(self.subsampling_factor))

    def subsampling_freqs(self) -> list[int]:
        """Frequency width of each strided stage's input after causal padding, then the final width."""
        k, s = self.subsampling_conv_kernel_size, self.subsampling_conv_stride
        widths, f = [], self.n_mels
        for _ in range(self.n_subsampling_stages):
            f_in = f + (k - 1) + (s - 1)
            widths.append(f_in)
            f = (f_in - k) // s + 1
        return [*widths, f]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """`nemotron_onnx_config.json`, checked and typed (unknown extra keys are ignored)."""

    vocab_size: int
    blank_token_id: int
    pad_token_id: int
    decoder_hidden_size: int
    num_decoder_layers: int
    max_symbols_per_step: int
    num_prompts: int
    default_prompt_id: int
    prompt_dictionary: Mapping[str, int]
    encoder: EncoderConfig
    features: FeatureConfig
    chunk_ms_to_lookahead: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    exported_chunk_ms: tuple[int, ...] = ()
    cache_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def prompt_id(self, language: str | None) -> int:
        """Prompt slot of a locale ("uk-UA"), a bare code the table lists ("uk"), or "auto"/None."""
        if language is None or language == "auto":
            return self.prompt_dictionary.get("auto", self.default_prompt_id)
        try:
            return self.prompt_dictionary[language]
        except KeyError:
            raise ValueError(
                f"unknown language {language!r}: not in the bundle's prompt_dictionary"
            ) from None


@dataclass(frozen=True, slots=True)
class Bundle:
    dir: Path
    config: ModelConfig
    precision: str
    # HF tensor names -> MLX layouts (module docstring) in `precision`; a quantized linear layer's
    # weight stays packed (asr_core.quant.QuantizedLinear, scales and biases in `precision`).
    encoder_weights: Mapping[str, Linear]
    mel_filters: np.ndarray  # (n_mels, n_fft/2+1) float32
    pieces: tuple[str, ...]  # piece text by token id (the blank id keeps whatever text the file has)
    # The ONNX graphs, or None where the layout holds the prediction network and joint as weights.
    decoder_path: Path | None
    joiner_path: Path | None
    sentencepiece_path: Path | None
    tensor_naming: Literal["hf", "nemo", "mlx"] = "hf"
    mel_filters_transposed: bool = False
    layout: str = ONNX_LAYOUT  # one of LAYOUTS
    stored_precision: str = "f32"  # the dtype most of the file's float tensors are stored in
    rnnt_weights: RnntWeights | None = None  # the prediction network and joint (MLX layouts), float32
    rnnt_graphs_built: tuple[onnx.ModelProto, onnx.ModelProto] | None = None  # their graphs, built once
    # Quantized modules (the layout's own module paths) -> (bits, group size); empty when dense.
    quantized: Mapping[str, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({}))

    def rnnt_graphs(self, threads: int = 1) -> RnntGraphs:
        """onnxruntime sessions of the prediction network and joint: the bundle's ONNX files, or
        graphs built in memory from its weights (`asr_core.decoder.onnx_build`)."""
        from asr_core.decoder import RnntGraphs

        cfg = self.config
        vocab, hidden, layers = cfg.vocab_size, cfg.decoder_hidden_size, cfg.num_decoder_layers
        if self.decoder_path is not None and self.joiner_path is not None:
            return RnntGraphs(
                self.decoder_path,
                self.joiner_path,
                vocab_size=vocab,
                hidden_size=hidden,
                num_layers=layers,
                threads=threads,
            )
        assert self.rnnt_graphs_built is not None, "a bundle without graph files has them built"
        decoder, joiner = self.rnnt_graphs_built
        return RnntGraphs(
            decoder, joiner, vocab_size=vocab, hidden_size=hidden, num_layers=layers, threads=threads
        )


# --------------------------------------------------------------------------------------------------
# Config


class JsonReader:
    """Typed access to one JSON object; every complaint names the file and the key path."""

    def __init__(self, path: Path, obj: Mapping[str, Any], prefix: str = "") -> None:
        self.path, self.obj, self.prefix = path, obj, prefix

    def fail(self, key: str, what: str) -> BundleError:
        return BundleError(f"{self.path}: {self.prefix}{key}: {what}")

    def has(self, key: str) -> bool:
        return key in self.obj

    def sub(self, key: str) -> JsonReader:
        value = self.obj.get(key)
        if not isinstance(value, dict):
            raise self.fail(key, "missing or not an object")
        return JsonReader(self.path, value, f"{self.prefix}{key}.")

    def int_(self, key: str, default: int | None = None, minimum: int | None = 0) -> int:
        if key not in self.obj:
            if default is None:
                raise self.fail(key, "missing")
            return default
        value = self.obj[key]
        # JSON writers may emit 80.0 for an integral value; accept that, nothing fractional.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def float_(self, key: str, default: float) -> float:
        value = self.obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(key, f"expected a number, got {value!r}")
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        value = self.obj.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true/false, got {value!r}")
        return value

    def choice(self, key: str, default: str | None, allowed: Iterable[str | None]) -> str | None:
        value = self.obj.get(key, default)
        allowed = tuple(allowed)
        if value not in allowed:
            raise self.fail(key, f"unsupported value {value!r} (supported: {', '.join(map(repr, allowed))})")
        return value


@dataclass(frozen=True, slots=True)
class _RawConfig:
    """What the config file says, before tensor shapes fill in the rest."""

    model: dict[str, Any]
    encoder: dict[str, Any]


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: cannot read: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(obj, dict):
        raise BundleError(f"{path}: expected a JSON object at the top level")
    return obj


def _parse_config(path: Path, obj: Mapping[str, Any]) -> _RawConfig:
    r = JsonReader(path, obj)
    vocab_size = r.int_("vocab_size", minimum=2)
    blank = r.int_("blank_token_id")
    if blank >= vocab_size:
        raise r.fail("blank_token_id", f"{blank} is outside the vocabulary (vocab_size {vocab_size})")
    num_prompts = r.int_("num_prompts", minimum=1)
    default_prompt = r.int_("default_prompt_id")
    if default_prompt >= num_prompts:
        raise r.fail("default_prompt_id", f"{default_prompt} >= num_prompts {num_prompts}")
    prompts_raw = obj.get("prompt_dictionary", {})
    if not isinstance(prompts_raw, dict):
        raise r.fail("prompt_dictionary", "expected an object {locale: prompt id}")
    prompts: dict[str, int] = {}
    for locale, pid in prompts_raw.items():
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < num_prompts:
            raise r.fail(f"prompt_dictionary.{locale}", f"prompt id {pid!r} not in [0, {num_prompts})")
        prompts[str(locale)] = pid

    e = r.sub("encoder")
    hidden = e.int_("hidden_size", minimum=1)
    layers = e.int_("num_hidden_layers", minimum=1)
    heads = e.int_("num_attention_heads", minimum=1)
    if hidden % heads:
        raise e.fail("num_attention_heads", f"{heads} does not divide hidden_size {hidden}")
    factor = e.int_("subsampling_factor", minimum=2)
    if factor & (factor - 1):
        raise e.fail("subsampling_factor", f"unsupported value {factor} (a power of two is required)")
    left = e.int_("left_context_frames", minimum=1)
    lookaheads_raw = e.obj.get("supported_lookaheads", list(DEFAULT_SUPPORTED_LOOKAHEADS))
    if not isinstance(lookaheads_raw, list) or not lookaheads_raw:
        raise e.fail("supported_lookaheads", f"expected a non-empty list, got {lookaheads_raw!r}")
    lookaheads: list[int] = []
    for la in lookaheads_raw:
        if isinstance(la, bool) or not isinstance(la, int) or not 0 <= la < left:
            raise e.fail("supported_lookaheads", f"unsupported lookahead {la!r} (0 <= r < {left})")
        lookaheads.append(la)
    default_la = e.int_("default_lookahead", default=3 if 3 in lookaheads else lookaheads[0])
    if default_la not in lookaheads:
        raise e.fail("default_lookahead", f"{default_la} is not in supported_lookaheads {lookaheads}")
    scale_input = e.bool_("scale_input", False)

    f = r.sub("features")
    sr = f.int_("sampling_rate", minimum=1)
    if sr != 16000:
        raise f.fail("sampling_rate", f"unsupported value {sr} (the model takes 16000 Hz)")
    n_fft = f.int_("n_fft", minimum=2)
    hop = f.int_("hop_length", minimum=1)
    win = f.int_("win_length", minimum=1)
    if win > n_fft:
        raise f.fail("win_length", f"{win} exceeds n_fft {n_fft}")
    features = FeatureConfig(
        sampling_rate=sr,
        n_fft=n_fft,
        hop_length=hop,
        win_length=win,
        n_mels=f.int_("n_mels", minimum=1),
        preemphasis=f.float_("preemphasis", 0.97),
        log_zero_guard=f.float_("log_zero_guard", 2.0**-24),
        mel_norm=str(f.choice("mel_norm", "slaney", ("slaney",))),
        mel_scale=str(f.choice("mel_scale", "slaney", ("slaney",))),
        fmin=f.float_("fmin", 0.0),
        fmax=f.float_("fmax", sr / 2),
    )
    if features.log_zero_guard <= 0:
        raise f.fail("log_zero_guard", f"must be > 0, got {features.log_zero_guard}")
    if not 0 <= features.fmin < features.fmax <= sr / 2:
        raise f.fail("fmax", f"need 0 <= fmin < fmax <= {sr / 2}, got {features.fmin}, {features.fmax}")
    frame_ms = e.float_("frame_ms", factor * hop * 1000 / sr)
    if abs(frame_ms - factor * hop * 1000 / sr) > 1e-6:
        raise e.fail("frame_ms", f"{frame_ms} disagrees with subsampling_factor * hop_length / sampling_rate")

    chunk_map: dict[int, int] = {}
    raw_map = obj.get("chunk_ms_to_lookahead", {})
    if not isinstance(raw_map, dict):
        raise r.fail("chunk_ms_to_lookahead", "expected an object {chunk_ms: lookahead}")
    for ms, la in raw_map.items():
        try:
            ms_i = int(ms)
        except ValueError:
            raise r.fail("chunk_ms_to_lookahead", f"key {ms!r} is not an integer") from None
        if isinstance(la, bool) or not isinstance(la, int) or not 0 <= la < left:
            raise r.fail(f"chunk_ms_to_lookahead.{ms}", f"unsupported lookahead {la!r}")
        chunk_map[ms_i] = la
    exported = obj.get("exported_chunk_ms", [])
    if not isinstance(exported, list) or not all(isinstance(x, int) for x in exported):
        raise r.fail("exported_chunk_ms", f"expected a list of integers, got {exported!r}")
    cache_shapes_raw = obj.get("cache_shapes", {})
    if not isinstance(cache_shapes_raw, dict):
        raise r.fail("cache_shapes", "expected an object {name: shape}")
    cache_shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in cache_shapes_raw.items():
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise r.fail(f"cache_shapes.{name}", f"expected a list of sizes, got {shape!r}")
        cache_shapes[name] = tuple(shape)

    optional: dict[str, int] = {}
    for key in (
        "intermediate_size",
        "conv_kernel_size",
        "subsampling_conv_channels",
        "prompt_intermediate_size",
    ):
        if e.has(key):
            optional[key] = e.int_(key, minimum=1)
    model = dict(
        vocab_size=vocab_size,
        blank_token_id=blank,
        pad_token_id=r.int_("pad_token_id", default=0),
        decoder_hidden_size=r.int_("decoder_hidden_size", minimum=1),
        num_decoder_layers=r.int_("num_decoder_layers", minimum=1),
        max_symbols_per_step=r.int_("max_symbols_per_step", minimum=1),
        num_prompts=num_prompts,
        default_prompt_id=default_prompt,
        prompt_dictionary=MappingProxyType(prompts),
        features=features,
        chunk_ms_to_lookahead=MappingProxyType(chunk_map),
        exported_chunk_ms=tuple(exported),
        cache_shapes=MappingProxyType(cache_shapes),
    )
    encoder = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        subsampling_factor=factor,
        left_context_frames=left,
        supported_lookaheads=tuple(lookaheads),
        default_lookahead=default_la,
        scale_input=scale_input,
        frame_ms=frame_ms,
        n_mels=features.n_mels,
        num_prompts=num_prompts,
        output_size=model["decoder_hidden_size"],
        **optional,
    )
    return _RawConfig(model=model, encoder=encoder)


# --------------------------------------------------------------------------------------------------
# Tensor names and shapes

# NeMo <-> HF renames (model_spec.md §2.3, from transformers' convert_nemotron3_5_asr_to_hf.py): where
# each NeMo fragment sits in a name ("^" start, "$" end, "" anywhere), NeMo text, HF text. The MLX
# layouts use NeMo's module names (mlx-audio keeps them so checkpoint keys map directly).
_NEMO_HF: tuple[tuple[str, str, str], ...] = (
    ("^", "prompt_kernel.0.", "prompt_projector.linear_1."),
    ("^", "prompt_kernel.2.", "prompt_projector.linear_2."),
    ("^", "encoder.pre_encode.conv.0.", "encoder.subsampling.conv_in."),
    ("^", "encoder.pre_encode.conv.2.", "encoder.subsampling.layers.0.depthwise_conv."),
    ("^", "encoder.pre_encode.conv.3.", "encoder.subsampling.layers.0.pointwise_conv."),
    ("^", "encoder.pre_encode.conv.5.", "encoder.subsampling.layers.1.depthwise_conv."),
    ("^", "encoder.pre_encode.conv.6.", "encoder.subsampling.layers.1.pointwise_conv."),
    ("^", "encoder.pre_encode.out.", "encoder.subsampling.linear."),
    ("", ".conv.batch_norm.", ".conv.norm."),
    ("", ".self_attn.linear_q.", ".self_attn.q_proj."),
    ("", ".self_attn.linear_k.", ".self_attn.k_proj."),
    ("", ".self_attn.linear_v.", ".self_attn.v_proj."),
    ("", ".self_attn.linear_out.", ".self_attn.o_proj."),
    ("", ".self_attn.linear_pos.", ".self_attn.relative_k_proj."),
    ("$", ".self_attn.pos_bias_u", ".self_attn.bias_u"),
    ("$", ".self_attn.pos_bias_v", ".self_attn.bias_v"),
    ("^", "joint.enc.", "encoder_projector."),
    ("^", "decoder.prediction.embed.", "decoder.embedding."),
    ("^", "decoder.prediction.dec_rnn.lstm.", "decoder.lstm."),
    ("^", "joint.pred.", "decoder.decoder_projector."),
    ("^", "joint.joint_net.2.", "joint.head."),
)


def _renames(to_hf: bool) -> tuple[tuple[re.Pattern[str], str], ...]:
    def pattern(anchor: str, text: str) -> re.Pattern[str]:
        body = re.escape(text)
        return re.compile("^" + body if anchor == "^" else body + "$" if anchor == "$" else body)

    return tuple(
        (pattern(anchor, nemo if to_hf else hf), hf if to_hf else nemo) for anchor, nemo, hf in _NEMO_HF
    )


_NEMO_TO_HF = _renames(to_hf=True)
_HF_TO_NEMO = _renames(to_hf=False)
_NEMO_DROPPED = re.compile(r"^preprocessor\.featurizer\.")


def nemo_to_hf_name(name: str) -> str:
    for pattern, repl in _NEMO_TO_HF:
        name = pattern.sub(repl, name)
    return name


def hf_to_nemo_name(name: str) -> str:
    for pattern, repl in _HF_TO_NEMO:
        name = pattern.sub(repl, name)
    return name


# Per-layer tensors: suffix -> kind. Kinds decide the shape check and the layout conversion.
_LAYER_TENSORS: dict[str, str] = {
    "norm_feed_forward1.weight": "norm",
    "norm_feed_forward1.bias": "norm",
    "feed_forward1.linear1.weight": "ff_in",
    "feed_forward1.linear2.weight": "ff_out",
    "norm_self_att.weight": "norm",
    "norm_self_att.bias": "norm",
    "self_attn.q_proj.weight": "square",
    "self_attn.k_proj.weight": "square",
    "self_attn.v_proj.weight": "square",
    "self_attn.o_proj.weight": "square",
    "self_attn.relative_k_proj.weight": "square",
    "self_attn.bias_u": "head_bias",
    "self_attn.bias_v": "head_bias",
    "norm_conv.weight": "norm",
    "norm_conv.bias": "norm",
    "conv.pointwise_conv1.weight": "pw1",
    "conv.depthwise_conv.weight": "dw1d",
    "conv.norm.weight": "norm",
    "conv.norm.bias": "norm",
    "conv.pointwise_conv2.weight": "pw2",
    "norm_feed_forward2.weight": "norm",
    "norm_feed_forward2.bias": "norm",
    "feed_forward2.linear1.weight": "ff_in",
    "feed_forward2.linear2.weight": "ff_out",
    "norm_out.weight": "norm",
    "norm_out.bias": "norm",
}


def encoder_tensor_kinds(num_layers: int, n_stages: int = 3) -> dict[str, str]:
    """Every tensor encoder.safetensors must hold (HF names) -> its kind."""
    kinds = {
        "encoder.subsampling.conv_in.weight": "conv_in",
        "encoder.subsampling.conv_in.bias": "sub_bias",
    }
    for i in range(n_stages - 1):
        p = f"encoder.subsampling.layers.{i}."
        kinds |= {
            p + "depthwise_conv.weight": "sub_dw",
            p + "depthwise_conv.bias": "sub_bias",
            p + "pointwise_conv.weight": "sub_pw",
            p + "pointwise_conv.bias": "sub_bias",
        }
    kinds |= {"encoder.subsampling.linear.weight": "sub_linear", "encoder.subsampling.linear.bias": "hidden"}
    for n in range(num_layers):
        kinds |= {f"encoder.layers.{n}.{suffix}": kind for suffix, kind in _LAYER_TENSORS.items()}
    kinds |= {
        "prompt_projector.linear_1.weight": "prompt1",
        "prompt_projector.linear_1.bias": "prompt_hidden",
        "prompt_projector.linear_2.weight": "prompt2",
        "prompt_projector.linear_2.bias": "hidden",
        "encoder_projector.weight": "proj",
        "encoder_projector.bias": "proj_bias",
    }
    return kinds


def expected_shape(kind: str, enc: EncoderConfig) -> tuple[int, ...]:
    D, H, C = enc.hidden_size, enc.num_attention_heads, enc.subsampling_conv_channels
    k = enc.subsampling_conv_kernel_size
    f_out = enc.subsampling_freqs()[-1]
    return {
        "conv_in": (C, 1, k, k),
        "sub_bias": (C,),
        "sub_dw": (C, 1, k, k),
        "sub_pw": (C, C, 1, 1),
        "sub_linear": (D, C * f_out),
        "hidden": (D,),
        "norm": (D,),
        "ff_in": (enc.intermediate_size, D),
        "ff_out": (D, enc.intermediate_size),
        "square": (D, D),
        "head_bias": (H, D // H),
        "pw1": (2 * D, D, 1),
        "dw1d": (D, 1, enc.conv_kernel_size),
        "pw2": (D, D, 1),
        "prompt1": (enc.prompt_intermediate_size, D + enc.num_prompts),
        "prompt_hidden": (enc.prompt_intermediate_size,),
        "prompt2": (D, enc.prompt_intermediate_size),
        "proj": (enc.output_size, D),
        "proj_bias": (enc.output_size,),
    }[kind]


LINEAR_KINDS = frozenset({"ff_in", "ff_out", "square", "sub_linear", "prompt1", "prompt2", "proj"})


def to_mlx_layout(kind: str, w: np.ndarray) -> np.ndarray:
    """PyTorch layout -> the MLX layout of the module docstring (numpy, any dtype incl. bf16 bits)."""
    if kind in LINEAR_KINDS:
        return np.ascontiguousarray(w.T)
    if kind in ("conv_in", "sub_dw", "sub_pw"):
        return np.ascontiguousarray(w.transpose(0, 2, 3, 1))
    if kind in ("pw1", "pw2"):
        return np.ascontiguousarray(w[:, :, 0].T)
    if kind == "dw1d":
        return np.ascontiguousarray(w[:, 0, :].T)
    return np.ascontiguousarray(w)


def to_pytorch_layout(kind: str, w: np.ndarray) -> np.ndarray:
    """The inverse of `to_mlx_layout` (for writers)."""
    if kind in LINEAR_KINDS:
        return np.ascontiguousarray(w.T)
    if kind in ("conv_in", "sub_dw", "sub_pw"):
        return np.ascontiguousarray(w.transpose(0, 3, 1, 2))
    if kind in ("pw1", "pw2"):
        return np.ascontiguousarray(w.T[:, :, None])
    if kind == "dw1d":
        return np.ascontiguousarray(w.T[:, None, :])
    return np.ascontiguousarray(w)


def derive_encoder_config(
    raw: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], path: Path | str = ENCODER_FILE
) -> EncoderConfig:
    """Fill the sizes the config omits from tensor shapes; a disagreement names the tensor."""

    def shape(name: str) -> tuple[int, ...]:
        return shapes[name]

    def size_from(key: str, name: str, dim: int) -> int:
        got = shape(name)[dim] if len(shape(name)) > dim else -1
        if key in raw and raw[key] != got:
            raise BundleError(
                f"{path}: tensor {name}: shape {shape(name)} disagrees with config {key}={raw[key]}"
            )
        return got

    values = dict(raw)
    values["intermediate_size"] = size_from(
        "intermediate_size", "encoder.layers.0.feed_forward1.linear1.weight", 0
    )
    values["conv_kernel_size"] = size_from(
        "conv_kernel_size", "encoder.layers.0.conv.depthwise_conv.weight", 2
    )
    values["subsampling_conv_channels"] = size_from(
        "subsampling_conv_channels", "encoder.subsampling.conv_in.weight", 0
    )
    values["prompt_intermediate_size"] = size_from(
        "prompt_intermediate_size", "prompt_projector.linear_1.weight", 0
    )
    conv_in = shape("encoder.subsampling.conv_in.weight")
    if len(conv_in) != 4 or conv_in[2:] != (SUBSAMPLING_KERNEL, SUBSAMPLING_KERNEL):
        raise BundleError(
            f"{path}: tensor encoder.subsampling.conv_in.weight: shape {conv_in}: "
            f"only {SUBSAMPLING_KERNEL}x{SUBSAMPLING_KERNEL} subsampling kernels are supported"
        )
    if values["conv_kernel_size"] < 1:
        raise BundleError(f"{path}: tensor encoder.layers.0.conv.depthwise_conv.weight: bad shape")
    return EncoderConfig(**values)


def check_encoder_shapes(
    shapes: Mapping[str, tuple[int, ...]], enc: EncoderConfig, path: Path | str = ENCODER_FILE
) -> None:
    kinds = encoder_tensor_kinds(enc.num_hidden_layers, enc.n_subsampling_stages)
    for name, kind in kinds.items():
        want = expected_shape(kind, enc)
        if tuple(shapes[name]) != want:
            raise BundleError(f"{path}: tensor {name}: expected shape {want}, got {tuple(shapes[name])}")


def check_encoder_names(names: Iterable[str], enc_num_layers: int, n_stages: int, path: Path | str) -> None:
    want = encoder_tensor_kinds(enc_num_layers, n_stages)
    have = set(names)
    missing = [n for n in want if n not in have]
    extra = sorted(have - set(want))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise BundleError(f"{path}: missing tensor {', '.join(missing[:3])}{more}")
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise BundleError(f"{path}: unexpected tensor {', '.join(extra[:3])}{more}")


def convert_encoder_weights(
    arrays: Mapping[str, np.ndarray], enc: EncoderConfig, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """In-memory path (tools, benchmarks): HF-named PyTorch-layout float arrays -> MLX layouts.

    Checks names and shapes exactly like the file loader does.
    """
    check_encoder_names(arrays, enc.num_hidden_layers, enc.n_subsampling_stages, "<arrays>")
    check_encoder_shapes({k: tuple(v.shape) for k, v in arrays.items()}, enc, "<arrays>")
    kinds = encoder_tensor_kinds(enc.num_hidden_layers, enc.n_subsampling_stages)
    out: dict[str, mx.array] = {}
    for name, kind in kinds.items():
        w = mx.array(to_mlx_layout(kind, np.asarray(arrays[name], dtype=np.float32))).astype(dtype)
        mx.eval(w)
        out[name] = w
    return out


# --------------------------------------------------------------------------------------------------
# safetensors (parsed here so every defect gets a precise one-line message; the format is a u64
# little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data)

_ST_DTYPES: dict[str, tuple[str, int]] = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}
_ST_PACKED = ("U32", "<u4", 4)  # quantized codes (MLX layouts only)


@dataclass(frozen=True, slots=True)
class StEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_safetensors_header(path: Path, packed: bool = False) -> dict[str, StEntry]:
    """Every tensor's entry, checked against the file; `packed` also accepts U32 (quantized codes)."""
    dtypes = dict(_ST_DTYPES)
    if packed:
        dtypes[_ST_PACKED[0]] = _ST_PACKED[1:]
    allowed = ", ".join(dtypes)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise BundleError(f"{path}: truncated: {size} bytes, no safetensors header")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > 100_000_000:
                raise BundleError(
                    f"{path}: truncated or not safetensors: header of {n} bytes in a {size}-byte file"
                )
            header_bytes = fh.read(n)
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BundleError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise BundleError(f"{path}: corrupt safetensors header (not an object)")
    data_start = 8 + n
    entries: dict[str, StEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
            raise BundleError(f"{path}: tensor {name}: corrupt header entry")
        dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
        if dtype not in dtypes:
            raise BundleError(f"{path}: tensor {name}: unsupported dtype {dtype} ({allowed} expected)")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BundleError(f"{path}: tensor {name}: corrupt shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise BundleError(f"{path}: tensor {name}: corrupt data_offsets {offsets!r}")
        begin, end = offsets
        nbytes = math.prod(shape) * dtypes[dtype][1]
        if end - begin != nbytes or begin < 0:
            raise BundleError(f"{path}: tensor {name}: data_offsets {offsets} do not hold {shape} {dtype}")
        if data_start + end > size:
            raise BundleError(
                f"{path}: truncated: tensor {name} ends at byte {data_start + end} but the file has {size}"
            )
        entries[name] = StEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    return entries


def read_tensor(path: Path, e: StEntry) -> tuple[np.ndarray, bool]:
    """The tensor's raw values (bf16 as uint16 bits) and whether they are bf16."""
    np_dtype = _ST_PACKED[1] if e.dtype == _ST_PACKED[0] else _ST_DTYPES[e.dtype][0]
    if math.prod(e.shape) == 0:
        return np.zeros(e.shape, np_dtype), e.dtype == "BF16"
    data = np.memmap(path, dtype=np_dtype, mode="r", offset=e.begin, shape=e.shape)
    return data, e.dtype == "BF16"


# --------------------------------------------------------------------------------------------------
# Other files


def load_mel_filters(path: Path, n_mels: int, n_bins: int) -> tuple[np.ndarray, bool]:
    """(n_mels, n_bins) float32 filterbank and whether the file stored it transposed."""
    want = n_mels * n_bins * 4
    try:
        size = path.stat().st_size
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e}") from None
    if size != want:
        raise BundleError(f"{path}: {size} bytes, expected {want} ({n_mels} x {n_bins} float32)")
    raw = np.fromfile(path, dtype="<f4").astype(np.float32)
    if not np.all(np.isfinite(raw)) or np.any(raw < 0):
        raise BundleError(f"{path}: not a mel filterbank (negative or non-finite weights)")
    as_stored = raw.reshape(n_mels, n_bins)
    transposed = raw.reshape(n_bins, n_mels).T
    if _is_filterbank(as_stored):
        return np.ascontiguousarray(as_stored), False
    if _is_filterbank(transposed):
        return np.ascontiguousarray(transposed), True
    raise BundleError(f"{path}: not a mel filterbank ({n_mels} x {n_bins}) in either orientation")


def _is_filterbank(m: np.ndarray) -> bool:
    """Each filter is one contiguous bump, and the bumps' peaks move up in frequency."""
    if np.any(m.max(axis=1) <= 0):
        return False
    for row in m:
        nz = np.flatnonzero(row)
        if nz[-1] - nz[0] + 1 != nz.size:
            return False
    peaks = m.argmax(axis=1)
    return bool(np.all(np.diff(peaks) >= 0))


def load_pieces(path: Path, vocab_size: int) -> tuple[str, ...]:
    """tokens.txt as `id<TAB>piece` (CDG export) or `piece id` (sherpa-onnx) lines -> pieces by id."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: cannot read: {e}") from None
    by_id: dict[int, str] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        head, tab, rest = line.partition("\t")
        if tab and head.strip().lstrip("-").isdigit():
            token_id, piece = int(head), rest
        else:
            piece, space, tail = line.rpartition(" ")
            if not space or not tail.lstrip("-").isdigit():
                raise BundleError(f"{path}: line {lineno}: expected 'id<TAB>piece' or 'piece id'")
            token_id = int(tail)
        if not 0 <= token_id < vocab_size:
            raise BundleError(f"{path}: line {lineno}: token id {token_id} outside [0, {vocab_size})")
        if token_id in by_id:
            raise BundleError(f"{path}: line {lineno}: token id {token_id} appears twice")
        by_id[token_id] = piece
    if len(by_id) != vocab_size:
        missing = next(i for i in range(vocab_size) if i not in by_id)
        raise BundleError(f"{path}: {len(by_id)} pieces for vocab_size {vocab_size} (id {missing} missing)")
    return tuple(by_id[i] for i in range(vocab_size))


# ONNX I/O (docs/architecture.md): name -> (elem type, rank, {dim index: expected size}).
_ONNX_FLOAT, _ONNX_INT64 = 1, 7
_ONNX_TYPE_NAMES = {_ONNX_FLOAT: "float32", _ONNX_INT64: "int64"}


def _onnx_contract(cfg: Mapping[str, Any], enc_out: int) -> dict[str, tuple[dict, dict]]:
    L, H, V = cfg["num_decoder_layers"], cfg["decoder_hidden_size"], cfg["vocab_size"]
    return {
        DECODER_FILE: (
            {
                "token": (_ONNX_INT64, 2, {1: 1}),
                "h_in": (_ONNX_FLOAT, 3, {0: L, 2: H}),
                "c_in": (_ONNX_FLOAT, 3, {0: L, 2: H}),
            },
            {
                "decoder_out": (_ONNX_FLOAT, 2, {1: enc_out}),
                "h_out": (_ONNX_FLOAT, 3, {0: L, 2: H}),
                "c_out": (_ONNX_FLOAT, 3, {0: L, 2: H}),
            },
        ),
        JOINER_FILE: (
            {
                "encoder_frame": (_ONNX_FLOAT, 2, {1: enc_out}),
                "decoder_out": (_ONNX_FLOAT, 2, {1: enc_out}),
            },
            {"logits": (_ONNX_FLOAT, 2, {1: V})},
        ),
    }


def check_onnx_io(path: Path, inputs: Mapping[str, tuple], outputs: Mapping[str, tuple]) -> None:
    import onnx  # lazy: only the loader needs it

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError/ValueError/OSError variants for bad files
        raise BundleError(f"{path}: not a readable ONNX model ({type(e).__name__})") from None
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    got_in = {v.name: v for v in graph.input if v.name not in initializers}
    got_out = {v.name: v for v in graph.output}
    for side, want, got in (("input", inputs, got_in), ("output", outputs, got_out)):
        if set(want) != set(got):
            raise BundleError(f"{path}: graph {side}s are {sorted(got)}, expected {sorted(want)}")
        for name, (elem, rank, dims) in want.items():
            t = got[name].type.tensor_type
            if t.elem_type != elem:
                raise BundleError(
                    f"{path}: {side} {name}: element type {t.elem_type}, expected {_ONNX_TYPE_NAMES[elem]}"
                )
            shape = t.shape.dim if t.HasField("shape") else None
            if shape is None or len(shape) != rank:
                raise BundleError(
                    f"{path}: {side} {name}: rank {len(shape) if shape else '?'}, expected {rank}"
                )
            for axis, size in dims.items():
                d = shape[axis]
                if d.HasField("dim_value") and d.dim_value != size:
                    raise BundleError(f"{path}: {side} {name}: dim {axis} is {d.dim_value}, expected {size}")


# --------------------------------------------------------------------------------------------------
# The loader


def on_gpu() -> bool:
    return bool(mx.default_device() == mx.gpu)


def load_bundle(dir: str | Path, precision: str = "f32") -> Bundle:
    """Check every file of the bundle in `dir`, then build the `Bundle` (weights in `precision`).

    `dir` holds any of LAYOUTS: the five-file ONNX bundle (when it has nemotron_onnx_config.json or
    encoder.safetensors), else an MLX layout recognised by its config.json (asr_core.mlx_bundle).
    `precision` "auto": f32 on the CPU; on a GPU f16 for the ONNX bundle, an MLX layout's stored
    dtype (non-quantized parts stay as published)."""
    root = Path(dir)
    if precision != "auto" and precision not in PRECISIONS:
        raise BundleError(f"precision {precision!r}: expected auto or one of {', '.join(PRECISIONS)}")
    if not root.is_dir():
        raise BundleError(f"{root}: not a directory")
    if not (root / CONFIG_FILE).is_file() and not (root / ENCODER_FILE).is_file():
        from asr_core.mlx_bundle import load_mlx_bundle

        return load_mlx_bundle(root, precision)
    if precision == "auto":
        precision = "f16" if on_gpu() else "f32"
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise BundleError(f"{root / name}: missing file")

    # 1. Validate everything (nothing heavy is read yet).
    raw = _parse_config(root / CONFIG_FILE, read_json(root / CONFIG_FILE))
    enc_path = root / ENCODER_FILE
    entries = read_safetensors_header(enc_path)
    naming: Literal["hf", "nemo"] = "hf"
    if "encoder.pre_encode.conv.0.weight" in entries and "encoder.subsampling.conv_in.weight" not in entries:
        naming = "nemo"
        renamed: dict[str, StEntry] = {}
        for name, e in entries.items():
            if _NEMO_DROPPED.match(name):
                continue
            renamed[nemo_to_hf_name(name)] = e
        entries = renamed
    n_stages = int(math.log2(raw.encoder["subsampling_factor"]))
    check_encoder_names(entries, raw.encoder["num_hidden_layers"], n_stages, enc_path)
    shapes = {name: e.shape for name, e in entries.items()}
    enc_cfg = derive_encoder_config(raw.encoder, shapes, enc_path)
    check_encoder_shapes(shapes, enc_cfg, enc_path)
    _check_cache_shapes(root / CONFIG_FILE, raw.model["cache_shapes"], enc_cfg)
    config = ModelConfig(encoder=enc_cfg, **raw.model)

    mel_filters, mel_transposed = load_mel_filters(
        root / MELFILTERS_FILE, config.features.n_mels, config.features.n_bins
    )
    pieces = load_pieces(root / TOKENS_FILE, config.vocab_size)
    for fname, (ins, outs) in _onnx_contract(raw.model, enc_cfg.output_size).items():
        check_onnx_io(root / fname, ins, outs)
    sp_path = root / SENTENCEPIECE_FILE

    # 2. Build: one tensor at a time so peak memory stays near the final size.
    dtype = PRECISIONS[precision]
    kinds = encoder_tensor_kinds(enc_cfg.num_hidden_layers, enc_cfg.n_subsampling_stages)
    weights: dict[str, mx.array] = {}
    for name, kind in kinds.items():
        data, is_bf16 = read_tensor(enc_path, entries[name])
        host = to_mlx_layout(kind, data)
        w = mx.array(host).view(mx.bfloat16) if is_bf16 else mx.array(host)
        w = w.astype(dtype)
        mx.eval(w)
        if not bool(mx.all(mx.isfinite(w)).item()):
            raise BundleError(f"{enc_path}: tensor {name}: non-finite values (in {precision})")
        weights[name] = w
        del data, host

    return Bundle(
        dir=root,
        config=config,
        precision=precision,
        encoder_weights=MappingProxyType(weights),
        mel_filters=mel_filters,
        pieces=pieces,
        decoder_path=root / DECODER_FILE,
        joiner_path=root / JOINER_FILE,
        sentencepiece_path=sp_path if sp_path.is_file() else None,
        tensor_naming=naming,
        stored_precision=ST_PRECISIONS[Counter(e.dtype for e in entries.values()).most_common(1)[0][0]],
        mel_filters_transposed=mel_transposed,
    )


def _check_cache_shapes(path: Path, shapes: Mapping[str, tuple[int, ...]], enc: EncoderConfig) -> None:
    """The published config lists the streaming cache shapes; they must match this architecture."""
    D, H, Lc = enc.hidden_size, enc.num_attention_heads, enc.left_context_frames
    want: dict[str, tuple[int, ...]] = {}
    for i in range(enc.num_hidden_layers):
        want[f"k_cache_{i}"] = (1, H, Lc, D // H)
        want[f"v_cache_{i}"] = (1, H, Lc, D // H)
        want[f"conv1d_cache_{i}"] = (1, D, enc.conv_kernel_size - 1)
    freqs = enc.subsampling_freqs()
    for i in range(enc.n_subsampling_stages):
        channels = 1 if i == 0 else enc.subsampling_conv_channels
        want[f"conv2d_cache_{i}"] = (1, channels, 1, freqs[i])
    for name, shape in shapes.items():
        if name in want and tuple(shape) != want[name]:
            raise BundleError(
                f"{path}: cache_shapes.{name}: {list(shape)} disagrees with the weights ({list(want[name])})"
            )
