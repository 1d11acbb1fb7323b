"""The 8 → 16 kHz upsampler and the block pipeline: streamed equals whole, exact lengths, steady delay."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from gateway.audio import g711
from gateway.audio.pipeline import AudioBlock, AudioPipeline, PendingBlocks
from gateway.audio.resample import UpsampleBatch, Upsampler, filter_reach


def noise(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 0.2).astype(np.float32)


@pytest.mark.parametrize("sizes", [[640] * 20, [160] * 80, [1, 7, 333, 2000, 13, 4096, 5], [12800]])
def test_streamed_output_equals_one_shot_soxr_whatever_the_block_sizes(sizes: list[int]) -> None:
    x = noise(sum(sizes))
    up = Upsampler("HQ")
    parts, i = [], 0
    for n in sizes:
        parts.append(up.push(x[i : i + n]))
        i += n
    parts.append(up.finish())
    y = np.concatenate(parts)
    whole = soxr.resample(x, 8000, 16000, quality="HQ")
    assert len(y) == 2 * len(x) == len(whole)
    assert np.abs(y - whole).max() < 1e-6


def test_delay_is_constant_lookahead_samples() -> None:
    up = Upsampler("HQ")
    pushed = out = 0
    for n in [640] * 30:
        out += len(up.push(noise(n, pushed)))
        pushed += n
        assert 2 * pushed - out == 2 * up.lookahead  # no lumps: every push emits all it can
    assert up.lookahead == filter_reach("HQ") <= 100  # ~12 ms at 8 kHz


def test_a_tone_comes_out_at_the_same_frequency_and_level() -> None:
    t = np.arange(8000) / 8000
    x = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    up = Upsampler()
    y = np.concatenate([up.push(x[i : i + 640]) for i in range(0, 8000, 640)] + [up.finish()])
    mid = y[2000:14000]
    spectrum = np.abs(np.fft.rfft(mid * np.hanning(len(mid))))
    peak_hz = np.argmax(spectrum) * 16000 / len(mid)
    assert abs(peak_hz - 1000) < 2
    assert abs(np.sqrt(np.mean(mid**2)) - 0.5 / np.sqrt(2)) < 0.005


def test_push_after_finish_is_an_error() -> None:
    up = Upsampler()
    up.finish()
    with pytest.raises(RuntimeError):
        up.push(noise(10))


class _Job:
    def __init__(self, upsampler: Upsampler) -> None:
        self.upsampler = upsampler
        self.out: list[np.ndarray] = []

    def resampled(self, out: np.ndarray) -> None:
        self.out.append(out)


def test_streams_resampled_in_one_batch_get_exactly_what_each_gets_alone() -> None:
    """One soxr pass of C channels per segment length gives every stream, sample for sample, what its
    own pass gives: streams pushing equal and unequal amounts, one added twice, one not due."""
    sizes = [640, 640, 640, 700, 160, 5000, 3]
    rng = np.random.default_rng(7)
    signals = [(rng.standard_normal(6 * n) * 0.3).astype(np.float32) for n in sizes]
    alone = [Upsampler() for _ in sizes]
    jobs = [_Job(Upsampler()) for _ in sizes]
    batch = UpsampleBatch()
    widest = 0
    for step in range(6):
        expected = []
        for i, n in enumerate(sizes):
            x = signals[i][step * n : (step + 1) * n]
            expected.append(alone[i].push(x))
            jobs[i].upsampler.stage(x)
            if jobs[i].upsampler.due:
                batch.add(jobs[i])
        batch.add(jobs[0])  # twice: runs once
        widest = max(widest, len(batch))
        batch.run()
        for i, job in enumerate(jobs):
            got = job.out.pop() if job.out else np.zeros(0, np.float32)
            assert not job.out
            assert np.array_equal(got, expected[i]), (step, sizes[i])
    assert widest >= 4 and len(batch) == 0


def collect(pipeline: AudioPipeline, script: list[tuple[str, object]]) -> list[AudioBlock]:
    out: list[AudioBlock] = []
    for op, arg in script:
        if op == "codes":
            pipeline.append_codes(arg, out)  # type: ignore[arg-type]
        elif op == "silence":
            pipeline.append_silence(arg, out)  # type: ignore[arg-type]
        elif op == "codec":
            pipeline.set_codec(arg, out)  # type: ignore[arg-type]
    pipeline.finish(out)
    return out


def test_pipeline_blocks_are_fixed_size_at_exact_start_times_and_total_twice_the_input() -> None:
    pcm = (noise(8000 + 123, 1) * 20000).astype(np.int16)
    codes = g711.encode(pcm, "PCMU")
    script: list[tuple[str, object]] = [("codes", codes[i : i + 160]) for i in range(0, len(codes), 160)]
    blocks = collect(AudioPipeline("PCMU", block_ms=80), script)
    assert [b.start_ms for b in blocks] == [80 * k for k in range(len(blocks))]
    assert all(len(b.pcm) == 1280 for b in blocks[:-1])
    assert 0 < len(blocks[-1].pcm) <= 1280
    assert sum(len(b.pcm) for b in blocks) == 2 * len(codes)
    assert all(b.pcm.dtype == np.float32 for b in blocks)


def test_pipeline_output_equals_decoding_and_resampling_the_whole_call() -> None:
    pcm = (noise(4000, 2) * 20000).astype(np.int16)
    codes = g711.encode(pcm, "PCMA")
    script: list[tuple[str, object]] = [
        ("codes", codes[:1000]),
        ("silence", 456),
        ("codes", codes[1000:]),
    ]
    y = np.concatenate([b.pcm for b in collect(AudioPipeline("PCMA", block_ms=40), script)])
    x = np.concatenate(
        [g711.decode(codes[:1000], "PCMA"), np.zeros(456, np.int16), g711.decode(codes[1000:], "PCMA")]
    )
    expected = np.clip(soxr.resample(x.astype(np.float32) / 32768, 8000, 16000, quality="HQ"), -1, 1)
    assert len(y) == len(expected) == 2 * (4000 + 456)
    assert np.abs(y - expected).max() < 1e-6


def test_silence_is_exact_zero_even_for_alaw() -> None:
    blocks = collect(AudioPipeline("PCMA", block_ms=20), [("silence", 1600)])
    y = np.concatenate([b.pcm for b in blocks])
    assert len(y) == 3200 and not y.any()


def test_codec_change_decodes_earlier_codes_with_the_old_law() -> None:
    tone = (np.sin(np.arange(800) / 5) * 10000).astype(np.int16)
    script: list[tuple[str, object]] = [
        ("codes", g711.encode(tone, "PCMU")),
        ("codec", "PCMA"),
        ("codes", g711.encode(tone, "PCMA")),
    ]
    y = np.concatenate([b.pcm for b in collect(AudioPipeline("PCMU"), script)])
    x = np.concatenate(
        [g711.decode(g711.encode(tone, "PCMU"), "PCMU"), g711.decode(g711.encode(tone, "PCMA"), "PCMA")]
    )
    expected = soxr.resample(x.astype(np.float32) / 32768, 8000, 16000, quality="HQ")
    assert np.abs(y - expected).max() < 1e-6


def test_a_block_is_emitted_as_soon_as_its_end_plus_the_lookahead_has_arrived() -> None:
    p = AudioPipeline("PCMU", block_ms=80)
    out: list[AudioBlock] = []
    need = 640 + p.lookahead
    p.append_silence(need - 1, out)
    assert out == []
    p.append_silence(1, out)
    assert [b.start_ms for b in out] == [0]


class _SoloAndBatched:
    """The same codes through a pipeline that resamples at once and one that waits for a batch."""

    def __init__(self, codec: str) -> None:
        self.alone: list[AudioBlock] = []
        self.solo = AudioPipeline(codec, block_ms=80)
        self.batch = UpsampleBatch()
        self.batched = AudioPipeline(codec, block_ms=80, batch=self.batch)
        self.out: list[AudioBlock | PendingBlocks | str] = []  # str: another event of the call's owner

    def append(self, codes: bytes) -> None:
        self.solo.append_codes(codes, self.alone)
        self.batched.append_codes(codes, self.out)

    def finish(self) -> list[tuple[AudioBlock, AudioBlock]]:
        """Both finished: each batched block beside the solo one, at the same start."""
        self.solo.finish(self.alone)
        self.batched.finish(self.out)
        blocks: list[AudioBlock] = []
        for item in self.out:
            if isinstance(item, PendingBlocks):
                blocks.extend(item.blocks)
            elif isinstance(item, AudioBlock):
                blocks.append(item)
        assert [b.start_ms for b in blocks] == [b.start_ms for b in self.alone]
        return list(zip(blocks, self.alone, strict=True))


def test_a_batched_pipeline_leaves_a_place_for_its_blocks_and_fills_it_when_the_batch_runs() -> None:
    """With a batch, a block's place in the output is a `PendingBlocks`, filled when the batch runs with
    exactly the blocks the pipeline gives alone; `finish` runs a pass the batch has not run, alone."""
    codes = g711.encode((noise(6000, 4) * 20000).astype(np.int16), "PCMU")
    two = _SoloAndBatched("PCMU")
    for i in range(0, len(codes), 160):
        two.append(codes[i : i + 160])
        if two.batched.pending:
            assert isinstance(two.out[-1], PendingBlocks) and not two.out[-1].done
            assert len(two.batch) == 1
            two.batch.run()
            assert two.out[-1].done and not two.batched.pending
    assert all(np.array_equal(a.pcm, b.pcm) for a, b in two.finish())


def test_audio_that_comes_before_the_batch_has_run_joins_the_waiting_pass() -> None:
    """A loop turn can bring a call several blocks' audio before the process's batch runs: the later
    audio joins the pass that waits (one place in the output, one pass when the batch runs), and the
    blocks are those the pipeline gives alone, to float rounding (one pass over what was two)."""
    codes = g711.encode((noise(6000, 5) * 20000).astype(np.int16), "PCMU")
    two = _SoloAndBatched("PCMU")
    for i in range(0, len(codes), 160):
        two.append(codes[i : i + 160])
        if i % 1600 == 1440:  # the batch runs every 200 ms of audio: 2-3 blocks' passes between
            two.batch.run()
            assert not two.batched.pending
    places = [item for item in two.out if isinstance(item, PendingBlocks)]
    assert len(two.out) == len(places) == two.batch.passes + 1  # the last waits for `finish`
    assert max(len(p.blocks) for p in places) >= 2
    assert max(np.abs(a.pcm - b.pcm).max() for a, b in two.finish()) < 1e-6


def test_an_event_after_the_waiting_place_sends_the_next_audio_to_a_new_place_after_it() -> None:
    """What the call's owner put after the waiting place (a DTMF digit, a report) must stay between the
    blocks before it and those after: the waiting pass runs first, alone, and the new audio waits in a
    new place after the event, exactly as the pipeline gives it alone."""
    codes = g711.encode((noise(2400, 6) * 20000).astype(np.int16), "PCMA")
    two = _SoloAndBatched("PCMA")
    two.append(codes[:1200])
    first = two.out[-1]
    assert isinstance(first, PendingBlocks) and not first.done
    two.out.append("event")
    two.append(codes[1200:])
    assert first.done and first.blocks  # ran alone
    assert two.out[1] == "event" and isinstance(two.out[2], PendingBlocks) and not two.out[2].done
    two.batch.run()
    assert all(np.array_equal(a.pcm, b.pcm) for a, b in two.finish())
