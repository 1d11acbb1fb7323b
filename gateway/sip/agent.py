"""The gateway's SIP user agent core in trunk mode (RFC 3261 §8.2, §12–§17): pure, no I/O.

Theory of operation
-------------------
`UserAgent` turns datagrams/stream messages into effects. Its inputs:

- `receive(data, flow, now)`: bytes from the network with the flow they came on;
- the application's decisions: `ring`, `answer`, `reject`, `answer_reoffer`, `reject_reoffer`, `hangup`;
- its timer: `next_deadline()` / `handle_timer(now)` (transaction timers, 2xx retransmission).

Each returns a list of effects: `Send(data, flow, dest)` for the adapter to write, and call events
(`CallOffered`, `CallCancelled`, `CallConfirmed`, `SessionReoffered`, `CallEndedByPeer`,
`CallAckTimeout`, `CallReleased`) for the application. Counters for Prometheus accumulate in
`counters` and are taken by the adapter (`take_counters()`).

Request processing follows §8.2 in order: source allow-list (403), authentication of initial INVITEs
(RFC 7616, 401/403), method (405 with Allow, or 501 for methods nobody defined), Request-URI scheme
(416), To tag without a dialog (481), merged requests (482), Require (420), content (415/406; an
INVITE without SDP is a delayed offer: our 2xx offers, its ACK answers), then admission (503 +
Retry-After). Initial INVITEs get 100 Trying at once and become calls identified by a `call_ref`
(the gateway's call id).

Routing (§18.2.2, RFC 3581): responses go to the packet's source IP; to its source port when the top
Via has `rport` (or over the same TCP connection), else to the Via's sent-by port. In-dialog requests
we send (BYE) go to the address the dialog's INVITE came from. No host named inside a message is ever
resolved or contacted.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.sip.admission import Admission, AdmissionConfig, Decision
from gateway.sip.auth import AuthResult, DigestAuthenticator, DigestConfig
from gateway.sip.dialog import Dialog, DialogId, DialogState
from gateway.sip.headers import (
    HeaderSyntaxError,
    Via,
    make_branch,
    make_tag,
    parse_via,
    quote,
    split_list,
    tokens_list,
    uri_scheme,
)
from gateway.sip.message import Headers, SipParseError, SipRequest, SipResponse, parse_message, serialize
from gateway.sip.transaction import (
    AnswerRetransmission,
    InviteServerTransaction,
    NonInviteClientTransaction,
    NonInviteServerTransaction,
    TimerConfig,
    Transmit,
    TxEffect,
    TxState,
    server_key,
)

Address = tuple[str, int]

ALLOWED_METHODS = ("INVITE", "ACK", "BYE", "CANCEL", "OPTIONS")
# Methods defined by SIP extensions that this gateway does not implement: 405 with Allow (§8.2.1).
# Any other method is unknown to us: 501 (§21.5.2).
KNOWN_METHODS = frozenset(
    {"REGISTER", "MESSAGE", "SUBSCRIBE", "NOTIFY", "REFER", "INFO", "UPDATE", "PRACK", "PUBLISH"}
)
# Method labels of ttg_sip_requests_total (bounded; the rest count as "other").
METRIC_METHODS = frozenset({*ALLOWED_METHODS, "INFO", "UPDATE", "PRACK", "REGISTER"})
SUPPORTED_SCHEMES = ("sip", "sips", "tel")
SIPREC_TAGS = frozenset({"siprec"})
# A SIPREC offer: SDP + rs-metadata in one multipart/mixed body; a metadata-only update (RFC 7866).
RECORDING_BODY_TYPES = ("multipart/mixed", "application/rs-metadata+xml", "application/rs-metadata")
SRS_FEATURE_TAG = "+sip.srs"  # RFC 7866: the SRS marks its Contact (RFC 3840 feature tag)

REASON_PHRASES = {
    100: "Trying",
    180: "Ringing",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    406: "Not Acceptable",
    408: "Request Timeout",
    415: "Unsupported Media Type",
    416: "Unsupported URI Scheme",
    420: "Bad Extension",
    480: "Temporarily Unavailable",
    481: "Call/Transaction Does Not Exist",
    482: "Loop Detected",
    483: "Too Many Hops",
    487: "Request Terminated",
    488: "Not Acceptable Here",
    491: "Request Pending",
    500: "Server Internal Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "Version Not Supported",
    513: "Message Too Large",
}


def reason_phrase(status: int) -> str:
    return REASON_PHRASES.get(status, "Unknown")


# --- flows and effects --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Flow:
    """How a message arrived: transport, the packet's source address, and the TCP connection."""

    transport: str  # "udp" or "tcp"
    remote: Address
    conn_id: int = 0

    @property
    def reliable(self) -> bool:
        return self.transport != "udp"


@dataclass(frozen=True, slots=True)
class Send:
    """Write `data` on `flow` (its connection when TCP and still open), else to `dest`."""

    data: bytes
    flow: Flow
    dest: Address


@dataclass(frozen=True, slots=True)
class CallOffered:
    """An initial INVITE passed every check: answer it with `answer` (or `ring` first) or `reject`."""

    call_ref: str
    request: SipRequest
    flow: Flow


@dataclass(frozen=True, slots=True)
class CallCancelled:
    """CANCEL (or a BYE on the early dialog) before our final answer; 487 already sent."""

    call_ref: str


@dataclass(frozen=True, slots=True)
class CallConfirmed:
    """The ACK for our 2xx to the initial INVITE arrived (with the SDP answer when our 2xx offered)."""

    call_ref: str
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class ReofferConfirmed:
    """The ACK for our 2xx to a re-INVITE arrived (with the SDP answer when the re-INVITE had no offer)."""

    call_ref: str
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class SessionReoffered:
    """A re-INVITE in the dialog: answer with `answer_reoffer` or `reject_reoffer`."""

    call_ref: str
    request: SipRequest


@dataclass(frozen=True, slots=True)
class CallEndedByPeer:
    """BYE from the peer; 200 already sent, the dialog is gone."""

    call_ref: str


@dataclass(frozen=True, slots=True)
class CallAckTimeout:
    """No ACK for our 2xx within 64*T1: §13.3.1.4 says end the session with a BYE."""

    call_ref: str


@dataclass(frozen=True, slots=True)
class CallReleased:
    """Our BYE was answered (`status`) or timed out (None): nothing of the call is left in the core."""

    call_ref: str
    status: int | None


CallEvent = (
    CallOffered
    | CallCancelled
    | CallConfirmed
    | SessionReoffered
    | ReofferConfirmed
    | CallEndedByPeer
    | CallAckTimeout
    | CallReleased
)
Effect = Send | CallEvent


@dataclass(frozen=True, slots=True)
class AgentConfig:
    host: str  # advertised address for Contact and our Via
    port: int
    user_agent: str = "ttg"
    timers: TimerConfig = field(default_factory=TimerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    digest: DigestConfig | None = None
    # Server transactions live up to 64*T1 after their answer; beyond this many (a request flood) new
    # requests get a stateless 503 instead of more state.
    max_transactions: int = 50_000
    # SIPREC recording sessions (RFC 7866): the `siprec` option tag is supported and INVITE bodies may
    # be multipart/mixed (SDP + recording metadata). Off: `Require: siprec` gets 420, multipart 415.
    siprec: bool = False

    @property
    def option_tags(self) -> frozenset[str]:
        """The SIP extensions this agent supports (RFC 3261 §8.2.2.3, §20.37)."""
        return SIPREC_TAGS if self.siprec else frozenset()

    @property
    def body_types(self) -> tuple[str, ...]:
        """The INVITE body types accepted (RFC 3261 §8.2.3): the Accept header of a 415 and of OPTIONS."""
        return ("application/sdp", *RECORDING_BODY_TYPES) if self.siprec else ("application/sdp",)


@dataclass(slots=True)
class SipCounters:
    """What happened since the last `take_counters()`; the adapter adds these to Prometheus."""

    requests: Counter[str] = field(default_factory=Counter)  # by method (bounded set + "other")
    responses: Counter[str] = field(default_factory=Counter)  # by status code (first transmissions)
    errors: Counter[str] = field(default_factory=Counter)  # malformed/stray/forbidden... (bounded)
    calls: Counter[str] = field(default_factory=Counter)  # call outcomes at admission


# --- calls ----------------------------------------------------------------------------------------------


class CallPhase(enum.Enum):
    OFFERED = "offered"  # INVITE admitted, no final response yet
    ANSWERED = "answered"  # 2xx sent, ACK outstanding
    CONFIRMED = "confirmed"  # ACK received
    ENDING = "ending"  # our BYE in flight (or queued until the ACK), or rejected/cancelled


@dataclass(slots=True)
class _ServerEntry:
    tx: InviteServerTransaction | NonInviteServerTransaction
    flow: Flow
    call_ref: str | None = None


@dataclass(slots=True)
class _Call:
    ref: str
    invite: SipRequest
    flow: Flow
    invite_key: tuple[str, ...]
    local_tag: str
    dialog: Dialog | None = None
    phase: CallPhase = CallPhase.OFFERED
    rtx: dict[int, AnswerRetransmission] = field(default_factory=dict)  # CSeq -> 2xx retransmission
    reoffer_key: tuple[str, ...] | None = None
    bye_pending: bool = False  # hang up as soon as the ACK arrives (or its wait times out)
    bye_reason: str | None = None
    bye_branch: str | None = None
    contact_host: str | None = None
    recording: bool = False  # a SIPREC recording session (our 2xx say so)
    streams: int = 1  # audio streams (legs) the call carries: what it counts against max_calls


class UserAgent:
    """See the module docstring. One instance serves every transport of the gateway."""

    def __init__(self, config: AgentConfig, *, new_call_ref: Callable[[], str] | None = None) -> None:
        self.config = config
        self.admission = Admission(config.admission)
        self.auth = DigestAuthenticator(config.digest) if config.digest is not None else None
        self.counters = SipCounters()
        self._new_ref = new_call_ref or (lambda: uuid.uuid4().hex)
        self._server: dict[tuple[str, ...], _ServerEntry] = {}
        self._client: dict[
            str, tuple[NonInviteClientTransaction, Flow, str]
        ] = {}  # branch -> (tx, flow, ref)
        self._calls: dict[str, _Call] = {}
        self._dialogs: dict[DialogId, str] = {}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._heap_n = itertools.count()

    # --- queries ---

    @property
    def active_calls(self) -> int:
        """Calls offered, answered or confirmed (not ending)."""
        return sum(1 for c in self._calls.values() if c.phase is not CallPhase.ENDING)

    @property
    def active_streams(self) -> int:
        """The audio streams of those calls: what `max_calls` limits (a two-leg SIPREC call counts 2;
        a call counts 1 until `set_streams` says more)."""
        return sum(c.streams for c in self._calls.values() if c.phase is not CallPhase.ENDING)

    def set_streams(self, call_ref: str, streams: int) -> None:
        """How many audio streams a call carries, once its offer is negotiated (or re-negotiated)."""
        call = self._calls.get(call_ref)
        if call is not None:
            call.streams = max(1, streams)

    def has_call(self, call_ref: str) -> bool:
        return call_ref in self._calls

    def call_phase(self, call_ref: str) -> CallPhase | None:
        call = self._calls.get(call_ref)
        return None if call is None else call.phase

    @property
    def pending_transactions(self) -> int:
        return len(self._server) + len(self._client)

    @property
    def pending_client_transactions(self) -> int:
        return len(self._client)

    def take_counters(self) -> SipCounters:
        out, self.counters = self.counters, SipCounters()
        return out

    def set_admitting(self, admitting: bool) -> None:
        self.admission.draining = not admitting

    # --- input: network ---

    def receive(self, data: bytes, flow: Flow, now: float) -> list[Effect]:
        try:
            message = parse_message(data, stream=flow.reliable)
        except SipParseError as e:
            return self._on_parse_error(e, flow)
        if isinstance(message, SipResponse):
            return self._on_response(message, now)
        return self._on_request(message, flow, now)

    def _on_parse_error(self, e: SipParseError, flow: Flow) -> list[Effect]:
        self.counters.errors[e.kind] += 1
        # §18.3 / §8.2.6: answer a malformed request when a response can be routed; never a response
        # or an ACK (RFC 4475: scalarlg/bigcode are discarded) and never a disallowed source.
        raw_vias = e.headers.get_all("Via")
        if not e.is_request or e.method == "ACK" or not raw_vias:
            return []
        if not self.admission.source_allowed(flow.remote[0]):
            return []
        try:
            top: Via | None = parse_via(raw_vias[0])[0]
        except HeaderSyntaxError:
            top = None  # unparseable Via: answer the packet's source address
        data = _raw_response(e.headers, e.status, e.reason, self.config.user_agent)
        self.counters.responses[str(e.status)] += 1
        return [Send(data, flow, self._reply_dest(top, flow))]

    def _on_response(self, response: SipResponse, now: float) -> list[Effect]:
        branch = response.via[0].branch or ""
        entry = self._client.get(branch)
        if entry is None or response.cseq.method != entry[0].request.method:
            self.counters.errors["stray_response"] += 1
            return []
        tx, _, ref = entry
        tx.receive_response(response, now)
        if tx.state in (TxState.COMPLETED, TxState.TERMINATED):
            return self._release(ref, branch, response.status)
        self._track("c", branch)
        return []

    def _on_request(self, req: SipRequest, flow: Flow, now: float) -> list[Effect]:
        method = req.method if req.method in METRIC_METHODS else "other"
        self.counters.requests[method] += 1
        if not self.admission.source_allowed(flow.remote[0]):
            self.counters.errors["forbidden_source"] += 1
            if req.method == "ACK":
                return []
            if req.method == "INVITE" and not req.to.tag:
                self.counters.calls["rejected_forbidden"] += 1
            return [self._stateless(req, flow, 403)]
        if req.method == "ACK":
            return self._on_ack(req, now)
        key = server_key(req)
        entry = self._server.get(key)
        if entry is not None:
            # A retransmission: the transaction answers it (§17.2.1, §17.2.2).
            return self._wrap(entry.tx.receive_request(req, now), entry.flow, req)
        if len(self._server) >= self.config.max_transactions:
            self.counters.errors["overload"] += 1
            return [self._stateless(req, flow, 503)]
        if req.method == "CANCEL":
            return self._on_cancel(req, key, flow, now)
        tx: InviteServerTransaction | NonInviteServerTransaction
        if req.method == "INVITE":
            tx = InviteServerTransaction(req, reliable=flow.reliable, timers=self.config.timers, now=now)
        else:
            tx = NonInviteServerTransaction(req, reliable=flow.reliable, timers=self.config.timers, now=now)
        entry = _ServerEntry(tx, flow)
        self._server[key] = entry
        return self._dispatch(req, key, entry, now)

    def _dispatch(
        self, req: SipRequest, key: tuple[str, ...], entry: _ServerEntry, now: float
    ) -> list[Effect]:
        initial_invite = req.method == "INVITE" and not req.to.tag
        # §22 / RFC 7616: authenticate initial INVITEs first (§8.2 puts authentication before §8.2.1).
        if initial_invite and self.auth is not None:
            result = self.auth.verify("INVITE", req.uri, req.headers.get_all("Authorization"), now)
            if result in (AuthResult.MISSING, AuthResult.STALE):
                challenges = self.auth.challenges(now, stale=result is AuthResult.STALE)
                return self._respond(key, 401, now, headers=[("WWW-Authenticate", c) for c in challenges])
            if result is AuthResult.REJECTED:
                self.counters.calls["rejected_auth"] += 1
                return self._respond(key, 403, now, warning="bad credentials")
        # §8.2.1 method inspection.
        if req.method not in ALLOWED_METHODS:
            status = 405 if req.method in KNOWN_METHODS else 501
            return self._respond(key, status, now, headers=[("Allow", ", ".join(ALLOWED_METHODS))])
        # §8.2.2.1 Request-URI scheme.
        try:
            scheme = uri_scheme(req.uri)
        except HeaderSyntaxError:
            scheme = ""
        if scheme not in SUPPORTED_SCHEMES:
            return self._respond(key, 416, now)
        # §8.2.2.2 / §12.2.2: a To tag names a dialog, which must exist.
        if req.to.tag:
            return self._in_dialog(req, key, entry, now)
        if req.method == "BYE":
            return self._respond(key, 481, now)
        if initial_invite and self._merged(req, key):
            return self._respond(key, 482, now)
        if unsupported := self._unsupported(req, key, now):
            return unsupported
        if req.method == "OPTIONS":
            return self._respond(key, 200, now, headers=self._capabilities())
        assert initial_invite
        refusal = self._check_offer(req)
        if refusal is not None:
            status, headers, warning = refusal
            if status in (415, 488, 406):
                self.counters.calls["rejected_codec"] += 1
            return self._respond(key, status, now, headers=headers, warning=warning)
        decision = self.admission.admit_invite(entry.flow.remote[0], self.active_streams, now)
        if not decision.admitted:
            return self._refuse(key, decision, now)
        return self._offer(req, key, entry, now)

    def _unsupported(self, req: SipRequest, key: tuple[str, ...], now: float) -> list[Effect]:
        """§8.2.2.3 Require: an option tag the gateway does not support (any but `siprec`) gets 420."""
        required = tokens_list(req.headers.get_all("Require"))
        unknown = [tag for tag in required if tag not in self.config.option_tags]
        if not unknown:
            return []
        return self._respond(key, 420, now, headers=[("Unsupported", ", ".join(unknown))])

    def _check_offer(self, req: SipRequest) -> tuple[int, list[tuple[str, str]], str | None] | None:
        """§8.2.3 content processing of an INVITE (or re-INVITE). What is inside the body (SDP, the
        parts of a SIPREC body) is the application's to judge."""
        accept_sdp = [("Accept", ", ".join(self.config.body_types))]
        encoding = req.headers.get("Content-Encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            return 415, [("Accept-Encoding", "identity"), *accept_sdp], None
        if req.body and req.content_type not in self.config.body_types:
            return 415, accept_sdp, None
        accepts = [a.split(";", 1)[0].strip().lower() for a in req.headers.values("Accept")]
        if "Accept" in req.headers and not {"application/sdp", "application/*", "*/*"} & set(accepts):
            # RFC 4475 sdp01: the answer would be SDP, which the caller says it cannot take.
            return 406, accept_sdp, None
        # No body: a delayed offer (§13.2.1): our 2xx makes the offer, the ACK brings the answer.
        return None

    def _merged(self, req: SipRequest, key: tuple[str, ...]) -> bool:
        """§8.2.2.2: same From tag, Call-ID and CSeq as a transaction in progress, another branch."""
        for call in self._calls.values():
            inv = call.invite
            if (
                call.invite_key != key
                and inv.call_id == req.call_id
                and inv.from_.tag == req.from_.tag
                and inv.cseq.seq == req.cseq.seq
            ):
                return True
        return False

    def _offer(self, req: SipRequest, key: tuple[str, ...], entry: _ServerEntry, now: float) -> list[Effect]:
        ref = self._new_ref()
        call = _Call(ref, req, entry.flow, key, make_tag())
        self._calls[ref] = call
        entry.call_ref = ref
        # §17.2.1: 100 Trying at once, so the caller stops retransmitting while we set up media.
        effects = self._respond(key, 100, now)
        effects.append(CallOffered(ref, req, entry.flow))
        return effects

    def _refuse(self, key: tuple[str, ...], decision: Decision, now: float) -> list[Effect]:
        self.counters.calls[decision.label] += 1
        headers = [] if decision.retry_after_s is None else [("Retry-After", str(decision.retry_after_s))]
        return self._respond(key, decision.status, now, headers=headers, warning=decision.reason)

    def _in_dialog(
        self, req: SipRequest, key: tuple[str, ...], entry: _ServerEntry, now: float
    ) -> list[Effect]:
        ref = self._dialogs.get((req.call_id, req.to.tag or "", req.from_.tag or ""))
        call = None if ref is None else self._calls.get(ref)
        if call is None or call.dialog is None:
            return self._respond(key, 481, now)
        dialog = call.dialog
        entry.call_ref = call.ref
        if dialog.state is DialogState.TERMINATED:
            # Our BYE crossed theirs (or a late retransmission): nothing left to end.
            return self._respond(key, 200 if req.method == "BYE" else 481, now)
        if unsupported := self._unsupported(req, key, now):
            return unsupported
        if not dialog.accept_remote_cseq(req):
            return self._respond(key, 500, now, warning="CSeq out of order")
        if req.method == "BYE":
            return self._on_bye(call, key, now)
        if req.method == "OPTIONS":
            return self._respond(key, 200, now, headers=self._capabilities())
        # re-INVITE (§14.2)
        if call.phase is CallPhase.OFFERED or call.reoffer_key is not None:
            # An INVITE is still pending on this dialog: 500 with Retry-After (§14.2).
            return self._respond(key, 500, now, headers=[("Retry-After", "1")], warning="INVITE pending")
        if call.phase is CallPhase.ENDING:
            return self._respond(key, 481, now)
        refusal = self._check_offer(req) if req.body else None
        if refusal is not None:
            status, headers, warning = refusal
            return self._respond(key, status, now, headers=headers, warning=warning)
        dialog.apply("reinvite")
        call.reoffer_key = key
        effects = self._respond(key, 100, now)
        effects.append(SessionReoffered(call.ref, req))
        return effects

    def _on_bye(self, call: _Call, key: tuple[str, ...], now: float) -> list[Effect]:
        assert call.dialog is not None
        effects: list[Effect] = []
        invite = self._server.get(call.invite_key)
        early = call.dialog.state is DialogState.EARLY
        call.dialog.apply("bye_received")
        effects += self._respond(key, 200, now)
        if early and invite is not None and not invite.tx.final_sent:
            # §15.1.2: a BYE on an early dialog ends the pending INVITE with 487.
            effects += self._respond(call.invite_key, 487, now, to_tag=call.local_tag)
            effects.append(CallCancelled(call.ref))
        else:
            effects.append(CallEndedByPeer(call.ref))
        self._forget(call)
        return effects

    def _on_cancel(self, req: SipRequest, key: tuple[str, ...], flow: Flow, now: float) -> list[Effect]:
        # §9.2: CANCEL is its own transaction; it matches the INVITE by the INVITE's transaction key.
        tx = NonInviteServerTransaction(req, reliable=flow.reliable, timers=self.config.timers, now=now)
        invite = self._server.get(server_key(req, method="INVITE"))
        # §9.2: the 200 to a CANCEL carries the To tag of our answer to the INVITE.
        self._server[key] = _ServerEntry(tx, flow, None if invite is None else invite.call_ref)
        if invite is None:
            return self._respond(key, 481, now)
        effects = self._respond(key, 200, now)
        call = self._calls.get(invite.call_ref or "")
        if invite.tx.final_sent or call is None:
            return effects  # too late: the INVITE was answered; CANCEL has no effect (§9.2)
        effects += self._respond(self._key_of(invite), 487, now, to_tag=call.local_tag)
        if self._key_of(invite) == call.invite_key:
            self.counters.calls["cancelled"] += 1
            effects.append(CallCancelled(call.ref))
            self._forget(call)
        else:
            call.reoffer_key = None  # a cancelled re-INVITE: the session stays as it was
        return effects

    def _on_ack(self, req: SipRequest, now: float) -> list[Effect]:
        key = server_key(req)
        entry = self._server.get(key)
        if entry is not None and entry.tx.state in (TxState.COMPLETED, TxState.CONFIRMED):
            entry.tx.receive_request(req, now)  # ACK of an error response (same transaction)
            self._track("s", key)
            return []
        ref = self._dialogs.get((req.call_id, req.to.tag or "", req.from_.tag or ""))
        call = None if ref is None else self._calls.get(ref)
        if call is None:
            return []  # §17.2.1: an ACK that matches nothing is dropped, never answered
        rtx = call.rtx.get(req.cseq.seq)
        if rtx is None or rtx.acked:
            return []
        rtx.ack()
        effects: list[Effect] = []
        if req.cseq.seq == call.invite.cseq.seq:
            if call.phase is not CallPhase.ENDING:
                call.phase = CallPhase.CONFIRMED
                effects.append(CallConfirmed(call.ref, req.body))
        elif call.phase is not CallPhase.ENDING:
            effects.append(ReofferConfirmed(call.ref, req.body))
        if call.bye_pending:
            effects += self._send_bye(call, now)
        return effects

    # --- input: application ---

    def ring(self, call_ref: str, now: float) -> list[Effect]:
        """180 Ringing with our To tag (an early dialog)."""
        call = self._calls.get(call_ref)
        if call is None or call.phase is not CallPhase.OFFERED:
            return []
        if call.dialog is None:
            self._create_dialog(call)
        assert call.dialog is not None
        call.dialog.apply("provisional")
        return self._respond(call.invite_key, 180, now, to_tag=call.local_tag)

    def answer(
        self,
        call_ref: str,
        sdp: bytes,
        now: float,
        *,
        contact_host: str | None = None,
        recording: bool = False,
    ) -> list[Effect]:
        """200 OK with our SDP answer; retransmitted until the ACK (§13.3.1.4). [] if the call is gone.

        `contact_host` overrides the configured host in Contact (the address the peer reached us on).
        `recording`: the call is a SIPREC recording session, so this and every later 2xx of the dialog
        marks our Contact `+sip.srs` and, when the SRC listed `siprec` in Require or Supported, carries
        `Require: siprec` (RFC 7866; RFC 3261 §8.2.2.3: an extension applied to a response is listed
        in its Require, and only one the request named).
        """
        call = self._calls.get(call_ref)
        if call is None or call.phase is not CallPhase.OFFERED:
            return []
        if call.dialog is None:
            self._create_dialog(call)
        assert call.dialog is not None
        call.dialog.apply("answer")
        call.phase = CallPhase.ANSWERED
        self.counters.calls["admitted"] += 1
        call.contact_host = contact_host
        call.recording = recording and self.config.siprec
        return self._answer_2xx(call, call.invite_key, sdp, now)

    def reject(
        self, call_ref: str, status: int, now: float, *, warning: str | None = None, result: str = "failed"
    ) -> list[Effect]:
        """A final error response to the initial INVITE (e.g. 488 after SDP negotiation, 503).

        `result` labels the outcome in ttg_calls_total (e.g. rejected_media, failed, ended_setup).
        """
        call = self._calls.get(call_ref)
        if call is None or call.phase is not CallPhase.OFFERED:
            return []
        self.counters.calls[result] += 1
        if call.dialog is not None:
            call.dialog.apply("reject")
        retry = self.config.admission.retry_after_s
        headers = [("Retry-After", str(retry))] if status == 503 else []
        effects = self._respond(
            call.invite_key, status, now, to_tag=call.local_tag, headers=headers, warning=warning
        )
        self._forget(call)
        return effects

    def answer_reoffer(
        self, call_ref: str, sdp: bytes, now: float, *, contact_host: str | None = None
    ) -> list[Effect]:
        call = self._calls.get(call_ref)
        if call is None or call.reoffer_key is None:
            return []
        if contact_host:
            call.contact_host = contact_host
        key, call.reoffer_key = call.reoffer_key, None
        return self._answer_2xx(call, key, sdp, now)

    def reject_reoffer(
        self, call_ref: str, status: int, now: float, *, warning: str | None = None
    ) -> list[Effect]:
        """An error to a re-INVITE leaves the session as it was (§14.2)."""
        call = self._calls.get(call_ref)
        if call is None or call.reoffer_key is None:
            return []
        key, call.reoffer_key = call.reoffer_key, None
        return self._respond(key, status, now, warning=warning)

    def hangup(self, call_ref: str, now: float, *, reason: str | None = None) -> list[Effect]:
        """End a call from our side: an error response while still offered, else BYE (§15).

        `reason` becomes an RFC 3326 Reason header text. A BYE waits for the ACK of our 2xx (§15:
        not before it arrives or its wait times out).
        """
        call = self._calls.get(call_ref)
        if call is None:
            return []
        if call.phase is CallPhase.OFFERED:
            return self.reject(call_ref, 480, now, warning=reason, result="failed")
        if call.phase is CallPhase.ENDING:
            return []
        call.phase = CallPhase.ENDING
        call.bye_reason = reason
        initial = call.rtx.get(call.invite.cseq.seq)
        if initial is not None and not initial.acked and not initial.expired:
            call.bye_pending = True
            return []
        return self._send_bye(call, now)

    # --- timers ---

    # One heap of (deadline, n, kind, id) for every timer-owning object: "s" server transaction (key),
    # "c" client transaction (branch), "r" 2xx retransmission ((call_ref, CSeq)). An entry is stale
    # when its object is gone or has another deadline now; stale entries are skipped when met.

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap:
            at, _, kind, ident = heap[0]
            if self._deadline_of(kind, ident) == at:
                return at
            heapq.heappop(heap)
        return None

    def handle_timer(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, kind, ident = heapq.heappop(heap)
            if self._deadline_of(kind, ident) != at:
                continue
            effects += self._fire(kind, ident, now)
            self._track(kind, ident)
        return effects

    def _deadline_of(self, kind: str, ident: Any) -> float | None:
        if kind == "s":
            entry = self._server.get(ident)
            return None if entry is None else entry.tx.next_deadline()
        if kind == "c":
            client = self._client.get(ident)
            return None if client is None else client[0].next_deadline()
        ref, seq = ident
        call = self._calls.get(ref)
        rtx = None if call is None else call.rtx.get(seq)
        return None if rtx is None else rtx.next_deadline()

    def _track(self, kind: str, ident: Any) -> None:
        at = self._deadline_of(kind, ident)
        if at is not None:
            heapq.heappush(self._heap, (at, next(self._heap_n), kind, ident))

    def _fire(self, kind: str, ident: Any, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if kind == "s":
            entry = self._server[ident]
            effects += self._wrap(entry.tx.handle_timer(now), entry.flow, entry.tx.request)
            if entry.tx.state is TxState.TERMINATED:
                del self._server[ident]
        elif kind == "c":
            tx, flow, ref = self._client[ident]
            for eff in tx.handle_timer(now):
                if isinstance(eff, Transmit):
                    effects.append(Send(eff.data, flow, flow.remote))
            if tx.state is TxState.TERMINATED:
                effects += self._release(ref, ident, tx.response.status if tx.response else None)
        else:
            ref, seq = ident
            call = self._calls[ref]
            for eff in call.rtx[seq].handle_timer(now):
                if isinstance(eff, Transmit):
                    effects.append(Send(eff.data, call.flow, self._reply_dest(call.invite.via[0], call.flow)))
                elif seq == call.invite.cseq.seq:
                    # §13.3.1.4: no ACK for the 2xx: the session should end with a BYE.
                    if call.bye_pending:
                        effects += self._send_bye(call, now)
                    else:
                        effects.append(CallAckTimeout(call.ref))
        return effects

    # --- helpers ---

    def _create_dialog(self, call: _Call) -> None:
        call.dialog = Dialog.from_invite(call.invite, call.local_tag)
        self._dialogs[call.dialog.id] = call.ref

    def _answer_2xx(self, call: _Call, key: tuple[str, ...], sdp: bytes, now: float) -> list[Effect]:
        contact = self._contact(call.flow, call.contact_host)
        extensions: list[tuple[str, str]] = []
        if call.recording:
            contact += f";{SRS_FEATURE_TAG}"
            named = tokens_list(
                [*call.invite.headers.get_all("Require"), *call.invite.headers.get_all("Supported")]
            )
            if SIPREC_TAGS & set(named):
                extensions.append(("Require", ", ".join(sorted(SIPREC_TAGS))))
        headers = [
            ("Contact", contact),
            *self._capabilities(accept=False),
            *extensions,
            ("Content-Type", "application/sdp"),
        ]
        effects = self._respond(key, 200, now, to_tag=call.local_tag, headers=headers, body=sdp)
        entry = self._server[key]
        assert entry.tx.last_response is not None
        seq = entry.tx.request.cseq.seq
        call.rtx[seq] = AnswerRetransmission(
            serialize(entry.tx.last_response), timers=self.config.timers, now=now
        )
        self._track("r", (call.ref, seq))
        return effects

    def _send_bye(self, call: _Call, now: float) -> list[Effect]:
        call.bye_pending = False
        call.phase = CallPhase.ENDING
        if call.dialog is None or call.dialog.state is not DialogState.CONFIRMED:
            self._forget(call)
            return []
        call.dialog.apply("bye_sent")
        transport = "TCP" if call.flow.reliable else "UDP"
        host = call.contact_host or self.config.host
        via = Via(transport, host, self.config.port, (("branch", make_branch()), ("rport", None)))
        extra: list[tuple[str, str]] = [("User-Agent", self.config.user_agent)]
        if call.bye_reason:
            # RFC 3326 Reason header: why the gateway ended the call.
            extra.append(("Reason", f"SIP;cause=200;text={quote(call.bye_reason)}"))
        bye = call.dialog.make_request("BYE", via, extra=tuple(extra))
        tx = NonInviteClientTransaction(bye, reliable=call.flow.reliable, timers=self.config.timers, now=now)
        branch = via.branch or ""
        self._client[branch] = (tx, call.flow, call.ref)
        call.bye_branch = branch
        self._track("c", branch)
        return [
            Send(eff.data, call.flow, call.flow.remote) for eff in tx.start() if isinstance(eff, Transmit)
        ]

    def _release(self, ref: str, branch: str, status: int | None) -> list[Effect]:
        self._client.pop(branch, None)
        call = self._calls.get(ref)
        if call is not None:
            self._forget(call)
        return [CallReleased(ref, status)]

    def _forget(self, call: _Call) -> None:
        """Drop the call from the core (its transactions live on to absorb retransmissions)."""
        call.phase = CallPhase.ENDING
        if call.bye_branch is not None and call.bye_branch in self._client:
            return  # kept until the BYE transaction ends
        self._calls.pop(call.ref, None)
        if call.dialog is not None:
            self._dialogs.pop(call.dialog.id, None)

    @staticmethod
    def _key_of(entry: _ServerEntry) -> tuple[str, ...]:
        return server_key(entry.tx.request)

    def _capabilities(self, accept: bool = True) -> list[tuple[str, str]]:
        headers = [("Allow", ", ".join(ALLOWED_METHODS))]
        if accept:
            headers.append(("Accept", ", ".join(self.config.body_types)))
        headers.append(("Supported", ", ".join(sorted(self.config.option_tags))))
        return headers

    def _contact(self, flow: Flow, host: str | None = None) -> str:
        transport = ";transport=tcp" if flow.reliable else ""
        return f"<sip:{_host_for_uri(host or self.config.host)}:{self.config.port}{transport}>"

    def _respond(
        self,
        key: tuple[str, ...],
        status: int,
        now: float,
        *,
        to_tag: str | None = None,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
        warning: str | None = None,
    ) -> list[Effect]:
        entry = self._server[key]
        req = entry.tx.request
        if to_tag is None and status != 100 and not req.to.tag:
            # §8.2.6.2: a final response outside a dialog carries a To tag of ours.
            call = self._calls.get(entry.call_ref or "")
            to_tag = call.local_tag if call is not None else make_tag()
        extra = list(headers or [])
        if warning:
            extra.append(("Warning", f"399 {self.config.host} {quote(warning)}"))
        response = _response(
            req, entry.flow, status, to_tag=to_tag, headers=extra, body=body, server=self.config.user_agent
        )
        self.counters.responses[str(status)] += 1
        effects = self._wrap(entry.tx.respond(response, now), entry.flow, req)
        self._track("s", key)
        return effects

    def _stateless(self, req: SipRequest, flow: Flow, status: int) -> Send:
        response = _response(
            req, flow, status, to_tag=None if req.to.tag else make_tag(), server=self.config.user_agent
        )
        self.counters.responses[str(status)] += 1
        return Send(serialize(response), flow, self._reply_dest(req.via[0], flow))

    def _wrap(self, effects: list[TxEffect], flow: Flow, req: SipRequest) -> list[Effect]:
        dest = self._reply_dest(req.via[0], flow)
        return [Send(e.data, flow, dest) for e in effects if isinstance(e, Transmit)]

    @staticmethod
    def _reply_dest(via: Via | None, flow: Flow) -> Address:
        """§18.2.2 + RFC 3581 §4, always toward the packet's source IP (never a host from the message)."""
        if via is None or via.has_rport:
            return flow.remote
        # UDP without rport; for TCP this is used only when the connection is gone (reconnect there).
        return (flow.remote[0], via.port or 5060)


def _host_for_uri(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _stamp_via(via: Via, flow: Flow) -> Via:
    """§18.2.1: add `received` when the sent-by host differs from the source; RFC 3581: fill `rport`."""
    ip, port = flow.remote
    out = via
    if via.has_rport:
        out = out.with_param("rport", str(port)).with_param("received", ip)
    elif via.host.strip("[]") != ip:
        out = out.with_param("received", ip)
    return out


def _response(
    req: SipRequest,
    flow: Flow,
    status: int,
    *,
    to_tag: str | None,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    server: str = "ttg",
) -> SipResponse:
    """A response to `req` (§8.2.6.2): Via (top one stamped), From, To (+tag), Call-ID, CSeq copied."""
    raw_vias = req.headers.get_all("Via")
    first = split_list(raw_vias[0])
    top = _stamp_via(req.via[0], flow)
    first[0] = str(top) if top is not req.via[0] else first[0]
    via_lines = [", ".join(first), *raw_vias[1:]]
    to = req.to.with_tag(to_tag) if to_tag and not req.to.tag else req.to
    to_value = str(to) if to is not req.to else (req.headers.get("To") or str(req.to))
    items: list[tuple[str, str]] = [("Via", v) for v in via_lines]
    items += [
        ("From", req.headers.get("From") or str(req.from_)),
        ("To", to_value),
        ("Call-ID", req.call_id),
        ("CSeq", str(req.cseq)),
    ]
    if status == 100 and "Timestamp" in req.headers:
        items.append(("Timestamp", req.headers.get("Timestamp") or ""))  # §8.2.6.1
    items.append(("Server", server))
    items += headers or []
    vias = (top, *req.via[1:])
    return SipResponse(
        status, reason_phrase(status), Headers(tuple(items)), body, vias, req.from_, to, req.call_id, req.cseq
    )


def _raw_response(headers: Headers, status: int, why: str, server: str) -> bytes:
    """A response to a request that could not be parsed: the routing fields copied as received."""
    lines = [f"SIP/2.0 {status} {reason_phrase(status)}"]
    lines += [f"Via: {v}" for v in headers.get_all("Via")]
    for name in ("From", "To", "Call-ID", "CSeq"):
        value = headers.get(name)
        if value is not None:
            lines.append(f"{name}: {value}")
    lines.append(f"Server: {server}")
    lines.append(f"Warning: 399 - {quote(why[:200])}")
    lines.append("Content-Length: 0")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "replace")
