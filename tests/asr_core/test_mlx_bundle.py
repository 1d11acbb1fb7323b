"""The MLX-layout loader and `ttg export --quantize` on their own: which modules get packed and how,
what stays dense and why, that packed weights stay packed through the encoder, and the one-line
error for every way a bundle can be wrong (checked before any weight is read)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import asr_core.mlx_bundle as mlx_bundle_module
from asr_core.bundle import MLX_AUDIO_LAYOUT, ModelConfig, load_bundle
from asr_core.encoder import StreamingEncoder
from asr_core.encoder.layers import weight_nbytes
from asr_core.errors import BundleError
from asr_core.features import FeatureConfig
from asr_core.quant import QuantizedLinear
from tests.fixtures.mlx_audio import load_arrays
from tools.bundle.mlx_export import MlxExportError, export_mlx, mixed68_protected, plan, read_bitmap
from tools.bundle.spec import FULL


@pytest.fixture(scope="module")
def q8(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("tiny-q8")
    return out, export_mlx(tiny_bundle, out, "q8")


@pytest.fixture
def copy(q8: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    return Path(shutil.copytree(q8[0], tmp_path / "b"))


def _full_config() -> ModelConfig:
    s = FULL
    enc = s.encoder_config()
    return ModelConfig(
        vocab_size=s.vocab_size,
        blank_token_id=s.blank_id,
        pad_token_id=0,
        decoder_hidden_size=s.decoder_hidden,
        num_decoder_layers=s.decoder_layers,
        max_symbols_per_step=10,
        num_prompts=s.num_prompts,
        default_prompt_id=101,
        prompt_dictionary={"auto": 101},
        encoder=enc,
        features=FeatureConfig(),
    )


# -- what gets quantized -----------------------------------------------------------------------------


def test_at_full_size_every_linear_layer_is_quantized_and_mixed68_protects_13() -> None:
    cfg = _full_config()
    q8 = plan(cfg, "q8")
    assert len(q8) == 223 and all(c.bits == 8 and c.group_size == 64 for c in q8.values())
    mixed = plan(cfg, "mixed68")
    eight = {n for n, c in mixed.items() if c.bits == 8}
    assert eight == mixed68_protected(cfg) and len(eight) == 13  # the mixed 6/8 card: 13 at 8 bits
    assert sum(c.bits == 6 for c in mixed.values()) == 210
    assert (
        "encoder.layers.23.feed_forward1.linear1" in eight
        and "encoder.layers.19.feed_forward1.linear1" not in eight
    )


def test_group_sizes_that_fit_are_chosen_and_the_rest_stays_dense() -> None:
    """The demo model's widths: 176 fits no MLX group size, 352 only 32, 704 and 1088 64."""
    cfg = _full_config()
    demo = dataclasses.replace(
        cfg,
        encoder=dataclasses.replace(
            cfg.encoder,
            hidden_size=176,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=704,
            subsampling_conv_channels=64,
            prompt_intermediate_size=352,
            output_size=256,
        ),
        decoder_hidden_size=256,
        vocab_size=256,
        blank_token_id=255,
    )
    choices = plan(demo, "q8")
    assert choices["encoder.layers.0.feed_forward1.linear2"].group_size == 64
    assert choices["prompt_kernel.2"].group_size == 32
    assert choices["encoder.pre_encode.out"].group_size == 64  # 64 channels x 17 = 1088
    dense = {n for n, c in choices.items() if c.bits is None}
    assert (
        "encoder.layers.0.self_attn.linear_q" in dense and "joint.enc" in dense and "prompt_kernel.0" in dense
    )
    assert "multiple of any MLX group size" in choices["joint.enc"].reason
    assert len(choices) - len(dense) == 17 and len(dense) == 44
    # A larger requested group size falls back to the nearest that fits.
    assert plan(demo, "q8", group_size=128)["joint.joint_net.2"].group_size == 128
    assert plan(demo, "q8", group_size=128)["encoder.layers.0.feed_forward1.linear2"].group_size == 64


def test_the_exported_bundle_reports_its_choices(q8: tuple[Path, dict[str, Any]]) -> None:
    out, summary = q8
    # tiny: 16 channels x 17 = 272 fits no group size; the 96-wide prompt layer fits 32 only.
    assert summary["dense_modules"].keys() == {"encoder.pre_encode.out"}
    assert summary["by_group_size"] == {"32": 1, "64": 23} and summary["by_bits"] == {"8": 24}
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (8, 32)  # the smallest group size on top (mlx-audio's loader)
    assert q["encoder.layers.0.feed_forward1.linear1"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert "prompt_kernel.2" not in q  # its (8, 32) is the top level's
    assert sorted(summary["files"]) == ["config.json", "model.safetensors", "quant_bitmap.json"]


def test_a_bitmap_overrides_the_scheme_module_by_module(tiny_bundle: Path, tmp_path: Path) -> None:
    bitmap = tmp_path / "bitmap.json"
    bitmap.write_text(json.dumps({"joint.joint_net.2": 8, "prompt_kernel.0": {"bits": 6}, "joint.enc": None}))
    summary = export_mlx(tiny_bundle, tmp_path / "b", "q4", bitmap)
    bundle = load_bundle(tmp_path / "b")
    assert bundle.quantized["joint.joint_net.2"] == (8, 64) and bundle.quantized["prompt_kernel.0"] == (6, 64)
    assert (
        "joint.enc" not in bundle.quantized and summary["dense_modules"]["joint.enc"] == "dense by the bitmap"
    )
    assert bundle.quantized["encoder.layers.0.self_attn.linear_q"] == (4, 64)
    # The written allocation is itself a bitmap: the same bundle again.
    export_mlx(tiny_bundle, tmp_path / "again", "q8", tmp_path / "b" / "quant_bitmap.json")
    assert load_bundle(tmp_path / "again").quantized == bundle.quantized


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"encoder.layers.9.feed_forward1.linear1": 8}, "not a quantizable module"),
        ({"joint.enc": 7}, "bits 7"),
        ({"joint.enc": {"bits": 8, "group_size": 48}}, "group_size 48"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_a_bad_bitmap_is_refused(tiny_bundle: Path, tmp_path: Path, content: object, message: str) -> None:
    (tmp_path / "bitmap.json").write_text(json.dumps(content))
    with pytest.raises(MlxExportError, match=message):
        read_bitmap(tmp_path / "bitmap.json", {"joint.enc": 64})


# -- loading -----------------------------------------------------------------------------------------


def test_packed_weights_stay_packed_and_the_encoder_stays_close_to_the_source(
    q8: tuple[Path, dict[str, Any]], tiny_bundle: Path
) -> None:
    bundle, source = load_bundle(q8[0], "f32"), load_bundle(tiny_bundle, "f32")
    assert bundle.layout == MLX_AUDIO_LAYOUT and bundle.decoder_path is None
    w = bundle.encoder_weights["encoder.layers.0.feed_forward1.linear1.weight"]
    assert (
        isinstance(w, QuantizedLinear) and w.weight.dtype == mx.uint32 and (w.bits, w.group_size) == (8, 64)
    )
    assert not isinstance(bundle.encoder_weights["encoder.subsampling.linear.weight"], QuantizedLinear)
    assert bundle.config.encoder == source.config.encoder and bundle.pieces[:-1] == source.pieces[:-1]
    assert dict(bundle.config.prompt_dictionary) == dict(source.config.prompt_dictionary)
    mel = np.random.default_rng(3).standard_normal((300, 128), dtype=np.float32)
    ours = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=False, unpack=False)
    assert isinstance(ours.params.layers[0].ff1_w1, QuantizedLinear)  # what the encoder multiplies with
    assert len(ours.params.layers[0].w_qkv) == 1  # q, k and v packed alike: one product
    ref = StreamingEncoder(source.encoder_weights, source.config.encoder, "f32", compile=False)
    a, b = ours.forward_offline(mel, 3, 19), ref.forward_offline(mel, 3, 19)
    # bf16 storage alone costs ~1.7e-2 rel-L2 (docs/parity.md); 8-bit codes add to it
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-2
    # The decoder graphs built from the weights: the source's decoder on the same frames.
    g, g0 = bundle.rnnt_graphs(), source.rnnt_graphs()
    h, c = g.zero_state(2)
    got, want = g.decoder_step(np.array([0, 5]), h, c)[0], g0.decoder_step(np.array([0, 5]), h, c)[0]
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()


def test_on_the_cpu_packed_codes_are_dequantized_once_with_the_same_frames(
    q8: tuple[Path, dict[str, Any]],
) -> None:
    bundle = load_bundle(q8[0], "f32")
    default = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=False)
    packed = StreamingEncoder(
        bundle.encoder_weights, bundle.config.encoder, "f32", compile=False, unpack=False
    )
    assert default.unpacked and not isinstance(default.params.layers[0].ff1_w1, QuantizedLinear)
    mel = np.random.default_rng(4).standard_normal((200, 128), dtype=np.float32)
    np.testing.assert_allclose(
        default.forward_offline(mel, 13, 0), packed.forward_offline(mel, 13, 0), atol=1e-5, rtol=0
    )
    assert weight_nbytes(packed.params) < 0.6 * weight_nbytes(default.params)


def test_everything_is_checked_before_any_weight_is_read(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_tensor(*_: object) -> None:
        raise AssertionError("a weight was read before the bundle was validated")

    monkeypatch.setattr(mlx_bundle_module, "read_tensor", read_tensor)
    _edit_config(copy, lambda c: c["quantization"].update(bits=4))
    with pytest.raises(BundleError, match="4-bit codes"):
        load_bundle(copy)


def _edit_config(d: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))


def _edit_tensors(d: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    arrays = load_arrays(d / "model.safetensors")
    edit(arrays)
    mx.save_safetensors(str(d / "model.safetensors"), arrays)


L0 = "encoder.layers.0."


def _bad_scale(a: dict[str, Any]) -> None:
    s = a[L0 + "feed_forward1.linear1.scales"]
    a[L0 + "feed_forward1.linear1.scales"] = mx.where(mx.arange(s.shape[1]) == 0, mx.array(float("nan")), s)


CASES: list[
    tuple[str, Callable[[dict[str, Any]], object] | None, Callable[[dict[str, Any]], object] | None, str]
] = [
    (
        "missing",
        None,
        lambda a: a.pop(L0 + "norm_out.weight"),
        r"missing tensor encoder\.layers\.0\.norm_out\.weight",
    ),
    ("extra", None, lambda a: a.update(extra=mx.zeros(3)), "unexpected tensor extra"),
    (
        "shape",
        None,
        lambda a: a.update({L0 + "norm_out.weight": mx.zeros(7)}),
        r"tensor encoder\.layers\.0\.norm_out\.weight: expected shape \(64,\), got \(7,\)",
    ),
    ("bits", lambda c: c["quantization"].update(bits=4), None, "4-bit codes"),
    (
        "group",
        lambda c: c["quantization"][L0 + "feed_forward1.linear1"].update(group_size=32),
        None,
        "group size in config.json does not match",
    ),
    (
        "group-too-large",
        lambda c: c["quantization"][L0 + "feed_forward1.linear1"].update(group_size=128),
        None,
        "input width 64 is not a multiple of its group size 128",
    ),
    ("mode", lambda c: c["quantization"].update(mode="mxfp4"), None, "unsupported quantization mode 'mxfp4'"),
    (
        "bits-value",
        lambda c: c["quantization"].update(bits=7),
        None,
        "quantization.bits: unsupported value 7",
    ),
    (
        "entry-for-dense",
        lambda c: c["quantization"].update({"encoder.pre_encode.out": {"bits": 8, "group_size": 64}}),
        None,
        r"quantization\.encoder\.pre_encode\.out: no such packed module",
    ),
    (
        "scales-on-a-conv",
        None,
        lambda a: a.update(
            {L0 + "conv.pointwise_conv1.scales": mx.zeros(1), L0 + "conv.pointwise_conv1.biases": mx.zeros(1)}
        ),
        "conv.pointwise_conv1 is not a linear layer or embedding",
    ),
    (
        "no-quantization",
        lambda c: (c.pop("quantization"), c.pop("quantization_config")),
        None,
        "has no quantization",
    ),
    ("model-type", lambda c: c.update(model_type="whisper"), None, "model_type 'whisper' is not a layout"),
    (
        "hf-checkpoint",
        lambda c: c.update(model_type="nemotron_asr_streaming"),
        None,
        "a transformers checkpoint: `ttg export` converts it",
    ),
    (
        "normalize",
        lambda c: c["preprocessor"].update(normalize="per_feature"),
        None,
        "unsupported value 'per_feature'",
    ),
    (
        "lefts",
        lambda c: c["encoder"].update(att_context_size=[[56, 3], [70, 13]]),
        None,
        "left contexts differ",
    ),
    (
        "vocabulary",
        lambda c: c.update(vocabulary=["a"]),
        None,
        "1 pieces, but the decoder has vocab_size 256",
    ),
    ("no-prompt", lambda c: c["prompt"].update(num_prompts=0), None, "without a language prompt"),
    (
        "xscaling-type",
        lambda c: c["encoder"].update(xscaling="yes"),
        None,
        "encoder.xscaling: expected true/false",
    ),
    ("non-finite", None, _bad_scale, r"feed_forward1\.linear1\.scales: non-finite"),
    (
        "codes-not-u32",
        None,
        lambda a: a.update(
            {L0 + "feed_forward1.linear1.weight": a[L0 + "feed_forward1.linear1.weight"].astype(mx.float32)}
        ),
        "packed codes must be U32",
    ),
]


@pytest.mark.parametrize(
    ("config_edit", "tensor_edit", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_broken_bundle_is_a_one_line_error(
    copy: Path,
    config_edit: Callable[[dict[str, Any]], object] | None,
    tensor_edit: Callable[[dict[str, Any]], object] | None,
    message: str,
) -> None:
    if config_edit is not None:
        _edit_config(copy, config_edit)
    if tensor_edit is not None:
        _edit_tensors(copy, tensor_edit)
    with pytest.raises(BundleError, match=message) as err:
        load_bundle(copy)
    assert "\n" not in str(err.value) and str(copy) in str(err.value)


def test_a_folder_of_neither_layout_says_what_it_looked_for(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"not a model bundle: no nemotron_onnx_config\.json"):
        load_bundle(tmp_path)


def test_auto_precision_on_the_cpu_is_float32(q8: tuple[Path, dict[str, Any]]) -> None:
    bundle = load_bundle(q8[0], "auto")
    assert bundle.precision == "f32"
    w = bundle.encoder_weights["encoder.layers.0.self_attn.q_proj.weight"]
    assert isinstance(w, QuantizedLinear) and w.scales.dtype == mx.float32
