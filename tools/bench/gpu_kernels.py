"""Where one encoder step's GPU time goes, kernel by kernel (Nsight Compute on the lent H200).

    source .whl/device_env.sh && ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum --csv --print-units base --log-file $OUT/ncu_512.csv \\
        python3 -m tools.bench.gpu_kernels --batch 512
    python3 -m tools.bench.gpu_kernels --summarize $OUT/ncu_512.csv --steps 2

The first form builds the full-size encoder (random weights at the bundles' scales, f16, lookahead
3; with `--reference`, transformers' streaming step of the same weights in fp16 instead, for the
same breakdown of the other implementation), runs warm-up steps at batch B until the caches are
full, prints the step's wall time without the profiler, then brackets `--steps` steps with
cuProfilerStart/Stop so that `--profile-from-start off` records exactly their kernels. ncu runs the
kernels one at a time, so the sum is the step's GPU time with no overlap (MLX issues a step on one
stream: there is none to lose). The second form groups the recorded kernels by kind (GEMM, copy,
elementwise fused under mx.compile, …) and by name and prints per-step milliseconds, the part of
the whole and the launch count. `--smoke` runs the first form with a tiny config on whatever device
there is (the test suite's CPU), with nothing to bracket. Several `--batch` sizes run one after the
other on one model (without ncu: the step's wall time at each, for one model build).
`--warm-buckets MAX_BATCH` runs only the engine's warm-ups on that model (every batch bucket of the
encoder, every shape of the device decoder), which on CUDA leave the compiled kernels in MLX's cache on
disk for a gateway started next
(`tools/device/h200_run.sh` runs it beside `ttg make-bundle` on a fresh machine).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Kernel kinds by name; first match wins. Names are MLX's CUDA kernels and cuBLAS/CUTLASS GEMMs.
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("gemm", re.compile(r"gemm|sm90_|cutlass|xmma|cublas|matmul", re.I)),
    ("copy", re.compile(r"copy", re.I)),
    ("gather/scatter", re.compile(r"gather|scatter|take|slice_update", re.I)),
    ("layer_norm", re.compile(r"layer_norm|layernorm|rms", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("reduce", re.compile(r"reduce|all_reduce|row_reduce|col_reduce", re.I)),
    ("concatenate", re.compile(r"concat", re.I)),
    ("fused (compiled)", re.compile(r"compiled|fused", re.I)),
    ("elementwise", re.compile(r"binary|unary|ternary|arange|fill", re.I)),
]


UNIT_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3}


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def profile(
    batches: list[int], steps: int, seed: int, smoke: bool, reference: bool, interleave: int = 0
) -> None:
    """Each batch size in turn on one model: the step's wall time, then `steps` bracketed steps (give
    ncu one batch size, or its log holds the kernels of all). Then `interleave` rounds of one step at
    each batch size in turn, as a gateway's engine alternates between sizes: on CUDA, MLX keeps the
    graphs a step records in a cache of limited size, which one size alone may fit and several not."""
    import mlx.core as mx

    from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames
    from tools.bench.encoder import ReferenceStream, default_warmup
    from tools.bench.gpu_encoder import FULL, LOOKAHEAD, PROMPTS, TINY, build_reference, our_weights

    cfg = TINY if smoke else FULL
    model = build_reference(cfg, "cpu", seed)
    factor, n_mels = cfg.subsampling_factor, cfg.n_mels
    rng = np.random.default_rng(seed)
    try:
        cuda: ctypes.CDLL | None = ctypes.CDLL("libcuda.so.1")
    except OSError:
        cuda = None  # no NVIDIA driver (a CPU run): the steps run, nothing brackets them
    sync: Callable[[], None]
    if reference:  # transformers' streaming step, fp16, on the GPU where torch has one
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device, torch.float16)
        sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    else:
        encoder = StreamingEncoder(our_weights(model, cfg, mx.float16), cfg, "f16")
        del model
        sync = mx.synchronize
    timed: list[tuple[str, Callable[[bool], float]]] = []
    all_slots: list[int] = []
    for batch in batches:
        prompts = [PROMPTS[b % len(PROMPTS)] for b in range(batch)]
        run: Callable[[np.ndarray], object]
        slots: list[int] = []
        if reference:
            run = ReferenceStream(model, LOOKAHEAD, prompts).step
        else:
            slots = [encoder.alloc(p, LOOKAHEAD) for p in prompts]

            def ours(mel: np.ndarray, slots: list[int] = slots) -> object:
                return encoder.step([ChunkInput(s, mel[b]) for b, s in enumerate(slots)])

            run = ours
        label = f"{'transformers' if reference else 'ours'} B={batch}"

        def step(first: bool, batch: int = batch, run: Callable[[np.ndarray], object] = run) -> float:
            n = first_chunk_frames(LOOKAHEAD, factor) if first else chunk_frames(LOOKAHEAD, factor)
            mel = rng.standard_normal((batch, n, n_mels), dtype=np.float32)
            t0 = time.perf_counter()
            run(mel)  # both hand the frames back on the host: the step has finished
            return time.perf_counter() - t0

        step(True)
        for _ in range(default_warmup(cfg, LOOKAHEAD) + 4):
            step(False)
        walls = sorted(step(False) for _ in range(10))
        median_ms = 1e3 * walls[len(walls) // 2]
        print(f"{label}: step wall median {median_ms:.2f} ms without the profiler", flush=True)
        if cuda is not None:
            cuda.cuProfilerStart()
        for _ in range(steps):
            step(False)
        sync()
        if cuda is not None:
            cuda.cuProfilerStop()
        done = "profiled" if cuda is not None else "run (no CUDA driver)"
        print(f"{label}: {steps} steps {done}", flush=True)
        timed.append((label, step))
        all_slots += slots
    walls_of: dict[str, list[float]] = defaultdict(list)
    for _ in range(interleave):
        for label, one_step in timed:
            walls_of[label].append(one_step(False))
    for label, walls in walls_of.items():
        walls.sort()
        print(f"{label}: step wall median {1e3 * walls[len(walls) // 2]:.2f} ms interleaved", flush=True)
    for s in all_slots:
        encoder.release(s)


def summarize(path: Path, steps: int, top: int) -> str:
    by_name: dict[str, list[float]] = defaultdict(list)
    with path.open(newline="") as f:
        # ncu writes its own log lines before the CSV header.
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "nsecond")
        if unit not in UNIT_MS:
            raise ValueError(f"{path}: unknown duration unit {unit!r}")
        name = row.get("Kernel Name") or row.get("Function Name") or "?"
        by_name[name].append(float(row["Metric Value"].replace(",", "")) * UNIT_MS[unit])
    total = sum(sum(v) for v in by_name.values())
    by_kind: dict[str, list[float]] = defaultdict(list)
    for name, times in by_name.items():
        by_kind[kind_of(name)].extend(times)
    out = [
        f"{path.name}: {total / steps:.2f} ms of kernels per step, "
        f"{sum(len(v) for v in by_name.values()) / steps:.0f} launches per step",
        "",
        "| kind | ms per step | share | launches per step |",
        "| --- | --- | --- | --- |",
    ]
    for kind, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        out.append(
            f"| {kind} | {sum(times) / steps:.2f} | {sum(times) / total:.0%} | {len(times) / steps:.0f} |"
        )
    out += [
        "",
        "| kernel | ms per step | share | launches per step | mean µs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        out.append(
            f"| `{short}` | {sum(times) / steps:.2f} | {sum(times) / total:.0%} | {len(times) / steps:.0f} | "
            f"{1e3 * sum(times) / len(times):.1f} |"
        )
    return "\n".join(out)


def warm_buckets(max_batch: int, seed: int, smoke: bool) -> None:
    """The engine's own warm-up (`StreamingEncoder.warmup`: every batch bucket up to `max_batch`, lookahead
    3) on random full-size f16 weights. On CUDA, MLX keeps the kernels it compiles on disk (its PTX cache,
    by kernel source, not weights), so a gateway whose engines start afterwards on a bundle of the same
    size finds them there; run beside `ttg make-bundle`, the two costs overlap instead of adding up."""
    import mlx.core as mx

    from asr_core.encoder import StreamingEncoder
    from tools.bench.gpu_encoder import FULL, LOOKAHEAD, TINY, build_reference, our_weights

    cfg = TINY if smoke else FULL
    weights = our_weights(build_reference(cfg, "cpu", seed), cfg, mx.float16)
    encoder = StreamingEncoder(weights, cfg, "f16", compile=True)  # as on a GPU (also on the suite's CPU)
    t0 = time.perf_counter()
    buckets = encoder.warmup(LOOKAHEAD, max_batch)
    seconds = time.perf_counter() - t0
    print(f"warm-up: {buckets} batch buckets up to {max_batch} in {seconds:.1f} s", flush=True)
    # The device decoder's warm-up as the engine runs it (f32, rows up to max_batch, chunks up to 16
    # frames), on random weights of the bundle's shapes: its kernels are the rest of a gateway's start.
    from asr_core.decoder.device import DeviceDecoder
    from asr_core.decoder.numpy_rnnt import RnntWeights
    from tools.bundle.spec import SPECS
    from tools.bundle.weights import random_rnnt_weights

    spec = SPECS["tiny" if smoke else "full"]
    rnnt = RnntWeights.from_torch_names(random_rnnt_weights(spec, seed), spec.decoder_layers)
    decoder = DeviceDecoder(rnnt, spec.blank_id, spec.max_symbols_per_step)
    t0 = time.perf_counter()
    shapes = decoder.warmup(max_rows=max_batch)
    seconds = time.perf_counter() - t0
    print(f"device decoder warm-up: {shapes} shapes up to {max_batch} rows in {seconds:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[512])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", type=Path, default=None, help="an ncu --csv log to summarise")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then ROUNDS rounds of one step at each --batch size in turn (wall time per size)",
    )
    parser.add_argument("--smoke", action="store_true", help="the tiny config (what the test suite runs)")
    parser.add_argument("--reference", action="store_true", help="transformers' step instead of ours")
    parser.add_argument(
        "--warm-buckets",
        type=int,
        default=None,
        metavar="MAX_BATCH",
        help="only the engine's warm-ups (encoder, device decoder) up to MAX_BATCH rows (fills MLX's "
        "kernel cache on disk)",
    )
    args = parser.parse_args(argv)
    if args.summarize is not None:
        print(summarize(args.summarize, args.steps, args.top))
    elif args.warm_buckets is not None:
        warm_buckets(args.warm_buckets, args.seed, args.smoke)
    else:
        profile(args.batch, args.steps, args.seed, args.smoke, args.reference, args.interleave)
    return 0


if __name__ == "__main__":
    sys.exit(main())
