"""`ttg bench decoder`: RNN-T greedy decoding throughput, in calls per CPU core at real time.

    ttg bench decoder --model DIR --streams 1,16,64,256 --seconds 10 [--modes workers,batched,numpy,mlx]

Every simulated call carries `--seconds` of encoder frames, decoded chunk by chunk (lookahead 3:
4 frames = 320 ms per chunk) the way the engine does it:

- workers: one stream at a time through `GreedyDecoder` (onnxruntime, 1 thread) -- the per-call
  worker design; its cost per call does not depend on how many calls there are;
- batched: every call's chunk of a step in one `BatchedGreedyDecoder` pass (onnxruntime graphs);
- numpy / mlx: the batched decoder over the graphs' weights in numpy or MLX (`RnntGraphs.weights()`).
- device: `DeviceDecoder` (asr_core/decoder/device.py), the whole label-looping pass in MLX with the
  predictor states on the device (what the engine's decoder mode "device" runs after each encoder
  step); on a GPU its step time, not calls/core, is the number to read.

calls/core = seconds of audio decoded / CPU seconds of this process (all its threads), i.e. how many
real-time calls one core keeps up with. CPU time, not wall time, so other load on the machine does
not count against the decoder.

Joiner inputs (`--frames`):
- scripted (default): built for the bundle's weights so that each call emits one token on ~28 % of
  its frames (`--tokens-per-second` 3.5 at 12.5 frames/s, the rate of conversational speech) and
  blank on the others. "Silent" frames are -1e4 in every dimension: relu(f + g) is then zero, the
  logits are the biases, and blank (the largest bias) wins whatever the predictor state. A token frame
  is found by search from the call's current predictor state: points along random rays whose joint
  says a token, and blank once the predictor has taken that token, each by a margin (2e-3) that
  float differences between the backends cannot flip. Calls take one of `--signals` scripts after a
  silent lead-in of 0..7 frames (out of phase). Values do not change the work: one joiner row per
  frame and per token, one predictor row per token.
- encoder: the bundle's own encoder (numpy reference, tools/bundle/numpy_encoder.py) on speech-like
  probe audio (tools/bundle/probe.py). Random-weight decoders emit in bursts of up to max_symbols
  tokens there (tools/bundle/weights.py says why), so this is the realistic input for a real model
  only.
The measured tokens/s and the share of frames with 0/1/2/3-9/10 tokens are printed with the results.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from asr_core.bundle import load_bundle
from asr_core.decoder import BatchedGreedyDecoder, Emission, GreedyDecoder, NumpyRnnt, RnntGraphs, RnntNet
from asr_core.features import FeatureConfig, log_mel
from tools.bundle.numpy_encoder import encoder_forward, joiner_frames
from tools.bundle.probe import probe_audio

MODES = ("workers", "batched", "numpy", "mlx", "device")
FRAMES_PER_SECOND = 12.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="bundle directory")
    parser.add_argument("--streams", default="1,16,64,256", help="comma-separated call counts (1,16,64,256)")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per call (10)")
    parser.add_argument("--modes", default="workers,batched,numpy,mlx", help=f"subset of {','.join(MODES)}")
    parser.add_argument("--lookahead", type=int, default=3, help="chunk = lookahead+1 encoder frames (3)")
    parser.add_argument(
        "--frames",
        choices=("scripted", "encoder"),
        default="scripted",
        help="joiner inputs (see doc): scripted",
    )
    parser.add_argument(
        "--tokens-per-second", type=float, default=3.5, help="scripted token rate per call (3.5)"
    )
    parser.add_argument("--signals", type=int, default=8, help="distinct frame sequences (8)")
    parser.add_argument(
        "--workers-max-streams", type=int, default=16, help="calls timed in 'workers' mode (16)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)


def _config(model: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((model / "nemotron_onnx_config.json").read_text())
    return cfg


def _encoder_weights(model: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: np.asarray(v, np.float32) for k, v in load_file(str(model / "encoder.safetensors")).items()}


def speech_frames(model: Path, seconds: float, signals: int, lookahead: int) -> list[np.ndarray]:
    cfg = _config(model)
    n_mels = int(cfg["features"]["n_mels"])
    filters = np.fromfile(model / "melfilters.f32", "<f4").reshape(n_mels, -1)
    weights = _encoder_weights(model)
    heads = int(cfg["encoder"]["num_attention_heads"])
    prompt = int(cfg["prompt_dictionary"].get("auto", cfg["default_prompt_id"]))
    out = []
    for k in range(signals):
        mel = log_mel(probe_audio(seconds, seed=100 + k), filters, FeatureConfig(n_mels=n_mels))
        hidden = encoder_forward(weights, mel, heads, lookahead)
        out.append(joiner_frames(weights, hidden, prompt, int(cfg["num_prompts"])))
    return out


def scripted_frames(
    net: NumpyRnnt,
    blank: int,
    scripts: int,
    n_frames: int,
    tokens_per_second: float,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Joiner inputs that make greedy decoding emit one token on a chosen ~`tokens_per_second` of the
    frames and blank on all others, whatever the weights (see the module doc)."""
    w = net.w
    joint = w.head_w.shape[1]
    others = np.delete(w.head_b, blank)
    if not w.head_b[blank] > others.max() + _MARGIN:
        raise ValueError("scripted frames need blank to have the largest joint bias; use --frames encoder")
    silent = np.full(joint, -_SILENT, np.float32)  # relu(silent + g) = 0: logits = bias, blank wins
    p_token = tokens_per_second / FRAMES_PER_SECOND
    out = []
    for _ in range(scripts):
        h, c = net.zero_state(1)
        g, h, c = net.decoder_step(np.array([blank]), h, c)
        frames = []
        owed = 0  # scheduled tokens not placed yet (no suitable frame found): they go on the next frames
        for _t in range(n_frames):
            owed += int(rng.random() < p_token)
            frame = silent
            if owed:
                for _try in range(3):  # a fresh set of candidates per try
                    found = _one_token_frame(net, blank, g, h, c, rng)
                    if found is not None:
                        frame, (g, h, c) = found
                        owed -= 1
                        break
            frames.append(frame)
        out.append(np.stack(frames).astype(np.float32))
    return out


_SILENT = 1e4
_MARGIN = 2e-3  # logits; float differences between the backends are ~1e-5 of the logits' scale
_RAYS = 8
_LENGTHS = np.geomspace(0.05, 50.0, 128)


def _top2(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """argmax and its margin over the runner-up, per row."""
    best = logits.argmax(axis=1)
    top = logits[np.arange(len(best)), best]
    rest = logits.copy()
    rest[np.arange(len(best)), best] = -np.inf
    return best, top - rest.max(axis=1)


def _one_token_frame(
    net: NumpyRnnt, blank: int, g: np.ndarray, h: np.ndarray, c: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """A frame on which, from this predictor state, the joint says a token and then blank, both by at
    least _MARGIN (so float differences between onnxruntime, numpy and MLX cannot flip them).

    Random predictors barely react to the token they are fed, so such frames sit close to the
    token/blank boundary: candidates are points along random rays, finely spaced in length."""
    joint = g.shape[1]
    rays = rng.standard_normal((_RAYS, joint))
    rays /= np.linalg.norm(rays, axis=1, keepdims=True)
    cand = (rays[:, None, :] * _LENGTHS[None, :, None]).reshape(-1, joint).astype(np.float32)
    first, m1 = _top2(net.joiner(cand, np.broadcast_to(g, cand.shape)))
    idx = np.flatnonzero((first != blank) & (m1 >= _MARGIN))
    if not idx.size:
        return None
    idx = idx[np.argsort(m1[idx])][:64]  # the closest to the boundary are the likeliest to flip
    tokens = first[idx]
    g2, h2, c2 = net.decoder_step(tokens, np.repeat(h, idx.size, axis=1), np.repeat(c, idx.size, axis=1))
    second, m2 = _top2(net.joiner(cand[idx], g2))
    good = np.flatnonzero((second == blank) & (m2 >= _MARGIN))
    if not good.size:
        return None
    j = int(good[0])
    return cand[idx[j]], (g2[j : j + 1], h2[:, j : j + 1], c2[:, j : j + 1])


def _streams(
    frames: list[np.ndarray], n: int, chunk: int, rng: np.random.Generator, scripted: bool
) -> list[list[np.ndarray]]:
    """N calls from the frame sequences: scripted ones start after a random silent lead-in (blank frames
    leave the predictor state alone, so the script still holds); encoder frames start at a random
    frame (circularly)."""
    calls = []
    for i in range(n):
        f = frames[i % len(frames)]
        # scripted: a lead-in of 0..2 chunks puts calls out of phase at little cost to the token rate
        shift = int(rng.integers(0, 2 * chunk if scripted else len(f)))
        if scripted:
            silent = np.full((shift, f.shape[1]), -_SILENT, np.float32)
            f = np.concatenate([silent, f])[: len(f)]
        else:
            f = np.roll(f, -shift, axis=0)
        calls.append([np.ascontiguousarray(f[a : a + chunk]) for a in range(0, len(f), chunk)])
    return calls


def _net(mode: str, graphs: RnntGraphs) -> RnntNet:
    if mode in ("workers", "batched", "device"):
        return graphs
    if mode == "numpy":
        return NumpyRnnt(graphs.weights())
    from asr_core.decoder.mlx_rnnt import MlxRnnt

    return MlxRnnt(graphs.weights())


def run_mode(
    mode: str, net: RnntNet, blank: int, max_symbols: int, calls: list[list[np.ndarray]]
) -> dict[str, Any]:
    tokens: list[list[int]] = [[] for _ in calls]
    per_frame: list[int] = []  # tokens on each frame of each call
    step_ms: list[float] = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if mode == "workers":
        dec = GreedyDecoder(net, blank, max_symbols)
        for i, chunks in enumerate(calls):
            state = dec.new_state()
            for ch in chunks:
                t = time.perf_counter()
                ems = dec.decode(state, ch)
                step_ms.append(1e3 * (time.perf_counter() - t))
                tokens[i] += [e.token for e in ems]
                per_frame += _per_frame(ems, state.frames - len(ch), len(ch))
    elif mode == "device":
        from asr_core.decoder.device import DeviceDecoder

        assert isinstance(net, RnntGraphs)
        ddec = DeviceDecoder(net.weights(), blank, max_symbols, capacity=len(calls))
        slots = [ddec.alloc() for _ in calls]
        # Trace the compiled iteration for this batch outside the clock: a silent frame is blank for
        # every row and leaves the predictor states as they are.
        silent = np.full((len(calls[0][0]), net.shape.joint), -_SILENT, np.float32)
        ddec.decode(slots, [silent] * len(slots))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in range(len(calls[0])):
            t = time.perf_counter()
            chunks = [c[step] for c in calls]
            first = [step * len(calls[0][0])] * len(calls)
            emitted = ddec.decode(slots, chunks, first)
            step_ms.append(1e3 * (time.perf_counter() - t))
            for i, ems in enumerate(emitted):
                tokens[i] += [e.token for e in ems]
                per_frame += _per_frame(ems, first[i], len(chunks[i]))
    else:
        bdec = BatchedGreedyDecoder(net, blank, max_symbols)
        states = bdec.new_states(len(calls))
        for step in range(len(calls[0])):
            t = time.perf_counter()
            out: list[list[Emission]] = bdec.decode(states, [c[step] for c in calls])
            step_ms.append(1e3 * (time.perf_counter() - t))
            for i, ems in enumerate(out):
                tokens[i] += [e.token for e in ems]
                n = len(calls[i][step])
                per_frame += _per_frame(ems, states[i].frames - n, n)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    audio_s = sum(sum(len(ch) for ch in chunks) for chunks in calls) / FRAMES_PER_SECOND
    return {
        "mode": mode,
        "calls": len(calls),
        "audio_s": audio_s,
        "cpu_s": cpu,
        "wall_s": wall,
        "calls_per_core": audio_s / cpu if cpu > 0 else float("inf"),
        "tokens_per_s_per_call": sum(map(len, tokens)) / audio_s,
        "step_ms_mean": float(np.mean(step_ms)),
        "step_ms_p99": float(np.percentile(step_ms, 99)),
        "step_ms_max": float(np.max(step_ms)),
        # share of frames with 0, 1, 2, 3-9 and max_symbols tokens (real speech: mostly 0 and 1)
        "frames_by_tokens": _histogram(per_frame, max_symbols),
        "_tokens": tokens,
    }


def _per_frame(ems: list[Emission], first: int, n: int) -> list[int]:
    counts = [0] * n
    for e in ems:
        counts[e.frame - first] += 1
    return counts


def _histogram(per_frame: list[int], max_symbols: int) -> dict[str, float]:
    c = np.asarray(per_frame)
    total = max(1, c.size)
    return {
        "0": float((c == 0).sum() / total),
        "1": float((c == 1).sum() / total),
        "2": float((c == 2).sum() / total),
        f"3-{max_symbols - 1}": float(((c >= 3) & (c < max_symbols)).sum() / total),
        str(max_symbols): float((c >= max_symbols).sum() / total),
    }


def main(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"ttg bench decoder: unknown mode(s) {bad}; choose from {MODES}", file=sys.stderr)
        return 2
    counts = [int(x) for x in args.streams.split(",")]
    # Any layout: its ONNX graphs, or the graphs built at load from an MLX layout's weights.
    bundle = load_bundle(args.model, "f32")
    graphs = bundle.rnnt_graphs()
    blank, max_symbols = bundle.config.blank_token_id, bundle.config.max_symbols_per_step
    if args.frames == "encoder" and bundle.decoder_path is None:
        print("ttg bench decoder: --frames encoder reads a five-file bundle's encoder", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.frames == "scripted":
        rng = np.random.default_rng(args.seed)
        n_frames = round(args.seconds * FRAMES_PER_SECOND)
        try:
            frames = scripted_frames(
                NumpyRnnt(graphs.weights()), blank, args.signals, n_frames, args.tokens_per_second, rng
            )
        except ValueError as exc:
            print(f"ttg bench decoder: {exc}", file=sys.stderr)
            return 2
    else:
        frames = speech_frames(args.model, args.seconds, args.signals, args.lookahead)
    print(
        f"{args.frames} frames: {args.signals} x {len(frames[0])} frames "
        f"in {time.perf_counter() - t0:.1f} s (V={graphs.shape.vocab}, J={graphs.shape.joint})",
        file=sys.stderr,
    )
    nets = {m: _net(m, graphs) for m in modes}
    results: list[dict[str, Any]] = []
    head = f"{'calls':>6} {'mode':>8} {'calls/core':>11} {'tok/s/call':>10} {'step ms mean':>12}"
    print(f"{head} {'p99':>7} {'max':>7}  frames with 0/1/2/3-9/10 tokens")
    for n in counts:
        calls = _streams(
            frames, n, args.lookahead + 1, np.random.default_rng(args.seed), args.frames == "scripted"
        )
        reference: list[list[int]] | None = None
        for mode in modes:
            subset = calls[: args.workers_max_streams] if mode == "workers" else calls
            r = run_mode(mode, nets[mode], blank, max_symbols, subset)
            toks = r.pop("_tokens")
            reference = toks if reference is None else reference
            common = min(len(toks), len(reference))  # 'workers' times only the first calls
            r["tokens_match_first_mode"] = toks[:common] == reference[:common]
            r["streams"] = n
            results.append(r)
            hist = " ".join(f"{v:.2f}" for v in r["frames_by_tokens"].values())
            print(
                f"{n:>6} {mode:>8} {r['calls_per_core']:>11.1f} {r['tokens_per_s_per_call']:>10.2f} "
                f"{r['step_ms_mean']:>12.2f} {r['step_ms_p99']:>7.2f} {r['step_ms_max']:>7.2f}  {hist}"
                + ("" if r["tokens_match_first_mode"] else "  TOKENS DIFFER")
            )
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "model": str(args.model),
        "vocab": graphs.shape.vocab,
        "joint": graphs.shape.joint,
        "seconds_per_call": args.seconds,
        "lookahead": args.lookahead,
        "frames": args.frames,
        "command": " ".join(sys.argv),
        "results": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["tokens_match_first_mode"] for r in results) else 1
