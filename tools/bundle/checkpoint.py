"""Upstream checkpoints as plain data: HF `model.safetensors` (+ config.json) or a NeMo `.nemo` archive.

`read_checkpoint(path)` returns every tensor under its HF name (float32 numpy), the model sizes as a
`ModelSpec` (from the config when there is one, else read off tensor shapes), and what else the source
carries: the vocabulary (SentencePiece model in the .nemo, `tokenizer.json` beside an HF checkpoint)
and NeMo's stored mel filterbank.

A .nemo is a tar of `model_config.yaml`, `model_weights.ckpt` (a torch state dict: reading it needs
torch) and tokenizer files (`<hash>_tokenizer.model`, `vocab.txt`).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from asr_core.bundle import nemo_to_hf_name
from tools.bundle.prompts import AUTO_PROMPT_ID, PROMPT_DICTIONARY
from tools.bundle.spec import LEFT_CONTEXT_FRAMES, ModelSpec

F32 = NDArray[np.float32]


class CheckpointError(ValueError):
    """The source cannot be read or does not hold this model."""


@dataclass
class Checkpoint:
    source: Path
    kind: str  # "hf" | "nemo"
    tensors: dict[str, F32]  # HF names
    spec: ModelSpec
    prompt_dictionary: dict[str, int]
    default_prompt_id: int
    pieces: list[str] | None = None  # vocabulary without blank, by id
    sentencepiece: bytes | None = None  # the SentencePiece model file, when the source has one
    mel_filters: F32 | None = None  # (n_mels, n_fft/2+1) as stored by NeMo
    notes: list[str] | None = None


def _spec_from_tensors(t: Mapping[str, F32], hints: Mapping[str, Any]) -> ModelSpec:
    """Sizes from tensor shapes; `hints` (config values) only where shapes cannot tell."""
    try:
        hidden = t["encoder.subsampling.linear.weight"].shape[0]
        layers = 1 + max(int(m.group(1)) for n in t if (m := re.match(r"^encoder\.layers\.(\d+)\.", n)))
        heads = t["encoder.layers.0.self_attn.bias_u"].shape[0]
        ff = t["encoder.layers.0.feed_forward1.linear1.weight"].shape[0]
        kernel = t["encoder.layers.0.conv.depthwise_conv.weight"].shape[-1]
        channels = t["encoder.subsampling.conv_in.weight"].shape[0]
        prompt_in = t["prompt_projector.linear_1.weight"]
        joint = t["encoder_projector.weight"].shape[0]
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"not a Nemotron streaming ASR checkpoint: missing {exc}") from exc
    vocab = t["joint.head.weight"].shape[0] if "joint.head.weight" in t else int(hints.get("vocab_size", 0))
    dec_layers = sum(1 for n in t if re.match(r"^decoder\.lstm\.weight_ih_l\d+$", n))
    return ModelSpec(
        name="export",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=ff,
        conv_kernel_size=kernel,
        subsampling_channels=channels,
        n_mels=int(hints.get("n_mels", 128)),
        vocab_size=vocab,
        decoder_hidden=joint,
        decoder_layers=dec_layers or int(hints.get("num_decoder_layers", 2)),
        prompt_intermediate=prompt_in.shape[0],
        num_prompts=prompt_in.shape[1] - hidden,
        max_symbols_per_step=int(hints.get("max_symbols_per_step", 10)),
    )


def _check_config(spec: ModelSpec, hints: Mapping[str, Any], source: str) -> None:
    """Config values that contradict the tensors, or that this implementation does not support."""
    for key, value in (
        ("hidden_size", spec.hidden_size),
        ("num_hidden_layers", spec.num_layers),
        ("num_attention_heads", spec.num_heads),
        ("vocab_size", spec.vocab_size),
    ):
        if key in hints and int(hints[key]) != value:
            raise CheckpointError(f"{source}: config says {key}={hints[key]} but the tensors have {value}")
    if hints.get("scale_input"):
        raise CheckpointError(
            f"{source}: scale_input/xscaling = true is not supported (the model uses false)"
        )
    left = hints.get("left_context")
    if left is not None and int(left) != LEFT_CONTEXT_FRAMES:
        raise CheckpointError(
            f"{source}: left attention context {left}, the runtime supports {LEFT_CONTEXT_FRAMES}"
        )
    blank = hints.get("blank_token_id")
    if blank is not None and spec.vocab_size and int(blank) != spec.vocab_size - 1:
        raise CheckpointError(f"{source}: blank id {blank} is not the last of {spec.vocab_size} outputs")


# -- HF ------------------------------------------------------------------------------------------


def _read_safetensors(path: Path) -> dict[str, F32]:
    from safetensors.numpy import load_file

    try:
        return {k: np.asarray(v, dtype=np.float32) for k, v in load_file(str(path)).items()}
    except Exception as exc:
        raise CheckpointError(f"{path.name}: cannot read safetensors ({exc})") from exc


def _read_hf(src: Path) -> Checkpoint:
    root = src if src.is_dir() else src.parent
    notes: list[str] = []
    if src.is_dir():
        index = root / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [root / s for s in shards]
        elif (root / "model.safetensors").is_file():
            files = [root / "model.safetensors"]
        else:
            raise CheckpointError(f"{src}: no model.safetensors (or sharded index) in this directory")
    else:
        files = [src]
    tensors: dict[str, F32] = {}
    for f in files:
        tensors.update(_read_safetensors(f))
    # A full-model HF checkpoint may prefix names with "model." (base_model_prefix).
    if (
        "encoder.subsampling.conv_in.weight" not in tensors
        and "model.encoder.subsampling.conv_in.weight" in tensors
    ):
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    if "encoder.pre_encode.conv.0.weight" in tensors:  # NeMo names in a safetensors file
        tensors = {nemo_to_hf_name(k): v for k, v in tensors.items() if not k.startswith("preprocessor.")}

    hints: dict[str, Any] = {}
    prompts, default_prompt = dict(PROMPT_DICTIONARY), AUTO_PROMPT_ID
    cfg_path = root / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        enc = cfg.get("encoder_config", {})
        hints = {
            "hidden_size": enc.get("hidden_size"),
            "num_hidden_layers": enc.get("num_hidden_layers"),
            "num_attention_heads": enc.get("num_attention_heads"),
            "n_mels": enc.get("num_mel_bins", 128),
            "scale_input": enc.get("scale_input", False),
            "left_context": (enc["sliding_window"] - 1) if "sliding_window" in enc else None,
            "vocab_size": cfg.get("vocab_size"),
            "blank_token_id": cfg.get("blank_token_id"),
            "num_decoder_layers": cfg.get("num_decoder_layers", 2),
            "max_symbols_per_step": cfg.get("max_symbols_per_step", 10),
        }
        hints = {k: v for k, v in hints.items() if v is not None}
        default_prompt = int(cfg.get("default_prompt_id", AUTO_PROMPT_ID))
    else:
        notes.append("no config.json beside the weights: sizes read off tensor shapes, defaults for the rest")
    spec = _spec_from_tensors(tensors, hints)
    _check_config(spec, hints, str(cfg_path if cfg_path.is_file() else src))

    pieces = None
    tok_json = root / "tokenizer.json"
    if tok_json.is_file():
        model = json.loads(tok_json.read_text(encoding="utf-8")).get("model", {})
        vocab = model.get("vocab")
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
            pieces = [str(p[0]) for p in vocab]
        elif isinstance(vocab, dict):  # BPE/WordPiece: piece -> id
            pieces = [p for p, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    sp_bytes = (root / "tokenizer.model").read_bytes() if (root / "tokenizer.model").is_file() else None
    return Checkpoint(src, "hf", tensors, spec, prompts, default_prompt, pieces, sp_bytes, None, notes)


# -- NeMo ----------------------------------------------------------------------------------------


def _read_nemo(src: Path) -> Checkpoint:
    try:
        import torch
    except ImportError as exc:
        raise CheckpointError("reading a .nemo needs torch (pip install '.[reference]')") from exc
    import yaml

    try:
        tar = tarfile.open(src, "r:*")  # noqa: SIM115 (closed by the with-block below)
    except (tarfile.TarError, OSError) as exc:
        raise CheckpointError(f"{src.name}: not a .nemo archive ({exc})") from exc
    with tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}

        def read(name: str) -> bytes:
            f = tar.extractfile(members[name])
            assert f is not None
            return f.read()

        for needed in ("model_config.yaml", "model_weights.ckpt"):
            if needed not in members:
                raise CheckpointError(f"{src.name}: no {needed} in the archive")
        cfg = yaml.safe_load(read("model_config.yaml")) or {}
        state = torch.load(io.BytesIO(read("model_weights.ckpt")), map_location="cpu", weights_only=True)
        sp_name = next((n for n in members if n.endswith("tokenizer.model")), None)
        sp_bytes = read(sp_name) if sp_name else None

    tensors = {
        nemo_to_hf_name(k): v.float().numpy() for k, v in state.items() if not k.startswith("preprocessor.")
    }
    fb = state.get("preprocessor.featurizer.fb")
    filters = fb.float().numpy().reshape(fb.shape[-2], fb.shape[-1]) if fb is not None else None

    enc = cfg.get("encoder", {})
    defaults = cfg.get("model_defaults", {})
    att = enc.get("att_context_size")
    left = att[0][0] if isinstance(att, list) and att and isinstance(att[0], list) else None
    hints: dict[str, Any] = {
        "hidden_size": enc.get("d_model"),
        "num_hidden_layers": enc.get("n_layers"),
        "num_attention_heads": enc.get("n_heads"),
        "n_mels": enc.get("feat_in", 128),
        "scale_input": enc.get("xscaling", False),
        "left_context": left,
        "num_decoder_layers": cfg.get("decoder", {}).get("prednet", {}).get("pred_rnn_layers", 2),
        "max_symbols_per_step": cfg.get("decoding", {}).get("greedy", {}).get("max_symbols", 10),
    }
    hints = {k: v for k, v in hints.items() if v is not None}
    spec = _spec_from_tensors(tensors, hints)
    _check_config(spec, hints, f"{src.name}:model_config.yaml")
    prompts = {str(k): int(v) for k, v in (defaults.get("prompt_dictionary") or PROMPT_DICTIONARY).items()}
    pieces = None
    notes: list[str] = []
    if sp_bytes is not None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(sp_bytes)
        pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    else:
        notes.append("the archive has no tokenizer.model")
    return Checkpoint(
        src,
        "nemo",
        tensors,
        spec,
        prompts,
        prompts.get("auto", AUTO_PROMPT_ID),
        pieces,
        sp_bytes,
        filters,
        notes,
    )


def read_checkpoint(src: Path) -> Checkpoint:
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory")
    if src.is_file() and src.suffix == ".nemo":
        return _read_nemo(src)
    if src.is_dir() or src.suffix == ".safetensors":
        return _read_hf(src)
    raise CheckpointError(
        f"{src}: expected a .nemo archive, a .safetensors file or an HF checkpoint directory"
    )
