"""`ttg make-bundle`: write a complete model bundle with deterministic random weights.

    ttg make-bundle --size tiny --seed 0 --out var/bundles/tiny
    ttg make-bundle --size full --seed 0 --out var/bundles/full --dtype f16
    ttg make-bundle --size tiny --seed 0 --out DIR --from-reference   # weights of the HF reference model

Same arguments, same bytes (with `--calibrate speech`: on the same espeak-ng and MLX backend).
`full` has the real 0.6B shapes (642 encoder tensors, vocab 13088, J=640); `tiny` is a small config
for tests. Random weights are calibrated so that greedy decoding emits tokens at about the rate of
conversational speech, by one of two methods (`--calibrate`):

- `probe`: the blank bias tuned on a synthetic speech-like signal (tools/bundle/weights.py). Fast and
  needs nothing, but on real speech the rate and the pauses are whatever the random encoder makes of it.
- `speech`: the weights shaped so that on telephone speech (espeak-ng through G.711, the MLX streaming
  encoder) the model emits `--tokens-per-second` per second of speech, one token at a time, and nothing
  in pauses (tools/bundle/speechlike.py, docs/benchmarks.md). For benchmarks: decode load and
  endpointing like a real model's. Needs espeak-ng and runs the encoder over ~50 s of audio.

The default, `auto`, is `speech` for `--size full` (its only use is benchmarking) and `probe` for
`--size tiny` (tests need no espeak-ng, and their expectations were set with it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tools.bundle.spec import SPECS
from tools.bundle.speech import SpeechError
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
        "--calibrate",
        choices=("auto", "probe", "speech"),
        default="auto",
        help="how random weights are tuned: 'speech' (espeak-ng telephone speech through the encoder), "
        "'probe' (a synthetic signal); auto: speech for full, probe for tiny",
    )
    parser.add_argument(
        "--calibration-precision",
        choices=("f32", "f16", "bf16"),
        default="f32",
        help="MLX precision of the speech calibration's encoder pass (default f32)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=DEFAULT_TOKENS_PER_SECOND,
        help=f"token rate random weights are tuned to emit on speech ({DEFAULT_TOKENS_PER_SECOND})",
    )


def calibration_method(size: str, calibrate: str) -> str:
    if calibrate != "auto":
        return calibrate
    return "speech" if size == "full" else "probe"


def make_bundle(
    out: Path,
    size: str,
    seed: int,
    dtype: str = "f32",
    from_reference: bool = False,
    tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND,
    calibrate: str = "auto",
    calibration_precision: str = "f32",
) -> dict[str, object]:
    spec = SPECS[size]
    weights: BundleWeights
    method = calibration_method(size, calibrate)
    if from_reference:
        if method != "probe":
            raise ValueError("--from-reference bundles are calibrated with the probe (--calibrate probe)")
        from tools.bundle.reference import build_reference_model, reference_bundle_weights

        weights = reference_bundle_weights(build_reference_model(spec, seed, tokens_per_second), spec, seed)
        report: dict[str, object] = {"method": "probe"}
    else:
        weights, report = random_bundle_weights(spec, seed, tokens_per_second, method, calibration_precision)
    summary = write_bundle(out, spec, weights, dtype)
    summary["calibration"] = report
    return summary


def main(args: argparse.Namespace) -> int:
    if not 0.0 < args.tokens_per_second < 12.5:
        print("ttg make-bundle: --tokens-per-second must be between 0 and 12.5", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        summary = make_bundle(
            args.out,
            args.size,
            args.seed,
            args.dtype,
            args.from_reference,
            args.tokens_per_second,
            args.calibrate,
            args.calibration_precision,
        )
    except ImportError as exc:
        print(f"ttg make-bundle: --from-reference needs torch and transformers ({exc})", file=sys.stderr)
        return 2
    except (ValueError, SpeechError) as exc:
        print(f"ttg make-bundle: {exc}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 2)
    print(json.dumps(summary, indent=2))
    return 0
