"""`ttg make-bundle` then `ttg transcribe`, end to end as a user runs them (subprocesses), and token-level
agreement with the reference implementation (HF transformers greedy decoding, shared weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import peers
from tests.fixtures.bundle import ReferenceBundle

ROOT = Path(__file__).resolve().parents[2]


def ttg(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # The developer's own TTG_*/NEMO_* variables (TTG_MODEL__DIR...) must not change what a test runs.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TTG_", "NEMO_"))}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **(env or {})},
    )


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two spoken phrases with a pause, as espeak-ng writes them (22.05 kHz: transcribe resamples)."""
    d = tmp_path_factory.mktemp("speech")
    parts = []
    for i, text in enumerate(["Good morning, this is a test call.", "Please transcribe every word."]):
        p = d / f"part{i}.wav"
        subprocess.run([peers.tool("espeak-ng"), "-v", "en-us", "-s", "160", "-w", str(p), text], check=True)
        parts.append(p)
    out = d / "speech.wav"
    subprocess.run([peers.tool("sox"), str(parts[0]), str(parts[1]), str(out), "pad", "0", "0.6"], check=True)
    return out


@pytest.fixture(scope="module")
def made_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("made") / "tiny"
    r = ttg("make-bundle", "--size", "tiny", "--seed", "0", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


def events(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_make_bundle_then_transcribe_is_deterministic(made_bundle: Path, speech: Path) -> None:
    first = ttg("transcribe", "--model", made_bundle, "--segments", speech)
    second = ttg("transcribe", "--model", made_bundle, "--segments", speech)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    lines = first.stdout.splitlines()
    assert lines and all(line.startswith("[") for line in lines)


def test_partials_grow_as_prefixes_of_the_final(made_bundle: Path, speech: Path) -> None:
    r = ttg("transcribe", "--model", made_bundle, "--json", speech)
    assert r.returncode == 0, r.stderr
    evs = events(r.stdout)
    assert evs[-1]["event"] == "StreamEnded" and evs[-1]["reason"] == "finished"
    assert evs[-1]["dropped_chunks"] == 0
    transcripts = [e for e in evs if e["event"] == "TranscriptEvent"]
    assert any(e["kind"] == "partial" for e in transcripts)
    last_text: dict[object, str] = {}
    for e in transcripts:
        text = str(e["text"])
        assert text.startswith(last_text.get(e["segment_id"], ""))
        last_text[e["segment_id"]] = text
    plain = ttg("transcribe", "--model", made_bundle, "--partials", speech)
    assert plain.returncode == 0 and any(line.startswith("~ ") for line in plain.stdout.splitlines())


def test_transcribe_tokens_equal_the_reference_greedy_decode(
    reference_tiny: ReferenceBundle, speech: Path
) -> None:
    """Our streaming pipeline (features, chunker, MLX encoder, ORT greedy) against HF transformers'
    feature extractor + offline `generate` on the same weights and the same resampled audio."""
    torch = peers.module("torch")
    from transformers.models.nemotron_asr_streaming.feature_extraction_nemotron_asr_streaming import (
        NemotronAsrStreamingFeatureExtractor,
    )

    from tools.transcribe import read_audio

    r = ttg(
        "transcribe",
        "--model",
        reference_tiny.bundle,
        "--lang",
        "en-US",
        "--lookahead",
        "3",
        "--vad",
        "off",  # the pipeline itself: a VAD flush decodes its frames with padded right context
        "--json",
        speech,
    )
    assert r.returncode == 0, r.stderr
    ours = [int(t) for e in events(r.stdout) if e.get("kind") == "final" for t in e["token_ids"]]  # type: ignore[attr-defined]
    print(f"{len(ours)} tokens")

    audio = read_audio(speech)  # the same soxr resampling transcribe does
    fe = NemotronAsrStreamingFeatureExtractor(feature_size=128)
    feats = fe(audio, sampling_rate=16_000, return_tensors="pt")["input_features"]
    prompt = json.loads((reference_tiny.bundle / "nemotron_onnx_config.json").read_text())[
        "prompt_dictionary"
    ]
    blank = reference_tiny.spec.blank_id
    with torch.no_grad():
        out = reference_tiny.model.generate(
            input_features=feats,
            prompt_ids=torch.tensor([prompt["en-US"]]),
            num_lookahead_tokens=3,
            max_new_tokens=100_000,
        )
    ref = [int(t) for t in out.sequences[0].tolist() if int(t) != blank]
    assert len(ours) > 10
    # Finals hold every token except a tail without text (e.g. a lone language tag) at the very end.
    assert ref[: len(ours)] == ours
    tail = ref[len(ours) :]
    if tail:
        from asr_core.bundle import load_bundle
        from asr_core.tokenizer import Tokenizer

        tok = Tokenizer.from_bundle(load_bundle(reference_tiny.bundle))
        assert tok.decode(tail).text.strip() == ""


def test_without_a_model_it_uses_the_demo_model_or_warns_loudly(tmp_path: Path, speech: Path) -> None:
    from asr_core.model import embedded_model_dir

    r = ttg("transcribe", speech, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    if embedded_model_dir() is None:
        assert "MEANINGLESS" in r.stderr
        assert (tmp_path / "ttg" / "tiny-random-bundle-seed0" / "encoder.safetensors").exists()
    else:  # the shipped demo model is the default: no warning, no random bundle
        assert "MEANINGLESS" not in r.stderr and not (tmp_path / "ttg").exists()


def test_bad_input_is_a_clear_error(made_bundle: Path, speech: Path, tmp_path: Path) -> None:
    r = ttg("transcribe", "--model", made_bundle, tmp_path / "missing.wav")
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = ttg("transcribe", "--model", made_bundle, "--lang", "xx-XX", speech)
    assert r.returncode == 2 and "unknown language" in r.stderr
    r = ttg("transcribe", "--model", tmp_path, speech)
    assert r.returncode == 2 and "cannot load the model" in r.stderr


def test_stereo_and_other_rates_are_mixed_down_and_resampled(tmp_path: Path) -> None:
    import soundfile as sf

    from tools.transcribe import read_audio

    t = np.arange(8000) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 440 * t)], axis=1) * 0.5
    path = tmp_path / "tone.flac"
    sf.write(str(path), stereo, 8000)
    audio = read_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1 and abs(len(audio) - 16000) <= 1
    assert 0.3 < float(np.sqrt(np.mean(audio[1000:-1000] ** 2))) < 0.4  # 0.5 / sqrt(2)


def test_the_model_is_the_flag_else_ttg_model_dir_else_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools.transcribe import cli_model_dir, default_model_dir

    monkeypatch.delenv("TTG_MODEL__DIR", raising=False)
    monkeypatch.delenv("NEMO_MODEL_DIR", raising=False)
    assert cli_model_dir(None) == default_model_dir()
    monkeypatch.setenv("NEMO_MODEL_DIR", str(tmp_path / "alias"))
    assert cli_model_dir(None) == tmp_path / "alias"
    monkeypatch.setenv("TTG_MODEL__DIR", str(tmp_path / "env"))
    assert cli_model_dir(None) == tmp_path / "env"
    assert cli_model_dir(tmp_path / "flag") == tmp_path / "flag"
