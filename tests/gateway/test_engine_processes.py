"""Several engine processes behind one gateway (TTG_DAEMON__ENGINES): which worker feeds which engine,
and how their STATUS records read as one for admission and /readyz (a failed engine's no longer)."""

from __future__ import annotations

from typing import Any

from asr_core.wire import Status
from gateway.daemon import (
    RestartBudget,
    admission_limit,
    engine_front_ends,
    worker_chunk_ends,
    worker_engines,
)
from gateway.workers.legs import WorkerLegs
from gateway.workers.pool import place_leg


class _Pool:
    on_event: Any = None
    on_worker_died: Any = None


def test_worker_i_feeds_engine_i_mod_n() -> None:
    assert worker_engines(5, 2) == [0, 1, 0, 1, 0]
    assert engine_front_ends(5, 2) == [3, 2]
    assert engine_front_ends(4, 1) == [4]
    ends = [[("e0", 0), ("e0", 1), ("e0", 2)], [("e1", 0), ("e1", 1)]]
    assert worker_chunk_ends(ends) == [("e0", 0), ("e1", 0), ("e0", 1), ("e1", 1), ("e0", 2)]


def _place(engines: list[int], legs: list[int], taking: list[bool], n: int) -> list[int]:
    """Where n new legs go, one after the other; the workers' legs after them."""
    legs = list(legs)
    for _ in range(n):
        i = place_leg(engines, legs, taking)
        assert i is not None
        legs[i] += 1
    return legs


def test_legs_are_spread_evenly_over_the_engines_however_many_workers_feed_each() -> None:
    engines = worker_engines(12, 5)  # engines 0 and 1 have three workers, the others two
    legs = _place(engines, [0] * 12, [True] * 12, 2000)
    per_engine = [sum(n for n, e in zip(legs, engines, strict=True) if e == k) for k in range(5)]
    assert per_engine == [400] * 5
    # Within an engine its workers share its legs evenly.
    assert sorted({legs[i] for i in range(12) if engines[i] == 0}) == [133, 134]
    assert {legs[i] for i in range(12) if engines[i] == 4} == {200}


def test_one_engine_is_the_workers_with_the_fewest_legs_first() -> None:
    assert place_leg([0, 0, 0], [2, 1, 1], [True] * 3) == 1  # ties: the lowest index
    assert _place([0, 0, 0], [5, 0, 2], [True] * 3, 4) == [5, 3, 3]


def test_a_worker_not_taking_legs_is_passed_over_but_its_engines_legs_count() -> None:
    # Engine 0's worker 0 is suspended with 10 legs; its worker 2 still takes legs, but engine 1 has fewer.
    assert place_leg([0, 1, 0, 1], [10, 3, 0, 3], [False, True, True, True]) == 1
    # Engine 1 up to engine 0's ten, then they take turns.
    assert _place([0, 1, 0, 1], [10, 3, 0, 3], [False, True, True, True], 6) == [10, 6, 1, 5]
    assert place_leg([0, 1], [0, 0], [False, False]) is None


def test_the_engines_status_is_the_worst_lag_and_load_and_the_summed_counts() -> None:
    legs = WorkerLegs(_Pool(), spec=None, hooks=None)  # type: ignore[arg-type]
    assert legs.status == {}
    one = {
        "active_streams": 3,
        "queued_chunks": 1,
        "lag_s": 0.2,
        "load": 0.7,
        "max_wait_ms": 30.0,
        "failed": False,
    }
    legs.on_results([Status(one)], engine=0)
    assert legs.status == one
    two = {**one, "lag_s": 1.5, "load": 0.4, "active_streams": 4, "max_wait_ms": 10.0}
    legs.on_results([Status(two)], engine=1)
    assert legs.status == {
        "active_streams": 7,
        "queued_chunks": 2,
        "lag_s": 1.5,
        "load": 0.7,
        "max_wait_ms": 30.0,
        "failed": False,
    }
    assert (legs.engine_streams(0), legs.engine_streams(1), legs.engine_streams(2)) == (3, 4, 0)
    legs.on_results([Status({**one, "lag_s": 0.1})], engine=1)  # the latest record of each engine counts
    assert legs.status["lag_s"] == 0.2
    assert legs.engine_streams(1) == 3
    legs.on_results([Status({**one, "lag_s": 9.0})], engine=1)
    assert legs.engine_status(1)["lag_s"] == 9.0  # what the per-engine gauges show
    legs.engine_died("gone", engine=1, workers=[1])  # a dead engine's last lag does not hold admission
    assert legs.status == one
    assert legs.engine_streams(1) == 0
    assert legs.engine_status(1) == {}


def test_admission_stays_below_what_the_engines_device_pools_hold() -> None:
    assert admission_limit([None], 0) is None  # a CPU engine: no limit
    assert admission_limit([780], 0) == 780  # one process
    assert admission_limit([780, 780], 8) == 1552  # two engines behind 8 workers: a leg of slack each
    assert admission_limit([780, None], 8) is None


def test_a_process_is_replaced_at_most_limit_times_within_the_window() -> None:
    budget = RestartBudget(limit=3, window_s=600.0)
    assert [budget.allow(("worker", 0), t) for t in (0.0, 10.0, 20.0, 30.0)] == [True, True, True, False]
    assert budget.allow(("worker", 1), 30.0)  # each process has its own
    assert not budget.allow(("worker", 0), 599.0)  # the first replacement still counts
    assert budget.allow(("worker", 0), 600.0)  # 600 s after it, one is free again
    assert not budget.allow(("worker", 0), 601.0)
