"""Jitter buffer policy, driven by a fake clock (times in seconds, delay 60 ms)."""

from __future__ import annotations

from gateway.rtp.jitter_buffer import BUFFERED, DUPLICATE, LATE, RELEASED, JitterBuffer

DELAY = 0.06


class Harness:
    def __init__(self, delay: float = DELAY, capacity: int = 256) -> None:
        self.jb: JitterBuffer[int] = JitterBuffer(delay, capacity)
        self.released: list[int] = []

    def push(self, seq: int, now: float) -> int:
        return self.jb.push(seq, seq, now, self.released)

    def tick(self, now: float) -> None:
        self.jb.handle_timer(now, self.released)

    def start(self, seq: int = 100, now: float = 0.0) -> None:
        self.push(seq, now)
        self.tick(now + DELAY)


def test_the_first_packet_waits_one_delay_then_in_order_packets_pass_at_once() -> None:
    h = Harness()
    assert h.push(100, 0.0) == BUFFERED
    assert h.jb.next_deadline() == DELAY
    h.tick(0.059)
    assert h.released == []
    h.tick(0.06)
    assert h.released == [100]
    assert h.push(101, 0.08) == RELEASED
    assert h.released == [100, 101]
    assert h.jb.next_deadline() is None


def test_a_reordered_first_packet_is_put_in_front_during_priming() -> None:
    h = Harness()
    h.push(101, 0.0)
    h.push(100, 0.01)
    h.tick(0.06)
    assert h.released == [100, 101]
    assert h.jb.lost_total == 0


def test_reordering_within_the_delay_loses_nothing() -> None:
    h = Harness()
    h.start()
    assert h.push(102, 0.1) == BUFFERED
    assert h.jb.next_deadline() == 0.1 + DELAY
    assert h.push(101, 0.12) == RELEASED
    assert h.released == [100, 101, 102]
    assert h.jb.lost_total == 0 and h.jb.next_deadline() is None


def test_a_gap_is_given_up_one_delay_after_the_first_packet_behind_it() -> None:
    h = Harness()
    h.start()
    h.push(103, 0.1)
    h.push(104, 0.12)
    h.tick(0.159)
    assert h.released == [100]
    h.tick(0.16)
    assert h.released == [100, 103, 104]
    assert h.jb.lost_total == 2  # 101 and 102, still pending (could arrive late)


def test_a_packet_arriving_after_its_gap_was_given_up_is_late_and_not_lost() -> None:
    h = Harness()
    h.start()
    h.push(102, 0.1)
    h.tick(0.2)
    assert h.jb.lost_total == 1
    assert h.push(101, 0.25) == LATE
    assert h.jb.lost_total == 0
    assert h.released == [100, 102]


def test_duplicates_of_released_or_waiting_packets_are_reported() -> None:
    h = Harness()
    h.start()
    assert h.push(100, 0.07) == DUPLICATE
    h.push(103, 0.08)
    assert h.push(103, 0.09) == DUPLICATE
    assert h.released == [100]


def test_losses_settle_once_the_stream_is_100_packets_past_them() -> None:
    h = Harness()
    h.start()
    h.push(102, 0.1)
    h.tick(0.2)
    assert (h.jb.lost, h.jb.lost_total) == (0, 1)
    for seq in range(103, 202):
        h.push(seq, 0.3)
    assert (h.jb.lost, h.jb.lost_total) == (0, 1)  # 201 − 100 = 101 - not yet past the horizon
    h.push(202, 0.3)
    assert (h.jb.lost, h.jb.lost_total) == (1, 1)
    assert h.push(101, 0.4) == DUPLICATE  # below the released point and no longer a pending loss


def test_sequence_numbers_before_the_start_are_late() -> None:
    h = Harness()
    h.start(100)
    assert h.push(99, 0.1) == LATE


def test_capacity_overflow_gives_up_the_oldest_gap_at_once() -> None:
    h = Harness(capacity=4)
    h.start()
    for seq in range(102, 107):
        h.push(seq, 0.1)
    assert h.released == [100, 102, 103, 104, 105, 106]
    assert h.jb.lost_total == 1


def test_flush_releases_everything_and_settles_the_losses() -> None:
    h = Harness()
    h.push(10, 0.0)
    h.push(12, 0.01)
    h.push(15, 0.02)
    h.jb.flush(h.released)
    assert h.released == [10, 12, 15]
    assert (h.jb.lost, h.jb.lost_total) == (3, 3)
    assert h.jb.idle


def test_reset_starts_a_new_source_and_keeps_the_counters() -> None:
    h = Harness()
    h.start(5)
    h.push(7, 0.1)
    h.jb.flush(h.released)
    h.jb.reset()
    assert h.push(9000, 1.0) == BUFFERED  # priming again for the new source
    h.tick(1.06)
    assert h.released == [5, 7, 9000] and h.jb.lost == 1


def test_zero_delay_releases_immediately_and_gives_up_gaps_on_the_next_tick() -> None:
    h = Harness(delay=0.0)
    assert h.push(1, 0.0) == RELEASED or h.released == [1]
    h.push(3, 0.01)
    h.tick(0.01)
    assert h.released == [1, 3]
