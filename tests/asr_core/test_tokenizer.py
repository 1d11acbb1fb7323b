"""Tokenizer: pieces -> text, language tags stripped and reported, text that only grows."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr_core.errors import BundleError
from asr_core.tokenizer import Decoded, Tokenizer

W = "\u2581"
PIECES = [
    "<unk>",
    "<en-US>",
    "<uk-UA>",
    "<0x0A>",
    f"{W}hello",
    f"{W}world",
    ".",
    f"{W}",
    "ing",
    f"{W}при",
    "віт",
    "你",
    "好",
    f"{W}<fr-FR>",  # not a tag: a word piece that happens to contain brackets
    "<blank>",
]
BLANK = len(PIECES) - 1
IDS = {p: i for i, p in enumerate(PIECES)}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(PIECES, BLANK)


def _ids(*pieces: str) -> list[int]:
    return [IDS[p] for p in pieces]


def test_word_pieces_become_words(tok: Tokenizer) -> None:
    assert tok.decode(_ids(f"{W}hello", f"{W}world", ".")).text == "hello world."
    assert tok.decode(_ids(f"{W}при", "віт")).text == "привіт"
    assert tok.decode(_ids("你", "好")).text == "你好"  # CJK: no word marks, no spaces


def test_language_tags_are_stripped_and_the_last_is_reported(tok: Tokenizer) -> None:
    out = tok.decode(_ids(f"{W}hello", "<en-US>", f"{W}", f"{W}при", "віт", ".", "<uk-UA>"))
    assert out.text == "hello привіт."
    assert out.language == "uk-UA"
    assert tok.decode(_ids(f"{W}hello")).language is None
    assert tok.language_of(IDS["<en-US>"]) == "en-US" and tok.language_of(IDS[f"{W}hello"]) is None


def test_unk_byte_pieces_and_blank_give_no_text(tok: Tokenizer) -> None:
    ids = _ids("<unk>", f"{W}hello", "<0x0A>", "<blank>", f"{W}world")
    assert tok.decode(ids).text == "hello world"


def test_runs_of_spaces_collapse_and_edges_are_trimmed(tok: Tokenizer) -> None:
    assert tok.decode(_ids(f"{W}", f"{W}hello", f"{W}", f"{W}", f"{W}world", f"{W}")).text == "hello world"
    assert tok.decode([]).text == ""


def test_starts_word(tok: Tokenizer) -> None:
    assert tok.starts_word(IDS[f"{W}hello"]) and not tok.starts_word(IDS["ing"])
    assert not tok.starts_word(IDS["<en-US>"]) and not tok.starts_word(BLANK) and not tok.starts_word(999)


def test_ids_outside_the_vocabulary_are_an_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([len(PIECES)])
    with pytest.raises(ValueError):
        Tokenizer(PIECES, len(PIECES))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), max_size=30))
def test_text_of_a_growing_token_list_only_grows(ids: list[int]) -> None:
    tok = Tokenizer(PIECES, BLANK)
    inc = tok.incremental()
    previous = ""
    for i in range(len(ids)):
        text = inc.extend(ids[i : i + 1])
        assert text == tok.decode(ids[: i + 1]).text
        assert text.startswith(previous)
        previous = text
    assert inc.language == tok.decode(ids).language
    assert inc.ids == tuple(ids)


def test_bundle_tokenizer_strips_the_generated_vocabularys_tags(tiny_bundle: Path) -> None:
    from asr_core.bundle import load_bundle

    tok = Tokenizer.from_bundle(load_bundle(tiny_bundle))
    pieces = list(tok.pieces)
    ids = [pieces.index(f"{W}hello"), pieces.index("<uk-UA>"), pieces.index(f"{W}world"), tok.blank_id]
    assert tok.decode(ids) == Decoded("hello world", "uk-UA")


# -- with a SentencePiece model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    import sentencepiece as spm

    lines = [
        "hello world this is a call",
        "please hold the line thank you",
        "привіт як справи дякую",
        "bonjour merci au revoir",
    ] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=80,
        model_type="unigram",
        user_defined_symbols=["<en-US>", "<uk-UA>", "<fr-FR>"],
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(path))
    pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())] + ["<blank>"]
    return path, pieces


def test_sentencepiece_model_decodes_like_sentencepiece_without_tags(
    sp_model: tuple[Path, list[str]],
) -> None:
    import sentencepiece as spm

    path, pieces = sp_model
    sp = spm.SentencePieceProcessor(model_file=str(path))
    tok = Tokenizer(pieces, len(pieces) - 1, path)
    ids = [*sp.EncodeAsIds("hello world"), pieces.index("<en-US>"), *sp.EncodeAsIds("дякую")]
    out = tok.decode([*ids, len(pieces) - 1])
    assert out.text == "hello world дякую" and out.language == "en-US"
    words = sp.EncodeAsIds("please hold the line")
    assert tok.decode(words).text == sp.DecodeIds(words)


def test_a_sentencepiece_model_that_disagrees_with_tokens_txt_is_rejected(
    sp_model: tuple[Path, list[str]],
) -> None:
    path, pieces = sp_model
    wrong = list(pieces)
    wrong[5] = "something-else"
    with pytest.raises(BundleError, match="piece 5"):
        Tokenizer(wrong, len(wrong) - 1, path)
    with pytest.raises(BundleError, match="not a SentencePiece model"):
        Tokenizer(pieces, len(pieces) - 1, Path(__file__))
