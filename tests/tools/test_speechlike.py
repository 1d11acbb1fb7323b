"""Speech-calibrated bundles (`ttg make-bundle --calibrate speech`) decode telephone speech like a
speech model: a few tokens per second of speech, none in pauses, a final at each pause."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from asr_core.api import StreamEnded, TranscriptEvent
from tests.fixtures import peers
from tests.fixtures.bundle import BundleFactory
from tools.bench.speechlike import analyse, held_out_set, stream_speech, token_times
from tools.bundle.spec import TINY
from tools.bundle.speech import RATE, SpeechStream, frame_labels, render, telephone_channel
from tools.bundle.speechlike import encoder_outputs, shape_encoder
from tools.bundle.weights import random_encoder_tensors
from tools.make_bundle import add_arguments
from tools.make_bundle import main as make_bundle_main


@pytest.fixture(scope="module")
def speech_bundle(bundle_factory: BundleFactory) -> Path:
    peers.tool("espeak-ng")  # the calibration speaks its sentences with it
    return bundle_factory("tiny", 0, "f32", calibrate="speech")


@pytest.fixture(scope="module")
def speech_model(speech_bundle: Path) -> Any:
    from asr_core.model import AsrModel

    return AsrModel.load(speech_bundle, "f32")


def test_calibration_reaches_its_token_rate_with_nothing_in_pauses(speech_bundle: Path) -> None:
    with safe_open(str(speech_bundle / "encoder.safetensors"), "np") as f:
        meta = f.metadata()
    assert meta["weights"] == "random" and meta["calibration"] == "speech"
    assert 3.0 <= float(meta["calibration_speech_tokens_per_second"]) <= 4.0  # asked for 3.5
    assert meta["calibration_pause_tokens"] == "0"
    assert int(meta["calibration_distinct_tokens"]) >= 40


def test_speech_calibrated_bundle_passes_the_strict_loader(speech_bundle: Path) -> None:
    from asr_core.bundle import load_bundle

    bundle = load_bundle(speech_bundle, "f32")
    assert len(bundle.encoder_weights) == len(TINY.encoder_shapes())
    assert bundle.config.blank_token_id == TINY.blank_id
    assert bundle.config.encoder == TINY.encoder_config()  # what the calibration's encoder pass ran


def test_held_out_speech_through_the_engine_decodes_like_speech(speech_model: Any) -> None:
    """Other sentences and voices than the calibration's, streamed through the engine: a token rate
    within a factor of two of the calibrated 3.5 per second, nothing in pauses, a final in each."""
    streams = render(held_out_set(per_voice=2))
    results = [
        analyse(s, ev, 400) for s, ev in zip(streams, stream_speech(speech_model, streams), strict=True)
    ]
    speech_s = sum(r.speech_s for r in results)
    assert 3.5 / 2 <= sum(r.speech_tokens for r in results) / speech_s <= 3.5 * 2
    assert sum(r.pause_tokens for r in results) == 0
    assert sum(r.pauses_with_final for r in results) == sum(r.pauses for r in results) > 0
    assert sum(r.splits_inside_sentences + r.silent_sentences for r in results) == 0


def test_silence_and_line_noise_decode_to_nothing(speech_model: Any) -> None:
    rng = np.random.default_rng(0)
    quiet = np.zeros(8000 * 6, np.float32)
    noisy = (rng.standard_normal(8000 * 6) * 10 ** (-55 / 20)).astype(np.float32)
    streams = [
        SpeechStream(name, prompt, telephone_channel(pcm), (), ())
        for name, prompt, pcm in (("zero", "en-US", quiet), ("noise", "auto", noisy), ("uk", "uk-UA", noisy))
    ]
    for events in stream_speech(speech_model, streams):
        assert [type(e) for e in events] == [StreamEnded]
        assert events[0].reason == "finished" and events[0].chunks > 0


def test_the_loudness_channel_never_reads_the_zero_padding() -> None:
    """Digital silence stays in one narrow band of output dimension 0, far below speech, on every
    frame, including a stream's first and last (whatever its length), where the encoder pads with
    zeros (which would read as loud)."""
    enc = dict(random_encoder_tensors(TINY, 3))
    shape_encoder(TINY, enc)
    streams = [
        SpeechStream(f"s{n}", "en-US", np.zeros(n, np.float32), (), ())
        for n in (RATE * 2, RATE * 2 + 160, RATE * 2 + 1440, RATE * 3 + 999)
    ]
    silent = np.concatenate([z[:, 0] for z in encoder_outputs(TINY, enc, streams)])
    peers.tool("espeak-ng")  # the speech it is compared with
    speech = render(held_out_set(per_voice=1))[:1]
    loud = encoder_outputs(TINY, enc, speech)[0][:, 0]
    gap = float(np.median(loud[frame_labels(speech[0].spans, len(loud), 2) == 1])) - silent.max()
    assert gap > 1.0 and np.ptp(silent) < 0.1 * gap


def test_the_bytes_do_not_depend_on_how_many_threads_blas_may_use(tmp_path: Path) -> None:
    """The calibration's encoder pass gave other sums with OpenBLAS on 1 and on 2 threads."""
    bundles = []
    for threads in ("1", "2"):
        out = tmp_path / f"threads-{threads}"
        subprocess.run(
            [sys.executable, "-m", "gateway.cli", "make-bundle", "--size", "tiny", "--calibrate", "speech",
             "--out", str(out)],
            env={**os.environ, "OPENBLAS_NUM_THREADS": threads}, check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        bundles.append(out)
    for name in ("encoder.safetensors", "decoder.onnx", "joiner.onnx"):
        assert (bundles[0] / name).read_bytes() == (bundles[1] / name).read_bytes(), name


def test_same_arguments_give_the_same_bytes(speech_bundle: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--size", "tiny", "--calibrate", "speech", "--out", str(tmp_path / "again")])
    assert make_bundle_main(args) == 0
    for name in ("encoder.safetensors", "decoder.onnx", "joiner.onnx"):
        assert (tmp_path / "again" / name).read_bytes() == (speech_bundle / name).read_bytes(), name


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_refuses_speech_calibration_of_reference_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parse("--calibrate", "speech", "--from-reference", "--out", str(tmp_path / "x"))
    assert make_bundle_main(args) == 2
    assert "--from-reference" in capsys.readouterr().err


def test_cli_says_when_espeak_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert make_bundle_main(_parse("--calibrate", "speech", "--out", str(tmp_path / "x"))) == 2
    assert "espeak-ng is not on PATH" in capsys.readouterr().err


def _event(
    kind: str, segment: int, ids: tuple[int, ...], end_ms: int, at_end: bool = False
) -> TranscriptEvent:
    return TranscriptEvent("s", kind, segment, "x" * len(ids), 0, end_ms, ids, None, at_end)  # type: ignore[arg-type]


def test_tokens_are_timed_by_the_first_event_that_carries_them() -> None:
    events = [
        _event("partial", 0, (5,), 400),
        _event("partial", 0, (5, 6, 7), 720),
        _event("final", 0, (5, 6, 7, 8), 800),
        _event("partial", 1, (9,), 2000),
        StreamEnded("s", "finished"),
    ]
    assert [(t.ms, t.token, t.segment) for t in token_times(events)] == [
        (320, 5, 0),
        (640, 6, 0),
        (640, 7, 0),
        (720, 8, 0),
        (1920, 9, 1),
    ]


def test_finals_are_judged_by_where_segments_split() -> None:
    """Sentences at 1-2 s, 3-4 s and 5-5.5 s of a 6 s stream; the third gets no token."""
    spans = ((RATE, 2 * RATE), (3 * RATE, 4 * RATE), (5 * RATE, 5 * RATE + RATE // 2))
    stream = SpeechStream("v", "en-US", np.zeros(6 * RATE, np.float32), spans, ())
    events = [
        _event("partial", 0, (1, 2), 1500),
        _event("final", 0, (1, 2, 3), 2080),  # closed in the first pause
        _event("partial", 1, (4,), 2500),  # a token in that pause, 420 ms after the sentence
        _event("final", 1, (4, 5), 3500),  # a final inside the second sentence...
        _event("final", 2, (6, 7), 3900, at_end=True),  # ...whose rest only ends with the stream
        StreamEnded("s", "finished"),
    ]
    r = analyse(stream, events, tolerance_ms=400)
    assert (r.speech_tokens, r.pause_tokens, r.distinct_tokens) == (6, 1, 7)
    assert (r.pauses, r.pauses_with_final, r.pauses_merged) == (2, 1, 1)
    assert (r.splits_inside_sentences, r.silent_sentences, r.finals) == (1, 1, 3)
    assert r.speech_s == pytest.approx(2.5) and r.pause_s == pytest.approx(6.0 - 1.8 - 1.8 - 1.3)
