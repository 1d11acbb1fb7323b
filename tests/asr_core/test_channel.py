"""The shared-memory channel: framing of records in the ring (pure), and the channel between processes."""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from asr_core.channel import (
    HEADER,
    ChannelReader,
    ChannelWriter,
    RingError,
    RingReader,
    RingWriter,
    SharedMemory,
    channel_pair,
    record_size,
)
from asr_core.host import _Output
from asr_core.remote import ChunkSender
from asr_core.wire import EVENT, Finish, decode_input


def ring(capacity: int) -> tuple[RingWriter, RingReader]:
    buf = memoryview(bytearray(capacity))
    return RingWriter(buf), RingReader(buf)


def drain(r: RingReader) -> list[tuple[int, bytes]]:
    out = [(kind, bytes(view)) for kind, view in r.records()]
    r.release()
    return out


# --- framing -----------------------------------------------------------------------------------------


def test_records_come_out_in_order_with_their_kind_and_bytes_once_published() -> None:
    w, r = ring(256)
    assert w.write(1, b"hello") and w.write(2, b"", b"wor", bytearray(b"ld"))
    assert drain(r) == []  # nothing published yet
    r.published(w.tail)
    assert drain(r) == [(1, b"hello"), (2, b"world")]
    assert drain(r) == []


def test_the_reader_never_reads_past_the_published_position() -> None:
    w, r = ring(256)
    w.write(1, b"a")
    published = w.tail
    w.write(1, b"b")
    r.published(published)
    assert drain(r) == [(1, b"a")]
    r.published(w.tail)
    assert drain(r) == [(1, b"b")]


def test_a_record_that_does_not_fit_before_the_end_starts_at_zero_behind_a_pad_the_reader_skips() -> None:
    w, r = ring(256)
    for kind in (1, 2, 3):
        assert w.write(kind, bytes([kind]) * 56)  # 64 bytes each: 192 in all
    r.published(w.tail)
    assert [k for k, _ in drain(r)] == [1, 2, 3]
    w.consumed(r.head)
    assert w.write(4, b"z" * 40)  # 48 bytes: 192..240
    assert w.write(5, b"q" * 40)  # 16 bytes left before the end: a pad, then 0..48
    assert w.tail % 256 == record_size(40)
    r.published(w.tail)
    assert drain(r) == [(4, b"z" * 40), (5, b"q" * 40)]


def test_a_full_ring_refuses_a_record_until_the_reader_releases() -> None:
    w, r = ring(128)
    assert w.write(1, b"a" * 24) and w.write(1, b"b" * 24) and w.write(1, b"c" * 24) and w.write(1, b"d" * 24)
    assert not w.write(1, b"e")
    r.published(w.tail)
    assert len(drain(r)) == 4
    assert not w.write(1, b"e")  # the writer has not heard yet
    w.consumed(r.head)
    assert w.write(1, b"e")


def test_records_larger_than_a_quarter_of_the_ring_and_kind_zero_are_refused() -> None:
    w, _ = ring(256)
    with pytest.raises(ValueError, match="exceeds"):
        w.write(1, b"x" * (64 - HEADER.size + 1))
    assert w.write(1, b"x" * (64 - HEADER.size))
    with pytest.raises(ValueError, match="kind"):
        w.write(0, b"pad is reserved")


def test_positions_from_a_confused_peer_are_errors() -> None:
    w, r = ring(128)
    w.write(1, b"a")
    with pytest.raises(RingError):
        w.consumed(w.tail + 8)  # beyond what was written
    with pytest.raises(RingError):
        r.published(1000)  # more than a lap ahead of the reader
    r.published(w.tail)
    with pytest.raises(RingError):
        r.published(0)  # backwards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sizes_over_many_laps_arrive_intact_and_in_order(seed: int) -> None:
    rng = random.Random(seed)
    w, r = ring(1024)
    sent: list[tuple[int, bytes]] = []
    got: list[tuple[int, bytes]] = []
    for i in range(3000):
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(0, w.max_payload + 1)))
        kind = 1 + i % 7
        while not w.write(kind, payload):
            r.published(w.tail)
            got += drain(r)
            w.consumed(r.head)
        sent.append((kind, payload))
        if rng.random() < 0.3:  # publish and read at random moments
            r.published(w.tail)
            got += drain(r)
            if rng.random() < 0.5:
                w.consumed(r.head)
    r.published(w.tail)
    got += drain(r)
    assert got == sent


# --- between processes -------------------------------------------------------------------------------


_CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from asr_core.channel import ChannelEnd, ChannelWriter
    w = ChannelWriter.open(ChannelEnd.decode(sys.argv[1]))
    n, die = int(sys.argv[2]), sys.argv[3] == "die"
    for i in range(n):
        mel = np.full((32, 128), i, np.float32)
        while not w.write(7, np.int64(i).tobytes(), mel):
            w.flush()
            import select; select.select([w.fileno()], [], [], 0.05)
        if i % 10 == 9:
            w.flush()
    w.flush()
    if die:
        import os; os._exit(3)   # no clean close: the reader must still get what was published
    w.close()
    """
)


def _spawn_writer(end_text: str, fds: tuple[int, int], n: int, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, end_text, str(n), mode], pass_fds=fds, stderr=subprocess.PIPE
    )


@pytest.mark.parametrize("mode", ["close", "die"])
def test_a_child_process_writes_chunks_the_parent_reads_in_order_then_sees_it_gone(mode: str) -> None:
    writer_end, _, memory, (a, b) = channel_pair(1 << 18)  # 256 KiB: the 16 KiB chunks lap it
    child = _spawn_writer(writer_end.encode(), writer_end.fds(), 200, mode)
    a.close()  # the child holds the writer's socket now
    reader = ChannelReader(memory, b)
    seen: list[int] = []
    while not reader.closed:
        select.select([reader], [], [], 5.0)
        for kind, view in reader.poll():
            assert kind == 7
            i = int(np.frombuffer(view[:8], np.int64)[0])
            mel = np.frombuffer(view[8:], np.float32).reshape(32, 128)
            assert (mel == i).all()
            seen.append(i)
        reader.release()
    for _, view in reader.poll():  # published just before the end
        seen.append(int(np.frombuffer(view[:8], np.int64)[0]))
    assert child.wait(10) == (3 if mode == "die" else 0), child.stderr.read() if child.stderr else ""
    assert seen == list(range(200))
    reader.close()


def test_shared_memory_is_anonymous_and_mapped_by_fd() -> None:
    mem = SharedMemory.create(4096)
    other = SharedMemory.attach(mem.fd, 4096)
    mem.buf[10:15] = b"hello"
    assert bytes(other.buf[10:15]) == b"hello"
    other.close()
    mem.close()


def test_a_writer_whose_reader_is_gone_reports_it_on_flush() -> None:
    _, _, memory, (a, b) = channel_pair(4096)
    w = ChannelWriter(memory, a)
    b.close()
    w.write(1, b"x")
    for _ in range(3):  # the first send after the peer closed may still succeed
        ok = w.flush()
        w.write(1, b"y")
    assert not ok
    assert w.closed
    w.close()


def test_a_reader_that_finds_the_writer_gone_by_a_failed_send_still_reads_what_it_published() -> None:
    _, _, memory, (a, b) = channel_pair(4096)
    w = ChannelWriter(memory, a)
    r = ChannelReader(SharedMemory.attach(os.dup(memory.fd), 4096), b)
    w.write(1, b"first")
    w.flush()
    assert [bytes(v) for _, v in r.poll()] == [b"first"]
    w.write(1, b"last")
    w.flush()
    w.close()  # gone, with the position of "last" still on the reader's socket
    r.release()  # sends the reader's position to a closed peer: it learns the writer is gone
    assert r.closed
    assert [bytes(v) for _, v in r.poll()] == [b"last"]
    r.close()


def test_a_sender_whose_position_did_not_reach_the_reader_is_not_done_flushing() -> None:
    """A FINISH written and flushed while the reader's socket is full is published by a later flush
    (the media worker calls again while `flush` says False), not left in the ring unannounced."""
    _, _, memory, (a, b) = channel_pair(1 << 20)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # a few positions fill the socket
    sender = ChunkSender(ChannelWriter(memory, a))
    reader = ChannelReader(SharedMemory.attach(os.dup(memory.fd), 1 << 20), b)
    key = 0
    for key in range(10_000):
        sender.finish(key, 0)
        if not sender.flush():
            break
    else:
        pytest.fail("the socket never filled")
    announced = [_key(kind, v) for kind, v in reader.poll()]
    assert announced[-1] < key  # the last FINISH is in the ring, its position not on the socket
    reader.release()
    assert sender.flush()  # the socket was read: the position goes out now
    announced += [_key(kind, v) for kind, v in reader.poll()]
    assert announced == list(range(key + 1))
    reader.close()
    sender.writer.close()


def _key(kind: int, view: memoryview) -> int:
    record = decode_input(kind, view)
    assert isinstance(record, Finish)
    return record.key


def test_the_engines_results_are_announced_once_the_readers_socket_has_room_again() -> None:
    """A result written while the gateway's socket is full is announced without waiting for another
    record to come along (the engine's publisher retries its position)."""
    _, _, memory, (a, b) = channel_pair(1 << 16)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:  # positions of nothing (0) until the socket takes no more
            a.send((0).to_bytes(8, "little"))
    out = _Output(ChannelWriter(memory, a), status_period_s=3600.0)
    out.status = dict  # one status record at the start, the next in an hour: as the host's
    reader = ChannelReader(SharedMemory.attach(os.dup(memory.fd), 1 << 16), b)
    out.start()
    time.sleep(0.1)  # the publisher is idle, waiting for records
    out.write(EVENT, [b"final"])
    time.sleep(0.2)  # the publisher tries to announce it, and finds the socket full
    got: list[bytes] = []
    deadline = time.monotonic() + 10.0
    while not got and time.monotonic() < deadline:
        select.select([reader], [], [], 0.1)
        got = [bytes(v) for kind, v in reader.poll() if kind == EVENT]
    out.stop()
    assert got == [b"final"]
    reader.close()
    out.writer.close()
