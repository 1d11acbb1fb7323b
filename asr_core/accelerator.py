"""Which accelerator MLX runs this process's work on, told to a process that must not load MLX itself.

The multi-process daemon's first process never imports MLX (the engines own the device: on an NVIDIA
card a CUDA context there would sit beside the engines' and outside their MPS server), yet its
defaults depend on the device: how many engine processes, which decoder. `probe()` asks a short-lived
child interpreter (`python -m asr_core.accelerator`, one JSON line) before any engine starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from asr_core.config import DecoderConfig, DecoderMode, SchedulerConfig

AcceleratorKind = Literal["cuda", "metal", "cpu"]
KINDS: tuple[AcceleratorKind, ...] = ("cuda", "metal", "cpu")


class AcceleratorProbeError(RuntimeError):
    """The probe's child did not say which accelerator this machine has."""


@dataclass(frozen=True, slots=True)
class Accelerator:
    kind: AcceleratorKind
    # MLX's limit for one process on this device (bytes): 95 % of a CUDA card's memory by default; 0 on
    # the CPU, where the engines' share of memory is not managed.
    memory_limit: int = 0


# On a CUDA card one engine process cannot launch kernels fast enough for thousands of calls; four side
# by side carried the most on 80 and 141 GB cards (docs/benchmarks.md, "Process model"). Each needs its
# share of the card for the pools of its streams, so a smaller card gets one per ENGINE_MEMORY.
CUDA_ENGINES = 4
ENGINE_MEMORY = 16 << 30
# Rows a CUDA step may carry: its cost hardly grows with the rows up to hundreds, so one engine's whole
# share of the calls fits one step.
CUDA_MAX_BATCH = 512


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What the gateway's "auto" settings come to on an accelerator."""

    engines: int
    decoder_mode: DecoderMode
    max_batch: int


def profile(accelerator: Accelerator) -> EngineProfile:
    """On a CUDA card: several engine processes, decoding on the device after each step (a step's rows
    never cross to the host and back), batches as large as an engine's share of the calls. Elsewhere the
    engine's own defaults (one engine, ORT decoder workers, 64 rows): measured best on a CPU; on Apple
    silicon the CUDA choices are not measured, so the defaults stay."""
    if accelerator.kind != "cuda":
        return EngineProfile(1, DecoderConfig().mode, SchedulerConfig().max_batch)
    engines = max(1, min(CUDA_ENGINES, accelerator.memory_limit // ENGINE_MEMORY))
    return EngineProfile(engines, "device", CUDA_MAX_BATCH)


def this_process() -> Accelerator:
    """The device MLX's default stream runs on in this process (imports MLX)."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return Accelerator("cpu")
    cuda = getattr(mx, "cuda", None)  # not in every MLX build for Apple silicon
    kind: AcceleratorKind = "cuda" if cuda is not None and cuda.is_available() else "metal"
    return Accelerator(kind, int(mx.get_memory_limit()))


def probe(timeout_s: float = 120.0) -> Accelerator:
    """`this_process()` as a child interpreter of this Python sees it. Raises AcceleratorProbeError
    (with the child's last line of stderr) when the child fails, hangs or says something else."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "asr_core.accelerator"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise AcceleratorProbeError(f"no answer from the accelerator probe in {timeout_s:.0f} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise AcceleratorProbeError(f"the accelerator probe failed: {why}")
    try:
        answer = json.loads(lines[-1])
        kind, memory_limit = answer["kind"], int(answer["memory_limit"])
    except (ValueError, KeyError, TypeError):
        raise AcceleratorProbeError(f"the accelerator probe said {lines[-1]!r}") from None
    if kind not in KINDS:
        raise AcceleratorProbeError(f"the accelerator probe named an unknown kind {kind!r}")
    return Accelerator(kind, memory_limit)


if __name__ == "__main__":
    found = this_process()
    print(json.dumps({"kind": found.kind, "memory_limit": found.memory_limit}))
