"""The demo corpus text: numbers as spoken, one normalization, and a held-out set of new sentences."""

from __future__ import annotations

import random
import re

import pytest

from tools.demo_model import text


@pytest.mark.parametrize(
    ("n", "spoken"),
    [
        (0, "zero"),
        (13, "thirteen"),
        (40, "forty"),
        (245, "two hundred forty five"),
        (1000, "one thousand"),
        (2553, "two thousand five hundred fifty three"),
        (1_000_017, "one million seventeen"),
    ],
)
def test_english_cardinals_are_spelled_as_spoken_without_hyphens(n: int, spoken: str) -> None:
    assert text.en_cardinal(n) == spoken


def test_english_ordinals_and_years_follow_how_dates_are_read() -> None:
    assert [text.en_ordinal(d) for d in (1, 2, 3, 12, 20, 21, 28)] == [
        "first", "second", "third", "twelfth", "twentieth", "twenty first", "twenty eighth",
    ]  # fmt: skip
    assert text.en_year(2024) == "twenty twenty four"
    assert text.en_year(2007) == "two thousand seven"
    assert text.en_year(1905) == "nineteen oh five"
    assert text.en_year(1900) == "nineteen hundred"


def test_ukrainian_amounts_agree_in_gender_and_number() -> None:
    forms = ("гривня", "гривні", "гривень")
    assert [text.uk_plural(n, forms) for n in (1, 2, 5, 11, 14, 21, 22, 25, 101)] == [
        "гривня", "гривні", "гривень", "гривень", "гривень", "гривня", "гривні", "гривень", "гривня",
    ]  # fmt: skip
    assert text.uk_cardinal(2, feminine=True) == "дві"
    assert text.uk_cardinal(2) == "два"
    assert text.uk_cardinal(1234, feminine=True) == "одна тисяча двісті тридцять чотири"
    assert text.uk_digits("509") == "п'ять нуль дев'ять"


def test_normalize_lowercases_drops_punctuation_and_keeps_word_apostrophes() -> None:
    assert text.normalize("Hello, I'd  like ‘THAT’ -- OK?") == "hello i'd like that ok"
    assert text.normalize("П’ять, ДВА!") == "п'ять два"
    assert text.normalize("  ") == ""


def test_every_spoken_label_is_already_normalized_and_has_no_digits() -> None:
    rng = random.Random(7)
    for split in ("train", "test"):
        for lang in ("en", "uk"):
            for _ in range(300):
                s = text.make_sentence(rng, lang, split)
                assert s.spoken == text.normalize(s.spoken)
                assert not re.search(r"\d", s.spoken), s
                assert "{" not in s.spoken


def test_held_out_templates_and_names_never_occur_in_training() -> None:
    for templates in (text.EN_TEMPLATES, text.UK_TEMPLATES):
        assert not set(templates["train"]) & set(templates["test"])

    def names(split: str) -> set[str]:
        return set(text._NAMES[split]["first"]) | set(text._NAMES[split]["last"])

    # Neither as a first nor as a last name: a held-out name is a word training never heard.
    assert not names("train") & names("test")
    assert not set(text._COMPANIES["train"]) & set(text._COMPANIES["test"])


def test_held_out_sentences_use_only_words_that_training_sentences_contain() -> None:
    # New sentences, known vocabulary (slot values aside): what the held-out WER measures is
    # generalisation to new word sequences and voices, not to words never heard.
    def words(templates: tuple[str, ...]) -> set[str]:
        return {w for t in templates for w in re.sub(r"\{\w+\}", " ", t).split()}

    for templates in (text.EN_TEMPLATES, text.UK_TEMPLATES):
        assert words(templates["test"]) <= words(templates["train"])


def test_word_salad_is_made_of_training_words_only_and_never_held_out_names() -> None:
    rng = random.Random(3)
    held_out_names = set(text._NAMES["test"]["first"]) | set(text._NAMES["test"]["last"])
    for lang in ("en", "uk"):
        known = set(text.training_vocabulary(lang).types)
        for _ in range(200):
            s = text.make_salad(rng, lang)
            words = s.spoken.split()
            assert 3 <= len(words) <= 10 and set(words) <= known
            assert s.spoken == text.normalize(s.spoken) and not set(words) & held_out_names


def test_a_salad_share_changes_training_sentences_but_not_the_held_out_set() -> None:
    from tools.demo_model import corpus

    plain = corpus.plan("train", 300, 0.15, seed=4)
    mixed = corpus.plan("train", 300, 0.15, seed=4, salad_share=0.4)
    salads = sum(u.template == "{salad}" for u in mixed)
    assert 80 <= salads <= 160 and not any(u.template == "{salad}" for u in plain)
    assert corpus.plan("test", 50, 0.15, seed=4) == corpus.plan("test", 50, 0.15, seed=4)


def _held_out_names_and_companies() -> set[str]:
    """Read from the lists the test split draws from, not from the code's own exclusion set."""
    return set(text._NAMES["test"]["first"]) | set(text._NAMES["test"]["last"]) | set(text._COMPANIES["test"])


def test_coined_words_are_pronounceable_new_words_never_a_held_out_name_or_company() -> None:
    rng = random.Random(5)
    held_out = _held_out_names_and_companies()
    words = [text.coin_word(rng) for _ in range(5000)]
    assert not set(words) & held_out
    assert all(3 <= len(w) <= 12 and w.isascii() and w.isalpha() and w == text.normalize(w) for w in words)
    assert len(set(words)) > 4000  # thousands of different spellings, not a list to memorize
    known = set(text.training_vocabulary("en").types)
    for _ in range(200):
        s = text.make_coined(rng)
        assert s.lang == "en" and s.template == "{coined}" and 3 <= len(s.spoken.split()) <= 8
        assert not set(s.spoken.split()) & held_out
    mixed = [w for _ in range(300) for w in text.make_coined(rng).spoken.split()]
    assert 0.3 < sum(w not in known for w in mixed) / len(mixed) < 0.7


def test_a_coined_share_adds_english_coined_sentences_and_without_it_a_set_stays_as_it_was() -> None:
    from tools.demo_model import corpus

    assert corpus.plan("train", 300, 0.15, seed=4, salad_share=0.4, shard=2, coined_share=0.0) == corpus.plan(
        "train", 300, 0.15, seed=4, salad_share=0.4, shard=2
    )
    coined = corpus.plan("train", 300, 0.15, seed=4, salad_share=0.2, coined_share=0.9)
    assert 120 <= sum(u.template == "{coined}" for u in coined) <= 240
    assert all(u.lang == "en" for u in coined if u.template == "{coined}")


def test_coined_names_fill_name_and_company_slots_only_when_asked() -> None:
    held_out = _held_out_names_and_companies()
    plain = [text.make_sentence(random.Random(s), "en", "train") for s in range(300)]
    same = [text.make_sentence(random.Random(s), "en", "train", coined_names=0.0) for s in range(300)]
    assert plain == same  # without coined names the draws are the ones they always were
    known = set(text.training_vocabulary("en").types)
    named = [
        text.make_sentence(random.Random(s), "en", "train", coined_names=1.0)
        for s in range(2000)
        if "{name}" in text.make_sentence(random.Random(s), "en", "train").template
    ]
    assert len(named) > 100
    for s in named:
        template_words = set(text._SLOT_RE.sub(" ", s.template).split())
        new_words = [w for w in s.spoken.split() if w not in template_words and not w.isdigit()]
        assert new_words and not set(new_words) & held_out
    assert sum(w not in known for s in named for w in s.spoken.split()) >= 2 * len(named) * 0.9


def test_spliced_sentences_join_the_start_of_one_training_sentence_to_the_end_of_another() -> None:
    rng = random.Random(11)
    starts = {t.split()[0] for t in text.EN_TEMPLATES["train"] if not t.startswith("{")}
    names = text._NAMES["train"]
    known = {
        *text.training_vocabulary("en").types,
        *names["first"],
        *names["last"],
        *text._COMPANIES["train"],
    }
    sentences = [text.make_spliced(rng, "en") for _ in range(500)]
    for s in sentences:
        words = s.spoken.split()
        assert s.template == "{spliced}" and 1 <= len(words) <= 24 and set(words) <= known
        assert s.spoken == text.normalize(s.spoken)
    assert sum(s.spoken.split()[0] in starts for s in sentences) > 0.8 * len(sentences)
    templates = {text.normalize(t) for t in text.EN_TEMPLATES["train"]}
    assert sum(s.spoken not in templates for s in sentences) > 0.7 * len(sentences)  # mostly new sentences


def test_perturbed_sentences_edit_about_the_given_share_of_words() -> None:
    import jiwer

    for rate in (0.12, 0.3):
        edits = words = 0
        for seed in range(400):
            original = text.make_sentence(random.Random(seed), "en", "train").spoken
            edited = text.make_perturbed(random.Random(seed), "en", rate=rate)
            assert edited.template == "{perturbed}" and edited.spoken
            out = jiwer.process_words(original, edited.spoken)
            edits += out.substitutions + out.deletions + out.insertions
            words += len(original.split())
        assert 0.6 * rate < edits / words < 1.2 * rate, (rate, edits / words)


def test_new_mixes_leave_sets_built_without_them_and_the_held_out_set_unchanged() -> None:
    from tools.demo_model import corpus

    base = corpus.plan("train", 300, 0.15, seed=4, salad_share=0.4, shard=2)
    assert base == corpus.plan(
        "train", 300, 0.15, seed=4, salad_share=0.4, shard=2, splice_share=0.0, perturb_share=0.0
    )
    varied = corpus.plan("train", 1000, 0.15, seed=4, shard=5, **corpus.VARIED_MIX)
    share = {k: sum(u.template == k for u in varied) / 1000 for k in ("{salad}", "{spliced}", "{perturbed}")}
    assert (
        0.2 < share["{salad}"] < 0.3 and 0.2 < share["{spliced}"] < 0.35 and 0.1 < share["{perturbed}"] < 0.25
    )
    novel = corpus.plan(
        "dev", 200, 0.15, seed=4, shard=1, salad_share=0.0, splice_share=0.5, perturb_share=1.0
    )
    assert {u.template for u in novel} == {"{spliced}", "{perturbed}"}
    assert corpus.plan("test", 400, 0.15, seed=1234) == corpus.plan("test", 400, 0.15, seed=1234)
