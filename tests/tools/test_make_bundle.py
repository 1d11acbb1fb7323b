"""`ttg make-bundle`: complete, deterministic bundles whose graphs compute the reference's math."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors import safe_open

from tests.fixtures import peers
from tests.fixtures.bundle import BundleFactory, ReferenceBundle
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.numpy_encoder import encoder_forward, joiner_frames
from tools.bundle.spec import FULL, TINY
from tools.bundle.tokens import generated_vocabulary
from tools.bundle.writer import BUNDLE_FILES
from tools.make_bundle import add_arguments
from tools.make_bundle import main as make_bundle_main


def _tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path / "encoder.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_full_size_spec_has_the_published_tensor_set() -> None:
    shapes = FULL.encoder_shapes()
    assert len(shapes) == 642
    assert sum(int(np.prod(s)) for s in shapes.values()) == 614_257_280
    assert sum(int(np.prod(s)) for s in FULL.rnnt_shapes().values()) == 23_739_808
    assert shapes["encoder.subsampling.linear.weight"] == (1024, 4352)
    assert shapes["prompt_projector.linear_1.weight"] == (2048, 1152)
    assert FULL.blank_id == 13087
    vocab = generated_vocabulary(FULL.vocab_size)
    assert len(vocab) == len(set(vocab)) == 13088
    assert sum(p.startswith("<") and p.endswith(">") and "-" in p for p in vocab) == 40


def test_tiny_bundle_has_every_file_and_exactly_the_spec_tensors(tiny_bundle: Path) -> None:
    for name in BUNDLE_FILES:
        assert (tiny_bundle / name).stat().st_size > 0, name
    tensors = _tensors(tiny_bundle)
    assert {k: v.shape for k, v in tensors.items()} == TINY.encoder_shapes()
    assert all(v.dtype == np.float32 for v in tensors.values())
    cfg = json.loads((tiny_bundle / "nemotron_onnx_config.json").read_text())
    assert cfg["vocab_size"] == TINY.vocab_size and cfg["blank_token_id"] == TINY.blank_id
    assert cfg["encoder"]["left_context_frames"] == 56 and cfg["encoder"]["scale_input"] is False
    assert cfg["prompt_dictionary"]["uk-UA"] == 19 and cfg["prompt_dictionary"]["auto"] == 101
    lines = (tiny_bundle / "tokens.txt").read_text(encoding="utf-8").splitlines()
    assert (
        len(lines) == TINY.vocab_size and lines[0] == "0\t<unk>" and lines[-1] == f"{TINY.blank_id}\t<blank>"
    )
    assert {"<en-US>", "<uk-UA>"} <= {line.split("\t")[1] for line in lines}


def test_melfilters_are_the_slaney_filterbank_of_the_reference_extractor(tiny_bundle: Path) -> None:
    transformers = peers.module("transformers")
    stored = np.fromfile(tiny_bundle / "melfilters.f32", dtype="<f4").reshape(128, 257)
    hf = transformers.audio_utils.mel_filter_bank(
        num_frequency_bins=257,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
        dtype=np.float32,
    ).T
    assert np.abs(stored - hf).max() < 1e-7
    assert np.flatnonzero(stored[0]).tolist() == [1]  # model_spec.md §4: filter 0 touches only bin 1
    assert stored[0, 1] == pytest.approx(0.02837754, abs=1e-7)
    np.testing.assert_array_equal(stored, slaney_mel_filters())


def test_same_seed_gives_byte_identical_files_and_another_seed_other_weights(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    assert make_bundle_main(_args(out=tmp_path / "again")) == 0
    for name in BUNDLE_FILES:
        assert (tmp_path / "again" / name).read_bytes() == (tiny_bundle / name).read_bytes(), name
    assert make_bundle_main(_args(out=tmp_path / "other", seed=7)) == 0
    other, mine = _tensors(tmp_path / "other"), _tensors(tiny_bundle)
    assert not np.array_equal(
        other["encoder.layers.0.self_attn.q_proj.weight"], mine["encoder.layers.0.self_attn.q_proj.weight"]
    )
    assert (tmp_path / "other" / "decoder.onnx").read_bytes() != (tiny_bundle / "decoder.onnx").read_bytes()


def _args(out: Path, seed: int = 0, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--size", "tiny", "--seed", str(seed), "--out", str(out), *extra])


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_reduced_precision_stores_the_f32_weights_rounded(
    dtype: str, bundle_factory: BundleFactory, tiny_bundle: Path
) -> None:
    import ml_dtypes

    low = _tensors(bundle_factory("tiny", 0, dtype))
    full = _tensors(tiny_bundle)
    np_dtype = np.float16 if dtype == "f16" else ml_dtypes.bfloat16
    for name, value in full.items():
        assert low[name].dtype == np_dtype
        np.testing.assert_array_equal(low[name], value.astype(np_dtype), err_msg=name)


def test_graphs_have_the_contract_io_with_a_symbolic_batch(tiny_bundle: Path) -> None:
    def io(path: Path) -> dict[str, list[object]]:
        g = onnx.load(str(path)).graph
        inits = {i.name for i in g.initializer}
        return {
            vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in [*g.input, *g.output]
            if vi.name not in inits
        }

    h, layers, v = TINY.decoder_hidden, TINY.decoder_layers, TINY.vocab_size
    assert io(tiny_bundle / "decoder.onnx") == {
        "token": ["batch", 1],
        "h_in": [layers, "batch", h],
        "c_in": [layers, "batch", h],
        "decoder_out": ["batch", h],
        "h_out": [layers, "batch", h],
        "c_out": [layers, "batch", h],
    }
    assert io(tiny_bundle / "joiner.onnx") == {
        "encoder_frame": ["batch", h],
        "decoder_out": ["batch", h],
        "logits": ["batch", v],
    }


def test_graphs_compute_the_reference_prediction_network_and_joint(reference_tiny: ReferenceBundle) -> None:
    """ONNX LSTM gate order (i,o,f,c) vs torch (i,f,g,o) and the bias split are where exports go wrong."""
    torch = peers.module("torch")
    model, spec = reference_tiny.model, reference_tiny.spec
    dec, joi = (
        _session(reference_tiny.bundle / "decoder.onnx"),
        _session(reference_tiny.bundle / "joiner.onnx"),
    )
    rng = np.random.default_rng(3)
    batch = 5
    tokens = np.array([spec.blank_id, 0, 7, 100, spec.blank_id - 1], np.int64)
    h = rng.standard_normal((spec.decoder_layers, batch, spec.decoder_hidden)).astype(np.float32)
    c = rng.standard_normal(h.shape).astype(np.float32)
    g, h_out, c_out = dec.run(None, {"token": tokens[:, None], "h_in": h, "c_in": c})
    f = rng.standard_normal((batch, spec.decoder_hidden)).astype(np.float32)
    (logits,) = joi.run(None, {"encoder_frame": f, "decoder_out": g})
    with torch.no_grad():
        emb = model.decoder.embedding(torch.from_numpy(tokens)[:, None])
        out, (h_ref, c_ref) = model.decoder.lstm(emb, (torch.from_numpy(h), torch.from_numpy(c)))
        g_ref = model.decoder.decoder_projector(out[:, -1])
        logits_ref = model.joint(
            decoder_hidden_states=torch.from_numpy(g), encoder_hidden_states=torch.from_numpy(f)
        )
    np.testing.assert_allclose(g, g_ref.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h_out, h_ref.numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(c_out, c_ref.numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(logits, logits_ref.numpy(), rtol=1e-5, atol=1e-4)


def test_reference_bundle_holds_the_reference_models_encoder_weights(reference_tiny: ReferenceBundle) -> None:
    state = {k: v.numpy() for k, v in reference_tiny.model.state_dict().items()}
    stored = _tensors(reference_tiny.bundle)
    assert set(stored) == set(TINY.encoder_shapes())
    for name, value in stored.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    # perturbed away from the identity init so that the norms and attention biases matter
    assert np.abs(state["encoder.layers.0.norm_out.weight"] - 1).max() > 0.05
    assert np.abs(state["encoder.layers.1.self_attn.bias_u"]).max() > 0.05


def test_bundle_is_accepted_by_the_loader(tiny_bundle: Path) -> None:
    from asr_core.bundle import load_bundle

    bundle = load_bundle(tiny_bundle, "f32")
    assert bundle.config.blank_token_id == TINY.blank_id
    assert len(bundle.encoder_weights) == len(TINY.encoder_shapes())
    assert bundle.pieces[1] == "<en-US>"


def test_numpy_encoder_used_for_calibration_matches_the_reference(reference_tiny: ReferenceBundle) -> None:
    torch = peers.module("torch")
    state = {k: v.numpy() for k, v in reference_tiny.model.state_dict().items()}
    mel = np.random.default_rng(0).standard_normal((203, 128)).astype(np.float32) * 3 - 8
    for lookahead in (0, 3):
        with torch.no_grad():
            ref = reference_tiny.model.get_audio_features(
                input_features=torch.from_numpy(mel)[None],
                prompt_ids=torch.tensor([19]),
                num_lookahead_tokens=lookahead,
            )
        hidden = encoder_forward(state, mel, TINY.num_heads, lookahead)
        np.testing.assert_allclose(hidden, ref.last_hidden_state[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(
            joiner_frames(state, hidden, 19, 128), ref.pooler_output[0].numpy(), atol=1e-5
        )


def test_random_weights_are_calibrated_to_a_speech_like_token_rate(tiny_bundle: Path) -> None:
    with safe_open(str(tiny_bundle / "encoder.safetensors"), "np") as f:
        meta = f.metadata()
    assert meta["weights"] == "random" and meta["seed"] == "0"
    assert 2.5 <= float(meta["probe_tokens_per_second"]) <= 4.5


def test_cli_rejects_an_impossible_token_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(out=tmp_path / "x")
    args.tokens_per_second = 20.0
    assert make_bundle_main(args) == 2
    assert "tokens-per-second" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
