"""`ttg transcribe`: stream audio files through the engine and print their transcripts.

    ttg transcribe --model DIR [--lang en-US] [--lookahead 3] [--precision auto] [--partials] FILE...

Each file (wav/flac/anything libsndfile reads; any rate and channel count -> 16 kHz mono with soxr)
is pushed through the engine in real chunk order, in 100 ms blocks, as fast as the engine takes it:
the reader waits while the stream's backlog is high, so no chunk is ever dropped and the output is
deterministic. Several files run as concurrent streams (batched in the encoder) and print in order.
Without --model: TTG_MODEL__DIR (alias NEMO_MODEL_DIR, as `ttg serve` reads it), else the embedded
demo model, or (until it ships) a tiny random bundle generated into a cache directory, whose
transcripts are meaningless (a warning says so). Any layout the loader reads works (README, "Models").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import numpy as np

BLOCK_MS = 100
BACKLOG_LIMIT = 8  # chunks; below the engine's queue bound, so the file reader never causes a drop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="audio files (wav, flac, ...)")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model bundle directory (default: TTG_MODEL__DIR, else the demo model)",
    )
    parser.add_argument("--lang", default="en-US", help="language prompt (a bundle locale or 'auto')")
    parser.add_argument("--lookahead", type=int, default=None, help="encoder lookahead in 80 ms frames")
    parser.add_argument("--precision", default="auto", choices=["auto", "f32", "f16", "bf16"])
    parser.add_argument("--partials", action="store_true", help="print partial transcripts as they grow")
    parser.add_argument("--segments", action="store_true", help="print each final segment with its times")
    parser.add_argument("--json", action="store_true", help="print every event as a JSON line")
    parser.add_argument(
        "--vad",
        choices=["webrtc", "energy", "off"],
        default=None,
        help="endpointing VAD (default: the engine's, as `ttg serve`; off: token silence only)",
    )
    parser.add_argument(
        "--decoder-mode",
        choices=["workers", "batched"],
        default=None,
        help="decoder mode (default: engine's)",
    )


def read_audio(path: Path) -> np.ndarray:
    """Any file libsndfile reads -> float32 mono 16 kHz in [-1, 1]."""
    import soundfile as sf
    import soxr

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != 16_000:
        mono = soxr.resample(mono, rate, 16_000, "HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


def cli_model_dir(model: Path | None) -> Path:
    """The model of `ttg transcribe`/`ttg eval`: --model, else TTG_MODEL__DIR (as `ttg serve` reads
    it), else `default_model_dir()`."""
    from gateway.config import Settings

    if model is not None:
        return model
    configured = Settings().model.dir
    return Path(configured).expanduser() if configured else default_model_dir()


def default_model_dir(err: TextIO = sys.stderr) -> Path:
    """The embedded demo model, else a cached tiny random bundle (with a loud warning)."""
    from asr_core.model import embedded_model_dir

    embedded = embedded_model_dir()
    if embedded is not None:
        return embedded
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ttg" / "tiny-random-bundle-seed0"
    )
    if not (cache / "nemotron_onnx_config.json").exists():
        from tools.make_bundle import make_bundle

        make_bundle(cache, "tiny", 0)
    print(
        "WARNING: no --model and no embedded demo model: using a TINY RANDOM bundle "
        f"({cache}); its transcripts are MEANINGLESS. Pass --model DIR for real output.",
        file=err,
    )
    return cache


class _FileStream:
    def __init__(self, path: Path, audio: np.ndarray) -> None:
        self.path = path
        self.audio = audio
        self.events: list[Any] = []
        self.done = threading.Event()


def transcribe(
    model: Any,
    files: list[Path],
    audios: list[np.ndarray],
    *,
    language: str | list[str],
    lookahead: int | None,
    decoder_mode: str | None = None,
    on_event: Any = None,
    vad: str | None = None,
    endpoint: Any = None,
    max_batch: int | None = None,
    hooks: Any = None,
) -> list[list[Any]]:
    """Run the files as concurrent streams; returns each file's events (StreamEnded last).

    `language`: one for all files or one per file; `endpoint`: an `EndpointConfig` (default: the
    engine's); `max_batch`: the scheduler's rows a step (default: the engine's); `hooks`: the engine's
    `EngineHooks`."""
    from asr_core.api import StreamEnded, StreamOptions
    from asr_core.config import DecoderConfig, EndpointConfig, EngineConfig, SchedulerConfig
    from asr_core.engine import AsrEngine
    from asr_core.vad import VadConfig

    decoder = DecoderConfig() if decoder_mode is None else DecoderConfig(mode=decoder_mode)  # type: ignore[arg-type]
    # A queue bound well above the reader's backlog limit: the file reader, not the drop policy, paces.
    scheduler = SchedulerConfig(max_queued_chunks=4 * BACKLOG_LIMIT)
    if max_batch is not None:
        scheduler = dataclasses.replace(scheduler, max_batch=max_batch)
    config = EngineConfig(
        scheduler=scheduler,
        decoder=decoder,
        vad=VadConfig() if vad is None else VadConfig(kind=vad),  # type: ignore[arg-type]
        endpoint=EndpointConfig() if endpoint is None else endpoint,
    )
    languages = [language] * len(files) if isinstance(language, str) else list(language)
    jobs = [_FileStream(p, a) for p, a in zip(files, audios, strict=True)]

    def callback(job: _FileStream) -> Any:
        def cb(ev: Any) -> None:
            job.events.append(ev)
            if on_event is not None:
                on_event(job.path, ev)
            if isinstance(ev, StreamEnded):
                job.done.set()

        return cb

    block = 16_000 * BLOCK_MS // 1000
    with AsrEngine(model, config, hooks) as engine:
        streams = [
            engine.open_stream(str(j.path), StreamOptions(language=lang, lookahead=lookahead), callback(j))
            for j, lang in zip(jobs, languages, strict=True)
        ]
        pos = [0] * len(jobs)
        active = set(range(len(jobs)))
        while active:
            progressed = False
            for i in sorted(active):
                if streams[i].backlog >= BACKLOG_LIMIT:
                    continue
                streams[i].push(jobs[i].audio[pos[i] : pos[i] + block])
                pos[i] += block
                progressed = True
                if pos[i] >= len(jobs[i].audio):
                    streams[i].finish()
                    active.discard(i)
            if not progressed:
                time.sleep(0.002)
        for j in jobs:
            j.done.wait()
    return [j.events for j in jobs]


def main(args: argparse.Namespace) -> int:
    from asr_core.api import StreamEnded, TranscriptEvent
    from asr_core.model import AsrModel

    audios = []
    for path in args.files:
        try:
            audios.append(read_audio(path))
        except Exception as e:
            print(f"ttg transcribe: cannot read {path}: {e}", file=sys.stderr)
            return 2
    model_dir = cli_model_dir(args.model)
    try:
        model = AsrModel.load(model_dir, args.precision)
    except Exception as e:
        print(f"ttg transcribe: cannot load the model: {e}", file=sys.stderr)
        return 2
    lock = threading.Lock()
    many = len(args.files) > 1

    def live(path: Path, ev: Any) -> None:
        with lock:
            if args.json:
                print(json.dumps({"file": str(path), "event": type(ev).__name__, **asdict(ev)}), flush=True)
            elif args.partials and isinstance(ev, TranscriptEvent) and ev.kind == "partial":
                print(f"{path}: ~ {ev.text}" if many else f"~ {ev.text}", flush=True)

    try:
        results = transcribe(
            model,
            list(args.files),
            audios,
            language=args.lang,
            lookahead=args.lookahead,
            decoder_mode=args.decoder_mode,
            on_event=live,
            vad=args.vad,
        )
    except ValueError as e:  # unknown language, unsupported lookahead
        print(f"ttg transcribe: {e}", file=sys.stderr)
        return 2
    status = 0
    for path, events in zip(args.files, results, strict=True):
        finals = [e for e in events if isinstance(e, TranscriptEvent) and e.kind == "final"]
        end = events[-1]
        assert isinstance(end, StreamEnded)
        if end.reason != "finished":
            print(f"ttg transcribe: {path}: stream ended with {end.reason}: {end.error}", file=sys.stderr)
            status = 1
        if args.json:
            continue
        if args.segments:
            if many:
                print(f"== {path}")
            for f in finals:
                print(f"[{f.start_ms / 1000:.2f}-{f.end_ms / 1000:.2f}] {f.text}")
        else:
            text = " ".join(f.text for f in finals)
            print(f"{path}: {text}" if many else text)
    return status
