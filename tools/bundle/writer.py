"""Write a complete model bundle (docs/architecture.md, "The model bundle").

Files: encoder.safetensors (HF names, PyTorch layouts, f32/f16/bf16), decoder.onnx + joiner.onnx
(f32, symbolic batch), tokens.txt, nemotron_onnx_config.json, melfilters.f32. Each file is written
under a temporary name and renamed into place, and both graphs are run in onnxruntime against the
numpy math before they are kept.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from numpy.typing import NDArray

from asr_core.decoder.numpy_rnnt import NumpyRnnt, RnntWeights
from asr_core.decoder.onnx_build import build_decoder, build_joiner
from tools.bundle.filters import slaney_mel_filters, write_filters
from tools.bundle.safetensors_io import DTYPES, write_safetensors
from tools.bundle.spec import FEATURES, ModelSpec
from tools.bundle.tokens import generated_vocabulary, write_tokens

F32 = NDArray[np.float32]
BUNDLE_FILES = (
    "encoder.safetensors",
    "decoder.onnx",
    "joiner.onnx",
    "tokens.txt",
    "nemotron_onnx_config.json",
    "melfilters.f32",
)


@dataclass(frozen=True, slots=True)
class BundleWeights:
    """Where the weights come from: encoder tensors (streamed, HF names in spec order) and the
    prediction network + joint (HF names, PyTorch layouts)."""

    encoder: Callable[[], Iterable[tuple[str, F32]]]
    rnnt: Mapping[str, F32]
    metadata: dict[str, str] = field(default_factory=dict)


class GraphCheckError(RuntimeError):
    pass


def _replace(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)


def _tmp(out: Path, name: str) -> Path:
    return out / f".{name}.tmp"


def check_graphs(
    decoder: onnx.ModelProto, joiner: onnx.ModelProto, weights: RnntWeights, blank_id: int
) -> float:
    """Run both graphs in onnxruntime at batch 3 against the numpy math; returns max |Δ|."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    dec = ort.InferenceSession(decoder.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    joi = ort.InferenceSession(joiner.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ref = NumpyRnnt(weights)
    rng = np.random.default_rng(0)
    tokens = np.array([blank_id, 0, weights.vocab // 2], np.int64)
    h = rng.standard_normal((len(weights.lstm), 3, weights.hidden)).astype(np.float32)
    c = rng.standard_normal(h.shape).astype(np.float32)
    got = dec.run(None, {"token": tokens[:, None], "h_in": h, "c_in": c})
    g, h_out, c_out = ref.decoder_step(tokens, h, c)
    f = rng.standard_normal(g.shape).astype(np.float32)
    got.append(joi.run(None, {"encoder_frame": f, "decoder_out": g})[0])
    want = (g, h_out, c_out, ref.joiner(f, g))
    worst = 0.0
    for name, g, w in zip(("decoder_out", "h_out", "c_out", "logits"), got, want, strict=True):
        err = float(np.abs(g - w).max() / max(1.0, float(np.abs(w).max())))
        if not err <= 1e-5:
            raise GraphCheckError(f"{name}: onnxruntime differs from the numpy reference by {err:.3g}")
        worst = max(worst, err)
    return worst


def write_encoder(
    out: Path,
    spec: ModelSpec,
    produce: Callable[[], Iterable[tuple[str, F32]]],
    dtype: str,
    metadata: dict[str, str],
) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    tmp = _tmp(out, "encoder.safetensors")
    write_safetensors(tmp, spec.encoder_shapes(), produce, dtype, metadata=metadata)
    _replace(tmp, out / "encoder.safetensors")


def write_graphs(out: Path, spec: ModelSpec, rnnt_tensors: Mapping[str, F32]) -> float:
    """decoder.onnx + joiner.onnx from HF-named prediction network / joint tensors; checked in ORT."""
    rnnt = RnntWeights.from_torch_names(rnnt_tensors, spec.decoder_layers)
    b_ih = [
        np.asarray(rnnt_tensors[f"decoder.lstm.bias_ih_l{i}"], np.float32) for i in range(spec.decoder_layers)
    ]
    decoder, joiner = build_decoder(rnnt, b_ih), build_joiner(rnnt)
    graph_err = check_graphs(decoder, joiner, rnnt, spec.blank_id)
    for name, model in (("decoder.onnx", decoder), ("joiner.onnx", joiner)):
        tmp = _tmp(out, name)
        tmp.write_bytes(model.SerializeToString())
        _replace(tmp, out / name)
    return graph_err


def write_text_file(out: Path, name: str, text: str) -> None:
    tmp = _tmp(out, name)
    tmp.write_text(text, encoding="utf-8")
    _replace(tmp, out / name)


def write_tokens_file(out: Path, pieces: list[str]) -> None:
    tmp = _tmp(out, "tokens.txt")
    write_tokens(tmp, pieces)
    _replace(tmp, out / "tokens.txt")


def write_config(out: Path, config: Mapping[str, object]) -> None:
    write_text_file(out, "nemotron_onnx_config.json", json.dumps(config, indent=2) + "\n")


def write_melfilters(out: Path, spec: ModelSpec, filters: F32 | None = None) -> None:
    """The given filterbank (e.g. the one a .nemo stores) or the slaney formula's."""
    if filters is None:
        filters = slaney_mel_filters(
            FEATURES["sampling_rate"], FEATURES["n_fft"], spec.n_mels, 0.0, FEATURES["fmax"]
        )
    tmp = _tmp(out, "melfilters.f32")
    write_filters(tmp, filters)
    _replace(tmp, out / "melfilters.f32")


def write_bundle(out: Path, spec: ModelSpec, weights: BundleWeights, dtype: str = "f32") -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"producer": "ttg make-bundle", "model": spec.name, "format": "pt", **weights.metadata}
    write_encoder(out, spec, weights.encoder, dtype, meta)
    graph_err = write_graphs(out, spec, weights.rnnt)
    write_tokens_file(out, generated_vocabulary(spec.vocab_size))
    write_config(out, spec.onnx_config())
    write_melfilters(out, spec)
    return {
        "dir": str(out),
        "model": spec.name,
        "dtype": dtype,
        "encoder_tensors": len(spec.encoder_shapes()),
        "graph_check_max_rel_err": graph_err,
        "bytes": {name: (out / name).stat().st_size for name in BUNDLE_FILES},
    }
