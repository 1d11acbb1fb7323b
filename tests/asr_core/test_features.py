"""Streaming log-mel: the reference recipe exactly, whatever the push pattern."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr_core.features import FeatureConfig, MelFrames, StreamingLogMel, log_mel
from tests.fixtures import peers
from tools.bundle.filters import slaney_mel_filters
from tools.bundle.probe import probe_audio

FILTERS = slaney_mel_filters()


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _float64_reference(x: np.ndarray) -> np.ndarray:
    """HF's recipe (preemphasis, centered zero-padded STFT, power, mel, log) in float64 through torch."""
    torch = peers.module("torch")
    xt = torch.from_numpy(x.astype(np.float64))
    y = torch.cat([xt[:1], xt[1:] - 0.97 * xt[:-1]])
    window = torch.hann_window(400, periodic=False, dtype=torch.float64)
    spec = torch.stft(y, 512, 160, 400, window=window, return_complex=True, pad_mode="constant", center=True)
    mel = torch.from_numpy(FILTERS.astype(np.float64)) @ spec.abs() ** 2
    return torch.log(mel + 2.0**-24).T.numpy()[: len(x) // 160]


@pytest.mark.parametrize("n_samples", [0, 1, 159, 160, 199, 200, 359, 360, 4040, 16037])
def test_a_stream_of_l_samples_has_floor_l_over_160_frames(n_samples: int) -> None:
    assert log_mel(_noise(n_samples), FILTERS).shape == (n_samples // 160, 128)


def test_frames_equal_the_float64_reference_recipe() -> None:
    x = probe_audio(2.0)
    np.testing.assert_allclose(log_mel(x, FILTERS), _float64_reference(x), rtol=0, atol=2e-6)


def test_frames_match_the_reference_feature_extractor() -> None:
    """HF computes in float32: its STFT rounding moves quiet bins (near the 2^-24 log floor) by up to
    ~2e-4 -- ours equals the float64 recipe (test above). So: 1e-4 wherever the log-mel is above -10,
    5e-4 everywhere."""
    transformers = peers.module("transformers")
    extractor = transformers.NemotronAsrStreamingFeatureExtractor(feature_size=128)
    for x in (probe_audio(3.0), _noise(48123)):
        ref = extractor(x, sampling_rate=16000, return_tensors="np")
        n = int(ref["attention_mask"].sum())
        ours, want = log_mel(x, FILTERS), ref["input_features"][0][:n]
        assert ours.shape[0] == n
        err = np.abs(ours - want)
        assert err.max() <= 5e-4
        assert err[want > -10].max() <= 1e-4


@settings(max_examples=40, deadline=None)
@given(
    n_samples=st.integers(0, 6000),
    cuts=st.lists(st.integers(0, 6000), max_size=12),
)
def test_any_push_pattern_gives_bit_identical_frames(n_samples: int, cuts: list[int]) -> None:
    x = _noise(n_samples, seed=n_samples)
    whole = log_mel(x, FILTERS)
    stream = StreamingLogMel(MelFrames(FILTERS))
    bounds = sorted({0, n_samples, *(c for c in cuts if c <= n_samples)})
    parts = [stream.push(x[a:b]) for a, b in itertools.pairwise(bounds)]
    parts.append(stream.finish())
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_streams_that_share_one_mel_math_each_get_their_own_audio_s_frames() -> None:
    """A model builds its `MelFrames` once and every stream's log-mel uses it, interleaved."""
    shared = MelFrames(FILTERS)
    audio = [_noise(5000 + 37 * i, seed=i) for i in range(3)]
    streams = [StreamingLogMel(shared) for _ in audio]
    parts: list[list[np.ndarray]] = [[] for _ in audio]
    for a, b in itertools.pairwise(range(0, 5200, 640)):
        for i, (stream, x) in enumerate(zip(streams, audio, strict=True)):
            parts[i].append(stream.push(x[a:b]))
    for i, (stream, x) in enumerate(zip(streams, audio, strict=True)):
        parts[i].append(stream.finish())
        np.testing.assert_array_equal(np.concatenate(parts[i]), log_mel(x, FILTERS))
    assert not shared.filters_t.flags.writeable and not shared.window.flags.writeable


def test_a_frame_is_released_as_soon_as_its_window_is_complete() -> None:
    """Frame t spans samples 160t-200 ... 160t+199, so it is final once sample 160t+199 is in."""
    stream = StreamingLogMel(MelFrames(FILTERS))
    x = _noise(4040)
    assert stream.push(x[:199]).shape[0] == 0
    assert stream.push(x[199:200]).shape[0] == 1
    assert stream.push(x[200:4040]).shape[0] == 24  # 25 frames: the first chunk at lookahead 3
    assert stream.frames_emitted == 25 and stream.samples_seen == 4040
    assert stream.finish().shape[0] == 0  # floor(4040 / 160) = 25: nothing left


def test_finish_emits_the_last_frame_over_zero_padding() -> None:
    stream = StreamingLogMel(MelFrames(FILTERS))
    x = _noise(330)  # floor(330/160) = 2 frames; frame 1 needs samples up to 359
    assert stream.push(x).shape[0] == 1
    last = stream.finish()
    assert last.shape[0] == 1
    np.testing.assert_array_equal(last, log_mel(x, FILTERS)[1:])
    assert stream.finish().shape[0] == 0
    with pytest.raises(RuntimeError):
        stream.push(x)


def test_int16_scaled_input_would_shift_every_feature() -> None:
    """The model expects floats in [-1, 1]; 32768x louder input moves the log-mel by log(32768^2)."""
    x = probe_audio(1.0)
    delta = log_mel(x * 32768, FILTERS) - log_mel(x, FILTERS)
    loud = log_mel(x, FILTERS) > -10  # well above the 2^-24 guard
    np.testing.assert_allclose(delta[loud], np.log(32768.0**2), atol=3e-3)  # the guard still adds a little


def test_config_from_the_bundle_features_block_and_filter_shape_check() -> None:
    cfg = FeatureConfig.from_dict(
        {"sampling_rate": 16000, "n_fft": 512, "n_mels": 128, "mel_scale": "slaney"}
    )
    assert cfg == FeatureConfig()
    with pytest.raises(ValueError, match="mel filters"):
        MelFrames(FILTERS.T.copy())
