"""`ttg make-bundle`: write a complete model bundle with deterministic random weights.

    ttg make-bundle --size tiny --seed 0 --out var/bundles/tiny
    ttg make-bundle --size full --seed 0 --out var/bundles/full --dtype f16
    ttg make-bundle --size tiny --seed 0 --out DIR --from-reference   # weights of the HF reference model

Same arguments, same bytes. `full` has the real 0.6B shapes (642 encoder tensors, vocab 13088, J=640);
`tiny` is a small config for tests. Random weights are calibrated so that greedy decoding emits tokens
at about the rate of conversational speech (see tools/bundle/weights.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.bundle.spec import SPECS
from tools.bundle.weights import DEFAULT_TOKENS_PER_SECOND, random_bundle_weights
from tools.bundle.writer import BundleWeights, write_bundle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=sorted(SPECS), default="tiny", help="model shapes (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    parser.add_argument(
        "--dtype", choices=("f32", "f16", "bf16"), default="f32", help="encoder weights dtype"
    )
    parser.add_argument(
        "--from-reference",
        action="store_true",
        help="take the weights from transformers' Nemotron3_5AsrForRNNT (needs the 'reference' extra)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=DEFAULT_TOKENS_PER_SECOND,
        help=f"token rate random weights are tuned to emit on speech ({DEFAULT_TOKENS_PER_SECOND})",
    )


def make_bundle(
    out: Path,
    size: str,
    seed: int,
    dtype: str = "f32",
    from_reference: bool = False,
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND,
) -> dict[str, object]:
    spec = SPECS[size]
    weights: BundleWeights
    if from_reference:
        from tools.bundle.reference import build_reference_model, reference_bundle_weights

        weights = reference_bundle_weights(build_reference_model(spec, seed, tokens_per_second), spec, seed)
    else:
        weights = random_bundle_weights(spec, seed, tokens_per_second)
    return write_bundle(out, spec, weights, dtype)


def main(args: argparse.Namespace) -> int:
    if not 0.0 < args.tokens_per_second < 12.5:
        print("ttg make-bundle: --tokens-per-second must be between 0 and 12.5", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        summary = make_bundle(
            args.out, args.size, args.seed, args.dtype, args.from_reference, args.tokens_per_second
        )
    except ImportError as exc:
        print(f"ttg make-bundle: --from-reference needs torch and transformers ({exc})", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(summary, indent=2))
    return 0
