"""The replay run: places calls by the load shape, streams each call's audio, reads the events back,
and builds the report. `run_replay(config) -> Report` is the in-process API (tests, scripts);
`run_replay_async` is the same inside a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import random
import secrets
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.replay import audio, plots, report, sdp, siprec
from tools.replay.analysis import ReceivedEvent, Stats, UtteranceTiming
from tools.replay.config import ReplayConfig
from tools.replay.events import EventReader
from tools.replay.load import LoadShape
from tools.replay.net import Pacer, RtpPortPool, RtpSocket, SipEndpoint
from tools.replay.progress import LiveView, Snapshot
from tools.replay.rtp import LatenessHistogram, RtpStream
from tools.replay.scrape import MetricsScraper, batch_series
from tools.replay.uac import Answered, Ended, Failed, Output, Provisional, Rejected, UacCall, UacParams

logger = logging.getLogger(__name__)

now = time.monotonic


class ReplayError(Exception):
    """The run could not start (audio, Redis, SIP socket); the message says what to fix."""


def languages(cfg: ReplayConfig) -> Iterator[str]:
    """The call languages in order, by smooth weighted round robin (see LanguageMix.assign)."""
    batch = 1000
    while True:
        yield from cfg.lang.assign(batch)


@dataclass(eq=False)
class _LegRecord:
    """One audio stream of a call: a plain call has one; a SIPREC call one per recorded party."""

    clips: list[audio.AudioClip]
    name: str = ""  # SIPREC: the leg name the gateway should give it ("" = the call's only leg)
    label: str = ""
    sock: RtpSocket | None = None
    stream: RtpStream | None = None


@dataclass(eq=False)
class _CallRecord:
    index: int
    sip_call_id: str
    lang: str
    legs: list[_LegRecord]
    vendor: str = ""  # SIPREC: the SRC whose offers this call's INVITE is shaped like
    outcome: str = "pending"
    detail: str = ""
    status: int | None = None
    retry_after_s: float | None = None
    setup_s: float | None = None
    codec: str = ""
    ptime_ms: int = 0
    uac: UacCall | None = None
    stop: asyncio.Future[None] | None = None
    provisional: list[int] = field(default_factory=list)

    def finish(self, outcome: str, detail: str = "") -> None:
        if self.outcome == "pending":
            self.outcome = outcome
            self.detail = detail


class _CallSignals:
    """Turns the UAC's events into two futures the call task awaits."""

    def __init__(self, rec: _CallRecord) -> None:
        loop = asyncio.get_running_loop()
        self.rec = rec
        self.setup: asyncio.Future[Answered | Rejected | Failed] = loop.create_future()
        self.ended: asyncio.Future[Ended | Failed] = loop.create_future()

    def __call__(self, events: list[Output]) -> None:
        for ev in events:
            if isinstance(ev, Provisional):
                self.rec.provisional.append(ev.status)
            elif isinstance(ev, Answered | Rejected):
                if not self.setup.done():
                    self.setup.set_result(ev)
            elif isinstance(ev, Failed):
                if not self.setup.done():
                    self.setup.set_result(ev)
                elif not self.ended.done():
                    self.ended.set_result(ev)
            elif isinstance(ev, Ended) and not self.ended.done():
                self.ended.set_result(ev)


class _Run:
    def __init__(self, cfg: ReplayConfig, library: audio.AudioLibrary) -> None:
        self.cfg = cfg
        self.library = library
        self.picker = audio.ClipPicker(library)
        self.langs = languages(cfg)
        self.prefix = cfg.call_id_prefix or f"ttg-replay-{secrets.token_hex(4)}"
        self.sip = SipEndpoint(cfg.transport, cfg.local_ip, cfg.sip_port, cfg.target)
        self.ports = RtpPortPool(cfg.local_ip, cfg.rtp_port_min, cfg.rtp_port_max)
        self.pacer = Pacer()
        self.reader = EventReader(cfg.redis_url, cfg.stream, now) if cfg.redis_url else None
        self.scraper = (
            MetricsScraper(cfg.metrics_url, cfg.scrape_interval_s, now) if cfg.metrics_url else None
        )
        self.records: list[_CallRecord] = []
        self.lateness = LatenessHistogram()  # every call's packets, one histogram
        self.active = 0
        self.peak_active = 0
        self._changed = asyncio.Event()
        self._stopping = False
        self._stop_all: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.concurrency: list[tuple[float, int]] = []
        self.t_start = now()

    def request_stop(self) -> None:
        """Stop placing calls and hang up the ones that are up (Ctrl-C); the report is still written."""
        if not self._stopping:
            logger.warning("stopping: hanging up %d active calls", self.active)
            self._stopping = True
            self._changed.set()
            if not self._stop_all.done():
                self._stop_all.set_result(None)

    # --- one call ---
    async def _call(self, rec: _CallRecord) -> None:
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        self.concurrency.append((now() - self.t_start, self.active))
        try:
            await self._call_inner(rec)
        except Exception as exc:  # a harness bug must fail one call, not the run
            logger.exception("call %s: unexpected error", rec.sip_call_id)
            rec.finish("failed", f"replay error: {exc!r}")
        finally:
            for leg in rec.legs:
                if leg.sock is not None:
                    leg.sock.close()
            self.active -= 1
            self.concurrency.append((now() - self.t_start, self.active))
            self._changed.set()
            if rec.outcome == "pending":
                rec.finish("failed", "no outcome")

    async def _call_inner(self, rec: _CallRecord) -> None:
        cfg = self.cfg
        try:
            for leg in rec.legs:
                leg.sock = self.ports.open()
        except OSError as exc:
            rec.finish("failed", f"no RTP port: {exc}")
            return
        ports = [leg.sock.port for leg in rec.legs if leg.sock is not None]
        headers = (*cfg.headers, (cfg.lang_header, rec.lang)) if cfg.lang_header else cfg.headers
        content_type, contact_params = "application/sdp", ""
        if rec.vendor:
            recording = siprec.build_offer(
                rec.vendor, index=rec.index, ip=cfg.local_ip, ports=ports, session_id=1000 + rec.index
            )
            for leg, recorded in zip(rec.legs, recording.legs, strict=True):
                leg.name, leg.label = recorded.expected_leg, recorded.label
            body, content_type = recording.body, recording.content_type
            # RFC 7866: an SRC requires the siprec extension and marks its Contact with +sip.src.
            headers = (*headers, ("Require", "siprec"), *recording.headers)
            contact_params = ";+sip.src"
        else:
            body = sdp.build_offer(
                cfg.local_ip, ports[0], cfg.media.codec, cfg.media.ptime_ms, 1000 + rec.index, cfg.from_user
            )
        host, port = cfg.target
        hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        uac = UacCall(
            UacParams(
                call_id=rec.sip_call_id,
                local_host=cfg.local_ip,
                local_port=self.sip.local_port,
                transport=cfg.transport.upper(),
                request_uri=f"sip:{cfg.to_user}@{hostport}",
                from_uri=f"sip:{cfg.from_user}@{cfg.local_ip}",
                to_uri=f"sip:{cfg.to_user}@{hostport}",
                sdp_offer=body,
                contact_user=cfg.from_user,
                content_type=content_type,
                contact_params=contact_params,
                extra_headers=headers,
                t1_s=cfg.t1_s,
                t2_s=cfg.t2_s,
                setup_timeout_s=cfg.setup_timeout_s,
            )
        )
        rec.uac = uac
        signals = _CallSignals(rec)
        self.sip.add(uac, signals)
        if self.reader is not None:
            self.reader.watch(rec.sip_call_id)
        self.sip.start(uac)

        waiting: set[asyncio.Future[Any]] = {signals.setup, self._stop_all}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not signals.setup.done():  # stopped while ringing: CANCEL (or wait for a provisional first)
            self.sip.hangup(uac)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(signals.setup), 64 * cfg.t1_s + 1)
            if not signals.setup.done() or not isinstance(signals.setup.result(), Answered):
                rec.finish("stopped", "stopped before answer")
                return
        setup = signals.setup.result()
        if isinstance(setup, Rejected):
            rec.status, rec.retry_after_s = setup.status, setup.retry_after_s
            rec.finish("rejected", setup.reason)
            return
        if isinstance(setup, Failed):
            rec.status = uac.final_status
            rec.finish("failed", setup.reason)
            return
        rec.status = uac.final_status
        rec.setup_s = setup.setup_s
        try:
            answers = self._answers(rec, setup.sdp)
        except sdp.SdpError as exc:
            rec.finish("failed", f"unusable SDP answer: {exc}")
            await self._hangup(uac, signals)
            return
        first = answers[0]
        ptime = first.ptime_ms if first.ptime_ms in (10, 20, 30, 40, 50, 60) else cfg.media.ptime_ms
        rec.codec, rec.ptime_ms = first.codec, ptime
        flows = []
        last = len(rec.legs) - 1
        for i, (leg, answer) in enumerate(zip(rec.legs, answers, strict=True)):
            # SIPREC: the parties take turns (a later leg starts later); every leg ends with the same tail.
            offset = i * cfg.leg_offset_ms
            tail = cfg.media.tail_ms + (last - i) * cfg.leg_offset_ms
            plan = audio.plan_call(leg.clips, ptime, cfg.media.lead_ms + offset, cfg.media.gap_ms, tail)
            leg.stream = RtpStream(
                plan, answer.codec, answer.payload_type, now(), ptime, cfg.impairments,
                random.Random(cfg.seed * 1_000_003 + rec.index * 16 + i), self.lateness,
            )  # fmt: skip
            assert leg.sock is not None
            try:
                leg.sock.connect((answer.host, answer.port))
            except OSError as exc:
                rec.finish("failed", f"cannot send RTP to {answer.host}:{answer.port}: {exc}")
                await self._hangup(uac, signals)
                return
            flows.append(self.pacer.add(leg.stream, leg.sock))
        all_sent = asyncio.ensure_future(asyncio.gather(*(flow.done for flow in flows)))
        waiting = {all_sent, signals.ended, self._stop_all}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        stopped = not all_sent.done()
        for flow in flows:
            self.pacer.stop(flow)
        if not all_sent.done():
            all_sent.cancel()
        if signals.ended.done():
            rec.finish("failed", f"call ended before its audio did ({signals.ended.result().reason})")
            return
        ended_reason = await self._hangup(uac, signals)
        if stopped:
            rec.finish("stopped", "stopped by the operator")
        elif ended_reason == "bye":
            rec.finish("completed", "bye")
        else:
            rec.finish("failed", ended_reason)

    @staticmethod
    def _answers(rec: _CallRecord, body: bytes) -> list[sdp.MediaAnswer]:
        """What to send on each leg, from the answer's m-lines in offer order (RFC 3264 §6)."""
        answers = sdp.parse_answers(body)
        if len(answers) < len(rec.legs):
            raise sdp.SdpError(f"{len(answers)} audio m-line(s) for {len(rec.legs)} offered")
        out = []
        for leg, answer in zip(rec.legs, answers, strict=False):
            if isinstance(answer, sdp.SdpError):
                raise answer
            if leg.label and answer.label != leg.label:
                # RFC 7866: the SRS echoes each stream's a=label in its answer.
                raise sdp.SdpError(f"m-line labelled {leg.label!r} answered with label {answer.label!r}")
            out.append(answer)
        return out

    async def _hangup(self, uac: UacCall, signals: _CallSignals) -> str:
        self.sip.hangup(uac)
        try:
            ended = await asyncio.wait_for(asyncio.shield(signals.ended), 64 * self.cfg.t1_s + 1)
        except TimeoutError:
            return "no answer to BYE"
        return ended.reason

    # --- the run ---
    async def _progress(self, view: LiveView | None) -> None:
        last_t, last_n = now(), self.pacer.packets_sent
        while True:
            await asyncio.sleep(0.5)
            t = now()
            self.concurrency.append((t - self.t_start, self.active))
            if view is None:
                continue
            pps = (self.pacer.packets_sent - last_n) / max(t - last_t, 1e-6)
            last_t, last_n = t, self.pacer.packets_sent
            events = [e for evs in (self.reader.events.values() if self.reader else ()) for e in evs]
            setups = [r.setup_s * 1000 for r in self.records if r.setup_s is not None]
            view.update(
                Snapshot(
                    elapsed_s=t - self.t_start,
                    active=self.active,
                    started=len(self.records),
                    total=self.shape.total,
                    completed=sum(r.outcome == "completed" for r in self.records),
                    rejected=sum(r.outcome == "rejected" for r in self.records),
                    failed=sum(r.outcome == "failed" for r in self.records),
                    pps=pps,
                    partials=sum(e.type == "partial" for e in events),
                    finals=sum(e.type == "final" for e in events),
                    setup_p50_ms=statistics.median(setups) if setups else None,
                )
            )

    def _new_call(self) -> asyncio.Task[None]:
        index = len(self.records)
        lang = next(self.langs)
        media = self.cfg.media
        vendor = siprec.vendor_of_call(self.cfg.siprec, index) if self.cfg.siprec else ""
        # Each leg its own speech: consecutive picks of the round robin are different files.
        legs = [
            _LegRecord(self.picker.clips_for_call(lang, media.call_seconds, media.gap_ms))
            for _ in range(siprec.LEGS if vendor else 1)
        ]
        rec = _CallRecord(index, f"{self.prefix}-{index:06d}@{self.cfg.local_ip}", lang, legs, vendor)
        self.records.append(rec)
        return asyncio.create_task(self._call(rec), name=f"call-{index}")

    async def main(self, view: LiveView | None) -> report.Report:
        cfg = self.cfg
        started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        if self.reader is not None:
            try:
                await self.reader.open()
            except Exception as exc:
                raise ReplayError(f"Redis at {cfg.redis_url} is not reachable: {exc}") from exc
        try:
            await self.sip.open()
        except OSError as exc:
            if self.reader is not None:
                await self.reader.close()
            raise ReplayError(f"cannot open the SIP {cfg.transport} socket to {cfg.target}: {exc}") from exc
        cpu0, wall0 = time.process_time(), now()
        self.t_start = wall0
        self.shape = LoadShape(cfg.load, wall0)
        background = [asyncio.create_task(self.pacer.run(), name="pacer")]
        reader_task = asyncio.create_task(self.reader.run(), name="redis-reader") if self.reader else None
        if self.scraper is not None:
            background.append(asyncio.create_task(self.scraper.run(), name="metrics-scraper"))
        background.append(asyncio.create_task(self._progress(view), name="progress"))
        calls: list[asyncio.Task[None]] = []
        try:
            while not self._stopping:
                t = now()
                calls += [self._new_call() for _ in range(self.shape.due(t, self.active))]
                if not self.shape.accepting(t):
                    break
                deadline = self.shape.next_deadline(t, self.active)
                self._changed.clear()
                timeout = None if deadline is None else max(0.0, deadline - now())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout)
            if calls:
                await asyncio.wait(calls)
            await self._drain()
            if self.scraper is not None:
                import aiohttp

                async with aiohttp.ClientSession() as session:
                    await self.scraper.scrape_once(session)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            for task in calls:
                task.cancel()
            self.sip.close()
            if self.reader is not None and reader_task is not None:
                await self.reader.stop(reader_task)
                await self.reader.close()
        wall, cpu = now() - wall0, time.process_time() - cpu0
        return self._report(started_at, wall, cpu)

    async def _drain(self) -> None:
        """Wait (up to drain_s in all) for the call_end event of every answered call."""
        if self.reader is None:
            return
        deadline = now() + self.cfg.drain_s
        for rec in self.records:
            if rec.setup_s is None:
                continue
            remaining = deadline - now()
            if remaining <= 0:
                break
            await self.reader.wait_call_end(rec.sip_call_id, remaining)

    # --- the report ---
    def _call_results(self, rec: _CallRecord) -> list[report.CallResult]:
        """One result per leg (a plain call has one), each with its own media and transcripts."""
        events = self.reader.events.get(rec.sip_call_id, []) if self.reader is not None else []
        expected = {leg.name for leg in rec.legs}
        strays = sum(
            1
            for e in events
            if e.type in ("partial", "final", "dtmf") and e.fields.get("leg") not in expected
        )
        return [
            self._leg_result(rec, leg, events, strays if i == 0 and rec.vendor else 0)
            for i, leg in enumerate(rec.legs)
        ]

    def _leg_result(
        self, rec: _CallRecord, leg: _LegRecord, events: list[ReceivedEvent], strays: int
    ) -> report.CallResult:
        stream, sock, uac = leg.stream, leg.sock, rec.uac
        kwargs: dict[str, Any] = {}
        if stream is not None:
            imp = stream.impairer
            kwargs.update(
                media_s=stream.k * stream.ptime_s,
                rtp_planned=stream.n_packets,
                rtp_sent=stream.sent,
                rtp_lost_impairment=imp.lost,
                rtp_duplicated_impairment=imp.duplicated,
                rtp_reordered_impairment=imp.reordered,
                send_jitter_ms=stream.jitter_s * 1000,
                send_lateness_max_ms=stream.lateness_max_s * 1000,
            )
            timings = [
                UtteranceTiming(u.start_ms, u.end_ms, m.start_t, m.end_t, u.sentence)
                for u, m in zip(stream.plan.utterances, stream.marks, strict=True)
            ]
            reference = stream.plan.reference if stream.done else None  # WER only over whole files
        else:
            timings, reference = [], None
        if sock is not None:
            kwargs.update(
                rtp_send_errors=sock.send_errors, rtp_echoed=sock.received, rtcp_received=sock.rtcp_received
            )
        if uac is not None:
            kwargs.update(invite_retransmits=uac.invite_retransmits, bye_retransmits=uac.bye_retransmits)
        if self.reader is not None and rec.setup_s is not None:
            kwargs.update(report.transcript_results(timings, events, reference, leg=leg.name))
        elif timings:
            kwargs["utterances"] = tuple(
                report.analysis.UtteranceResult(t.start_ms, t.end_ms, None, None, 0, t.sentence)
                for t in timings
            )
        return report.CallResult(
            index=rec.index,
            sip_call_id=rec.sip_call_id,
            lang=rec.lang,
            clips=tuple(c.name for c in leg.clips),
            outcome=rec.outcome,
            detail=rec.detail,
            status=rec.status,
            retry_after_s=rec.retry_after_s,
            setup_s=rec.setup_s,
            codec=rec.codec,
            ptime_ms=rec.ptime_ms,
            leg=leg.name,
            vendor=rec.vendor,
            label=leg.label,
            events_on_other_legs=strays,
            **kwargs,
        )

    def _report(self, started_at: str, wall: float, cpu: float) -> report.Report:
        results = tuple(result for r in self.records for result in self._call_results(r))
        lateness = self.lateness
        jitters = [flow.stream.jitter_s * 1000 for flow in self.pacer.flows]
        lat = Stats(
            n=lateness.n,
            mean=1000 * lateness.total_s / lateness.n if lateness.n else None,
            p50=1000 * lateness.quantile(0.5),
            p95=1000 * lateness.quantile(0.95),
            p99=1000 * lateness.quantile(0.99),
            min=None,
            max=1000 * lateness.max_s,
        )
        loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
        harness = report.HarnessStats(
            wall_s=wall,
            cpu_s=cpu,
            cpu_percent=100.0 * cpu / wall if wall > 0 else 0.0,
            packets_sent=self.pacer.packets_sent,
            packets_per_s=self.pacer.packets_sent / wall if wall > 0 else 0.0,
            send_lateness_ms=lat,
            send_jitter_ms_mean=statistics.fmean(jitters) if jitters else 0.0,
            send_jitter_ms_max=max(jitters, default=0.0),
            sip_sent=self.sip.sent,
            sip_received=self.sip.received,
            sip_parse_errors=self.sip.parse_errors,
            sip_stray=self.sip.stray,
            sip_transport_errors=self.sip.transport_errors,
            redis_entries_read=self.reader.entries_read if self.reader else 0,
            redis_errors=self.reader.errors if self.reader else 0,
            scrape_errors=self.scraper.errors if self.scraper else 0,
            event_loop=loop_name,
        )
        return report.Report(
            config=config_dict(self.cfg),
            started_at=started_at,
            summary=report.summarize(results, self.peak_active, readback=self.reader is not None),
            harness=harness,
            calls=results,
            batch_series=tuple(batch_series(self.scraper.scrapes, self.t_start)) if self.scraper else (),
            concurrency_series=tuple(self.concurrency),
        )


def config_dict(cfg: ReplayConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["target"] = f"{cfg.target[0]}:{cfg.target[1]}"
    d["lang"] = str(cfg.lang)
    d["audio_dir"] = str(cfg.audio_dir) if cfg.audio_dir else None
    d["out_dir"] = str(cfg.out_dir) if cfg.out_dir else None
    d["headers"] = [f"{k}: {v}" for k, v in cfg.headers]
    return d


def load_audio(cfg: ReplayConfig) -> audio.AudioLibrary:
    """The run's audio, in memory. Generated files go into `audio_dir` (kept and reused), or into a
    temporary folder that is gone once they are loaded."""
    langs = [lang for lang, _ in cfg.lang.weights]
    try:
        if cfg.audio_dir is None:
            with tempfile.TemporaryDirectory(prefix="ttg-replay-audio-") as tmp:
                audio.generate_espeak(Path(tmp), cfg.generate, langs)
                return audio.load_library(Path(tmp), cfg.media.pause_ms)
        if cfg.generate > 0:
            audio.generate_espeak(cfg.audio_dir, cfg.generate, langs)
        return audio.load_library(cfg.audio_dir, cfg.media.pause_ms)
    except audio.AudioError as exc:
        raise ReplayError(str(exc)) from exc


async def run_replay_async(
    cfg: ReplayConfig,
    library: audio.AudioLibrary | None = None,
    *,
    view: LiveView | None = None,
    on_run: Callable[[Any], None] | None = None,
) -> report.Report:
    """One run against a gateway; writes report files when `cfg.out_dir` is set."""
    if library is None:
        library = await asyncio.to_thread(load_audio, cfg)
    run = _Run(cfg, library)
    if on_run is not None:
        on_run(run)
    result = await run.main(view)
    if cfg.out_dir is not None:
        write_report(result, cfg.out_dir)
    return result


def write_report(result: report.Report, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = []
    if plots.latency_cdf(result, out_dir / "latency_cdf.png"):
        pngs.append("latency_cdf.png")
    if plots.batch_over_time(result, out_dir / "batch_size.png"):
        pngs.append("batch_size.png")
    report.write_json(result, out_dir / "report.json")
    report.write_markdown(result, out_dir / "report.md", pngs)
    return [out_dir / "report.json", out_dir / "report.md", *(out_dir / p for p in pngs)]


def new_loop_runner() -> asyncio.Runner:
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        return asyncio.Runner()


def run_replay(cfg: ReplayConfig, library: audio.AudioLibrary | None = None) -> report.Report:
    """Synchronous entry point: runs on its own event loop (uvloop when installed). Ctrl-C stops
    placing calls, hangs up the active ones and still returns (and writes) the report."""
    with new_loop_runner() as runner:
        return runner.run(_run_with_signals(cfg, library))


async def _run_with_signals(cfg: ReplayConfig, library: audio.AudioLibrary | None) -> report.Report:
    loop = asyncio.get_running_loop()
    holder: list[_Run] = []

    def on_sigint() -> None:
        if holder:
            holder[0].request_stop()

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    try:
        if cfg.progress:
            with LiveView() as view:
                return await run_replay_async(cfg, library, view=view, on_run=holder.append)
        return await run_replay_async(cfg, library, on_run=holder.append)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
