"""`ttg bench batch-parity`: does a stream decode the same alone and as one row of a large batch here?

    ttg bench batch-parity --model DIR --audio DIR [--streams 512] [--precision f16 f32]
        [--decoder-mode device] [--json OUT]

Each audio file (any rate; `ttg transcribe`'s reading) goes through the engine alone, then `--streams`
streams (file i mod n each) go through one engine at once with the scheduler's batch limit at
`--streams`, so that steps carry hundreds of rows. Per precision, printed: how many of the streams' final
token sequences differ from their file's solo run, the steps' mean and largest batch, and for up to
`--examples` differing streams the two texts.

On the CPU in f32 a row's arithmetic does not depend on its batch (the test suite checks batched == solo
to 1e-5). On a GPU in f16 the library picks its GEMM kernels by shape, so the same row may round
differently in a batch of 512 than alone; this program measures whether that changes what is said.
Numbers only: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="bundle directory")
    parser.add_argument("--audio", type=Path, required=True, help="a folder of audio files (*.wav)")
    parser.add_argument("--streams", type=int, default=512, help="streams decoded together (default 512)")
    parser.add_argument(
        "--precision", nargs="+", default=["f16"], choices=["auto", "f32", "f16", "bf16"],
        help="one run per precision (default f16)",
    )  # fmt: skip
    parser.add_argument("--decoder-mode", choices=["workers", "batched", "device"], default="device")
    parser.add_argument("--examples", type=int, default=4, help="differing streams printed (default 4)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")


def _final_tokens(events: list[Any]) -> list[int]:
    from asr_core.api import TranscriptEvent

    return [t for e in events if isinstance(e, TranscriptEvent) and e.kind == "final" for t in e.token_ids]


def _text(events: list[Any]) -> str:
    from asr_core.api import TranscriptEvent

    return " | ".join(e.text for e in events if isinstance(e, TranscriptEvent) and e.kind == "final")


def run(
    model_dir: Path, files: list[Path], streams: int, precision: str, decoder_mode: str
) -> dict[str, Any]:
    """One precision: every file solo, then `streams` streams together; the differences."""
    from asr_core.hooks import NullHooks
    from asr_core.model import AsrModel
    from tools.transcribe import read_audio, transcribe

    audios = [read_audio(f) for f in files]
    model = AsrModel.load(model_dir, precision)
    solo = [
        transcribe(model, [f], [a], language="en-US", lookahead=3, decoder_mode=decoder_mode)[0]
        for f, a in zip(files, audios, strict=True)
    ]
    batch_sizes: list[int] = []

    class Sizes(NullHooks):
        def encoder_step(self, seconds: float, batch_size: int, queue_waits_s: Any) -> None:
            batch_sizes.append(batch_size)

    t0 = time.monotonic()
    together = transcribe(
        model,
        [files[i % len(files)] for i in range(streams)],
        [audios[i % len(files)] for i in range(streams)],
        language="en-US",
        lookahead=3,
        decoder_mode=decoder_mode,
        max_batch=streams,
        hooks=Sizes(),
    )
    wall = time.monotonic() - t0
    differing = [
        {"stream": i, "file": files[k].name, "solo": _text(solo[k]), "batched": _text(ev)}
        for i, ev in enumerate(together)
        if _final_tokens(ev) != _final_tokens(solo[k := i % len(files)])
    ]
    return {
        "precision": model.info.precision,
        "device": model.info.device,
        "streams": streams,
        "files": len(files),
        "solo_final_tokens": {f.name: len(_final_tokens(ev)) for f, ev in zip(files, solo, strict=True)},
        "differing_streams": len(differing),
        "differing_files": sorted({d["file"] for d in differing}),
        "mean_batch": round(sum(batch_sizes) / max(1, len(batch_sizes)), 1),
        "max_batch": max(batch_sizes, default=0),
        "wall_s": round(wall, 1),
        "examples": differing,
    }


def main(args: argparse.Namespace) -> int:
    files = sorted(args.audio.glob("*.wav"))
    if not files:
        print(f"ttg bench batch-parity: no *.wav in {args.audio}", file=sys.stderr)
        return 2
    results = []
    for precision in args.precision:
        r = run(args.model, files, args.streams, precision, args.decoder_mode)
        print(
            f"{r['precision']} on {r['device']}: {r['differing_streams']} of {r['streams']} streams "
            f"differ from their file's solo run (files: {', '.join(r['differing_files']) or 'none'}); "
            f"steps of {r['mean_batch']} rows on average, {r['max_batch']} at most; {r['wall_s']} s",
            flush=True,
        )
        for d in r["examples"][: args.examples]:
            print(f"  stream {d['stream']} ({d['file']})")
            print(f"    solo:    {d['solo']}\n    batched: {d['batched']}")
        r["examples"] = r["examples"][: args.examples]
        results.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0
