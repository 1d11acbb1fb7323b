"""`ttg export`: checkpoints written by the reference implementation -> the same bundle."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from asr_core.bundle import load_bundle
from tests.fixtures import peers
from tests.fixtures.bundle import ReferenceBundle
from tests.fixtures.mlx_audio import nemo_config, write_nemo
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.prompts import PROMPT_DICTIONARY
from tools.export import EXIT_INCOMPLETE, main

pytestmark = pytest.mark.reference


def _tensors(bundle: Path) -> dict[str, np.ndarray]:
    with safe_open(str(bundle / "encoder.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _args(src: Path, out: Path, dtype: str = "f32", tokens: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        src=src,
        out=out,
        dtype=dtype,
        tokens=tokens,
        sentencepiece=None,
        quantize=None,
        bitmap=None,
        group_size=64,
    )


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


def _nemo_archive(ref: ReferenceBundle, path: Path, *, xscaling: bool = False) -> np.ndarray:
    """The reference model as NeMo would save it, with NeMo's own copy of the filterbank (returned)."""
    torch = peers.module("torch")
    fb = slaney_mel_filters().astype(np.float32) * np.float32(1 + 1e-7)  # NeMo's own copy, not bit-equal
    extra = {
        "preprocessor.featurizer.fb": fb[None],
        "preprocessor.featurizer.window": torch.hann_window(400, periodic=False),
    }
    pieces = [f"p{i}" for i in range(ref.spec.vocab_size - 1)]
    write_nemo(
        path,
        ref.model.state_dict(),
        nemo_config(ref.spec, PROMPT_DICTIONARY, pieces, xscaling=xscaling),
        extra,
    )
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
