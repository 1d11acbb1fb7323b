"""One outgoing call as a pure state machine: the INVITE client transaction (RFC 3261 §17.1.1), the
dialog it creates (§12.1.2), ACK (§13.2.2.4 for 2xx, §17.1.1.3 for the rest), CANCEL (§9.1) and the
BYE non-INVITE client transaction (§17.1.2).

Driven by: `start(now)`, `receive(message, now)`, `hangup(now)` and `handle_timer(now)`; it returns
outputs: `Send` (bytes for the adapter to put on the wire) and call events (`Provisional`, `Answered`,
`Rejected`, `Failed`, `Ended`). `next_deadline()` says when `handle_timer` is due. No sockets, no
clock: the adapter passes `now` (monotonic seconds).

Theory of operation:
    CALLING --1xx--> PROCEEDING --2xx--> CONFIRMED --hangup--> TERMINATING --final--> TERMINATED
    CALLING/PROCEEDING --3xx..6xx--> TERMINATED (ACK sent; retransmitted finals are ACKed again)
    PROCEEDING --hangup or setup timeout--> CANCELLING --487--> TERMINATED
    CALLING --Timer B--> TERMINATED; TERMINATING --Timer F--> TERMINATED
On UDP, INVITE is retransmitted at T1, 2T1, 4T1... (Timer A) until a response; BYE and CANCEL at
T1 doubling up to T2 (Timer E), at T2 once a provisional arrived. Reliable transports (TCP) do not
retransmit (§17.1.1.2, §17.1.2.2) but keep the timeouts.
"""

from __future__ import annotations

import enum
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from tools.replay import sipmsg
from tools.replay.sipmsg import SipMessage

ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS"


def random_token() -> str:
    return secrets.token_hex(8)


class CallState(enum.Enum):
    IDLE = "idle"
    CALLING = "calling"
    PROCEEDING = "proceeding"
    CANCELLING = "cancelling"
    CONFIRMED = "confirmed"
    TERMINATING = "terminating"
    TERMINATED = "terminated"


@dataclass(frozen=True, slots=True)
class Send:
    data: bytes


@dataclass(frozen=True, slots=True)
class Provisional:
    status: int


@dataclass(frozen=True, slots=True)
class Answered:
    sdp: bytes
    setup_s: float  # first INVITE sent → 2xx received


@dataclass(frozen=True, slots=True)
class Rejected:
    status: int
    reason: str
    retry_after_s: float | None


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


@dataclass(frozen=True, slots=True)
class Ended:
    reason: str  # "bye" (ours answered 2xx), "remote_bye", "bye_timeout", "bye_<status>"


Output = Send | Provisional | Answered | Rejected | Failed | Ended


@dataclass(frozen=True, slots=True)
class UacParams:
    call_id: str
    local_host: str
    local_port: int
    transport: str  # "UDP" or "TCP"
    request_uri: str  # sip:user@host:port
    from_uri: str
    to_uri: str
    sdp_offer: bytes  # the INVITE body: an SDP offer, or a SIPREC multipart body
    contact_user: str = "replay"
    content_type: str = "application/sdp"
    contact_params: str = ""  # after the Contact's URI, e.g. ";+sip.src" (RFC 7866: an SRC says so)
    extra_headers: tuple[tuple[str, str], ...] = ()
    t1_s: float = 0.5
    t2_s: float = 4.0
    setup_timeout_s: float = 32.0

    @property
    def reliable(self) -> bool:
        return self.transport.upper() != "UDP"


class _ClientTx:
    """Retransmission and timeout bookkeeping of one client transaction."""

    def __init__(self, data: bytes, now: float, p: UacParams, cap: float | None) -> None:
        self.data = data
        self.interval = p.t1_s
        self.cap = cap  # None: INVITE (Timer A doubles without a cap); T2 for non-INVITE (Timer E)
        self.retx_at: float | None = None if p.reliable else now + p.t1_s
        self.timeout_at = now + 64 * p.t1_s  # Timer B / Timer F
        self.t2 = p.t2_s
        self.retransmits = 0

    def proceeding(self) -> None:
        if self.cap is None:
            self.retx_at = None  # INVITE: a provisional stops Timer A
        elif self.retx_at is not None:
            self.interval = self.t2  # non-INVITE: keep retransmitting at T2 (§17.1.2.2)

    def fire(self, now: float) -> bytes | None:
        if self.retx_at is None or now < self.retx_at:
            return None
        self.interval = self.interval * 2 if self.cap is None else min(self.interval * 2, self.cap)
        self.retx_at = now + self.interval
        self.retransmits += 1
        return self.data

    def deadlines(self) -> list[float]:
        return [t for t in (self.retx_at, self.timeout_at) if t is not None]


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    m = re.match(r"\s*(\d+)", value)  # RFC 3261 §20.33: delta-seconds [comment] *(;param)
    return float(m.group(1)) if m else None


class UacCall:
    def __init__(self, params: UacParams, new_token: Callable[[], str] = random_token) -> None:
        self.p = params
        self._token = new_token
        self.state = CallState.IDLE
        self.local_tag = new_token()
        self.remote_tag: str | None = None
        self.remote_target: str | None = None
        self.route_set: list[str] = []
        self._invite_branch = "z9hG4bK" + new_token()
        self._invite: _ClientTx | None = None
        self._invite_sent_at = 0.0
        self._setup_deadline: float | None = None
        self._ack_2xx: bytes | None = None
        self._ack_final: bytes | None = None
        self._cancel: _ClientTx | None = None
        self._cancel_wanted = False
        self._cancel_reason = ""
        self._bye: _ClientTx | None = None
        self._bye_branch = ""
        self.final_status: int | None = None
        self.bye_status: int | None = None

    # --- counters for the report ---
    @property
    def invite_retransmits(self) -> int:
        return self._invite.retransmits if self._invite else 0

    @property
    def bye_retransmits(self) -> int:
        return self._bye.retransmits if self._bye else 0

    # --- message building ---
    def _via(self, branch: str) -> str:
        sent_by = f"{self.p.local_host}:{self.p.local_port}"
        return f"SIP/2.0/{self.p.transport.upper()} {sent_by};branch={branch};rport"

    def _contact(self) -> str:
        transport = self.p.transport.lower()
        uri = f"sip:{self.p.contact_user}@{self.p.local_host}:{self.p.local_port};transport={transport}"
        return f"<{uri}>{self.p.contact_params}"

    def _from(self) -> str:
        return f"<{self.p.from_uri}>;tag={self.local_tag}"

    def _to(self, tag: str | None) -> str:
        return f"<{self.p.to_uri}>" + (f";tag={tag}" if tag else "")

    def _build_invite(self) -> bytes:
        headers = [
            ("Via", self._via(self._invite_branch)),
            ("Max-Forwards", "70"),
            ("From", self._from()),
            ("To", self._to(None)),
            ("Call-ID", self.p.call_id),
            ("CSeq", "1 INVITE"),
            ("Contact", self._contact()),
            ("Allow", ALLOW),
            ("User-Agent", "ttg-replay"),
            *self.p.extra_headers,
            ("Content-Type", self.p.content_type),
        ]
        return sipmsg.serialize(f"INVITE {self.p.request_uri} SIP/2.0", headers, self.p.sdp_offer)

    def _in_dialog(self, method: str, cseq: int, branch: str) -> bytes:
        """ACK-for-2xx and BYE: to the remote target, through the route set (§12.2.1.1)."""
        headers = [
            ("Via", self._via(branch)),
            ("Max-Forwards", "70"),
            *(("Route", r) for r in self.route_set),
            ("From", self._from()),
            ("To", self._to(self.remote_tag)),
            ("Call-ID", self.p.call_id),
            ("CSeq", f"{cseq} {method}"),
            ("User-Agent", "ttg-replay"),
        ]
        target = self.remote_target or self.p.request_uri
        return sipmsg.serialize(f"{method} {target} SIP/2.0", headers)

    def _same_tx_request(self, method: str, to: str) -> bytes:
        """ACK for a non-2xx final (§17.1.1.3) and CANCEL (§9.1): the INVITE's branch, URI and CSeq number."""
        headers = [
            ("Via", self._via(self._invite_branch)),
            ("Max-Forwards", "70"),
            ("From", self._from()),
            ("To", to),
            ("Call-ID", self.p.call_id),
            ("CSeq", f"1 {method}"),
            ("User-Agent", "ttg-replay"),
        ]
        return sipmsg.serialize(f"{method} {self.p.request_uri} SIP/2.0", headers)

    # --- inputs ---
    def start(self, now: float) -> list[Output]:
        if self.state is not CallState.IDLE:
            return []
        data = self._build_invite()
        self._invite = _ClientTx(data, now, self.p, cap=None)
        self._invite_sent_at = now
        self._setup_deadline = now + self.p.setup_timeout_s
        self.state = CallState.CALLING
        return [Send(data)]

    def hangup(self, now: float) -> list[Output]:
        if self.state is CallState.CONFIRMED:
            return self._send_bye(now)
        if self.state is CallState.PROCEEDING:
            return self._send_cancel(now, "hung up before answer")
        if self.state is CallState.CALLING:
            # §9.1: a CANCEL SHOULD NOT be sent before a provisional response; send it when one comes.
            self._cancel_wanted = True
            self._cancel_reason = "hung up before answer"
        return []

    def receive(self, msg: SipMessage, now: float) -> list[Output]:
        if msg.call_id != self.p.call_id:
            return []
        if msg.is_request:
            return self._receive_request(msg)
        _, method = msg.cseq
        if method == "INVITE" and msg.top_via_branch == self._invite_branch:
            return self._invite_response(msg, now)
        if method == "BYE" and self._bye is not None and msg.top_via_branch == self._bye_branch:
            return self._bye_response(msg)
        if method == "CANCEL" and self._cancel is not None:
            if msg.status is not None and msg.status >= 200:
                self._cancel.retx_at = None
            else:
                self._cancel.proceeding()
        return []

    def handle_timer(self, now: float) -> list[Output]:
        out: list[Output] = []
        if self._invite is not None and self.state is CallState.CALLING:
            data = self._invite.fire(now)
            if data is not None:
                out.append(Send(data))
            if now >= self._invite.timeout_at:  # Timer B
                self.state = CallState.TERMINATED
                out.append(Failed("timeout: no response to INVITE (Timer B)"))
                return out
        if (
            self.state is CallState.PROCEEDING
            and self._setup_deadline is not None
            and now >= self._setup_deadline
        ):
            out += self._send_cancel(now, f"no answer within {self.p.setup_timeout_s:g} s")
        if self._cancel is not None and self.state is CallState.CANCELLING:
            data = self._cancel.fire(now)
            if data is not None:
                out.append(Send(data))
            if now >= self._cancel.timeout_at:
                self.state = CallState.TERMINATED
                out.append(Failed(f"{self._cancel_reason}; no final response after CANCEL"))
        if self._bye is not None and self.state is CallState.TERMINATING:
            data = self._bye.fire(now)
            if data is not None:
                out.append(Send(data))
            if now >= self._bye.timeout_at:  # Timer F
                self.state = CallState.TERMINATED
                out.append(Ended("bye_timeout"))
        return out

    def next_deadline(self) -> float | None:
        times: list[float] = []
        if self.state is CallState.CALLING and self._invite is not None:
            times += self._invite.deadlines()
        elif self.state is CallState.PROCEEDING and self._setup_deadline is not None:
            times.append(self._setup_deadline)
        elif self.state is CallState.CANCELLING and self._cancel is not None:
            times += self._cancel.deadlines()
        elif self.state is CallState.TERMINATING and self._bye is not None:
            times += self._bye.deadlines()
        return min(times) if times else None

    @property
    def done(self) -> bool:
        return self.state is CallState.TERMINATED

    # --- internals ---
    def _send_cancel(self, now: float, reason: str) -> list[Output]:
        data = self._same_tx_request("CANCEL", self._to(None))
        self._cancel = _ClientTx(data, now, self.p, cap=self.p.t2_s)
        self._cancel_reason = reason
        self.state = CallState.CANCELLING
        return [Send(data)]

    def _send_bye(self, now: float) -> list[Output]:
        self._bye_branch = "z9hG4bK" + self._token()
        data = self._in_dialog("BYE", 2, self._bye_branch)
        self._bye = _ClientTx(data, now, self.p, cap=self.p.t2_s)
        self.state = CallState.TERMINATING
        return [Send(data)]

    def _invite_response(self, msg: SipMessage, now: float) -> list[Output]:
        status = msg.status or 0
        if status < 200:
            if self.state is CallState.CALLING:
                assert self._invite is not None
                self._invite.proceeding()
                self.state = CallState.PROCEEDING
                if self._cancel_wanted:
                    return [Provisional(status), *self._send_cancel(now, self._cancel_reason)]
                return [Provisional(status)]
            return []
        if status < 300:
            return self._invite_2xx(msg, now)
        # §17.1.1.3: ACK every non-2xx final (retransmissions too), in the INVITE's transaction.
        if self._ack_final is None:
            self._ack_final = self._same_tx_request("ACK", msg.get("to") or self._to(None))
        out: list[Output] = [Send(self._ack_final)]
        if self.state in (CallState.CALLING, CallState.PROCEEDING):
            self.final_status = status
            self.state = CallState.TERMINATED
            out.append(Rejected(status, msg.reason, _retry_after(msg.get("retry-after"))))
        elif self.state is CallState.CANCELLING:
            self.final_status = status
            self.state = CallState.TERMINATED
            out.append(Failed(self._cancel_reason))
        return out

    def _invite_2xx(self, msg: SipMessage, now: float) -> list[Output]:
        if self._ack_2xx is not None:
            return [Send(self._ack_2xx)]  # §13.2.2.4: ACK each retransmission of the 2xx
        if self.state not in (CallState.CALLING, CallState.PROCEEDING, CallState.CANCELLING):
            return []
        to = msg.get("to") or ""
        self.remote_tag = sipmsg.header_param(to, "tag")
        contact = msg.get("contact")
        self.remote_target = sipmsg.name_addr_uri(contact) if contact else self.p.request_uri
        # §12.1.2: the UAC's route set is the Record-Route list in reverse order.
        rr = [v for h in msg.get_all("record-route") for v in sipmsg.split_header_list(h)]
        self.route_set = list(reversed(rr))
        self._ack_2xx = self._in_dialog("ACK", 1, "z9hG4bK" + self._token())
        self.final_status = msg.status
        cancelling = self.state is CallState.CANCELLING
        self.state = CallState.CONFIRMED
        out: list[Output] = [Send(self._ack_2xx)]
        if cancelling:  # the 2xx won the race with our CANCEL: end the dialog with BYE (§9.1)
            out.append(Failed(self._cancel_reason))
            out += self._send_bye(now)
            return out
        out.append(Answered(msg.body, now - self._invite_sent_at))
        return out

    def _bye_response(self, msg: SipMessage) -> list[Output]:
        status = msg.status or 0
        assert self._bye is not None
        if status < 200:
            self._bye.proceeding()
            return []
        if self.state is not CallState.TERMINATING:
            return []
        self.bye_status = status
        self.state = CallState.TERMINATED
        return [Ended("bye" if status < 300 else f"bye_{status}")]

    def _receive_request(self, msg: SipMessage) -> list[Output]:
        method = msg.method or ""
        if method == "ACK":
            return []
        from_tag = sipmsg.header_param(msg.get("from") or "", "tag")
        in_dialog = self.remote_tag is not None and from_tag == self.remote_tag
        if method == "BYE":
            if not in_dialog:
                return [Send(sipmsg.response_to(msg, 481, "Call/Transaction Does Not Exist"))]
            out: list[Output] = [Send(sipmsg.response_to(msg, 200, "OK"))]
            if self.state is CallState.CONFIRMED:
                self.state = CallState.TERMINATED
                out.append(Ended("remote_bye"))
            return out
        if method == "OPTIONS":
            return [Send(sipmsg.response_to(msg, 200, "OK"))]
        if method == "INVITE":  # a re-INVITE: we keep the session as it is (§14.2)
            return [Send(sipmsg.response_to(msg, 488, "Not Acceptable Here"))]
        if method in ("INFO", "NOTIFY", "UPDATE") and in_dialog:
            return [Send(sipmsg.response_to(msg, 200, "OK"))]
        return [Send(sipmsg.response_to(msg, 501, "Not Implemented"))]
