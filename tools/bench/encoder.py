"""`ttg bench encoder`: batched MLX encoder step time per batch size, side by side with the reference.

    ttg bench encoder --model var/bundles/full --batch 1 8 --json var/bench/encoder_cpu.json

For each batch size B: B streams are allocated at one lookahead, fed a first chunk and `--warmup`
later chunks (enough to fill the 56-frame attention caches), then `--steps` timed later chunks. One
timed step is `StreamingEncoder.step` over B rows: host mel in, every row's joiner frames back on the
host. Where torch + transformers are installed (the `reference` extra) the reference runs in the
same loop, step for step on the same mel: HF `Nemotron3_5AsrForRNNT.get_audio_features` with its
streaming caches at the same B, frames brought to the host too; the table gives both medians and the
ratio, and the largest difference of the frames the two produced.

The helpers here (reference wrapper, statistics) are shared with `tools/bench/gpu_encoder.py`, which
runs on the GPU host: keep this module importable with numpy + MLX alone (torch is imported lazily).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import inspect
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import asr_core._blas
from asr_core.bundle import EncoderConfig, ModelConfig
from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="bundle directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (default: 1)")
    parser.add_argument("--precision", choices=("f32", "f16", "bf16"), default="f32")
    parser.add_argument("--lookahead", type=int, default=None, help="encoder lookahead (default: bundle's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per batch size (default: 10)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed later chunks first (default: fills the caches)"
    )
    parser.add_argument(
        "--compile", choices=("auto", "on", "off"), default="auto", help="mx.compile the step"
    )
    parser.add_argument(
        "--array-exp",
        choices=("auto", "on", "off"),
        default="auto",
        help="sigmoid and softmax as fused array ops (asr_core.encoder.expmath; auto: x86-64 CPU with g++)",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for both (OpenBLAS under MLX, torch); default: each library's own",
    )
    parser.add_argument(
        "--busy-threads",
        type=int,
        default=0,
        help="threads running interpreter work beside the steps, as the engine process's receiver, "
        "assemblers and device decoder do (the worst case: they never wait); the step's host phase "
        "shows what they cost it",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


# --------------------------------------------------------------------------------------------------
# statistics and environment


@dataclass
class Timing:
    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    n: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        ms = np.asarray(seconds, dtype=np.float64) * 1e3
        return cls(
            float(np.median(ms)), float(np.percentile(ms, 90)), float(ms.mean()), float(ms.min()), len(ms)
        )


@dataclass
class BatchResult:
    batch: int
    ours: Timing | None = None
    reference: Timing | None = None
    max_abs_diff: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or self.reference is None:
            return None
        return self.ours.median_ms / self.reference.median_ms


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_device": str(mx.default_device()),
        "openblas": asr_core._blas.openblas_path(),
    }
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None
            )
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def markdown_table(results: Sequence[BatchResult], label: str = "") -> str:
    head = "| B | ours median ms | ours p90 ms | reference median ms | reference p90 ms | ours / reference |"
    head += " ours per stream ms | max abs diff |"
    lines = [head, "|" + "---|" * 8]

    def f(x: float | None, spec: str = ".2f") -> str:
        return "—" if x is None else format(x, spec)

    for r in results:
        if r.error or r.ours is None:
            lines.append(f"| {r.batch} | {r.error or 'no result'} |  |  |  |  |  |  |")
            continue
        o, ref = r.ours, r.reference
        cells = [
            f(o.median_ms),
            f(o.p90_ms),
            f(ref.median_ms if ref else None),
            f(ref.p90_ms if ref else None),
            f(r.ratio),
            f(o.median_ms / r.batch, ".3f"),
            f(r.max_abs_diff, ".1e"),
        ]
        lines.append(f"| {r.batch} | " + " | ".join(cells) + " |")
    return (f"{label}\n" if label else "") + "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the reference (transformers), batched streaming with caches


def hf_config_kwargs(enc: EncoderConfig, vocab_size: int = 2, blank_token_id: int = 1) -> dict[str, Any]:
    """`Nemotron3_5AsrConfig` keyword arguments of an encoder of these sizes (no dropout).

    The decoder/joint sizes only matter for what `get_audio_features` never touches.
    """
    encoder = dict(
        hidden_size=enc.hidden_size,
        num_hidden_layers=enc.num_hidden_layers,
        num_attention_heads=enc.num_attention_heads,
        intermediate_size=enc.intermediate_size,
        hidden_act="silu",
        attention_bias=False,
        convolution_bias=False,
        conv_kernel_size=enc.conv_kernel_size,
        subsampling_factor=enc.subsampling_factor,
        subsampling_conv_channels=enc.subsampling_conv_channels,
        num_mel_bins=enc.n_mels,
        subsampling_conv_kernel_size=enc.subsampling_conv_kernel_size,
        subsampling_conv_stride=enc.subsampling_conv_stride,
        max_position_embeddings=5000,
        scale_input=enc.scale_input,
        sliding_window=enc.left_context_frames + 1,
        default_num_lookahead_tokens=enc.default_lookahead,
        dropout=0.0,
        dropout_positions=0.0,
        layerdrop=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
    )
    return dict(
        encoder_config=encoder,
        vocab_size=vocab_size,
        blank_token_id=blank_token_id,
        decoder_hidden_size=enc.output_size,
        num_prompts=enc.num_prompts,
        prompt_intermediate_size=enc.prompt_intermediate_size,
    )


def reference_from_bundle(model_dir: Path, config: ModelConfig) -> Any:
    """The reference model holding the bundle's encoder weights (float32, CPU)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Nemotron3_5AsrConfig, Nemotron3_5AsrForRNNT

    from asr_core.bundle import nemo_to_hf_name

    model = Nemotron3_5AsrForRNNT(
        Nemotron3_5AsrConfig(**hf_config_kwargs(config.encoder, config.vocab_size, config.blank_token_id))
    ).eval()
    state = load_file(str(model_dir / "encoder.safetensors"))
    if "encoder.pre_encode.conv.0.weight" in state:
        state = {nemo_to_hf_name(k): v for k, v in state.items() if not k.startswith("preprocessor.")}
    state = {k: v.to(torch.float32) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("decoder.", "joint."))]
    if missing or unexpected:
        raise RuntimeError(f"reference model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


class ReferenceStream:
    """B streams of the reference in lockstep: `get_audio_features` with its K/V and conv caches."""

    def __init__(self, model: Any, lookahead: int, prompt_ids: Sequence[int]) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.lookahead = lookahead
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.prompts = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        # transformers renamed the encoder's `past_key_values` argument to `cache` (5.2x); pass only
        # what the installed version's encoder takes.
        params = inspect.signature(model.encoder.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.extra = {"output_attention_mask": False} if "output_attention_mask" in params else {}
        self.cache: Any = None
        self.padding_cache: Any = None

    def step(self, mel: np.ndarray) -> np.ndarray:
        """mel (B, n, n_mels) -> frames (B, T, J) float32 on the host (synchronizes the device)."""
        torch = self.torch
        x = torch.from_numpy(np.ascontiguousarray(mel)).to(self.device, self.dtype)
        kwargs = dict(self.extra)
        if self.cache is not None:
            kwargs[self.cache_arg] = self.cache
        with torch.inference_mode():
            out = self.model.get_audio_features(
                input_features=x,
                prompt_ids=self.prompts,
                num_lookahead_tokens=self.lookahead,
                use_cache=True,
                padding_cache=self.padding_cache,
                **kwargs,
            )
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else getattr(out, "past_key_values", None)
        if self.cache is None or out.padding_cache is None:
            raise RuntimeError("the reference returned no streaming caches")
        self.padding_cache = out.padding_cache
        return out.pooler_output.float().cpu().numpy()


# --------------------------------------------------------------------------------------------------
# the measurement loop


def run_batch(
    encoder: StreamingEncoder,
    batch: int,
    lookahead: int,
    prompt_ids: Sequence[int],
    steps: int,
    warmup: int,
    rng: np.random.Generator,
    reference: Callable[[Sequence[int]], ReferenceStream] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> BatchResult:
    """Time `steps` encoder steps at batch `batch` (and the reference's, interleaved step by step).

    Row b speaks prompt_ids[b % len(prompt_ids)]; `reference(row_prompts)` makes the reference's B
    streams."""
    cfg = encoder.cfg
    n_mels, factor = cfg.n_mels, cfg.subsampling_factor
    row_prompts = [prompt_ids[b % len(prompt_ids)] for b in range(batch)]
    slots = [encoder.alloc(p, lookahead) for p in row_prompts]
    ref = reference(row_prompts) if reference is not None else None
    ours_s: list[float] = []
    ref_s: list[float] = []
    diff = 0.0
    host_s = 0.0  # the step's host phases (plan and graph: `StreamingEncoder.seconds`), timed steps
    try:
        for i in range(1 + warmup + steps):
            host0 = encoder.seconds["plan"] + encoder.seconds["graph"]
            n = first_chunk_frames(lookahead, factor) if i == 0 else chunk_frames(lookahead, factor)
            mel = rng.standard_normal((batch, n, n_mels), dtype=np.float32)
            rows = [ChunkInput(s, mel[b]) for b, s in enumerate(slots)]
            t0 = time.perf_counter()
            ours = encoder.step(rows)
            t1 = time.perf_counter()
            if i > warmup:
                ours_s.append(t1 - t0)
                host_s += encoder.seconds["plan"] + encoder.seconds["graph"] - host0
            if ref is not None:
                t0 = time.perf_counter()
                theirs = ref.step(mel)
                t1 = time.perf_counter()
                if i > warmup:
                    ref_s.append(t1 - t0)
                diff = max(diff, float(np.abs(np.stack(ours) - theirs).max()))
            if i == 0:
                log(f"B={batch}: first step done")
    finally:
        for s in slots:
            encoder.release(s)
    return BatchResult(
        batch=batch,
        ours=Timing.of(ours_s),
        reference=Timing.of(ref_s) if ref_s else None,
        max_abs_diff=diff if ref is not None else None,
        extra={"host_ms": 1e3 * host_s / len(ours_s)} if ours_s else {},
    )


def default_warmup(cfg: EncoderConfig, lookahead: int) -> int:
    # The reference's attention cache grows to its full 56 frames first; compare at steady state.
    return math.ceil(cfg.left_context_frames / (lookahead + 1)) + 1


def set_cpu_threads(n: int) -> None:
    """The same thread count for OpenBLAS (MLX's CPU matmuls) and torch."""
    import ctypes

    path = asr_core._blas.openblas_path()
    if path is not None:
        ctypes.CDLL(path).openblas_set_num_threads(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass


@contextlib.contextmanager
def busy_interpreter(threads: int) -> Iterator[Callable[[], int]]:
    """`threads` threads that want the interpreter lock all the time, while the block runs; it gets
    the number of turns they have taken so far (a turn: one pass of their loop)."""
    stop = threading.Event()
    turns = [0]

    def spin() -> None:
        while not stop.is_set():
            turns[0] += 1

    workers = [threading.Thread(target=spin, name=f"busy-{i}", daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    try:
        yield lambda: turns[0]
    finally:
        stop.set()
        for w in workers:
            w.join()


def log_line(msg: str) -> None:
    print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from asr_core.bundle import load_bundle

    if args.threads is not None:
        set_cpu_threads(args.threads)
    bundle = load_bundle(args.model, args.precision)
    cfg = bundle.config
    lookahead = cfg.encoder.default_lookahead if args.lookahead is None else args.lookahead
    compile_flag = None if args.compile == "auto" else args.compile == "on"
    array_exp = None if args.array_exp == "auto" else args.array_exp == "on"
    encoder = StreamingEncoder(
        bundle.encoder_weights, cfg.encoder, bundle.precision, compile=compile_flag, array_exp=array_exp
    )
    if not encoder.compiled:
        encoder.warmup(lookahead, 1)  # builds the CPU's fused kernels where they are used
    warmup = default_warmup(cfg.encoder, lookahead) if args.warmup is None else args.warmup
    # Rows of one step speak different languages, as calls do.
    prompt_ids = [cfg.prompt_dictionary[x] for x in ("en-US", "uk-UA", "auto") if x in cfg.prompt_dictionary]
    prompt_ids = prompt_ids or [cfg.default_prompt_id]

    reference: Callable[[Sequence[int]], ReferenceStream] | None = None
    ref_note = "skipped (--no-reference)"
    if not args.no_reference:
        try:
            import torch

            model = reference_from_bundle(bundle.dir, cfg)
            if args.precision != "f32":
                model = model.to({"f16": torch.float16, "bf16": torch.bfloat16}[args.precision])
            reference = functools.partial(ReferenceStream, model, lookahead)
            ref_note = f"transformers {__import__('transformers').__version__}, torch {torch.__version__}"
        except ImportError as e:
            ref_note = f"unavailable ({e.name} not installed)"
    log_line(f"encoder ready (compile={encoder.compiled})")
    log_line(f"reference: {ref_note}")

    rng = np.random.default_rng(args.seed)
    results = []
    with busy_interpreter(args.busy_threads):
        for b in args.batch:
            log_line(f"B={b}: {1 + warmup + args.steps} steps")
            try:
                results.append(
                    run_batch(encoder, b, lookahead, prompt_ids, args.steps, warmup, rng, reference, log_line)
                )
            except Exception as e:  # report and go on with the next batch size
                results.append(BatchResult(batch=b, error=f"{type(e).__name__}: {e}"))
            log_line(markdown_table(results[-1:]).splitlines()[-1])
    for r in results:
        if "host_ms" in r.extra:
            print(f"B={r.batch}: host phase (plan + graph) {r.extra['host_ms']:.2f} ms a step")

    title = (
        f"encoder step, {args.precision}, lookahead {lookahead}, {cfg.encoder.num_hidden_layers} layers x "
        f"{cfg.encoder.hidden_size}, compile={encoder.compiled}, "
        f"array_exp={encoder.params.array_exp}"
    )
    print(markdown_table(results, title))
    if args.json:
        report = {
            "command": " ".join(["ttg", *sys.argv[1:]]) if sys.argv else None,
            "environment": environment(),
            "model": str(args.model),
            "precision": args.precision,
            "lookahead": lookahead,
            "warmup": warmup,
            "steps": args.steps,
            "compile": encoder.compiled,
            "array_exp": encoder.params.array_exp,
            "threads": args.threads,
            "busy_threads": args.busy_threads,
            "reference": ref_note,
            "encoder_config": asdict(cfg.encoder),
            "results": [{**asdict(r), "ratio": r.ratio} for r in results],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 1 if any(r.error for r in results) else 0
