"""The demo model: transformers' `Nemotron3_5AsrForRNNT` at a small size, plus the training-time pieces
that HF does not have (joint over the whole lattice, batched greedy decoding for on-device WER).

Using the HF class is what makes the tensor names exactly Nemotron's (model_spec.md §2.1): the export
path and the bundle loader then take this model like the real one. Same structure as the real model:
causal dw-striding subsampling (x8), rel-pos conformer blocks with chunked_limited attention (left 56),
causal depthwise conv with LayerNorm, no input scaling, the 128-slot language prompt after the encoder,
`encoder_projector`, a 2-layer LSTM prediction network and a ReLU joint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

LOOKAHEADS = (3, 0, 6, 13)  # the engine's supported list; first = default
PROMPTS = {"en-US": 0, "uk-UA": 19, "auto": 101}
NUM_PROMPTS = 128


@dataclass(frozen=True, slots=True)
class DemoConfig:
    hidden_size: int = 176
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 704
    conv_kernel_size: int = 9
    subsampling_channels: int = 64
    n_mels: int = 128
    decoder_hidden: int = 256
    decoder_layers: int = 2
    prompt_intermediate: int = 352
    dropout: float = 0.1
    max_symbols_per_step: int = 10

    def spec(self, vocab_size: int) -> Any:
        """The bundle writer's `ModelSpec` of this size; `vocab_size` includes blank (the last id)."""
        from tools.bundle.spec import ModelSpec

        return ModelSpec(
            name="demo",
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            conv_kernel_size=self.conv_kernel_size,
            subsampling_channels=self.subsampling_channels,
            n_mels=self.n_mels,
            vocab_size=vocab_size,
            decoder_hidden=self.decoder_hidden,
            decoder_layers=self.decoder_layers,
            prompt_intermediate=self.prompt_intermediate,
            num_prompts=NUM_PROMPTS,
            max_symbols_per_step=self.max_symbols_per_step,
        )

    def hf_config(self, vocab_size: int, training: bool = True) -> dict[str, Any]:
        """kwargs of `Nemotron3_5AsrConfig`: the bundle spec's, plus dropout while training and the demo's
        prompt slot for `auto`."""
        cfg: dict[str, Any] = self.spec(vocab_size).hf_config()
        drop = self.dropout if training else 0.0
        cfg["encoder_config"].update(dropout=drop, activation_dropout=drop, attention_dropout=drop)
        cfg.update(pad_token_id=0, default_prompt_id=PROMPTS["auto"])
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_model(cfg: DemoConfig, vocab_size: int, training: bool = True) -> Any:
    from transformers import Nemotron3_5AsrConfig, Nemotron3_5AsrForRNNT

    return Nemotron3_5AsrForRNNT(Nemotron3_5AsrConfig(**cfg.hf_config(vocab_size, training)))


def init_from_scratch(model: Any) -> Any:
    """Re-initialize every convolution, linear layer and LSTM with PyTorch's defaults (what NeMo trains from).

    transformers' `_init_weights` draws all of them from N(0, 0.02), which suits fine-tuning loaded weights
    but not training from scratch: the 3x3 subsampling convolutions (fan-in 9, default std ~0.2) shrink
    the log-mel by ~10^-6 over the three stages, far below the conformer LayerNorm's eps (sqrt 3e-3),
    so the encoder hands the joint almost no audio and the network settles on a language model of the
    labels (it decodes the same sentence for every clip). LayerNorms, the attention biases and the
    embeddings keep their HF values. Returns `model`.
    """
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear, torch.nn.LSTM)):
            module.reset_parameters()
    # The subsampling stack is five convolutions with ReLUs: with PyTorch's default init each one passes
    # ~1/6 of the signal's variance while its random bias adds a constant, so the conformer starts from
    # an input that is >99% the same for every clip (measured: audio-dependent variance 0.2% of the
    # encoder output) and the encoder learns as if deaf. He init with zero biases keeps the audio (20%).
    for module in model.encoder.subsampling.modules():
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        elif isinstance(module, torch.nn.Linear):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="linear")
        else:
            continue
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    return model


def encode(
    model: Any, mel: torch.Tensor, mel_frames: torch.Tensor, prompts: torch.Tensor, lookahead: int
) -> torch.Tensor:
    """(B, T, n_mels) log-mel -> (B, T', J) joiner inputs (prompted, through encoder_projector), offline
    with the chunked_limited mask of `lookahead` (== what the streaming engine computes chunk by chunk)."""
    return encode_with_hidden(model, mel, mel_frames, prompts, lookahead)[0]


def encode_with_hidden(
    model: Any, mel: torch.Tensor, mel_frames: torch.Tensor, prompts: torch.Tensor, lookahead: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode`, plus the conformer output before the prompt (B, T', hidden): what the training-only CTC
    head reads."""
    mask = (torch.arange(mel.shape[1], device=mel.device)[None, :] < mel_frames[:, None]).long()
    out = model.get_audio_features(
        input_features=mel, attention_mask=mask, prompt_ids=prompts, num_lookahead_tokens=lookahead
    )
    return out.pooler_output, out.last_hidden_state


def joint_lattice(
    model: Any,
    enc: torch.Tensor,
    targets: torch.Tensor,
    blank: int,
    history_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Raw joint logits over the whole (T', U+1) lattice: (B, T', U+1, V). The prediction network reads
    blank first (the start symbol, as at inference) and then the labels.

    `history_noise` (training only) replaces that share of the labels the prediction network *reads* by
    random pieces; the labels the loss scores stay right. With a few hundred sentence templates the
    prediction network otherwise becomes a template language model strong enough to outvote the audio:
    a held-out sentence that leaves the templates ("i need to | check the balance of my account") gets its
    tail deleted. Noisy history makes the joint lean on the encoder."""
    history = targets
    if history_noise > 0:
        # Drawn on the CPU (the generator is the CPU one SpecAugment uses), then moved.
        replace = torch.rand(targets.shape, generator=generator) < history_noise
        random_pieces = torch.randint(0, blank, targets.shape, generator=generator)  # never blank
        history = torch.where(replace.to(targets.device), random_pieces.to(targets.device), targets)
    start = torch.full((targets.shape[0], 1), blank, dtype=torch.long, device=targets.device)
    dec = model.decoder(torch.cat([start, history], dim=1))  # (B, U+1, J)
    return model.joint(decoder_hidden_states=dec[:, None, :, :], encoder_hidden_states=enc[:, :, None, :])


@torch.no_grad()
def greedy_decode(
    model: Any, enc: torch.Tensor, enc_frames: torch.Tensor, blank: int, max_symbols: int = 10
) -> list[list[int]]:
    """Batched RNN-T greedy (model_spec.md §6.2): per frame up to `max_symbols` emissions; the
    prediction network advances only on non-blank. Same semantics as the engine's ONNX decoder."""
    dec = model.decoder
    b = enc.shape[0]
    layers, hidden = dec.lstm.num_layers, dec.lstm.hidden_size
    h = torch.zeros(layers, b, hidden, device=enc.device, dtype=enc.dtype)
    c = torch.zeros_like(h)

    def step(
        tokens: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, (h2, c2) = dec.lstm(dec.embedding(tokens[:, None]), (h, c))
        return dec.decoder_projector(out[:, 0]), h2, c2

    dec_out, h, c = step(torch.full((b,), blank, dtype=torch.long, device=enc.device), h, c)
    hyps: list[list[int]] = [[] for _ in range(b)]
    for t in range(enc.shape[1]):
        active = t < enc_frames
        for _ in range(max_symbols):
            if not bool(active.any()):
                break
            logits = model.joint(decoder_hidden_states=dec_out, encoder_hidden_states=enc[:, t])
            k = logits.argmax(dim=-1)
            emit = active & (k != blank)
            if not bool(emit.any()):
                break
            new_out, h2, c2 = step(torch.where(emit, k, torch.full_like(k, blank)), h, c)
            sel = emit[:, None]
            dec_out = torch.where(sel, new_out, dec_out)
            h = torch.where(sel[None], h2, h)
            c = torch.where(sel[None], c2, c)
            for i in torch.nonzero(emit).flatten().tolist():
                hyps[i].append(int(k[i]))
            active = emit
    return hyps


class _StemWeight(torch.nn.Module):
    """conv_in.weight = V / std."""

    def __init__(self, std: float) -> None:
        super().__init__()
        self.std = std

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v / self.std

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.std


class _StemBias(torch.nn.Module):
    """conv_in.bias = c - (mean / std) * sum(V): the offset that raw log-mel (mean ~ -11) would add."""

    def __init__(self, conv: torch.nn.Module, mean: float, std: float) -> None:
        super().__init__()
        self.conv = [conv]  # a list: not a submodule (no cycle in the module tree)
        self.ratio = mean / std

    def _v_sum(self) -> torch.Tensor:
        v: Any = self.conv[0].parametrizations.weight.original  # type: ignore[union-attr]
        return torch.as_tensor(v).sum(dim=(1, 2, 3))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return c - self.ratio * self._v_sum()

    def right_inverse(self, b: torch.Tensor) -> torch.Tensor:
        return b + self.ratio * self._v_sum().detach()


def normalize_stem(model: Any, mean: float, std: float, reinit: bool = False) -> Any:
    """Train the first subsampling convolution as if its input were normalized log-mel, (x - mean) / std.

    The model reads raw log-mel (no normalization, as the real model and the engine), whose large common
    offset dominates the stem's output and slows learning several times over (a BiLSTM probe on this
    corpus: dev CTC 3.0 vs 4.3 after 900 steps). A reparameterization keeps the computation exactly the
    bundle's convolution on raw features (`stem_state` exports its effective weight and bias under the HF
    names) while the optimizer works on normalized parameters. Call after loading any weights; `reinit`
    (a model trained from scratch) draws the stem anew, He init over normalized features. Returns `model`."""
    from torch.nn.utils import parametrize

    conv = model.encoder.subsampling.conv_in
    parametrize.register_parametrization(conv, "weight", _StemWeight(std))
    parametrize.register_parametrization(conv, "bias", _StemBias(conv, mean, std))
    if reinit:  # from scratch: He init in the normalized space (a raw-space He init is offset-dominated)
        with torch.no_grad():
            torch.nn.init.kaiming_normal_(conv.parametrizations.weight.original, nonlinearity="relu")
            conv.parametrizations.bias.original.zero_()
    return model


def export_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict under the HF names, with a normalized stem folded back into conv_in."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".parametrizations." not in name:
            out[name] = tensor
    conv = model.encoder.subsampling.conv_in
    if hasattr(conv, "parametrizations"):
        out["encoder.subsampling.conv_in.weight"] = conv.weight.detach()
        out["encoder.subsampling.conv_in.bias"] = conv.bias.detach()
    return out
