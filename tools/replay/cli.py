"""`ttg replay`: synthetic call load against a running gateway, with a latency/accuracy report.

Examples:
    ttg replay --generate 20 --calls 20                       # 20 concurrent espeak-ng calls
    ttg replay --audio calls/ --calls 50 --cps 5 --call-seconds 60 --loss 0.01 --jitter-ms 30
    ttg replay --generate 10 --lang en-US:0.7,uk-UA:0.3 --calls 10
    ttg replay --generate 10 --find-capacity --call-seconds 30
Defaults for the target, Redis and /metrics come from the gateway's settings (TTG_* variables).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import sys
from pathlib import Path
from typing import Any

from tools.replay.config import (
    DEFAULT_SETTLE_S,
    Impairments,
    LanguageMix,
    LoadConfig,
    MediaConfig,
    ReplayConfig,
)
from tools.replay.siprec import VENDORS


def _hostport(text: str) -> tuple[str, int]:
    text = text.removeprefix("sip:")
    if "@" in text:
        text = text.split("@", 1)[1]
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":") or "5060"
    else:
        host, _, port = text.partition(":")
        port = port or "5060"
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host[:port], got {text!r}")
    return host, int(port)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def _lang(text: str) -> LanguageMix:
    try:
        return LanguageMix.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _settings_defaults() -> dict[str, Any]:
    """The gateway's settings (env TTG_*), so the tool finds a locally configured gateway by default."""
    try:
        from gateway.addresses import advertised_address
        from gateway.config import Settings

        s = Settings()
        sip_host = advertised_address(s.sip.host, "127.0.0.1")
        http_host = advertised_address(s.http.host, "127.0.0.1")
        return {
            "target": (sip_host, s.sip.port),
            "redis_url": s.redis.url,
            "stream": s.redis.stream,
            "metrics_url": f"http://{http_host}:{s.http.port}/metrics",
        }
    except Exception:  # settings are a convenience here; a broken env must not stop the tool
        return {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("Examples:", 1)[1] if __doc__ else None
    g = p.add_argument_group("target")
    g.add_argument(
        "--target", type=_hostport, help="gateway SIP address host[:port] (default from TTG_SIP__*)"
    )
    g.add_argument("--transport", choices=("udp", "tcp"), default="udp")
    g.add_argument("--local-ip", default="127.0.0.1", help="address to bind and advertise (SIP and RTP)")
    g.add_argument("--sip-port", type=int, default=0, help="local SIP port (0: any free one)")
    g.add_argument("--rtp-ports", default="40000-49998", help="local RTP port range, one even port per call")
    g.add_argument("--from-user", default="replay")
    g.add_argument("--to-user", default="ttg", help="user part of the Request-URI (the dialed number)")
    g.add_argument(
        "--header", type=_header, action="append", default=[], help="extra INVITE header 'Name: value'"
    )
    g.add_argument(
        "--lang", type=_lang, default=LanguageMix(), help="call language or mix, e.g. en-US:0.7,uk-UA:0.3"
    )
    g.add_argument(
        "--lang-header", default="X-Language", help="header that carries the call language ('' = none)"
    )
    g.add_argument(
        "--siprec",
        nargs="?",
        const="all",
        default="",
        choices=("all", *VENDORS),
        metavar="VENDOR",
        help="place SIPREC recording sessions (two legs, different speech on each) shaped like this SRC's "
        f"offers ({', '.join(VENDORS)}); no VENDOR: call n takes the n-th shape",
    )
    g.add_argument(
        "--leg-offset-ms", type=int, default=1500, help="SIPREC: each further leg starts speaking this later"
    )

    g = p.add_argument_group("audio")
    g.add_argument(
        "--audio", type=Path, help="folder of audio files (any rate/format; x.txt = reference of x.wav)"
    )
    g.add_argument(
        "--generate", type=int, default=0, metavar="N", help="generate N espeak-ng files per language"
    )
    g.add_argument("--codec", choices=("pcmu", "pcma"), default="pcmu", help="G.711 law offered first")
    g.add_argument("--ptime", type=int, default=20, help="packet time in ms (10..60)")
    g.add_argument(
        "--call-seconds", type=float, default=0.0, help="repeat files until a call carries this much"
    )
    g.add_argument("--gap-ms", type=int, default=1200, help="silence between files in a call")
    g.add_argument("--tail-ms", type=int, default=2000, help="silence after the last file, before BYE")
    g.add_argument("--pause-ms", type=int, default=600, help="silence that ends an utterance (VAD rule)")

    g = p.add_argument_group("load")
    g.add_argument("--calls", type=int, default=1, help="concurrent calls")
    g.add_argument(
        "--total", type=int, help="calls to place in all (default: --calls, or unbounded with --duration)"
    )
    g.add_argument("--cps", type=float, default=10.0, help="new calls per second at most")
    g.add_argument(
        "--ramp", type=float, default=0.0, metavar="S", help="raise concurrency from 1 over S seconds"
    )
    g.add_argument("--duration", type=float, metavar="S", help="keep placing calls for S seconds")
    g.add_argument("--seed", type=int, default=1)

    g = p.add_argument_group("impairments")
    g.add_argument("--loss", type=float, default=0.0, help="packet loss probability")
    g.add_argument("--jitter-ms", type=float, default=0.0, help="extra delay per packet, uniform 0..J ms")
    g.add_argument("--reorder", type=float, default=0.0, help="probability a packet swaps with the next")
    g.add_argument("--duplicate", type=float, default=0.0, help="probability a packet is sent twice")

    g = p.add_argument_group("readback and report")
    g.add_argument("--redis-url", help="Redis with the transcript stream (default TTG_REDIS__URL)")
    g.add_argument("--stream", help="global stream key (default TTG_REDIS__STREAM)")
    g.add_argument("--no-redis", action="store_true", help="SIP/RTP load only, no transcript readback")
    g.add_argument(
        "--drain", type=float, default=15.0, metavar="S", help="wait up to S s for call_end events"
    )
    g.add_argument("--metrics-url", help="gateway /metrics to scrape (default from TTG_HTTP__*)")
    g.add_argument("--no-metrics", action="store_true")
    g.add_argument("--out", type=Path, help="report folder (default var/replay/<time>)")
    g.add_argument("--no-progress", action="store_true", help="no live view")

    g = p.add_argument_group("capacity")
    g.add_argument(
        "--find-capacity", action="store_true", help="raise concurrency until p95 TTF exceeds the bound"
    )
    g.add_argument("--bound-ms", type=float, help="p95 TTF bound (default: single-call p95 + --margin-ms)")
    g.add_argument("--margin-ms", type=float, default=300.0)
    g.add_argument("--max-calls", type=int, default=256, help="highest concurrency to try")
    g.add_argument(
        "--resolution", type=int, default=1, help="stop bisecting when good and bad are this close"
    )
    g.add_argument(
        "--settle-s",
        type=float,
        default=DEFAULT_SETTLE_S,
        help="before each level, wait up to this long for the gateway's /metrics to show no call up and "
        "no overload refusals (0: do not wait)",
    )


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    defaults = _settings_defaults()
    lo, _, hi = str(args.rtp_ports).partition("-")
    if not (lo.isdigit() and hi.isdigit()):
        raise ValueError(f"--rtp-ports must be LOW-HIGH, got {args.rtp_ports!r}")
    call_seconds = args.call_seconds
    if args.find_capacity and not call_seconds:
        call_seconds = 30.0  # a level needs enough utterances per call for a p95
    out = args.out or Path("var/replay") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return ReplayConfig(
        target=args.target or defaults.get("target", ("127.0.0.1", 5060)),
        transport=args.transport,
        local_ip=args.local_ip,
        sip_port=args.sip_port,
        rtp_port_min=int(lo),
        rtp_port_max=int(hi),
        from_user=args.from_user,
        to_user=args.to_user,
        headers=tuple(args.header),
        lang=args.lang,
        lang_header=args.lang_header,
        siprec=args.siprec,
        leg_offset_ms=args.leg_offset_ms,
        audio_dir=args.audio if args.audio else (out / "audio" if args.generate else None),
        generate=args.generate,
        media=MediaConfig(
            codec=args.codec.upper(),
            ptime_ms=args.ptime,
            call_seconds=call_seconds,
            gap_ms=args.gap_ms,
            tail_ms=args.tail_ms,
            pause_ms=args.pause_ms,
        ),
        load=LoadConfig(
            calls=args.calls, total=args.total, cps=args.cps, ramp_s=args.ramp, duration_s=args.duration
        ),
        impairments=Impairments(args.loss, args.jitter_ms, args.reorder, args.duplicate),
        seed=args.seed,
        redis_url=None
        if args.no_redis
        else (args.redis_url or str(defaults.get("redis_url", "redis://127.0.0.1:6379/0"))),
        stream=args.stream or str(defaults.get("stream", "ttg:transcripts")),
        drain_s=args.drain,
        metrics_url=None
        if args.no_metrics
        else (args.metrics_url or str(defaults.get("metrics_url", "http://127.0.0.1:9108/metrics"))),
        out_dir=out,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def main(args: argparse.Namespace) -> int:
    from tools.replay import report as report_mod
    from tools.replay.runner import ReplayError, load_audio, new_loop_runner, run_replay

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"ttg replay: {exc}", file=sys.stderr)
        return 2
    try:
        if args.find_capacity:
            from tools.replay.capacity import find_capacity_async

            library = load_audio(cfg)
            with new_loop_runner() as runner:
                cap = runner.run(
                    find_capacity_async(
                        cfg,
                        library,
                        bound_s=None if args.bound_ms is None else args.bound_ms / 1000.0,
                        margin_s=args.margin_ms / 1000.0,
                        max_calls=args.max_calls,
                        resolution=args.resolution,
                        settle_s=args.settle_s,
                        out_dir=cfg.out_dir,
                    )
                )
            print(f"capacity: {cap.capacity} concurrent calls (bound p95 TTF {cap.bound_s * 1000:.0f} ms)")
            print(f"report: {cfg.out_dir}/capacity.md")
            return 0
        result = run_replay(cfg)
    except ReplayError as exc:
        print(f"ttg replay: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report_mod.summary_markdown(result.summary)))
    print(f"report: {cfg.out_dir}/report.md")
    return 0 if result.ok else 1
