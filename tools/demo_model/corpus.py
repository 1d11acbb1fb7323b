"""Demo corpus: espeak-ng call-centre speech at 8 kHz, split into train / dev / test.

Output (under `--out`, e.g. var/demo/):

    carry/{train,dev,test}.npz       packed 8 kHz µ-law audio + labels (`data.py`), for training
    carry/corpus.json                voices, sizes, seed (tokenizer.model, melfilters.f32: recipe.py)
    shard<k>/train.npz               further training sets (--train-shards), one per extra GPU carry
    test/<lang>/<id>.wav             held-out telephone clips: 8 kHz G.711 round trip (+ noise in test-noisy)
    test/manifest.jsonl              {"audio": path, "text": spoken form, "lang": "en-US" | "uk-UA", ...}

The held-out set uses templates, names and voice settings (variant, speed, pitch) that training never
sees (`text.py` keeps the template and name lists disjoint; `VOICES` keeps the voice settings disjoint).
Training audio is stored clean (trimmed, level-normalized 16-bit at 8 kHz, LZMA-compressed); the
training script adds the telephone channel on the fly (see `augment.py`), so every epoch hears new noise.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import soundfile as sf
import soxr

from tools.demo_model import augment, data, text

SAMPLE_RATE = 8000
ESPEAK_RATE = 22050
LOCALES = {"en": "en-US", "uk": "uk-UA"}

# espeak-ng voice settings. Accent bases are shared by train and test; variants, speeds and pitches
# of the test set are values training never uses.
EN_BASES = (
    "en-us",
    "en",
    "en-gb-scotland",
    "en-gb-x-rp",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
    "en-029",
    "en-us-nyc",
)
# Half the training clips take one of espeak-ng's other variants instead: more timbres to generalize from
# (the held-out variants below stay unheard; the robot, whisper and croak ones are left out).
EXTRA_VARIANTS = (
    "Alex", "Alicia", "Andrea", "Andy", "Annie", "AnxiousAndy", "Denis", "Diogo", "Gene", "Gene2",
    "Henrique", "Hugo", "Jacky", "Lee", "Marco", "Mario", "Michael", "Mike", "Nguyen",
    "RicishayMax", "Storm", "Tweaky", "adam", "anika", "announcer", "antonio", "aunty", "belinda",
    "benjamin", "boris", "caleb", "david", "ed", "edward", "edward2", "fast", "grandma", "grandpa",
    "gustave", "iven", "iven2", "iven3", "iven4", "john", "kaukovalta", "klatt5", "klatt6", "linda",
    "marcelo", "max", "michel", "miguel", "norbert", "pablo", "paul", "pedro", "quincy", "rob",
    "robert", "sandro", "shelby", "steph", "steph2", "steph3", "travis", "victor", "zac",
)  # fmt: skip
VOICES: dict[str, dict[str, tuple[int | str, ...]]] = {
    "train": {
        "variant": ("m1", "m2", "m3", "m5", "m6", "m8", "f1", "f2", "f5", "klatt", "klatt2", "klatt3"),
        "variant_extra": EXTRA_VARIANTS,
        "speed": (120, 130, 140, 150, 160, 170, 180, 190, 200, 210),
        "pitch": (20, 30, 40, 50, 60, 70, 80),
        "gap": (0, 0, 0, 1, 2, 3),
    },
    "test": {
        "variant": ("m4", "m7", "f3", "f4", "klatt4"),
        "speed": (135, 155, 185),
        "pitch": (25, 45, 65),
        "gap": (0, 1),
    },
}


@dataclass(frozen=True, slots=True)
class Voice:
    base: str
    variant: str
    speed: int
    pitch: int
    gap: int

    @property
    def name(self) -> str:
        return f"{self.base}+{self.variant}"

    def args(self) -> list[str]:
        return ["-v", self.name, "-s", str(self.speed), "-p", str(self.pitch), "-g", str(self.gap)]


@dataclass(frozen=True, slots=True)
class Utterance:
    uid: str
    lang: Literal["en", "uk"]
    split: str
    template: str
    written: str
    text: str
    voice: Voice


def pick_voice(rng: random.Random, lang: str, split: str) -> Voice:
    grid = VOICES["test" if split == "test" else "train"]
    base = rng.choice(EN_BASES) if lang == "en" else "uk"
    # (The test grid has no extras, so the held-out plan draws exactly what it always drew.)
    extra = "variant_extra" in grid and rng.random() < 0.5
    return Voice(
        base=base,
        variant=str(rng.choice(grid["variant_extra" if extra else "variant"])),
        speed=int(rng.choice(grid["speed"])),
        pitch=int(rng.choice(grid["pitch"])),
        gap=int(rng.choice(grid["gap"])),
    )


def plan(
    split: str,
    count: int,
    uk_share: float,
    seed: int,
    salad_share: float = 0.0,
    shard: int = 0,
    coined_share: float = 0.0,
    splice_share: float = 0.0,
    perturb_share: float = 0.0,
    coined_name_share: float = 0.0,
) -> list[Utterance]:
    """The utterances of one split: text from the split's templates, voice from the split's grid.

    Training sets can mix in, each share taken of the sentences the ones before left: `salad_share`
    random sequences of training words (`text.make_salad`); `coined_share` of the English ones salad
    half of made-up words (`text.make_coined`); `splice_share` fragments of training sentences joined
    (`text.make_spliced`); `perturb_share` training sentences with edited words (`text.make_perturbed`).
    `coined_name_share` of the name and company slots get coined words. `shard` > 0 draws another,
    independent set of the same split (more training data than one carry holds)."""
    rng = random.Random(f"{seed}:{split}" if shard == 0 else f"{seed}:{split}:{shard}")
    prefix = split if shard == 0 else f"{split}-s{shard}"
    text_split: text.Split = "test" if split == "test" else "train"
    out = []
    for i in range(count):
        lang: Literal["en", "uk"] = "uk" if rng.random() < uk_share else "en"
        salad = salad_share > 0 and rng.random() < salad_share
        # Drawn only when asked for: sets built without coined words stay byte for byte as they were.
        coined = not salad and lang == "en" and coined_share > 0 and rng.random() < coined_share
        splice = not (salad or coined) and splice_share > 0 and rng.random() < splice_share
        perturb = not (salad or coined or splice) and perturb_share > 0 and rng.random() < perturb_share
        if salad:
            sentence = text.make_salad(rng, lang)
        elif coined:
            sentence = text.make_coined(rng)
        elif splice:
            sentence = text.make_spliced(rng, lang, coined_name_share)
        elif perturb:
            sentence = text.make_perturbed(rng, lang, coined_names=coined_name_share)
        else:
            sentence = text.make_sentence(rng, lang, text_split, coined_name_share)
        voice = pick_voice(rng, lang, split)
        out.append(
            Utterance(
                f"{prefix}-{i:06d}", lang, split, sentence.template, sentence.written, sentence.spoken, voice
            )
        )
    return out


@functools.cache
def espeak_command() -> tuple[str, ...]:
    """espeak-ng, in its deterministic random mode where it has one. The voices with breath noise
    (the f2, f3, f5 variants among ours) draw it from rand(); espeak-ng 1.52 seeds that from the
    clock unless given -D, so the same sentence gave other samples in the next second. 1.51 never
    seeded it (the same samples every run) and has no -D."""
    usage = subprocess.run(["espeak-ng", "--help"], capture_output=True, text=True, timeout=30).stdout
    return ("espeak-ng", "-D") if re.search(r"^-D\s", usage, re.MULTILINE) else ("espeak-ng",)


def synthesize(utt: Utterance) -> np.ndarray:
    """espeak-ng -> trimmed, level-normalized float32 mono at 8 kHz (soxr HQ, as NeMo resamples)."""
    wav = subprocess.run(
        [*espeak_command(), *utt.voice.args(), "--stdout", utt.text],
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout
    # espeak-ng streams a RIFF header with placeholder sizes; the samples follow the "data" tag.
    data = wav.index(b"data") + 8
    pcm = (
        np.frombuffer(wav[data : len(wav) - (len(wav) - data) % 2], dtype="<i2").astype(np.float32) / 32768.0
    )
    audio = soxr.resample(pcm, ESPEAK_RATE, SAMPLE_RATE, "HQ").astype(np.float32)
    return augment.normalize_level(augment.trim_silence(audio, SAMPLE_RATE))


def _synthesize_many(utts: Sequence[Utterance]) -> list[np.ndarray]:
    return [synthesize(u) for u in utts]


def synthesize_all(utts: Sequence[Utterance], workers: int) -> list[np.ndarray]:
    batches = [utts[i : i + 64] for i in range(0, len(utts), 64)]
    if workers <= 1:
        return [a for b in batches for a in _synthesize_many(b)]
    with ProcessPoolExecutor(workers) as pool:
        return [a for batch in pool.map(_synthesize_many, batches) for a in batch]


def write_test_set(
    root: Path, utts: Sequence[Utterance], audio: Sequence[np.ndarray], seed: int
) -> list[np.ndarray]:
    """Held-out telephone clips as 16-bit WAV at 8 kHz, two conditions, and a JSONL manifest.

    test:       G.711 µ-law round trip, 0.3-0.6 s of line silence around the speech.
    test-noisy: A-law or µ-law, level change, noise at 10-25 dB SNR (the harder condition).
    Returns the clips of the "test" condition (for the copy that travels with the training data).
    """
    rng = np.random.default_rng(seed)
    lines = []
    plain: list[np.ndarray] = []
    for condition in ("test", "test-noisy"):
        folder = root / condition
        folder.mkdir(parents=True, exist_ok=True)
        for utt, clean in zip(utts, audio, strict=True):
            pad = lambda: np.zeros(int(rng.uniform(0.3, 0.6) * SAMPLE_RATE), np.float32)  # noqa: E731
            clip = np.concatenate([pad(), clean, pad()])
            if condition == "test":
                clip = augment.g711_round_trip(clip, "ulaw")
                plain.append(clip)
            else:
                clip = augment.apply_gain_db(clip, float(rng.uniform(-12, 3)))
                clip = augment.add_noise(
                    clip, rng, snr_db=float(rng.uniform(10, 25)), sample_rate=SAMPLE_RATE
                )
                clip = augment.g711_round_trip(clip, str(rng.choice(["ulaw", "alaw"])))
            name = f"{condition}/{utt.uid}.wav"
            sf.write(root / name, clip, SAMPLE_RATE, subtype="PCM_16")
            lines.append(
                {
                    "audio": name,
                    "text": utt.text,
                    "lang": LOCALES[utt.lang],
                    "condition": condition,
                    "written": utt.written,
                    "voice": asdict(utt.voice),
                    "seconds": round(len(clip) / SAMPLE_RATE, 3),
                }
            )
    with (root / "manifest.jsonl").open("w") as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return plain


def iter_texts(utts: Sequence[Utterance]) -> Iterator[str]:
    for u in utts:
        yield u.text


@dataclass(frozen=True, slots=True)
class CorpusSizes:
    train: int = 3200
    dev: int = 150
    test: int = 400
    uk_share: float = 0.15
    salad_share: float = 0.5  # training sentences that are shuffled training words (text.make_salad)
    test_carried: int = 150  # the first N test clips also travel to the GPU machine (on-device WER)
    # Further training sets of `train` utterances each (shard<k>/train.npz): one carry to the GPU machine
    # holds one set, so each call of a multi-call run brings another (train.py --extra-train).
    train_shards: int = 1
    coined_share: float = 0.0  # English training sentences that are half made-up words (text.make_coined)
    splice_share: float = 0.0  # of the rest: fragments of training sentences joined (text.make_spliced)
    perturb_share: float = 0.0  # of the rest: training sentences with edited words (text.make_perturbed)
    coined_name_share: float = 0.0  # name and company slots filled with coined words


# The shipped model's second training session (docs/demo-model.md): shards 4-19 of sentences that leave
# the templates, and a development set of spliced and edited sentences (dev1/dev.npz) to score them with
# while the held-out set stays unseen.
VARIED_MIX: dict[str, Any] = {
    "salad_share": 0.25, "coined_share": 0.15, "splice_share": 0.4, "perturb_share": 0.4,
    "coined_name_share": 0.5,
}  # fmt: skip
VARIED_SHARDS = range(4, 20)
NOVEL_DEV_MIX: dict[str, Any] = {
    "dev": 200, "salad_share": 0.0, "splice_share": 0.5, "perturb_share": 1.0, "coined_name_share": 0.5,
}  # fmt: skip


def build(out: Path, sizes: CorpusSizes, seed: int, workers: int) -> dict[str, object]:
    """Generate the whole corpus under `out`; returns the summary also written to carry/corpus.json."""
    started = time.monotonic()
    carry = out / "carry"
    carry.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {
        "seed": seed,
        "sample_rate": SAMPLE_RATE,
        "sizes": asdict(sizes),
        "splits": {},
    }
    plans = {
        "train": training_plan(sizes, seed, 0),
        "dev": plan("dev", sizes.dev, sizes.uk_share, seed),
        "test": plan("test", sizes.test, sizes.uk_share, seed),
    }
    plans.update({f"shard{k}": training_plan(sizes, seed, k) for k in range(1, sizes.train_shards)})
    for split, utts in plans.items():
        audio = synthesize_all(utts, workers)
        seconds = sum(len(a) for a in audio) / SAMPLE_RATE
        info: dict[str, object] = {"utterances": len(utts), "hours": round(seconds / 3600, 3)}
        if split == "test":
            test_root = out / "test"
            if test_root.exists():
                shutil.rmtree(test_root)
            plain = write_test_set(test_root, utts, audio, seed)
            info["clips"] = 2 * len(plain)
            n = min(sizes.test_carried, len(plain))
            info["bytes"] = data.pack_split(
                carry / "test.npz",
                plain[:n],
                [u.text for u in utts[:n]],
                [LOCALES[u.lang] for u in utts[:n]],
                [u.uid for u in utts[:n]],
            )
        else:
            target = _shard_file(out, split) if split.startswith("shard") else carry / f"{split}.npz"
            info["bytes"] = _pack(target, utts, audio)
        info["langs"] = {lang: sum(u.lang == lang for u in utts) for lang in LOCALES}
        summary["splits"][split] = info  # type: ignore[index]
        print(f"{split}: {info}", flush=True)
    training = [u for split, utts in plans.items() if split not in ("dev", "test") for u in utts]
    (out / "train_text.txt").write_text("\n".join(iter_texts(training)) + "\n")
    summary["voices"] = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in VOICES.items()}
    summary["en_bases"] = list(EN_BASES)
    summary["seconds_to_build"] = round(time.monotonic() - started, 1)
    (carry / "corpus.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def training_plan(sizes: CorpusSizes, seed: int, shard: int, split: str = "train") -> list[Utterance]:
    """A training (or, `split="dev"`, a development) set drawn with the sizes' mix of sentences."""
    return plan(
        split,
        sizes.train if split == "train" else sizes.dev,
        sizes.uk_share,
        seed,
        sizes.salad_share,
        shard=shard,
        coined_share=sizes.coined_share,
        splice_share=sizes.splice_share,
        perturb_share=sizes.perturb_share,
        coined_name_share=sizes.coined_name_share,
    )


_MIXED = ("{salad}", "{coined}", "{spliced}", "{perturbed}")  # the templates of mixed-in sentences


def _shard_file(out: Path, name: str, split: str = "train") -> Path:
    (out / name).mkdir(parents=True, exist_ok=True)
    return out / name / f"{split}.npz"


def _pack(target: Path, utts: Sequence[Utterance], audio: Sequence[np.ndarray]) -> int:
    return data.pack_split(
        target, audio, [u.text for u in utts], [LOCALES[u.lang] for u in utts], [u.uid for u in utts]
    )


def build_shard(
    out: Path, sizes: CorpusSizes, seed: int, workers: int, shard: int, split: str = "train"
) -> dict[str, object]:
    """One more training shard (`out`/shard<k>/train.npz) without touching the rest of the corpus; with
    `split="dev"` a development set of the same mix in the training voices (`out`/dev<k>/dev.npz), e.g.
    spliced and edited sentences that score how a model does off the templates without the held-out set."""
    utts = training_plan(sizes, seed, shard, split)
    audio = synthesize_all(utts, workers)
    target = _shard_file(out, f"shard{shard}") if split == "train" else _shard_file(out, f"dev{shard}", "dev")
    info: dict[str, object] = {
        "utterances": len(utts),
        "hours": round(sum(len(a) for a in audio) / SAMPLE_RATE / 3600, 3),
        "bytes": _pack(target, utts, audio),
        "mix": {k: sum(u.template == k for u in utts) for k in _MIXED},
        "sizes": asdict(sizes),
        "seed": seed,
    }
    (target.parent / "shard.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = CorpusSizes()
    parser.add_argument("--out", type=Path, default=Path("var/demo"))
    parser.add_argument("--train", type=int, default=default.train)
    parser.add_argument("--dev", type=int, default=default.dev)
    parser.add_argument("--test", type=int, default=default.test)
    parser.add_argument("--test-carried", type=int, default=default.test_carried)
    parser.add_argument("--uk-share", type=float, default=default.uk_share)
    parser.add_argument("--salad-share", type=float, default=default.salad_share)
    parser.add_argument("--train-shards", type=int, default=default.train_shards)
    parser.add_argument("--coined-share", type=float, default=default.coined_share)
    parser.add_argument("--splice-share", type=float, default=default.splice_share)
    parser.add_argument("--perturb-share", type=float, default=default.perturb_share)
    parser.add_argument("--coined-name-share", type=float, default=default.coined_name_share)
    parser.add_argument(
        "--only-shard", type=int, default=None, help="build only training shard K (shard<K>/train.npz)"
    )
    parser.add_argument(
        "--split",
        choices=("train", "dev"),
        default="train",
        help="with --only-shard: dev builds dev<K>/dev.npz (--dev utterances) instead",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--workers", type=int, default=2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    # Every CorpusSizes field has its flag of the same name (add_arguments).
    sizes = CorpusSizes(**{f.name: getattr(args, f.name) for f in fields(CorpusSizes)})
    if args.only_shard is not None:
        print(build_shard(args.out, sizes, args.seed, args.workers, args.only_shard, args.split), flush=True)
    else:
        build(args.out, sizes, args.seed, args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
