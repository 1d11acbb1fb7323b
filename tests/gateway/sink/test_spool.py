"""The spool: append-only records with a replay cursor; a damaged file never stops startup."""

from __future__ import annotations

from pathlib import Path

from gateway.events import to_fields
from gateway.sink.spool import CURSOR_FILE, SPOOL_FILE, Record, Spool, decode_line, encode_record

from .factories import ev


def rec(seq: int, call: str = "c1", kind: str = "final", text: str = "") -> Record:
    return Record(to_fields(ev(kind, call, seg=seq, text=text or f"text {seq}"), seq))


def test_a_record_survives_encoding_with_text_of_any_language() -> None:
    r = rec(7, text='Добрий день — 你好，世界 🎉 "quoted"\nnew line\t\\')
    line = encode_record(r)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_line(line) == r


def test_a_line_with_a_wrong_checksum_or_no_newline_is_rejected() -> None:
    line = encode_record(rec(1))
    assert decode_line(line[:-1]) is None  # torn: no newline
    assert decode_line(line[:20] + b"X" + line[21:]) is None  # a flipped byte
    assert decode_line(b"00000000 {}\n") is None
    assert decode_line(b"garbage\n") is None


def test_records_are_read_back_in_order_and_the_cursor_survives_a_reopen(tmp_path: Path) -> None:
    spool, scan = Spool.open(tmp_path)
    assert (scan.pending, scan.corrupt) == (0, 0)
    assert spool.append([rec(1), rec(2), rec(3)]) == 3
    got, offsets = spool.read_batch(2)
    assert [r.seq for r in got] == [1, 2]
    spool.ack(2, offsets[-1])
    spool.close()

    spool, scan = Spool.open(tmp_path)
    assert scan.pending == 1 and spool.pending == 1
    assert scan.max_seq == {("c1", "caller"): 3}  # acknowledged records still count for seq continuity
    assert [r.seq for r in spool.iter_pending()] == [3]
    spool.close()


def test_rewind_hands_out_the_same_records_again(tmp_path: Path) -> None:
    spool, _ = Spool.open(tmp_path)
    spool.append([rec(1), rec(2)])
    first, _ = spool.read_batch(10)
    spool.rewind()
    again, _ = spool.read_batch(10)
    assert first == again


def test_the_file_is_emptied_once_everything_is_acknowledged(tmp_path: Path) -> None:
    spool, _ = Spool.open(tmp_path)
    spool.append([rec(1), rec(2)])
    records, offsets = spool.read_batch(10)
    spool.ack(len(records), offsets[-1])
    assert spool.pending == 0 and spool.size == 0
    assert (tmp_path / SPOOL_FILE).stat().st_size == 0
    spool.append([rec(3)])
    assert [r.seq for r in spool.read_batch(10)[0]] == [3]


def test_a_torn_last_line_is_skipped_counted_and_cut_so_new_records_follow_cleanly(tmp_path: Path) -> None:
    spool, _ = Spool.open(tmp_path)
    spool.append([rec(1), rec(2)])
    spool.close()
    with (tmp_path / SPOOL_FILE).open("ab") as f:  # a crash in the middle of writing record 3
        f.write(encode_record(rec(3))[:25])

    spool, scan = Spool.open(tmp_path)
    assert (scan.pending, scan.corrupt) == (2, 1)
    spool.append([rec(4)])
    assert [r.seq for r in spool.read_batch(10)[0]] == [1, 2, 4]
    spool.close()
    spool, scan = Spool.open(tmp_path)  # and the file is clean now
    assert (scan.pending, scan.corrupt) == (3, 0)


def test_a_damaged_record_in_the_middle_is_skipped_and_the_others_replayed(tmp_path: Path) -> None:
    lines = [encode_record(rec(i)) for i in (1, 2, 3)]
    lines[1] = lines[1].replace(b"text 2", b"text X")  # bit rot: checksum no longer matches
    (tmp_path / SPOOL_FILE).write_bytes(b"".join(lines) + b"\x00\xff not json\n")
    spool, scan = Spool.open(tmp_path)
    assert (scan.pending, scan.corrupt) == (2, 2)
    assert [r.seq for r in spool.read_batch(10)[0]] == [1, 3]


def test_a_cursor_past_the_end_replays_everything(tmp_path: Path) -> None:
    (tmp_path / SPOOL_FILE).write_bytes(encode_record(rec(1)))
    (tmp_path / CURSOR_FILE).write_text("999999\n")
    spool, scan = Spool.open(tmp_path)
    assert scan.pending == 1 and [r.seq for r in spool.read_batch(10)[0]] == [1]


def test_an_unreadable_cursor_file_means_start_from_the_beginning(tmp_path: Path) -> None:
    (tmp_path / SPOOL_FILE).write_bytes(encode_record(rec(1)))
    (tmp_path / CURSOR_FILE).write_text("not a number")
    _, scan = Spool.open(tmp_path)
    assert scan.pending == 1


def test_append_stops_at_max_bytes_and_says_how_many_fit(tmp_path: Path) -> None:
    size = len(encode_record(rec(1)))
    spool, _ = Spool.open(tmp_path, max_bytes=2 * size + size // 2)
    assert spool.append([rec(1), rec(2), rec(3)]) == 2
    assert spool.pending == 2
    spool.sync()  # fdatasync works on the live file
