"""Telephone-channel augmentation for the demo corpus (numpy only: it also runs on the GPU machine).

The chain follows a real call: line silence around the speech, level change (a quiet or hot caller,
clipping at the codec), band limiting, noise at a given SNR, G.711 µ-law/A-law, and packet loss that the
receiver conceals (20 ms frames: repeat of the last good frame, faded, or silence). All in 8 kHz float32.
"""

from __future__ import annotations

import numpy as np

from tools.demo_model import g711

FRAME_8K = 160  # one 20 ms RTP packet of G.711 at 8 kHz


def to_pcm16(audio: np.ndarray) -> np.ndarray:
    return g711.to_int16(audio)


def trim_silence(
    audio: np.ndarray, sample_rate: int, threshold_db: float = -45.0, margin_s: float = 0.05
) -> np.ndarray:
    """Cut leading/trailing samples quieter than `threshold_db` below the peak (keeping a margin)."""
    if audio.size == 0:
        return audio
    peak = float(np.max(np.abs(audio)))
    if peak == 0.0:
        return audio[:0]
    loud = np.nonzero(np.abs(audio) > peak * 10 ** (threshold_db / 20))[0]
    margin = int(margin_s * sample_rate)
    return audio[max(loud[0] - margin, 0) : loud[-1] + margin + 1]


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if audio.size else 0.0


def normalize_level(audio: np.ndarray, rms_db: float = -20.0, peak_max: float = 0.9) -> np.ndarray:
    """Scale to `rms_db` dBFS RMS, lowered if needed so the peak stays under `peak_max`."""
    level = rms(audio)
    if level == 0.0:
        return audio.astype(np.float32)
    gain = 10 ** (rms_db / 20) / level
    peak = float(np.max(np.abs(audio))) * gain
    if peak > peak_max:
        gain *= peak_max / peak
    return (audio * gain).astype(np.float32)


def apply_gain_db(audio: np.ndarray, gain_db: float) -> np.ndarray:
    return (audio * 10 ** (gain_db / 20)).astype(np.float32)


def _colored_noise(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Noise with power spectrum ~ 1/f^exponent (0 white, 1 pink, 2 brown), unit RMS."""
    white = rng.standard_normal(n)
    if exponent == 0.0 or n < 4:
        return white / max(rms(white), 1e-12)
    spectrum = np.fft.rfft(white)
    freqs = np.arange(spectrum.size, dtype=np.float64)
    freqs[0] = 1.0
    shaped = np.fft.irfft(spectrum / freqs ** (exponent / 2), n)
    return shaped / max(rms(shaped), 1e-12)


def _hum(rng: np.random.Generator, n: int, sample_rate: int) -> np.ndarray:
    """Mains hum with harmonics plus a little hiss: what a bad line or a cheap headset adds."""
    t = np.arange(n) / sample_rate
    mains = rng.choice([50.0, 60.0])
    phases = rng.uniform(0, 2 * np.pi, 6)
    hum = sum(np.sin(2 * np.pi * mains * k * t + phases[k - 1]) / k for k in range(1, 7))
    hum = hum + 0.1 * rng.standard_normal(n)
    return hum / max(rms(hum), 1e-12)


def add_noise(
    audio: np.ndarray,
    rng: np.random.Generator,
    snr_db: float,
    sample_rate: int,
    kind: str | None = None,
    babble: np.ndarray | None = None,
    speech_rms: float | None = None,
) -> np.ndarray:
    """Add noise at `snr_db` relative to the speech RMS (`speech_rms`, else the RMS of the loud part)."""
    n = audio.size
    if speech_rms is None:
        loud = audio[np.abs(audio) > 0.1 * max(float(np.max(np.abs(audio))), 1e-9)] if n else audio
        speech_rms = rms(loud) if loud.size else rms(audio)
    kinds = ["white", "pink", "brown", "hum"] + (["babble"] if babble is not None and babble.size else [])
    kind = kind or str(rng.choice(kinds))
    if kind == "babble" and babble is not None and babble.size:
        reps = int(np.ceil(n / babble.size))
        noise = np.tile(babble, reps)[:n].astype(np.float64)
        noise = noise / max(rms(noise), 1e-12)
    elif kind == "hum":
        noise = _hum(rng, n, sample_rate)
    else:
        noise = _colored_noise(rng, n, {"white": 0.0, "pink": 1.0, "brown": 2.0}[kind])
    scale = speech_rms * 10 ** (-snr_db / 20)
    return (audio + scale * noise).astype(np.float32)


def bandpass_telephone(
    audio: np.ndarray, sample_rate: int, low: float = 300.0, high: float = 3400.0
) -> np.ndarray:
    """The classic 300-3400 Hz telephone band (windowed-sinc FIR, 101 taps)."""
    taps = 101
    t = np.arange(taps) - (taps - 1) / 2

    def lowpass(fc: float) -> np.ndarray:
        return 2 * fc / sample_rate * np.sinc(2 * fc / sample_rate * t)

    h = (lowpass(high) - lowpass(low)) * np.hamming(taps)
    return np.convolve(audio, h, mode="same").astype(np.float32)


def g711_round_trip(audio: np.ndarray, law: str) -> np.ndarray:
    return g711.round_trip(audio, law)


def packet_loss(
    audio: np.ndarray,
    rng: np.random.Generator,
    loss_rate: float,
    burst: float = 0.3,
    conceal: str = "repeat",
    frame: int = FRAME_8K,
) -> np.ndarray:
    """Drop 20 ms frames (Gilbert model: mean loss `loss_rate`, P(loss | loss) = `burst`) and conceal.

    "repeat": the last good frame again, halved per extra lost frame (what simple receivers do);
    "zero": silence. Returns a copy; the length never changes (the media timeline is kept).
    """
    out = audio.astype(np.float32, copy=True)
    if loss_rate <= 0 or out.size < 2 * frame:
        return out
    # Stationary loss rate of a 2-state chain: p_gb / (p_gb + 1 - burst) = loss_rate.
    p_good_to_bad = loss_rate * (1 - burst) / max(1 - loss_rate, 1e-6)
    lost = False
    last_good = np.zeros(frame, np.float32)
    fade = 1.0
    for start in range(0, out.size - frame + 1, frame):
        lost = rng.random() < (burst if lost else p_good_to_bad)
        if lost:
            fade *= 0.5
            out[start : start + frame] = last_good * fade if conceal == "repeat" else 0.0
        else:
            last_good = out[start : start + frame].copy()
            fade = 1.0
    return out


def telephone_channel(
    clean: np.ndarray,
    rng: np.random.Generator,
    sample_rate: int = 8000,
    babble: np.ndarray | None = None,
    strength: float = 1.0,
) -> np.ndarray:
    """One random telephone call for a clean clip (what training hears; each call draws anew).

    `strength` in [0, 1] scales how often the harsher effects happen (0: silence + G.711 only).
    """
    speech_rms = rms(clean)
    pads = [np.zeros(int(rng.uniform(0.05, 0.6) * sample_rate), np.float32) for _ in range(2)]
    audio = np.concatenate([pads[0], clean, pads[1]])
    gain_db = float(rng.uniform(-18, 6)) if rng.random() < 0.8 * strength else 0.0
    audio = apply_gain_db(audio, gain_db)
    speech_rms *= 10 ** (gain_db / 20)
    if rng.random() < 0.3 * strength:
        audio = bandpass_telephone(audio, sample_rate)
    if rng.random() < 0.7 * strength:
        audio = add_noise(
            audio, rng, float(rng.uniform(5, 30)), sample_rate, babble=babble, speech_rms=speech_rms
        )
    elif rng.random() < 0.5:
        # even a quiet line has a noise floor; espeak's digital silence does not
        audio = add_noise(
            audio, rng, float(rng.uniform(35, 50)), sample_rate, kind="white", speech_rms=speech_rms
        )
    audio = g711_round_trip(audio, "ulaw" if rng.random() < 0.6 else "alaw")
    if rng.random() < 0.3 * strength:
        conceal = "repeat" if rng.random() < 0.7 else "zero"
        audio = packet_loss(audio, rng, float(rng.uniform(0.01, 0.06)), conceal=conceal)
    return audio
