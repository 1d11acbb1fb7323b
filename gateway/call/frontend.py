"""The telephony front end: SIP endpoint + per-call media + ASR stream + event publishing.

`TelephonyFrontEnd` is the composition the daemon runs. For every admitted INVITE it negotiates the
SDP offer (`gateway.sdp`; nothing acceptable → 488), picks the call's language (header → dialed number
map → default), opens the ASR stream, creates the `CallSession` (which publishes call_start), opens the
call's RTP port (the media manager) and answers. SIP call events (ACK, re-INVITE, BYE, CANCEL, no ACK)
and media/ASR events drive the session; when a session says so, the front end sends the BYE or the
error response. It owns one registry of calls keyed by the gateway's call id (= `CallEvent.call_id`).

Lifecycle: `start()` binds SIP; `stop_admitting()` makes new INVITEs get 503 (drain); `drain(timeout)`
waits for calls to end by themselves; `close()` ends the rest (BYE, reason shutdown), waits for their
final transcripts and call_end events (bounded) and for the BYE transactions, then closes the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asr_core.api import AsrEvent, EventCallback, StreamOptions
from asr_core.errors import AsrError
from gateway import metrics
from gateway.addresses import advertised_address, local_ip_toward
from gateway.call.core import AsrStreamLike, CallInfo, CallSession, CallState, SessionInput, SipAction
from gateway.events import EventPublisher
from gateway.rtp.media import MediaSink
from gateway.rtp.ports import PortsExhausted
from gateway.rtp.stats import MediaStats
from gateway.sdp import MediaPlan, Negotiation, SdpAnswerer, SdpError, negotiate, negotiate_answer, parse_sdp
from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import (
    AgentConfig,
    CallAckTimeout,
    CallCancelled,
    CallConfirmed,
    CallEndedByPeer,
    CallOffered,
    CallPhase,
    CallReleased,
    Flow,
    ReofferConfirmed,
    SessionReoffered,
    UserAgent,
)
from gateway.sip.agent import CallEvent as SipCallEvent
from gateway.sip.auth import DigestConfig
from gateway.sip.endpoint import SipEndpoint
from gateway.sip.headers import HeaderSyntaxError, parse_sip_uri, unescape, uri_scheme
from gateway.sip.message import SipRequest
from gateway.sip.transaction import TimerConfig

if TYPE_CHECKING:
    from gateway.config import Settings

logger = logging.getLogger(__name__)

# A language value we pass on: a BCP 47-ish locale ("en-US", "uk-UA", "yue") or "auto".
_LOCALE_RE = re.compile(r"^(auto|[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8}){0,3})$")
MAX_METADATA_HEADERS = 32
MAX_METADATA_VALUE = 512


class StreamOpener(Protocol):
    """What the front end needs of `asr_core.engine.AsrEngine`."""

    def open_stream(
        self, stream_id: str, options: StreamOptions, on_event: EventCallback
    ) -> AsrStreamLike: ...


class CallMedia(Protocol):
    """One call's RTP receiver (gateway.rtp.receiver): its local port, re-INVITE updates, close."""

    @property
    def port(self) -> int: ...

    def update(self, plan: MediaPlan) -> None: ...

    def close(self) -> MediaStats:
        """Flush (the last audio reaches the sink), free the ports and return the final stats."""


class MediaManager(Protocol):
    """gateway.rtp.receiver.MediaManager: binds a port pair and starts receiving (PortsExhausted: 503)."""

    async def open(self, plan: MediaPlan | None, sink: MediaSink, *, name: str = "") -> CallMedia:
        """`plan` None: a delayed offer; the port takes nothing until `update()` with the answer."""


# --- per-call choices (pure) ----------------------------------------------------------------------


def dialed_number(request: SipRequest) -> str:
    """The DNIS: the user part of the Request-URI (or the tel: number), unescaped; '' if none."""
    for uri in (request.uri, request.to.uri):
        try:
            scheme = uri_scheme(uri)
            if scheme == "tel":
                return unescape(uri[4:].split(";", 1)[0])
            if scheme in ("sip", "sips"):
                user = parse_sip_uri(uri).user_unescaped
                if user:
                    return user.split(";", 1)[0]
        except HeaderSyntaxError:
            continue
    return ""


def _user_of(uri: str) -> str:
    try:
        if uri_scheme(uri) == "tel":
            return unescape(uri[4:].split(";", 1)[0])
        return (parse_sip_uri(uri).user_unescaped or "").split(";", 1)[0]
    except HeaderSyntaxError:
        return ""


def choose_language(
    request: SipRequest, *, header: str, dnis_languages: Mapping[str, str], default: str
) -> tuple[str, str]:
    """(language, where it came from): the header if it holds a locale, else the dialed-number map
    (exact match first, then the longest `prefix*` entry), else the default."""
    value = (request.headers.get(header) or "").strip() if header else ""
    if value and _LOCALE_RE.match(value):
        return value, "header"
    dnis = dialed_number(request)
    if dnis:
        if dnis in dnis_languages:
            return dnis_languages[dnis], "dnis"
        best = ""
        for key in dnis_languages:
            if key.endswith("*") and dnis.startswith(key[:-1]) and len(key) > len(best):
                best = key
        if best:
            return dnis_languages[best], "dnis"
    return default, "default"


def call_metadata(request: SipRequest, flow: Flow, allow: Sequence[str]) -> dict[str, str]:
    """call_start fields: From/To (as sent), caller and dialed numbers, P-Asserted-Identity, the
    allow-listed headers (JSON object, names as sent, values capped) and where the call came from."""
    headers: dict[str, str] = {}
    patterns = [p.lower() for p in allow]
    for name, value in request.headers:
        if len(headers) >= MAX_METADATA_HEADERS:
            break
        if any(fnmatch.fnmatchcase(name.lower(), p) for p in patterns) and name not in headers:
            headers[name] = value[:MAX_METADATA_VALUE]
    return {
        "from": request.headers.get("From") or "",
        "to": request.headers.get("To") or "",
        "ani": _user_of(request.from_.uri),
        "dnis": dialed_number(request),
        "pai": request.headers.get("P-Asserted-Identity") or "",
        "headers": json.dumps(headers, ensure_ascii=False, sort_keys=True),
        "source": f"{flow.remote[0]}:{flow.remote[1]}",
        "transport": flow.transport,
    }


# --- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrontEndConfig:
    sip_host: str = "0.0.0.0"
    sip_port: int = 5060
    advertised_host: str = ""  # Contact address; "" = our address toward each caller
    # SDP c=/o= address: the first concrete one of these, else our address toward each caller.
    media_hosts: tuple[str, ...] = ()
    ptime_ms: int = 20  # a=ptime of answers when the offer has none
    transports: tuple[str, ...] = ("udp", "tcp")
    user_agent: str = "ttg"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    digest: DigestConfig | None = None
    timers: TimerConfig = field(default_factory=TimerConfig)
    max_tcp_connections: int = 1024
    default_language: str = "en-US"
    lookahead: int | None = None
    language_header: str = "X-Language"
    dnis_languages: Mapping[str, str] = field(default_factory=dict)
    metadata_headers: tuple[str, ...] = ("X-*",)
    codecs: tuple[str, ...] = ("PCMU", "PCMA")
    answer_delay_s: float = 0.0
    finish_timeout_s: float = 10.0
    model_name: str = ""

    @classmethod
    def from_settings(cls, settings: Settings, *, model_name: str = "") -> FrontEndConfig:
        """From `gateway.config.Settings` (read at the edge; the front end gets this dataclass)."""
        sip = settings.sip
        digest = None
        if sip.digest_user:
            digest = DigestConfig(
                realm=sip.digest_realm,
                username=sip.digest_user,
                password=sip.digest_password,
                algorithms=tuple(sip.digest_algorithms),
            )
        t1 = sip.t1_ms / 1000.0
        return cls(
            sip_host=sip.host,
            sip_port=sip.port,
            advertised_host=sip.advertised_host,
            media_hosts=(settings.rtp.advertised_host, sip.advertised_host, settings.rtp.host),
            ptime_ms=settings.rtp.ptime_ms,
            transports=tuple(sip.transports),
            user_agent=sip.user_agent,
            admission=AdmissionConfig(
                max_calls=sip.max_calls,
                allow_cidrs=tuple(sip.allow_cidrs),
                invite_rate_per_s=sip.invite_rate,
                invite_burst=sip.invite_burst,
                retry_after_s=sip.retry_after_s,
            ),
            digest=digest,
            timers=TimerConfig(t1=t1, t2=max(4.0, 8 * t1), t4=5.0),
            max_tcp_connections=sip.max_tcp_connections,
            default_language=settings.asr.language,
            lookahead=settings.asr.lookahead,
            language_header=sip.language_header,
            dnis_languages=dict(sip.dnis_languages),
            metadata_headers=tuple(sip.metadata_headers),
            codecs=tuple(settings.rtp.codecs),
            answer_delay_s=sip.answer_delay_ms / 1000.0,
            finish_timeout_s=sip.asr_finish_timeout_s,
            model_name=model_name,
        )


# --- the front end ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    ref: str
    session: CallSession
    flow: Flow
    negotiation: Negotiation | None  # None until a delayed offer is answered
    answerer: SdpAnswerer
    contact_host: str
    media: CallMedia | None = None
    media_task: asyncio.Task[None] | None = None
    media_closing: bool = False
    reject_status: int = 500
    last_answer: bytes = b""  # our last SDP (answer, or offer)
    pending_offer: str | None = None  # our offer in a 2xx, waiting for the answer in the ACK
    timer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class TelephonyFrontEnd:
    """See the module docstring."""

    def __init__(
        self,
        config: FrontEndConfig,
        engine: StreamOpener,
        publisher: EventPublisher,
        media: MediaManager,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.publisher = publisher
        self.media = media
        self.agent = UserAgent(
            AgentConfig(
                host=advertised_address(config.advertised_host, config.sip_host, "127.0.0.1"),
                port=config.sip_port,
                user_agent=config.user_agent,
                timers=config.timers,
                admission=config.admission,
                digest=config.digest,
            )
        )
        self.sip = SipEndpoint(
            self.agent,
            self,
            host=config.sip_host,
            port=config.sip_port,
            udp="udp" in config.transports,
            tcp="tcp" in config.transports,
            max_tcp_connections=config.max_tcp_connections,
            clock=clock,
        )
        self._calls: dict[str, _Call] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()

    # --- lifecycle ---

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        await self.sip.start()

    @property
    def sip_port(self) -> int:
        return self.sip.port

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    def stop_admitting(self) -> None:
        """New INVITEs get 503 + Retry-After from now on; calls in progress go on."""
        self.sip.set_admitting(False)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting and wait up to `timeout_s` for the calls to end; True when none is left."""
        self.stop_admitting()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return not self._calls

    async def close(self, timeout_s: float = 15.0) -> None:
        """End every call (BYE or 503, reason shutdown), wait for their call_end (bounded by
        `timeout_s`) and for the BYE transactions (bounded by 64*T1), then close the SIP sockets."""
        self.stop_admitting()
        for call in list(self._calls.values()):
            self._end(call, SessionInput.SHUTDOWN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        for call in list(self._calls.values()):
            logger.warning("call %s still ending at shutdown; abandoning it", call.ref)
            for task in list(call.tasks):
                task.cancel()
            self._discard(call)
        bye_deadline = loop.time() + min(64 * self.config.timers.t1, max(0.5, deadline - loop.time()))
        while self.agent.pending_client_transactions and loop.time() < bye_deadline:
            await asyncio.sleep(0.05)
        await self.sip.close()

    # --- SIP events ---

    def on_sip_event(self, event: SipCallEvent) -> None:
        if isinstance(event, CallOffered):
            self._on_offer(event)
            return
        call = self._calls.get(event.call_ref)
        if call is None:
            return
        if isinstance(event, CallConfirmed):
            if call.session.accepts(SessionInput.ACKED):
                call.session.acked(self.sip.now())
            if call.pending_offer is not None and not self._take_answer(call, event.body):
                # RFC 3261 §13.2.1 / §13.3.1.4: no usable answer to our offer: the session cannot go on.
                self._end(call, SessionInput.ERROR)
        elif isinstance(event, ReofferConfirmed):
            if call.pending_offer is not None and not self._take_answer(call, event.body):
                logger.info("call %s: no usable answer in the re-INVITE's ACK; media unchanged", call.ref)
        elif isinstance(event, SessionReoffered):
            self._on_reoffer(call, event.request)
        elif isinstance(event, CallEndedByPeer):
            self._end(call, SessionInput.PEER_BYE)
        elif isinstance(event, CallCancelled):
            self._end(call, SessionInput.CANCELLED)
        elif isinstance(event, CallAckTimeout):
            self._end(call, SessionInput.ACK_TIMEOUT)
        elif isinstance(event, CallReleased):
            logger.debug("call %s: BYE done (%s)", call.ref, event.status)

    def _on_offer(self, event: CallOffered) -> None:
        try:
            self._offer(event)
        except Exception:
            # A bug must not leave the caller waiting (nor the call counted against max_calls).
            logger.exception("call %s: setting up failed", event.call_ref)
            call = self._calls.get(event.call_ref)
            if call is not None:
                self._end(call, SessionInput.ERROR)
            else:
                self.sip.reject(event.call_ref, 500, warning="internal error", result="failed")

    def _offer(self, event: CallOffered) -> None:
        req, ref, flow = event.request, event.call_ref, event.flow
        cfg = self.config
        negotiation: Negotiation | None = None
        try:
            if req.body:
                negotiation = negotiate(parse_sdp(req.body), codecs=cfg.codecs, default_ptime_ms=cfg.ptime_ms)
        except SdpError as e:
            logger.info("call %s: SDP refused: %s", ref, e)
            self.sip.reject(ref, e.status_hint, warning=str(e)[:200], result="rejected_codec")
            return
        language, source = choose_language(
            req, header=cfg.language_header, dnis_languages=cfg.dnis_languages, default=cfg.default_language
        )
        try:
            stream, language = self._open_stream(ref, language)
        except (AsrError, ValueError, RuntimeError) as e:
            logger.warning("call %s: ASR stream refused: %s", ref, e)
            self.sip.reject(ref, 503, warning="transcription unavailable", result="failed")
            return
        extra = call_metadata(req, flow, cfg.metadata_headers)
        extra["model"] = cfg.model_name
        extra["language_source"] = source
        plan = negotiation.accepted[0] if negotiation is not None else None
        extra["codec"] = plan.codec if plan is not None else ""  # a delayed offer: known after the ACK
        toward = local_ip_toward(flow.remote[0])
        contact_host = advertised_address(cfg.advertised_host, cfg.sip_host, toward)
        media_host = advertised_address(*cfg.media_hosts, toward)
        session = CallSession(
            CallInfo(ref, req.call_id, language, extra),
            stream,
            self.publisher,
            now=self.sip.now(),
            finish_timeout_s=cfg.finish_timeout_s,
            on_end_request=self._on_end_request,
        )
        call = _Call(ref, session, flow, negotiation, SdpAnswerer(media_host), contact_host)
        self._calls[ref] = call
        self._idle.clear()
        metrics.ACTIVE_CALLS.set(len(self._calls))
        call.media_task = self._spawn(call, self._setup(call, plan))

    def _open_stream(self, ref: str, language: str) -> tuple[AsrStreamLike, str]:
        options = StreamOptions(language=language, lookahead=self.config.lookahead)
        try:
            return self.engine.open_stream(ref, options, self._asr_callback(ref)), language
        except ValueError:
            if language == self.config.default_language:
                raise
            # An unknown locale in the header/map: transcribe in the default language rather than fail.
            logger.warning(
                "call %s: language %r not available; using %r", ref, language, self.config.default_language
            )
            language = self.config.default_language
            options = StreamOptions(language=language, lookahead=self.config.lookahead)
            return self.engine.open_stream(ref, options, self._asr_callback(ref)), language

    async def _setup(self, call: _Call, plan: MediaPlan | None) -> None:
        try:
            await self._open_and_answer(call, plan)
        except Exception:
            logger.exception("call %s: answering failed", call.ref)
            call.media_task = None
            self._end(call, SessionInput.ERROR)

    async def _open_and_answer(self, call: _Call, plan: MediaPlan | None) -> None:
        try:
            media = await self.media.open(plan, call.session, name=call.ref)
        except Exception as e:
            logger.warning("call %s: media setup failed: %s", call.ref, e)
            call.media_task = None
            call.reject_status = 503 if isinstance(e, PortsExhausted | OSError) else 500
            if call.session.over:
                self._close_media(call)
            else:
                self._end(call, SessionInput.ERROR)
            return
        call.media = media
        call.media_task = None
        if call.session.over:
            self._close_media(call)
            return
        if self.config.answer_delay_s > 0:
            self.sip.ring(call.ref)
            await asyncio.sleep(self.config.answer_delay_s)
            if call.session.over:
                return
        if call.negotiation is not None:
            answer = call.answerer.answer(call.negotiation, [media.port]).encode()
        else:
            # A delayed offer (§13.2.1): our 2xx offers, the ACK must answer.
            offer = call.answerer.offer(
                [media.port], codecs=self.config.codecs, ptime_ms=self.config.ptime_ms
            )
            call.pending_offer = offer
            answer = offer.encode()
        call.last_answer = answer
        self.sip.answer(call.ref, answer, contact_host=call.contact_host)
        if self.agent.call_phase(call.ref) is CallPhase.ANSWERED and call.session.accepts(
            SessionInput.ANSWERED
        ):
            call.session.answered(self.sip.now())

    def _on_reoffer(self, call: _Call, request: SipRequest) -> None:
        if call.media is None or call.session.over:
            self.sip.reject_reoffer(call.ref, 491, warning="session not ready")
            return
        if not request.body:
            # An offerless re-INVITE (a session refresh): our current SDP is the offer; the ACK answers.
            call.pending_offer = call.last_answer.decode()
            self.sip.answer_reoffer(call.ref, call.last_answer, contact_host=call.contact_host)
        else:
            try:
                negotiation = negotiate(
                    parse_sdp(request.body), codecs=self.config.codecs, default_ptime_ms=self.config.ptime_ms
                )
            except SdpError as e:
                # RFC 3264 §8: a refused re-offer leaves the session as it was.
                self.sip.reject_reoffer(call.ref, e.status_hint, warning=str(e)[:200])
                return
            plan = negotiation.accepted[0]
            call.media.update(plan)
            call.negotiation = negotiation
            answer = call.answerer.answer(negotiation, [call.media.port]).encode()
            call.last_answer = answer
            self.sip.answer_reoffer(call.ref, answer, contact_host=call.contact_host)
        if call.session.accepts(SessionInput.REOFFERED):
            call.session.reoffered(self.sip.now())

    def _take_answer(self, call: _Call, body: bytes) -> bool:
        """The peer's answer (in an ACK) to the offer in our 2xx: apply it to the media."""
        offer, call.pending_offer = call.pending_offer, None
        if offer is None or not body or call.media is None:
            return False
        try:
            negotiation = negotiate_answer(
                parse_sdp(offer),
                parse_sdp(body),
                codecs=self.config.codecs,
                default_ptime_ms=self.config.ptime_ms,
            )
        except SdpError as e:
            logger.info("call %s: unusable SDP answer: %s", call.ref, e)
            return False
        call.media.update(negotiation.accepted[0])
        call.negotiation = negotiation
        return True

    # --- ending ---

    def _on_end_request(self, session: CallSession, event: SessionInput) -> None:
        """The session asks to end (RTP timeout, ASR failure): run it outside the caller's frame."""
        call = self._calls.get(session.call_id)
        if call is not None and self._loop is not None:
            self._loop.call_soon(self._end, call, event)

    def _end(self, call: _Call, event: SessionInput) -> None:
        session = call.session
        if session.over or not session.accepts(event):
            return
        action = session.end(event, self.sip.now())
        if action is SipAction.BYE:
            self.sip.hangup(call.ref, reason=event.value)
        elif action is SipAction.REJECT:
            status = 503 if event is SessionInput.SHUTDOWN else call.reject_status
            self.sip.reject(call.ref, status, warning=event.value, result="failed")
        self._close_media(call)
        self._rearm(call)

    def _close_media(self, call: _Call) -> None:
        if call.media_closing:
            return
        if call.media is None:
            if call.media_task is not None and not call.media_task.done():
                return  # `_setup` closes it when the port is open
            call.media_closing = True
            call.session.media_closed(None, self.sip.now())
            self._check_ended(call)
            return
        call.media_closing = True
        stats: MediaStats | None = None
        try:
            stats = call.media.close()
        except Exception:
            logger.exception("call %s: closing media failed", call.ref)
        call.session.media_closed(stats.to_fields() if stats is not None else None, self.sip.now())
        self._check_ended(call)
        self._rearm(call)

    # --- ASR events (engine threads → loop) ---

    def _asr_callback(self, ref: str) -> EventCallback:
        loop = self._loop
        assert loop is not None

        def on_event(event: AsrEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(self._on_asr_event, ref, event)

        return on_event

    def _on_asr_event(self, ref: str, event: AsrEvent) -> None:
        call = self._calls.get(ref)
        if call is None:
            return
        call.session.on_asr_event(event, self.sip.now())
        self._check_ended(call)

    # --- per-call timer and bookkeeping ---

    def _rearm(self, call: _Call) -> None:
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        at = call.session.next_deadline()
        if at is not None and self._loop is not None and call.ref in self._calls:
            call.timer = self._loop.call_later(max(0.0, at - self.sip.now()), self._on_timer, call)

    def _on_timer(self, call: _Call) -> None:
        call.timer = None
        call.session.handle_timer(self.sip.now())
        self._check_ended(call)
        self._rearm(call)

    def _check_ended(self, call: _Call) -> None:
        if call.session.state is CallState.ENDED:
            self._discard(call)

    def _discard(self, call: _Call) -> None:
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        if self._calls.pop(call.ref, None) is not None:
            metrics.ACTIVE_CALLS.set(len(self._calls))
        if not self._calls:
            self._idle.set()

    def _spawn(self, call: _Call, coro: Any) -> asyncio.Task[Any]:
        assert self._loop is not None
        task = self._loop.create_task(coro)
        call.tasks.add(task)
        task.add_done_callback(call.tasks.discard)
        return task
