"""`ttg serve`: the composition root. Settings → model → sink → HTTP → engine → SIP/RTP front end.

    ttg serve [--model DIR] [--sip-port 5060] [--http-port 9108] [--redis-url URL] ...

Startup, in this order (what an operator sees):
1. Settings from `TTG_*` (NEMO_* aliases), then the command-line flags on top. A bad value, an RTP
   port range too small for `TTG_SIP__MAX_CALLS`, or a bundle that does not load ends the process
   with one line on stderr and exit status 2, before any port is bound.
2. The model bundle is loaded once (no bundle given: the embedded demo model).
3. The sink opens its spool (events a previous run could not deliver are sent first) and starts;
   Redis being unreachable is not fatal: events wait in memory, then in the spool.
4. HTTP (/metrics, /healthz, /readyz) comes up: /readyz says "model not loaded" until step 6.
5. The engine starts (MLX thread builds the encoder; decoder workers own their ORT sessions).
6. The SIP/RTP front end binds and the gateway is ready.

Shutdown on SIGTERM/SIGINT: /readyz turns 503 (draining) and new INVITEs get 503 + Retry-After; live
calls may go on for `TTG_DAEMON__SHUTDOWN_GRACE_S`; the rest are hung up (BYE, Reason: shutdown) and
their finals and call_end events awaited (`TTG_DAEMON__HANGUP_TIMEOUT_S`); the sink flushes what Redis
takes within `TTG_SINK__FLUSH_TIMEOUT_S` and spools the rest; HTTP stops; the engine shuts down; exit 0.
A second signal skips what is left of the grace period and shortens every later wait (the spool is
still written); a third exits at once (committed events are already in the spool file).

If the engine's MLX thread dies, the daemon logs it, turns /readyz 503, ends every call (their ASR
streams end with an error, so each gets a BYE and a call_end) and exits with status 1, so that a
supervisor (systemd Restart=on-failure, launchd KeepAlive) starts a fresh process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from asr_core.heap import freeze_startup_heap
from gateway.addresses import is_unspecified
from gateway.config import Settings
from gateway.events import CallEvent, EventPublisher
from gateway.http import HttpServer, Readiness
from gateway.logs import configure_logging
from gateway.rtp.ports import rtp_pair_ports

if TYPE_CHECKING:
    from asr_core.accelerator import Accelerator
    from asr_core.config import EngineConfig
    from gateway.cuda_mps import MpsServer
    from gateway.sip.admission import ConcurrencyLimit

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1  # the engine died, or startup failed after the checks (a port in use ...)
EXIT_CONFIG = 2  # bad settings or model bundle: nothing was bound

# After a second signal: how long the remaining shutdown steps may take at most.
FORCED_HANGUP_S = 3.0
FORCED_FLUSH_S = 1.0
# After an engine failure: how long calls get to end by themselves (their ASR streams end with an error
# at once, so each call ends with reason "error") before the rest are hung up as a shutdown.
ENGINE_FAILURE_GRACE_S = 5.0
ENGINE_SHUTDOWN_S = 10.0
ENGINE_START_TIMEOUT_S = 900.0  # a GPU's first start compiles its kernels (minutes on a fresh machine)
# An engine process that fails while others run is replaced: first the calls on its media workers end
# (they lost their ASR streams; each gets its BYE and call_end), for at most this long.
ENGINE_REPLACE_DRAIN_S = 10.0
# A process that keeps failing (a fault its input or the device brings back at once) is not replaced
# without end: at most this many replacements of one engine or media worker within the window.
REPLACEMENTS_PER_WINDOW = 3
REPLACEMENT_WINDOW_S = 600.0
STATUS_PERIOD_S = 0.25  # how often the engine's lag is looked at (admission, /readyz, metrics)
OWN_LOOP_REPORT_S = 1.0  # single-process mode: how often this loop's lateness goes to the metrics


class StartupError(Exception):
    """A problem an operator must fix; its message is the one line printed on stderr."""

    def __init__(self, message: str, code: int = EXIT_CONFIG) -> None:
        super().__init__(message)
        self.code = code


# --- command line ------------------------------------------------------------------------------------


def _port_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX, e.g. 20000-30000, got {text!r}") from None
    if not sep or not 1024 <= low < high <= 65535:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX within 1024-65535, got {text!r}")
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the gateway: SIP/RTP in, transcripts to Redis Streams, /metrics /healthz /readyz over HTTP. "
        "Every setting is an environment variable TTG_<SECTION>__<FIELD> (see ops/env.example); "
        "these flags override the common ones."
    )
    g = parser.add_argument_group("overrides of TTG_* settings")
    g.add_argument("--model", metavar="DIR", help="model bundle directory (TTG_MODEL__DIR; default: demo)")
    g.add_argument("--precision", choices=["auto", "f32", "f16", "bf16"], help="TTG_MODEL__PRECISION")
    g.add_argument("--language", metavar="LOCALE", help="default call language (TTG_ASR__LANGUAGE)")
    g.add_argument("--sip-host", metavar="ADDR", help="SIP bind address (TTG_SIP__HOST)")
    g.add_argument("--sip-port", type=int, metavar="PORT", help="SIP port, UDP and TCP (TTG_SIP__PORT)")
    g.add_argument("--advertised-host", metavar="ADDR", help="Contact/SDP address (TTG_SIP__ADVERTISED_HOST)")
    g.add_argument("--max-calls", type=int, metavar="N", help="concurrent calls (TTG_SIP__MAX_CALLS)")
    g.add_argument("--rtp-host", metavar="ADDR", help="RTP bind address (TTG_RTP__HOST)")
    g.add_argument(
        "--rtp-ports", type=_port_range, metavar="MIN-MAX", help="RTP port range (TTG_RTP__PORT_MIN/MAX)"
    )
    g.add_argument("--redis-url", metavar="URL", help="TTG_REDIS__URL")
    g.add_argument("--stream", metavar="KEY", help="global transcript stream (TTG_REDIS__STREAM)")
    g.add_argument("--spool-dir", metavar="DIR", help="TTG_SINK__SPOOL_DIR")
    g.add_argument("--http-host", metavar="ADDR", help="TTG_HTTP__HOST")
    g.add_argument("--http-port", type=int, metavar="PORT", help="TTG_HTTP__PORT")
    g.add_argument("--log-level", metavar="LEVEL", help="TTG_LOG__LEVEL (DEBUG, INFO, WARNING ...)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Environment (and NEMO_* aliases) first, the flags on top (pydantic-settings deep-merges)."""
    overrides: dict[str, Any] = {}

    def put(section: str, name: str, value: Any) -> None:
        if value is not None:
            overrides.setdefault(section, {})[name] = value

    get = lambda name: getattr(args, name, None)  # noqa: E731  (a Namespace from tests may lack some)
    put("model", "dir", get("model"))
    put("model", "precision", get("precision"))
    put("asr", "language", get("language"))
    put("sip", "host", get("sip_host"))
    put("sip", "port", get("sip_port"))
    put("sip", "advertised_host", get("advertised_host"))
    put("sip", "max_calls", get("max_calls"))
    put("rtp", "host", get("rtp_host"))
    if get("rtp_ports") is not None:
        put("rtp", "port_min", args.rtp_ports[0])
        put("rtp", "port_max", args.rtp_ports[1])
    put("redis", "url", get("redis_url"))
    put("redis", "stream", get("stream"))
    put("sink", "spool_dir", get("spool_dir"))
    put("http", "host", get("http_host"))
    put("http", "port", get("http_port"))
    put("log", "level", get("log_level"))
    from pydantic import ValidationError

    try:
        return Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        name = "TTG_" + "__".join(str(p).upper() for p in first["loc"])
        raise StartupError(f"bad setting {name}: {first['msg']} (got {first.get('input')!r})") from None


# --- startup checks (pure) ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    level: int  # logging.ERROR: refuse to start; logging.WARNING: start, but say so
    message: str


def rtp_port_pairs(port_min: int, port_max: int) -> int:
    """RTP/RTCP pairs in the range: even RTP port, RTCP on the next one (RFC 3550 §11)."""
    return len(rtp_pair_ports(port_min, port_max))


def check_settings(s: Settings) -> list[Finding]:
    """What an operator would want to hear about before the gateway takes calls."""
    out: list[Finding] = []
    pairs = rtp_port_pairs(s.rtp.port_min, s.rtp.port_max)
    needed = s.sip.max_calls  # it counts streams (legs), one RTP/RTCP pair each
    if s.rtp.port_min >= s.rtp.port_max or pairs == 0:
        rng = f"TTG_RTP__PORT_MIN ({s.rtp.port_min}) .. TTG_RTP__PORT_MAX ({s.rtp.port_max})"
        out.append(Finding(logging.ERROR, f"{rng} holds no RTP/RTCP port pair"))
    elif pairs < needed:
        out.append(
            Finding(
                logging.ERROR,
                f"RTP ports {s.rtp.port_min}-{s.rtp.port_max} hold {pairs} RTP/RTCP pairs but "
                f"TTG_SIP__MAX_CALLS={s.sip.max_calls} streams need as many: widen the range or lower "
                "max_calls",
            )
        )
    elif s.rtp.port_quarantine_s > 0 and pairs < needed + needed // 10:
        out.append(
            Finding(
                logging.WARNING,
                f"RTP ports {s.rtp.port_min}-{s.rtp.port_max} hold {pairs} pairs for {needed} streams: "
                f"released pairs rest {s.rtp.port_quarantine_s:g} s, so at full load with turnover some "
                "calls may get 503",
            )
        )
    advertised = s.rtp.advertised_host or s.sip.advertised_host
    if (is_unspecified(s.sip.host) or is_unspecified(s.rtp.host)) and not advertised:
        out.append(
            Finding(
                logging.WARNING,
                f"binding {s.sip.host or '*'} (SIP) / {s.rtp.host or '*'} (RTP) with no advertised address: "
                "Contact and SDP will carry this host's own address toward each caller; behind NAT or "
                "in a container set TTG_SIP__ADVERTISED_HOST (and TTG_RTP__ADVERTISED_HOST if media "
                "differs) or callers will send RTP to an address they cannot reach (one-way audio)",
            )
        )
    for name, host in (("TTG_SIP__ADVERTISED_HOST", s.sip.advertised_host),
                       ("TTG_RTP__ADVERTISED_HOST", s.rtp.advertised_host)):  # fmt: skip
        if host and is_unspecified(host):
            out.append(Finding(logging.ERROR, f"{name}={host} is a wildcard: advertise a reachable address"))
    if not _is_loopback(s.http.host):
        out.append(
            Finding(
                logging.WARNING,
                f"HTTP (/metrics, /readyz) is bound to {s.http.host}, not loopback: "
                "make sure only your monitoring can reach it",
            )
        )
    if s.sip.digest_user and not s.sip.digest_password:
        out.append(
            Finding(logging.ERROR, "TTG_SIP__DIGEST_USER is set but TTG_SIP__DIGEST_PASSWORD is empty")
        )
    if log_level(s.log.level) is None:
        out.append(Finding(logging.ERROR, f"TTG_LOG__LEVEL={s.log.level!r} is not a log level"))
    return out


def log_level(name: str) -> int | None:
    level = logging.getLevelNamesMapping().get(name.strip().upper())
    return level


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redact_url(url: str) -> str:
    """A Redis URL for logs: the password replaced."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


# --- logging -----------------------------------------------------------------------------------------


# --- the model ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ModelChoice:
    dir: Path
    name: str  # call_start `model`, ttg_build_info{model}


def choose_model(s: Settings) -> ModelChoice:
    """The configured bundle, else the embedded demo model (asr_core/demo_model, shipped with the package)."""
    from asr_core.model import embedded_model_dir

    if s.model.dir:
        d = Path(s.model.dir).expanduser()
        return ModelChoice(d, d.resolve().name or str(d))
    embedded = embedded_model_dir()
    if embedded is None:
        raise StartupError(
            "no model given (TTG_MODEL__DIR / --model) and this install has no embedded demo model "
            "(asr_core/demo_model): point TTG_MODEL__DIR at a bundle"
        )
    return ModelChoice(embedded, "demo")


@contextlib.contextmanager
def _bundle_view(s: Settings, bundle: Path) -> Iterator[tuple[Path, Callable[[str], str]]]:
    """The bundle with TTG_MODEL__MEL_FILTERS / TTG_MODEL__ENCODER_WEIGHTS (NEMO_MEL_FILTERS,
    NEMO_MLX_WEIGHTS) swapped in: a temporary directory of symlinks, so the loader reads one folder.
    Yields the folder and a function that maps paths in loader messages back to the real files."""
    overrides = {"melfilters.f32": s.model.mel_filters, "encoder.safetensors": s.model.encoder_weights}
    overrides = {k: v for k, v in overrides.items() if v}
    if not overrides:
        yield bundle, lambda text: text
        return
    with tempfile.TemporaryDirectory(prefix="ttg-bundle-") as tmp:
        view = Path(tmp)
        real: dict[str, str] = {}
        if bundle.is_dir():
            for f in bundle.iterdir():
                if f.name not in overrides:
                    (view / f.name).symlink_to(f.resolve())
                    real[str(view / f.name)] = str(f)
        for name, path in overrides.items():
            target = Path(path).expanduser()
            if not target.is_file():
                var = "TTG_MODEL__MEL_FILTERS" if name == "melfilters.f32" else "TTG_MODEL__ENCODER_WEIGHTS"
                raise StartupError(f"{var}={path}: no such file")
            (view / name).symlink_to(target.resolve())
            real[str(view / name)] = str(target)

        def back(text: str) -> str:
            for fake, true in real.items():
                text = text.replace(fake, true)
            return text.replace(str(view), str(bundle))

        yield view, back


def load_model(s: Settings, choice: ModelChoice) -> Any:
    """`AsrModel.load`, with any loader error turned into a one-line StartupError naming the file."""
    from asr_core.errors import AsrError
    from asr_core.model import AsrModel

    with _bundle_view(s, choice.dir) as (folder, back):
        try:
            return AsrModel.load(folder, s.model.precision)
        except (AsrError, OSError, ValueError) as e:
            raise StartupError(f"cannot load the model bundle: {back(str(e))}") from None
        except Exception as e:  # a loader bug: still one line, with the type for the bug report
            raise StartupError(
                f"cannot load the model bundle {choice.dir}: {type(e).__name__}: {back(str(e))}"
            ) from None


# --- readiness and the per-call log ------------------------------------------------------------------


@dataclasses.dataclass
class DaemonReadiness(Readiness):
    """Readiness plus the daemon's own reason: the ASR engine failed (the process is about to exit)."""

    engine_failed: bool = False
    engine_behind: str = ""  # why new calls are refused (the engine's lag), "" while it keeps up

    def reasons(self) -> list[str]:
        out = super().reasons()
        if self.engine_failed:
            out.insert(0, "ASR engine failed")
        if self.engine_behind:
            out.append(self.engine_behind)
        return out


class CallLogPublisher:
    """The sink, plus one INFO line when a call starts and one when it ends, with its counters."""

    def __init__(self, sink: EventPublisher) -> None:
        self._sink = sink
        self._counts: dict[str, list[int]] = {}  # call_id -> [partials, finals]

    def publish(self, ev: CallEvent) -> None:
        try:
            self._log(ev)
        except Exception:  # logging must never cost an event
            logger.exception("call log failed for a %s event", ev.type)
        self._sink.publish(ev)

    def _log(self, ev: CallEvent) -> None:
        x = ev.extra
        if ev.type == "call_start":
            self._counts[ev.call_id] = [0, 0]
            logger.info(
                "call %s started: from %s to %s via %s/%s, sip call-id %s, lang %s (%s), codec %s",
                ev.call_id, x.get("ani") or x.get("from", ""), x.get("dnis", ""), x.get("source", ""),
                x.get("transport", ""), ev.sip_call_id, ev.lang, x.get("language_source", ""),
                x.get("codec") or "-",
            )  # fmt: skip
        elif ev.type in ("partial", "final"):
            counts = self._counts.get(ev.call_id)
            if counts is not None:
                counts[ev.type == "final"] += 1
        elif ev.type == "call_end":
            partials, finals = self._counts.pop(ev.call_id, [0, 0])
            logger.info(
                "call %s ended: %s after %.1f s, audio %s ms, %d finals, %d partials, dtmf %s, asr %s "
                "(dropped chunks %s), rtp %s packets, lost %s, late %s, dup %s, jitter %s ms",
                ev.call_id, x.get("reason", "?"), int(x.get("duration_ms") or 0) / 1000,
                x.get("audio_ms", "0"), finals, partials, x.get("dtmf_events", "0"), x.get("asr", "-"),
                x.get("asr_dropped_chunks", "0"), x.get("rtp_packets", "0"), x.get("rtp_lost", "0"),
                x.get("rtp_late", "0"), x.get("rtp_duplicate", "0"), x.get("rtp_jitter_ms", "0"),
            )  # fmt: skip


# --- the daemon --------------------------------------------------------------------------------------


EngineFactory = Callable[[Any, Callable[[BaseException], None]], Any]


def engine_config(s: Settings, share: float = 1.0, *, on: Accelerator) -> EngineConfig:
    """The engine's dataclasses from the typed settings: built field by field, so a renamed setting
    is a type error here instead of a silent fall-back to a default. `share`: the part of the call
    limit this engine serves (one engine's part of the legs), the streams its pools are sized for.
    `on`: the accelerator the engine runs on, which the "auto" settings follow (`profile`)."""
    from asr_core.accelerator import profile
    from asr_core.config import DecoderConfig, EndpointConfig, EngineConfig, SchedulerConfig
    from asr_core.vad import VadConfig

    auto = profile(on)

    # The VAD's energy gate is the assembler's quiet-audio threshold; 0 dBFS there (judge by tokens
    # only) says nothing about the line's floor, so the gate keeps the VAD's own default.
    vad_energy_db = s.asr.endpoint_energy_db if s.asr.endpoint_energy_db < 0.0 else VadConfig().energy_db
    return EngineConfig(
        cpu_threads=s.encoder.cpu_threads,
        streams=math.ceil(s.sip.max_calls * share),
        scheduler=SchedulerConfig(
            max_batch=s.encoder.max_batch or auto.max_batch,
            max_wait_ms=s.encoder.max_wait_ms,
            wait_policy=s.encoder.wait_policy,
            max_queued_chunks=s.encoder.max_queued_chunks,
            max_undecoded_chunks=s.decoder.max_undecoded_chunks,
        ),
        decoder=DecoderConfig(
            mode=auto.decoder_mode if s.decoder.mode == "auto" else s.decoder.mode,
            workers=s.decoder.workers,
            device_thread=s.decoder.device_thread,
        ),
        endpoint=EndpointConfig(
            blank_ms=s.asr.endpoint_blank_ms,
            energy_db=s.asr.endpoint_energy_db,
            max_blank_ms=s.asr.endpoint_max_blank_ms,
            max_segment_ms=s.asr.max_segment_ms,
            partial_interval_ms=s.asr.partial_interval_ms,
            partials=s.asr.partials,
            words=s.asr.words,
        ),
        vad=VadConfig(
            kind=s.asr.vad,
            hangover_ms=s.asr.vad_hangover_ms,
            min_speech_ms=s.asr.vad_min_speech_ms,
            webrtc_mode=s.asr.vad_webrtc_mode,
            energy_db=vad_energy_db,
        ),
        default_language=s.asr.language or "auto",
        default_lookahead=s.asr.lookahead,
    )


def default_engine_factory(settings: Settings) -> EngineFactory:
    def make(model: Any, on_fatal: Callable[[BaseException], None]) -> Any:
        from asr_core.accelerator import this_process
        from asr_core.engine import AsrEngine
        from gateway.metrics import PrometheusEngineHooks

        # One process: the engine runs where the model was loaded, so MLX here says which device.
        config = engine_config(settings, on=this_process())
        return AsrEngine(model, config, PrometheusEngineHooks(), on_fatal=on_fatal)

    return make


def resolve_media_workers(setting: int, cpus: int | None) -> int:
    """TTG_DAEMON__MEDIA_WORKERS: -1 (auto) is one process per two cores (at most 16), or all in one
    process below four cores, where the separate processes would only compete for the same cores."""
    if setting >= 0:
        return setting
    cpus = cpus or 1
    return 0 if cpus < 4 else min(16, cpus // 2)


class Daemon:
    """Runs the gateway until a signal (or an engine failure); `run()` returns the exit status.

    Two process models, one daemon. In one process (`model` given): the engine's threads run here and
    `LocalLegs` wires each call's RTP into its ASR stream. With media workers (`engine_processes`
    given, already started): the engines run in those processes, `MediaWorkerPool` starts the workers
    that receive RTP and run the ASR front end (worker i feeds engine i mod N), `WorkerLegs` carries the
    call core's leg effects to them and the engines' results back; this process keeps SIP, the
    per-call cores, Redis and HTTP. An engine process that fails while others run is replaced with its
    media workers (`new_engine(k)` makes engine k; its calls end as errors, the others go on), and a
    media worker that dies by a fresh one on a new channel into its engine; the only engine, or the
    last one up, failing stops the gateway (exit status 1).

    `engine_factory(model, on_fatal)` builds the (not yet started) engine; tests pass one that wraps
    the real engine's model to inject a failure. `install_signals=False` when the caller owns them.
    """

    def __init__(
        self,
        settings: Settings,
        model: Any,
        choice: ModelChoice,
        *,
        engine_factory: EngineFactory | None = None,
        install_signals: bool = True,
        engine_processes: Sequence[Any] = (),
        new_engine: Callable[[int], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.engine_processes = list(engine_processes)  # asr_core.remote.EngineProcess, started
        self.new_engine = new_engine  # engine process k, not started: replaces one that failed
        self._engines_down: set[int] = set()  # failed, being replaced
        self._replacing: set[asyncio.Task[None]] = set()  # `_replace_engine` at work
        self._budget = RestartBudget()
        self.pool: Any = None
        self.legs: Any = None
        self.choice = choice
        self.engine_factory = engine_factory or default_engine_factory(settings)
        self.install_signals = install_signals
        self.readiness = DaemonReadiness()
        self.exit_code = EXIT_OK
        self.frontend: Any = None
        self.http: HttpServer | None = None
        self.sink: Any = None
        self.engine: Any = None
        self.ready = asyncio.Event()  # set once calls are taken (tests, embedding)
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._hurry = False  # no grace period (engine failure)
        self._tasks: set[asyncio.Task[None]] = set()
        self._signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_stopping = False
        self._tmp: Any = None
        from gateway.sip.admission import OverloadGuard

        self.overload = OverloadGuard(settings.sip.max_engine_lag_ms / 1000)
        self.call_limit: ConcurrencyLimit | None = None  # once admission's max_calls is known (`_start`)
        self.engine_load = 0.0  # the engines' latest utilisation (`EncoderScheduler.load`)

    # --- control ---

    def request_stop(self, why: str = "requested") -> None:
        """Begin a graceful shutdown (what SIGTERM does); a second call forces it; a third exits."""
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: shutting down gracefully (again to hurry, a third time to exit at once)", why)
            self._stop.set()
        elif self._signals == 2:
            logger.warning("%s again: hanging up every call now and flushing briefly", why)
            self._force.set()
            self._stop.set()
        else:
            logger.warning("%s a third time: exiting now; committed events are in the spool", why)
            logging.shutdown()
            os._exit(EXIT_FAILURE)

    def _on_engine_fatal(self, error: BaseException) -> None:
        """Called on the engine's MLX thread."""
        from gateway import metrics

        metrics.ENGINE_FAILURES.inc()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(self._engine_failed, error)

    def _engine_failed(self, error: BaseException) -> None:
        logger.critical(
            "ASR engine failed (%s: %s): not ready, ending every call, then exiting with status %d "
            "so that the supervisor restarts the gateway",
            type(error).__name__, error, EXIT_FAILURE,
        )  # fmt: skip
        self.readiness.engine_failed = True
        self.exit_code = EXIT_FAILURE
        self._hurry = True  # no grace period for speech: the calls end as their streams fail
        self._stop.set()

    # --- run ---

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self.install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
        try:
            try:
                await self._start()
            except StartupError:
                raise
            except OSError as e:
                raise StartupError(f"cannot start: {e}", EXIT_FAILURE) from None
            if not self._stop.is_set():
                self.ready.set()
                await self._stop.wait()
        except StartupError as e:
            logger.error("%s", e)
            self.exit_code = e.code
        finally:
            await self._shutdown()
            if self.install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
        return self.exit_code

    async def _start(self) -> None:
        from gateway.call.frontend import FrontEndConfig, TelephonyFrontEnd
        from gateway.call.legs import LocalLegs
        from gateway.metrics import init_metrics
        from gateway.rtp.receiver import MediaManager
        from gateway.sink import RedisSink

        s = self.settings
        # The device the model was loaded on: here, or by the engine processes (all on one accelerator).
        device = self.model.info.device if self.model is not None else self.engine_processes[0].info["device"]
        init_metrics(model=self.choice.name, device=device)
        try:
            self.sink = RedisSink.from_settings(s, on_degraded=self.readiness.set_sink_degraded)
        except OSError as e:
            raise StartupError(f"cannot open the spool in {s.sink.spool_dir}: {e}") from None
        await self.sink.start()
        if self.sink.core.spool.pending:
            logger.info(
                "spool: %d events from an earlier run go to Redis first", self.sink.core.spool.pending
            )
        self._tasks.add(asyncio.create_task(self._check_redis()))
        self.http = HttpServer(self.readiness, s.http.host, s.http.port)
        try:
            await self.http.start()
        except OSError as e:
            raise StartupError(
                f"cannot serve HTTP on {s.http.host}:{s.http.port}: {e}", EXIT_FAILURE
            ) from None
        if self.engine_processes:
            legs = await self._start_workers()
        else:
            self.engine = self.engine_factory(self.model, self._on_engine_fatal)
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(self.engine.start)
            except Exception as e:
                self.engine = None
                raise StartupError(f"the ASR engine did not start: {e}", EXIT_FAILURE) from None
            cfg = self.engine.config
            logger.info(
                "ASR engine up in %.1f s: %d decoder workers (%s), max batch %d",
                time.monotonic() - t0, cfg.decoder.workers, cfg.decoder.mode, cfg.scheduler.max_batch,
            )  # fmt: skip
            legs = LocalLegs(self.engine, MediaManager.from_settings(s))
        self._clamp_max_calls()
        self.frontend = TelephonyFrontEnd(
            FrontEndConfig.from_settings(s, model_name=self.choice.name),
            legs,
            CallLogPublisher(self.sink),
        )
        from gateway.sip.admission import ConcurrencyLimit

        admission = self.frontend.agent.admission
        admission.overload = self.overload
        ceiling = admission.config.max_calls
        limit = ConcurrencyLimit(
            s.sip.call_limit_lag_ms / 1000, s.sip.call_limit_start, ceiling, max_load=s.sip.call_limit_load
        )
        admission.limit = self.call_limit = limit
        try:
            await self.frontend.start()
        except OSError as e:
            raise StartupError(
                f"cannot listen for SIP on {s.sip.host}:{s.sip.port}: {e}", EXIT_FAILURE
            ) from None
        self.readiness.details["active_calls"] = lambda: self.frontend.active_calls
        self.readiness.details["engine_lag_s"] = lambda: round(self.overload.lag_s, 3)
        self.readiness.details["engine_load"] = lambda: round(self.engine_load, 3)
        self.readiness.details["call_limit"] = lambda: limit.limit
        if self.pool is not None:
            self.readiness.details["media_workers"] = lambda: self.pool.alive
            self.readiness.details["engines_up"] = lambda: self._engines_up
        self.readiness.model_loaded = True
        self._tasks.add(asyncio.create_task(self._watch_engine()))
        if self.pool is None:  # the media path runs on this loop: its lateness shows as worker 0's
            from gateway import metrics
            from gateway.loop_lag import watch_loop_lag

            def report(lag_s: float) -> None:
                metrics.set_media_worker_timing("0", lag_s, 0.0)  # no channel: chunks go straight in

            self._tasks.add(asyncio.create_task(watch_loop_lag(report, OWN_LOOP_REPORT_S)))
        logger.info(
            "ready: SIP %s on %s:%d, RTP %s:%d-%d, HTTP %s, Redis %s stream %s, model %s, event loop %s",
            "+".join(s.sip.transports).upper(), s.sip.host, self.frontend.sip_port, s.rtp.host,
            s.rtp.port_min, s.rtp.port_max, self.http.url, redact_url(s.redis.url), s.redis.stream,
            self.choice.name, type(asyncio.get_running_loop()).__module__.split(".")[0],
        )  # fmt: skip
        freeze_startup_heap()

    def _clamp_max_calls(self) -> None:
        """Keep admission below what the engines' device pools hold (`AsrEngine.max_streams`), so that
        a call past it gets 503 + Retry-After rather than an ASR stream that cannot open."""
        s = self.settings
        if self.engine_processes:
            workers = self.pool.alive if self.pool is not None else 0
            limit = admission_limit([e.info.get("max_streams") for e in self.engine_processes], workers)
        else:
            limit = admission_limit([getattr(self.engine, "max_streams", None)], 0)
        if limit is not None and s.sip.max_calls > limit:
            logger.warning(
                "TTG_SIP__MAX_CALLS=%d is more than the ASR engine%s can hold on this device (%d streams): "
                "admitting at most %d (more engine processes hold more: TTG_DAEMON__ENGINES)",
                s.sip.max_calls, "s" if len(self.engine_processes) > 1 else "", limit, limit,
            )  # fmt: skip
            s.sip.max_calls = limit

    async def _start_workers(self) -> Any:
        """The multi-process model: the media workers, fed by the engine process started in main()."""
        import json
        import tempfile
        from dataclasses import asdict

        from gateway import metrics
        from gateway.metrics import PrometheusEngineHooks
        from gateway.rtp.receiver import media_config
        from gateway.workers.legs import WorkerLegs
        from gateway.workers.pool import MediaWorkerPool

        s, engines = self.settings, self.engine_processes
        spec = engines[0].spec
        assert spec is not None and all(e.results is not None for e in engines)
        chunk_ends = worker_chunk_ends([e.front_end_ends() for e in engines])
        n = len(chunk_ends)
        self._tmp = tempfile.TemporaryDirectory(prefix="ttg-serve-")
        spec_file = Path(self._tmp.name) / "frontend.json"
        spec_file.write_text(json.dumps(spec.to_json()))
        self.pool = MediaWorkerPool(
            n,
            spec_file=spec_file,
            chunk_ends=chunk_ends,
            engines=worker_engines(n, len(engines)),
            media_config=asdict(media_config(s.rtp)),
            host=s.rtp.host,
            port_min=s.rtp.port_min,
            port_max=s.rtp.port_max,
            quarantine_s=s.rtp.port_quarantine_s,
            intake_tick_s=s.rtp.intake_tick_ms / 1000,
            log_level=s.log.level,
            uvloop=s.daemon.uvloop,
        )
        t0 = time.monotonic()
        try:
            await self.pool.start()
        except (RuntimeError, OSError, ValueError) as e:
            raise StartupError(f"the media workers did not start: {e}", EXIT_FAILURE) from None
        for engine in engines:  # a worker that dies now closes its channel: the engine sees it
            engine.handed_over()
        self.legs = WorkerLegs(self.pool, spec, PrometheusEngineHooks())
        self.pool.on_worker_died = self._worker_died
        loop = asyncio.get_running_loop()
        for i, engine in enumerate(engines):
            loop.add_reader(engine.results.fileno(), self._engine_results, i)
            loop.add_reader(engine.control_fileno, self._engine_control, i)
        metrics.MEDIA_WORKERS.set(n)
        metrics.ENGINES_UP.set(len(engines))
        first = engines[0]
        logger.info(
            "%d media workers up in %.1f s (RTP %s); ASR engine process%s %s (%s on %s): %s decoding, "
            "max batch %d",
            n, time.monotonic() - t0, ", ".join(f"{lo}-{hi}" for lo, hi in self.pool.slices),
            "es" if len(engines) > 1 else "", ", ".join(str(e.pid) for e in engines),
            first.info.get("precision"), first.info.get("device"), first.config.decoder.mode,
            first.config.scheduler.max_batch,
        )  # fmt: skip
        return self.legs

    def _engine_results(self, i: int) -> None:
        try:
            self.legs.on_results(self.engine_processes[i].read_results(), engine=i)
        except Exception:
            logger.exception("reading the results of engine %d failed", i)

    def _engine_control(self, i: int) -> None:
        from gateway import metrics

        engine = self.engine_processes[i]
        alive = engine.poll_control()
        if alive and engine.failure is None:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(engine.control_fileno)
        if not alive:
            with contextlib.suppress(ValueError, OSError):
                self._engine_results(i)  # what it published before it went
                loop.remove_reader(engine.results.fileno())
        if self._engine_stopping or self.readiness.engine_failed:
            return
        metrics.ENGINE_FAILURES.inc()
        error = engine.failure or "the engine process is gone"
        others_up = len(self.engine_processes) - len(self._engines_down | {i})
        if self.new_engine is not None and others_up > 0 and not self._stop.is_set():
            self._engine_down(i, error, replace=self._budget.allow(("engine", i), time.monotonic()))
            return
        if not alive:
            self.legs.engine_died(error)
        self._engine_failed(RuntimeError(error))

    @property
    def _engines_up(self) -> int:
        return len(self.engine_processes) - len(self._engines_down)

    def _start_replacement(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a replacement (of an engine or a media worker); shutdown cancels and awaits it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    def _workers_of(self, i: int) -> list[int]:
        """The media workers that feed engine i (worker w feeds engine w mod N)."""
        return list(range(i, self.pool.n, len(self.engine_processes)))

    def _engine_down(self, i: int, error: str, *, replace: bool) -> None:
        """Engine i failed while others run: its workers take no new calls, the calls on them end as
        errors (the text decoded so far is already out), and a replacement starts unless this engine
        used up its replacements (`RestartBudget`): then the others go on without it."""
        from gateway import metrics

        workers = self._workers_of(i)
        self._engines_down.add(i)
        up = self._engines_up
        metrics.ENGINES_UP.set(up)
        self.pool.suspend(workers)
        budget = f"it failed {REPLACEMENTS_PER_WINDOW} times within {REPLACEMENT_WINDOW_S:.0f} s"
        logger.critical(
            "ASR engine %d (process %s) failed (%s): the calls of media workers %s end as errors, "
            "the other %d engine%s go on; %s",
            i, self.engine_processes[i].pid, error, ",".join(map(str, workers)), up, "s" if up != 1 else "",
            "replacing it" if replace else f"not replacing it: {budget}",
        )  # fmt: skip
        self.legs.engine_died(error, engine=i, workers=workers)
        if replace:
            self._start_replacement(self._replace_engine(i, workers))

    async def _replace_engine(self, i: int, workers: list[int]) -> None:
        """Engine i and its media workers, anew: the failed process goes, a new one loads the model
        (seconds on a CPU; on a GPU tens of seconds, its kernels being cached by then), fresh workers
        take their port slices and the new channel's ends, and the workers take calls again."""
        from asr_core.errors import EngineStoppedError
        from gateway import metrics

        old = self.engine_processes[i]
        await asyncio.to_thread(old.kill)
        with contextlib.suppress(ValueError, OSError):  # still registered if it failed alive
            self._engine_results(i)
            asyncio.get_running_loop().remove_reader(old.results.fileno())
        old.close()
        left = await self.pool.drained(workers, ENGINE_REPLACE_DRAIN_S)
        if left:
            logger.warning("engine %d: %d legs still open after %.0f s; their workers stop anyway",
                           i, left, ENGINE_REPLACE_DRAIN_S)  # fmt: skip
        if self._stop.is_set():
            return
        assert self.new_engine is not None
        engine = self.new_engine(i)
        t0 = time.monotonic()
        start = asyncio.ensure_future(asyncio.to_thread(engine.start, ENGINE_START_TIMEOUT_S))
        try:
            await asyncio.shield(start)
            await self.pool.replace(workers, engine.front_end_ends())
        except asyncio.CancelledError:  # the gateway stops: a start under way ends once the process is gone
            await asyncio.to_thread(engine.kill)
            with contextlib.suppress(Exception):
                await start
            engine.close()
            raise
        except (EngineStoppedError, RuntimeError, OSError) as e:
            await asyncio.to_thread(engine.kill)
            engine.close()
            logger.critical("ASR engine %d could not be replaced: %s", i, e)
            if self._engines_up == 0:
                self._engine_failed(RuntimeError(f"no ASR engine is up: {e}"))
            return
        engine.handed_over()
        self.engine_processes[i] = engine
        loop = asyncio.get_running_loop()
        loop.add_reader(engine.results.fileno(), self._engine_results, i)
        loop.add_reader(engine.control_fileno, self._engine_control, i)
        self._engines_down.discard(i)
        self.pool.resume(workers)
        metrics.ENGINES_UP.set(self._engines_up)
        metrics.MEDIA_WORKERS.set(self.pool.alive)
        logger.info(
            "ASR engine %d replaced by process %s in %.1f s, with media workers %s: %d of %d engines up",
            i, engine.pid, time.monotonic() - t0, ",".join(map(str, workers)),
            self._engines_up, len(self.engine_processes),
        )  # fmt: skip

    def _worker_died(self, index: int, legs: list[str]) -> None:
        """A media worker is gone: its calls end as errors (WorkerLegs); the others go on, and a fresh
        worker takes its place with a new channel into its engine. With none left no call can be taken:
        exit non-zero so that the supervisor starts a fresh gateway."""
        from gateway import metrics

        metrics.MEDIA_WORKERS.set(self.pool.alive)
        self.legs.worker_died(index, legs)
        if self.pool.alive == 0 and not self._stop.is_set():
            logger.critical("every media worker died: exiting with status %d", EXIT_FAILURE)
            self.exit_code = EXIT_FAILURE
            self._hurry = True
            self._stop.set()
            return
        engine = index % len(self.engine_processes)
        if self._stop.is_set() or engine in self._engines_down:
            return  # an engine being replaced brings its workers back with it
        if not self._budget.allow(("worker", index), time.monotonic()):
            logger.critical(
                "media worker %d died %d times within %.0f s: not replacing it; the others go on",
                index, REPLACEMENTS_PER_WINDOW, REPLACEMENT_WINDOW_S,
            )  # fmt: skip
            return
        self._start_replacement(self._replace_worker(index, engine))

    async def _replace_worker(self, index: int, k: int) -> None:
        """Media worker `index` anew, with a new chunk channel into its running engine k."""
        from gateway import metrics

        engine = self.engine_processes[k]
        t0 = time.monotonic()
        try:
            end = engine.add_front_end()
            await self.pool.replace([index], [end])
        except (OSError, RuntimeError) as e:
            logger.error("media worker %d could not be replaced: %s", index, e)
            return
        finally:
            engine.handed_over()
        self.pool.resume([index])
        metrics.MEDIA_WORKERS.set(self.pool.alive)
        logger.info("media worker %d replaced by process %s in %.1f s", index,
                    self.pool.workers[index].proc.pid, time.monotonic() - t0)  # fmt: skip

    async def _watch_engine(self) -> None:
        """The engine's lag -> admission (503 while far behind), /readyz and the metrics."""
        from gateway import metrics

        while True:
            await asyncio.sleep(STATUS_PERIOD_S)
            if self.legs is not None:
                status = self.legs.status
                for k in range(len(self.engine_processes)):
                    metrics.set_engine_status(str(k), self.legs.engine_status(k))
            elif self.engine is not None and hasattr(self.engine, "status"):
                status = self.engine.status()
                metrics.set_engine_status("0", status)
            else:
                continue
            lag, self.engine_load = float(status.get("lag_s", 0.0)), float(status.get("load", 0.0))
            metrics.ENGINE_LAG.set(lag)
            metrics.ENGINE_LOAD.set(self.engine_load)
            if self.frontend is not None and self.call_limit is not None:
                streams = self.frontend.agent.active_streams
                self.call_limit.update(lag, streams, time.monotonic(), self.engine_load)
                metrics.CALL_LIMIT.set(self.call_limit.limit)
            if self.overload.update(lag, time.monotonic()):
                metrics.ENGINE_OVERLOADED.set(1 if self.overload.overloaded else 0)
                if self.overload.overloaded:
                    self.readiness.engine_behind = f"ASR engine behind (lag {lag:.1f} s): new calls get 503"
                    logger.warning(
                        "ASR engine %.1f s behind (bound %.1f s): new calls get 503 + Retry-After %d s",
                        lag, self.overload.max_lag_s, self.overload.retry_after_s,
                    )  # fmt: skip
                else:
                    self.readiness.engine_behind = ""
                    logger.info("ASR engine caught up (lag %.2f s): taking new calls again", lag)

    async def _check_redis(self) -> None:
        """Say at startup whether Redis answers (the sink itself only notices with the first event)."""
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        s = self.settings
        client = aioredis.Redis.from_url(
            s.redis.url,
            socket_timeout=s.redis.socket_timeout_s,
            socket_connect_timeout=s.redis.connect_timeout_s,
        )
        try:
            await client.ping()
        except (RedisError, OSError) as e:
            logger.warning(
                "Redis at %s does not answer (%s): starting anyway; events wait in memory, then in the "
                "spool (%s), and go out when it is back",
                redact_url(s.redis.url), e, s.sink.spool_dir,
            )  # fmt: skip
        finally:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    async def _until_forced(self, aw: Awaitable[Any], forced_limit_s: float) -> None:
        """Await `aw`; once a forcing signal comes, give it at most `forced_limit_s` more."""
        task = asyncio.ensure_future(aw)
        force = asyncio.create_task(self._force.wait())
        try:
            await asyncio.wait({task, force}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                done, _ = await asyncio.wait({task}, timeout=forced_limit_s)
                if not done:
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            force.cancel()

    async def _shutdown(self) -> None:
        s = self.settings
        self.readiness.draining = True
        t0 = time.monotonic()
        if self.frontend is not None:
            self.frontend.stop_admitting()
            live = self.frontend.active_calls
            grace = ENGINE_FAILURE_GRACE_S if self._hurry else s.daemon.shutdown_grace_s
            if live and not self._force.is_set():
                logger.info(
                    "draining: %d calls may go on for up to %.0f s (a second signal hangs them up now)",
                    live, grace,
                )  # fmt: skip
                await self._until_forced(self.frontend.drain(grace), 0.0)
            live = self.frontend.active_calls
            if live:
                logger.info("hanging up %d calls (BYE, Reason: shutdown) and waiting for their finals", live)
            hangup_s = FORCED_HANGUP_S if self._force.is_set() else s.daemon.hangup_timeout_s
            await self._until_forced(self.frontend.close(hangup_s), FORCED_HANGUP_S)
        if self.sink is not None:
            flush_s = FORCED_FLUSH_S if self._force.is_set() else s.sink.flush_timeout_s
            try:
                await self.sink.close(flush_s)
            except Exception:
                logger.exception("closing the sink failed")
        if self.http is not None:
            await self.http.stop()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._replacing):  # a replacement engine starting goes with it
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        if self.pool is not None:
            await self.pool.stop()
        if self.engine is not None:
            try:
                await asyncio.to_thread(self.engine.shutdown, drain=True, timeout=ENGINE_SHUTDOWN_S)
            except Exception:
                logger.exception("engine shutdown failed")
        if self.engine_processes:
            await self._stop_engine_processes()
        if self._tmp is not None:
            self._tmp.cleanup()
        logger.info("stopped in %.1f s (exit status %d)", time.monotonic() - t0, self.exit_code)

    async def _stop_engine_processes(self) -> None:
        self._engine_stopping = True
        loop = asyncio.get_running_loop()
        for engine in self.engine_processes:
            for fd in (
                engine.control_fileno,
                engine.results.fileno() if engine.results is not None else None,
            ):
                if fd is not None:
                    with contextlib.suppress(ValueError, OSError):
                        loop.remove_reader(fd)

        def stop(engine: Any) -> int:
            code = int(engine.shutdown(drain=True, timeout=ENGINE_SHUTDOWN_S))
            engine.close()
            return code

        codes = await asyncio.gather(*(asyncio.to_thread(stop, e) for e in self.engine_processes))
        for k, (engine, code) in enumerate(zip(self.engine_processes, codes, strict=True)):
            if code != 0 and not self.readiness.engine_failed and k not in self._engines_down:
                logger.error("the engine process %s exited with status %d", engine.pid, code)
                self.exit_code = EXIT_FAILURE


class RestartBudget:
    """How many times a process may be replaced: `limit` within any `window_s` (pure; `now` given)."""

    def __init__(self, limit: int = REPLACEMENTS_PER_WINDOW, window_s: float = REPLACEMENT_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: dict[object, list[float]] = {}

    def allow(self, who: object, now: float) -> bool:
        """Whether `who` may be replaced now; a yes counts."""
        recent = [t for t in self._times.get(who, []) if now - t < self.window_s]
        if len(recent) >= self.limit:
            self._times[who] = recent
            return False
        self._times[who] = [*recent, now]
        return True


def admission_limit(engine_limits: Sequence[int | None], workers: int) -> int | None:
    """The most calls the engines can hold (None: no limit): the sum of their stream limits, less one per
    media worker (legs are spread evenly over the engines that take them, but while an engine's workers
    are suspended the others take its share, so one may hold more than its part)."""
    if not engine_limits or any(x is None for x in engine_limits):
        return None
    return max(1, sum(x for x in engine_limits if x is not None) - workers)


def worker_chunk_ends(per_engine: Sequence[Sequence[Any]]) -> list[Any]:
    """Media worker i's chunk channel: its engine's (`worker_engines`) (i div N)-th front-end end."""
    n = len(per_engine)
    total = sum(len(ends) for ends in per_engine)
    return [per_engine[e][i // n] for i, e in enumerate(worker_engines(total, n))]


def worker_engines(workers: int, engines: int) -> list[int]:
    """The engine process each media worker feeds: worker i feeds engine i mod N (`worker_chunk_ends`)."""
    return [i % engines for i in range(workers)]


def engine_front_ends(workers: int, engines: int) -> list[int]:
    """How many media workers feed each engine process."""
    feeds = worker_engines(workers, engines)
    return [feeds.count(k) for k in range(engines)]


# --- entry point -------------------------------------------------------------------------------------


def _run_loop(coro_fn: Callable[[], Awaitable[int]], use_uvloop: bool) -> int:
    loop_factory = None
    if use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            logger.info("uvloop is not installed: using the standard asyncio event loop")
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro_fn())  # type: ignore[arg-type]


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except StartupError as e:
        print(f"ttg serve: {e}", file=sys.stderr)
        return e.code
    configure_logging(log_level(settings.log.level) or logging.INFO)
    findings = check_settings(settings)
    for f in findings:
        if f.level >= logging.ERROR:
            print(f"ttg serve: {f.message}", file=sys.stderr)
            return EXIT_CONFIG
        logger.log(f.level, "%s", f.message)
    workers = resolve_media_workers(settings.daemon.media_workers, os.cpu_count())
    if workers > 0:
        return _main_with_workers(settings, workers)
    try:
        choice = choose_model(settings)
        t0 = time.monotonic()
        model = load_model(settings, choice)
    except StartupError as e:
        print(f"ttg serve: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # Ctrl-C while the model loads: nothing to shut down yet
        print("ttg serve: interrupted while loading the model", file=sys.stderr)
        return 130
    logger.info("model %s loaded from %s in %.1f s", choice.name, choice.dir, time.monotonic() - t0)
    daemon = Daemon(settings, model, choice)
    code = _run_loop(daemon.run, settings.daemon.uvloop)
    # The engine's MLX thread released its own device state and streams when it stopped; this thread
    # loaded the weights, so it ends its MLX streams too before the interpreter (and with it the CUDA
    # runtime) goes away.
    del daemon, model
    from asr_core.model import release_mlx_thread

    release_mlx_thread()
    return code


def _main_with_workers(settings: Settings, workers: int) -> int:
    """The multi-process model: the engine process loads the model and starts before anything here is
    bound (a bad bundle still ends the process with status 2 and one line), then the daemon."""
    from asr_core.accelerator import AcceleratorProbeError, probe, profile
    from gateway.cuda_mps import MpsError, start_for_engines

    try:
        choice = choose_model(settings)
    except StartupError as e:
        print(f"ttg serve: {e}", file=sys.stderr)
        return e.code
    # Before any engine (and the MPS server they would run through) starts: the "auto" settings follow
    # the device, which only a process that loads MLX can see.
    try:
        accelerator = probe()
    except AcceleratorProbeError as e:
        print(f"ttg serve: {e}", file=sys.stderr)
        return EXIT_FAILURE
    # At most one engine per media worker (each worker feeds one engine): said only where the operator
    # asked for more, the auto count just fits the workers there are.
    n_engines = min(settings.daemon.engines or profile(accelerator).engines, workers)
    if settings.daemon.engines > workers:
        logger.warning(
            "TTG_DAEMON__ENGINES=%d but %d media workers: running %d engine processes",
            settings.daemon.engines, workers, n_engines,
        )  # fmt: skip
    try:
        mps, mps_note = start_for_engines(settings.daemon.cuda_mps, n_engines)
    except MpsError as e:
        print(f"ttg serve: {e}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        return _run_engines_and_daemon(settings, workers, choice, n_engines, accelerator, mps, mps_note)
    finally:
        if mps is not None:  # a start that failed: after the engines went (the daemon waits for them)
            mps.stop()


def _run_engines_and_daemon(
    settings: Settings,
    workers: int,
    choice: ModelChoice,
    n_engines: int,
    accelerator: Accelerator,
    mps: MpsServer | None,
    mps_note: str | None,
) -> int:
    from asr_core.errors import EngineStoppedError
    from asr_core.remote import EngineProcess
    from gateway import metrics

    engine_env = {**os.environ, **mps.client_env} if mps is not None else None
    engines: list[EngineProcess] = []
    front_ends = engine_front_ends(workers, n_engines)
    with _bundle_view(settings, choice.dir) as (folder, back):

        def new_engine(k: int) -> EngineProcess:
            """Engine process k (of n_engines) of this gateway, not started."""
            return EngineProcess(
                folder,
                settings.model.precision,
                # Legs are spread evenly over the engines (`place_leg`), however many workers feed each.
                engine_config(settings, 1 / n_engines, on=accelerator),
                front_ends=front_ends[k],
                log_level=settings.log.level,
                role="engine" if n_engines == 1 else f"engine_{k}",
                device_share=1 / n_engines,
                switch_interval_ms=settings.daemon.engine_switch_interval_ms,
                env=engine_env,
            )

        try:
            # One after the other: the first compiles what the accelerator needs (kernels go to a disk
            # cache), the others find it there.
            for k in range(n_engines):
                engine = new_engine(k)
                engines.append(engine)
                t0 = time.monotonic()
                engine.start(timeout=ENGINE_START_TIMEOUT_S)
                logger.info(
                    "model %s loaded from %s in %.1f s by the engine process %s (%d of %d)",
                    choice.name, choice.dir, time.monotonic() - t0, engine.pid, k + 1, n_engines,
                )  # fmt: skip
        except EngineStoppedError as e:
            _kill_all(engines)
            kind, message = engines[-1].start_error or ("", str(e))
            if kind == "BundleError":
                print(f"ttg serve: cannot load the model bundle: {back(message)}", file=sys.stderr)
                return EXIT_CONFIG
            print(f"ttg serve: the ASR engine process did not start: {back(message)}", file=sys.stderr)
            return EXIT_FAILURE
        except KeyboardInterrupt:
            _kill_all(engines)
            print("ttg serve: interrupted while loading the model", file=sys.stderr)
            return 130
        # Said once the engines are up: a bundle that does not load stays a one-line error.
        memory = (
            f", {accelerator.memory_limit / 2**30:.1f} GiB for a process" if accelerator.memory_limit else ""
        )
        logger.info("accelerator: %s%s; %d engine process%s", accelerator.kind, memory, n_engines,
                    "es" if n_engines > 1 else "")  # fmt: skip
        if mps_note is not None:
            logger.info("CUDA MPS: %s", mps_note)
        metrics.CUDA_MPS.set(1 if mps is not None else 0)
        daemon = Daemon(settings, None, choice, engine_processes=engines, new_engine=new_engine)
        code = _run_loop(daemon.run, settings.daemon.uvloop)
        if mps is not None:  # after the engines stopped: the control daemon waits for its clients
            logger.info("CUDA MPS: control daemon %s stopped, status %s", mps.pid, mps.stop())
        return code


def _kill_all(engines: Sequence[Any]) -> None:
    """A start that failed half-way: the engine processes started so far go, with their channels."""
    for engine in engines:
        engine.kill()
        engine.close()
