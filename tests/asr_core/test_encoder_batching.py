"""Batched == solo: a stream's frames do not depend on who else is in the step (slot pool rules)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from asr_core.bundle import Bundle, load_bundle
from asr_core.config import SchedulerConfig
from asr_core.encoder import (
    ChunkInput,
    StreamingEncoder,
    chunk_frames,
    encoder_frames,
    first_chunk_frames,
    offline_frames,
)
from asr_core.scheduler import EncoderScheduler

TOL = 1e-5


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle, "f32")


def make(bundle: Bundle, **kw: object) -> StreamingEncoder:
    kw.setdefault("compile", False)
    return StreamingEncoder(bundle.encoder_weights, bundle.config.encoder, "f32", **kw)  # type: ignore[arg-type]


def split(mel: np.ndarray, lookahead: int, empty_last: bool = False) -> list[tuple[np.ndarray, bool]]:
    out, start, size = [], 0, first_chunk_frames(lookahead)
    while start < len(mel):
        stop = min(len(mel), start + size)
        out.append((mel[start:stop], stop == len(mel) and not empty_last))
        start, size = stop, chunk_frames(lookahead)
    if empty_last:
        out.append((mel[:0], True))
    return out


def solo(
    enc: StreamingEncoder, mel: np.ndarray, lookahead: int, prompt: int, empty_last: bool = False
) -> np.ndarray:
    slot = enc.alloc(prompt, lookahead)
    frames = [enc.step([ChunkInput(slot, c, last)])[0] for c, last in split(mel, lookahead, empty_last)]
    enc.release(slot)
    return np.concatenate(frames)


@dataclass
class Stream:
    lookahead: int
    prompt: int
    mel: np.ndarray
    joins_at: int
    empty_last: bool = False
    chunks: list[tuple[np.ndarray, bool]] = field(default_factory=list)
    slot: int | None = None
    out: list[np.ndarray] = field(default_factory=list)
    done: bool = False


def run_schedule(enc: StreamingEncoder, streams: list[Stream], rng: np.random.Generator) -> int:
    """Streams join at their step, skip steps at random (not ready), leave when done; returns steps."""
    for s in streams:
        s.chunks = split(s.mel, s.lookahead, s.empty_last)
    step = 0
    while not all(s.done for s in streams):
        rows, owners = [], []
        for s in streams:
            if s.done or step < s.joins_at or (s.slot is not None and rng.random() < 0.3):
                continue
            if s.slot is None:
                s.slot = enc.alloc(s.prompt, s.lookahead)
            chunk, last = s.chunks[len(s.out)]
            rows.append(ChunkInput(s.slot, chunk, last))
            owners.append(s)
        rng.shuffle(order := np.arange(len(rows)))
        outs = enc.step([rows[i] for i in order]) if rows else []
        for i, o in zip(order, outs, strict=True):
            s = owners[i]
            s.out.append(o)
            if rows[i].is_last:
                enc.release(s.slot)  # type: ignore[arg-type]
                s.done = True
        step += 1
    return step


@pytest.mark.parametrize(
    "compiled,kv_groups", [(False, 1), (True, 1), (True, 2)], ids=["eager", "compiled", "kv-layer-groups"]
)
def test_batched_frames_equal_each_streams_solo_run(bundle: Bundle, compiled: bool, kv_groups: int) -> None:
    rng = np.random.default_rng(11 if compiled else 12)
    lookaheads = [0, 3, 6, 13] if not compiled else [3, 3, 0, 13]
    streams = []
    for i in range(10 if not compiled else 5):
        r = lookaheads[i % len(lookaheads)]
        n_mel = int(rng.integers(1, 500))
        if i == 2:  # ends on a chunk boundary, then an empty last chunk (end of stream found later)
            n_mel = first_chunk_frames(r) + chunk_frames(r) * int(rng.integers(0, 5))
        streams.append(
            Stream(
                r,
                int(rng.choice([0, 19, 101])),
                rng.standard_normal((n_mel, 128), dtype=np.float32),
                joins_at=int(rng.integers(0, 12)),
                empty_last=i == 2,
            )
        )
    enc = make(bundle, capacity=2, compile=compiled, kv_groups=kv_groups)  # grows while streams join
    run_schedule(enc, streams, rng)
    assert enc.capacity >= 4 and enc.n_active == 0
    reference = make(bundle)
    for s in streams:
        want = solo(reference, s.mel, s.lookahead, s.prompt)
        got = np.concatenate(s.out)
        assert got.shape == want.shape == (offline_frames(len(s.mel)), bundle.config.encoder.output_size)
        assert np.abs(got - want).max() <= TOL


def test_freed_slot_is_reused_without_leaking_the_old_stream(bundle: Bundle) -> None:
    enc = make(bundle, capacity=1)
    rng = np.random.default_rng(5)
    old = rng.standard_normal((400, 128), dtype=np.float32)
    new = rng.standard_normal((300, 128), dtype=np.float32)
    slot = enc.alloc(19, 3)
    for c, last in split(old, 3)[:5]:
        enc.step([ChunkInput(slot, c, last)])
    enc.release(slot)  # mid-stream: its caches are full of the old audio
    assert enc.alloc(0, 6) == slot
    got = np.concatenate([enc.step([ChunkInput(slot, c, last)])[0] for c, last in split(new, 6)])
    np.testing.assert_allclose(got, solo(make(bundle), new, 6, 0), atol=TOL, rtol=0)


def test_streaming_equals_offline_for_every_length_of_final_chunk(bundle: Bundle) -> None:
    enc = make(bundle)
    rng = np.random.default_rng(9)
    for r in (0, 3):
        base = first_chunk_frames(r) + chunk_frames(r)
        for extra in range(0, chunk_frames(r) + 1):
            mel = rng.standard_normal((base + extra, 128), dtype=np.float32)
            got = solo(enc, mel, r, 101)
            # Two computations (chunks + caches vs the whole utterance): fp32 rounding, relative too.
            np.testing.assert_allclose(got, enc.forward_offline(mel, r, 101), atol=TOL, rtol=TOL)


def test_an_empty_last_chunk_ends_the_stream(bundle: Bundle) -> None:
    enc = make(bundle)
    mel = np.random.default_rng(1).standard_normal((57, 128), dtype=np.float32)
    slot = enc.alloc(0, 3)
    enc.step([ChunkInput(slot, mel[:25])])
    enc.step([ChunkInput(slot, mel[25:57])])
    assert enc.step([ChunkInput(slot, mel[:0], is_last=True)])[0].shape == (0, 64)
    with pytest.raises(ValueError, match="already received its last chunk"):
        enc.step([ChunkInput(slot, mel[:32])])


def test_chunk_geometry() -> None:
    assert [first_chunk_frames(r) for r in (0, 3, 6, 13)] == [1, 25, 49, 105]
    assert [chunk_frames(r) for r in (0, 3, 6, 13)] == [8, 32, 56, 112]
    for r in (0, 3, 6, 13):
        assert encoder_frames(first_chunk_frames(r), True, False) == r + 1
        assert encoder_frames(chunk_frames(r), False, False) == r + 1
        for n in range(1, chunk_frames(r) + 1):  # a short final chunk gives the offline frame count
            total = first_chunk_frames(r) + n
            assert r + 1 + encoder_frames(n, False, True) == offline_frames(total)


@pytest.mark.parametrize(
    "rows,message",
    [
        (
            lambda s: [ChunkInput(s, np.zeros((24, 128), np.float32))],
            "first chunk of 24 mel frames, expected 25",
        ),
        (lambda s: [ChunkInput(s, np.zeros((25, 80), np.float32))], r"mel of shape \(25, 80\)"),
        (lambda s: [ChunkInput(s, np.zeros((25, 128), np.float32))] * 2, "appears twice"),
        (lambda s: [ChunkInput(s + 1, np.zeros((25, 128), np.float32))], "is not allocated"),
    ],
)
def test_bad_rows_are_refused_before_anything_runs(bundle: Bundle, rows: object, message: str) -> None:
    enc = make(bundle)
    slot = enc.alloc(0, 3)
    with pytest.raises(ValueError, match=message):
        enc.step(rows(slot))  # type: ignore[operator]
    # The refused step left the stream untouched: its real first chunk still works.
    assert enc.step([ChunkInput(slot, np.zeros((25, 128), np.float32))])[0].shape == (4, 64)


def test_alloc_checks_prompt_and_lookahead(bundle: Bundle) -> None:
    enc = make(bundle)
    with pytest.raises(ValueError, match="lookahead 2 not in"):
        enc.alloc(0, 2)
    with pytest.raises(ValueError, match="prompt id 128 outside"):
        enc.alloc(128, 3)
    with pytest.raises(ValueError, match="slot 5 is not allocated"):
        enc.release(5)


def test_warmup_traces_every_batch_bucket_and_leaves_the_pool_empty(bundle: Bundle) -> None:
    enc = make(bundle, compile=True)
    assert enc.warmup(3, 5) == 4  # buckets 1, 2, 4, 8
    assert enc.n_active == 0 and enc.capacity == 8
    assert make(bundle).warmup(3, 5) == 0  # eager: nothing to trace
    mel = np.random.default_rng(2).standard_normal((100, 128), dtype=np.float32)
    np.testing.assert_allclose(solo(enc, mel, 3, 0), solo(make(bundle), mel, 3, 0), atol=TOL, rtol=0)


def test_warmup_sizes_the_pools_for_the_streams_expected_before_it_traces(bundle: Bundle) -> None:
    """The compiled calls take the pools as inputs: sized for the streams an engine expects from the
    start, live joins up to that many never grow them (a grown pool traces every call again)."""
    enc = make(bundle, compile=True)
    enc.warmup(3, 5, streams=20)
    assert enc.capacity == 20 and enc.n_active == 0
    slots = [enc.alloc(0, 3) for _ in range(20)]
    assert enc.capacity == 20  # no growth while the expected streams join
    mel = np.random.default_rng(4).standard_normal((25, 128), dtype=np.float32)
    batched = enc.step([ChunkInput(s, mel) for s in slots])
    eager = make(bundle)
    alone = eager.step([ChunkInput(eager.alloc(0, 3), mel)])[0]
    np.testing.assert_allclose(batched[7], alone, atol=TOL, rtol=0)
    small = make(bundle, compile=True)
    small.warmup(3, 5, streams=3)  # fewer than the batch buckets need: those decide
    assert small.capacity == 8


def test_warmup_splits_the_kv_pool_into_layer_groups_where_one_array_would_pass_the_limit(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU kernels address a pool array with 32 bits: where the streams expected would take one K|V
    array past that, warm-up splits it into groups of layers, each below, and a stream already running
    reads its caches from them as before. (The limit is lowered here so that 20 streams pass it.)"""
    from asr_core.encoder import streaming

    cfg = bundle.config.encoder
    per_slot = cfg.num_hidden_layers * cfg.left_context_frames * 2 * cfg.hidden_size
    monkeypatch.setattr(streaming, "_MAX_POOL_ELEMENTS", 12 * per_slot)
    assert streaming.pool_stream_limit(cfg) == 11 and streaming.pool_stream_limit(cfg, 2) == 23
    assert streaming.kv_groups_for(cfg, 11) == 1 and streaming.kv_groups_for(cfg, 20) == 2
    mel = np.random.default_rng(6).standard_normal((200, 128), dtype=np.float32)
    chunks = split(mel, 3)
    enc = make(bundle, compile=True)
    slot = enc.alloc(19, 3)
    frames = [enc.step([ChunkInput(slot, c, last)])[0] for c, last in chunks[:3]]
    enc.warmup(3, 5, streams=20)
    assert enc.kv_groups == 2 and enc.capacity == 20 and enc.n_active == 1
    frames += [enc.step([ChunkInput(slot, c, last)])[0] for c, last in chunks[3:]]
    np.testing.assert_allclose(np.concatenate(frames), solo(make(bundle), mel, 3, 19), atol=TOL, rtol=0)


def test_after_warmup_a_short_last_chunk_runs_in_the_compiled_regular_call(bundle: Bundle) -> None:
    """A short last chunk's subsampling would have a shape of its own (one per length and bucket):
    traced live it would stall every stream while a GPU compiles kernels for it, and left uncompiled it
    costs a call of many small kernels. It rides in the regular call instead, zero-padded and masked
    stage by stage, so that every call of the stream runs compiled, with the frames of eager runs."""
    enc = make(bundle, compile=True)
    enc.warmup(3, 4)
    rng = np.random.default_rng(3)
    for n in (100, 96, 90, 89):  # last chunks of 11, 7, 1 and 32 (a full one) mel rows
        mel = rng.standard_normal((n, 128), dtype=np.float32)
        frames = solo(enc, mel, 3, 0)
        np.testing.assert_allclose(frames, solo(make(bundle), mel, 3, 0), atol=TOL, rtol=0)
    assert enc.calls["untraced"] == 0


def test_after_warmup_a_shape_it_did_not_trace_runs_uncompiled_with_the_same_frames(bundle: Bundle) -> None:
    """A lookahead the warm-up did not trace runs uncompiled rather than trace live."""
    enc = make(bundle, compile=True)
    enc.warmup(3, 4)
    mel = np.random.default_rng(4).standard_normal((100, 128), dtype=np.float32)
    frames = solo(enc, mel, 0, 0)
    assert enc.calls["untraced"] > 0
    np.testing.assert_allclose(frames, solo(make(bundle), mel, 0, 0), atol=TOL, rtol=0)
    cold = make(bundle, compile=True)
    solo(cold, mel, 0, 0)
    assert cold.calls["untraced"] == 0  # without a warmup every shape is traced as it comes


def test_the_steps_the_scheduler_plans_stay_within_the_batch_sizes_compiled(bundle: Bundle) -> None:
    """The encoder runs a later chunk's flush as two rows (the chunk and its padding chunk), so a step
    of max_batch planned rows with flushes in it would need a batch size the warm-up did not compile
    and run uncompiled, when the engine is busiest. The scheduler counts a flush as the encoder's
    `rows_per_flush` rows, so every step it plans runs compiled."""
    enc = make(bundle, compile=True)
    enc.warmup(3, 4)  # batch sizes 1, 2 and 4
    assert enc.rows_per_flush == 2
    rng = np.random.default_rng(6)
    first, later = first_chunk_frames(3), chunk_frames(3)

    def mel(n: int) -> np.ndarray:
        return rng.standard_normal((n, 128), dtype=np.float32)

    slots = [enc.alloc(0, 3) for _ in range(4)]
    enc.step([ChunkInput(s, mel(first)) for s in slots])
    crowded = [ChunkInput(s, mel(2 * later), flush=True) for s in slots[:2]]
    enc.step(crowded + [ChunkInput(s, mel(later)) for s in slots[2:]])
    assert enc.calls["untraced"] > 0  # four planned rows ran as six: a size never compiled

    enc = make(bundle, compile=True)
    enc.warmup(3, 4)
    sched: EncoderScheduler[ChunkInput] = EncoderScheduler(SchedulerConfig(max_batch=4, max_wait_ms=0.0))
    sched.flush_rows = enc.rows_per_flush
    slots = [enc.alloc(0, 3) for _ in range(4)]
    for k, slot in enumerate(slots):
        sched.add_stream(k, prompt_id=0, lookahead=3)
        sched.push_chunk(k, ChunkInput(slot, mel(first)), now=0.0)
    for k, slot in enumerate(slots):
        if k < 2:
            sched.push_chunk(k, ChunkInput(slot, mel(2 * later), flush=True), now=0.0, flush=True)
        sched.push_chunk(k, ChunkInput(slot, mel(later)), now=0.0)
    planned = []
    while (plan := sched.schedule(1.0)) is not None:
        frames = enc.step([r.payload for r in plan.rows])
        for chunk in sched.update_from_output(plan, frames, 1.0):
            sched.chunk_decoded(chunk.key)
        planned.append([(r.key, r.flush) for r in plan.rows])
    assert planned == [
        [(0, False), (1, False), (2, False), (3, False)],  # the first chunks
        [(0, True), (1, True)],  # two flushes: four rows
        [(0, False), (1, False), (2, False), (3, False)],  # the later chunks
    ]
    assert enc.calls["untraced"] == 0


def test_short_last_chunks_share_the_regular_stack_call_with_the_same_frames(bundle: Bundle) -> None:
    """One stack call per step for chunks of one lookahead, whatever their last chunks' lengths: each
    kind of call costs a GPU the launches of the whole stack, so a step must not make one per length."""
    rng = np.random.default_rng(5)
    mels = [rng.standard_normal((n, 128), dtype=np.float32) for n in (89, 70, 75, 57)]
    enc, reference = make(bundle), make(bundle)
    slots = [enc.alloc(0, 3) for _ in mels]
    chunks = [split(m, 3) for m in mels]  # first (25 mel frames), later (32), then each its own tail
    outs: list[list[np.ndarray]] = [[] for _ in mels]
    for k in range(3):
        rows = [(i, *chunks[i][k]) for i in range(len(mels)) if k < len(chunks[i])]
        before = enc.calls["stack"]
        got = enc.step([ChunkInput(slots[i], c, last) for i, c, last in rows])
        assert enc.calls["stack"] - before == 1
        for (i, _, _), frames in zip(rows, got, strict=True):
            outs[i].append(frames)
    assert {len(c[-1][0]) for c in chunks[:3]} == {32, 13, 18}  # tails of three lengths, one full
    for mel, out in zip(mels, outs, strict=True):
        np.testing.assert_allclose(np.concatenate(out), solo(reference, mel, 3, 0), atol=TOL, rtol=0)


def test_a_step_sends_its_host_made_inputs_as_one_array(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA every array made from host memory may cost MLX's allocator a managed allocation and a
    synchronous copy (scalars aside), so a step sends its mel and all its indices as one array and the
    calls read views of it — whatever the mix of first, later, short last chunks and flushes,
    with the frames of each stream's solo run."""
    import mlx.core as mx

    from asr_core.encoder import streaming

    rng = np.random.default_rng(6)
    mels = [rng.standard_normal((n, 128), dtype=np.float32) for n in (89, 70, 57)]
    enc, reference = make(bundle, compile=True), make(bundle)
    slots = [enc.alloc(0, 3) for _ in mels]
    chunks = [split(m, 3) for m in mels]
    made: list[str] = []
    real_array = mx.array

    def counting_array(*args: object, **kwargs: object) -> mx.array:
        out = real_array(*args, **kwargs)
        if out.size > 1:  # scalars (the mask's constants) come from a small pool of their own
            made.append(str(out.dtype))
        return out

    monkeypatch.setattr(streaming.mx, "array", counting_array)
    flusher = enc.alloc(0, 3)  # a fourth stream: its first chunk, then a flush beside the others
    extra = [ChunkInput(flusher, mels[0][:25]), ChunkInput(flusher, mels[0][25:57], flush=True), None]
    outs: list[list[np.ndarray]] = [[] for _ in mels]
    for k in range(3):
        rows = [(i, *chunks[i][k]) for i in range(len(mels)) if k < len(chunks[i])]
        made.clear()
        got = enc.step(
            [ChunkInput(slots[i], c, last) for i, c, last in rows] + [x for x in extra[k : k + 1] if x]
        )
        assert made == ["mlx.core.int32"]
        for (i, _, _), frames in zip(rows, got[: len(rows)], strict=True):
            outs[i].append(frames)
    monkeypatch.undo()
    for mel, out in zip(mels, outs, strict=True):
        np.testing.assert_allclose(np.concatenate(out), solo(reference, mel, 3, 0), atol=TOL, rtol=0)


def test_on_a_gpu_the_pools_stop_growing_below_2_to_the_31_elements() -> None:
    """Some MLX GPU kernels index with 32 bits: at full size one K|V pool array for every layer passes
    2**31 elements at 781 slots (none on the CPU); more streams take the layers in groups, an array
    each."""
    from asr_core.encoder.streaming import kv_groups_for, pool_stream_limit
    from tools.bundle.spec import FULL

    cfg = FULL.encoder_config()

    def kv_elements(slots: int) -> int:
        return cfg.num_hidden_layers * (1 + slots * cfg.left_context_frames) * 2 * cfg.hidden_size

    limit = pool_stream_limit(cfg)
    assert kv_elements(limit) < 2**31 <= kv_elements(limit + 1)
    assert limit == 780
    # More streams split the K|V pool into groups of layers, each array below 2**31 values.
    assert [kv_groups_for(cfg, n) for n in (780, 781, 1000, 1560, 1561, 2000)] == [1, 2, 2, 2, 3, 3]
    groups = kv_groups_for(cfg, 2000)
    assert kv_elements(2000) // groups < 2**31 and pool_stream_limit(cfg, groups) >= 2000
