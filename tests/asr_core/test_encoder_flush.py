"""A flush (non-committing step) encodes a chunk as the stream's next one and leaves the stream's
caches exactly as they were: every later chunk encodes as without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asr_core.bundle import Bundle, load_bundle
from asr_core.chunker import MelChunker
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


def padded(part: np.ndarray, n: int) -> np.ndarray:
    """The first n frames of a chunk padded with copies of frame n-1 to the chunk and one more (what
    the chunker's flush_chunk gives)."""
    size = len(part) + chunk_frames(LOOKAHEAD)
    return np.concatenate([part[:n], np.repeat(part[n - 1 : n], size - n, axis=0)])


def stream(enc: StreamingEncoder, parts: list[np.ndarray], flush_before: dict[int, int]) -> list[np.ndarray]:
    """Encode `parts` in order; before part k, flush its first `flush_before[k]` frames, padded."""
    slot = enc.alloc(0, LOOKAHEAD)
    out = []
    for k, part in enumerate(parts):
        if k in flush_before:
            enc.step([ChunkInput(slot, padded(part, flush_before[k]), flush=True)])
        out.append(enc.step([ChunkInput(slot, part)])[0])
    enc.release(slot)
    return out


def test_chunks_after_a_flush_encode_exactly_as_without_it(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    plain = stream(encoder(bundle), parts, {})
    flushed = stream(encoder(bundle), parts, {0: 7, 2: 13, 3: 1, 4: 31})
    for a, b in zip(plain, flushed, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n_chunks", [1, 2])
def test_a_flush_gives_the_frames_of_its_chunks_streamed(
    bundle: Bundle, mel: np.ndarray, n_chunks: int
) -> None:
    parts = chunks(mel)
    for k in (0, 1, 3):
        enc = encoder(bundle)
        slot, other = enc.alloc(0, LOOKAHEAD), enc.alloc(0, LOOKAHEAD)  # other: the same, committed
        for part in parts[:k]:
            enc.step([ChunkInput(slot, part), ChunkInput(other, part)])
        flushed = enc.step([ChunkInput(slot, np.concatenate(parts[k : k + n_chunks]), flush=True)])[0]
        streamed = np.concatenate([enc.step([ChunkInput(other, p)])[0] for p in parts[k : k + n_chunks]])
        assert flushed.shape == (n_chunks * (LOOKAHEAD + 1), bundle.config.encoder.output_size)
        np.testing.assert_allclose(flushed, streamed, atol=TOL)


def test_a_flush_sharing_a_step_leaves_the_other_rows_alone(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    enc = encoder(bundle)
    a, b = enc.alloc(0, LOOKAHEAD), enc.alloc(1, LOOKAHEAD)
    alone = encoder(bundle)
    ref = alone.alloc(1, LOOKAHEAD)
    for k, part in enumerate(parts):
        rows = [ChunkInput(b, part)]
        if k % 2:  # stream a flushes beside stream b's real chunk, then sends its own real chunk
            rows.append(ChunkInput(a, padded(part, 20), flush=True))
        got = enc.step(rows)[0]
        enc.step([ChunkInput(a, part)])
        np.testing.assert_allclose(got, alone.step([ChunkInput(ref, part)])[0], atol=TOL)


def test_an_empty_flush_is_a_no_op_and_bad_flushes_are_refused(bundle: Bundle, mel: np.ndarray) -> None:
    parts = chunks(mel)
    enc = encoder(bundle)
    slot = enc.alloc(0, LOOKAHEAD)
    assert enc.step([ChunkInput(slot, parts[0][:0], flush=True)])[0].shape[0] == 0
    with pytest.raises(ValueError, match="flush"):
        enc.step([ChunkInput(slot, parts[0][:5], flush=True)])  # a partial chunk is padded first
    with pytest.raises(ValueError, match="flush"):
        enc.step([ChunkInput(slot, np.concatenate([parts[0], parts[1][:9]]), flush=True)])
    with pytest.raises(ValueError, match="flush"):
        enc.step([ChunkInput(slot, parts[0], is_last=True, flush=True)])
    np.testing.assert_array_equal(
        enc.step([ChunkInput(slot, parts[0])])[0], stream(encoder(bundle), parts[:1], {})[0]
    )


def test_the_chunker_pads_a_flush_with_its_last_frame_and_counts_the_real_frames() -> None:
    ch = MelChunker(LOOKAHEAD)
    frames = np.arange(25 + 20, dtype=np.float32)[:, None].repeat(2, axis=1)
    assert ch.flush_chunk()[0].shape[0] == 0  # no audio yet: nothing to flush
    assert len(ch.push(frames[:25])) == 1  # the first chunk; nothing pending
    chunk, real = ch.flush_chunk()  # late tokens of the last chunk may come in the next one's frames
    assert real == 0 and chunk.shape == (64, 2) and (chunk == frames[24]).all()
    assert not ch.push(frames[25:])  # 20 pending
    chunk, real = ch.flush_chunk()  # padded to the next chunk and one more
    assert chunk.shape == (64, 2) and real == 3  # 20 mel frames reach 3 of the 4 encoder frames
    np.testing.assert_array_equal(chunk[:20], frames[25:])
    np.testing.assert_array_equal(chunk[20:], np.repeat(frames[-1:], 44, axis=0))
    (nxt,) = ch.push(frames[:12])  # the frames stay pending: the real chunk follows as usual
    np.testing.assert_array_equal(nxt[:20], frames[25:])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_flush_of_later_chunks_rides_in_the_regular_stack_call(
    bundle: Bundle, mel: np.ndarray, compiled: bool
) -> None:
    """Its second chunk continues its first inside the call (caches taken from the first's context),
    so a step of later chunks and flushes makes one stack call; a flush at a stream's first chunk
    still makes one of its own. Every row's frames are those of the chunks streamed one by one."""
    parts = chunks(mel)
    enc = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", compile=compiled)
    ref = encoder(bundle)
    slots = [enc.alloc(0, LOOKAHEAD) for _ in range(4)]
    refs = [ref.alloc(0, LOOKAHEAD) for _ in range(4)]
    fresh, fresh_ref = enc.alloc(0, LOOKAHEAD), ref.alloc(0, LOOKAHEAD)
    enc.step([ChunkInput(s, parts[0]) for s in slots])
    ref.step([ChunkInput(s, parts[0]) for s in refs])
    later = np.concatenate(parts[1:3])
    before = enc.calls["stack"]
    got = enc.step(
        [ChunkInput(s, parts[1]) for s in slots[:2]] + [ChunkInput(s, later, flush=True) for s in slots[2:]]
    )
    assert enc.calls["stack"] - before == 1
    for g, r in zip(got[:2], refs[:2], strict=True):
        np.testing.assert_allclose(g, ref.step([ChunkInput(r, parts[1])])[0], atol=TOL)
    for g, r in zip(got[2:], refs[2:], strict=True):
        streamed = np.concatenate([ref.step([ChunkInput(r, p)])[0] for p in parts[1:3]])
        np.testing.assert_allclose(g, streamed, atol=TOL)
    before = enc.calls["stack"]
    first = np.concatenate(parts[0:2])
    enc.step([ChunkInput(slots[0], parts[2]), ChunkInput(fresh, first, flush=True)])
    assert enc.calls["stack"] - before == 2
    streamed = np.concatenate([ref.step([ChunkInput(fresh_ref, p)])[0] for p in parts[0:2]])
    got_first = enc.step([ChunkInput(fresh, first, flush=True)])[0]
    np.testing.assert_allclose(got_first, streamed, atol=TOL)
