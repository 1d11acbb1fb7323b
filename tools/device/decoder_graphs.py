"""The device decoder alone on full-size random weights: milliseconds per decode and per label-looping
iteration, the rows of each decode alternating as an engine's steps do. One line per run.

MLX reads its CUDA graph settings (`MLX_USE_CUDA_GRAPHS`, `MLX_MAX_OPS_PER_BUFFER`,
`MLX_CUDA_GRAPH_CACHE_SIZE`) once a process, so each setting is a run of its own
(`h200_run.sh decoder` runs the list):

    MLX_USE_CUDA_GRAPHS=0 python3 -m tools.device.decoder_graphs --label "no graphs"
    python3 -m tools.device.decoder_graphs --rows 256 --dtype bf16 --label "bf16, 256 rows"

Random weights emit on most frames (a decode of 4 frames a row then runs its 41 iterations at most);
`--blank-bias` raises the blank's logit so that emissions are sparse: at 2.5, 11 iterations a decode (the
calibrated bundle's decodes take ~4 in the gateway). Kernels compile in the untimed warm-up (minutes on a
fresh machine).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="128,256,448,192", help="rows of each decode in turn (comma list)")
    parser.add_argument("--frames", type=int, default=4, help="frames a row (4: one 320 ms chunk)")
    parser.add_argument("--decodes", type=int, default=40, help="timed decodes")
    parser.add_argument("--blank-bias", type=float, default=2.5)
    parser.add_argument(
        "--dtype", choices=("f32", "bf16", "f16"), default="f32", help="the engine decodes in f32"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)

    import mlx.core as mx

    from asr_core.decoder.device import DeviceDecoder
    from asr_core.decoder.numpy_rnnt import RnntWeights
    from tools.bundle.spec import SPECS
    from tools.bundle.weights import random_rnnt_weights

    spec = SPECS["full"]
    weights = RnntWeights.from_torch_names(random_rnnt_weights(spec, args.seed), spec.decoder_layers)
    weights.head_b[spec.blank_id] += args.blank_bias
    dtype = {"f32": mx.float32, "bf16": mx.bfloat16, "f16": mx.float16}[args.dtype]
    decoder = DeviceDecoder(weights, spec.blank_id, spec.max_symbols_per_step, dtype=dtype, capacity=512)
    rows = [int(r) for r in args.rows.split(",")]
    slots = decoder.alloc_many(max(rows))
    rng = np.random.default_rng(args.seed)
    # Joiner inputs as a calibrated bundle's encoder makes them: mean 0, std 0.5 (tools/bundle/weights.py).
    frames = [(0.5 * rng.standard_normal((args.frames, decoder.width))).astype(np.float32) for _ in slots]

    def run(decodes: int) -> tuple[float, int]:
        start, iterations = time.perf_counter(), decoder.iterations
        for k in range(decodes):
            n = rows[k % len(rows)]
            decoder.decode(slots[:n], frames[:n])
        return time.perf_counter() - start, decoder.iterations - iterations

    warm, _ = run(2 * len(rows))
    seconds, iterations = run(args.decodes)
    print(
        f"{args.label:32s} warm-up {warm:6.1f} s | {1e3 * seconds / args.decodes:7.2f} ms a decode, "
        f"{iterations / args.decodes:5.1f} iterations, {1e3 * seconds / iterations:6.3f} ms an iteration",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
