"""The UAS side of a SIP dialog (RFC 3261 §12): its identity, state table and in-dialog requests (pure).

A dialog is created by our response with a To tag to an initial INVITE (§12.1.1): early with a 1xx,
confirmed with the 2xx; an error final response or a BYE (either direction) ends it. Only the
transitions in `TRANSITIONS` are allowed; anything else raises `DialogStateError` and changes nothing.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from gateway.sip.headers import CSeq, NameAddr, Via, parse_name_addr, split_list
from gateway.sip.message import Headers, SipRequest


class DialogState(enum.Enum):
    EARLY = "early"
    CONFIRMED = "confirmed"
    TERMINATED = "terminated"


class DialogStateError(Exception):
    """An input the dialog's state table does not allow (a bug in the caller)."""


# state -> {input -> next state}
TRANSITIONS: dict[DialogState, dict[str, DialogState]] = {
    DialogState.EARLY: {
        "provisional": DialogState.EARLY,
        "answer": DialogState.CONFIRMED,
        "reject": DialogState.TERMINATED,
    },
    DialogState.CONFIRMED: {
        "reinvite": DialogState.CONFIRMED,
        "bye_received": DialogState.TERMINATED,
        "bye_sent": DialogState.TERMINATED,
    },
    DialogState.TERMINATED: {},
}

DialogId = tuple[str, str, str]  # (Call-ID, local tag, remote tag)


@dataclass(slots=True)
class Dialog:
    """UAS dialog state (§12.1.1): built from the initial INVITE and our To tag."""

    call_id: str
    local_tag: str
    remote_tag: str  # "" for RFC 2543 peers without a From tag
    local_uri: NameAddr  # the INVITE's To, with our tag
    remote_uri: NameAddr  # the INVITE's From
    remote_target: str  # the INVITE's Contact URI (where in-dialog requests are addressed)
    route_set: tuple[str, ...]  # the INVITE's Record-Route, in order (§12.1.1)
    remote_seq: int
    local_seq: int = field(default_factory=lambda: secrets.randbelow(2**20) + 1)
    state: DialogState = DialogState.EARLY

    @classmethod
    def from_invite(cls, invite: SipRequest, local_tag: str) -> Dialog:
        contacts = invite.headers.values("Contact")
        target = parse_name_addr(contacts[0]).uri if contacts else invite.from_.uri
        routes = tuple(f"<{parse_name_addr(v).uri}>" for v in invite.headers.values("Record-Route"))
        return cls(
            call_id=invite.call_id,
            local_tag=local_tag,
            remote_tag=invite.from_.tag or "",
            local_uri=invite.to.with_tag(local_tag),
            remote_uri=invite.from_,
            remote_target=target,
            route_set=routes,
            remote_seq=invite.cseq.seq,
        )

    @property
    def id(self) -> DialogId:
        return (self.call_id, self.local_tag, self.remote_tag)

    def apply(self, event: str) -> DialogState:
        nxt = TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise DialogStateError(f"dialog {self.call_id}: {event} not allowed in {self.state.value}")
        self.state = nxt
        return nxt

    def accept_remote_cseq(self, request: SipRequest) -> bool:
        """§12.2.2: a request with a CSeq lower than the remote sequence number is out of order (500).

        ACK and CANCEL carry the CSeq of the request they belong to and are not checked.
        """
        if request.method in ("ACK", "CANCEL"):
            return True
        if request.cseq.seq <= self.remote_seq:
            # Equal is allowed only for the INVITE that created the dialog (its retransmissions are
            # matched by the transaction layer before reaching here).
            return False
        self.remote_seq = request.cseq.seq
        return True

    def make_request(self, method: str, via: Via, *, extra: tuple[tuple[str, str], ...] = ()) -> SipRequest:
        """An in-dialog request from us (§12.2.1.1): Request-URI = remote target, Route = route set."""
        self.local_seq += 1
        cseq = CSeq(self.local_seq, method)
        remote = self.remote_uri
        items: list[tuple[str, str]] = [
            ("Via", str(via)),
            ("Max-Forwards", "70"),
            ("From", str(self.local_uri)),
            ("To", str(remote)),
            ("Call-ID", self.call_id),
            ("CSeq", str(cseq)),
        ]
        items.extend(("Route", r) for r in self.route_set)
        items.extend(extra)
        return SipRequest(
            method=method,
            uri=self.remote_target,
            headers=Headers(tuple(items)),
            body=b"",
            via=(via,),
            from_=self.local_uri,
            to=remote,
            call_id=self.call_id,
            cseq=cseq,
            max_forwards=70,
        )


def record_route_values(request: SipRequest) -> list[str]:
    return [p for v in request.headers.get_all("Record-Route") for p in split_list(v)]
