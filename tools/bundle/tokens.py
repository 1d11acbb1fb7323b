"""Vocabularies for generated bundles and the tokens.txt writer.

A generated vocabulary looks like the real one where the runtime cares: id 0 is `<unk>`, a block of
`<xx-XX>` language-tag pieces, a few `<0xNN>` byte pieces (skipped by the detokenizer), word-initial
pieces with `▁` (U+2581) and continuation pieces, punctuation, some Cyrillic and CJK; the last id is
blank. Deterministic (no randomness at all), so tokens.txt is identical for every seed.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tools.bundle.prompts import SUPPORTED_LOCALES

WORD = "\u2581"
BLANK_PIECE = "<blank>"
_TINY_TAGS = ("en-US", "uk-UA", "fr-FR", "de-DE", "es-ES", "zh-CN")
_WORDS = (
    "the", "a", "and", "to", "of", "is", "hello", "world", "call", "please", "hold", "thank", "you",
    "yes", "no", "one", "two", "three", "four", "five", "при", "віт", "так", "ні", "bonjour", "merci",
    "ja", "nein",
)  # fmt: skip
_SUFFIXES = ("s", "ed", "ing", "er", "ly", "ть", "ся")
_PUNCT = (".", ",", "?", "!", "'", "-")
_CJK = ("你", "好", "谢", "是")


def _base_pieces(tags: tuple[str, ...]) -> list[str]:
    pieces = ["<unk>", *(f"<{t}>" for t in tags), "<0x0A>", "<0xE2>", WORD]
    pieces += [WORD + w for w in _WORDS]
    pieces += list(_SUFFIXES) + list(_PUNCT) + list(_CJK)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces += [WORD + ch for ch in letters] + list(letters)
    pieces += [WORD + ch for ch in "абвгдеєжзиіїйклмнопрстуфхцчшщьюя"]
    return list(dict.fromkeys(pieces))  # unique, first occurrence kept


def generated_vocabulary(vocab_size: int) -> list[str]:
    """`vocab_size` pieces by id (the last is blank)."""
    tags = _TINY_TAGS if vocab_size < 2000 else SUPPORTED_LOCALES
    pieces = _base_pieces(tags)
    seen = set(pieces)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    # Fill with letter pairs, then triples, alternating word-initial and continuation pieces.
    for n in itertools.count(2):
        for combo in itertools.product(letters, repeat=n):
            for piece in (WORD + "".join(combo), "".join(combo)):
                if len(pieces) >= vocab_size - 1:
                    return [*pieces, BLANK_PIECE]
                if piece not in seen:
                    seen.add(piece)
                    pieces.append(piece)
    raise AssertionError("unreachable")


def write_tokens(path: Path, pieces: list[str]) -> None:
    """tokens.txt as `id<TAB>piece` lines (the published export's format)."""
    path.write_text("".join(f"{i}\t{p}\n" for i, p in enumerate(pieces)), encoding="utf-8")
