"""`ttg eval`: manifests, scoring on normalized text, and the CLI over a real (random) bundle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from gateway.cli import main as ttg
from tools.eval import load_manifest, score


def test_manifest_paths_resolve_against_the_manifest_folder_and_extra_keys_are_kept(tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text(
        '{"audio": "a/x.wav", "text": "Hello", "lang": "en-US", "condition": "test"}\n'
        '\n{"audio": "y.wav", "text": "так"}\n',
        encoding="utf-8",
    )
    entries = load_manifest(tmp_path / "m.jsonl")
    assert [e.audio for e in entries] == [tmp_path / "a" / "x.wav", tmp_path / "y.wav"]
    assert entries[0].extra == {"condition": "test"} and entries[1].lang is None


def test_a_broken_manifest_line_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "manifest.jsonl").write_text('{"audio": "x.wav"}\n')
    with pytest.raises(ValueError, match=r"manifest.jsonl:1"):
        load_manifest(tmp_path)


def test_scores_ignore_case_and_punctuation_and_count_edits() -> None:
    s = score(["My account is four two.", "yes"], ["my account's four two", "Yes!"])
    assert s["words"] == 6 and s["substitutions"] == 1 and s["deletions"] == 1
    assert s["wer"] == pytest.approx(2 / 6, abs=1e-4)
    assert s["sentence_errors"] == 1
    assert score([""], ["anything"])["utterances"] == 0


def test_eval_cli_streams_and_decodes_offline_with_identical_transcripts(tmp_path: Path) -> None:
    from tools.make_bundle import make_bundle

    make_bundle(tmp_path / "bundle", "tiny", 0)
    rng = np.random.default_rng(0)
    rows = []
    for i, seconds in enumerate((1.3, 2.1, 0.7)):
        sf.write(
            tmp_path / f"c{i}.wav", (0.1 * rng.standard_normal(int(8000 * seconds))).astype(np.float32), 8000
        )
        rows.append({"audio": f"c{i}.wav", "text": "one two three", "lang": "uk-UA" if i == 2 else "en-US"})
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    code = ttg(
        [
            "eval",
            "--set",
            str(tmp_path),
            "--model",
            str(tmp_path / "bundle"),
            "--mode",
            "both",
            "--lookahead",
            "3",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["utterances"] == 3
    assert set(result["streaming"]) >= {"all", "en-US", "uk-UA"}
    assert result["streaming_vs_offline"]["differ"] == 0
    assert all(u["streaming"] for u in result["utterance_results"])  # the random bundle does emit
    assert result["streaming"]["segmentation"]["finals"] >= 3


def test_segmentation_counts_finals_split_utterances_and_those_ending_in_one_word() -> None:
    from tools.eval import segmentation

    got = segmentation([["could you check"], ["could you check", "me"], ["yes", "i can"], []])
    assert got == {"finals": 5, "split": 2, "last_final_one_word": 1}


def test_eval_cli_rejects_an_empty_selection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "manifest.jsonl").write_text('{"audio": "x.wav", "text": "a", "condition": "test"}\n')
    assert ttg(["eval", "--set", str(tmp_path), "--condition", "nope"]) == 2
    assert "no utterances" in capsys.readouterr().err
