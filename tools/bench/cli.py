"""`ttg bench <name> ...` (encoder, engine, engine-procs, decoder, media, sip, sink, channel, gateway,
quant, ttf, vad, batch-parity, speechlike, admission): dispatch to tools/bench/<name>.py (dashes as
underscores).

Each benchmark module defines `add_arguments(parser)` and `main(args) -> int`. Only the chosen one is
imported (like the subcommands of `ttg`), so a benchmark runs on a host that lacks what the others
import (the GPU host has no soxr or pydantic).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

BENCHMARKS: dict[str, tuple[str, str]] = {
    "encoder": ("tools.bench.encoder", "batched MLX encoder step time per batch size (vs the reference)"),
    "engine": ("tools.bench.engine", "real-time-paced synthetic calls through the whole engine"),
    "engine-procs": ("tools.bench.engine_procs", "the engine in its own process fed by front-end processes"),
    "decoder": ("tools.bench.decoder", "RNN-T decoder throughput: per-stream workers vs batched"),
    "media": ("tools.bench.media", "media receive path: per packet, per block, real UDP intake"),
    "sip": ("tools.bench.sip", "SIP parser/core cost and sipp call setup rate against the front end"),
    "sink": ("tools.bench.sink", "Redis sink throughput, publish() cost, spool write and replay"),
    "channel": ("tools.bench.channel", "chunk transport between processes: shared-memory channel vs pipes"),
    "gateway": ("tools.bench.gateway", "whole-gateway load levels: redis + ttg serve + ttg replay, CPU/GPU"),
    "quant": ("tools.bench.quant", "encoder step and weight memory: f16 vs q8 vs mixed68 bundles, same run"),
    "vad": ("tools.bench.vad", "voice activity on telephone audio: end-of-speech latency, misses, splits"),
    "ttf": ("tools.bench.ttf", "time to final through real calls: redis-server + ttg serve + ttg replay"),
    "batch-parity": (
        "tools.bench.batch_parity",
        "a stream's final tokens alone and as one row of a large batch, per precision",
    ),
    "speechlike": (
        "tools.bench.speechlike",
        "tokens/s in speech and in pauses, finals at pauses (espeak-ng)",
    ),
    "admission": (
        "tools.bench.admission",
        "the adaptive call limit against a burst, the engine modelled on a measured one",
    ),
}


def chosen(argv: Sequence[str]) -> str | None:
    """The benchmark named on the command line (the first BENCHMARKS name after `bench`)."""
    args = list(argv)
    start = args.index("bench") + 1 if "bench" in args else 0
    return next((a for a in args[start:] if a in BENCHMARKS), None)


def add_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> None:
    name = chosen(sys.argv[1:] if argv is None else argv)
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for bench, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(bench, help=help_text, description=help_text)
        p.set_defaults(_bench_module=module)
        if bench == name:
            importlib.import_module(module).add_arguments(p)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).main(args) or 0)
