"""`ttg bench quant`: encoder step and weight memory of one model as f16 vs q8 vs mixed68, same run.

    python3 -m tools.bench.quant [--size full] [--batch 1 128 512] [--schemes f16 q8 mixed68]

1. writes the five-file bundle of a random model (`--size`, f16, uncalibrated weights: the step's
   work does not depend on their values) under `--work`, unless it is there already (or takes the
   bundle `--source`, e.g. the demo model);
2. exports it with `ttg export --quantize q8` and `--quantize mixed68` (tools/bundle/mlx_export.py):
   mlx-audio-layout bundles on disk;
3. loads every scheme with `load_bundle` and builds its `StreamingEncoder` (all at `--precision`:
   auto = f16 on a GPU, f32 on the CPU, so the schemes differ only in their weights; packed codes
   stay packed on a GPU, the CPU dequantizes them unless `--packed on`), measuring the
   weight bytes on the device (the encoder's arrays; packed codes at their packed size) and the MLX
   memory still held once the loaded bundle is dropped (weights, position tables, an 8-slot pool);
4. for each B: B streams per scheme at lookahead 3; a first chunk, `--warmup` later chunks (the
   attention caches fill; on a GPU the first step also compiles the kernels), then `--steps` timed
   later chunks, the schemes in turn on the same mel within every step (the order rotates), each step
   one `StreamingEncoder.step` (host mel in, every row's joiner frames back on the host).

Prints markdown tables as it goes and writes `quant.json` + `quant.md` to `--out` (default $OUT,
else var/bench). Stops starting new batch sizes after `--budget-s`. Imports only what the GPU host
has (numpy, MLX, onnx, onnxruntime, ml_dtypes) and the project's own code.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from asr_core import configure_process

if __name__ == "__main__":  # run as a program on a CPU: OpenBLAS under MLX, before mlx.core loads
    configure_process()
import mlx.core as mx

from asr_core.bundle import load_bundle, on_gpu
from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames
from asr_core.encoder.layers import weight_nbytes
from tools.bench.encoder import Timing, environment, log_line
from tools.bundle.mlx_export import export_mlx
from tools.bundle.spec import SPECS
from tools.bundle.weights import random_encoder_tensors, random_rnnt_weights
from tools.bundle.writer import BundleWeights, write_bundle

SCHEMES = ("f16", "q8", "mixed68")
LOOKAHEAD = 3
PROMPTS = (0, 19, 101)  # rows of one step speak different languages, as calls do


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=tuple(SPECS), default="full", help="model size (full)")
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        help="an existing bundle as the f16 scheme instead of a random one",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 128, 512], help="batch sizes (1 128 512)")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--precision", choices=("auto", "f32", "f16", "bf16"), default="auto")
    parser.add_argument(
        "--packed",
        choices=("auto", "on", "off"),
        default="auto",
        help="multiply with the packed codes (auto: on a GPU; the CPU dequantizes them once)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per batch size (20)")
    parser.add_argument("--warmup", type=int, default=15, help="untimed later chunks first (15)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttg-quant-bench"), help="bundles go here")
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default: $OUT, else var/bench)"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new batch size after this")
    parser.add_argument("--seed", type=int, default=0)


def make_bundles(
    size: str, seed: int, work: Path, schemes: list[str], source: Path | None
) -> dict[str, Path]:
    spec = SPECS[size]
    f16 = source or work / f"{size}-f16"
    if source is None and not (f16 / "joiner.onnx").is_file():
        t0 = time.monotonic()
        rnnt = random_rnnt_weights(spec, seed)
        weights = BundleWeights(lambda: random_encoder_tensors(spec, seed), rnnt, {"weights": "random"})
        write_bundle(f16, spec, weights, "f16")
        log_line(f"wrote {f16} ({_mb(f16)} MB) in {time.monotonic() - t0:.0f} s")
    out = {"f16": f16}
    for scheme in schemes:
        if scheme == "f16":
            continue
        d = work / f"{source.name if source else size}-{scheme}"
        if not (d / "model.safetensors").is_file():
            t0 = time.monotonic()
            try:
                summary = export_mlx(f16, d, scheme)
            except Exception as e:  # reported; the other schemes still run
                log_line(f"export {scheme}: FAILED {type(e).__name__}: {e}")
                continue
            log_line(
                f"exported {scheme}: {summary['quantized_modules']} modules {summary['by_bits']} bits, "
                f"{_mb(d)} MB, in {time.monotonic() - t0:.0f} s"
            )
        out[scheme] = d
    return out


def _mb(d: Path) -> int:
    return round(sum(f.stat().st_size for f in d.iterdir() if f.is_file()) / 1e6)


def load_encoder(
    path: Path, precision: str, unpack: bool | None
) -> tuple[StreamingEncoder, int, dict[str, Any]]:
    """The bundle's encoder; the memory MLX still holds for it once the bundle itself is dropped."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    bundle = load_bundle(path, precision)
    enc = StreamingEncoder(
        bundle.encoder_weights, bundle.config.encoder, precision, capacity=8, unpack=unpack
    )
    info = {"layout": bundle.layout, "quantized_modules": len(bundle.quantized), "packed": not enc.unpacked}
    n_mels = bundle.config.encoder.n_mels
    del bundle
    gc.collect()
    mx.clear_cache()
    info["weight_bytes"] = weight_nbytes(enc.params)
    info["active_memory_growth_bytes"] = mx.get_active_memory() - before
    return enc, n_mels, info


def run_batch(
    encoders: dict[str, StreamingEncoder],
    n_mels: int,
    batch: int,
    steps: int,
    warmup: int,
    rng: np.random.Generator,
) -> dict[str, dict[str, Any]]:
    """One batch size, the schemes in turn on the same mel; a scheme that fails (a kernel the device
    lacks, memory) is reported with its error and the others go on."""
    prompts = [PROMPTS[b % len(PROMPTS)] for b in range(batch)]
    slots = {name: [enc.alloc(p, LOOKAHEAD) for p in prompts] for name, enc in encoders.items()}
    times: dict[str, list[float]] = {name: [] for name in encoders}
    first: dict[str, float] = {}
    errors: dict[str, str] = {}
    names = list(encoders)
    try:
        for i in range(1 + warmup + steps):
            n = first_chunk_frames(LOOKAHEAD) if i == 0 else chunk_frames(LOOKAHEAD)
            mel = rng.standard_normal((batch, n, n_mels), dtype=np.float32)
            for name in names[i % len(names) :] + names[: i % len(names)]:
                if name in errors:
                    continue
                rows = [ChunkInput(s, mel[b]) for b, s in enumerate(slots[name])]
                t0 = time.perf_counter()
                try:
                    encoders[name].step(rows)
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
                    log_line(f"{name} B={batch}: FAILED {errors[name]}")
                    continue
                dt = time.perf_counter() - t0
                if i == 0:
                    first[name] = dt
                elif i > warmup:
                    times[name].append(dt)
    finally:
        for name, enc in encoders.items():
            for s in slots[name]:
                enc.release(s)
    return {
        name: {"batch": batch, "error": errors[name]}
        if name in errors
        else {"batch": batch, "first_step_s": first[name], **asdict(Timing.of(times[name]))}
        for name in encoders
    }


def tables(memory: dict[str, dict[str, Any]], rows: list[dict[str, dict[str, Any]]], names: list[str]) -> str:
    base = names[0]
    lines = [
        "| scheme | layout | quantized modules | weights on the device | MLX memory held by the encoder |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        m = memory[n]
        lines.append(
            f"| {n} | {m['layout']} | {m['quantized_modules']} | {m['weight_bytes'] / 1e6:.1f} MB "
            f"({m['weight_bytes'] / memory[base]['weight_bytes']:.2f}) | "
            f"{m['active_memory_growth_bytes'] / 1e6:.1f} MB |"
        )
    lines += [
        "",
        "| B | "
        + " | ".join(f"{n} median ms (p90)" for n in names)
        + " | "
        + " | ".join(f"{n} / {base}" for n in names[1:])
        + " |",
        "|---|" + "---|" * (2 * len(names) - 1),
    ]
    for row in rows:
        b = row[base]["batch"]
        ok = {n for n in names if "median_ms" in row[n]}
        cells = [
            f"{row[n]['median_ms']:.2f} ({row[n]['p90_ms']:.2f})" if n in ok else "failed" for n in names
        ]
        ratios = [
            f"{row[n]['median_ms'] / row[base]['median_ms']:.2f}" if {n, base} <= ok else "—"
            for n in names[1:]
        ]
        lines.append(f"| {b} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    out_dir = args.out or Path(os.environ.get("OUT", "var/bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in SCHEMES if s in args.schemes]
    precision = args.precision if args.precision != "auto" else ("f16" if on_gpu() else "f32")
    env = environment()
    log_line(f"start: {json.dumps(env)}; precision {precision}")
    paths = make_bundles(args.size, args.seed, args.work, names, args.source)

    encoders: dict[str, StreamingEncoder] = {}
    memory: dict[str, dict[str, Any]] = {}
    n_mels = 0
    unpack = None if args.packed == "auto" else args.packed == "off"
    for name in [n for n in names if n in paths]:
        t0 = time.monotonic()
        try:
            encoders[name], n_mels, memory[name] = load_encoder(paths[name], precision, unpack)
        except Exception as e:  # reported; the other schemes still run
            log_line(f"load {name}: FAILED {type(e).__name__}: {e}")
            continue
        m = memory[name]
        log_line(
            f"{name}: {m['layout']} layout, {m['quantized_modules']} quantized modules, weights "
            f"{m['weight_bytes'] / 1e6:.1f} MB on the device (loaded in {time.monotonic() - t0:.0f} s)"
        )

    rng = np.random.default_rng(args.seed)
    rows: list[dict[str, dict[str, Any]]] = []
    skipped: list[int] = []
    names = list(encoders)

    def write_report() -> str:
        """quant.json + quant.md with what is measured so far (also after each batch size)."""
        text = tables(memory, rows, names)
        report = {
            "command": "python3 -m tools.bench.quant " + " ".join(sys.argv[1:]),
            "environment": env,
            "size": args.size,
            "source": str(args.source) if args.source else None,
            "precision": precision,
            "packed": args.packed,
            "lookahead": LOOKAHEAD,
            "steps": args.steps,
            "warmup": args.warmup,
            "memory": memory,
            "results": rows,
            "skipped_batches": skipped,
            "elapsed_s": time.monotonic() - t_start,
        }
        (out_dir / "quant.json").write_text(json.dumps(report, indent=2))
        (out_dir / "quant.md").write_text(text + "\n")
        return text

    for b in args.batch:
        if time.monotonic() - t_start > args.budget_s:
            skipped.append(b)
            log_line(f"B={b}: skipped (time budget)")
            continue
        t0 = time.monotonic()
        row = run_batch(encoders, n_mels, b, args.steps, args.warmup, rng)
        rows.append(row)
        done = [n for n in names if "median_ms" in row[n]]
        log_line(
            f"B={b} ({time.monotonic() - t0:.0f} s): "
            + ", ".join(
                f"{n} {row[n]['median_ms']:.2f} ms (first {row[n]['first_step_s']:.1f} s)" for n in done
            )
        )
        write_report()
    print(write_report(), flush=True)
    log_line(f"wrote {out_dir / 'quant.json'} and quant.md ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
