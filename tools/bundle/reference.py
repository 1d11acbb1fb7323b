"""The reference implementation (HF transformers' `Nemotron3_5AsrForRNNT`) at a bundle's sizes.

`build_reference_model` makes the HF model of a `ModelSpec`, seeded, with the same weight scales as the
random bundles (drawn by torch, so they are not the numpy draws) and the same calibration; the
bundle written from it (`reference_bundle_weights`) then shares every weight with the model, which is
what the parity tests compare against. Needs torch + transformers (the `reference` extra).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from tools.bundle.spec import ModelSpec
from tools.bundle.weights import DEFAULT_TOKENS_PER_SECOND, calibrate, init_kind
from tools.bundle.writer import BundleWeights

if TYPE_CHECKING:
    import torch


def build_reference_model(
    spec: ModelSpec, seed: int, tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND
) -> Any:
    import torch
    from transformers import Nemotron3_5AsrConfig, Nemotron3_5AsrForRNNT

    torch.manual_seed(seed)
    model = Nemotron3_5AsrForRNNT(Nemotron3_5AsrConfig(**spec.hf_config())).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind, loc, scale = init_kind(name, tuple(param.shape))
            gen = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
            if kind == "zeros":
                param.zero_()
            elif kind == "uniform":
                param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) * scale)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * scale + loc)
        model.decoder.embedding.weight[spec.blank_id] = 0.0  # NeMo's blank_as_pad
        state = state_dict_numpy(model)
        calibrate(spec, state, state, tokens_per_second)
        params = dict(model.named_parameters())
        for name in (
            "encoder_projector.weight",
            "encoder_projector.bias",
            "joint.head.weight",
            "joint.head.bias",
        ):
            params[name].copy_(torch.from_numpy(state[name]))
    model.generation_config.decoder_start_token_id = spec.blank_id
    return model


def state_dict_numpy(model: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy().copy() for k, v in model.state_dict().items()}


def reference_bundle_weights(model: torch.nn.Module, spec: ModelSpec, seed: int) -> BundleWeights:
    state = state_dict_numpy(model)
    enc_names = spec.encoder_shapes()
    missing = [n for n in enc_names if n not in state] + [n for n in spec.rnnt_shapes() if n not in state]
    if missing:
        raise KeyError(f"reference model lacks tensors {missing[:3]} (transformers version?)")
    return BundleWeights(
        encoder=lambda: ((n, state[n]) for n in enc_names),
        rnnt={n: state[n] for n in spec.rnnt_shapes()},
        metadata={
            "weights": "reference",
            "seed": str(seed),
            "reference": "transformers Nemotron3_5AsrForRNNT",
        },
    )
