"""Voice activity on telephone audio: how fast and how reliably each VAD says "the caller stopped".

    ttg bench vad [--set var/demo/test] [--calls 40] [--hangover-ms 200] [--silero-onnx FILE]
                  [--json OUT]

Calls are built from the held-out clips of `--set` (condition `test`: espeak-ng speech through a
G.711 round trip with 0.3-0.6 s of line silence on each side): `--clips` clips back to back per
call. The truth is replay's energy rule (tools/replay/audio.py: 10 ms frames, speech at most 35 dB
below the loudest frame, runs under 60 ms ignored) on the clean clip, the same end of speech that
`ttg replay` measures time to final from. Each call is then played in every line condition (clean,
white/pink/hum noise at an SNR to the speech RMS), G.711 µ-law round trip, 8 -> 16 kHz with soxr HQ
(the gateway's filter), and fed in 80 ms pushes (the gateway's block) to `SpeechEndDetector` with
each frame classifier. Per VAD and condition:

- end latency: from the true end of an utterance to the VAD's decision (hang-over included);
- missed: utterances whose end was not decided before the next one began (two merged into one);
- splits: ends decided inside an utterance (a pause between words longer than the hang-over);
- false ends: further ends in the silence between utterances (noise taken for speech, then lost);
- cost: classifier CPU time per second of audio.

`--silero-onnx` adds Silero VAD (the `silero_vad.onnx` of its PyPI package, through onnxruntime;
32 ms windows with 64 samples of context, speech at probability >= 0.5) for comparison.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soxr

from asr_core.vad import (
    EnergyClassifier,
    FrameClassifier,
    SpeechEndDetector,
    VadConfig,
    WebRtcClassifier,
)

RATE_8K, RATE_16K = 8000, 16000
PUSH_SAMPLES = RATE_16K * 80 // 1000
CONDITIONS: dict[str, tuple[str | None, float]] = {
    "clean": (None, 0.0),
    "white 25 dB": ("white", 25.0),
    "pink 20 dB": ("pink", 20.0),
    "hum 20 dB": ("hum", 20.0),
    "white 15 dB": ("white", 15.0),
    "pink 10 dB": ("pink", 10.0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", type=Path, default=Path("var/demo/test"), help="held-out set (manifest.jsonl)")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--clips", type=int, default=5, help="clips per call")
    p.add_argument("--hangover-ms", type=int, default=200)
    p.add_argument("--min-speech-ms", type=int, default=60)
    p.add_argument("--energy-db", type=float, default=-45.0)
    p.add_argument("--webrtc-modes", default="1,2,3")
    p.add_argument("--silero-onnx", type=Path, default=None)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)


class SileroClassifier:
    """Silero VAD v5 over onnxruntime: one window of 512 samples (+64 of context) per 32 ms; each
    10 ms frame gets the probability of the newest complete window."""

    def __init__(self, path: Path, threshold: float = 0.5) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self._sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(64, np.float32)
        self._pending = np.zeros(0, np.float32)
        self._prob = 0.0
        self._threshold = threshold
        self._sr = np.array(RATE_16K, np.int64)

    def speech(self, frames: np.ndarray) -> np.ndarray:
        return np.array([self._frame(f) for f in frames], bool)

    def _frame(self, frame: np.ndarray) -> bool:
        self._pending = np.concatenate([self._pending, frame])
        while self._pending.size >= 512:
            window = np.concatenate([self._context, self._pending[:512]])[None]
            out, self._state = self._sess.run(None, {"input": window, "state": self._state, "sr": self._sr})
            self._prob = float(out.reshape(-1)[0])
            self._context = window[0, -64:]
            self._pending = self._pending[512:]
        return self._prob >= self._threshold


@dataclass(frozen=True, slots=True)
class Call:
    pcm8k: np.ndarray  # float32, clean line
    spans: list[tuple[int, int]]  # true utterances, 8 kHz samples


def build_calls(args: argparse.Namespace) -> list[Call]:
    import soundfile as sf

    from tools.eval import load_manifest
    from tools.replay.audio import speech_segments, to_int16

    entries = [e for e in load_manifest(args.set) if e.extra.get("condition") == "test"]
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(entries))
    calls = []
    for c in range(args.calls):
        parts, spans, offset = [], [], 0
        for k in range(args.clips):
            e = entries[order[(c * args.clips + k) % len(entries)]]
            pcm, rate = sf.read(str(e.audio), dtype="float32")
            assert rate == RATE_8K, e.audio
            segs = speech_segments(to_int16(pcm), pause_ms=600)
            if segs:
                start, end = segs[0].start_ms, segs[-1].end_ms
                spans.append((offset + start * 8, offset + end * 8))
            parts.append(pcm)
            offset += pcm.size
        calls.append(Call(np.concatenate(parts), spans))
    return calls


def line(call: Call, condition: str, rng: np.random.Generator) -> np.ndarray:
    """The call as the gateway hears it: noise, G.711 µ-law, 16 kHz."""
    from tools.demo_model import augment

    kind, snr = CONDITIONS[condition]
    x = call.pcm8k
    if kind is not None:
        speech = np.concatenate([x[a:b] for a, b in call.spans])
        x = augment.add_noise(x, rng, snr, RATE_8K, kind=kind, speech_rms=augment.rms(speech))
    x = augment.g711_round_trip(x, "ulaw")
    return soxr.resample(x, RATE_8K, RATE_16K, "HQ").astype(np.float32)


@dataclass(slots=True)
class Score:
    delays_ms: list[float] = field(default_factory=list)
    missed: int = 0
    splits: int = 0
    false_ends: int = 0


def score(call: Call, ends: list[tuple[int, int]], into: Score) -> None:
    """Match decisions (16 kHz samples) against the true spans (8 kHz samples)."""
    spans = [(2 * a, 2 * b) for a, b in call.spans]
    for i, (a, b) in enumerate(spans):
        nxt = spans[i + 1][0] if i + 1 < len(spans) else 10**12
        into.splits += sum(1 for _, d in ends if a < d <= b)
        after = [d for _, d in ends if b < d <= nxt]
        if after:
            into.delays_ms.append((after[0] - b) / 16.0)
            into.false_ends += len(after) - 1
        else:
            into.missed += 1


def run_vad(make: Callable[[], FrameClassifier], pcm: np.ndarray, cfg: VadConfig) -> tuple[list[Any], float]:
    det = SpeechEndDetector(cfg, make())
    t0 = time.process_time()
    ends = []
    for i in range(0, pcm.size, PUSH_SAMPLES):
        ends += det.push(pcm[i : i + PUSH_SAMPLES])
    return [(e.speech_end, e.decided_at) for e in ends], time.process_time() - t0


def main(args: argparse.Namespace) -> int:
    calls = build_calls(args)
    vads: dict[str, Callable[[], FrameClassifier]] = {
        f"energy {args.energy_db:g} dBFS": lambda: EnergyClassifier(args.energy_db)
    }
    for mode in (int(m) for m in args.webrtc_modes.split(",") if m):
        vads[f"webrtc mode {mode}"] = lambda mode=mode: WebRtcClassifier(mode)  # type: ignore[misc]
        vads[f"webrtc {mode} + energy gate"] = lambda mode=mode: WebRtcClassifier(  # type: ignore[misc]
            mode, EnergyClassifier(args.energy_db)
        )
    if args.silero_onnx is not None:
        path = args.silero_onnx
        vads["silero 0.5"] = lambda: SileroClassifier(path)
    cfg = VadConfig(kind="energy", hangover_ms=args.hangover_ms, min_speech_ms=args.min_speech_ms)
    results: dict[str, dict[str, Any]] = {}
    n_utts = sum(len(c.spans) for c in calls)
    seconds = sum(c.pcm8k.size for c in calls) / RATE_8K
    print(f"{len(calls)} calls, {n_utts} utterances, {seconds:.0f} s; hang-over {args.hangover_ms} ms")
    print("| VAD | line | end latency p50 / p95 ms | missed | splits / utt | false ends / min | CPU µs/s |")
    print("|---|---|---|---|---|---|---|")
    for condition in CONDITIONS:
        rng = np.random.default_rng(args.seed)
        lines = [line(c, condition, rng) for c in calls]
        for name, make in vads.items():
            sc = Score()
            cpu = 0.0
            for call, pcm in zip(calls, lines, strict=True):
                ends, dt = run_vad(make, pcm, cfg)
                cpu += dt
                score(call, ends, sc)
            delays, missed = sc.delays_ms, sc.missed
            p50, p95 = np.percentile(delays, [50, 95]).tolist() if delays else [float("nan")] * 2
            r = {
                "delay_p50_ms": round(p50, 1),
                "delay_p95_ms": round(p95, 1),
                "missed": missed,
                "missed_share": round(missed / n_utts, 3),
                "splits_per_utt": round(sc.splits / n_utts, 3),
                "false_ends_per_min": round(sc.false_ends / (seconds / 60), 2),
                "cpu_us_per_s": round(1e6 * cpu / seconds, 1),
            }
            results[f"{name} | {condition}"] = r
            print(
                f"| {name} | {condition} | {r['delay_p50_ms']} / {r['delay_p95_ms']} | "
                f"{missed} ({100 * r['missed_share']:.0f} %) | {r['splits_per_utt']} | "
                f"{r['false_ends_per_min']} | {r['cpu_us_per_s']} |",
                flush=True,
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0
