"""`ttg bench batch-parity`: does a stream decode the same alone and as one row of a large batch here?

    ttg bench batch-parity --model DIR --audio DIR [--streams 512] [--precision f16 f32]
        [--decoder-mode device] [--json OUT]

Each audio file (any rate; `ttg transcribe`'s reading) goes through the engine alone, then `--streams`
streams (file i mod n each) go through one engine at once with the scheduler's batch limit at
`--streams`, so that steps carry hundreds of rows. Per precision, printed: how many of the streams' final
token sequences differ from their file's solo run, the steps' mean and largest batch, and for up to
`--examples` differing streams the two texts. Then the encoder alone (its device defaults: on a GPU
compiled and batch-padded): each file's chunks stepped alone and, for `--streams` streams, every
stream's next chunk in one step; printed: the largest difference of a stream's frames from its file's
solo frames, absolute and relative to the frames' RMS (rounding: ~1e-3 in f16; a wrong row: ~1). Last,
the decoder alone on those solo frames: the device decoder per file and as `--streams` streams at once,
each against the per-stream reference decoder (onnxruntime on the CPU), so that a difference above is
placed in the encoder or in the decoder. The frames are also computed by a plain encoder (not
compiled, not batch-padded) on the same device, alone and batched, and the first file's first chunks
on the CPU, each compared, so that a difference is placed in compilation, padding or the device's
kernels; the reference decoder also decodes each file's batched frames; and one row's matrix product
alone (a matrix-vector kernel) is compared with the same row among eight.

On the CPU a row's arithmetic does not depend on its batch (the test suite checks batched == solo to
1e-5 in f32). On a GPU the libraries pick their kernels by shape (one row or many; f16, or TF32 for
f32), so the same row may round differently in a batch of 512 than alone; this program measures
whether that changes what is said, and how far the frames move. The encoder part runs without the
engine's warm-up: on a fresh GPU machine each new shape compiles first. Numbers only: nothing here
asserts.
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
    frames, solo_chunks, batched_chunks = encoder_frames_parity(model, audios, streams)
    decoding = decoder_parity(model, solo_chunks, batched_chunks, streams)
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
        **frames,
        **decoding,
        "matmul_one_row_vs_eight_rel_diff": matmul_parity(model.info.precision),
        "examples": differing,
    }


def encoder_frames_parity(
    model: Any, audios: list[Any], streams: int, lookahead: int = 3, cpu_chunks: int = 4
) -> tuple[dict[str, Any], list[list[Any]], list[list[Any]]]:
    """Each audio's chunks through the encoder alone, then `streams` streams (audio i mod n) stepped
    together, with the engine's encoder (on a GPU: compiled, batch-padded) and with a plain one (neither)
    on the same device; and the first audio's first `cpu_chunks` chunks alone on the CPU (the reference:
    no GPU kernel). Returns each comparison's largest difference (absolute, relative to the frames'
    RMS, and the first chunk that differs by more than 1 % of it), each audio's engine frames alone and
    each stream's in the batch, chunk by chunk."""
    import mlx.core as mx

    prompt = model.prompt_id("en-US")

    def chunks(audio: Any) -> list[tuple[Any, bool]]:
        front = model.new_frontend(lookahead)
        out = front.push(audio)
        rest, last_is_final = front.finish()
        out += rest
        return [(c, last_is_final and i == len(out) - 1) for i, c in enumerate(out)]

    cut = [chunks(a) for a in audios]

    def together(encoder: Any, cuts: list[list[tuple[Any, bool]]]) -> list[list[Any]]:
        """The streams' chunks stepped together (each step: every stream's next chunk), their frames."""
        slots = [encoder.alloc(prompt, lookahead) for _ in cuts]
        got: list[list[Any]] = [[] for _ in cuts]
        for k in range(max(len(cs) for cs in cuts)):
            rows = [(i, cs[k]) for i, cs in enumerate(cuts) if k < len(cs)]
            frames = encoder.step([(slots[i], c, last, False) for i, (c, last) in rows])
            for (i, _), f in zip(rows, frames, strict=True):
                got[i].append(f)
        for slot in slots:
            encoder.release(slot)
        return got

    def solo(encoder: Any, cuts: list[list[tuple[Any, bool]]]) -> list[list[Any]]:
        return [together(encoder, [cs])[0] for cs in cuts]

    def batched(encoder: Any) -> list[list[Any]]:
        return together(encoder, [cut[i % len(cut)] for i in range(streams)])

    engine = model.create_encoder()
    engine_solo, engine_batched = solo(engine, cut), batched(engine)
    plain = model.create_encoder(compile=False)
    plain_solo, plain_batched = solo(plain, cut), batched(plain)
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        (cpu,) = solo(model.create_encoder(compile=False), [cut[0][:cpu_chunks]])
    finally:
        mx.set_default_device(device)
    n = len(cut)
    pairs = {
        "engine batched vs engine solo": [(engine_batched[i], engine_solo[i % n]) for i in range(streams)],
        "plain solo vs engine solo": list(zip(plain_solo, engine_solo, strict=True)),
        "plain batched vs plain solo": [(plain_batched[i], plain_solo[i % n]) for i in range(streams)],
        "engine solo vs cpu": [(engine_solo[0], cpu)],
        "engine batched vs cpu": [(engine_batched[0], cpu)],
        "plain solo vs cpu": [(plain_solo[0], cpu)],
    }
    frames = {name: _frames_diff(p) for name, p in pairs.items()}
    worst = frames["engine batched vs engine solo"]
    summary = {"frames_max_abs_diff": worst["abs"], "frames_max_rel_diff": worst["rel"], "frames": frames}
    return summary, engine_solo, engine_batched


def _frames_diff(pairs: list[tuple[list[Any], list[Any]]]) -> dict[str, Any]:
    """The largest difference of frames from their reference over (chunks, reference chunks) pairs
    (the common chunks), absolute and relative to the reference's RMS, and the first chunk index at
    which any pair differs by more than 1 % of that RMS (None: none)."""
    import numpy as np

    worst_abs = worst_rel = 0.0
    first: int | None = None
    for got, ref in pairs:
        k = min(len(got), len(ref))
        rms = max(1e-12, float(np.sqrt(np.mean(np.concatenate(ref[:k]).astype(np.float64) ** 2))))
        for j in range(k):
            diff = float(np.abs(got[j].astype(np.float64) - ref[j]).max(initial=0.0))
            worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / rms)
            if diff > 0.01 * rms and (first is None or j < first):
                first = j
    return {"abs": worst_abs, "rel": worst_rel, "first_chunk_over_1pct": first}


def matmul_parity(precision: str) -> dict[str, float]:
    """One row times a matrix alone (M = 1: libraries pick a matrix-vector kernel) against the same row
    inside M = 8 rows, for the shapes of the prediction network and joint (random values), in f32 and in
    `precision`: the largest difference relative to the product's RMS. Rounding: ~1e-7 (f32), ~1e-3
    (f16); a kernel that is wrong for one shape: ~1."""
    import mlx.core as mx
    import numpy as np

    from asr_core.bundle import PRECISIONS

    rng = np.random.default_rng(0)
    out = {}
    for name in sorted({"f32", precision}):
        dtype, worst = PRECISIONS[name], 0.0
        for k, n in ((640, 2560), (640, 640), (640, 1025), (1024, 4096)):
            w = mx.array(rng.standard_normal((k, n)) / np.sqrt(k), dtype=dtype)
            x = mx.array(rng.standard_normal((8, k)), dtype=dtype)
            one, many = (x[:1] @ w).astype(mx.float32), (x @ w)[:1].astype(mx.float32)
            rms = mx.sqrt(mx.mean(many * many))
            worst = max(worst, float(np.array(mx.max(mx.abs(one - many)) / rms)))
        out[name] = worst
    return out


def decoder_parity(
    model: Any, solo_chunks: list[list[Any]], batched_chunks: list[list[Any]], streams: int
) -> dict[str, Any]:
    """The same encoder frames (each file's solo frames, chunk by chunk) through the device decoder
    alone and as `streams` streams decoded together, and through the per-stream reference decoder
    (onnxruntime on the CPU): how many streams' tokens differ from the reference either way. And the
    reference decoder on each file's first stream's frames from the batch: whether the encoder's
    batched frames alone change the tokens."""

    def ids(tokens: list[Any]) -> list[int]:
        return [int(t.id) for t in tokens]

    def reference_tokens(chunks: list[Any]) -> list[int]:
        dec, first, out = model.new_decoder(), 0, []
        state = dec.new_state()
        for f in chunks:
            out += ids(dec.decode(state, f, first))
            first += f.shape[0]
        return out

    reference = [reference_tokens(chunks) for chunks in solo_chunks]
    n = len(solo_chunks)
    from_batch = [reference_tokens(batched_chunks[i]) for i in range(min(n, streams))]
    device = model.new_device_decoder()

    def device_tokens(streams_chunks: list[list[Any]]) -> list[list[int]]:
        """The streams decoded together by the device decoder (each call: every stream's next chunk)."""
        slots = device.alloc_many(len(streams_chunks))
        out: list[list[int]] = [[] for _ in streams_chunks]
        firsts = [0] * len(streams_chunks)
        for k in range(max(len(c) for c in streams_chunks)):
            rows = [i for i, c in enumerate(streams_chunks) if k < len(c)]
            frames = [streams_chunks[i][k] for i in rows]
            decoded = device.decode([slots[i] for i in rows], frames, [firsts[i] for i in rows])
            for i, tokens, f in zip(rows, decoded, frames, strict=True):
                out[i] += ids(tokens)
                firsts[i] += f.shape[0]
        for slot in slots:
            device.release(slot)
        return out

    device_solo = [device_tokens([chunks])[0] for chunks in solo_chunks]
    together = device_tokens([solo_chunks[i % n] for i in range(streams)])
    return {
        "decoder_device_solo_vs_reference": sum(a != b for a, b in zip(device_solo, reference, strict=True)),
        "decoder_device_batched_vs_reference": sum(together[i] != reference[i % n] for i in range(streams)),
        "reference_on_batched_frames_vs_solo_frames": sum(
            a != b for a, b in zip(from_batch, reference, strict=False)
        ),
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
            f"steps of {r['mean_batch']} rows on average, {r['max_batch']} at most; {r['wall_s']} s; "
            f"encoder frames batched vs solo: max |diff| {r['frames_max_abs_diff']:.3g}, "
            f"{r['frames_max_rel_diff']:.3g} of their RMS; the same frames decoded, streams whose tokens "
            f"differ from the reference decoder's: device solo {r['decoder_device_solo_vs_reference']} of "
            f"{r['files']}, device batched {r['decoder_device_batched_vs_reference']} of {r['streams']}; "
            f"the reference decoder on batched frames vs on solo frames: "
            f"{r['reference_on_batched_frames_vs_solo_frames']} of {min(r['files'], r['streams'])} files "
            f"differ; one row alone vs in eight rows, a matrix product's largest difference relative "
            f"to its RMS: {r['matmul_one_row_vs_eight_rel_diff']}",
            flush=True,
        )
        for name, d in r["frames"].items():
            print(
                f"  frames, {name}: max |diff| {d['abs']:.3g}, {d['rel']:.3g} of the reference's RMS, "
                f"first chunk beyond 1 %: {d['first_chunk_over_1pct']}"
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
