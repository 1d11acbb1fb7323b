"""Batched torch front end for training: 8 kHz -> 16 kHz resampling and the model's exact log-mel.

Runs on the GPU machine (torch + numpy only). The log-mel is the one of `asr_core.features` / NeMo /
HF (model_spec.md §4): preemphasis 0.97, symmetric Hann 400 in a 512 FFT, hop 160, center with zero
padding, power spectrum, slaney mel (the bundle's `melfilters.f32`), log(x + 2^-24), no normalization;
`floor(L / 160)` valid frames, frames past them set to 0.0 (NeMo's pad value, which is also what the
offline causal subsampling sees past the end), so a padded batch gives each clip its unpadded features.

The gateway resamples 8 -> 16 kHz with soxr HQ. soxr is not on the GPU machine, so training uses a
linear-phase windowed-sinc FIR with the same band edges (pass to 0.91·4 kHz, stop from 4 kHz, Kaiser
window for ~120 dB); tests/tools/test_demo_model_frontend.py measures the log-mel difference to soxr.
"""

from __future__ import annotations

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 512
HOP = 160
WIN = 400
PREEMPHASIS = 0.97
LOG_GUARD = 2.0**-24


def upsample2_filter(taps: int = 361, beta: float = 12.0, cutoff_hz: float = 3826.0) -> np.ndarray:
    """Low-pass FIR at 16 kHz for 2x upsampling (gain 2 for the inserted zeros); odd length, centered."""
    n = np.arange(taps) - (taps - 1) / 2
    fc = cutoff_hz / SAMPLE_RATE
    h = 2 * fc * np.sinc(2 * fc * n) * np.kaiser(taps, beta)
    return (2.0 * h / h.sum()).astype(np.float64)


class Upsampler:
    """x (B, N) at 8 kHz -> (B, 2N) at 16 kHz, zero-delay (linear phase, centered)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        h = upsample2_filter()
        # Polyphase: even outputs use taps 0,2,4..., odd outputs taps 1,3,5... of the 16 kHz filter.
        self.half = (len(h) - 1) // 2
        self.weight = torch.tensor(h[::-1].copy(), dtype=torch.float32, device=device).view(1, 1, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape
        up = torch.zeros(b, 1, 2 * n, dtype=x.dtype, device=x.device)
        up[:, 0, ::2] = x
        up = torch.nn.functional.pad(up, (self.half, self.half))
        return torch.nn.functional.conv1d(up, self.weight.to(x.dtype)).view(b, 2 * n)


def frame_count(samples: torch.Tensor) -> torch.Tensor:
    return torch.div(samples, HOP, rounding_mode="floor")


class LogMel:
    """audio (B, N) float in [-1, 1] at 16 kHz + lengths (B,) -> (B, T, n_mels), frame lengths (B,)."""

    def __init__(self, filters: np.ndarray, device: torch.device | str = "cpu") -> None:
        if filters.shape[1] != N_FFT // 2 + 1:
            raise ValueError(f"mel filters must be (n_mels, {N_FFT // 2 + 1}), got {filters.shape}")
        self.filters = torch.tensor(filters, dtype=torch.float32, device=device)
        self.window = torch.hann_window(WIN, periodic=False, dtype=torch.float32, device=device)

    def __call__(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        audio = audio.float()
        steps = torch.arange(audio.shape[1], device=audio.device)
        valid = steps[None, :] < lengths[:, None]
        audio = torch.cat([audio[:, :1], audio[:, 1:] - PREEMPHASIS * audio[:, :-1]], dim=1)
        audio = audio.masked_fill(~valid, 0.0)
        spec = torch.stft(
            audio,
            N_FFT,
            hop_length=HOP,
            win_length=WIN,
            window=self.window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        power = spec.real.square() + spec.imag.square()
        mel = torch.log(torch.matmul(self.filters, power) + LOG_GUARD).transpose(1, 2)
        frames = frame_count(lengths)
        keep = torch.arange(mel.shape[1], device=mel.device)[None, :] < frames[:, None]
        mel = mel.masked_fill(~keep[:, :, None], 0.0)
        # Trim to the longest valid length (a center=True STFT has one frame more than floor(L/160)).
        return mel[:, : max(int(frames.max()), 1)].contiguous(), frames


def encoder_frames(mel_frames: torch.Tensor) -> torch.Tensor:
    """Encoder output length for mel lengths (three causal stride-2 convs: floor(L/2)+1, thrice)."""
    out = mel_frames
    for _ in range(3):
        out = torch.div(out, 2, rounding_mode="floor") + 1
    return out


def spec_augment(
    mel: torch.Tensor,
    frames: torch.Tensor,
    generator: torch.Generator,
    freq_masks: int = 2,
    freq_width: int = 15,
    time_masks: int = 2,
    time_ratio: float = 0.05,
) -> torch.Tensor:
    """SpecAugment (frequency and time masks), vectorized over the batch.

    Masks are filled with each clip's mean feature value: the features are not normalized, so 0.0
    (NeMo's fill for normalized features) would be a loud value here. `generator` is a CPU generator.
    """
    b, t, f = mel.shape
    dev = mel.device

    def draw(high: torch.Tensor | float, shape: tuple[int, ...]) -> torch.Tensor:
        u = torch.rand(shape, generator=generator)
        return (u * torch.as_tensor(high, dtype=torch.float32)).floor().long().to(dev)

    valid = torch.arange(t, device=dev)[None, :] < frames[:, None]  # (B, T)
    fill = (mel * valid[:, :, None]).sum(dim=(1, 2)) / (valid.sum(dim=1).clamp(min=1) * f)
    fw = draw(freq_width + 1, (b, freq_masks))
    f0 = (torch.rand((b, freq_masks), generator=generator).to(dev) * (f - fw).clamp(min=1)).floor().long()
    bins = torch.arange(f, device=dev)[None, None, :]
    fmask = ((bins >= f0[:, :, None]) & (bins < (f0 + fw)[:, :, None])).any(dim=1)  # (B, F)
    max_w = (frames.float() * time_ratio).floor().clamp(min=1).cpu()
    tw = draw(max_w[:, None] + 1, (b, time_masks))
    t0 = (
        (torch.rand((b, time_masks), generator=generator).to(dev) * (frames[:, None] - tw).clamp(min=1))
        .floor()
        .long()
    )
    steps = torch.arange(t, device=dev)[None, None, :]
    tmask = ((steps >= t0[:, :, None]) & (steps < (t0 + tw)[:, :, None])).any(dim=1)  # (B, T)
    mask = (fmask[:, None, :] | tmask[:, :, None]) & valid[:, :, None]
    return torch.where(mask, fill[:, None, None], mel)
