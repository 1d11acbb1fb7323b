"""Demo corpus audio: G.711 tables, the telephone channel, the packed splits, espeak-ng synthesis."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import peers
from tools.demo_model import augment, corpus, data, g711

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ALL_PCM = np.arange(-32768, 32768, dtype=np.int16)


@pytest.mark.parametrize(
    ("law", "enc", "dec"), [("ulaw", "lin2ulaw", "ulaw2lin"), ("alaw", "lin2alaw", "alaw2lin")]
)
def test_g711_tables_match_the_reference_codec_on_every_sample_and_code(law: str, enc: str, dec: str) -> None:
    ref = peers.module("audioop")  # deprecated, but the stdlib's G.711 is an independent reference

    codes = np.frombuffer(getattr(ref, enc)(ALL_PCM.tobytes(), 2), dtype=np.uint8)
    ours = g711.ulaw_encode(ALL_PCM) if law == "ulaw" else g711.alaw_encode(ALL_PCM)
    np.testing.assert_array_equal(ours, codes)
    every = np.arange(256, dtype=np.uint8)
    linear = np.frombuffer(getattr(ref, dec)(every.tobytes(), 2), dtype=np.int16)
    np.testing.assert_array_equal(
        g711.ulaw_decode(every) if law == "ulaw" else g711.alaw_decode(every), linear
    )


def test_packet_loss_keeps_the_timeline_and_loses_about_the_asked_share() -> None:
    rng = np.random.default_rng(0)
    audio = np.ones(160 * 5000, np.float32)
    out = augment.packet_loss(audio, rng, loss_rate=0.05, conceal="zero")
    assert out.shape == audio.shape
    lost = float(np.mean(out.reshape(-1, 160)[:, 0] == 0.0))
    assert 0.035 < lost < 0.065


def test_repeat_concealment_replays_the_last_good_frame_faded() -> None:
    rng = np.random.default_rng(1)
    audio = np.random.default_rng(2).standard_normal(160 * 400).astype(np.float32)
    out = augment.packet_loss(audio, rng, loss_rate=0.1, burst=0.0, conceal="repeat").reshape(-1, 160)
    frames = audio.reshape(-1, 160)
    changed = [i for i in range(1, len(frames)) if not np.array_equal(out[i], frames[i])]
    assert changed
    for i in changed:
        if np.array_equal(out[i - 1], frames[i - 1]):  # first frame of a loss run
            np.testing.assert_allclose(out[i], 0.5 * frames[i - 1])


@pytest.mark.parametrize("kind", ["white", "pink", "brown", "hum"])
def test_noise_is_added_at_the_requested_snr(kind: str) -> None:
    rng = np.random.default_rng(3)
    speech = (0.1 * np.sin(np.arange(16000) * 0.05)).astype(np.float32)
    noisy = augment.add_noise(
        speech, rng, snr_db=10.0, sample_rate=8000, kind=kind, speech_rms=augment.rms(speech)
    )
    snr = 20 * np.log10(augment.rms(speech) / augment.rms(noisy - speech))
    assert snr == pytest.approx(10.0, abs=0.05)


def test_telephone_channel_output_is_a_g711_signal_with_the_speech_inside() -> None:
    rng = np.random.default_rng(4)
    clean = augment.normalize_level(np.random.default_rng(5).standard_normal(8000).astype(np.float32))
    for _ in range(5):
        out = augment.telephone_channel(clean, rng, strength=1.0)
        assert len(out) >= len(clean)
        codes = g711.to_int16(out)
        assert np.all(np.abs(out) <= 1.0)
        # Every sample is a value some G.711 code decodes to (µ-law or A-law).
        values = set(g711.ULAW_DECODE.tolist()) | set(g711.ALAW_DECODE.tolist())
        assert set(np.unique(codes).tolist()) <= values


def test_packed_split_round_trips_labels_and_mu_law_audio(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    clips = [augment.normalize_level(rng.standard_normal(n).astype(np.float32)) for n in (800, 1, 4000)]
    size = data.pack_split(
        tmp_path / "s.npz", clips, ["one", "два", "three"], ["en-US", "uk-UA", "en-US"], ["a", "b", "c"]
    )
    assert size == (tmp_path / "s.npz").stat().st_size
    split = data.load_split(tmp_path / "s.npz")
    assert split.texts == ["one", "два", "three"] and split.langs == ["en-US", "uk-UA", "en-US"]
    for got, want in zip(split.clips, clips, strict=True):
        np.testing.assert_array_equal(got, g711.round_trip(want, "ulaw"))


def test_training_shards_are_new_draws_that_join_into_one_set(tmp_path: Path) -> None:
    first, second = corpus.plan("train", 40, 0.15, seed=5), corpus.plan("train", 40, 0.15, seed=5, shard=1)
    assert {u.text for u in first} != {u.text for u in second}
    assert not {u.uid for u in first} & {u.uid for u in second}
    clip = np.zeros(80, np.float32)
    parts = [data.Split([clip], ["one"], ["en-US"], [u]) for u in ("a", "b")]
    joined = data.join_splits(parts)
    assert joined.uids == ["a", "b"] and joined.texts == ["one", "one"]
    with pytest.raises(ValueError, match="share clip ids"):
        data.join_splits([parts[0], parts[0]])


def test_test_voices_are_settings_training_never_uses() -> None:
    train, test = corpus.VOICES["train"], corpus.VOICES["test"]
    for key in ("variant", "speed", "pitch"):
        assert not set(train[key]) & set(test[key]), key
    assert not set(train["variant_extra"]) & set(test["variant"])
    rng = random.Random(0)
    heard = {corpus.pick_voice(rng, "en", "dev").variant for _ in range(400)}
    assert heard <= set(train["variant"]) | set(train["variant_extra"])
    assert heard & set(train["variant"]) and heard & set(train["variant_extra"])
    assert {corpus.pick_voice(rng, "en", "test").variant for _ in range(50)} <= set(test["variant"])


def test_espeak_synthesis_gives_trimmed_8khz_speech_at_the_target_level() -> None:
    utt = corpus.plan("test", 1, 0.0, seed=11)[0]
    audio = corpus.synthesize(utt)
    assert audio.dtype == np.float32
    words = len(utt.text.split())
    assert 0.15 * words < len(audio) / corpus.SAMPLE_RATE < 1.0 * words + 1
    assert augment.rms(audio) == pytest.approx(10 ** (-20 / 20), rel=0.3)
    assert np.max(np.abs(audio)) <= 0.9 + 1e-6


def test_the_espeak_bundle_speaks_the_same_waveforms_without_the_systems_espeak(tmp_path: Path) -> None:
    """tools/demo_model/espeak_bundle.sh: what lets the GPU machine (no espeak-ng there) build shards."""
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    bundle = tmp_path / "esp"
    subprocess.run(
        [str(repo / "tools/demo_model/espeak_bundle.sh"), str(bundle)], check=True, capture_output=True
    )
    args = ["-v", "uk+m4", "-s", "155", "--stdout", "мій телефон два сім"]
    # A bare environment: no PATH, no ESPEAK_DATA_PATH; the wrapper finds its own libraries and data.
    ours = subprocess.run(
        [str(bundle / "bin/espeak-ng"), *args], check=True, capture_output=True, env={}
    ).stdout
    system = subprocess.run(["espeak-ng", *args], check=True, capture_output=True).stdout
    assert len(ours) > 10_000 and ours == system
