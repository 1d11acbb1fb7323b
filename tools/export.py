"""`ttg export SRC --out DIR [--dtype f16|bf16|f32]`: an upstream checkpoint -> the bundle format.

`ttg export BUNDLE --out DIR --quantize {q8,q5,q4,mixed68} [--bitmap FILE] [--group-size N]`: any
bundle ttg loads -> the quantized mlx-audio layout (tools/bundle/mlx_export.py says what is written).

SRC is an HF checkpoint (`model.safetensors`, or its directory with `config.json`, maybe sharded) or a
NeMo `.nemo` archive (needs torch to read its weights). Written:

- encoder.safetensors: the 642 encoder-side tensors under HF names, PyTorch layouts, in `--dtype`;
- decoder.onnx / joiner.onnx: built from the prediction network + joint weights, when SRC has them;
- nemotron_onnx_config.json: sizes from the config (or tensor shapes), prompt table of the source;
- melfilters.f32: the filterbank a .nemo stores, else the slaney formula (they agree to ~3e-9);
- tokens.txt (+ tokenizer.model): from `--tokens`, `--sentencepiece`, or the source's tokenizer.

Whatever cannot be derived is listed at the end with the option that supplies it; the exit status
is then 3 (bundle incomplete), 0 when all files are there, 2 on a bad source.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from asr_core.errors import BundleError
from tools.bundle.checkpoint import Checkpoint, CheckpointError, read_checkpoint
from tools.bundle.mlx_export import SCHEMES, MlxExportError, export_mlx
from tools.bundle.tokens import BLANK_PIECE
from tools.bundle.writer import (
    BUNDLE_FILES,
    write_config,
    write_encoder,
    write_graphs,
    write_melfilters,
    write_tokens_file,
)

EXIT_INCOMPLETE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="model.safetensors / HF checkpoint dir / model .nemo")
    parser.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    parser.add_argument(
        "--dtype",
        choices=("f16", "bf16", "f32"),
        default=None,
        help="stored dtype of the non-quantized tensors (f16; with --quantize: the source's)",
    )
    parser.add_argument("--tokens", type=Path, help="tokens.txt to use (id<TAB>piece or 'piece id' lines)")
    parser.add_argument(
        "--sentencepiece", type=Path, help="SentencePiece tokenizer.model to take pieces from"
    )
    parser.add_argument(
        "--quantize",
        choices=tuple(SCHEMES),
        default=None,
        help="write the quantized mlx-audio layout from SRC, a bundle directory of any layout",
    )
    parser.add_argument(
        "--bitmap", type=Path, default=None, help="per-module bits overriding the --quantize scheme (JSON)"
    )
    parser.add_argument(
        "--group-size", type=int, default=64, help="quantization group size where it fits (32, 64, 128)"
    )


class ExportError(ValueError):
    pass


def _pieces_from_tokens_file(path: Path, vocab: int) -> list[str]:
    from asr_core.bundle import load_pieces

    return list(load_pieces(path, vocab))


def _pieces(
    ck: Checkpoint, tokens: Path | None, sentencepiece: Path | None
) -> tuple[list[str] | None, bytes | None]:
    vocab = ck.spec.vocab_size
    if tokens is not None:
        return _pieces_from_tokens_file(tokens, vocab), None
    sp_bytes = ck.sentencepiece
    pieces = ck.pieces
    if sentencepiece is not None:
        import sentencepiece as spm

        sp_bytes = sentencepiece.read_bytes()
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(sp_bytes)
        except RuntimeError as exc:
            raise ExportError(f"{sentencepiece.name}: not a SentencePiece model ({exc})") from exc
        pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    if pieces is None:
        return None, None
    # The joint has one output per piece plus blank (the last id). HF tokenizers may list extra
    # specials (<pad>, <blank>) after the pieces; the model's ids stop at vocab - 1.
    if len(pieces) < vocab - 1:
        raise ExportError(
            f"the tokenizer has {len(pieces)} pieces but the joint has {vocab} outputs (pieces + blank)"
        )
    if len(pieces) > vocab:
        raise ExportError(f"the tokenizer has {len(pieces)} pieces, more than the joint's {vocab} outputs")
    return [*pieces[: vocab - 1], BLANK_PIECE], sp_bytes


def export(
    src: Path, out: Path, dtype: str = "f16", tokens: Path | None = None, sentencepiece: Path | None = None
) -> dict[str, object]:
    ck = read_checkpoint(src)
    spec = ck.spec
    shapes = spec.encoder_shapes()
    for name, shape in shapes.items():
        if name not in ck.tensors:
            raise ExportError(f"{src.name}: tensor {name} missing")
        if tuple(ck.tensors[name].shape) != shape:
            raise ExportError(
                f"{src.name}: tensor {name} has shape {tuple(ck.tensors[name].shape)}, expected {shape}"
            )
    rnnt_names = set(spec.rnnt_shapes())
    unknown = sorted(n for n in ck.tensors if n not in shapes and n not in rnnt_names)
    if unknown:
        raise ExportError(f"{src.name}: unexpected tensors {unknown[:3]}{' ...' if len(unknown) > 3 else ''}")

    pieces, sp_bytes = _pieces(ck, tokens, sentencepiece)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"producer": "ttg export", "source": src.name, "source_format": ck.kind, "format": "pt"}
    write_encoder(out, spec, lambda: ((n, ck.tensors[n]) for n in shapes), dtype, meta)
    missing: dict[str, str] = {}
    graph_err = None
    have_rnnt = [n for n in rnnt_names if n in ck.tensors]
    if len(have_rnnt) == len(rnnt_names):
        for name, shape in spec.rnnt_shapes().items():
            if tuple(ck.tensors[name].shape) != shape:
                raise ExportError(
                    f"{src.name}: tensor {name} has shape {tuple(ck.tensors[name].shape)}, expected {shape}"
                )
        graph_err = write_graphs(out, spec, {n: ck.tensors[n] for n in rnnt_names})
    else:
        why = (
            "no prediction network / joint weights"
            if not have_rnnt
            else f"only {len(have_rnnt)} of {len(rnnt_names)} prediction network / joint tensors"
        )
        for name in ("decoder.onnx", "joiner.onnx"):
            missing[name] = f"the source has {why}: copy the graphs of a bundle of this model"
    write_config(out, spec.onnx_config(ck.prompt_dictionary, ck.default_prompt_id))
    write_melfilters(out, spec, ck.mel_filters)
    if pieces is not None:
        write_tokens_file(out, pieces)
        if sp_bytes is not None:
            (out / "tokenizer.model").write_bytes(sp_bytes)
    else:
        missing["tokens.txt"] = (
            "the source has no tokenizer: pass --tokens tokens.txt or --sentencepiece tokenizer.model"
        )
    return {
        "dir": str(out),
        "source": str(src),
        "source_format": ck.kind,
        "dtype": dtype,
        "encoder_tensors": len(shapes),
        "vocab_size": spec.vocab_size,
        "graph_check_max_rel_err": graph_err,
        "files": sorted(n for n in [*BUNDLE_FILES, "tokenizer.model"] if (out / n).is_file()),
        "missing": missing,
        "notes": ck.notes or [],
    }


def main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if args.quantize is not None:
        return _main_quantize(args, t0)
    if args.bitmap is not None:
        print("ttg export: --bitmap goes with --quantize", file=sys.stderr)
        return 2
    try:
        summary = export(args.src, args.out, args.dtype or "f16", args.tokens, args.sentencepiece)
    except (CheckpointError, ExportError, BundleError) as exc:
        print(f"ttg export: {exc}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(summary, indent=2))
    missing = summary["missing"]
    assert isinstance(missing, dict)
    for name, how in missing.items():
        print(f"ttg export: incomplete bundle: {name} not written ({how})", file=sys.stderr)
    return EXIT_INCOMPLETE if missing else 0


def _main_quantize(args: argparse.Namespace, t0: float) -> int:
    if not args.src.is_dir():
        print(f"ttg export: --quantize reads a bundle directory; {args.src} is not one", file=sys.stderr)
        return 2
    try:
        summary = export_mlx(args.src, args.out, args.quantize, args.bitmap, args.group_size, args.dtype)
    except (MlxExportError, BundleError) as exc:
        print(f"ttg export: {exc}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(summary, indent=2))
    return 0
