"""Sizes of a bundle's model: the real 0.6B shapes (`full`) and a small config for tests (`tiny`).

One `ModelSpec` gives everything the writer needs: the HF tensor names and PyTorch shapes of
`encoder.safetensors` (642 tensors at full size, model_spec.md §2.1), the prediction network and joint
shapes that go into the ONNX graphs, the HF `Nemotron3_5AsrConfig` dict of the same model (for the
reference), and the bundle's `nemotron_onnx_config.json`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tools.bundle.prompts import AUTO_PROMPT_ID, NUM_PROMPTS, PROMPT_DICTIONARY

LEFT_CONTEXT_FRAMES = 56
SUPPORTED_LOOKAHEADS = (3, 0, 6, 13)  # first entry = default (NeMo att_context_size order)
CHUNK_MS_TO_LOOKAHEAD = {80: 0, 160: 1, 320: 3, 560: 6, 1120: 13}

FEATURES: dict[str, Any] = {
    "sampling_rate": 16000,
    "n_fft": 512,
    "hop_length": 160,
    "win_length": 400,
    "n_mels": 128,
    "preemphasis": 0.97,
    "log_zero_guard": 2.0**-24,
    "mel_norm": "slaney",
    "mel_scale": "slaney",
    "fmin": 0.0,
    "fmax": 8000.0,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int  # encoder d_model
    num_layers: int
    num_heads: int
    intermediate_size: int
    conv_kernel_size: int
    subsampling_channels: int
    n_mels: int
    vocab_size: int  # including blank (the last id)
    decoder_hidden: int  # LSTM width = joint width J
    decoder_layers: int
    prompt_intermediate: int
    num_prompts: int = NUM_PROMPTS
    subsampling_factor: int = 8
    max_symbols_per_step: int = 10

    @property
    def blank_id(self) -> int:
        return self.vocab_size - 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def subsampled_freq(self) -> int:
        # Causal Conv2d stages: pad (2 left, 1 right), kernel 3, stride 2 -> 128 -> 65 -> 33 -> 17.
        f = self.n_mels
        for _ in range(int(math.log2(self.subsampling_factor))):
            f = (f + 3 - 3) // 2 + 1
        return f

    def encoder_config(self, output_size: int | None = None) -> Any:
        """asr_core's `EncoderConfig` of this model (what the loader would make of the bundle);
        `output_size` overrides encoder_projector's width (default: the joint's)."""
        from asr_core.bundle import EncoderConfig

        return EncoderConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            conv_kernel_size=self.conv_kernel_size,
            subsampling_factor=self.subsampling_factor,
            subsampling_conv_channels=self.subsampling_channels,
            n_mels=self.n_mels,
            left_context_frames=LEFT_CONTEXT_FRAMES,
            num_prompts=self.num_prompts,
            prompt_intermediate_size=self.prompt_intermediate,
            output_size=self.decoder_hidden if output_size is None else output_size,
            supported_lookaheads=SUPPORTED_LOOKAHEADS,
            default_lookahead=SUPPORTED_LOOKAHEADS[0],
        )

    def encoder_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF names -> PyTorch shapes of every tensor of encoder.safetensors, in a fixed order."""
        d, c, ff = self.hidden_size, self.subsampling_channels, self.intermediate_size
        out: dict[str, tuple[int, ...]] = {
            "encoder.subsampling.conv_in.weight": (c, 1, 3, 3),
            "encoder.subsampling.conv_in.bias": (c,),
        }
        for i in range(int(math.log2(self.subsampling_factor)) - 1):
            p = f"encoder.subsampling.layers.{i}"
            out[f"{p}.depthwise_conv.weight"] = (c, 1, 3, 3)
            out[f"{p}.depthwise_conv.bias"] = (c,)
            out[f"{p}.pointwise_conv.weight"] = (c, c, 1, 1)
            out[f"{p}.pointwise_conv.bias"] = (c,)
        out["encoder.subsampling.linear.weight"] = (d, c * self.subsampled_freq)
        out["encoder.subsampling.linear.bias"] = (d,)
        for n in range(self.num_layers):
            p = f"encoder.layers.{n}"
            for norm in (
                "norm_feed_forward1",
                "norm_self_att",
                "norm_conv",
                "norm_feed_forward2",
                "norm_out",
            ):
                out[f"{p}.{norm}.weight"] = (d,)
                out[f"{p}.{norm}.bias"] = (d,)
            for ffn in ("feed_forward1", "feed_forward2"):
                out[f"{p}.{ffn}.linear1.weight"] = (ff, d)
                out[f"{p}.{ffn}.linear2.weight"] = (d, ff)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "relative_k_proj"):
                out[f"{p}.self_attn.{proj}.weight"] = (d, d)
            out[f"{p}.self_attn.bias_u"] = (self.num_heads, self.head_dim)
            out[f"{p}.self_attn.bias_v"] = (self.num_heads, self.head_dim)
            out[f"{p}.conv.pointwise_conv1.weight"] = (2 * d, d, 1)
            out[f"{p}.conv.depthwise_conv.weight"] = (d, 1, self.conv_kernel_size)
            out[f"{p}.conv.norm.weight"] = (d,)
            out[f"{p}.conv.norm.bias"] = (d,)
            out[f"{p}.conv.pointwise_conv2.weight"] = (d, d, 1)
        pi, j = self.prompt_intermediate, self.decoder_hidden
        out["prompt_projector.linear_1.weight"] = (pi, d + self.num_prompts)
        out["prompt_projector.linear_1.bias"] = (pi,)
        out["prompt_projector.linear_2.weight"] = (d, pi)
        out["prompt_projector.linear_2.bias"] = (d,)
        out["encoder_projector.weight"] = (j, d)
        out["encoder_projector.bias"] = (j,)
        return out

    def rnnt_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF names -> shapes of the prediction network and joint (they live in the ONNX graphs)."""
        h, v = self.decoder_hidden, self.vocab_size
        out: dict[str, tuple[int, ...]] = {"decoder.embedding.weight": (v, h)}
        for layer in range(self.decoder_layers):
            out[f"decoder.lstm.weight_ih_l{layer}"] = (4 * h, h)
            out[f"decoder.lstm.weight_hh_l{layer}"] = (4 * h, h)
            out[f"decoder.lstm.bias_ih_l{layer}"] = (4 * h,)
            out[f"decoder.lstm.bias_hh_l{layer}"] = (4 * h,)
        out["decoder.decoder_projector.weight"] = (h, h)
        out["decoder.decoder_projector.bias"] = (h,)
        out["joint.head.weight"] = (v, h)
        out["joint.head.bias"] = (v,)
        return out

    def hf_config(self) -> dict[str, Any]:
        """Keyword arguments of transformers' `Nemotron3_5AsrConfig` for this model (no dropout)."""
        encoder = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "convolution_bias": False,
            "conv_kernel_size": self.conv_kernel_size,
            "subsampling_factor": self.subsampling_factor,
            "subsampling_conv_channels": self.subsampling_channels,
            "num_mel_bins": self.n_mels,
            "subsampling_conv_kernel_size": 3,
            "subsampling_conv_stride": 2,
            "max_position_embeddings": 5000,
            "scale_input": False,
            "sliding_window": LEFT_CONTEXT_FRAMES + 1,
            "default_num_lookahead_tokens": SUPPORTED_LOOKAHEADS[0],
            "dropout": 0.0,
            "dropout_positions": 0.0,
            "layerdrop": 0.0,
            "activation_dropout": 0.0,
            "attention_dropout": 0.0,
        }
        return {
            "encoder_config": encoder,
            "vocab_size": self.vocab_size,
            "blank_token_id": self.blank_id,
            "decoder_hidden_size": self.decoder_hidden,
            "num_decoder_layers": self.decoder_layers,
            "max_symbols_per_step": self.max_symbols_per_step,
            "num_prompts": self.num_prompts,
            "prompt_intermediate_size": self.prompt_intermediate,
            "default_prompt_id": AUTO_PROMPT_ID,
        }

    def cache_shapes(self) -> dict[str, list[int]]:
        """Per-stream streaming state at batch 1 (the published export's names, model_spec.md §5.2)."""
        out: dict[str, list[int]] = {}
        for kv in ("k", "v"):
            for i in range(self.num_layers):
                out[f"{kv}_cache_{i}"] = [1, self.num_heads, LEFT_CONTEXT_FRAMES, self.head_dim]
        freq, channels = self.n_mels, 1
        for i in range(int(math.log2(self.subsampling_factor))):
            out[f"conv2d_cache_{i}"] = [1, channels, 1, freq + 3]  # one time row after (2,1) freq padding
            freq, channels = (freq + 3 - 3) // 2 + 1, self.subsampling_channels
        for i in range(self.num_layers):
            out[f"conv1d_cache_{i}"] = [1, self.hidden_size, self.conv_kernel_size - 1]
        return out

    def onnx_config(
        self, prompt_dictionary: Mapping[str, int] | None = None, default_prompt_id: int = AUTO_PROMPT_ID
    ) -> dict[str, Any]:
        """The bundle's nemotron_onnx_config.json (published keys plus our optional extensions)."""
        return {
            "model_type": "nemotron3_5_asr",
            "vocab_size": self.vocab_size,
            "blank_token_id": self.blank_id,
            "pad_token_id": 0,
            "decoder_hidden_size": self.decoder_hidden,
            "num_decoder_layers": self.decoder_layers,
            "max_symbols_per_step": self.max_symbols_per_step,
            "num_prompts": self.num_prompts,
            "default_prompt_id": default_prompt_id,
            "prompt_dictionary": dict(PROMPT_DICTIONARY if prompt_dictionary is None else prompt_dictionary),
            "encoder": {
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "subsampling_factor": self.subsampling_factor,
                "left_context_frames": LEFT_CONTEXT_FRAMES,
                "frame_ms": 80.0,
                "intermediate_size": self.intermediate_size,
                "conv_kernel_size": self.conv_kernel_size,
                "subsampling_conv_channels": self.subsampling_channels,
                "scale_input": False,
                "supported_lookaheads": list(SUPPORTED_LOOKAHEADS),
                "default_lookahead": SUPPORTED_LOOKAHEADS[0],
                "prompt_intermediate_size": self.prompt_intermediate,
            },
            "features": dict(FEATURES, n_mels=self.n_mels),
            "chunk_ms_to_lookahead": {str(k): v for k, v in CHUNK_MS_TO_LOOKAHEAD.items()},
            "exported_chunk_ms": [320],
            "cache_shapes": self.cache_shapes(),
        }


FULL = ModelSpec(
    name="full",
    hidden_size=1024,
    num_layers=24,
    num_heads=8,
    intermediate_size=4096,
    conv_kernel_size=9,
    subsampling_channels=256,
    n_mels=128,
    vocab_size=13088,
    decoder_hidden=640,
    decoder_layers=2,
    prompt_intermediate=2048,
)

# Small enough for CI (a few hundred kB), but every structural feature of the real model is present:
# 2 conformer layers, 4 heads, both subsampling stages, a 2-layer LSTM and a vocabulary with tag pieces.
TINY = ModelSpec(
    name="tiny",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    intermediate_size=256,
    conv_kernel_size=9,
    subsampling_channels=16,
    n_mels=128,
    vocab_size=257,
    decoder_hidden=64,
    decoder_layers=2,
    prompt_intermediate=96,
)

SPECS: dict[str, ModelSpec] = {"tiny": TINY, "full": FULL}
