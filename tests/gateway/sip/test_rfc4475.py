"""RFC 4475 torture messages: every one, through the parser and the UAS core, with the handling the RFC
asks of a UAS that takes no registrations (see /work/shared/conformance/rfc4475/README.md).

The messages name foreign hosts; the core answers the packet's source (127.0.0.1 here) and these tests
open no socket at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.sip.agent import AgentConfig, CallOffered, Flow, Send, UserAgent
from gateway.sip.message import SipParseError, SipRequest, SipResponse, parse_message

# The 49 messages of RFC 4475, byte for byte (README.md there: the expected handling).
CONFORMANCE = Path(__file__).resolve().parents[2] / "data" / "rfc4475"

# file -> what the UAS does: a status code, "call" (a new call offered to the application after
# 100 Trying), or None (silently discarded: responses, which a UAS never answers).
EXPECTED: dict[str, int | str | None] = {
    # §3.1.1 valid messages
    "wsinv": 481,  # valid, but it carries a To tag of a dialog we never had (§12.2.2)
    "intmeth": 501,  # an extension method nobody defined
    "esc01": "call",
    "escnull": 405,  # REGISTER: this gateway is no registrar
    "esc02": 501,  # "RE%47IST%45R" is a method token, not REGISTER
    "lwsdisp": 200,
    "longreq": "call",
    "dblreq": 405,  # the REGISTER; the trailing INVITE in the datagram is discarded (§18.3)
    "semiuri": 200,
    "transports": 200,
    "mpart01": 405,  # MESSAGE
    "unreason": None,
    "noreason": None,
    # §3.1.2 invalid messages
    "badinv01": 400,
    "clerr": 400,
    "ncl": 400,
    "scalar02": 400,
    "scalarlg": None,
    "quotbal": 400,
    "ltgtruri": 400,
    "lwsruri": 400,
    "lwsstart": 400,
    "trws": 400,
    "escruri": 400,
    "baddate": 400,
    "regbadct": 400,
    "badaspec": 400,
    "baddn": 400,
    "badvers": 505,
    "mismatch01": 400,
    "mismatch02": 400,
    "bigcode": None,
    # §3.2 transaction layer
    "badbranch": 200,
    # §3.3 application layer
    "insuf": 400,
    "unkscm": 416,
    "novelsc": 416,
    "unksm2": 405,
    "bext01": 420,
    "invut": 415,
    "regaut01": 405,
    "multi01": 400,
    "mcl01": 400,
    "bcast": None,
    "zeromf": 200,  # a UAS does not forward; Max-Forwards 0 matters to proxies only (§16.3)
    "cparam01": 405,
    "cparam02": 405,
    "regescrt": 405,
    "sdp01": 406,
    # §3.4 backward compatibility
    "inv2543": "call",
}

VALID = {"wsinv", "intmeth", "esc01", "escnull", "esc02", "lwsdisp", "longreq", "dblreq", "semiuri",
         "transports", "mpart01", "unreason", "noreason", "badbranch", "unkscm", "novelsc", "unksm2",
         "bext01", "invut", "regaut01", "zeromf", "cparam01", "cparam02", "regescrt", "sdp01", "inv2543",
         "bcast"}  # fmt: skip


def load(name: str) -> bytes:
    return (CONFORMANCE / f"{name}.dat").read_bytes()


def test_the_set_is_complete() -> None:
    names = {p.stem for p in CONFORMANCE.glob("*.dat")}
    assert names == set(EXPECTED), names ^ set(EXPECTED)
    assert len(names) == 49


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_torture_messages_parse(name: str) -> None:
    message = parse_message(load(name))
    assert isinstance(message, SipRequest | SipResponse)


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - VALID))
def test_invalid_torture_messages_are_rejected_by_the_parser(name: str) -> None:
    with pytest.raises(SipParseError) as info:
        parse_message(load(name))
    assert info.value.status in (400, 505)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_uas_handles_every_torture_message_as_rfc4475_asks(name: str) -> None:
    ua = UserAgent(AgentConfig(host="127.0.0.1", port=5060))
    source = ("127.0.0.1", 5070)
    effects = ua.receive(load(name), Flow("udp", source), now=0.0)
    sends = [e for e in effects if isinstance(e, Send)]
    expected = EXPECTED[name]
    for send in sends:
        # Never toward a host named in the message: always the packet's source IP.
        assert send.dest[0] == "127.0.0.1"
    if expected is None:
        assert effects == []
    elif expected == "call":
        assert [int(s.data.split(b" ")[1]) for s in sends] == [100]
        assert any(isinstance(e, CallOffered) for e in effects)
    else:
        assert [int(s.data.split(b" ")[1]) for s in sends] == [expected]
        assert not any(isinstance(e, CallOffered) for e in effects)
        assert sends[0].data.endswith(b"\r\n\r\n")  # no body in error responses


def test_rfc4475_set_leaves_the_core_serving_and_counts_the_malformed() -> None:
    ua = UserAgent(AgentConfig(host="127.0.0.1", port=5060))
    flow = Flow("udp", ("127.0.0.1", 5070))
    for name in sorted(EXPECTED):
        ua.receive(load(name), flow, now=0.0)
    counters = ua.take_counters()
    # 19 invalid messages + 2 broken responses, each counted by kind.
    assert sum(counters.errors.values()) >= 21
    # The core still takes a normal OPTIONS afterwards.
    from tests.gateway.sip.factories import request

    effects = ua.receive(request("OPTIONS"), flow, now=1.0)
    assert [int(e.data.split(b" ")[1]) for e in effects if isinstance(e, Send)] == [200]


def test_dblreq_processes_only_the_first_request_of_the_datagram() -> None:
    message = parse_message(load("dblreq"))
    assert isinstance(message, SipRequest)
    assert message.method == "REGISTER"
    assert message.body == b""


def test_wsinv_reads_folded_and_spaced_headers() -> None:
    message = parse_message(load("wsinv"))
    assert isinstance(message, SipRequest)
    assert message.max_forwards == 68
    assert message.cseq.seq == 9 and message.cseq.method == "INVITE"
    assert [v.transport for v in message.via] == ["UDP", "TCP", "UDP"]
    assert message.via[1].branch == "z9hG4bK9ikj8"
    assert message.to.tag == "1918181833n"
    assert message.from_.display_name == 'J Rosenberg \\"'
    assert message.headers.get("NewFangledHeader") == "newfangled value continued newfangled value"


def test_intmeth_keeps_unusual_tokens_and_utf8() -> None:
    message = parse_message(load("intmeth"))
    assert isinstance(message, SipRequest)
    assert message.method == "!interesting-Method0123456789_*+`.%indeed'~"
    assert message.cseq.method == message.method
    assert message.from_.tag == "_token~1'+`*%!-."


def test_longreq_expands_compact_forms_and_keeps_all_vias() -> None:
    message = parse_message(load("longreq"))
    assert isinstance(message, SipRequest)
    assert len(message.via) == 34
    assert message.headers.get("Content-Length") == "150"
    assert len(message.body) == 150


def test_esc01_unescapes_the_dialed_user() -> None:
    from gateway.sip.headers import parse_sip_uri

    message = parse_message(load("esc01"))
    assert isinstance(message, SipRequest)
    assert parse_sip_uri(message.uri).user_unescaped == "sips:user@example.com"
