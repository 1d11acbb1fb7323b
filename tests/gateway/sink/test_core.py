"""The sink core: commit order and seq, the drop policy, spilling, replay, outcomes (fake clock)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events import CallEvent
from gateway.sink.core import BatchOutcome, Probe, SendBatch, SinkConfig, SinkCore
from gateway.sink.spool import Spool

from .factories import FakeRedis, Hooks, drain, ev, make_core


def send(core: SinkCore, now: float) -> SendBatch:
    action = core.poll(now)
    assert isinstance(action, SendBatch), action
    return action


def seqs(records: list[dict[str, str]] | tuple, call: str = "c1") -> list[int]:
    return [
        int(getattr(r, "fields", r)["seq"]) for r in records if getattr(r, "fields", r)["call_id"] == call
    ]


def test_seq_is_gapless_per_call_and_leg_from_1_in_commit_order(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path)
    redis = FakeRedis()
    for e in [ev("call_start"), ev("partial", seg=0), ev("call_start", "c2"), ev("final", seg=0)]:
        core.publish(e)
    core.publish(ev("final", leg="callee", seg=0))
    drain(core, redis, 0.0)
    got = [(f["call_id"], f["leg"], f["seq"], f["event_id"]) for f in redis.stream]
    assert got == [
        ("c1", "caller", "1", "c1:caller:1"),
        ("c1", "caller", "2", "c1:caller:2"),
        ("c2", "caller", "1", "c2:caller:1"),
        ("c1", "caller", "3", "c1:caller:3"),
        ("c1", "callee", "1", "c1:callee:1"),
    ]


def test_a_batch_holds_at_most_batch_max_records_in_order(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, batch_max=3)
    for i in range(7):
        core.publish(ev("final", seg=i))
    sizes = []
    while isinstance(action := core.poll(0.0), SendBatch):
        sizes.append(len(action.records))
        core.batch_done(action, BatchOutcome((True,) * len(action.records)), 0.0)
    assert sizes == [3, 3, 1]


def test_over_the_memory_limit_partials_are_dropped_first_and_never_get_a_seq(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path, max_buffered=4)
    for e in [
        ev("call_start"),
        ev("partial", seg=0),
        ev("partial", seg=0),
        ev("final", seg=0),
        ev("partial", seg=1),
    ]:
        core.publish(e)
    assert hooks.drop[("partial", "buffer_full")] == 3
    redis = FakeRedis()
    drain(core, redis, 0.0)
    assert [(f["type"], f["seq"]) for f in redis.stream] == [("call_start", "1"), ("final", "2")]


def test_memory_full_of_durable_events_spills_them_to_the_spool_in_order(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path, max_buffered=3)
    core.probe_done(True, 0.0)  # Redis is up but not being drained in this test
    for i in range(5):
        core.publish(ev("final", seg=i))
    assert core.spool.pending == 4 and core.in_memory == 1  # the 4th event spilled the first four
    assert sum(hooks.spool.values()) == 4 and not hooks.drop
    redis = FakeRedis()
    drain(core, redis, 0.0)
    assert seqs(redis.stream) == [1, 2, 3, 4, 5]  # spool first, then memory: order kept


def test_redis_down_for_spill_after_s_moves_durables_to_disk_and_drops_pending_partials(
    tmp_path: Path,
) -> None:
    core, hooks = make_core(tmp_path, spill_after_s=2.0)
    core.publish(ev("call_start"))
    core.batch_failed(send(core, 0.0), 0.0)  # Redis down at t=0
    assert core.next_deadline() == 1.0  # the retry (backoff 1 s) comes before the spill (2 s)
    core.batch_failed(send(core, 1.0), 1.0)  # the call_start is committed: it stays in memory
    core.publish(ev("partial", seg=0))
    core.publish(ev("final", seg=0))
    assert core.spool.pending == 0 and not core.degraded  # a short outage stays in memory
    assert core.next_deadline() == 2.0
    retry = send(core, 2.0)  # the spill happens first, so this retry reads the spool
    assert retry.from_spool
    core.batch_failed(retry, 2.0)
    assert core.spool.pending == 2 and core.in_memory == 0
    assert hooks.drop[("partial", "redis_down")] == 1
    assert [(r.type, r.seq) for r in core.spool.iter_pending()] == [("call_start", 1), ("final", 2)]
    assert core.degraded


def test_while_redis_stays_down_after_a_spill_partials_are_dropped_and_durables_spooled(
    tmp_path: Path,
) -> None:
    core, hooks = make_core(tmp_path, spill_after_s=0.0)
    core.publish(ev("call_start"))
    core.batch_failed(send(core, 0.0), 0.0)
    core.poll(0.0)  # spilled
    assert core.spool.pending == 1
    core.publish(ev("partial", seg=0))  # it would be stale by the time it could be sent
    core.publish(ev("dtmf", text="5"))
    assert hooks.drop[("partial", "redis_down")] == 1 and core.spool.pending == 2
    redis = FakeRedis()
    core.probe_done(True, 3.0)
    drain(core, redis, 3.0)
    assert [(f["type"], f["seq"]) for f in redis.stream] == [("call_start", "1"), ("dtmf", "2")]
    assert not core.degraded and core.idle


def test_a_failed_batch_is_sent_again_first_with_the_same_seqs(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path)
    for i in range(3):
        core.publish(ev("final", seg=i))
    first = send(core, 0.0)
    core.publish(ev("final", seg=3))
    core.batch_failed(first, 0.0)
    assert core.poll(0.5) is None  # backing off
    again = send(core, 1.0)
    assert again.records == first.records  # the same records, same seqs; the new one waits uncommitted
    core.batch_done(again, BatchOutcome((True,) * 3), 1.0)
    assert seqs(send(core, 1.0).records) == [4]


def test_a_lost_reply_is_harmless_because_redis_refuses_what_it_already_has(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path)
    redis = FakeRedis()
    for i in range(3):
        core.publish(ev("final", seg=i))
    batch = send(core, 0.0)
    redis.apply(batch.records)  # Redis stored it, but the reply never came back
    core.batch_failed(batch, 0.0)
    drain(core, redis, 1.0)
    assert seqs(redis.stream) == [1, 2, 3]
    assert hooks.pub["final"] == 3 and hooks.dup["final"] == 3


def test_a_transient_error_mid_batch_keeps_what_was_stored_and_resends_the_rest(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path)
    for i in range(4):
        core.publish(ev("final", seg=i))
    batch = send(core, 0.0)
    core.batch_done(
        batch, BatchOutcome((True, True), "OOM command not allowed when used memory > 'maxmemory'"), 0.0
    )
    assert not core.redis_up and hooks.pub["final"] == 2
    again = send(core, 1.0)
    assert seqs(again.records) == [3, 4]


def test_a_permanent_error_drops_that_record_only_and_counts_it(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path)
    for i in range(3):
        core.publish(ev("final", seg=i))
    batch = send(core, 0.0)
    core.batch_done(
        batch, BatchOutcome((True,), "WRONGTYPE Operation against a key holding the wrong kind"), 0.0
    )
    assert hooks.drop[("final", "rejected")] == 1
    assert core.redis_up
    assert seqs(send(core, 0.0).records) == [3]


def test_spool_batches_are_acknowledged_up_to_the_record_where_they_stopped(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, max_buffered=1)
    for i in range(4):
        core.publish(ev("final", seg=i))  # each beyond the first spills
    batch = send(core, 0.0)
    assert batch.from_spool
    core.batch_done(batch, BatchOutcome((True,), "LOADING Redis is loading the dataset in memory"), 0.0)
    again = send(core, 1.0)
    assert again.from_spool and seqs(again.records) == seqs(batch.records)[1:]


def test_readiness_is_degraded_only_while_redis_is_down_beyond_the_memory_buffer(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, max_buffered=2, spill_after_s=100)
    core.probe_done(True, 0.0)
    core.publish(ev("final", seg=0))
    core.batch_failed(send(core, 0.0), 0.0)
    assert not core.degraded  # down, but everything fits in memory
    core.publish(ev("final", seg=1))
    core.publish(ev("final", seg=2))  # over: spilled to disk
    assert core.degraded
    core.probe_done(True, 5.0)
    assert not core.degraded  # Redis is back; the backlog drains


def test_an_idle_healthy_redis_is_probed_every_probe_interval(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, up=False, probe_interval_s=5.0)
    assert isinstance(core.poll(0.0), Probe)  # first contact at startup
    core.probe_done(True, 0.0)
    assert core.poll(1.0) is None and core.next_deadline() == 5.0
    assert isinstance(core.poll(5.0), Probe)
    core.probe_done(False, 5.0)
    assert not core.redis_up and core.next_deadline() == 6.0  # retry after the backoff


def test_shutdown_spools_what_is_in_memory_and_drops_partials(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path)
    core.publish(ev("call_start"))
    core.publish(ev("partial", seg=0))
    core.publish(ev("final", seg=0))
    core.shutdown(0.0)
    assert core.spool.pending == 2 and hooks.drop[("partial", "shutdown")] == 1
    core.publish(ev("call_end"))  # a late event still reaches the spool
    assert core.spool.pending == 3
    assert [r.seq for r in core.spool.iter_pending()] == [1, 2, 3]


def test_after_a_restart_spooled_records_keep_their_seq_and_new_ones_continue(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path)
    core.publish(ev("call_start"))
    core.publish(ev("final", seg=0))
    core.shutdown(0.0)
    core.spool.close()

    spool, scan = Spool.open(tmp_path / "spool")
    core2 = SinkCore(SinkConfig(), spool, scan, Hooks(), backoff=lambda n: 1.0)
    assert core2.next_seq("c1", "caller") == 3
    core2.publish(ev("final", seg=1))
    redis = FakeRedis()
    core2.probe_done(True, 0.0)
    drain(core2, redis, 0.0)
    assert seqs(redis.stream) == [1, 2, 3]


def test_a_crash_between_xadd_and_the_cursor_write_does_not_duplicate(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, max_buffered=1)
    for i in range(3):
        core.publish(ev("final", seg=i))
    redis = FakeRedis()
    batch = send(core, 0.0)
    redis.apply(batch.records)  # stored in Redis ... and the process dies before acknowledging the spool
    core.spool.close()
    spool, scan = Spool.open(tmp_path / "spool")
    core2 = SinkCore(SinkConfig(), spool, scan, Hooks(), backoff=lambda n: 1.0)
    core2.probe_done(True, 0.0)
    drain(core2, redis, 0.0)
    assert seqs(redis.stream) == seqs(batch.records)


def test_call_end_retires_the_counter_but_a_stray_late_event_continues_the_sequence(tmp_path: Path) -> None:
    core, _ = make_core(tmp_path, ended_calls_kept=1)
    core.publish(ev("call_end"))
    core.publish(ev("final", seg=9))  # a bug upstream: an event after call_end
    core.publish(ev("call_end", "c2"))
    core.publish(ev("call_end", "c3"))  # c2 leaves the ended table (kept: 1)
    redis = FakeRedis()
    drain(core, redis, 0.0)
    assert seqs(redis.stream) == [1, 2]
    assert core.next_seq("c2", "caller") == 1 and core.next_seq("c3", "caller") == 2


def test_an_event_whose_extra_fields_overwrite_the_schema_is_dropped_not_raised(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path)
    core.publish(CallEvent("call_start", "c1", "s", extra={"seq": "7"}))
    assert hooks.drop[("call_start", "invalid")] == 1 and core.idle


def test_a_full_spool_drops_and_counts_never_raises(tmp_path: Path) -> None:
    spool, scan = Spool.open(tmp_path, max_bytes=600)
    hooks = Hooks()
    core = SinkCore(SinkConfig(max_buffered=1), spool, scan, hooks, backoff=lambda n: 1.0)
    for i in range(6):
        core.publish(ev("final", seg=i, text="x" * 100))
    assert hooks.drop[("final", "spool_full")] > 0
    assert hooks.drop[("final", "spool_full")] + spool.pending + core.in_memory == 6


# --- the whole policy under random outages: nothing durable lost or doubled, seq gapless ----------
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_under_random_outages_every_durable_event_is_stored_once_and_seq_stays_gapless(
    tmp_path_factory: pytest.TempPathFactory, seed: int
) -> None:
    rnd = random.Random(seed)
    tmp = tmp_path_factory.mktemp("prop")
    core, hooks = make_core(
        tmp, max_buffered=rnd.choice([3, 8, 50]), batch_max=rnd.choice([1, 4, 16]), spill_after_s=2
    )
    redis = FakeRedis()
    up = True
    now = 0.0
    published: list[CallEvent] = []
    generation = 0
    for step in range(300):
        now += rnd.random() * 0.5
        if rnd.random() < 0.05:
            up = not up
        if rnd.random() < 0.6:
            call = f"g{generation}c{rnd.randrange(4)}"  # calls do not outlive the gateway
            kind = rnd.choice(["partial", "partial", "final", "dtmf"])
            e = ev(kind, call, seg=step, text=f"{kind} {step}")
            published.append(e)
            core.publish(e)
        if rnd.random() < 0.02:  # a graceful restart of the gateway
            core.shutdown(now)
            core.spool.close()
            spool, scan = Spool.open(tmp / "spool")
            core = SinkCore(core.cfg, spool, scan, hooks, backoff=lambda n: 1.0)
            generation += 1
        action = core.poll(now)
        if isinstance(action, SendBatch):
            fate = rnd.random()
            if not up:
                core.batch_failed(action, now)
            elif fate < 0.1:  # stored, but the reply was lost
                redis.apply(action.records)
                core.batch_failed(action, now)
            elif fate < 0.2:  # stored partly, then a transient error
                k = rnd.randrange(len(action.records))
                out = redis.apply(action.records[:k])
                core.batch_done(action, BatchOutcome(out.stored, "LOADING"), now)
            else:
                core.batch_done(action, redis.apply(action.records), now)
        elif isinstance(action, Probe):
            core.probe_done(up, now)
    core.probe_done(True, now + 100)
    drain(core, redis, now + 100)
    assert core.idle

    durable_texts = sorted(e.text for e in published if e.durable)
    stored_durable = sorted(f["text"] for f in redis.stream if f["type"] != "partial")
    assert stored_durable == durable_texts  # every durable event exactly once
    for call in {e.call_id for e in published}:
        assert seqs(redis.stream, call) == list(range(1, len(seqs(redis.stream, call)) + 1))
    n_partials = sum(1 for e in published if not e.durable)
    stored_partials = sum(1 for f in redis.stream if f["type"] == "partial")
    dropped_partials = sum(n for (kind, _), n in hooks.drop.items() if kind == "partial")
    assert stored_partials + dropped_partials == n_partials  # every partial accounted for


def test_retries_while_redis_is_down_carry_no_newly_committed_events(tmp_path: Path) -> None:
    core, hooks = make_core(tmp_path, spill_after_s=5.0)
    core.publish(ev("final", seg=0))
    core.batch_failed(send(core, 0.0), 0.0)  # the final is committed (seq 1) and Redis is down
    core.publish(ev("partial", seg=1))
    core.publish(ev("final", seg=1))
    retry = send(core, 1.0)
    assert seqs(retry.records) == [1]  # only what was committed already
    core.batch_failed(retry, 1.0)
    core.poll(5.0)  # spill: the partial never got a seq and is dropped
    assert hooks.drop[("partial", "redis_down")] == 1
    assert [(r.type, r.seq) for r in core.spool.iter_pending()] == [("final", 1), ("final", 2)]
