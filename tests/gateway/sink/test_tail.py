"""`ttg tail` and the consumer-group example: what a person (or a worker) reading the stream sees."""

from __future__ import annotations

import json
import os
import pty
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli import main as ttg
from gateway.events import CallEvent, to_fields
from gateway.tail import TailView, interleave

ROOT = Path(__file__).resolve().parents[3]
STREAM = "ttg:transcripts"


def fields(kind: str, seq: int, call: str = "c1", **kw: object) -> dict[str, str]:
    return to_fields(CallEvent(kind, call, f"{call}@sip", ts=1_700_000_000.0, **kw), seq)  # type: ignore[arg-type]


def plain(view: TailView, f: dict[str, str]) -> list[str]:
    return [line.plain for line in view.feed(f)]


# --- the view (pure) -----------------------------------------------------------------------------
def test_a_final_is_a_line_with_its_media_span_and_text_and_clears_the_open_partial() -> None:
    view = TailView()
    assert plain(view, fields("partial", 1, segment_id=0, text="Добрий")) == []
    assert [t.plain for t in view.live().renderables] == ["… c1/caller  Добрий"]  # type: ignore[attr-defined]
    lines = plain(view, fields("final", 2, segment_id=0, text="Добрий день", start_ms=1500, end_ms=3250))
    assert len(lines) == 1 and lines[0].endswith("c1/caller  #0  0:01.5–0:03.2  Добрий день")
    assert view.partials == {}


def test_a_newer_partial_replaces_the_older_one_of_the_same_call_and_leg() -> None:
    view = TailView()
    view.feed(fields("partial", 1, segment_id=0, text="你"))
    view.feed(fields("partial", 2, segment_id=0, text="你好"))
    view.feed(fields("partial", 1, call="c2", segment_id=0, text="hi"))
    assert sorted(t.plain for t in view.partials.values()) == ["… c1/caller  你好", "… c2/caller  hi"]


def test_call_start_dtmf_and_call_end_are_marked() -> None:
    view = TailView()
    start = plain(view, fields("call_start", 1, lang="uk-UA", extra={"from": "sip:a@x", "to": "sip:b@y"}))
    assert "▶ call c1 started" in start[0] and "from=sip:a@x" in start[0] and "lang=uk-UA" in start[0]
    assert "☎ DTMF 7 at 0:02.0" in plain(view, fields("dtmf", 2, text="7", start_ms=2000))[0]
    view.feed(fields("partial", 3, segment_id=1, text="…"))
    assert "■ call c1 ended  bye" in plain(view, fields("call_end", 4, extra={"reason": "bye"}))[0]
    assert view.partials == {}


def test_an_event_delivered_again_is_shown_once_and_a_gap_is_pointed_out() -> None:
    view = TailView()
    view.feed(fields("final", 1, segment_id=0, text="one"))
    assert plain(view, fields("final", 1, segment_id=0, text="one")) == []
    lines = plain(view, fields("final", 4, segment_id=1, text="four"))
    assert "events 2..3 are not in the stream" in lines[0] and lines[1].endswith("four")


def test_the_call_filter_shows_only_that_call() -> None:
    view = TailView(call_id="c2")
    assert plain(view, fields("final", 1, call="c1", segment_id=0, text="x")) == []
    assert plain(view, fields("final", 1, call="c2", segment_id=0, text="y"))[0].endswith("y")


PARTICIPANTS = json.dumps(
    [
        {"id": "p0", "name": "Customer", "aor": "sip:+15550100@x", "role": "caller", "legs": ["caller"]},
        {"id": "p1", "name": "", "aor": "sip:7001@x", "role": "callee", "legs": ["callee"]},
    ]
)


def test_a_recording_session_shows_who_speaks_on_each_leg() -> None:
    view = TailView()
    view.feed(fields("call_start", 1, extra={"participants": PARTICIPANTS}))
    caller = plain(view, fields("final", 2, segment_id=0, text="hello", start_ms=0, end_ms=900))
    callee = plain(
        view, fields("final", 1, leg="callee", segment_id=0, text="hi", start_ms=1000, end_ms=1500)
    )
    assert "c1/caller (Customer)  #0" in caller[0] and "c1/callee (sip:7001@x)  #0" in callee[0]
    view.feed(fields("call_end", 3, extra={"reason": "bye"}))
    assert view.speakers == {}


def test_a_calls_legs_are_interleaved_by_media_time_each_in_its_own_order() -> None:
    def entry(n: int, kind: str, leg: str, seq: int, start: int | None = None) -> tuple[str, dict[str, str]]:
        return f"{n}-0", fields(kind, seq, leg=leg, segment_id=seq, text=f"{leg}{seq}", start_ms=start)

    committed = [
        entry(1, "call_start", "caller", 1),
        entry(2, "final", "caller", 2, 0),
        entry(3, "final", "caller", 3, 4000),  # the caller's second sentence came out first ...
        entry(4, "final", "callee", 1, 1500),  # ... before the callee's answer, which was said before it
        entry(5, "dtmf", "callee", 2, 2500),
        entry(6, "final", "callee", 3, 5000),
        entry(7, "call_end", "caller", 4),
    ]
    order = [e[1]["type"] if e[1]["type"].startswith("call") else e[1]["text"] for e in interleave(committed)]
    assert order == ["call_start", "caller2", "callee1", "callee2", "caller3", "callee3", "call_end"]
    view = TailView()
    shown = [line for e in interleave(committed) for line in plain(view, e[1])]
    assert not any("not in the stream" in line for line in shown) and len(shown) == 7


# --- the command against a real redis-server -----------------------------------------------------
@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        yield client


def put_call(r: redis.Redis, call: str, n_finals: int = 2) -> None:
    evs = [fields("call_start", 1, call)]
    for i in range(n_finals):
        evs.append(fields("partial", len(evs) + 1, call, segment_id=i, text="…"))
        span = {"start_ms": 2000 * i, "end_ms": 2000 * i + 1500}
        evs.append(fields("final", len(evs) + 1, call, segment_id=i, text=f"{call} фраза {i} 🎉", **span))
    evs.append(fields("call_end", len(evs) + 1, call, extra={"reason": "bye"}))
    for f in evs:
        entry_id = r.xadd(STREAM, f)  # type: ignore[arg-type]
        if f["type"] in ("call_start", "call_end"):
            r.xadd("ttg:calls", {"entry_id": entry_id, **f})  # type: ignore[arg-type, dict-item]


@pytest.mark.redis
def test_tail_json_prints_every_event_of_the_last_n(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    put_call(r, "a")
    assert ttg(["tail", "--url", redis_url, "--json", "-n", "3"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["type"], e["seq"]) for e in out] == [("partial", "4"), ("final", "5"), ("call_end", "6")]


@pytest.mark.redis
def test_tail_call_prints_that_call_from_its_start_as_text(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    put_call(r, "a")
    put_call(r, "b")
    put_call(r, "a2")
    assert ttg(["tail", "--url", redis_url, "--call", "b"]) == 0
    out = capsys.readouterr().out
    assert (
        "▶ call b started" in out
        and "b фраза 0 🎉" in out
        and "b фраза 1 🎉" in out
        and "■ call b ended" in out
    )
    assert "a фраза" not in out and "…" not in out  # not a terminal: no partials


@pytest.mark.redis
def test_tail_group_resumes_what_a_crashed_consumer_left_unacknowledged(
    r: redis.Redis, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    put_call(r, "a", n_finals=1)
    r.xgroup_create(STREAM, "g", id="0")
    r.xreadgroup("g", "w1", {STREAM: ">"}, count=2)  # w1 took two entries and died before XACK
    put_call(r, "b", n_finals=1)
    assert ttg(["tail", "--url", redis_url, "--group", "g", "--consumer", "w1", "--json"]) == 0
    seen = [(e["call_id"], e["seq"]) for e in map(json.loads, capsys.readouterr().out.splitlines())]
    assert seen == [("a", "1"), ("a", "2"), ("a", "3"), ("a", "4")] + [("b", str(i)) for i in range(1, 5)]
    assert r.xpending(STREAM, "g")["pending"] == 0
    assert ttg(["tail", "--url", redis_url, "--group", "g", "--consumer", "w1", "--json"]) == 0
    assert capsys.readouterr().out == ""


def test_tail_says_so_when_redis_cannot_be_reached(capsys: pytest.CaptureFixture[str]) -> None:
    assert ttg(["tail", "--url", "redis://127.0.0.1:1/0"]) == 2
    assert "cannot reach Redis" in capsys.readouterr().err


class Proc:
    """A child process whose stdout lines can be awaited with a deadline; stopped by its PID."""

    def __init__(self, *argv: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def lines(self, n: int, timeout_s: float = 15.0) -> list[str]:
        out: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            try:
                line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"got {out}, wanted {n} lines; stderr: {self.stop()}") from None
            if line is None:
                raise AssertionError(f"process exited after {out}: {self.stop()}")
            out.append(line)
        return out

    def stop(self) -> str:
        if self.p.poll() is None:
            self.p.terminate()
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        assert self.p.stderr is not None
        return self.p.stderr.read()


@pytest.mark.redis
def test_tail_follow_prints_new_events_as_they_arrive(r: redis.Redis, redis_url: str) -> None:
    put_call(r, "old", n_finals=1)
    proc = Proc(sys.executable, "-m", "gateway.cli", "tail", "-f", "-n", "0", "--json", "--url", redis_url)
    try:
        deadline = time.monotonic() + 15  # wait until it blocks in XREAD: later entries are "new"
        while not any(c.get("cmd") == "xread" for c in r.client_list()):
            assert time.monotonic() < deadline, f"tail never reached XREAD: {proc.stop()}"
            time.sleep(0.05)
        put_call(r, "new", n_finals=1)
        got = [json.loads(line) for line in proc.lines(4)]
        assert [(e["call_id"], e["type"]) for e in got] == [
            ("new", "call_start"), ("new", "partial"), ("new", "final"), ("new", "call_end")
        ]  # fmt: skip
    finally:
        proc.stop()


@pytest.mark.redis
def test_the_consumer_group_example_prints_each_final_once(r: redis.Redis, redis_url: str) -> None:
    put_call(r, "x", n_finals=2)  # before the worker starts: the group is created at "0"
    proc = Proc(sys.executable, str(ROOT / "docs/examples/consumer_group.py"), redis_url, "w1")
    try:
        assert proc.lines(2) == ["x [0-1500 ms] x фраза 0 🎉", "x [2000-3500 ms] x фраза 1 🎉"]
        put_call(r, "y", n_finals=1)
        assert proc.lines(1) == ["y [0-1500 ms] y фраза 0 🎉"]
        deadline = time.monotonic() + 10
        while r.xinfo_groups(STREAM)[0]["lag"] or r.xpending(STREAM, "transcripts")["pending"]:
            assert time.monotonic() < deadline, "the worker did not acknowledge every entry"
            time.sleep(0.05)
    finally:
        proc.stop()


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.mark.redis
def test_on_a_terminal_partials_are_rewritten_in_place_and_the_final_replaces_them(
    r: redis.Redis, redis_url: str
) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: ttg tail on a pseudo-terminal, of a kind that draws (whatever runs the tests)
        os.execve(
            sys.executable,
            [sys.executable, "-m", "gateway.cli", "tail", "-f", "-n", "0", "--url", redis_url],
            {**os.environ, "TERM": "xterm-256color"},
        )
    try:
        deadline = time.monotonic() + 15
        while not any(c.get("cmd") == "xread" for c in r.client_list()):
            assert time.monotonic() < deadline, "tail never reached XREAD"
            time.sleep(0.05)
        for seq, text in enumerate(["Добрий", "Добрий день"], start=1):
            r.xadd(STREAM, fields("partial", seq, segment_id=0, text=text))  # type: ignore[arg-type]
            time.sleep(0.2)
        r.xadd(STREAM, fields("final", 3, segment_id=0, text="Добрий день!", end_ms=900))  # type: ignore[arg-type]
        out = b""
        while b"\n" not in out.split("Добрий день!".encode())[-1] or "Добрий день!".encode() not in out:
            assert time.monotonic() < deadline, out
            if select.select([fd], [], [], 0.2)[0]:
                out += os.read(fd, 65536)
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)
    screen = ANSI.sub("", out.decode(errors="replace"))
    # Each partial overwrote the line ("\r"), the final is a line of its own, and no stale partial follows.
    assert "… c1/caller  Добрий\r" in screen and "… c1/caller  Добрий день\r" in screen
    final_line = next(line for line in screen.split("\n") if "Добрий день!" in line)
    assert final_line.rstrip("\r").endswith("c1/caller  #0  ?–0:00.9  Добрий день!")
    assert "… c1/caller" not in screen.split("Добрий день!")[-1]
