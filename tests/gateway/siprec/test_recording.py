"""A recording offer from headers and body to answered streams and leg names (RFC 7866)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sdp import Negotiation, SdpAnswerer, negotiate, parse_sdp
from gateway.siprec.metadata import MetadataError, parse_metadata
from gateway.siprec.multipart import BodyError
from gateway.siprec.recording import (
    OfferBody,
    is_src_contact,
    name_legs,
    participants_field,
    read_offer_body,
    safe_leg_name,
    session_kind,
    stream_limit,
)
from tools.replay.siprec import VENDORS, build_offer

SDP2 = (
    "v=0\r\no=- 1 1 IN IP4 192.0.2.1\r\ns=-\r\nc=IN IP4 192.0.2.1\r\nt=0 0\r\n"
    "m=audio 4000 RTP/AVP 0\r\na=label:1\r\na=sendonly\r\n"
    "m=audio 4002 RTP/AVP 0\r\na=label:2\r\na=sendonly\r\n"
)


def negotiated(sdp: bytes | str, *, recording: bool = True, max_streams: int = 2) -> Negotiation:
    return negotiate(parse_sdp(sdp), max_streams=max_streams, recording=recording)


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_each_vendor_offer_gets_two_recvonly_legs_named_as_documented(vendor: str) -> None:
    offer = build_offer(vendor, index=4, ip="192.0.2.10", ports=(4000, 4002), session_id=77)
    body = read_offer_body(offer.content_type, offer.body)
    assert body.sdp is not None
    kind = session_kind(["siprec"], ["<sip:src@192.0.2.10>;+sip.src"], body)
    assert kind == "recording"
    neg = negotiated(body.sdp, max_streams=stream_limit(kind, max_streams=2, multi_leg_calls=False))
    assert len(neg.accepted) == 2
    # sendonly is how an SRC sends: not hold in a recording session (media expected, normal timeout).
    assert all(not p.on_hold and p.media_expected for p in neg.accepted)
    names = name_legs(neg.accepted, body.metadata, recording=True)
    assert [names[leg.index] for leg in offer.legs] == [leg.expected_leg for leg in offer.legs]

    answer = parse_sdp(SdpAnswerer("192.0.2.99").answer(neg, [30000, 30002]))
    assert [m.direction for m in answer.media] == ["recvonly", "recvonly"]
    assert [m.attribute("label") for m in answer.media] == [leg.label for leg in offer.legs]

    assert body.metadata is not None
    people = json.loads(participants_field(body.metadata, names, neg.accepted))
    by_id = {p["id"]: p for p in people}
    for leg in offer.legs:
        who = by_id[leg.sender.id]
        assert who["name"] == leg.sender.name and leg.sender.user in who["aor"]
        assert who["name_addr"].startswith(f'"{leg.sender.name}" <')
        assert who["legs"] == [leg.expected_leg]


def test_avaya_second_leg_uses_static_pcma_without_rtpmap() -> None:
    offer = build_offer("avaya", index=1, ip="192.0.2.10", ports=(4000, 4002), session_id=1)
    body = read_offer_body(offer.content_type, offer.body)
    assert body.sdp is not None
    neg = negotiated(body.sdp)
    assert [(p.codec, p.payload_type) for p in neg.accepted] == [("PCMA", 8), ("PCMA", 8)]
    assert neg.accepted[0].dtmf_payload_type == 101 and neg.accepted[1].dtmf_payload_type is None


def test_a_trunk_call_keeps_sendonly_as_hold_and_takes_only_the_first_stream() -> None:
    kind = session_kind([], ["<sip:pbx@192.0.2.1>"], OfferBody(sdp=SDP2.encode()))
    assert kind == "plain"
    neg = negotiated(
        SDP2, recording=False, max_streams=stream_limit(kind, max_streams=2, multi_leg_calls=False)
    )
    assert [p is not None for p in neg.plans] == [True, False]
    assert neg.accepted[0].on_hold
    assert name_legs(neg.accepted, None, recording=False) == {0: "caller"}


def test_a_plain_two_stream_call_when_multi_leg_calls_are_allowed() -> None:
    neg = negotiated(
        SDP2, recording=False, max_streams=stream_limit("plain", max_streams=4, multi_leg_calls=True)
    )
    assert len(neg.accepted) == 2
    assert name_legs(neg.accepted, None, recording=False) == {0: "stream-1", 1: "stream-2"}


def test_max_streams_caps_legs_and_answers_the_rest_with_port_0() -> None:
    sdp3 = SDP2 + "m=audio 4004 RTP/AVP 0\r\na=label:3\r\na=sendonly\r\n"
    neg = negotiated(sdp3, max_streams=2)
    answer = parse_sdp(SdpAnswerer("192.0.2.99").answer(neg, [30000, 30002]))
    assert [m.port for m in answer.media] == [30000, 30002, 0]


def test_metadata_without_stream_association_names_legs_by_label() -> None:
    # Streams declared, nobody said to send them (seen from an older OpenSIPS): who speaks is unknown.
    m = parse_metadata(
        '<recording xmlns="urn:ietf:params:xml:ns:recording:1">'
        '<participant participant_id="A"/><participant participant_id="B"/>'
        '<stream stream_id="s"><label>1</label></stream><stream stream_id="t"><label>2</label></stream>'
        "</recording>"
    )
    names = name_legs(negotiated(SDP2).accepted, m, recording=True)
    assert names == {0: "stream-1", 1: "stream-2"}
    assert [p["legs"] for p in json.loads(participants_field(m, names, negotiated(SDP2).accepted))] == [
        [],
        [],
    ]


def test_single_stream_recording_without_association_is_mixed() -> None:
    one = SDP2.split("m=audio 4002")[0]
    assert name_legs(negotiated(one).accepted, None, recording=True) == {0: "mixed"}


def test_a_stream_several_participants_send_is_mixed() -> None:
    m = parse_metadata(
        '<recording xmlns="urn:ietf:params:xml:ns:recording:1">'
        '<participant participant_id="A"/><participant participant_id="B"/>'
        '<stream stream_id="s"><label>1</label></stream><stream stream_id="t"><label>2</label></stream>'
        '<participantstreamassoc participant_id="A"><send>s</send><send>t</send></participantstreamassoc>'
        '<participantstreamassoc participant_id="B"><send>s</send></participantstreamassoc></recording>'
    )
    assert name_legs(negotiated(SDP2).accepted, m, recording=True) == {0: "mixed", 1: "A"}


def test_names_are_kept_across_reoffers_and_never_reused() -> None:
    first = name_legs(negotiated(SDP2).accepted, None, recording=True)
    assert first == {0: "stream-1", 1: "stream-2"}
    # A re-INVITE with metadata that now names the senders does not rename running legs ...
    m = parse_metadata(
        '<recording xmlns="urn:ietf:params:xml:ns:recording:1">'
        '<participant participant_id="stream-2"/><participant participant_id="B"/>'
        '<stream stream_id="x"><label>3</label></stream>'
        '<participantstreamassoc participant_id="stream-2"><send>x</send></participantstreamassoc>'
        "</recording>"
    )
    sdp3 = SDP2 + "m=audio 4004 RTP/AVP 0\r\na=label:3\r\na=sendonly\r\n"
    again = name_legs(negotiated(sdp3, max_streams=3).accepted, m, recording=True, named=first)
    # ... and a new leg whose natural name is taken gets its m= line number appended.
    assert again == {0: "stream-1", 1: "stream-2", 2: "stream-2-3"}


def test_leg_names_are_safe_for_keys_and_event_ids() -> None:
    assert safe_leg_name("kQNhKFdEEeeJ99D/VsPGWA==") == "kQNhKFdEEeeJ99D/VsPGWA=="
    assert safe_leg_name("a:b c\n") == "a_b_c"
    assert len(safe_leg_name("x" * 200)) == 64


def test_src_contact_feature_tag() -> None:
    assert is_src_contact(["<sip:src@192.0.2.1:5060;transport=tcp>;+sip.src"])
    assert is_src_contact(['"SRC" <sip:src@h>;expires=60;+SIP.SRC'])
    assert not is_src_contact(["<sip:src@h;+sip.src>"])  # a URI parameter is not a feature tag
    assert not is_src_contact(["<sip:pbx@h>"])


def test_require_siprec_without_src_contact_and_without_metadata_is_plain() -> None:
    assert session_kind(["siprec"], ["<sip:x@h>"], OfferBody(sdp=b"v=0")) == "plain"


@pytest.mark.parametrize(
    ("content_type", "payload", "status"),
    [
        ("text/plain", b"hello", 415),
        ("multipart/mixed", b"--x\r\n\r\nv=0\r\n--x--\r\n", 400),
        (
            "multipart/mixed;boundary=x",
            b"--x\r\nContent-Type: application/sdp\r\n\r\nv=0\r\n"
            b"--x\r\nContent-Type: application/sdp\r\n\r\nv=0\r\n--x--\r\n",
            400,
        ),
        (
            "multipart/mixed;boundary=x",
            b"--x\r\nContent-Type: application/sdp\r\n\r\nv=0\r\n"
            b"--x\r\nContent-Type: application/isup\r\nContent-Disposition: signal;handling=required\r\n"
            b"\r\nIAM\r\n--x--\r\n",
            415,
        ),
    ],
)
def test_bodies_that_are_refused(content_type: str, payload: bytes, status: int) -> None:
    with pytest.raises(BodyError) as err:
        read_offer_body(content_type, payload)
    assert err.value.status == status


def test_metadata_only_body_and_empty_body() -> None:
    body = read_offer_body(
        "application/rs-metadata+xml", b'<recording xmlns="urn:ietf:params:xml:ns:recording:1"/>'
    )
    assert body.sdp is None and body.metadata is not None
    assert read_offer_body(None, b"") == OfferBody()


def test_metadata_part_found_by_disposition_and_placed_before_the_sdp() -> None:
    payload = (
        b"--B\r\nContent-Type: application/xml\r\nContent-Disposition: recording-session\r\n\r\n"
        b'<recording xmlns="urn:ietf:params:xml:ns:recording:1"><datamode>complete</datamode></recording>\r\n'
        b"--B\r\nContent-Type: application/sdp\r\n\r\n" + SDP2.encode() + b"\r\n--B--\r\n"
    )
    body = read_offer_body("multipart/mixed; boundary=B", payload)
    assert body.metadata is not None and body.sdp is not None and body.sdp.startswith(b"v=0")


@settings(max_examples=300, deadline=None)
@given(
    content_type=st.sampled_from(
        [
            "multipart/mixed;boundary=b",
            "multipart/mixed",
            "application/rs-metadata+xml",
            "application/sdp",
            "x/y",
        ]
    ),
    payload=st.binary(max_size=600)
    | st.builds(
        lambda parts: b"".join(b"--b\r\n" + h + b"\r\n\r\n" + c + b"\r\n" for h, c in parts) + b"--b--\r\n",
        st.lists(
            st.tuples(
                st.sampled_from(
                    [
                        b"Content-Type: application/sdp",
                        b"Content-Type: application/rs-metadata+xml",
                        b"Content-Disposition: recording-session",
                        b"Content-Type: a/b\r\nContent-Disposition: x;handling=required",
                        b"",
                    ]
                ),
                st.binary(max_size=200) | st.sampled_from([b"<recording/>", b"<recording><x", b"v=0"]),
            ),
            max_size=4,
        ),
    ),
)
def test_any_body_is_read_or_refused_with_a_4xx(content_type: str, payload: bytes) -> None:
    try:
        read_offer_body(content_type, payload)
    except (BodyError, MetadataError) as e:
        assert 400 <= e.status < 500
