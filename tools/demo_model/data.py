"""The packed corpus splits that travel to the GPU machine (numpy + lzma only; no project imports).

One `.npz` per split: `ulaw_lzma` = LZMA of every clip's G.711 µ-law bytes back to back (8 kHz),
`offsets` (N+1,) sample offsets, and per clip `text` (spoken form), `lang` (locale) and `uid`.
µ-law because it is what a phone line carries anyway (its 8-bit codes are the training audio's floor of
quality) and, with LZMA, ~5.7 kB per second of speech: two hours fit in the 40 MiB carry.
"""

from __future__ import annotations

import lzma
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tools.demo_model import g711


@dataclass(frozen=True, slots=True)
class Split:
    clips: list[np.ndarray]  # float32 at 8 kHz, in [-1, 1]
    texts: list[str]
    langs: list[str]
    uids: list[str]

    def __len__(self) -> int:
        return len(self.clips)

    def seconds(self, sample_rate: int = 8000) -> float:
        return sum(len(c) for c in self.clips) / sample_rate


def pack_split(
    path: Path, clips: Sequence[np.ndarray], texts: Sequence[str], langs: Sequence[str], uids: Sequence[str]
) -> int:
    """Write one split; returns its size in bytes."""
    codes = [g711.ulaw_encode(g711.to_int16(c)) for c in clips]
    offsets = np.cumsum([0] + [len(c) for c in codes]).astype(np.int64)
    blob = np.concatenate(codes) if codes else np.zeros(0, np.uint8)
    packed = np.frombuffer(lzma.compress(blob.tobytes(), preset=6), dtype=np.uint8)
    with path.open("wb") as f:
        np.savez(
            f,
            ulaw_lzma=packed,
            offsets=offsets,
            text=np.array(list(texts), dtype=str),
            lang=np.array(list(langs), dtype=str),
            uid=np.array(list(uids), dtype=str),
        )
    return path.stat().st_size


def join_splits(splits: Sequence[Split]) -> Split:
    """Several sets as one (the training shards of a multi-call GPU run); uids must stay unique."""
    joined = Split(
        [c for s in splits for c in s.clips],
        [t for s in splits for t in s.texts],
        [x for s in splits for x in s.langs],
        [u for s in splits for u in s.uids],
    )
    if len(set(joined.uids)) != len(joined.uids):
        raise ValueError("the joined sets share clip ids: the same shard given twice?")
    return joined


def load_split(path: Path) -> Split:
    with np.load(path) as z:
        codes = np.frombuffer(lzma.decompress(z["ulaw_lzma"].tobytes()), dtype=np.uint8)
        offsets = z["offsets"]
        pcm = g711.ulaw_decode(codes).astype(np.float32) / 32768.0
        clips = [pcm[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        return Split(
            clips, [str(t) for t in z["text"]], [str(x) for x in z["lang"]], [str(u) for u in z["uid"]]
        )
