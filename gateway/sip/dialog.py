"""The UAS side of a SIP dialog (RFC 3261 §12): its identity, state table and in-dialog requests (pure).

A dialog is created by our response with a To tag to an initial INVITE (§12.1.1): early with a 1xx,
confirmed with the 2xx; an error final response or a BYE (either direction) ends it. Only the
transitions in `TRANSITIONS` are allowed; anything else raises `DialogStateError` and changes nothing.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from gateway.sip.headers import (
    CSeq,
    HeaderSyntaxError,
    NameAddr,
    Via,
    has_param,
    parse_name_addr,
    parse_sip_uri,
    split_list,
)
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
        """An in-dialog request from us (§12.2.1.1). With a loose-routing first hop (its URI has `lr`, as
        every RFC 3261 proxy's does): Request-URI = remote target, Route = the route set. With a strict
        router (RFC 2543): Request-URI = the first route, Route = the rest, then the remote target."""
        self.local_seq += 1
        uri, routes = self.remote_target, self.route_set
        if routes and not _loose(routes[0]):
            uri, routes = routes[0][1:-1], (*routes[1:], f"<{self.remote_target}>")
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
        items.extend(("Route", r) for r in routes)
        items.extend(extra)
        return SipRequest(
            method=method,
            uri=uri,
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
    """The request's Record-Route values, one per element, in order, exactly as received."""
    return [p for v in request.headers.get_all("Record-Route") for p in split_list(v)]


def _loose(route: str) -> bool:
    """Whether a route-set entry ("<uri>") names a loose router (§16.12.1.1: the `lr` parameter)."""
    try:
        return has_param(parse_sip_uri(route[1:-1]).params, "lr")
    except HeaderSyntaxError:
        return True  # not a SIP URI we can read (e.g. tel:): leave the Request-URI alone
