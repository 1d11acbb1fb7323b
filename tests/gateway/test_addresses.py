"""One rule for "no address": every spelling of the unspecified address is a wildcard bind address,
is never advertised, and in an SDP offer puts the stream on hold (RFC 3264 §8.4) wherever it is read."""

from __future__ import annotations

import logging

import pytest

from gateway.addresses import advertised_address, is_unspecified
from gateway.call.frontend import FrontEndConfig
from gateway.config import Settings
from gateway.daemon import check_settings
from gateway.sdp import SdpAnswerer, negotiate, negotiate_answer, parse_sdp
from tests.gateway.sip.factories import SDP_OFFER

UNSPECIFIED = ["", "0.0.0.0", "::", "0:0:0:0:0:0:0:0", "::0", "0::", "0000:0000::0000", "[::]"]
CONCRETE = ["127.0.0.1", "::1", "192.0.2.7", "2001:db8::1", "0.0.0.1", "pbx.example.com", "[2001:db8::1]"]


@pytest.mark.parametrize("host", UNSPECIFIED)
def test_every_spelling_of_the_unspecified_address_is_one(host: str) -> None:
    assert is_unspecified(host)


@pytest.mark.parametrize("host", CONCRETE)
def test_concrete_addresses_and_names_are_not(host: str) -> None:
    assert not is_unspecified(host)


def test_the_advertised_address_is_the_first_concrete_candidate() -> None:
    assert advertised_address("", "0.0.0.0", "10.0.0.9") == "10.0.0.9"
    assert advertised_address("0:0:0:0:0:0:0:0", "192.0.2.1", "10.0.0.9") == "192.0.2.1"
    assert advertised_address(None, "203.0.113.1") == "203.0.113.1"
    with pytest.raises(ValueError):
        advertised_address("", "::", "0.0.0.0")


def test_sdp_address_prefers_rtp_then_sip_advertised_then_a_concrete_rtp_bind_then_the_route() -> None:
    def media_host(s: Settings) -> str:
        return advertised_address(*FrontEndConfig.from_settings(s).call.media_hosts, "10.0.0.9")

    s = Settings()
    assert media_host(s) == "10.0.0.9"  # bind 0.0.0.0: our address toward the caller
    s.rtp.host = "192.0.2.1"
    assert media_host(s) == "192.0.2.1"
    s.sip.advertised_host = "203.0.113.1"
    assert media_host(s) == "203.0.113.1"
    s.rtp.advertised_host = "203.0.113.2"
    assert media_host(s) == "203.0.113.2"


def _offer_with_connection(address: str) -> str:
    addrtype = "IP6" if ":" in address else "IP4"
    return SDP_OFFER.replace("c=IN IP4 127.0.0.1", f"c=IN {addrtype} {address}")


@pytest.mark.parametrize("address", [h for h in UNSPECIFIED if h and not h.startswith("[")])
def test_an_offer_to_the_unspecified_address_is_hold_everywhere(address: str) -> None:
    negotiation = negotiate(parse_sdp(_offer_with_connection(address)))
    (plan,) = negotiation.accepted
    assert plan.on_hold and not plan.media_expected
    assert "a=inactive" in SdpAnswerer("192.0.2.1").answer(negotiation, [20000])
    ours = parse_sdp(SdpAnswerer("192.0.2.1").offer([20000]))
    answer = parse_sdp(_offer_with_connection(address).replace("a=sendrecv", "a=sendonly"))
    (answered,) = negotiate_answer(ours, answer).accepted
    assert answered.on_hold and not answered.media_expected


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "0:0:0:0:0:0:0:0", "::0"])
def test_a_wildcard_bind_without_an_advertised_address_warns_and_a_wildcard_advertised_one_fails(
    host: str,
) -> None:
    (f,) = check_settings(Settings(sip={"host": host}, rtp={"host": "127.0.0.1"}))
    assert f.level == logging.WARNING and "TTG_SIP__ADVERTISED_HOST" in f.message
    (f,) = check_settings(
        Settings(sip={"host": "127.0.0.1", "advertised_host": host}, rtp={"host": "127.0.0.1"})
    )
    assert f.level == logging.ERROR and "wildcard" in f.message
