"""Telephone speech for calibrating and checking benchmark bundles: espeak-ng sentences with pauses,
through the channel a call takes (8 kHz G.711 µ-law, then the gateway's 8 -> 16 kHz upsampler), with
the sentences' sample spans known.

A `SpeechSet` names voices (espeak-ng settings and the prompt a call in that voice is opened with),
sentences and pause lengths; `render` gives one `SpeechStream` per voice: a lead-in, then sentence,
pause, sentence, ..., pause. Sentences are synthesized, trimmed and levelled like the demo corpus's
(`tools.demo_model.corpus.synthesize`: -20 dBFS RMS); pauses alternate between digital silence (what
`ttg replay` sends) and line noise at -66..-52 dBFS (under the engine's -45 dBFS pause threshold).

Same set, same espeak-ng, same samples. Needs espeak-ng on PATH (Debian package; on a machine without
one: tools/demo_model/espeak_bundle.sh), soxr and soundfile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

RATE = 16_000
LINE_RATE = 8_000
F32 = NDArray[np.float32]


class SpeechError(RuntimeError):
    """espeak-ng missing or failing."""


@dataclass(frozen=True, slots=True)
class Speaker:
    voice: str  # espeak-ng voice and variant, e.g. "en-us+f2"
    prompt: str  # the locale a call in this voice is opened with ("en-US", "uk-UA", "auto")
    speed: int = 160  # words per minute
    pitch: int = 50

    @property
    def lang(self) -> str:
        return "uk" if self.voice.startswith("uk") else "en"


@dataclass(frozen=True, slots=True)
class SpeechSet:
    """Each speaker reads `per_speaker` sentences of its language; pauses drawn from `pause_ms`."""

    speakers: tuple[Speaker, ...]
    sentences: dict[str, tuple[str, ...]]  # "en" / "uk" -> sentences
    per_speaker: int
    seed: int
    pause_ms: tuple[int, int] = (500, 1600)
    lead_ms: int = 600


@dataclass(frozen=True, slots=True)
class SpeechStream:
    name: str  # the voice
    prompt: str
    pcm: F32  # 16 kHz, as the engine receives it
    spans: tuple[tuple[int, int], ...]  # sentences, [start, end) in 16 kHz samples
    texts: tuple[str, ...]

    @property
    def seconds(self) -> float:
        return len(self.pcm) / RATE

    @property
    def speech_seconds(self) -> float:
        return sum(e - s for s, e in self.spans) / RATE


def say(text: str, speaker: Speaker) -> F32:
    """One sentence: 8 kHz float32, trimmed and levelled (the demo corpus's synthesis)."""
    import shutil

    from tools.demo_model.corpus import Utterance, Voice, synthesize

    if shutil.which("espeak-ng") is None:
        raise SpeechError(
            "espeak-ng is not on PATH (Debian: apt-get install espeak-ng; on a machine without a package "
            "mirror: tools/demo_model/espeak_bundle.sh DIR here, then PATH=DIR/bin:$PATH there)"
        )
    base, _, variant = speaker.voice.partition("+")
    voice = Voice(base=base, variant=variant or "m1", speed=speaker.speed, pitch=speaker.pitch, gap=0)
    utterance = Utterance("speech", speaker.lang, "bench", "", text, text, voice)  # type: ignore[arg-type]
    return synthesize(utterance)


def telephone_channel(pcm8k: F32) -> F32:
    """G.711 µ-law round trip at 8 kHz, then the gateway's upsampler to 16 kHz."""
    from gateway.audio.resample import Upsampler
    from tools.demo_model.augment import g711_round_trip

    up = Upsampler()
    line = g711_round_trip(pcm8k, "ulaw")
    return np.concatenate([up.push(line), up.finish()]).astype(np.float32)


def render(speech: SpeechSet) -> list[SpeechStream]:
    rng = np.random.default_rng([speech.seed, 0x5EEC])
    streams = []
    said_so_far: dict[str, int] = {}  # sentences of each language already given out
    for speaker in speech.speakers:
        texts = speech.sentences[speaker.lang]
        first = said_so_far.get(speaker.lang, 0)
        said_so_far[speaker.lang] = first + speech.per_speaker
        chosen = [texts[(first + k) % len(texts)] for k in range(speech.per_speaker)]
        parts: list[F32] = [np.zeros(LINE_RATE * speech.lead_ms // 1000, np.float32)]
        spans: list[tuple[int, int]] = []
        at = len(parts[0])
        for k, text in enumerate(chosen):
            said = say(text, speaker)
            pause = int(rng.uniform(*speech.pause_ms) * LINE_RATE / 1000)
            if k % 2:
                noise_db = float(rng.uniform(-66, -52))
                gap = (rng.standard_normal(pause) * 10 ** (noise_db / 20)).astype(np.float32)
            else:
                gap = np.zeros(pause, np.float32)
            spans.append((at, at + len(said)))
            parts += [said, gap]
            at += len(said) + pause
        ratio = RATE // LINE_RATE
        streams.append(
            SpeechStream(
                name=speaker.voice,
                prompt=speaker.prompt,
                pcm=telephone_channel(np.concatenate(parts)),
                spans=tuple((s * ratio, e * ratio) for s, e in spans),
                texts=tuple(chosen),
            )
        )
    return streams


def frame_labels(
    spans: Sequence[tuple[int, int]], n_frames: int, margin_frames: int, samples_per_frame: int = 1280
) -> NDArray[np.int8]:
    """Per 80 ms encoder frame (frame t = samples [1280 t, 1280 (t+1))): 1 speech, 0 pause, -1 within
    `margin_frames` of a sentence's start or end (either side)."""
    labels = np.zeros(n_frames, np.int8)
    for s, e in spans:
        a, b = s // samples_per_frame, -(-e // samples_per_frame)
        labels[max(0, a - margin_frames) : min(n_frames, b + margin_frames)] = -1
        labels[min(n_frames, a + margin_frames) : max(0, b - margin_frames)] = 1
    return labels


# Calibration speech: call-centre sentences and voices that the held-out check (`ttg bench speechlike`)
# does not use, nor `ttg replay --generate`.
CALIBRATION_SENTENCES: dict[str, tuple[str, ...]] = {
    "en": (
        "Good morning, this is the billing department, how can I help you today?",
        "I have been waiting for the engineer since eight o'clock.",
        "The card ending in three three one was declined yesterday.",
        "Could you spell your surname for me, please?",
        "We can offer you a discount of fifteen percent for twelve months.",
        "My router shows a red light and nothing else works.",
        "I would rather pay by bank transfer than by card.",
        "The parcel tracking page says it is still in the warehouse.",
        "Let me put you on hold while I check with my supervisor.",
        "Is there a cheaper tariff for customers over sixty?",
        "The heating has not worked since the boiler was replaced.",
        "Please confirm the appointment for Friday at half past two.",
    ),
    "uk": (
        "Доброго ранку, це служба підтримки, чим можу допомогти?",
        "Я чекаю на майстра з восьмої години ранку.",
        "Мою картку вчора відхилили без жодної причини.",
        "Скажіть, будь ласка, номер вашого договору.",
        "Ми можемо запропонувати знижку на три місяці.",
        "Роутер світиться червоним і нічого не працює.",
    ),
}

CALIBRATION_SET = SpeechSet(
    speakers=(
        Speaker("en-us+m1", "en-US", 160, 50),
        Speaker("en-us+f2", "en-US", 150, 60),
        Speaker("en-gb-scotland+m2", "auto", 170, 40),
        Speaker("uk+m1", "uk-UA", 155, 50),
        Speaker("en-029+f1", "en-US", 180, 70),
        Speaker("en-gb-x-gbclan+m5", "auto", 140, 30),
        Speaker("uk+f2", "uk-UA", 170, 60),
        Speaker("en-us-nyc+m6", "en-US", 185, 45),
    ),
    sentences=CALIBRATION_SENTENCES,
    per_speaker=2,
    seed=0,
    pause_ms=(400, 1200),
)
