"""A flush (non-committing step of a partial chunk) gives the frames of "the audio ends here" and
leaves the stream's caches exactly as they were: every later chunk encodes as without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asr_core.bundle import Bundle, load_bundle
from asr_core.encoder import ChunkInput, StreamingEncoder, chunk_frames, first_chunk_frames

LOOKAHEAD = 3
TOL = 1e-5


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle, "f32")


@pytest.fixture(scope="module")
def mel(bundle: Bundle) -> np.ndarray:
    rng = np.random.default_rng(3)
    n = first_chunk_frames(LOOKAHEAD) + 5 * chunk_frames(LOOKAHEAD)
    return rng.normal(-4.0, 2.0, (n, bundle.config.encoder.n_mels)).astype(np.float32)


def chunks(mel: np.ndarray) -> list[np.ndarray]:
    first = first_chunk_frames(LOOKAHEAD)
    size = chunk_frames(LOOKAHEAD)
    return [mel[:first]] + [mel[i : i + size] for i in range(first, len(mel), size)]


def encoder(bundle: Bundle) -> StreamingEncoder:
    return StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=False)


def stream(enc: StreamingEncoder, parts: list[np.ndarray], flush_before: dict[int, int]) -> list[np.ndarray]:
    """Encode `parts` in order; before part k, flush its first `flush_before[k]` frames."""
    slot = enc.alloc(0, LOOKAHEAD)
    out = []
    for k, part in enumerate(parts):
        if k in flush_before:
            enc.step([ChunkInput(slot, part[: flush_before[k]], flush=True)])
        out.append(enc.step([ChunkInput(slot, part)])[0])
    enc.release(slot)
    return out


def test_chunks_after_a_flush_encode_exactly_as_without_it(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    plain = stream(encoder(bundle), parts, {})
    flushed = stream(encoder(bundle), parts, {0: 7, 2: 13, 3: 1, 4: 31})
    for a, b in zip(plain, flushed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_flush_gives_the_frames_of_the_audio_ending_there(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    for k, n in [(0, 9), (2, 20), (3, 31)]:
        enc = encoder(bundle)
        slot = enc.alloc(0, LOOKAHEAD)
        ended = enc.alloc(0, LOOKAHEAD)  # the same audio, but the stream ends after n frames of part k
        for part in parts[:k]:
            enc.step([ChunkInput(slot, part), ChunkInput(ended, part)])
        partial = parts[k][:n]
        flushed, last = enc.step([ChunkInput(slot, partial, flush=True), ChunkInput(ended, partial, True)])
        assert 1 <= flushed.shape[0] <= LOOKAHEAD + 1
        np.testing.assert_allclose(flushed, last, atol=TOL)


def test_a_flush_sharing_a_step_leaves_the_other_rows_alone(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    enc = encoder(bundle)
    a, b = enc.alloc(0, LOOKAHEAD), enc.alloc(1, LOOKAHEAD)
    alone = encoder(bundle)
    ref = alone.alloc(1, LOOKAHEAD)
    for k, part in enumerate(parts):
        rows = [ChunkInput(b, part)]
        if k % 2:  # stream a flushes beside stream b's real chunk, then sends its own real chunk
            rows.append(ChunkInput(a, part[:20], flush=True))
        got = enc.step(rows)[0]
        enc.step([ChunkInput(a, part)])
        np.testing.assert_allclose(got, alone.step([ChunkInput(ref, part)])[0], atol=TOL)


def test_an_empty_flush_is_a_no_op_and_bad_flushes_are_refused(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    enc = encoder(bundle)
    slot = enc.alloc(0, LOOKAHEAD)
    assert enc.step([ChunkInput(slot, parts[0][:0], flush=True)])[0].shape[0] == 0
    with pytest.raises(ValueError, match="partial"):
        enc.step([ChunkInput(slot, parts[0], flush=True)])  # a whole chunk is not a flush
    with pytest.raises(ValueError, match="partial"):
        enc.step([ChunkInput(slot, parts[0][:5], is_last=True, flush=True)])
    np.testing.assert_array_equal(
        enc.step([ChunkInput(slot, parts[0])])[0], stream(encoder(bundle), parts[:1], {})[0]
    )
