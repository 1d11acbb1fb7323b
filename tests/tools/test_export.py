"""`ttg export`: checkpoints written by the reference implementation -> the same bundle."""

from __future__ import annotations

import argparse
import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from asr_core.bundle import load_bundle
from tests.fixtures import peers
from tests.fixtures.bundle import ReferenceBundle
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.prompts import PROMPT_DICTIONARY
from tools.export import EXIT_INCOMPLETE, main

pytestmark = pytest.mark.reference


def _tensors(bundle: Path) -> dict[str, np.ndarray]:
    with safe_open(str(bundle / "encoder.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _args(src: Path, out: Path, dtype: str = "f32", tokens: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(src=src, out=out, dtype=dtype, tokens=tokens, sentencepiece=None)


@pytest.fixture(scope="module")
def hf_checkpoint(reference_tiny: ReferenceBundle, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf-checkpoint")
    reference_tiny.model.save_pretrained(out)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    return out


def test_hf_checkpoint_exports_to_the_reference_bundle(
    hf_checkpoint: Path, reference_tiny: ReferenceBundle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = reference_tiny.bundle
    assert main(_args(hf_checkpoint, tmp_path / "b", tokens=ref / "tokens.txt")) == 0
    out = tmp_path / "b"
    summary = json.loads(capsys.readouterr().out)
    assert summary["missing"] == {} and summary["source_format"] == "hf"
    mine, want = _tensors(out), _tensors(ref)
    assert mine.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(mine[name], want[name], err_msg=name)
    # same weights through the same graph builder: the very same graph files
    for name in ("decoder.onnx", "joiner.onnx", "tokens.txt", "melfilters.f32"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert json.loads((out / "nemotron_onnx_config.json").read_text()) == json.loads(
        (ref / "nemotron_onnx_config.json").read_text()
    )
    assert load_bundle(out).config.vocab_size == reference_tiny.spec.vocab_size


def test_f16_export_rounds_the_encoder_weights(
    hf_checkpoint: Path, reference_tiny: ReferenceBundle, tmp_path: Path
) -> None:
    assert main(_args(hf_checkpoint, tmp_path / "b", "f16", reference_tiny.bundle / "tokens.txt")) == 0
    half, full = _tensors(tmp_path / "b"), _tensors(reference_tiny.bundle)
    for name, value in full.items():
        assert half[name].dtype == np.float16
        np.testing.assert_array_equal(half[name], value.astype(np.float16))


def test_without_a_tokenizer_the_bundle_is_incomplete_and_says_how_to_finish_it(
    hf_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(hf_checkpoint, tmp_path / "b")) == EXIT_INCOMPLETE
    err = capsys.readouterr().err
    assert "tokens.txt not written" in err and "--tokens" in err
    assert (tmp_path / "b" / "encoder.safetensors").is_file() and (tmp_path / "b" / "decoder.onnx").is_file()
    assert not (tmp_path / "b" / "tokens.txt").exists()


def test_a_tokens_file_of_the_wrong_size_is_rejected(hf_checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "tokens.txt"
    bad.write_text("".join(f"{i}\tp{i}\n" for i in range(10)), encoding="utf-8")
    assert main(_args(hf_checkpoint, tmp_path / "b", tokens=bad)) == 2


# -- .nemo ------------------------------------------------------------------------------------------

# HF -> NeMo, the inverse of model_spec.md §2.3, to write a .nemo as NeMo would.
_HF_TO_NEMO = (
    (r"^prompt_projector\.linear_1\.", "prompt_kernel.0."),
    (r"^prompt_projector\.linear_2\.", "prompt_kernel.2."),
    (r"^encoder\.subsampling\.conv_in\.", "encoder.pre_encode.conv.0."),
    (r"^encoder\.subsampling\.layers\.0\.depthwise_conv\.", "encoder.pre_encode.conv.2."),
    (r"^encoder\.subsampling\.layers\.0\.pointwise_conv\.", "encoder.pre_encode.conv.3."),
    (r"^encoder\.subsampling\.layers\.1\.depthwise_conv\.", "encoder.pre_encode.conv.5."),
    (r"^encoder\.subsampling\.layers\.1\.pointwise_conv\.", "encoder.pre_encode.conv.6."),
    (r"^encoder\.subsampling\.linear\.", "encoder.pre_encode.out."),
    (r"\.conv\.norm\.", ".conv.batch_norm."),
    (r"\.self_attn\.q_proj\.", ".self_attn.linear_q."),
    (r"\.self_attn\.k_proj\.", ".self_attn.linear_k."),
    (r"\.self_attn\.v_proj\.", ".self_attn.linear_v."),
    (r"\.self_attn\.o_proj\.", ".self_attn.linear_out."),
    (r"\.self_attn\.relative_k_proj\.", ".self_attn.linear_pos."),
    (r"\.self_attn\.bias_u$", ".self_attn.pos_bias_u"),
    (r"\.self_attn\.bias_v$", ".self_attn.pos_bias_v"),
    (r"^encoder_projector\.", "joint.enc."),
    (r"^decoder\.embedding\.", "decoder.prediction.embed."),
    (r"^decoder\.lstm\.", "decoder.prediction.dec_rnn.lstm."),
    (r"^decoder\.decoder_projector\.", "joint.pred."),
    (r"^joint\.head\.", "joint.joint_net.2."),
)


def _to_nemo(name: str) -> str:
    for pattern, repl in _HF_TO_NEMO:
        name = re.sub(pattern, repl, name)
    return name


def _nemo_archive(ref: ReferenceBundle, path: Path, *, xscaling: bool = False) -> np.ndarray:
    torch = peers.module("torch")
    yaml = peers.module("yaml")
    spec = ref.spec
    state = {_to_nemo(k): v.clone() for k, v in ref.model.state_dict().items()}
    assert "encoder.pre_encode.conv.0.weight" in state and "joint.joint_net.2.weight" in state
    fb = slaney_mel_filters().astype(np.float32) * np.float32(1 + 1e-7)  # NeMo's own copy, not bit-equal
    state["preprocessor.featurizer.fb"] = torch.from_numpy(fb[None])
    state["preprocessor.featurizer.window"] = torch.hann_window(400, periodic=False)
    config = {
        "model_defaults": {
            "enc_hidden": spec.hidden_size,
            "pred_hidden": spec.decoder_hidden,
            "num_prompts": 128,
            "prompt_dictionary": dict(PROMPT_DICTIONARY),
        },
        "encoder": {
            "feat_in": 128,
            "n_layers": spec.num_layers,
            "d_model": spec.hidden_size,
            "n_heads": spec.num_heads,
            "xscaling": xscaling,
            "att_context_size": [[56, 3], [56, 0], [56, 6], [56, 13]],
        },
        "decoder": {"prednet": {"pred_hidden": spec.decoder_hidden, "pred_rnn_layers": spec.decoder_layers}},
        "decoding": {"strategy": "greedy_batch", "greedy": {"max_symbols": 10}},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    with tarfile.open(path, "w") as tar:
        for name, data in (
            ("model_config.yaml", yaml.safe_dump(config).encode()),
            ("model_weights.ckpt", buf.getvalue()),
        ):
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return fb


def test_nemo_archive_exports_to_the_reference_bundle(
    reference_tiny: ReferenceBundle, tmp_path: Path
) -> None:
    fb = _nemo_archive(reference_tiny, tmp_path / "model.nemo")
    ref = reference_tiny.bundle
    assert main(_args(tmp_path / "model.nemo", tmp_path / "b", tokens=ref / "tokens.txt")) == 0
    out = tmp_path / "b"
    mine, want = _tensors(out), _tensors(ref)
    assert mine.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(mine[name], want[name], err_msg=name)
    for name in ("decoder.onnx", "joiner.onnx"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    # the filterbank NeMo stored is the one used, not the formula's
    np.testing.assert_array_equal(np.fromfile(out / "melfilters.f32", "<f4").reshape(128, 257), fb)


def test_unsupported_or_broken_sources_are_clear_errors(
    reference_tiny: ReferenceBundle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _nemo_archive(reference_tiny, tmp_path / "x.nemo", xscaling=True)
    assert main(_args(tmp_path / "x.nemo", tmp_path / "b")) == 2
    assert "xscaling" in capsys.readouterr().err
    (tmp_path / "junk.nemo").write_bytes(b"not a tar")
    assert main(_args(tmp_path / "junk.nemo", tmp_path / "b")) == 2
    assert "not a .nemo archive" in capsys.readouterr().err
    assert main(_args(tmp_path / "nothing-here", tmp_path / "b")) == 2
    assert "no such file" in capsys.readouterr().err
