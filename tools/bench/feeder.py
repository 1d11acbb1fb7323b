"""A front-end process for the engine process: synthetic calls through `StreamFrontEnd`, chunks out.

    python -m tools.bench.feeder --channel END --spec SPEC.json --calls 250 --seconds 20 --first-key 0

What a media worker does for its share of the calls, minus RTP: each call's 16 kHz audio is pushed
in `--block-ms` blocks (80 ms, like the gateway's media blocks), at real time (calls' phases spread
over one chunk period) or as fast as possible (`--fast`), through the model's front end; the chunks
go to the engine through `asr_core.remote.ChunkSender`, flushed once per wake-up. At the end each
call is finished; the program prints one JSON line (CPU seconds, how late the pacer ran) and exits.
`--die-after S` ends the process abruptly after S seconds (os._exit), as a crashed worker would.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from pathlib import Path

from asr_core.channel import ChannelEnd, ChannelWriter
from asr_core.frontend import FrontEndFactory, FrontEndSpec
from asr_core.remote import ChunkSender

SAMPLE_RATE = 16_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--channel", required=True, help="the channel end (fd:size:fd), inherited")
    p.add_argument("--spec", required=True, type=Path, help="front-end spec JSON file")
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--first-key", type=int, default=0, help="keys are first-key, first-key + 1, ...")
    p.add_argument("--seed", type=int, default=0, help="call k's audio is synthetic_call(seconds, seed + k)")
    p.add_argument("--voices", type=int, default=16, help="distinct synthetic signals, reused by later calls")
    p.add_argument("--block-ms", type=int, default=80)
    p.add_argument("--lookahead", type=int, default=None)
    p.add_argument("--language", default="en-US")
    p.add_argument("--fast", action="store_true", help="no pacing: as fast as the channel takes it")
    p.add_argument("--die-after", type=float, default=0.0)
    p.add_argument("--role", default="feeder", help="a name for process listings")


def main(args: argparse.Namespace) -> int:
    from tools.bench.engine import synthetic_call

    spec = FrontEndSpec.from_json(json.loads(args.spec.read_text()))
    factory = FrontEndFactory(spec)
    lookahead = spec.default_lookahead if args.lookahead is None else args.lookahead
    sender = ChunkSender(ChannelWriter.open(ChannelEnd.decode(args.channel)))
    block = SAMPLE_RATE * args.block_ms // 1000
    # Distinct voices for up to --voices calls, reused beyond (each call's phase differs anyway).
    voices = [synthetic_call(args.seconds, seed=args.seed + k) for k in range(min(args.calls, args.voices))]
    audio = [voices[k % len(voices)] for k in range(args.calls)]
    fronts = [factory.stream(lookahead) for _ in range(args.calls)]
    n_blocks = -(-audio[0].size // block)
    period = (lookahead + 1) * 0.08
    schedule = sorted(
        (period * k / max(1, args.calls) + (b + 1) * args.block_ms / 1000, k, b)
        for k in range(args.calls)
        for b in range(n_blocks)
    )
    for k in range(args.calls):
        sender.open(args.first_key + k, lookahead, args.language, f"call-{args.first_key + k}")
    sender.flush()
    t0, c0 = time.monotonic(), time.process_time()
    late_max = 0.0
    i = 0
    while i < len(schedule):
        now = time.monotonic() - t0
        if args.die_after and now >= args.die_after:
            os._exit(3)
        due = schedule[i][0]
        if not args.fast and due > now:
            sender.flush()
            select.select([], [], [], due - now)
            continue
        late_max = max(late_max, now - due) if not args.fast else 0.0
        # everything due by now, then one flush
        while i < len(schedule) and (args.fast or schedule[i][0] <= time.monotonic() - t0):
            _, k, b = schedule[i]
            i += 1
            x = audio[k][b * block : (b + 1) * block]
            payloads = fronts[k].push(x)
            if b == n_blocks - 1:
                more, last_is_final = fronts[k].finish()
                sender.chunks(
                    args.first_key + k, [*payloads, *more], fronts[k].samples, last_is_final=last_is_final
                )
                if not last_is_final:
                    sender.finish(args.first_key + k, fronts[k].samples)
            elif payloads:
                sender.chunks(args.first_key + k, payloads, fronts[k].samples)
            if args.fast and i % 64 == 0:
                break
        while not sender.flush():
            select.select([sender.writer.fileno()], [], [], 0.01)
            sender.writer.take_positions()
    print(
        json.dumps(
            {"cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - t0, "late_max_s": late_max}
        )
    )
    sys.stdout.flush()
    # Stay until the engine took everything (its reader closing our socket would lose nothing, but a
    # clean end is easier to read in a test).
    select.select([sender.writer.fileno()], [], [], 1.0)
    sender.writer.close()
    return 0


if __name__ == "__main__":
    from asr_core import configure_process

    configure_process(mlx=False)  # the front ends only, as in a media worker
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
