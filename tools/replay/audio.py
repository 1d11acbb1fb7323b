"""The audio the replay sends: files (any rate/format) or a generated espeak-ng set, converted to 8 kHz
16-bit mono with soxr, with the speech spans found by an energy VAD and optional reference text.

VAD rule (documented in docs/replay.md): 10 ms frames; a frame is speech when its energy is at least
max(loudest frame − 35 dB, −55 dBFS); runs of speech frames shorter than 60 ms are ignored (clicks);
runs closer than `pause_ms` are one utterance. An utterance's end is the end of its last speech frame,
so the time-to-final of an utterance starts at the last 10 ms of audio that still carried speech.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from numpy.typing import NDArray

from gateway.audio import g711

logger = logging.getLogger(__name__)

RATE = 8000
FRAME_MS = 10
VAD_REL_DB = 35.0
VAD_ABS_DBFS = -55.0
VAD_MIN_SPEECH_MS = 60

# Headerless G.711 files (what sipp's rtp_stream plays): 8 kHz, one byte per sample.
RAW_G711: dict[str, g711.Law] = {
    ".ulaw": "PCMU",
    ".mulaw": "PCMU",
    ".pcmu": "PCMU",
    ".alaw": "PCMA",
    ".pcma": "PCMA",
}
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aif", ".aiff", ".au", ".caf", *RAW_G711}


class AudioError(Exception):
    """An audio file or folder that cannot be used (named in the message)."""


@dataclass(frozen=True, slots=True)
class Utterance:
    """A speech span, in ms from the start of its clip (or call)."""

    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True, eq=False)
class AudioClip:
    name: str
    pcm: NDArray[np.int16]  # 8 kHz mono
    utterances: tuple[Utterance, ...]
    reference: str | None = None
    _encoded: dict[tuple[str, int], bytes] = field(default_factory=dict, repr=False)

    @property
    def duration_ms(self) -> float:
        return len(self.pcm) * 1000.0 / RATE

    def encoded(self, codec: str, samples_per_packet: int) -> bytes:
        """G.711 bytes, padded with silence to whole packets (cached: every call shares them)."""
        key = (codec, samples_per_packet)
        data = self._encoded.get(key)
        if data is None:
            pad = (-len(self.pcm)) % samples_per_packet
            law: g711.Law = "PCMA" if codec == "PCMA" else "PCMU"
            data = g711.encode(self.pcm, law) + bytes([g711.SILENCE_CODE[codec]]) * pad
            self._encoded[key] = data
        return data


def to_int16(x: NDArray[np.floating]) -> NDArray[np.int16]:
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int16)


def read_audio(path: Path) -> NDArray[np.int16]:
    """Any file soundfile (libsndfile) reads, or headerless G.711 → 8 kHz mono int16."""
    suffix = path.suffix.lower()
    if suffix in RAW_G711:
        return g711.decode(path.read_bytes(), RAW_G711[suffix])
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(f"{path}: cannot read audio ({exc})") from exc
    if data.shape[0] == 0:
        raise AudioError(f"{path}: no samples")
    mono = data.mean(axis=1)
    if rate != RATE:
        # soxr's HQ filter: flat to 0.9 × the lower Nyquist; streaming state is not needed (whole file).
        mono = soxr.resample(mono, rate, RATE, quality="HQ")
    return to_int16(mono)


def frame_energy_db(pcm: NDArray[np.int16], frame_ms: int = FRAME_MS) -> NDArray[np.float64]:
    n = RATE * frame_ms // 1000
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n) / 32768.0
    return 10.0 * np.log10(np.mean(frames * frames, axis=1) + 1e-12)


def speech_segments(pcm: NDArray[np.int16], pause_ms: int) -> list[Utterance]:
    """The VAD rule of the module docstring."""
    db = frame_energy_db(pcm)
    if db.size == 0:
        return []
    threshold = max(float(db.max()) - VAD_REL_DB, VAD_ABS_DBFS)
    active = db >= threshold
    # Runs of speech frames [start, end); runs shorter than VAD_MIN_SPEECH_MS are clicks, not speech.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], active.astype(np.int8), [0]])))
    runs = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    runs = [(a, b) for a, b in runs if (b - a) * FRAME_MS >= VAD_MIN_SPEECH_MS]
    merged: list[list[int]] = []
    for a, b in runs:
        if merged and (a - merged[-1][1]) * FRAME_MS < pause_ms:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return [Utterance(a * FRAME_MS, b * FRAME_MS) for a, b in merged]


def load_clip(path: Path, pause_ms: int) -> AudioClip:
    pcm = read_audio(path)
    ref_path = path.with_suffix(".txt")
    reference = ref_path.read_text(encoding="utf-8").strip() if ref_path.exists() else None
    utterances = tuple(speech_segments(pcm, pause_ms))
    if not utterances:
        logger.warning("%s: no speech found by the VAD (it still plays; no latency samples from it)", path)
    return AudioClip(name=path.name, pcm=pcm, utterances=utterances, reference=reference)


def _audio_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES)


@dataclass(frozen=True, slots=True)
class AudioLibrary:
    """Clips by language: `<dir>/<lang>/` holds a language's own files; files in `<dir>` serve every
    language without a folder of its own."""

    shared: tuple[AudioClip, ...]
    by_lang: dict[str, tuple[AudioClip, ...]]

    def pool(self, lang: str) -> tuple[AudioClip, ...]:
        clips = self.by_lang.get(lang.lower()) or self.shared
        if not clips:
            raise AudioError(f"no audio for language {lang} (and no shared files)")
        return clips

    @property
    def clips(self) -> list[AudioClip]:
        return [*self.shared, *(c for pool in self.by_lang.values() for c in pool)]


def load_library(folder: Path, pause_ms: int) -> AudioLibrary:
    if not folder.is_dir():
        raise AudioError(f"{folder}: not a folder")
    shared = tuple(load_clip(p, pause_ms) for p in _audio_files(folder))
    by_lang: dict[str, tuple[AudioClip, ...]] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = _audio_files(sub)
        if files:
            by_lang[sub.name.lower()] = tuple(load_clip(p, pause_ms) for p in files)
    if not shared and not by_lang:
        raise AudioError(f"{folder}: no audio files ({', '.join(sorted(AUDIO_SUFFIXES))})")
    return AudioLibrary(shared, by_lang)


# --- generated speech (espeak-ng) -----------------------------------------------------------------

SENTENCES = {
    "en": (
        "I would like to check the status of my order please.",
        "The delivery was supposed to arrive on Tuesday morning.",
        "Can you tell me why my bill is higher this month?",
        "My account number is four seven two nine one.",
        "The internet connection keeps dropping every evening.",
        "I moved to a new address last week.",
        "Please cancel the subscription at the end of the month.",
        "The technician never showed up for the appointment.",
        "I need to reset the password for my online account.",
        "Could you send me a copy of the last invoice?",
        "The package was left at the wrong door.",
        "We would like to add a second phone line.",
        "The printer stopped working after the update.",
        "I was charged twice for the same service.",
        "Thank you for your help, that solves the problem.",
        "The meeting has been moved to Thursday afternoon.",
        "Our office opens at nine and closes at six.",
        "Please call me back on my mobile number.",
        "The new plan includes unlimited calls and messages.",
        "I am calling about the refund I requested.",
    ),
    "uk": (
        "Добрий день, я хочу перевірити статус замовлення.",
        "Доставка мала прийти у вівторок зранку.",
        "Чому мій рахунок цього місяця більший?",
        "Інтернет постійно зникає щовечора.",
        "Я переїхав на нову адресу минулого тижня.",
        "Будь ласка, скасуйте підписку наприкінці місяця.",
        "Майстер так і не прийшов на зустріч.",
        "Мені потрібно змінити пароль до кабінету.",
        "Надішліть мені копію останнього рахунку.",
        "Дякую за допомогу, проблему вирішено.",
    ),
}
_VOICES = {"en": "en-us", "uk": "uk", "de": "de", "fr": "fr", "es": "es", "it": "it", "pl": "pl"}


def espeak_voice(lang: str) -> str:
    base = lang.split("-")[0].lower()
    if lang.lower() == "en-gb":
        return "en-gb"
    return _VOICES.get(base, base)


def _espeak(text: str, voice: str, out: Path) -> NDArray[np.int16]:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise AudioError("espeak-ng is not installed (Debian package espeak-ng; `make deps`)")
    proc = subprocess.run(
        [exe, "-v", voice, "-s", "160", "-w", str(out), text], capture_output=True, timeout=60, check=False
    )
    if proc.returncode != 0 or not out.exists():
        raise AudioError(f"espeak-ng -v {voice} failed: {proc.stderr.decode(errors='replace').strip()}")
    return read_audio(out)


def generate_espeak(
    folder: Path, n: int, langs: Sequence[str] = ("en-US",), sentences_per_file: int = 2
) -> Path:
    """Write `n` files per language (2 sentences each, 1.2 s apart) with their `.txt` references.
    One language goes into `folder`; several go into `folder/<lang>/`. Reuses an identical earlier set."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"n": n, "langs": list(langs), "per_file": sentences_per_file, "version": 1}
    tag = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    stamp = folder / ".espeak-set"
    if stamp.exists() and stamp.read_text().strip() == tag:
        return folder
    gap = np.zeros(RATE * 1200 // 1000, dtype=np.int16)
    edge = np.zeros(RATE * 300 // 1000, dtype=np.int16)
    with tempfile.TemporaryDirectory(prefix="ttg-espeak-") as tmp:
        for lang in langs:
            out_dir = folder if len(langs) == 1 else folder / lang
            out_dir.mkdir(parents=True, exist_ok=True)
            texts = SENTENCES.get(lang.split("-")[0].lower(), SENTENCES["en"])
            voice = espeak_voice(lang)
            for i in range(n):
                chosen = [texts[(i * sentences_per_file + k) % len(texts)] for k in range(sentences_per_file)]
                parts: list[NDArray[np.int16]] = [edge]
                for k, text in enumerate(chosen):
                    if k:
                        parts.append(gap)
                    parts.append(_espeak(text, voice, Path(tmp) / "s.wav"))
                parts.append(edge)
                stem = out_dir / f"{lang}-{i:03d}"
                sf.write(str(stem.with_suffix(".wav")), np.concatenate(parts), RATE, subtype="PCM_16")
                stem.with_suffix(".txt").write_text(" ".join(chosen) + "\n", encoding="utf-8")
    stamp.write_text(tag + "\n")
    return folder


# --- a call's media timeline ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlacedClip:
    clip: AudioClip
    first_packet: int  # the packet index where the clip starts (clips start on packet boundaries)


@dataclass(frozen=True, slots=True)
class CallUtterance:
    """An utterance on the call's media timeline (ms from the call's first RTP sample)."""

    start_ms: int
    end_ms: int
    start_packet: int  # the packet that carries its first speech sample
    end_packet: int  # the packet that carries its last speech sample
    sentence: str = ""  # "clip#k": the clip's k-th speech segment (the same sentence in every call)


@dataclass(frozen=True, slots=True)
class CallPlan:
    """Everything one call sends: clips on a timeline of whole packets, silence elsewhere."""

    clips: tuple[PlacedClip, ...]
    n_packets: int
    samples_per_packet: int
    utterances: tuple[CallUtterance, ...]

    @property
    def duration_s(self) -> float:
        return self.n_packets * self.samples_per_packet / RATE

    @property
    def reference(self) -> str | None:
        refs = [p.clip.reference for p in self.clips]
        if any(r is None for r in refs):
            return None
        return " ".join(r for r in refs if r)


def plan_call(clips: Sequence[AudioClip], ptime_ms: int, lead_ms: int, gap_ms: int, tail_ms: int) -> CallPlan:
    spp = RATE * ptime_ms // 1000

    def packets(ms: float) -> int:
        return -(-round(ms * RATE / 1000) // spp)  # ceil to whole packets

    placed: list[PlacedClip] = []
    utterances: list[CallUtterance] = []
    cursor = packets(lead_ms)
    for k, clip in enumerate(clips):
        if k:
            cursor += packets(gap_ms)
        placed.append(PlacedClip(clip, cursor))
        base = cursor * spp
        for j, u in enumerate(clip.utterances):
            s = base + u.start_ms * RATE // 1000
            e = base + u.end_ms * RATE // 1000  # exclusive sample index
            utterances.append(
                CallUtterance(
                    s * 1000 // RATE, e * 1000 // RATE, s // spp, (e - 1) // spp, f"{clip.name}#{j}"
                )
            )
        cursor += packets(clip.duration_ms)
    cursor += packets(tail_ms)
    return CallPlan(tuple(placed), cursor, spp, tuple(utterances))


class ClipPicker:
    """Deterministic clip order: each language pool is played round robin across all calls."""

    def __init__(self, library: AudioLibrary) -> None:
        self._library = library
        self._next: dict[str, int] = {}

    def clips_for_call(self, lang: str, call_seconds: float, gap_ms: int) -> list[AudioClip]:
        pool = self._library.pool(lang)
        key = lang.lower() if lang.lower() in self._library.by_lang else ""
        out: list[AudioClip] = []
        total_ms = 0.0
        while True:
            i = self._next.get(key, 0)
            self._next[key] = i + 1
            clip = pool[i % len(pool)]
            out.append(clip)
            total_ms += clip.duration_ms + (gap_ms if len(out) > 1 else 0)
            if total_ms >= call_seconds * 1000.0:
                return out
