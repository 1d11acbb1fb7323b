"""Does a checkpoint's encoder listen? Module by module: how much of the difference between real clips and
the same clips with the audio zeroed is left after it. A model that ignores the audio (the collapsed GPU
runs in docs/demo-model.md) still differs after the subsampling and then loses it block by block; at the
encoder output the difference is ~0.

    python -m tools.demo_model.listen var/demo/run6 [--data var/demo/carry] [--clips 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.demo_model import data
from tools.demo_model.model import PROMPTS, build_model, encode


@dataclass(frozen=True, slots=True)
class Row:
    module: str
    rms: float  # of the module's output on the real clips
    difference: float  # |real - zeroed| / |real| over the batch (relative L2)


def audio_dependence(
    model: Any, mel: torch.Tensor, silent_mel: torch.Tensor, frames: torch.Tensor, prompts: torch.Tensor
) -> list[Row]:
    """One forward pass on the real features and one on the zeroed audio's, every subsampling and
    conformer sub-module hooked, plus the encoder output."""
    outputs: dict[str, list[torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(_module: Any, _inputs: Any, out: Any) -> None:
            outputs.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out).detach())

        return hook

    handles = [model.encoder.subsampling.register_forward_hook(keep("subsampling"))]
    for k, block in enumerate(model.encoder.layers):
        handles += [m.register_forward_hook(keep(f"block{k}.{n}")) for n, m in block.named_children()]
    try:
        with torch.no_grad():
            for features in (mel, silent_mel):
                out = encode(model, features, frames, prompts, 3)
                outputs.setdefault("encoder output", []).append(out)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, (real, zero) in outputs.items():
        diff = float((real - zero).norm() / real.norm().clamp(min=1e-12))
        rows.append(Row(name, float(real.pow(2).mean().sqrt()), diff))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from tools.demo_model.package import checkpoint_config
    from tools.demo_model.train import Frontend, collate, read_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a train.py output folder")
    p.add_argument("--data", type=Path, default=Path("var/demo/carry"))
    p.add_argument("--clips", type=int, default=16, help="dev clips to compare")
    args = p.parse_args(argv)
    state, progress, _, _ = read_checkpoint(args.checkpoint)
    vocab = state["joint.head.weight"].shape[0]
    model = build_model(checkpoint_config(args.checkpoint), vocab, training=False)
    model.load_state_dict(state)
    model.eval()
    dev = data.load_split(args.data / "dev.npz")
    filters = np.fromfile(args.data / "melfilters.f32", dtype="<f4").reshape(128, 257)
    fe = Frontend(filters, "cpu")
    n = min(args.clips, len(dev))
    batch = collate(dev.clips[:n], [[1]] * n, [PROMPTS[lang] for lang in dev.langs[:n]])
    mel, frames = fe(batch["audio"], batch["audio_len"])
    silent, _ = fe(torch.zeros_like(batch["audio"]), batch["audio_len"])
    print(f"{args.checkpoint}: step {progress.get('step')}, {n} dev clips vs the same clips zeroed")
    print(f"{'module':32s} {'rms':>10s} {'difference':>11s}")
    for row in audio_dependence(model, mel, silent, frames, batch["prompts"]):
        print(f"{row.module:32s} {row.rms:10.4g} {row.difference:11.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
