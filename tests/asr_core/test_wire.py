"""The chunk record between a front-end process and the engine: what goes in comes out."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asr_core.frontend import ChunkPayload
from asr_core.wire import CHUNK, Chunk, decode_input, encode_chunk


def through_the_wire(payload: ChunkPayload, *, last: bool) -> Chunk:
    record = b"".join(bytes(part) for part in encode_chunk(7, payload, 12_345, last=last))
    out = decode_input(CHUNK, memoryview(record))
    assert isinstance(out, Chunk)
    return out


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"flush": True, "flush_frames": 3, "speech_end_at": 41.5},
        {"silent_since_flush": True},
    ],
)
def test_a_chunk_arrives_with_its_audio_times_and_flags(flags: dict[str, object]) -> None:
    rng = np.random.default_rng(0)
    sent = ChunkPayload(
        mel=rng.standard_normal((32, 128)).astype(np.float32),
        energies_db=rng.uniform(-120, 0, 4).astype(np.float32),
        completed_at=40.25,
        **flags,  # type: ignore[arg-type]
    )
    for last in (False, True):
        got = through_the_wire(sent, last=last)
        assert (got.key, got.last, got.samples) == (7, last, 12_345)
        np.testing.assert_array_equal(got.payload.mel, sent.mel)
        np.testing.assert_array_equal(got.payload.energies_db, sent.energies_db)
        assert dataclasses.replace(got.payload, mel=sent.mel, energies_db=sent.energies_db) == sent
