"""The training front end computes the engine's features: same log-mel, and 8->16 kHz close to soxr."""

from __future__ import annotations

import numpy as np
import pytest
import soxr
import torch

from asr_core.features import log_mel
from tools.bundle.filters import slaney_mel_filters
from tools.demo_model import corpus, frontend

FILTERS = slaney_mel_filters(16000, 512, 128, 0.0, 8000.0)

pytestmark = pytest.mark.reference  # torch + transformers


@pytest.fixture(scope="module")
def speech_8k() -> list[np.ndarray]:
    return [corpus.synthesize(u) for u in corpus.plan("test", 3, 0.34, seed=5)]


def test_training_log_mel_equals_asr_core_features_on_a_padded_batch(speech_8k: list[np.ndarray]) -> None:
    audio16 = [soxr.resample(a, 8000, 16000, "HQ").astype(np.float32) for a in speech_8k] + [
        np.zeros(159, np.float32)
    ]
    n = max(len(a) for a in audio16)
    batch = torch.zeros(len(audio16), n)
    for i, a in enumerate(audio16):
        batch[i, : len(a)] = torch.from_numpy(a)
    mel, frames = frontend.LogMel(FILTERS)(batch, torch.tensor([len(a) for a in audio16]))
    for i, a in enumerate(audio16):
        want = log_mel(a, FILTERS)
        assert int(frames[i]) == len(want) == len(a) // 160
        np.testing.assert_allclose(mel[i, : len(want)].numpy(), want, atol=2e-4)
        # Past a clip's frames the batch holds NeMo's pad value, what the offline subsampling sees.
        assert torch.all(mel[i, len(want) :] == 0.0)


def test_fir_upsampler_is_within_a_hair_of_soxr_hq_in_the_speech_band(speech_8k: list[np.ndarray]) -> None:
    up = frontend.Upsampler()
    lm = frontend.LogMel(FILTERS)
    for a in speech_8k:
        ref = soxr.resample(a, 8000, 16000, "HQ").astype(np.float32)
        ours = up(torch.from_numpy(a)[None])[0].numpy()
        assert ours.shape == ref.shape
        assert np.sqrt(np.mean((ours - ref) ** 2) / np.mean(ref**2)) < 1e-3  # better than -60 dB
        n = torch.tensor([len(ref)])
        d = np.abs(
            lm(torch.from_numpy(ours)[None], n)[0][0].numpy()
            - lm(torch.from_numpy(ref)[None], n)[0][0].numpy()
        )
        # Mel bins below 4 kHz (0..59) carry the telephone band; above it both are at the log floor.
        assert d[:, :60].max() < 0.05
        assert d.mean() < 5e-3


def test_spec_augment_masks_only_valid_frames_with_the_clip_mean() -> None:
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(3, 80, 128)
    frames = torch.tensor([80, 30, 0])
    out = frontend.spec_augment(mel, frames, g, time_ratio=0.1)
    changed = out != mel
    assert not changed[1, 30:].any() and not changed[2].any()
    assert changed[0].any()
    fill = mel[0].mean()
    assert torch.allclose(out[0][changed[0]], fill.expand(int(changed[0].sum())))


def test_encoder_frame_count_is_the_causal_subsampling_length() -> None:
    from tools.demo_model.model import DemoConfig, build_model

    mel = torch.arange(1, 300)
    # floor(L/2)+1 three times (kernel 3, stride 2, causal padding (2, 1)): 1+8r mel frames -> r+1.
    assert frontend.encoder_frames(torch.tensor([1, 9, 25, 49, 105])).tolist() == [1, 2, 4, 7, 14]
    model = build_model(DemoConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), 16)
    assert torch.equal(frontend.encoder_frames(mel), model._get_subsampling_output_length(mel).long())
