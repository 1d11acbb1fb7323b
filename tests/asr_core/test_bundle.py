"""The bundle loader takes the published file set as is and refuses every defect with one clear line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file, save_file

import asr_core.bundle as bundle_module
from asr_core.bundle import REQUIRED_FILES, BundleError, load_bundle, nemo_to_hf_name


@pytest.fixture
def bundle_copy(tiny_bundle: Path, tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, out)
    return out


def rewrite_tensors(d: Path, edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
    path = d / "encoder.safetensors"
    save_file(edit(load_file(str(path))), str(path))


def rewrite_config(d: Path, edit: Callable[[dict], None]) -> None:
    path = d / "nemotron_onnx_config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def load_error(d: Path) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(d)
    message = str(info.value)
    assert "\n" not in message, "a bundle error is one line"
    return message


# --------------------------------------------------------------------------------------------------
# what a good bundle gives


def test_tiny_bundle_loads_with_typed_config_and_mlx_layouts(tiny_bundle: Path) -> None:
    b = load_bundle(tiny_bundle, "f32")
    enc = b.config.encoder
    raw = load_file(str(tiny_bundle / "encoder.safetensors"))
    assert b.tensor_naming == "hf"
    assert len(b.encoder_weights) == len(raw)
    assert (enc.hidden_size, enc.num_hidden_layers, enc.left_context_frames) == (64, 2, 56)
    # Sizes the published config omits are read off the tensors.
    assert enc.intermediate_size == raw["encoder.layers.0.feed_forward1.linear1.weight"].shape[0]
    assert enc.prompt_intermediate_size == raw["prompt_projector.linear_1.weight"].shape[0]
    assert enc.output_size == b.config.decoder_hidden_size
    assert b.config.prompt_id("uk-UA") == 19 and b.config.prompt_id("auto") == 101
    # Layouts: linear (in, out), depthwise (K, C), pointwise conv1d as linear, conv2d OHWI.
    w = b.encoder_weights
    ff = "encoder.layers.1.feed_forward1.linear1.weight"
    np.testing.assert_array_equal(np.array(w[ff]), raw[ff].T)
    dw = "encoder.layers.0.conv.depthwise_conv.weight"
    np.testing.assert_array_equal(np.array(w[dw]), raw[dw][:, 0, :].T)
    pw = "encoder.layers.0.conv.pointwise_conv1.weight"
    np.testing.assert_array_equal(np.array(w[pw]), raw[pw][:, :, 0].T)
    conv = "encoder.subsampling.conv_in.weight"
    np.testing.assert_array_equal(np.array(w[conv]), raw[conv].transpose(0, 2, 3, 1))
    assert b.mel_filters.shape == (128, 257) and b.mel_filters.dtype == np.float32
    assert not b.mel_filters_transposed
    assert len(b.pieces) == b.config.vocab_size
    assert b.decoder_path.name == "decoder.onnx" and b.joiner_path.name == "joiner.onnx"


@pytest.mark.parametrize("precision,dtype", [("f16", mx.float16), ("bf16", mx.bfloat16)])
def test_precision_is_chosen_at_load(tiny_bundle: Path, precision: str, dtype: mx.Dtype) -> None:
    f32 = load_bundle(tiny_bundle, "f32").encoder_weights
    low = load_bundle(tiny_bundle, precision).encoder_weights
    name = "encoder.layers.0.self_attn.q_proj.weight"
    assert low[name].dtype == dtype
    np.testing.assert_allclose(
        np.array(low[name].astype(mx.float32)), np.array(f32[name]), rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize("stored", ["f16", "bf16"])
def test_half_precision_files_load(bundle_factory: Callable[..., Path], stored: str) -> None:
    b = load_bundle(bundle_factory("tiny", 0, stored), "f32")
    ref = load_bundle(bundle_factory("tiny", 0, "f32"), "f32")
    name = "encoder.layers.1.feed_forward2.linear2.weight"
    np.testing.assert_allclose(
        np.array(b.encoder_weights[name]), np.array(ref.encoder_weights[name]), rtol=1e-2, atol=1e-2
    )


def test_nemo_tensor_names_are_accepted(bundle_copy: Path, tiny_bundle: Path) -> None:
    hf_to_nemo = {
        "prompt_projector.linear_1.": "prompt_kernel.0.",
        "prompt_projector.linear_2.": "prompt_kernel.2.",
        "encoder.subsampling.conv_in.": "encoder.pre_encode.conv.0.",
        "encoder.subsampling.layers.0.depthwise_conv.": "encoder.pre_encode.conv.2.",
        "encoder.subsampling.layers.0.pointwise_conv.": "encoder.pre_encode.conv.3.",
        "encoder.subsampling.layers.1.depthwise_conv.": "encoder.pre_encode.conv.5.",
        "encoder.subsampling.layers.1.pointwise_conv.": "encoder.pre_encode.conv.6.",
        "encoder.subsampling.linear.": "encoder.pre_encode.out.",
        ".conv.norm.": ".conv.batch_norm.",
        ".self_attn.q_proj.": ".self_attn.linear_q.",
        ".self_attn.k_proj.": ".self_attn.linear_k.",
        ".self_attn.v_proj.": ".self_attn.linear_v.",
        ".self_attn.o_proj.": ".self_attn.linear_out.",
        ".self_attn.relative_k_proj.": ".self_attn.linear_pos.",
        ".self_attn.bias_u": ".self_attn.pos_bias_u",
        ".self_attn.bias_v": ".self_attn.pos_bias_v",
        "encoder_projector.": "joint.enc.",
    }

    def to_nemo(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, value in tensors.items():
            for hf, nemo in hf_to_nemo.items():
                name = name.replace(hf, nemo)
            out[name] = value
        # NeMo checkpoints also carry the preprocessor's buffers; the loader drops them.
        out["preprocessor.featurizer.fb"] = np.zeros((1, 128, 257), np.float32)
        return out

    rewrite_tensors(bundle_copy, to_nemo)
    names = load_file(str(bundle_copy / "encoder.safetensors")).keys()
    assert (
        "encoder.pre_encode.conv.0.weight" in names
        and "encoder.layers.0.self_attn.linear_pos.weight" in names
    )
    assert nemo_to_hf_name("encoder.layers.3.conv.batch_norm.bias") == "encoder.layers.3.conv.norm.bias"
    nemo, hf = load_bundle(bundle_copy), load_bundle(tiny_bundle)
    assert nemo.tensor_naming == "nemo"
    assert nemo.encoder_weights.keys() == hf.encoder_weights.keys()
    for name, w in hf.encoder_weights.items():
        np.testing.assert_array_equal(np.array(nemo.encoder_weights[name]), np.array(w))


def test_transposed_mel_filters_are_detected(bundle_copy: Path, tiny_bundle: Path) -> None:
    path = bundle_copy / "melfilters.f32"
    filters = np.fromfile(path, "<f4").reshape(128, 257)
    filters.T.copy().tofile(path)
    b = load_bundle(bundle_copy)
    assert b.mel_filters_transposed
    np.testing.assert_array_equal(b.mel_filters, load_bundle(tiny_bundle).mel_filters)


def test_sherpa_tokens_format_is_accepted_and_blank_is_by_id(bundle_copy: Path, tiny_bundle: Path) -> None:
    pieces = load_bundle(tiny_bundle).pieces
    blank = len(pieces) - 1
    lines = [f"{p} {i}" for i, p in enumerate(pieces[:-1])] + [f"<blk> {blank}"]
    (bundle_copy / "tokens.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    b = load_bundle(bundle_copy)
    assert b.pieces[:-1] == pieces[:-1] and b.pieces[blank] == "<blk>"
    assert b.config.blank_token_id == blank


def test_optional_sentencepiece_model_is_reported(bundle_copy: Path) -> None:
    assert load_bundle(bundle_copy).sentencepiece_path is None
    (bundle_copy / "tokenizer.model").write_bytes(b"\x00")
    assert load_bundle(bundle_copy).sentencepiece_path == bundle_copy / "tokenizer.model"


# --------------------------------------------------------------------------------------------------
# every defect: one line naming the file (and tensor)


@pytest.mark.parametrize("name", REQUIRED_FILES)
def test_missing_file(bundle_copy: Path, name: str) -> None:
    (bundle_copy / name).unlink()
    message = load_error(bundle_copy)
    assert name in message and "missing file" in message


def test_not_a_directory(tmp_path: Path) -> None:
    assert "not a directory" in load_error(tmp_path / "nope")


def test_unknown_precision(tiny_bundle: Path) -> None:
    with pytest.raises(BundleError, match="precision 'f8'"):
        load_bundle(tiny_bundle, "f8")


def test_missing_tensor(bundle_copy: Path) -> None:
    victim = "encoder.layers.1.self_attn.bias_v"
    rewrite_tensors(bundle_copy, lambda t: {k: v for k, v in t.items() if k != victim})
    message = load_error(bundle_copy)
    assert "encoder.safetensors" in message and f"missing tensor {victim}" in message


def test_extra_tensor(bundle_copy: Path) -> None:
    extra = "encoder.layers.0.self_attn.q_proj.bias"
    rewrite_tensors(bundle_copy, lambda t: {**t, extra: np.zeros(64, np.float32)})
    assert f"unexpected tensor {extra}" in load_error(bundle_copy)


def test_wrong_shape(bundle_copy: Path) -> None:
    victim = "encoder.layers.1.conv.pointwise_conv2.weight"
    rewrite_tensors(bundle_copy, lambda t: {**t, victim: np.zeros((64, 32, 1), np.float32)})
    message = load_error(bundle_copy)
    assert f"tensor {victim}: expected shape (64, 64, 1), got (64, 32, 1)" in message


def test_square_matrix_orientation_cannot_hide_a_wrong_fan_in(bundle_copy: Path) -> None:
    # A size read off one tensor must agree with every other tensor of that kind.
    victim = "encoder.layers.1.feed_forward1.linear1.weight"
    rewrite_tensors(bundle_copy, lambda t: {**t, victim: np.zeros((128, 64), np.float32)})
    assert f"tensor {victim}: expected shape (256, 64)" in load_error(bundle_copy)


def test_truncated_safetensors(bundle_copy: Path) -> None:
    path = bundle_copy / "encoder.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    message = load_error(bundle_copy)
    assert "encoder.safetensors: truncated: tensor" in message and "ends at byte" in message


def test_corrupt_safetensors_header(bundle_copy: Path) -> None:
    path = bundle_copy / "encoder.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))
    assert "encoder.safetensors: corrupt safetensors header" in load_error(bundle_copy)


def test_unsupported_tensor_dtype(bundle_copy: Path) -> None:
    victim = "encoder.layers.0.norm_out.bias"
    rewrite_tensors(bundle_copy, lambda t: {**t, victim: t[victim].astype(np.float64)})
    assert f"tensor {victim}: unsupported dtype F64" in load_error(bundle_copy)


def test_nonfinite_weights_are_refused(bundle_copy: Path) -> None:
    victim = "encoder.layers.0.norm_out.bias"

    def poison(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t[victim] = t[victim].copy()
        t[victim][3] = np.inf
        return t

    rewrite_tensors(bundle_copy, poison)
    assert f"tensor {victim}: non-finite values" in load_error(bundle_copy)


@pytest.mark.parametrize(
    "edit,expected",
    [
        (
            lambda c: c["features"].__setitem__("mel_scale", "htk"),
            "features.mel_scale: unsupported value 'htk'",
        ),
        (
            lambda c: c["features"].__setitem__("sampling_rate", 8000),
            "features.sampling_rate: unsupported value 8000",
        ),
        (
            lambda c: c["encoder"].__setitem__("scale_input", "yes"),
            "encoder.scale_input: expected true/false",
        ),
        (
            lambda c: c["encoder"].__setitem__("subsampling_factor", 6),
            "encoder.subsampling_factor: unsupported",
        ),
        (lambda c: c["encoder"].__setitem__("supported_lookaheads", [3, 70]), "unsupported lookahead 70"),
        (
            lambda c: c["encoder"].__setitem__("default_lookahead", 5),
            "encoder.default_lookahead: 5 is not in",
        ),
        (lambda c: c.__setitem__("default_prompt_id", 500), "default_prompt_id: 500 >= num_prompts 128"),
        (
            lambda c: c["prompt_dictionary"].__setitem__("xx-XX", 128),
            "prompt_dictionary.xx-XX: prompt id 128",
        ),
        (
            lambda c: c.__setitem__("blank_token_id", 10_000),
            "blank_token_id: 10000 is outside the vocabulary",
        ),
        (lambda c: c["encoder"].pop("hidden_size"), "encoder.hidden_size: missing"),
        (lambda c: c["encoder"].__setitem__("frame_ms", 40.0), "encoder.frame_ms: 40.0 disagrees"),
    ],
)
def test_unknown_or_unsupported_config_value(
    bundle_copy: Path, edit: Callable[[dict], None], expected: str
) -> None:
    rewrite_config(bundle_copy, edit)
    message = load_error(bundle_copy)
    assert "nemotron_onnx_config.json" in message and expected in message


def test_unknown_extra_config_keys_are_ignored(bundle_copy: Path) -> None:
    rewrite_config(bundle_copy, lambda c: c.update(future_key={"anything": 1}, base_model="x"))
    load_bundle(bundle_copy)


def test_config_sizes_must_agree_with_the_tensors(bundle_copy: Path) -> None:
    rewrite_config(bundle_copy, lambda c: c["encoder"].__setitem__("intermediate_size", 512))
    message = load_error(bundle_copy)
    assert (
        "tensor encoder.layers.0.feed_forward1.linear1.weight" in message
        and "intermediate_size=512" in message
    )


def test_cache_shapes_must_match_the_left_context(bundle_copy: Path) -> None:
    rewrite_config(bundle_copy, lambda c: c["cache_shapes"].__setitem__("k_cache_0", [1, 4, 70, 16]))
    assert "cache_shapes.k_cache_0: [1, 4, 70, 16] disagrees" in load_error(bundle_copy)


def test_invalid_json_config(bundle_copy: Path) -> None:
    (bundle_copy / "nemotron_onnx_config.json").write_text("{not json")
    assert "nemotron_onnx_config.json: not valid JSON" in load_error(bundle_copy)


def _rename_graph_input(path: Path, old: str, new: str) -> None:
    model = onnx.load(str(path))
    for value in model.graph.input:
        if value.name == old:
            value.name = new
    for node in model.graph.node:
        node.input[:] = [new if x == old else x for x in node.input]
    onnx.save(model, str(path))


def test_onnx_graph_with_unexpected_input_names(bundle_copy: Path) -> None:
    _rename_graph_input(bundle_copy / "decoder.onnx", "token", "targets")
    message = load_error(bundle_copy)
    assert "decoder.onnx: graph inputs are" in message and "'targets'" in message


def test_onnx_graph_with_wrong_rank(bundle_copy: Path) -> None:
    model = onnx.load(str(bundle_copy / "joiner.onnx"))
    out = model.graph.output[0]
    out.type.tensor_type.shape.dim.add().dim_value = 1
    onnx.save(model, str(bundle_copy / "joiner.onnx"))
    assert "joiner.onnx: output logits: rank 3, expected 2" in load_error(bundle_copy)


def test_onnx_graph_of_the_wrong_width(bundle_copy: Path) -> None:
    model = onnx.load(str(bundle_copy / "joiner.onnx"))
    dims = model.graph.output[0].type.tensor_type.shape.dim
    dims[1].dim_value = 13088
    onnx.save(model, str(bundle_copy / "joiner.onnx"))
    assert "joiner.onnx: output logits: dim 1 is 13088, expected 257" in load_error(bundle_copy)


def test_unreadable_onnx_file(bundle_copy: Path) -> None:
    (bundle_copy / "joiner.onnx").write_bytes(b"\x08\x07garbage" * 10)
    assert "joiner.onnx: not a readable ONNX model" in load_error(bundle_copy)


def test_everything_is_checked_before_any_weight_is_read(
    bundle_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_tensor(*_: object) -> None:
        raise AssertionError("a weight was read before the bundle was validated")

    monkeypatch.setattr(bundle_module, "read_tensor", read_tensor)
    (bundle_copy / "joiner.onnx").write_bytes(b"junk")
    assert "joiner.onnx" in load_error(bundle_copy)


@pytest.mark.parametrize(
    "content,expected",
    [
        ("0\ta\n1\tb\n", "2 pieces for vocab_size 257"),
        ("0\ta\n0\tb\n", "token id 0 appears twice"),
        ("just-a-piece\n", "line 1: expected 'id<TAB>piece' or 'piece id'"),
        ("999\tx\n", "token id 999 outside [0, 257)"),
    ],
)
def test_bad_tokens_file(bundle_copy: Path, content: str, expected: str) -> None:
    (bundle_copy / "tokens.txt").write_text(content)
    message = load_error(bundle_copy)
    assert "tokens.txt" in message and expected in message


def test_mel_filters_of_the_wrong_size(bundle_copy: Path) -> None:
    (bundle_copy / "melfilters.f32").write_bytes(np.zeros(100, np.float32).tobytes())
    assert "melfilters.f32: 400 bytes, expected 131584 (128 x 257 float32)" in load_error(bundle_copy)


def test_mel_filters_that_are_not_a_filterbank(bundle_copy: Path) -> None:
    rng = np.random.default_rng(0)
    rng.random((128, 257), dtype=np.float32).tofile(bundle_copy / "melfilters.f32")
    assert "melfilters.f32: not a mel filterbank" in load_error(bundle_copy)
