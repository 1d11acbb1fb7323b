"""The telephony front end: the asyncio adapter that carries out the effects of every call's core.

`TelephonyFrontEnd` owns the SIP endpoint (gateway.sip), one `CallCore` per call (gateway.call.core),
the `Legs` where the calls' media and ASR streams run (gateway.call.legs) and the event publisher. It
decides nothing about a call: it turns SIP call events and leg events into the core's inputs, hands
each to its call's core with `now`, and carries out the effects that come back (SIP answers and
requests through the endpoint, leg effects through `Legs`, events to the publisher). Inputs wait in one
queue that is worked off in order, so no core (and no effect) is ever entered from inside another.
One timer per call serves its core's `next_deadline()`. The registry of calls is keyed by the gateway's
call id (= `CallEvent.call_id`); a call is forgotten when its core has finished.

Lifecycle: `start()` binds SIP; `stop_admitting()` makes new INVITEs get 503 (drain); `drain(timeout)`
waits for calls to end by themselves; `close()` ends the rest (BYE, reason shutdown), waits for their
final transcripts and call_end events (bounded) and for the BYE transactions, then closes the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gateway import metrics
from gateway.addresses import advertised_address, local_ip_toward
from gateway.call.contract import (
    Acked,
    AckTimedOut,
    Answer,
    AnswerReoffer,
    CallInput,
    Cancelled,
    Effect,
    Failed,
    Hangup,
    LegInput,
    Offered,
    PeerHungUp,
    Publish,
    Reject,
    RejectReoffer,
    ReofferAcked,
    Reoffered,
    Ring,
    Shutdown,
)
from gateway.call.core import CallConfig, CallCore
from gateway.call.legs import Legs
from gateway.events import EventPublisher
from gateway.sip.admission import AdmissionConfig
from gateway.sip.agent import (
    AgentConfig,
    CallAckTimeout,
    CallCancelled,
    CallConfirmed,
    CallEndedByPeer,
    CallOffered,
    ReofferConfirmed,
    SessionReoffered,
    UserAgent,
)
from gateway.sip.agent import CallEvent as SipCallEvent
from gateway.sip.auth import DigestConfig
from gateway.sip.endpoint import SipEndpoint
from gateway.sip.transaction import TimerConfig

if TYPE_CHECKING:
    from gateway.config import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrontEndConfig:
    sip_host: str = "0.0.0.0"
    sip_port: int = 5060
    transports: tuple[str, ...] = ("udp", "tcp")
    user_agent: str = "ttg"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    digest: DigestConfig | None = None
    timers: TimerConfig = field(default_factory=TimerConfig)
    max_tcp_connections: int = 1024
    call: CallConfig = field(default_factory=CallConfig)

    @classmethod
    def from_settings(cls, settings: Settings, *, model_name: str = "") -> FrontEndConfig:
        """From `gateway.config.Settings` (read at the edge; the front end gets this dataclass)."""
        sip, rtp, asr = settings.sip, settings.rtp, settings.asr
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
            call=CallConfig(
                codecs=tuple(rtp.codecs),
                ptime_ms=rtp.ptime_ms,
                default_language=asr.language,
                lookahead=asr.lookahead,
                language_header=sip.language_header,
                dnis_languages=dict(sip.dnis_languages),
                metadata_headers=tuple(sip.metadata_headers),
                answer_delay_s=sip.answer_delay_ms / 1000.0,
                finish_timeout_s=sip.asr_finish_timeout_s,
                model_name=model_name,
                contact_hosts=(sip.advertised_host, sip.host),
                media_hosts=(rtp.advertised_host, sip.advertised_host, rtp.host),
                max_streams=rtp.max_streams,
                multi_leg_calls=rtp.multi_leg_calls,
                siprec=sip.siprec,
            ),
        )


def sip_input(event: SipCallEvent) -> CallInput | None:
    """The call core's input for a SIP call event of the user agent (None: nothing for the core)."""
    match event:
        case CallOffered(request=request, flow=flow):
            return Offered(request, flow, local_ip_toward(flow.remote[0]))
        case CallConfirmed(body=body):
            return Acked(body)
        case ReofferConfirmed(body=body):
            return ReofferAcked(body)
        case SessionReoffered(request=request):
            return Reoffered(request)
        case CallEndedByPeer():
            return PeerHungUp()
        case CallCancelled():
            return Cancelled()
        case CallAckTimeout():
            return AckTimedOut()
    return None  # CallReleased: our BYE is done; the call's core finished long before


@dataclass(slots=True)
class _Call:
    ref: str
    core: CallCore
    timer: asyncio.TimerHandle | None = None
    timer_at: float | None = None
    streams: int = 1  # its legs, as the SIP core and ttg_active_streams last heard


class TelephonyFrontEnd:
    """See the module docstring."""

    def __init__(
        self,
        config: FrontEndConfig,
        legs: Legs,
        publisher: EventPublisher,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.legs = legs
        self.publisher = publisher
        self.agent = UserAgent(
            AgentConfig(
                host=advertised_address(*config.call.contact_hosts, config.sip_host, "127.0.0.1"),
                port=config.sip_port,
                user_agent=config.user_agent,
                timers=config.timers,
                admission=config.admission,
                digest=config.digest,
                siprec=config.call.siprec,
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
        self._inbox: deque[tuple[str, CallInput | None]] = deque()
        self._working = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()

    # --- lifecycle ---

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self.legs.start(self)
        await self.sip.start()

    @property
    def sip_port(self) -> int:
        return self.sip.port

    @property
    def active_calls(self) -> int:
        return len(self._calls)

    @property
    def active_streams(self) -> int:
        """Audio streams (legs) of the calls in progress: what TTG_SIP__MAX_CALLS counts."""
        return sum(call.streams for call in self._calls.values())

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
        for ref in list(self._calls):
            self._feed(ref, Shutdown())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        for call in list(self._calls.values()):
            logger.warning("call %s still ending at shutdown; abandoning it", call.ref)
            self._forget(call)
        bye_deadline = loop.time() + min(64 * self.config.timers.t1, max(0.5, deadline - loop.time()))
        while self.agent.pending_client_transactions and loop.time() < bye_deadline:
            await asyncio.sleep(0.05)
        await self.legs.close()
        await self.sip.close()

    # --- inputs ---

    def on_sip_event(self, event: SipCallEvent) -> None:
        inp = sip_input(event)
        if inp is None:
            logger.debug("call %s: %s", event.call_ref, event)
            return
        if isinstance(inp, Offered):
            # Capacity counts streams: this call holds one place so far (the SIP core admitted it).
            free = self.config.admission.max_calls - self.agent.active_streams + 1
            inp = replace(inp, streams_free=max(0, free))
            self._calls[event.call_ref] = _Call(
                event.call_ref, CallCore(event.call_ref, self.config.call, now=self.sip.now())
            )
            self._idle.clear()
            metrics.ACTIVE_CALLS.set(len(self._calls))
            metrics.ACTIVE_STREAMS.set(self.active_streams)
        self._feed(event.call_ref, inp)

    def leg_event(self, call_id: str, event: LegInput) -> None:
        self._feed(call_id, event)

    def _feed(self, ref: str, inp: CallInput | None) -> None:
        """Queue an input (None: the call's timer) and work the queue off unless already doing so."""
        self._inbox.append((ref, inp))
        if self._working:
            return
        self._working = True
        try:
            while self._inbox:
                self._step(*self._inbox.popleft())
        finally:
            self._working = False

    def _step(self, ref: str, inp: CallInput | None) -> None:
        call = self._calls.get(ref)
        if call is None:
            return  # the call is gone (late engine or media events)
        now = self.sip.now()
        try:
            effects = call.core.handle_timer(now) if inp is None else call.core.handle(inp, now)
        except Exception:
            # A bug must not leave the caller waiting (nor the call counted against max_calls).
            logger.exception("call %s: the call core failed on %s", ref, type(inp).__name__)
            self._fail(call, inp)
            return
        for effect in effects:
            try:
                self._execute(call, effect)
            except Exception:
                logger.exception("call %s: carrying out %s failed", ref, type(effect).__name__)
                self._inbox.append((ref, Failed(f"{type(effect).__name__} failed")))
        if call.core.finished:
            self._forget(call)
        else:
            streams = max(1, len(call.core.live_legs))
            if streams != call.streams:  # an offer or re-offer decided the call's legs
                call.streams = streams
                self.agent.set_streams(ref, streams)
                metrics.ACTIVE_STREAMS.set(self.active_streams)
            self._rearm(call)

    def _fail(self, call: _Call, inp: CallInput | None) -> None:
        if not isinstance(inp, Failed):
            self._inbox.append((call.ref, Failed(f"internal error on {type(inp).__name__}")))
            return
        # The core cannot even end the call: answer SIP directly and forget it.
        self.sip.reject(call.ref, 500, warning="internal error", result="failed")
        self.sip.hangup(call.ref, reason="error")
        self._forget(call)

    # --- effects ---

    def _execute(self, call: _Call, effect: Effect) -> None:
        ref = call.ref
        match effect:
            case Publish(event=event):
                try:
                    self.publisher.publish(event)
                except Exception:
                    # The publisher must never block or raise; if it does, the call still goes on.
                    logger.exception("call %s: publishing %s failed", ref, event.type)
            case Ring():
                self.sip.ring(ref)
            case Answer(sdp=sdp, contact_host=host, recording=recording):
                self.sip.answer(ref, sdp, contact_host=host, recording=recording)
            case Reject(status=status, warning=warning, result=result):
                self.sip.reject(ref, status, warning=warning, result=result)
            case AnswerReoffer(sdp=sdp, contact_host=host):
                self.sip.answer_reoffer(ref, sdp, contact_host=host)
            case RejectReoffer(status=status, warning=warning):
                self.sip.reject_reoffer(ref, status, warning=warning)
            case Hangup(reason=reason):
                self.sip.hangup(ref, reason=reason)
            case _:
                self.legs.execute(ref, effect)

    # --- per-call timer and bookkeeping ---

    def _rearm(self, call: _Call) -> None:
        at = call.core.next_deadline()
        if call.timer is not None:
            if at == call.timer_at:
                return
            call.timer.cancel()
            call.timer = None
        call.timer_at = at
        if at is not None and self._loop is not None:
            delay = max(0.0, at - self.sip.now())
            call.timer = self._loop.call_later(delay, self._feed, call.ref, None)

    def _forget(self, call: _Call) -> None:
        call.timer_at = None
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        self.legs.discard(call.ref)
        if self._calls.pop(call.ref, None) is not None:
            metrics.ACTIVE_CALLS.set(len(self._calls))
            metrics.ACTIVE_STREAMS.set(self.active_streams)
        if not self._calls:
            self._idle.set()
