"""EncoderScheduler: the batching policy, driven with a fake clock and fake encoder outputs (no MLX)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from asr_core.config import SchedulerConfig
from asr_core.scheduler import EncodedChunk, EncoderScheduler, RecentRate, StepCost, StepPlan, StreamPhase


def make_scheduler(**kw: object) -> EncoderScheduler[str]:
    cfg: dict[str, object] = {
        "max_batch": 4,
        "max_wait_ms": 10.0,
        "max_queued_chunks": 4,
        "max_undecoded_chunks": 2,
        "wait_policy": "fixed",
    }
    cfg.update(kw)
    return EncoderScheduler(SchedulerConfig(**cfg))  # type: ignore[arg-type]


def with_streams(*stream_keys: int, **kw: object) -> EncoderScheduler[str]:
    """A scheduler (make_scheduler's settings, `kw` on top) with these streams added, lookahead 3."""
    s = make_scheduler(**kw)
    for k in stream_keys:
        s.add_stream(k, prompt_id=0, lookahead=3)
    return s


def fake_frames(plan: StepPlan[str], j: int = 3) -> list[np.ndarray]:
    """One (T, J) array per row; T = r+1 would do, the scheduler does not look inside."""
    return [np.full((4, j), row.seq, np.float32) for row in plan.rows]


def run(
    s: EncoderScheduler[str], now: float, decode: bool = True
) -> tuple[StepPlan[str], list[EncodedChunk[str]]]:
    plan = s.schedule(now)
    assert plan is not None
    out = s.update_from_output(plan, fake_frames(plan), now)
    if decode:
        for c in out:
            s.chunk_decoded(c.key)
    return plan, out


def keys(plan: StepPlan[str]) -> list[tuple[int, int]]:
    return [(r.key, r.seq) for r in plan.rows]


def test_single_stream_steps_at_once_since_waiting_cannot_grow_the_batch() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    assert s.next_deadline() == 0.0
    plan = s.schedule(0.0)
    assert plan is not None and keys(plan) == [(1, 0)]
    assert [j.key for j in plan.joined] == [1]


def test_partial_batch_waits_max_wait_for_other_streams() -> None:
    s = with_streams(1, 2, 3, max_wait_ms=10.0)
    s.push_chunk(1, "a", now=1.000)
    s.push_chunk(2, "b", now=1.004)
    assert s.schedule(1.005) is None
    assert s.next_deadline() == pytest.approx(1.010)
    plan = s.schedule(1.010)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0)]


def test_full_batch_steps_without_waiting() -> None:
    s = with_streams(1, 2, 3, max_batch=2)
    s.push_chunk(1, "a", now=0.0)
    s.push_chunk(2, "b", now=0.001)
    assert s.next_deadline() == 0.0
    plan = s.schedule(0.001)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0)]


def test_rows_are_oldest_first_and_overflow_goes_first_next_step() -> None:
    s = with_streams(1, 2, 3, max_batch=2)
    s.push_chunk(3, "c", now=0.0)
    s.push_chunk(1, "a", now=0.1)
    s.push_chunk(2, "b", now=0.2)
    plan, _ = run(s, 0.2)
    assert keys(plan) == [(3, 0), (1, 0)]
    s.push_chunk(1, "a1", now=0.3)
    s.push_chunk(3, "c1", now=0.3)
    plan, _ = run(s, 0.3)
    assert keys(plan) == [(2, 0), (1, 1)]  # 2 waited longest; 1 joined before 3 (tie on arrival)


def test_one_chunk_per_stream_per_step_in_push_order() -> None:
    s = make_scheduler(max_undecoded_chunks=10)
    s.add_stream(1, prompt_id=0, lookahead=3)
    for i in range(3):
        s.push_chunk(1, f"c{i}", now=0.0)
    seqs = []
    for _ in range(3):
        plan, out = run(s, 0.0)
        assert len(plan.rows) == 1
        seqs.append(out[0].seq)
    assert seqs == [0, 1, 2]


def test_stream_in_flight_is_not_planned_again() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    s.push_chunk(1, "c1", now=0.0)
    plan = s.schedule(0.0)
    assert plan is not None
    assert s.schedule(0.0) is None and s.next_deadline() is None
    s.update_from_output(plan, fake_frames(plan), 0.0)
    again = s.schedule(0.0)
    assert again is not None and keys(again) == [(1, 1)]


def test_undecoded_bound_holds_a_stream_until_the_decoder_catches_up() -> None:
    s = make_scheduler(max_undecoded_chunks=1)
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    s.push_chunk(1, "c1", now=0.0)
    run(s, 0.0, decode=False)
    assert s.schedule(1.0) is None
    s.chunk_decoded(1)
    plan = s.schedule(1.0)
    assert plan is not None and keys(plan) == [(1, 1)]


def test_first_frame_follows_the_media_timeline_per_lookahead() -> None:
    s = make_scheduler(max_undecoded_chunks=10)
    s.add_stream(1, prompt_id=0, lookahead=0)
    s.add_stream(2, prompt_id=0, lookahead=13)
    for _ in range(3):
        s.push_chunk(1, "x", now=0.0)
        s.push_chunk(2, "y", now=0.0)
    firsts: dict[int, list[int]] = {1: [], 2: []}
    for _ in range(3):
        _, out = run(s, 0.0)
        for c in out:
            firsts[c.key].append(c.first_frame)
    assert firsts == {1: [0, 1, 2], 2: [0, 14, 28]}


def test_update_returns_frames_and_payload_per_row() -> None:
    s = make_scheduler()
    s.add_stream(7, prompt_id=19, lookahead=3)
    s.push_chunk(7, "payload", now=0.0)
    plan = s.schedule(0.5)
    assert plan is not None and plan.joined[0].prompt_id == 19
    frames = [np.ones((4, 3), np.float32)]
    (chunk,) = s.update_from_output(plan, frames, 0.5)
    assert chunk.payload == "payload" and chunk.frames is frames[0]
    assert chunk.queue_wait_s == pytest.approx(0.5)


def test_update_rejects_an_output_that_does_not_match_the_plan() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    plan = s.schedule(0.0)
    assert plan is not None
    with pytest.raises(ValueError, match="0 outputs for 1 rows"):
        s.update_from_output(plan, [], 0.0)


def test_overflow_drops_the_oldest_middle_chunk_never_the_first() -> None:
    s = make_scheduler(max_queued_chunks=3)
    s.add_stream(1, prompt_id=0, lookahead=3)
    dropped = []
    for i in range(5):
        dropped += s.push_chunk(1, f"c{i}", now=float(i))
    # queue bound 3: c1 then c2 dropped; c0 (first chunk) survives
    assert [(d.seq, d.dropped_total) for d in dropped] == [(1, 1), (2, 2)]
    assert s.queued(1) == 3 and s.dropped(1) == 2
    seqs = []
    for _ in range(3):
        _, out = run(s, 10.0)
        seqs.append((out[0].seq, out[0].payload, out[0].first_frame))
    assert seqs == [(0, "c0", 0), (3, "c3", 12), (4, "c4", 16)]


def test_overflow_never_drops_the_last_chunk() -> None:
    s = make_scheduler(max_queued_chunks=2)
    s.add_stream(1, prompt_id=0, lookahead=3)
    run_plan = s.push_chunk(1, "c0", now=0.0)
    assert run_plan == []
    run(s, 0.0)  # first chunk encoded: now every queued chunk is droppable but the last
    s.push_chunk(1, "c1", now=0.0)
    s.push_chunk(1, "c2", now=0.0)
    dropped = s.push_chunk(1, "last", now=0.0, is_last=True)
    assert [d.seq for d in dropped] == [1]
    _, out = run(s, 0.0)
    _, out2 = run(s, 0.0)
    assert [out[0].payload, out2[0].payload] == ["c2", "last"] and out2[0].is_last


def test_a_slow_decoder_turns_into_counted_drops_not_unbounded_memory() -> None:
    s = make_scheduler(max_queued_chunks=4, max_undecoded_chunks=1)
    s.add_stream(1, prompt_id=0, lookahead=3)
    total_dropped = 0
    for i in range(20):
        total_dropped += len(s.push_chunk(1, f"c{i}", now=float(i)))
        plan = s.schedule(float(i))
        if plan is not None:
            s.update_from_output(plan, fake_frames(plan), float(i))  # never decoded
        assert s.queued(1) <= 4
    assert total_dropped == 20 - 1 - 4  # one encoded, four still queued


def test_finished_stream_leaves_after_its_last_chunk_and_releases_its_slot() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    s.push_chunk(1, "c1", now=0.0, is_last=True)
    assert s.phase(1) is StreamPhase.ENDING
    with pytest.raises(ValueError, match="takes no more chunks"):
        s.push_chunk(1, "late", now=0.0)
    _, out = run(s, 0.0)
    assert not out[0].is_last
    _, out = run(s, 0.0)
    assert out[0].is_last
    plan = s.schedule(0.0)
    assert plan is not None and plan.rows == ()
    assert [(x.key, x.reason, x.had_slot) for x in plan.left] == [(1, "finished", True)]
    assert 1 not in s and s.schedule(0.0) is None


def test_end_stream_on_a_chunk_boundary_leaves_when_drained() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "c0", now=0.0)
    s.end_stream(1, now=0.0)
    plan = s.schedule(0.0)
    assert plan is not None and keys(plan) == [(1, 0)] and plan.left == ()
    s.update_from_output(plan, fake_frames(plan), 0.1)
    assert s.next_deadline() == 0.1
    plan = s.schedule(0.1)
    assert plan is not None and [x.reason for x in plan.left] == ["finished"]


def test_close_discards_queue_and_in_flight_output_then_leaves_once() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.add_stream(2, prompt_id=0, lookahead=3)
    s.push_chunk(1, "a0", now=0.0)
    s.push_chunk(1, "a1", now=0.0)
    s.push_chunk(2, "b0", now=0.0)
    plan = s.schedule(0.0)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0)]
    s.close_stream(1, now=0.0)
    out = s.update_from_output(plan, fake_frames(plan), 0.0)
    assert [c.key for c in out] == [2]
    nxt = s.schedule(0.0)
    assert nxt is not None and [(x.key, x.reason) for x in nxt.left] == [(1, "closed")]
    s.close_stream(1, now=0.0)  # already gone: no second leave
    assert s.schedule(0.0) is None


def test_stream_closed_before_its_first_chunk_leaves_without_a_slot() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.close_stream(1, now=2.0)
    assert s.next_deadline() == 2.0
    plan = s.schedule(2.0)
    assert plan is not None and plan.joined == () and plan.rows == ()
    assert [(x.key, x.had_slot) for x in plan.left] == [(1, False)]


def test_streams_join_and_leave_mid_way_without_disturbing_others() -> None:
    s = make_scheduler(max_batch=8, max_undecoded_chunks=8)
    s.add_stream(1, prompt_id=0, lookahead=3)
    s.push_chunk(1, "a0", now=0.0)
    plan, _ = run(s, 0.0)
    assert [j.key for j in plan.joined] == [1]
    s.add_stream(2, prompt_id=5, lookahead=0)
    s.push_chunk(1, "a1", now=1.0)
    s.push_chunk(2, "b0", now=1.0)
    plan, _ = run(s, 1.0)
    assert keys(plan) == [(1, 1), (2, 0)] and [j.key for j in plan.joined] == [2]
    s.push_chunk(1, "a2", now=2.0, is_last=True)
    s.push_chunk(2, "b1", now=2.0)
    plan, _ = run(s, 2.0)
    assert keys(plan) == [(1, 2), (2, 1)] and plan.joined == ()
    s.push_chunk(2, "b2", now=3.0)
    plan, _ = run(s, 3.0)
    assert [x.key for x in plan.left] == [1] and keys(plan) == [(2, 2)]


def test_fairness_under_overload_every_stream_advances() -> None:
    """More ready streams than max_batch: each step takes the oldest, so nobody starves."""
    s = make_scheduler(max_batch=3, max_queued_chunks=100, max_undecoded_chunks=100)
    n = 7
    for k in range(n):
        s.add_stream(k, prompt_id=0, lookahead=3)
    now = 0.0
    served = dict.fromkeys(range(n), 0)
    for _ in range(70):
        for k in range(n):
            s.push_chunk(k, "c", now=now)
        for _ in range(2):  # capacity 6 chunks per tick for 7 offered: overloaded
            _, out = run(s, now)
            for c in out:
                served[c.key] += 1
        now += 0.32
    assert max(served.values()) - min(served.values()) <= 1


def test_add_stream_twice_is_an_error() -> None:
    s = make_scheduler()
    s.add_stream(1, prompt_id=0, lookahead=3)
    with pytest.raises(ValueError, match="already"):
        s.add_stream(1, prompt_id=0, lookahead=3)


def test_config_rejects_a_queue_bound_that_could_not_hold() -> None:
    with pytest.raises(ValueError, match="max_queued_chunks"):
        SchedulerConfig(max_queued_chunks=1)


def test_wake_is_needed_only_when_the_deadline_moves_earlier() -> None:
    """The engine wakes its MLX thread on `needs_wake` only: not on every push."""
    s = make_scheduler(max_batch=3, max_wait_ms=10.0, max_undecoded_chunks=1)
    for k in (1, 2, 3, 4):
        s.add_stream(k, prompt_id=0, lookahead=3)
    s.schedule(0.0)
    assert s.next_deadline() is None
    s.push_chunk(1, "a", now=1.0)
    assert s.needs_wake  # the first ready chunk arms the max_wait timer
    s.schedule(1.0)
    assert s.next_deadline() == pytest.approx(1.01)
    s.push_chunk(2, "b", now=1.002)
    assert not s.needs_wake  # a newer chunk does not move the deadline
    s.push_chunk(3, "c", now=1.003)
    assert s.needs_wake  # max_batch ready: due now
    plan, _ = run(s, 1.003, decode=False)
    assert keys(plan) == [(1, 0), (2, 0), (3, 0)]
    assert s.next_deadline() is None
    s.push_chunk(1, "a1", now=1.1)  # held back: chunk 0 is not decoded yet
    assert not s.needs_wake and s.next_deadline() is None
    s.chunk_decoded(1)
    assert s.needs_wake  # the held chunk became ready


# --- the adaptive wait ---------------------------------------------------------------------------------


def test_step_cost_fit_recovers_fixed_and_per_row_cost() -> None:
    gpu, cpu = StepCost(), StepCost()
    for rows in [1, 8, 64, 128, 256, 3, 40, 512] * 4:
        gpu.add(rows, 0.015 + 0.0001 * rows)
        cpu.add(rows, 0.0002 + 0.001 * rows)
    a, b = gpu.fit()
    assert a == pytest.approx(0.015, rel=1e-6) and b == pytest.approx(0.0001, rel=1e-6)
    a, b = cpu.fit()
    assert a == pytest.approx(0.0002, abs=1e-9) and b == pytest.approx(0.001, rel=1e-6)


def test_step_cost_counts_the_whole_step_as_fixed_when_the_batch_never_varies() -> None:
    c = StepCost()
    assert c.fit() == (0.0, 0.0)
    for t in (0.010, 0.012, 0.011):
        c.add(4, t)
    a, b = c.fit()
    assert b == 0.0 and 0.010 < a < 0.012


def test_recent_rate_counts_the_last_one_to_two_windows_and_forgets_a_quiet_spell() -> None:
    r = RecentRate(window_s=1.0)
    assert r.per_s(0.0) == 0.0
    for i in range(30):
        r.add(i / 20)  # 20 a second for 1.5 s
    assert r.per_s(1.5) == pytest.approx(20.0, rel=0.05)
    assert r.per_s(4.0) == 0.0  # nothing for over two windows: no rate from old events


def test_recent_rate_of_seconds_is_the_share_of_time_busy() -> None:
    r = RecentRate(window_s=1.0)
    for i in range(10):
        r.add(0.1 + 0.2 * i, 0.05)  # a 50 ms step every 200 ms
    assert r.per_s(2.1) == pytest.approx(0.25)
    r.add(2.2, 0.8)  # then one 800 ms step: the share rises with it
    assert r.per_s(2.3) == pytest.approx((0.25 + 0.8) / 1.2)


def test_load_is_the_rows_coming_in_times_what_each_row_adds_to_a_step() -> None:
    # 100 streams pushing a chunk every 320 ms: 312.5 rows a second; each row adds 2 ms to a step
    # (a GPU-like 20 ms fixed cost is shared): the encoder is 62.5 % loaded.
    s = with_streams(*range(100), max_batch=512, max_queued_chunks=16, max_undecoded_chunks=16)
    assert s.load(0.0) == 0.0  # no step measured yet: nothing known
    for rows in (10, 50, 100, 30, 80) * 4:
        s.observe_step(rows, 0.020 + 0.002 * rows)
    now = 0.0
    while now < 2.0:
        for k in range(100):
            s.push_chunk(k, "c", now + k * 0.0032)
        run(s, now + 0.32)
        now += 0.32
    assert s.load(now) == pytest.approx(0.625, rel=0.05)


def test_adaptive_wait_is_three_fixed_costs_capped_by_max_wait() -> None:
    s = make_scheduler(max_wait_ms=40.0, wait_policy="adaptive")
    assert s.max_wait_s == 0.0  # nothing measured yet: no reason to wait
    for rows in (1, 16, 64):
        s.observe_step(rows, 0.005 + 0.0001 * rows)
    assert s.max_wait_s == pytest.approx(3 * 0.005)
    for rows in (1, 16, 64) * 50:
        s.observe_step(rows, 0.020 + 0.0001 * rows)
    assert s.max_wait_s == pytest.approx(0.040)  # 3 x 20 ms, capped at 40 ms
    fixed = make_scheduler(max_wait_ms=40.0, wait_policy="fixed")
    fixed.observe_step(8, 0.5)
    assert fixed.max_wait_s == pytest.approx(0.040)


def _simulate(
    cost: Callable[[int], float], streams: int, *, policy: str, wait_ms: float = 100.0
) -> dict[str, float]:
    """Streams push a chunk every 320 ms at evenly spread phases; one runner steps whenever the policy
    says so, each step taking cost(rows) of fake time. Returns what the policy did."""
    config = SchedulerConfig(max_batch=512, max_wait_ms=wait_ms, max_queued_chunks=64, wait_policy=policy)  # type: ignore[arg-type]
    s: EncoderScheduler[str] = EncoderScheduler(config)
    period, seconds = 0.32, 6.0
    arrivals = sorted(
        (k * period / streams + j * period, k) for k in range(streams) for j in range(int(seconds / period))
    )
    for k in range(streams):
        s.add_stream(k, prompt_id=0, lookahead=3)
    now, i, busy = 0.0, 0, 0.0
    batches: list[int] = []
    waits: list[float] = []
    while i < len(arrivals) or s.next_deadline() is not None:
        while i < len(arrivals) and arrivals[i][0] <= now:
            s.push_chunk(arrivals[i][1], "mel", now=arrivals[i][0])
            i += 1
        plan = s.schedule(now)
        if plan is None or not plan.rows:
            later = [
                t for t in (arrivals[i][0] if i < len(arrivals) else None, s.next_deadline()) if t is not None
            ]
            now = max(now + 1e-9, min(later))  # (a deadline a rounding error short of due)
            continue
        dt = cost(len(plan.rows))
        now += dt
        busy += dt
        for c in s.update_from_output(plan, fake_frames(plan), now):
            s.chunk_decoded(c.key)
        s.observe_step(len(plan.rows), dt)
        batches.append(len(plan.rows))
        waits += [r.queue_wait_s for r in plan.rows]
    return {
        "mean_batch": sum(batches) / len(batches),
        "busy": busy / now,
        "max_wait": max(waits),
        "policy_wait": s.max_wait_s,
    }


def test_on_an_accelerator_the_adaptive_wait_fills_batches_and_frees_the_device() -> None:
    def accelerator(rows: int) -> float:  # a step costs about the same for 1 or 128 rows
        return 0.015 + 0.0001 * rows

    eager = _simulate(accelerator, 400, policy="fixed", wait_ms=0.0)  # step as soon as a row is ready
    capped = _simulate(accelerator, 400, policy="fixed", wait_ms=100.0)
    adaptive = _simulate(accelerator, 400, policy="adaptive", wait_ms=100.0)
    assert adaptive["policy_wait"] == pytest.approx(0.045, rel=0.01)
    assert adaptive["mean_batch"] > 2 * eager["mean_batch"]
    assert adaptive["busy"] < 0.6 * eager["busy"]
    # A chunk waits at most the policy's wait, plus the step in progress when it became ready.
    assert adaptive["max_wait"] <= 0.045 + accelerator(512)
    assert capped["max_wait"] > 2 * adaptive["max_wait"]  # the fixed cap waits whatever a step costs


def test_on_a_cpu_the_adaptive_wait_stays_short() -> None:
    def cpu(rows: int) -> float:  # every row costs: nothing to gain by waiting
        return 0.0003 + 0.002 * rows

    adaptive = _simulate(cpu, 100, policy="adaptive", wait_ms=100.0)
    assert adaptive["policy_wait"] < 0.002  # 3 x 0.3 ms once the batches vary enough to fit
    assert adaptive["max_wait"] < 0.02


def test_a_flush_steps_at_once_with_whatever_else_is_ready() -> None:
    """The caller stopped speaking and waits for the final: waiting for a fuller batch would add the
    wait to the time to final."""
    s = with_streams(1, 2, 3, max_wait_ms=50.0)
    s.push_chunk(1, "a", now=1.000)
    assert s.next_deadline() == pytest.approx(1.050)
    s.push_chunk(2, "flush", now=1.010, flush=True)
    assert s.needs_wake
    assert s.next_deadline() == pytest.approx(1.000)
    plan = s.schedule(1.010)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0)]
    assert [r.flush for r in plan.rows] == [False, True]


def test_a_flush_counts_the_rows_the_encoder_runs_it_as_toward_max_batch() -> None:
    """A flush of a later chunk runs as two rows: a step of max_batch planned rows with flushes in
    it would need a batch size the encoder was never compiled for."""
    s = with_streams(1, 2, 3, 4, max_batch=4)
    s.flush_rows = 2
    s.push_chunk(1, "a", now=1.000)
    s.push_chunk(2, "flush", now=1.001, flush=True)
    s.push_chunk(3, "c", now=1.002)
    s.push_chunk(4, "d", now=1.003)
    plan = s.schedule(1.010)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0), (3, 0)]  # 1 + 2 + 1 rows
    s.update_from_output(plan, fake_frames(plan), 1.011)
    plan = s.schedule(1.100)
    assert plan is not None and keys(plan) == [(4, 0)]  # the rest goes first next time
    lone = with_streams(1, max_batch=1)
    lone.flush_rows = 2
    lone.push_chunk(1, "flush", now=0.0, flush=True)
    plan = lone.schedule(0.0)
    assert plan is not None and keys(plan) == [(1, 0)]  # a flush alone is planned whatever it costs


def test_a_flush_behind_a_chunk_in_flight_steps_as_soon_as_the_stream_is_ready_again() -> None:
    s = with_streams(1, 2, 3, max_wait_ms=50.0)
    s.push_chunk(1, "a", now=1.000)
    s.push_chunk(2, "b", now=1.000)
    plan = s.schedule(1.050)
    assert plan is not None and keys(plan) == [(1, 0), (2, 0)]
    s.push_chunk(1, "flush", now=1.060, flush=True)
    s.push_chunk(3, "c", now=1.060)
    assert s.schedule(1.061) is None  # stream 1's chunk is still in flight; stream 3 waits its turn
    out = s.update_from_output(plan, fake_frames(plan), 1.070)
    assert s.next_deadline() == pytest.approx(1.060)
    plan = s.schedule(1.070)
    assert plan is not None and keys(plan) == [(1, 1), (3, 0)]
    assert [r.flush for r in plan.rows] == [True, False]
    assert len(out) == 2


def test_without_a_flush_the_batching_wait_is_unchanged() -> None:
    s = with_streams(1, 2, 3, max_wait_ms=50.0)
    s.push_chunk(1, "flush", now=1.000, flush=True)
    run(s, 1.000)
    s.push_chunk(2, "b", now=1.010)
    assert s.next_deadline() == pytest.approx(1.060)
    assert s.schedule(1.020) is None
