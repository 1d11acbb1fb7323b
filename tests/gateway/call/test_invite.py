"""What a call takes from its INVITE: dialed number, language, call_start metadata."""

from __future__ import annotations

import json

from gateway.call.invite import call_metadata, choose_language, dialed_number
from gateway.sip.agent import Flow
from gateway.sip.message import SipRequest, parse_message
from tests.gateway.sip.factories import invite


def req(data: bytes) -> SipRequest:
    message = parse_message(data)
    assert isinstance(message, SipRequest)
    return message


def test_language_comes_from_the_header_then_the_dialed_number_then_the_default() -> None:
    dnis = {"+4930123": "de-DE", "+380*": "uk-UA", "+38044*": "ru-RU"}
    pick = lambda data: choose_language(req(data), header="X-Language", dnis_languages=dnis, default="en-US")  # noqa: E731
    assert pick(invite(extra=("X-Language: fr-FR",))) == ("fr-FR", "header")
    assert pick(invite(uri="sip:+4930123@127.0.0.1")) == ("de-DE", "dnis")
    assert pick(invite(uri="sip:+380441234567@gw")) == ("ru-RU", "dnis")  # longest prefix wins
    assert pick(invite(uri="sip:+380501234567@gw")) == ("uk-UA", "dnis")
    assert pick(invite(uri="sip:999@gw")) == ("en-US", "default")
    # A header value that is not a locale is ignored (never passed to the engine).
    assert pick(invite(uri="sip:+4930123@gw", extra=("X-Language: ../../etc",))) == ("de-DE", "dnis")


def test_dialed_number_from_sip_and_tel_uris() -> None:
    assert dialed_number(req(invite(uri="sip:%2B4930123@gw;user=phone"))) == "+4930123"
    assert dialed_number(req(invite(uri="tel:+15551234;phone-context=x"))) == "+15551234"


def test_metadata_carries_from_to_pai_and_only_allow_listed_headers() -> None:
    data = invite(
        extra=(
            "P-Asserted-Identity: <sip:+15550100@pbx>",
            "X-Tenant: acme",
            "X-Secret-Token: hunter2",
            "X-Case: Ünïcödé",
        )
    )
    meta = call_metadata(req(data), Flow("udp", ("127.0.0.1", 5070)), ["X-Tenant", "x-case"])
    assert meta["from"] == '"Alice" <sip:alice@127.0.0.1:5070>;tag=uac-tag'
    assert meta["to"] == "<sip:1000@127.0.0.1:5060>"
    assert (meta["ani"], meta["dnis"]) == ("alice", "1000")
    assert meta["pai"] == "<sip:+15550100@pbx>"
    assert json.loads(meta["headers"]) == {"X-Tenant": "acme", "X-Case": "Ünïcödé"}
    assert (meta["source"], meta["transport"]) == ("127.0.0.1:5070", "udp")
