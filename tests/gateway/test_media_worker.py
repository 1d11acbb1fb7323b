"""A media worker's own timing reports: how late its event loop runs, and how long a chunk its front
end completed waits before the engine's channel hears of it (`ttg_media_worker_loop_lag_seconds`,
`ttg_media_worker_flush_delay_seconds`); and a long turn that publishes its chunks before it ends. A real
worker object over a real channel, RTP ports and control socket, in this process so that a test can hold
its loop up."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from asr_core.channel import ChannelReader, ChannelWriter, channel_pair
from asr_core.features import slaney_mel_filters
from asr_core.frontend import ChunkPayload, FrontEndFactory, FrontEndSpec
from asr_core.remote import ChunkSender
from gateway import metrics
from gateway.rtp.media import MediaConfig
from gateway.rtp.receiver import MediaManager
from gateway.workers.media_worker import COMMANDS_TURN_S, PUBLISH_WITHIN_TURN_S, MediaWorker, _Leg
from gateway.workers.protocol import line
from tools.ports import port_block


class Harness:
    def __init__(self, worker: MediaWorker, control: socket.socket, reader: ChannelReader) -> None:
        self.worker, self.control, self.reader = worker, control, reader
        self._buf = b""

    def complete_chunk(self, key: int) -> None:
        """What a leg's front end does when it completes a chunk: write it, mark the worker dirty."""
        mel, energies = np.zeros((32, 128), np.float32), np.zeros(4, np.float32)
        payload = ChunkPayload(mel=mel, energies_db=energies, completed_at=time.monotonic())
        self.worker.sender.chunks(key, [payload], 1280 * 4)
        self.worker.dirty(payload.completed_at)

    def _receive(self) -> None:
        """What the worker has written to the control socket so far, onto the buffer (without waiting)."""
        with contextlib.suppress(BlockingIOError):
            self._buf += self.control.recv(65536)

    async def next_report(self, *, timed: bool, timeout_s: float = 5.0) -> dict[str, Any]:
        """The next metrics report of a kind: `timed`, the periodic one (it carries the loop lag and flush
        delay), else one the worker sent at once (as at a leg's close)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                msg = json.loads(raw)
                if msg.get("op") == "metrics" and ("loop_lag_s" in msg) == timed:
                    return msg
            await asyncio.sleep(0.02)
            self._receive()
        raise AssertionError("no metrics report")

    def replies_so_far(self, op: str) -> int:
        """How many messages of `op` the worker has sent so far (read without waiting)."""
        self._receive()
        complete = self._buf[: self._buf.rfind(b"\n") + 1]
        return sum(json.loads(raw).get("op") == op for raw in complete.split(b"\n") if raw)

    async def next_timing_report(self) -> dict[str, Any]:
        return await self.next_report(timed=True)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    _, _, memory, (a, b) = channel_pair(1 << 20)
    sender = ChunkSender(ChannelWriter(memory, a))
    reader = ChannelReader(memory, b)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    _, writer = await asyncio.open_unix_connection(sock=theirs)
    filters = slaney_mel_filters()
    spec = FrontEndSpec({}, filters, subsampling_factor=8, lookaheads=(3,), default_lookahead=3)
    base = port_block(4)
    manager = MediaManager(MediaConfig(), host="127.0.0.1", port_min=base, port_max=base + 3)
    worker = MediaWorker(0, sender, FrontEndFactory(spec), manager, writer)
    task = asyncio.create_task(worker.metrics_loop())
    try:
        yield Harness(worker, ours, reader)
    finally:
        task.cancel()
        writer.close()
        ours.close()
        sender.writer.close()
        reader.close()


async def test_a_loop_turn_held_up_shows_as_the_workers_loop_lag(harness: Harness) -> None:
    await harness.next_timing_report()  # a report period that starts now
    await asyncio.sleep(0)
    time.sleep(0.6)  # one turn of the loop does 600 ms of work
    held = await harness.next_timing_report()  # the probe that wakes late records it before it reports
    assert held["loop_lag_s"] >= 0.55
    after = await harness.next_timing_report()
    assert after["loop_lag_s"] < held["loop_lag_s"]  # each report has its own period's maximum


async def test_a_chunk_completed_early_in_a_long_turn_counts_its_wait_to_be_sent(harness: Harness) -> None:
    await harness.next_timing_report()
    harness.complete_chunk(7)
    time.sleep(0.2)  # the rest of the turn in which the front end completed it
    await asyncio.sleep(0.01)  # the turn ends: the chunk is published
    assert [kind for kind, _ in harness.reader.poll()]  # the engine's end sees it
    report = await harness.next_timing_report()
    assert report["flush_delay_s"] >= 0.2
    assert (await harness.next_timing_report())["flush_delay_s"] == 0.0  # nothing waited since


async def test_a_long_turn_publishes_its_chunks_once_the_oldest_has_waited_long_enough(
    harness: Harness,
) -> None:
    harness.complete_chunk(7)
    assert not list(harness.reader.poll())  # a chunk alone waits for the end of its turn
    time.sleep(PUBLISH_WITHIN_TURN_S * 2)  # the same turn goes on serving other calls
    harness.complete_chunk(8)
    assert len(list(harness.reader.poll())) == 2  # published within the turn, both at once
    harness.reader.release()


async def test_a_block_that_completes_no_chunk_publishes_the_chunks_that_waited_long_enough(
    harness: Harness,
) -> None:
    """The last chunk of a long turn need not wait for its end: every block a leg hands its front end
    checks the oldest chunk's wait."""
    worker = harness.worker
    leg = _Leg(worker, "b", 9, worker.factory.stream(worker.factory.spec.default_lookahead))
    block = np.zeros(1280, np.float32)  # 80 ms: far from completing the leg's first chunk
    harness.complete_chunk(7)
    leg.on_audio(block, 0)
    assert not list(harness.reader.poll())  # not yet waited long enough: the turn's end publishes it
    time.sleep(PUBLISH_WITHIN_TURN_S * 2)  # the same turn goes on serving other calls
    leg.on_audio(block, 80)
    assert len(list(harness.reader.poll())) == 1  # published within the turn
    harness.reader.release()


async def test_a_report_carries_what_each_counter_gained_since_the_last_and_only_counters(
    harness: Harness,
) -> None:
    harness.worker.send_metrics()  # what the counters held before this spec
    await harness.next_report(timed=False)
    metrics.RTP_LOST.inc(2)
    metrics.RTP_RECEIVED.labels(codec="PCMA").inc(5)
    metrics.RTP_JITTER.observe(5.0)  # a histogram: the main process derives its own from the legs' stats
    harness.worker.send_metrics()
    report = await harness.next_report(timed=False)
    assert sorted(report["counters"]) == [
        ["ttg_rtp_packets_lost", {}, 2.0],
        ["ttg_rtp_packets_received", {"codec": "PCMA"}, 5.0],
    ]
    harness.worker.send_metrics()
    assert (await harness.next_report(timed=False))["counters"] == []  # each gain travels once


async def test_commands_that_arrive_together_leave_the_loop_to_the_calls_between_them(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wave of hang-ups brings a worker many legs' close and finish in one read: once a turn has spent
    COMMANDS_TURN_S on them, the other calls' datagrams and chunks get the loop before the next."""
    worker = harness.worker
    handle = worker.handle

    async def slow_handle(msg: dict[str, Any]) -> None:  # each command holds the loop 4 ms
        await handle(msg)
        time.sleep(0.004)

    monkeypatch.setattr(worker, "handle", slow_handle)
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    ours.sendall(b"".join(line({"op": "close", "leg": f"gone{i}"}) for i in range(20)) + line({"op": "stop"}))
    replies: list[int] = []  # the worker's "closed" answers so far, at each loop turn
    loop = asyncio.get_running_loop()

    def probe() -> None:
        replies.append(harness.replies_so_far("closed"))
        if not served.done():
            loop.call_soon(probe)

    served = asyncio.create_task(worker.serve(reader))
    loop.call_soon(probe)
    await served
    probe()
    writer.close()
    ours.close()
    assert replies[-1] == 20
    per_turn = [b - a for a, b in itertools.pairwise(replies) if b > a]
    assert max(per_turn) <= math.ceil(COMMANDS_TURN_S / 0.004)  # then the loop's other work, then more
