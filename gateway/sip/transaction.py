"""SIP transactions (RFC 3261 §17, RFC 6026): pure state machines with their timers as outputs.

Theory of operation
-------------------
Each class is driven by three inputs and returns a list of effects; it owns no socket and no clock:

- messages from the peer (`receive_request` / `receive_response`),
- messages from the transaction user (`respond` / the request given to the constructor),
- its timer: `next_deadline()` says when `handle_timer(now)` must be called (None = no timer).

Effects are `Transmit(data)` (the caller knows where: the transaction's flow) and `TimedOut(timer)`.
Every state change goes through the `TRANSITIONS` table of the class; an input the table does not allow
raises `TransactionStateError` and leaves the state unchanged.

Server transactions (what a UAS has):

- INVITE (§17.2.1 + RFC 6026 §7.1): PROCEEDING -1xx-> PROCEEDING; -2xx-> ACCEPTED (Timer L = 64*T1
  absorbs INVITE retransmissions, then TERMINATED); -300..699-> COMPLETED (Timer G retransmits the
  response over unreliable transports, T1 doubling up to T2; Timer H = 64*T1 gives up) -ACK-> CONFIRMED
  (Timer I = T4, 0 over reliable transports) -> TERMINATED.
- non-INVITE (§17.2.2): TRYING -1xx-> PROCEEDING -final-> COMPLETED (Timer J = 64*T1, 0 reliable)
  -> TERMINATED; request retransmissions are answered with the last response.

`AnswerRetransmission` is the UAS core's 2xx duty of §13.3.1.4 (a 2xx is retransmitted end to end,
T1 doubling up to T2, until its ACK arrives, giving up after 64*T1).

Client transaction (the gateway's own BYE): non-INVITE (§17.1.2): TRYING (Timer E retransmits over
unreliable transports; Timer F = 64*T1 times out) -1xx-> PROCEEDING -final-> COMPLETED (Timer K = T4,
0 reliable) -> TERMINATED.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from gateway.sip.headers import MAGIC_COOKIE
from gateway.sip.message import SipRequest, SipResponse, serialize


@dataclass(frozen=True, slots=True)
class TimerConfig:
    """§17.1.1.1 defaults: T1 = RTT estimate, T2 = the most a non-INVITE retransmit interval grows, T4 =
    the longest a message stays in the network."""

    t1: float = 0.5
    t2: float = 4.0
    t4: float = 5.0


@dataclass(frozen=True, slots=True)
class Transmit:
    data: bytes
    retransmission: bool = False


@dataclass(frozen=True, slots=True)
class TimedOut:
    timer: str  # "H": no ACK for an error response; "F": no response to our request; "L": no ACK for 2xx


TxEffect = Transmit | TimedOut


class TxState(enum.Enum):
    TRYING = "trying"
    PROCEEDING = "proceeding"
    ACCEPTED = "accepted"
    COMPLETED = "completed"
    CONFIRMED = "confirmed"
    TERMINATED = "terminated"


class TransactionStateError(Exception):
    """An input the transaction's state table does not allow (a bug in the caller)."""


def _klass(status: int) -> str:
    return "1xx" if status < 200 else "2xx" if status < 300 else "final"


# --- keys (§17.2.3) ---------------------------------------------------------------------------------


def server_key(request: SipRequest, method: str | None = None) -> tuple[str, ...]:
    """The key that matches a request to a server transaction (§17.2.3).

    RFC 3261 branches (magic cookie plus something) match on branch + sent-by + method, with ACK
    mapped to INVITE. Otherwise (RFC 2543 clients, or a bare cookie as in RFC 4475 badbranch) the
    Request-URI, From tag, Call-ID, CSeq number and the top Via identify the transaction. `method`
    overrides the request's (CANCEL looks up the INVITE it cancels).
    """
    top = request.via[0]
    m = method or ("INVITE" if request.method == "ACK" else request.method)
    branch = top.branch or ""
    if branch.startswith(MAGIC_COOKIE) and len(branch) > len(MAGIC_COOKIE):
        return ("3261", branch, top.sent_by.lower(), m)
    return ("2543", request.uri, request.from_.tag or "", request.call_id, str(request.cseq.seq), str(top), m)


class _Transaction:
    """What the three state machines share: the request, the transport's reliability, the timers, and
    the one way the state changes (`_go`: a `TRANSITIONS` entry, or `TransactionStateError`)."""

    KIND: ClassVar[str]  # how errors name the machine
    INITIAL: ClassVar[TxState]
    TRANSITIONS: ClassVar[dict[TxState, dict[str, TxState]]]

    def __init__(self, request: SipRequest, *, reliable: bool, timers: TimerConfig) -> None:
        self.request = request
        self.reliable = reliable
        self.timers = timers
        self.state = self.INITIAL

    def _go(self, event: str) -> None:
        nxt = self.TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise TransactionStateError(f"{self.KIND}: {event} not allowed in {self.state.value}")
        self.state = nxt


# --- server transactions ----------------------------------------------------------------------------


class InviteServerTransaction(_Transaction):
    """RFC 3261 §17.2.1 with RFC 6026's Accepted state. See the module docstring."""

    KIND = "INVITE server transaction"
    INITIAL = TxState.PROCEEDING
    TRANSITIONS: ClassVar[dict[TxState, dict[str, TxState]]] = {
        TxState.PROCEEDING: {"1xx": TxState.PROCEEDING, "2xx": TxState.ACCEPTED, "final": TxState.COMPLETED},
        TxState.ACCEPTED: {"2xx": TxState.ACCEPTED, "timer_L": TxState.TERMINATED},
        TxState.COMPLETED: {"ack": TxState.CONFIRMED, "timer_H": TxState.TERMINATED},
        TxState.CONFIRMED: {"ack": TxState.CONFIRMED, "timer_I": TxState.TERMINATED},
        TxState.TERMINATED: {},
    }

    def __init__(self, request: SipRequest, *, reliable: bool, timers: TimerConfig, now: float) -> None:
        super().__init__(request, reliable=reliable, timers=timers)
        self.last_response: SipResponse | None = None
        self._last_bytes: bytes | None = None
        self._deadline: float | None = None  # G (retransmit), H/I/L (state timers): see _timer_name
        self._timer_name: str | None = None
        self._g_interval = timers.t1
        self._h_deadline: float | None = None

    @property
    def final_sent(self) -> bool:
        return self.state is not TxState.PROCEEDING

    def respond(self, response: SipResponse, now: float) -> list[TxEffect]:
        self._go(_klass(response.status))
        self.last_response = response
        self._last_bytes = serialize(response)
        if self.state is TxState.ACCEPTED:
            # RFC 6026 §7.1: Timer L keeps the transaction alive to absorb INVITE retransmissions.
            self._set_timer("L", now + 64 * self.timers.t1)
        elif self.state is TxState.COMPLETED:
            self._h_deadline = now + 64 * self.timers.t1
            if self.reliable:
                self._set_timer("H", self._h_deadline)
            else:
                self._g_interval = self.timers.t1
                self._set_timer("G", now + self._g_interval)
        return [Transmit(self._last_bytes)]

    def receive_request(self, request: SipRequest, now: float) -> list[TxEffect]:
        """A retransmitted INVITE, or the ACK of a non-2xx final response (same branch)."""
        if request.method == "ACK":
            if self.state in (TxState.COMPLETED, TxState.CONFIRMED):
                first = self.state is TxState.COMPLETED
                self._go("ack")
                if first:
                    self._set_timer("I", now + (0.0 if self.reliable else self.timers.t4))
            # ACKs in other states belong to the 2xx (the core's dialog layer), never answered here.
            return []
        if self.state in (TxState.PROCEEDING, TxState.COMPLETED) and self._last_bytes is not None:
            # §17.2.1: a retransmitted INVITE gets the most recent provisional or the final again.
            return [Transmit(self._last_bytes, retransmission=True)]
        return []  # RFC 6026: absorbed in Accepted; nothing to say in Confirmed

    def handle_timer(self, now: float) -> list[TxEffect]:
        if self._deadline is None or now < self._deadline:
            return []
        name = self._timer_name
        if name == "G":
            assert self._last_bytes is not None and self._h_deadline is not None
            if now >= self._h_deadline:
                self._go("timer_H")
                self._clear_timer()
                return [TimedOut("H")]
            self._g_interval = min(2 * self._g_interval, self.timers.t2)
            self._set_timer("G", min(now + self._g_interval, self._h_deadline))
            return [Transmit(self._last_bytes, retransmission=True)]
        if name == "H":
            self._go("timer_H")
            self._clear_timer()
            return [TimedOut("H")]
        if name == "I":
            self._go("timer_I")
        elif name == "L":
            self._go("timer_L")
        self._clear_timer()
        return []

    def next_deadline(self) -> float | None:
        return self._deadline

    def _set_timer(self, name: str, at: float) -> None:
        self._timer_name, self._deadline = name, at

    def _clear_timer(self) -> None:
        self._timer_name, self._deadline = None, None


class NonInviteServerTransaction(_Transaction):
    """RFC 3261 §17.2.2."""

    KIND = "non-INVITE server transaction"
    INITIAL = TxState.TRYING
    TRANSITIONS: ClassVar[dict[TxState, dict[str, TxState]]] = {
        TxState.TRYING: {"1xx": TxState.PROCEEDING, "2xx": TxState.COMPLETED, "final": TxState.COMPLETED},
        TxState.PROCEEDING: {"1xx": TxState.PROCEEDING, "2xx": TxState.COMPLETED, "final": TxState.COMPLETED},
        TxState.COMPLETED: {"timer_J": TxState.TERMINATED},
        TxState.TERMINATED: {},
    }

    def __init__(self, request: SipRequest, *, reliable: bool, timers: TimerConfig, now: float) -> None:
        super().__init__(request, reliable=reliable, timers=timers)
        self.last_response: SipResponse | None = None
        self._last_bytes: bytes | None = None
        self._deadline: float | None = None

    @property
    def final_sent(self) -> bool:
        return self.state in (TxState.COMPLETED, TxState.TERMINATED)

    def respond(self, response: SipResponse, now: float) -> list[TxEffect]:
        self._go(_klass(response.status))
        self.last_response = response
        self._last_bytes = serialize(response)
        if self.state is TxState.COMPLETED:
            self._deadline = now + (0.0 if self.reliable else 64 * self.timers.t1)
        return [Transmit(self._last_bytes)]

    def receive_request(self, request: SipRequest, now: float) -> list[TxEffect]:
        if self._last_bytes is not None and self.state in (TxState.PROCEEDING, TxState.COMPLETED):
            return [Transmit(self._last_bytes, retransmission=True)]
        return []  # Trying: absorbed until the TU answers

    def handle_timer(self, now: float) -> list[TxEffect]:
        if self._deadline is not None and now >= self._deadline:
            self._go("timer_J")
            self._deadline = None
        return []

    def next_deadline(self) -> float | None:
        return self._deadline


class AnswerRetransmission:
    """§13.3.1.4: the UAS core retransmits its 2xx until the ACK arrives, T1 doubling up to T2; after
    64*T1 without an ACK it gives up (`TimedOut("L")`) and the session should be ended with a BYE."""

    def __init__(self, data: bytes, *, timers: TimerConfig, now: float) -> None:
        self.data = data
        self.timers = timers
        self.acked = False
        self.expired = False
        self._interval = timers.t1
        self._next: float | None = now + timers.t1
        self._give_up = now + 64 * timers.t1

    def ack(self) -> None:
        self.acked = True
        self._next = None

    def handle_timer(self, now: float) -> list[TxEffect]:
        if self._next is None or now < self._next:
            return []
        if now >= self._give_up:
            self._next = None
            self.expired = True
            return [TimedOut("L")]
        self._interval = min(2 * self._interval, self.timers.t2)
        self._next = min(now + self._interval, self._give_up)
        return [Transmit(self.data, retransmission=True)]

    def next_deadline(self) -> float | None:
        return self._next


# --- client transaction -----------------------------------------------------------------------------


class NonInviteClientTransaction(_Transaction):
    """RFC 3261 §17.1.2: the gateway's BYE. `start(now)` returns the first transmission."""

    KIND = "non-INVITE client transaction"
    INITIAL = TxState.TRYING
    TRANSITIONS: ClassVar[dict[TxState, dict[str, TxState]]] = {
        TxState.TRYING: {
            "1xx": TxState.PROCEEDING,
            "2xx": TxState.COMPLETED,
            "final": TxState.COMPLETED,
            "timer_F": TxState.TERMINATED,
        },
        TxState.PROCEEDING: {
            "1xx": TxState.PROCEEDING,
            "2xx": TxState.COMPLETED,
            "final": TxState.COMPLETED,
            "timer_F": TxState.TERMINATED,
        },
        TxState.COMPLETED: {"timer_K": TxState.TERMINATED},
        TxState.TERMINATED: {},
    }

    def __init__(self, request: SipRequest, *, reliable: bool, timers: TimerConfig, now: float) -> None:
        super().__init__(request, reliable=reliable, timers=timers)
        self.response: SipResponse | None = None
        self._data = serialize(request)
        self._e_interval = timers.t1
        self._e_next: float | None = None if reliable else now + timers.t1
        self._f_deadline = now + 64 * timers.t1
        self._k_deadline: float | None = None

    @property
    def branch(self) -> str:
        return self.request.via[0].branch or ""

    def start(self) -> list[TxEffect]:
        return [Transmit(self._data)]

    def receive_response(self, response: SipResponse, now: float) -> list[TxEffect]:
        if self.state not in (TxState.TRYING, TxState.PROCEEDING):
            return []  # a retransmitted final: absorbed in Completed (§17.1.2.2)
        self._go(_klass(response.status))
        if self.state is TxState.PROCEEDING:
            # Timer E keeps firing, now at T2 (§17.1.2.2).
            if self._e_next is not None:
                self._e_interval = self.timers.t2
            return []
        self.response = response
        self._e_next = None
        self._k_deadline = now + (0.0 if self.reliable else self.timers.t4)
        return []

    def handle_timer(self, now: float) -> list[TxEffect]:
        out: list[TxEffect] = []
        if self.state in (TxState.TRYING, TxState.PROCEEDING):
            if now >= self._f_deadline:
                self._go("timer_F")
                self._e_next = None
                return [TimedOut("F")]
            if self._e_next is not None and now >= self._e_next:
                if self.state is TxState.TRYING:
                    self._e_interval = min(2 * self._e_interval, self.timers.t2)
                self._e_next = now + self._e_interval
                out.append(Transmit(self._data, retransmission=True))
        elif self.state is TxState.COMPLETED and self._k_deadline is not None and now >= self._k_deadline:
            self._go("timer_K")
            self._k_deadline = None
        return out

    def next_deadline(self) -> float | None:
        if self.state in (TxState.TRYING, TxState.PROCEEDING):
            return self._f_deadline if self._e_next is None else min(self._e_next, self._f_deadline)
        if self.state is TxState.COMPLETED:
            return self._k_deadline
        return None


ServerTransaction = InviteServerTransaction | NonInviteServerTransaction
