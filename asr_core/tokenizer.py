"""Token ids -> text (model_spec.md §7).

Pieces come from tokens.txt, or from the SentencePiece model when the bundle ships one (then its
decoder joins the pieces, handling byte pieces properly). Rules:

- the blank id, `<unk>` and other control pieces (`<pad>`, `<s>`, `<blank>`, ...) give no text; so do
  byte pieces `<0xNN>` without a SentencePiece model (none are expected: byte fallback is off);
- every language-tag piece `<xx-XX>` is stripped; the last one seen is the detected language;
- `▁` (U+2581) marks a word start: it becomes a space; leading/trailing spaces are dropped and runs
  of spaces collapsed (a stripped tag must not leave a double space behind).

These rules only drop trailing spaces and collapse runs, so the text of a token list is always a
prefix of the text of any longer list that starts with it: partial transcripts only grow.
`IncrementalText` keeps that text for a growing list without re-joining from scratch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asr_core.errors import BundleError

if TYPE_CHECKING:
    from asr_core.bundle import Bundle

WORD_START = "\u2581"
LANGUAGE_TAG_RE = re.compile(r"^<([a-z]{2,3}-[A-Za-z]{2})>$")
_CONTROL_RE = re.compile(r"^<[^<>\s]+>$")  # <unk>, <pad>, <s>, </s>, <blank>, <blk>, <0x0A>, ...
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True, slots=True)
class Decoded:
    text: str
    language: str | None  # last language tag in the ids, e.g. "uk-UA"


def _canonical(raw: str) -> str:
    return _SPACES.sub(" ", raw).strip()


class Tokenizer:
    """Detokenizer for one vocabulary. Immutable after construction; safe to share across threads."""

    def __init__(self, pieces: Sequence[str], blank_id: int, sentencepiece: str | Path | None = None) -> None:
        if not 0 <= blank_id < len(pieces):
            raise ValueError(f"blank id {blank_id} outside the vocabulary of {len(pieces)} pieces")
        self.pieces = tuple(pieces)
        self.blank_id = blank_id
        self._sp: Any = None
        if sentencepiece is not None:
            self._sp = self._load_sentencepiece(Path(sentencepiece))
        # Per id: language tag (or None), whether it yields text, and its text contribution.
        self._tag: list[str | None] = []
        self._text: list[str] = []
        self._silent: list[bool] = []
        for i, piece in enumerate(self.pieces):
            tag = LANGUAGE_TAG_RE.match(piece)
            self._tag.append(tag.group(1) if tag else None)
            silent = i == blank_id or tag is not None or self._is_control(i, piece)
            self._silent.append(silent)
            self._text.append("" if silent else piece.replace(WORD_START, " "))

    def _load_sentencepiece(self, path: Path) -> Any:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise BundleError(f"{path.name}: not a SentencePiece model ({exc})") from exc
        n = sp.GetPieceSize()
        # The joint has one more output than the SentencePiece vocabulary: blank (the last id).
        if n > len(self.pieces):
            raise BundleError(f"{path.name}: {n} pieces, more than the {len(self.pieces)} of tokens.txt")
        for i in range(n):
            if i != self.blank_id and sp.IdToPiece(i) != self.pieces[i]:
                raise BundleError(
                    f"{path.name}: piece {i} is {sp.IdToPiece(i)!r} but tokens.txt has {self.pieces[i]!r}"
                )
        return sp

    def _is_control(self, token_id: int, piece: str) -> bool:
        sp = self._sp
        if sp is not None and token_id < sp.GetPieceSize():
            # Byte pieces stay: SentencePiece's decoder joins them into characters.
            return bool(sp.IsUnknown(token_id) or sp.IsControl(token_id))
        return bool(_CONTROL_RE.match(piece))

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> Tokenizer:
        return cls(bundle.pieces, bundle.config.blank_token_id, bundle.sentencepiece_path)

    # -- queries ----------------------------------------------------------------------------------

    def language_of(self, token_id: int) -> str | None:
        """The locale of a language-tag token ("uk-UA"), else None."""
        return self._tag[token_id] if 0 <= token_id < len(self._tag) else None

    def starts_word(self, token_id: int) -> bool:
        return (
            0 <= token_id < len(self.pieces)
            and not self._silent[token_id]
            and self.pieces[token_id].startswith(WORD_START)
        )

    def decode(self, ids: Sequence[int]) -> Decoded:
        return Decoded(_canonical(self._raw(ids)), self._last_language(ids))

    # -- internals --------------------------------------------------------------------------------

    def _check(self, token_id: int) -> None:
        if not 0 <= token_id < len(self.pieces):
            raise ValueError(f"token id {token_id} outside the vocabulary of {len(self.pieces)} pieces")

    def _kept(self, ids: Sequence[int]) -> list[int]:
        kept = []
        for i in ids:
            self._check(i)
            if not self._silent[i]:
                kept.append(i)
        return kept

    def _raw(self, ids: Sequence[int]) -> str:
        kept = self._kept(ids)
        if self._sp is not None:
            return str(self._sp.DecodeIds(kept)) if kept else ""
        return "".join(self._text[i] for i in kept)

    def _last_language(self, ids: Sequence[int]) -> str | None:
        for i in reversed(ids):
            self._check(i)
            if self._tag[i] is not None:
                return self._tag[i]
        return None

    def incremental(self) -> IncrementalText:
        return IncrementalText(self)


class IncrementalText:
    """Text of a growing token list: `extend(ids)` returns the text so far, which only grows."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._raw = ""
        self.language: str | None = None
        self.text = ""

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def extend(self, ids: Sequence[int]) -> str:
        if not ids:
            return self.text
        self._ids.extend(ids)
        if self._tok._sp is not None:
            self._raw = self._tok._raw(self._ids)  # byte pieces may combine across the boundary
        else:
            self._raw += self._tok._raw(ids)
        self.language = self._tok._last_language(ids) or self.language
        self.text = _canonical(self._raw)
        return self.text
