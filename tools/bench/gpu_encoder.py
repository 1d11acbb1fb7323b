"""Encoder step on the GPU: our MLX encoder next to transformers' streaming encoder, same GPU, same run.

On the lent H200, from the repository root with `.whl/` carried (../shared/tools/stage_mlx_cuda.sh):

    source .whl/device_env.sh && python3 -m tools.bench.gpu_encoder

Full-size config (24 x 1024, 0.6B), random weights built in memory from the HF model (no bundle
files). In order, each part guarded so a failure (OOM, a missing kernel) is reported and the rest runs:

1. parity at fp32, B=1, lookahead 3: ours vs `get_audio_features(..., use_cache=True)` chunk by chunk
   (17 chunks, so the 56-frame caches wrap), the short final chunk vs the reference's offline output;
   then ours in fp16/bf16 against the fp32 reference (rel-L2), next to the reference's own fp16/bf16;
2. for fp16 and bf16, for B in 1 8 32 64 128 256 512: our step and the reference's step, interleaved
   step by step on the same mel (after enough warm-up chunks to fill the caches);
3. ours at fp16 without mx.compile, where time is left;
4. the kernel count of one step (primitives of the evaluated graph, views excluded).

Prints markdown tables with timestamps as it goes and writes `$OUT/gpu_encoder.json` and
`$OUT/gpu_encoder.md`. Stops starting new measurements after `--budget-s` (default 320 s), so the
whole run stays under 6 minutes. `--smoke`: a tiny config on whatever device MLX/torch have (the CPU
here), B in {1, 2}, a few steps; it is what the test suite runs.

Imports only what the GPU host has: numpy, MLX, torch, transformers, and asr_core's encoder.
"""

from __future__ import annotations

import os

# Before MLX starts: keep fp32 matmuls in fp32 (TF32 would cost the fp32 parity check ~1e-3).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import argparse
import copy
import functools
import gc
import json
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asr_core import configure_process

if __name__ == "__main__":  # run as a program on a CPU: OpenBLAS under MLX, before mlx.core loads
    configure_process(torch=True)
import mlx.core as mx

from asr_core.bundle import EncoderConfig, convert_encoder_weights, encoder_tensor_kinds
from asr_core.encoder import (
    ChunkInput,
    StreamingEncoder,
    chunk_frames,
    first_chunk_frames,
)
from tools.bench.encoder import (
    BatchResult,
    ReferenceStream,
    environment,
    hf_config_kwargs,
    markdown_table,
    run_batch,
    set_cpu_threads,
)

FULL = EncoderConfig(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    intermediate_size=4096,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=256,
    n_mels=128,
    left_context_frames=56,
    num_prompts=128,
    prompt_intermediate_size=2048,
    output_size=640,
)
TINY = EncoderConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    conv_kernel_size=9,
    subsampling_factor=8,
    subsampling_conv_channels=16,
    n_mels=128,
    left_context_frames=56,
    num_prompts=128,
    prompt_intermediate_size=96,
    output_size=64,
)
LOOKAHEAD = 3
PROMPTS = (0, 19, 101)  # en-US, uk-UA, auto: rows of one step carry different languages
# Primitives that only make a view (no kernel) when MLX evaluates them.
VIEW_PRIMITIVES = {
    "Broadcast",
    "BroadcastAxes",
    "Slice",
    "Squeeze",
    "ExpandDims",
    "Transpose",
    "Unflatten",
    "AsStrided",
    "StopGradient",
    "Depends",
}

_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny config, B in {1, 2}, a few steps")
    parser.add_argument("--parity-only", action="store_true", help="only part 1 (e.g. at full size on a CPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["f16", "bf16"], choices=("f16", "bf16", "f32"))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per config (default 20)")
    parser.add_argument(
        "--budget-s", type=float, default=320.0, help="start nothing new after this many seconds"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT)")
    parser.add_argument("--seed", type=int, default=0)


# --------------------------------------------------------------------------------------------------
# models


def build_reference(cfg: EncoderConfig, device: str, seed: int) -> Any:
    """HF model of `cfg` on `device`, fp32, weights at the bundles' scales (LayerNorms and bias_u/v
    perturbed so every term shows in the parity numbers)."""
    import torch
    from transformers import Nemotron3_5AsrConfig, Nemotron3_5AsrForRNNT

    torch.manual_seed(seed)
    with torch.device(device):
        model = Nemotron3_5AsrForRNNT(Nemotron3_5AsrConfig(**hf_config_kwargs(cfg, 16, 15))).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if ".norm" in name and leaf == "weight":
                    p.normal_(1.0, 0.1)
                elif leaf in ("bias_u", "bias_v"):
                    p.normal_(0.0, 0.2)
                elif leaf == "bias" or p.ndim == 1:
                    p.normal_(0.0, 0.1 if ".norm" in name else 0.05)
                else:
                    p.normal_(0.0, float(np.prod(p.shape[1:])) ** -0.5)
    return model


def our_weights(model: Any, cfg: EncoderConfig, dtype: mx.Dtype) -> dict[str, mx.array]:
    state = model.state_dict()
    names = encoder_tensor_kinds(cfg.num_hidden_layers, cfg.n_subsampling_stages)
    arrays = {n: state[n].detach().float().cpu().numpy() for n in names}
    return convert_encoder_weights(arrays, cfg, dtype)


MX_DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def torch_dtype(name: str) -> Any:
    import torch

    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]


# --------------------------------------------------------------------------------------------------
# parts


def stream_ours(
    encoder: StreamingEncoder, chunks: list[np.ndarray], last_short: np.ndarray | None
) -> list[np.ndarray]:
    slot = encoder.alloc(PROMPTS[1], LOOKAHEAD)
    try:
        out = [encoder.step([ChunkInput(slot, c)])[0] for c in chunks]
        if last_short is not None:
            out.append(encoder.step([ChunkInput(slot, last_short, is_last=True)])[0])
        return out
    finally:
        encoder.release(slot)


def parity(model: Any, cfg: EncoderConfig, dtypes: list[str], rng: np.random.Generator) -> dict[str, Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n_later = 16
    chunks = [rng.standard_normal((first_chunk_frames(LOOKAHEAD), cfg.n_mels), dtype=np.float32)]
    chunks += [
        rng.standard_normal((chunk_frames(LOOKAHEAD), cfg.n_mels), dtype=np.float32) for _ in range(n_later)
    ]
    short = rng.standard_normal((13, cfg.n_mels), dtype=np.float32)
    ref = ReferenceStream(model, LOOKAHEAD, [PROMPTS[1]])
    theirs = [ref.step(c[None])[0] for c in chunks]
    mel = np.concatenate([*chunks, short])
    with torch.inference_mode():
        offline = (
            model.get_audio_features(
                input_features=torch.from_numpy(mel)[None].to(ref.device),
                prompt_ids=ref.prompts,
                num_lookahead_tokens=LOOKAHEAD,
            )
            .pooler_output[0]
            .float()
            .cpu()
            .numpy()
        )
    enc = StreamingEncoder(our_weights(model, cfg, mx.float32), cfg, "f32")
    ours = stream_ours(enc, chunks, short)
    per_chunk = [float(np.abs(a - b).max()) for a, b in zip(ours, theirs, strict=False)]
    tail = ours[-1]
    result: dict[str, Any] = {
        "f32_max_abs_diff_per_chunk": per_chunk,
        "f32_max_abs_diff": max(per_chunk),
        "f32_final_short_chunk_vs_offline": float(np.abs(tail - offline[-len(tail) :]).max()),
        "f32_stream_vs_reference_offline": float(np.abs(np.concatenate(ours) - offline).max()),
        "reference_mean_abs": float(np.abs(offline).mean()),
    }
    log(
        f"parity f32: per-chunk max|d| {max(per_chunk):.2e}, short final chunk "
        f"{result['f32_final_short_chunk_vs_offline']:.2e} "
        f"(outputs mean |x| {result['reference_mean_abs']:.2f})"
    )
    del enc
    full = np.concatenate(theirs)
    for name in dtypes:
        if name == "f32":
            continue
        enc = StreamingEncoder(our_weights(model, cfg, MX_DTYPES[name]), cfg, name)
        mine = np.concatenate(stream_ours(enc, chunks, None))
        low = copy.deepcopy(model).to(torch_dtype(name))
        low_ref = ReferenceStream(low, LOOKAHEAD, [PROMPTS[1]])
        ref_low = np.concatenate([low_ref.step(c[None])[0] for c in chunks])
        del low, low_ref
        result[f"{name}_rel_l2_ours"] = float(np.linalg.norm(mine - full) / np.linalg.norm(full))
        result[f"{name}_rel_l2_reference"] = float(np.linalg.norm(ref_low - full) / np.linalg.norm(full))
        log(
            f"parity {name}: rel-L2 vs fp32 reference: ours {result[f'{name}_rel_l2_ours']:.2e}, "
            f"reference in {name} {result[f'{name}_rel_l2_reference']:.2e}"
        )
        del enc
    return result


def count_kernels(encoder: StreamingEncoder, cfg: EncoderConfig, batch: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    slots = [encoder.alloc(PROMPTS[b % 3], LOOKAHEAD) for b in range(batch)]
    try:
        encoder.step(
            [
                ChunkInput(
                    s, rng.standard_normal((first_chunk_frames(LOOKAHEAD), cfg.n_mels), dtype=np.float32)
                )
                for s in slots
            ]
        )
        encoder.step(
            [
                ChunkInput(s, rng.standard_normal((chunk_frames(LOOKAHEAD), cfg.n_mels), dtype=np.float32))
                for s in slots
            ]
        )
        with tempfile.TemporaryDirectory() as tmp:
            dot = Path(tmp) / "step.dot"
            rows = [
                ChunkInput(s, rng.standard_normal((chunk_frames(LOOKAHEAD), cfg.n_mels), dtype=np.float32))
                for s in slots
            ]
            encoder.step(rows, dot_path=str(dot))
            text = dot.read_text()
    finally:
        for s in slots:
            encoder.release(s)
    return {"batch": batch, **graph_launches(text)}


# A reshape copies when it must merge axes a transpose (or as_strided) made non-mergeable; of a
# contiguous array or a row slice it only changes strides (MLX's prepare_reshape).
STRIDED_VIEWS = {"Transpose", "AsStrided"}
SHAPE_ONLY = {"Reshape", "Flatten", "Unflatten", "Squeeze", "ExpandDims"}


def graph_launches(dot: str) -> dict[str, Any]:
    """Kernel launches of one evaluated graph (`mx.export_to_dot` text), estimated from its nodes.

    A node is a kernel unless it only makes a view; a concatenation is one copy per input; a reshape
    copies only when its input is a transposed view (through other shape-only nodes). Not seen here:
    the copies MLX's GPU matmul makes of operands whose last two axes are not contiguous (the attention
    is laid out so that there are none) and the CPU fallbacks of `mx.fast` ops
    (on a CPU a LayerNorm shows as Sum/Square/AsType nodes, on the GPU it is one kernel)."""
    label = {n: lbl for n, lbl in re.findall(r'\{ (\d+) \[label ="([^"]*)"', dot)}
    inputs: dict[str, list[str]] = {}
    producer: dict[str, str] = {}
    for src, dst in re.findall(r'^("?\w+"?) -> ("?\w+"?)$', dot, flags=re.M):
        if dst.strip('"') in label:
            inputs.setdefault(dst.strip('"'), []).append(src.strip('"'))
        else:
            producer[dst.strip('"')] = src.strip('"')

    def strided(array: str) -> bool:
        node = producer.get(array)
        while node is not None and label[node] in SHAPE_ONLY and inputs.get(node):
            node = producer.get(inputs[node][0])
        return node is not None and label[node] in STRIDED_VIEWS

    counts: Counter[str] = Counter()
    nodes = 0
    for node, lbl in label.items():
        kind = "Compiled (fused)" if lbl.startswith("Compiled") else lbl
        if kind in VIEW_PRIMITIVES:
            continue
        nodes += 1
        if kind in ("Reshape", "Flatten"):
            if strided(inputs.get(node, [""])[0]):
                counts[f"{kind} (copy)"] += 1
        elif kind == "Concatenate":
            counts["Concatenate (copy per input)"] += len(inputs.get(node, []))
        else:
            counts[kind] += 1
    return {
        "kernels": sum(counts.values()),
        "graph_nodes": nodes,
        "fused_kernels": counts.get("Compiled (fused)", 0),
        "by_primitive": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
    }


def release_memory() -> None:
    gc.collect()
    mx.clear_cache()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def guarded(label: str, fn: Callable[[], Any]) -> Any:
    """fn(), or the exception it raised (logged, memory released): one failure never ends the run."""
    try:
        return fn()
    except Exception as e:
        log(f"{label}: FAILED {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        release_memory()
        return e


# Variants of ours (fp16, no reference): the choices the defaults made, measured.
VARIANTS: dict[str, dict[str, Any]] = {"no mx.compile": {"compile": False}}


@dataclass
class Bench:
    model: Any  # the reference, on the torch device
    cfg: EncoderConfig
    batches: list[int]
    steps: int
    warmup: int
    budget_end: float
    rng: np.random.Generator

    def encoder(self, name: str, **kw: Any) -> StreamingEncoder:
        return StreamingEncoder(our_weights(self.model, self.cfg, MX_DTYPES[name]), self.cfg, name, **kw)

    def measure(self, label: str, encoder: StreamingEncoder, b: int, with_reference: bool) -> BatchResult:
        if time.monotonic() > self.budget_end:
            return BatchResult(batch=b, error="skipped: time budget")

        def reference(prompts: Sequence[int]) -> ReferenceStream:
            return ReferenceStream(self.model, LOOKAHEAD, prompts)

        def run() -> BatchResult:
            return run_batch(
                encoder,
                b,
                LOOKAHEAD,
                PROMPTS,
                self.steps,
                self.warmup,
                self.rng,
                reference if with_reference else None,
            )

        log(
            f"{label} B={b}: {1 + self.warmup + self.steps} steps"
            + (", reference interleaved" * with_reference)
        )
        r = guarded(f"{label} B={b}", run)
        result = r if isinstance(r, BatchResult) else BatchResult(batch=b, error=f"{type(r).__name__}: {r}")
        log(f"{label}: " + markdown_table([result]).splitlines()[-1])
        return result

    def against_reference(self, name: str) -> tuple[list[BatchResult], StreamingEncoder | None]:
        encoder = guarded(f"{name} encoder", lambda: self.encoder(name))
        if isinstance(encoder, Exception):
            return [BatchResult(batch=b, error=repr(encoder)) for b in self.batches], None
        self.model.to(torch_dtype(name))
        log(f"{name}: ours compile={encoder.compiled}; reference {next(self.model.parameters()).dtype}")
        return [self.measure(name, encoder, b, True) for b in self.batches], encoder

    def variant(self, name: str, label: str, batches: list[int]) -> list[BatchResult]:
        encoder = guarded(label, lambda: self.encoder(name, **VARIANTS[label]))
        if isinstance(encoder, Exception):
            return [BatchResult(batch=b, error=repr(encoder)) for b in batches]
        out = [self.measure(label, encoder, b, False) for b in batches]
        del encoder
        release_memory()
        return out


# --------------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    import torch

    cfg = TINY if args.smoke else FULL
    batches = args.batch or ([1, 2] if args.smoke else [1, 8, 32, 64, 128, 256, 512])
    steps = args.steps or (3 if args.smoke else 20)
    # Enough later chunks that the reference's attention cache holds all 56 frames before timing.
    warmup = 2 if args.smoke else -(-cfg.left_context_frames // (LOOKAHEAD + 1)) + 1
    out_dir = args.out or Path(os.environ.get("OUT", "var/bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # A shared CPU (the smoke test): torch's OpenMP pool stalls under contention; one thread each.
        set_cpu_threads(1)
    env = environment()
    env["MLX_ENABLE_TF32"] = os.environ.get("MLX_ENABLE_TF32")
    log(f"start: {json.dumps(env)}")
    if device == "cuda" and mx.default_device() != mx.gpu:
        log("WARNING: MLX runs on the CPU here: its timings are not GPU timings")
    report: dict[str, Any] = {
        "command": "python3 -m tools.bench.gpu_encoder " + " ".join(sys.argv[1:]),
        "environment": env,
        "config": asdict(cfg),
        "lookahead": LOOKAHEAD,
        "prompts": PROMPTS,
        "steps": steps,
        "warmup": warmup,
        "torch_device": device,
    }
    rng = np.random.default_rng(args.seed)
    model = build_reference(cfg, device, args.seed)
    log(f"reference model built on {device}")
    par = guarded("parity", lambda: parity(model, cfg, args.dtypes, rng))
    report["parity"] = {"error": repr(par)} if isinstance(par, Exception) else par
    if args.parity_only:
        report["elapsed_s"] = time.monotonic() - _T0
        (out_dir / "gpu_encoder_parity.json").write_text(json.dumps(report, indent=2, default=_jsonable))
        log(f"wrote {out_dir / 'gpu_encoder_parity.json'}")
        return 0 if not isinstance(par, Exception) else 1

    bench = Bench(model, cfg, batches, steps, warmup, _T0 + args.budget_s, rng)
    tables: list[str] = []
    report["timings"] = {}
    for name in args.dtypes:
        results, encoder = bench.against_reference(name)
        report["timings"][name] = results
        tables.append(
            markdown_table(results, f"### {name}: step time, lookahead {LOOKAHEAD}, ours vs transformers")
        )
        if encoder is not None and "kernels" not in report:
            k = guarded("kernel count", functools.partial(count_kernels, encoder, cfg, 8))
            report["kernels"] = {"error": repr(k)} if isinstance(k, Exception) else k
            if not isinstance(k, Exception):
                log(f"kernels per step at B=8: {k['kernels']} ({k['fused_kernels']} fused elementwise)")
        del encoder
        release_memory()
    model.float()

    report["variants"] = {}
    name = args.dtypes[0]
    few = [b for b in batches if b in (1, 2, 32, 128, 512)]
    for label in VARIANTS:
        if time.monotonic() > bench.budget_end:
            break
        results = bench.variant(name, label, few[:: max(1, len(few) // 2)])
        report["variants"][label] = results
        tables.append(markdown_table(results, f"### variant ({name}): {label}"))

    return _finish(tables, report, out_dir)


def _finish(tables: list[str], report: dict[str, Any], out_dir: Path) -> int:
    text = "\n\n".join(tables)
    print(text, flush=True)
    report["elapsed_s"] = time.monotonic() - _T0
    (out_dir / "gpu_encoder.md").write_text(text + "\n")
    (out_dir / "gpu_encoder.json").write_text(json.dumps(report, indent=2, default=_jsonable))
    log(f"wrote {out_dir / 'gpu_encoder.json'} and gpu_encoder.md")
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, BatchResult):
        return {**asdict(x), "ratio": x.ratio}
    if isinstance(x, Exception):
        return repr(x)
    return str(x)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
