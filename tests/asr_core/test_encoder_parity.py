"""The MLX encoder equals the reference (transformers' Nemotron3_5AsrForRNNT, random weights).

The `reference_tiny` fixture is the HF model plus a bundle written from its weights (LayerNorms and
bias_u/v perturbed, so a dropped term shows). Streaming is compared chunk by chunk with the reference's
own streaming (`get_audio_features` with its caches). The reference cannot encode a short final chunk
the way its offline forward does (it drops the right padding), so a short final chunk is compared
with the reference's offline output, which is what streaming must reproduce.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from asr_core.bundle import load_bundle
from asr_core.encoder import (
    ChunkInput,
    StreamingEncoder,
    chunk_frames,
    encoder_frames,
    first_chunk_frames,
    offline_frames,
)
from tests.fixtures import peers

pytestmark = pytest.mark.reference

PROMPT = 19  # uk-UA
TOL_F32 = 1e-4


def chunks(n_mel: int, lookahead: int) -> Iterator[tuple[int, int, bool]]:
    """(start, stop, is_last) of the stream's chunks: 1+8r, then 8(r+1), the last one possibly short."""
    start, size = 0, first_chunk_frames(lookahead)
    while True:
        stop = min(n_mel, start + size)
        yield start, stop, stop == n_mel
        if stop == n_mel:
            return
        start, size = stop, chunk_frames(lookahead)


def reference_offline(model: object, mel: np.ndarray, lookahead: int, prompt: int = PROMPT) -> np.ndarray:
    torch = peers.module("torch")
    with torch.no_grad():
        out = model.get_audio_features(  # type: ignore[attr-defined]
            input_features=torch.from_numpy(mel)[None],
            prompt_ids=torch.tensor([prompt]),
            num_lookahead_tokens=lookahead,
        )
    return out.pooler_output[0].numpy()


def reference_streaming(model: object, mel: np.ndarray, lookahead: int) -> list[np.ndarray]:
    """The reference's per-chunk output for every full chunk (a short final chunk is left out)."""
    torch = peers.module("torch")
    outs, cache, padding = [], None, None
    with torch.no_grad():
        for a, b, _ in chunks(len(mel), lookahead):
            if b - a != (first_chunk_frames(lookahead) if a == 0 else chunk_frames(lookahead)):
                break
            kw = {} if cache is None else {"cache": cache}
            out = model.get_audio_features(  # type: ignore[attr-defined]
                input_features=torch.from_numpy(mel[a:b])[None],
                prompt_ids=torch.tensor([PROMPT]),
                num_lookahead_tokens=lookahead,
                use_cache=True,
                output_attention_mask=False,
                padding_cache=padding,
                **kw,
            )
            cache, padding = out.cache, out.padding_cache
            outs.append(out.pooler_output[0].numpy())
    return outs


def stream(
    encoder: StreamingEncoder, mel: np.ndarray, lookahead: int, prompt: int = PROMPT
) -> list[np.ndarray]:
    slot = encoder.alloc(prompt, lookahead)
    try:
        return [
            encoder.step([ChunkInput(slot, mel[a:b], last)])[0] for a, b, last in chunks(len(mel), lookahead)
        ]
    finally:
        encoder.release(slot)


@pytest.fixture(scope="module", params=[False, True], ids=["mlx-exp", "array-exp"])
def encoder(reference_tiny: object, request: pytest.FixtureRequest) -> StreamingEncoder:
    """Both ways of computing the layers' sigmoid and softmax (asr_core.encoder.expmath)."""
    bundle = load_bundle(reference_tiny.bundle, "f32")  # type: ignore[attr-defined]
    return StreamingEncoder(
        bundle.encoder_weights, bundle.config.encoder, "f32", compile=False, array_exp=request.param
    )


def stream_lengths(lookahead: int) -> list[int]:
    first, later = first_chunk_frames(lookahead), chunk_frames(lookahead)
    # More than 56 encoder frames (the ring wraps, the cache saturates) and a short final chunk;
    # a stream ending exactly on a chunk; a stream shorter than its first chunk.
    long_chunks = -(-(56 + 2 * (lookahead + 1)) // (lookahead + 1))
    lengths = [first + later * long_chunks + later // 2 + 1, first + 2 * later]
    if first > 1:
        lengths.append(first // 2 + 1)
    return lengths


@pytest.mark.parametrize("lookahead", [0, 3, 6, 13])
def test_streaming_matches_the_reference_chunk_by_chunk(
    reference_tiny: object, encoder: StreamingEncoder, lookahead: int
) -> None:
    model = reference_tiny.model  # type: ignore[attr-defined]
    rng = np.random.default_rng(lookahead)
    for n_mel in stream_lengths(lookahead):
        mel = rng.standard_normal((n_mel, 128), dtype=np.float32)
        ours = stream(encoder, mel, lookahead)
        theirs = reference_streaming(model, mel, lookahead)
        offline = reference_offline(model, mel, lookahead)
        assert sum(len(o) for o in ours) == len(offline) == offline_frames(n_mel)
        assert float(np.abs(offline).mean()) > 0.1, "outputs of unit scale, so 1e-4 is a strict bound"
        for i, (mine, ref) in enumerate(zip(ours, theirs, strict=False)):
            assert mine.shape == ref.shape
            assert np.abs(mine - ref).max() <= TOL_F32, f"n_mel={n_mel} chunk {i}"
        if len(theirs) < len(ours):  # the short final chunk: against the reference's offline frames
            a, b, _ = list(chunks(n_mel, lookahead))[-1]
            tail = ours[-1]
            assert len(tail) == encoder_frames(b - a, a == 0, True)
            np.testing.assert_allclose(tail, offline[-len(tail) :], atol=TOL_F32, rtol=0)


@pytest.mark.parametrize("lookahead", [0, 3, 6, 13])
def test_offline_forward_matches_the_reference_and_streaming(
    reference_tiny: object, encoder: StreamingEncoder, lookahead: int
) -> None:
    model = reference_tiny.model  # type: ignore[attr-defined]
    rng = np.random.default_rng(100 + lookahead)
    for n_mel in (1, 7, 9, 250, 613):
        mel = rng.standard_normal((n_mel, 128), dtype=np.float32)
        ours = encoder.forward_offline(mel, lookahead, PROMPT)
        np.testing.assert_allclose(ours, reference_offline(model, mel, lookahead), atol=TOL_F32, rtol=0)
        streamed = np.concatenate(stream(encoder, mel, lookahead))
        np.testing.assert_allclose(streamed, ours, atol=1e-5, rtol=1e-5, err_msg=f"n_mel={n_mel}")


def test_language_prompt_is_applied_after_the_encoder(
    reference_tiny: object, encoder: StreamingEncoder
) -> None:
    model = reference_tiny.model  # type: ignore[attr-defined]
    mel = np.random.default_rng(7).standard_normal((105, 128), dtype=np.float32)
    en, uk = encoder.forward_offline(mel, 3, 0), encoder.forward_offline(mel, 3, 19)
    assert np.abs(en - uk).max() > 1e-2
    np.testing.assert_allclose(en, reference_offline(model, mel, 3, prompt=0), atol=TOL_F32, rtol=0)


@pytest.mark.parametrize("precision,bound", [("f16", 5e-3), ("bf16", 3e-2)])
def test_half_precision_stays_close(reference_tiny: object, precision: str, bound: float) -> None:
    bundle = load_bundle(reference_tiny.bundle, precision)  # type: ignore[attr-defined]
    enc = StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, precision, compile=False)
    mel = np.random.default_rng(3).standard_normal((25 + 32 * 20 + 9, 128), dtype=np.float32)
    ours = np.concatenate(stream(enc, mel, 3))
    ref = reference_offline(reference_tiny.model, mel, 3)  # type: ignore[attr-defined]
    rel_l2 = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    assert rel_l2 <= bound, rel_l2
