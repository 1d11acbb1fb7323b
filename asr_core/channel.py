"""Channels between processes: records in a shared-memory byte ring, positions over a socket.

One channel carries records one way, from one writer process to one reader process:

    writer                                   reader
    ------                                   ------
    w.write(kind, header, payload) -> bool   for kind, view in r.poll(): ... (copy what you keep)
    w.flush()        --- "published up to" -->   (wakes the reader: select/add_reader on r.fileno())
    (learns free room) <-- "consumed up to" ---  r.release()

The bytes of a record are copied once, into shared memory, and read in place by the reader (a
memoryview; `np.frombuffer` on it makes no copy). No pickling and no kernel copy of the payload:
only positions (8-byte integers) cross the socket, one per `flush` / `release`, so a writer that
batches the records of one event-loop turn pays one system call for all of them.

Why positions travel over the socket and not as counters in the shared memory: the socket is also
the doorbell (the reader sleeps in select/epoll, not in a polling loop), and a position received
through the kernel is ordered after the record bytes it covers on every CPU (x86's stores are
ordered, ARM's are not; pure Python has no memory fence). The reader never looks past the last
position it received, and the writer never reuses bytes before the reader said it consumed them.

Framing (`RingWriter`, `RingReader`; pure, no system calls): a record is an 8-byte header (payload
length u32, kind u16, reserved u16) and the payload, padded to 8 bytes. Positions only grow (byte
offsets modulo the capacity). A record never wraps: when it does not fit before the end of the buffer,
a pad record (kind 0) fills the rest and the record starts at offset 0. The largest record is a
quarter of the capacity, so a writer that finds no room always has a reader with work to do, whose
`release` will make room.

Shared memory (`SharedMemory`): an anonymous file (memfd on Linux, an unlinked temporary file
elsewhere), so nothing is left in /dev/shm when a process dies; a child maps it from the inherited
file descriptor. End of a peer: `recv` returns nothing (`closed` becomes True); records the peer
published before it died are still read.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Self

HEADER = struct.Struct("<IHH")  # payload length, kind, reserved
ALIGN = 8
KIND_PAD = 0
_POS = struct.Struct("<Q")


def record_size(payload: int) -> int:
    """Bytes a record of `payload` bytes takes in the ring (header + payload, 8-byte aligned)."""
    return (HEADER.size + payload + ALIGN - 1) & ~(ALIGN - 1)


class RingError(Exception):
    """The ring's contents or positions are inconsistent (a bug or a corrupt peer)."""


# --- framing (pure) -------------------------------------------------------------------------------


class RingWriter:
    """The writing side's view of a ring of `len(buf)` bytes (a multiple of 8)."""

    def __init__(self, buf: memoryview) -> None:
        if len(buf) < 64 or len(buf) % ALIGN:
            raise ValueError(f"ring capacity must be a multiple of {ALIGN} and >= 64, got {len(buf)}")
        self.buf = buf
        self.capacity = len(buf)
        self.max_payload = self.capacity // 4 - HEADER.size
        self.tail = 0  # next byte to write (grows forever)
        self.head = 0  # the reader consumed everything before this (as far as we know)

    def free(self) -> int:
        return self.capacity - (self.tail - self.head)

    def reserve(self, kind: int, length: int) -> memoryview | None:
        """Room for a record of `length` payload bytes, or None when the ring has no room now.

        The record counts as written at once; it is published (visible to the reader) with the next
        `tail` the writer sends. The caller fills the returned view before that.
        """
        if not 0 < kind <= 0xFFFF:
            raise ValueError(f"record kind must be in 1..65535, got {kind}")
        size = record_size(length)
        if length > self.max_payload:
            raise ValueError(f"record of {length} bytes exceeds the ring's limit of {self.max_payload}")
        off = self.tail % self.capacity
        to_end = self.capacity - off
        need = size if size <= to_end else to_end + size
        if self.tail + need - self.head > self.capacity:
            return None
        if size > to_end:
            HEADER.pack_into(self.buf, off, to_end - HEADER.size, KIND_PAD, 0)
            self.tail += to_end
            off = 0
        HEADER.pack_into(self.buf, off, length, kind, 0)
        self.tail += size
        start = off + HEADER.size
        return self.buf[start : start + length]

    def write(self, kind: int, *parts: bytes | bytearray | memoryview) -> bool:
        """Copy `parts` (concatenated) into one record; False when the ring has no room now."""
        length = sum(memoryview(p).nbytes for p in parts)
        view = self.reserve(kind, length)
        if view is None:
            return False
        at = 0
        for p in parts:
            m = memoryview(p).cast("B")
            view[at : at + m.nbytes] = m
            at += m.nbytes
        return True

    def consumed(self, head: int) -> None:
        """The reader's position arrived."""
        if not self.head <= head <= self.tail:
            raise RingError(f"reader position {head} outside [{self.head}, {self.tail}]")
        self.head = head


class RingReader:
    """The reading side's view of the same ring."""

    def __init__(self, buf: memoryview) -> None:
        if len(buf) < 64 or len(buf) % ALIGN:
            raise ValueError(f"ring capacity must be a multiple of {ALIGN} and >= 64, got {len(buf)}")
        self.buf = buf
        self.capacity = len(buf)
        self.head = 0  # consumed up to here (released)
        self.cursor = 0  # read up to here (not yet released)
        self.tail = 0  # the writer published up to here

    def published(self, tail: int) -> None:
        if tail < self.tail or tail - self.head > self.capacity:
            raise RingError(f"writer position {tail} outside [{self.tail}, {self.head + self.capacity}]")
        self.tail = tail

    def records(self) -> Iterator[tuple[int, memoryview]]:
        """The published records after the cursor, in order: (kind, payload view). A view is valid
        until `release`: copy what must outlive it."""
        cap = self.capacity
        while self.cursor < self.tail:
            off = self.cursor % cap
            length, kind, _ = HEADER.unpack_from(self.buf, off)
            size = record_size(length)
            if off + size > cap or self.cursor + size > self.tail:
                raise RingError(f"record of {length} bytes at {self.cursor} crosses the end or the tail")
            self.cursor += size
            if kind != KIND_PAD:
                start = off + HEADER.size
                yield kind, self.buf[start : start + length]

    def release(self) -> int:
        """Everything read so far may be overwritten; returns the new head."""
        self.head = self.cursor
        return self.head


# --- shared memory --------------------------------------------------------------------------------


class SharedMemory:
    """Anonymous shared memory: `create(size)` here, `attach(fd, size)` in a child that inherited fd."""

    def __init__(self, fd: int, size: int, *, owner: bool) -> None:
        self.fd = fd
        self.size = size
        self.owner = owner
        self._map = mmap.mmap(fd, size)
        self.buf = memoryview(self._map)

    @classmethod
    def create(cls, size: int) -> SharedMemory:
        if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
            fd = os.memfd_create("ttg-channel", os.MFD_CLOEXEC)
        else:
            fd, path = tempfile.mkstemp(prefix="ttg-channel-")
            os.unlink(path)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedMemory:
        return cls(fd, size, owner=False)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.buf.release()
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with the process
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


# --- the link -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChannelEnd:
    """What a process needs to open its end of a channel: the memory and its socket (inheritable fds)."""

    memory_fd: int
    size: int
    socket_fd: int

    def encode(self) -> str:
        return f"{self.memory_fd}:{self.size}:{self.socket_fd}"

    @classmethod
    def decode(cls, text: str) -> ChannelEnd:
        mem, size, sock = (int(x) for x in text.split(":"))
        return cls(mem, size, sock)

    def fds(self) -> tuple[int, int]:
        return self.memory_fd, self.socket_fd


class _Link:
    """The socket end that carries positions (8-byte little-endian integers) both ways."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.closed = False  # the peer is gone: seen at EOF, or when a send to it failed
        self._eof = False  # everything the peer sent has been read
        self._partial = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> int | None:
        """The newest position waiting on the socket (None: nothing new); sets `closed` at EOF. A
        peer found gone by a failed send may still have sent positions before it went: they are read."""
        newest = None
        while not self._eof:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.closed = self._eof = True
                break
            if not data:
                self.closed = self._eof = True
                break
            data = self._partial + data
            whole = len(data) - len(data) % _POS.size
            if whole:
                (newest,) = _POS.unpack_from(data, whole - _POS.size)
            self._partial = data[whole:]
        return newest

    def send(self, position: int) -> bool:
        """Send a position; False when the socket is full (the caller retries later) or closed."""
        if self.closed:
            return False
        try:
            sent = self.sock.send(_POS.pack(position))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.closed = True
            return False
        if sent != _POS.size:  # a stream socket may take part of it; finish it blocking (8 bytes)
            self.sock.setblocking(True)
            try:
                self.sock.sendall(_POS.pack(position)[sent:])
            except OSError:
                self.closed = True
                return False
            finally:
                self.sock.setblocking(False)
        return True

    def close(self) -> None:
        self.closed = self._eof = True
        with contextlib.suppress(OSError):
            self.sock.close()


class _End:
    """What both ends share: the memory, the socket link, EOF, closing."""

    def __init__(self, memory: SharedMemory, sock: socket.socket) -> None:
        self.memory = memory
        self._link = _Link(sock)

    @classmethod
    def open(cls, end: ChannelEnd) -> Self:
        """This process's end from inherited fds."""
        return cls(SharedMemory.attach(end.memory_fd, end.size), socket.socket(fileno=end.socket_fd))

    @property
    def closed(self) -> bool:
        """The peer is gone (a reader still reads what it published before)."""
        return self._link.closed

    def fileno(self) -> int:
        return self._link.fileno()

    def close(self) -> None:
        self._link.close()
        self.memory.close()


class ChannelWriter(_End):
    """The writing end: `write` records, `flush` once per batch (publishes them and wakes the reader)."""

    def __init__(self, memory: SharedMemory, sock: socket.socket) -> None:
        super().__init__(memory, sock)
        self.ring = RingWriter(memory.buf)
        self._sent = 0
        self.records = 0
        self.flushes = 0

    def write(self, kind: int, *parts: bytes | bytearray | memoryview) -> bool:
        """Copy one record in; False when the ring is full even after hearing from the reader."""
        ring = self.ring
        if not ring.write(kind, *parts):
            self.take_positions()
            if not ring.write(kind, *parts):
                return False
        self.records += 1
        return True

    def take_positions(self) -> None:
        """Learn how far the reader got (non-blocking); call when readable, or when short of room."""
        head = self._link.receive()
        if head is not None:
            self.ring.consumed(head)

    def flush(self) -> bool:
        """Publish what was written since the last flush; False if the reader is gone or not keeping up
        with its socket (then the next flush sends the newer position)."""
        tail = self.ring.tail
        if tail == self._sent:
            return not self._link.closed
        if self._link.send(tail):
            self._sent = tail
            self.flushes += 1
            return True
        return False


class ChannelReader(_End):
    """The reading end: when `fileno()` is readable, `poll()` the records, then `release()` them."""

    def __init__(self, memory: SharedMemory, sock: socket.socket) -> None:
        super().__init__(memory, sock)
        self.ring = RingReader(memory.buf)
        self._owed: int | None = None  # a head the socket did not take yet
        self._sent_head = 0
        self.release_every = memory.size // 8

    def poll(self) -> Iterator[tuple[int, memoryview]]:
        """Records published since the last poll; views valid until `release`."""
        tail = self._link.receive()
        if tail is not None:
            self.ring.published(tail)
        return self.ring.records()

    def release(self) -> None:
        """Hand what was read back to the writer. Positions go out a few times per lap of the ring,
        not per call, so a busy reader costs the writer few wake-ups."""
        head = self.ring.release()
        if self._owed is not None or head - self._sent_head >= self.release_every or self._all_read():
            self._owed = head
            if self._link.send(head):
                self._sent_head = head
                self._owed = None

    def _all_read(self) -> bool:
        # Everything published is consumed: tell the writer, which may be waiting for room.
        return self.ring.head == self.ring.tail and self.ring.head != self._sent_head


def channel_pair(
    size: int,
) -> tuple[ChannelEnd, ChannelEnd, SharedMemory, tuple[socket.socket, socket.socket]]:
    """A new channel: (writer end, reader end) as inheritable fds, plus the objects that own them here
    (close them in this process once the ends were handed to the processes that use them)."""
    memory = SharedMemory.create(size)
    a, b = socket.socketpair()
    for s in (a, b):
        s.set_inheritable(True)
    os.set_inheritable(memory.fd, True)
    return (
        ChannelEnd(memory.fd, size, a.fileno()),
        ChannelEnd(memory.fd, size, b.fileno()),
        memory,
        (a, b),
    )
