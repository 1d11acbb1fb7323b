"""`ttg bench media`'s UDP measurement with `--front-end`: real RTP over loopback into one `MediaManager`,
each call's blocks through the embedded demo model's front end, as a media worker runs them."""

from __future__ import annotations

from tools.bench.media import bench_udp, front_end_factory


def test_with_the_front_end_every_call_turns_its_rtp_into_encoder_chunks() -> None:
    factory = front_end_factory(None)
    calls, seconds = 3, 3.0
    r = bench_udp(calls, seconds, "asyncio", 80, factory=factory)
    assert r["front_end"] is True
    assert r["lost"] == 0
    # 20 ms packets a call over the measured window (from 1 s after the start to 0.5 s before the end).
    assert r["packets_per_s"] > 0.8 * calls * 50
    # Every call's audio reached its front end: a chunk is 320 ms of audio (the demo model's lookahead
    # adds frames before the first), so ~3 s of audio gives each call several.
    assert r["chunks"] >= calls * 4
    assert r["cpu_us_per_packet"] > 0


def test_without_the_front_end_no_chunks_are_made() -> None:
    r = bench_udp(2, 2.0, "asyncio", 80)
    assert r["front_end"] is False
    assert r["chunks"] == 0
    assert r["packets_per_s"] > 0.8 * 2 * 50
