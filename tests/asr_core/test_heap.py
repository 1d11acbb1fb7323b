"""A process's start-up heap, frozen once it is ready: a full collection under load does not walk it."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from asr_core.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def thawed_after() -> Iterator[None]:
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector


@pytest.mark.usefixtures("thawed_after")
def test_start_up_garbage_is_collected_first_and_what_is_alive_is_frozen() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    alive = _Node()

    frozen = freeze_startup_heap()

    assert gone() is None
    assert frozen == gc.get_freeze_count() > 0
    assert gc.is_tracked(alive)
    assert not any(o is alive for o in gc.get_objects())  # no generation holds it: collections skip it


@pytest.mark.usefixtures("thawed_after")
def test_what_the_process_makes_after_start_up_is_collected_as_before() -> None:
    freeze_startup_heap()
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None


@pytest.mark.usefixtures("thawed_after")
def test_an_mlx_threads_release_collects_a_cycle_frozen_at_start_up() -> None:
    # Such a cycle may hold device arrays, which must be freed before the accelerator's runtime unloads.
    import mlx.core as mx

    from asr_core.model import release_mlx_thread

    a, b = _Node(), _Node()
    a.other, b.other = b, a
    freeze_startup_heap()
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is not None  # frozen: the collector does not look at it

    def mlx_thread() -> None:  # its own streams, released last (this thread's stay usable)
        mx.eval(mx.ones((2,)) * 3)
        release_mlx_thread()

    thread = threading.Thread(target=mlx_thread)
    thread.start()
    thread.join()

    assert gone() is None
    assert gc.get_freeze_count() == 0
