"""SpeechEndDetector: when the caller stopped speaking, decided from the audio alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asr_core.vad import FRAME_SAMPLES, EnergyClassifier, SpeechEndDetector, VadConfig

SR = 16000
CLIPS = Path(__file__).resolve().parents[2] / "asr_core" / "demo_model" / "clips"


def tone(seconds: float, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (level * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * SR), np.float32)


def energy_detector(**kw: int) -> SpeechEndDetector:
    cfg = VadConfig(kind="energy", **kw)
    return SpeechEndDetector(cfg, EnergyClassifier(cfg.energy_db))


def ends(det: SpeechEndDetector, audio: np.ndarray, sizes: list[int]) -> list[tuple[int, int]]:
    out, pos, k = [], 0, 0
    while pos < len(audio):
        n = sizes[k % len(sizes)]
        out += [(e.speech_end, e.decided_at) for e in det.push(audio[pos : pos + n])]
        pos, k = pos + n, k + 1
    return out


def test_speech_ends_after_the_hang_over_at_the_end_of_the_last_speech_frame() -> None:
    audio = np.concatenate([silence(0.5), tone(1.0), silence(0.5), tone(0.4), silence(1.0)])
    got = ends(energy_detector(hangover_ms=150), audio, [1280])
    assert got == [(24000, 24000 + 2400), (38400, 38400 + 2400)]


def test_decisions_do_not_depend_on_push_sizes() -> None:
    rng = np.random.default_rng(1)
    audio = np.concatenate([silence(0.3), tone(0.7), silence(0.25), tone(0.2), silence(0.8)])
    want = ends(energy_detector(), audio, [1280])
    assert want
    for _ in range(5):
        assert ends(energy_detector(), audio, rng.integers(1, 3000, size=20).tolist()) == want


def test_a_click_neither_opens_nor_extends_an_utterance() -> None:
    click = tone(0.03)  # shorter than min_speech_ms (60)
    assert ends(energy_detector(), np.concatenate([silence(0.5), click, silence(1.0)]), [1280]) == []
    audio = np.concatenate([silence(0.5), tone(1.0), silence(0.1), click, silence(1.0)])
    ((end, decided),) = ends(energy_detector(hangover_ms=200), audio, [1280])
    assert end == 24000 and decided == 24000 + 3200  # the click inside the hang-over does not count


def test_silent_since_a_decision_until_an_utterance_opens_after_it() -> None:
    det = energy_detector(hangover_ms=150)
    ((_, decided),) = ends(det, np.concatenate([silence(0.5), tone(1.0), silence(0.3)]), [1280])
    assert det.silent_since(decided)
    det.push(tone(0.03))  # a run too short to count yet: it may grow into speech
    assert not det.silent_since(decided)
    det.push(silence(0.1))  # it stayed a click
    assert det.silent_since(decided)
    det.push(np.concatenate([tone(0.2), silence(0.5)]))  # speech, and its own end
    assert not det.silent_since(decided)


def test_a_pause_shorter_than_the_hang_over_keeps_the_utterance_open() -> None:
    audio = np.concatenate([silence(0.5), tone(0.5), silence(0.14), tone(0.5), silence(1.0)])
    got = ends(energy_detector(hangover_ms=150), audio, [FRAME_SAMPLES * 3])
    assert len(got) == 1


def _clip() -> np.ndarray:
    from tools.transcribe import read_audio

    row = json.loads((CLIPS / "manifest.jsonl").read_text().splitlines()[1])
    return read_audio(CLIPS / row["audio"])


def test_webrtc_ends_speech_on_a_noisy_line_where_energy_alone_never_does() -> None:
    speech = _clip()
    rng = np.random.default_rng(0)
    rms = float(np.sqrt(np.mean(speech[np.abs(speech) > 0.01] ** 2)))
    noisy = speech + (rng.standard_normal(speech.size) * rms * 10 ** (-20 / 20)).astype(np.float32)
    line = np.concatenate([noisy, (rng.standard_normal(SR) * rms * 0.1).astype(np.float32)])
    assert ends(energy_detector(), line, [1280]) == []  # the noise floor stays above -45 dBFS
    got = ends(SpeechEndDetector(VadConfig()), line, [1280])
    assert got and got[-1][0] <= speech.size and got[-1][1] - got[-1][0] == 150 * SR // 1000


@pytest.mark.parametrize(
    "kw", [{"kind": "loud"}, {"hangover_ms": 5}, {"min_speech_ms": 0}, {"webrtc_mode": 4}]
)
def test_bad_settings_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        VadConfig(**kw)  # type: ignore[arg-type]
