"""SDP offer/answer: offers shaped like real vendors' negotiate as expected; garbage and misfits fail."""

from __future__ import annotations

import pytest

from gateway.sdp import (
    MediaPlan,
    NegotiationError,
    SdpAnswerer,
    SdpParseError,
    answer_direction,
    negotiate,
    negotiate_answer,
    parse_sdp,
    same_offer_version,
)


def sdp(text: str) -> str:
    return "\r\n".join(line.strip() for line in text.strip().splitlines()) + "\r\n"


ASTERISK = sdp("""
    v=0
    o=- 1596459227 1596459227 IN IP4 192.0.2.10
    s=Asterisk
    c=IN IP4 192.0.2.10
    t=0 0
    m=audio 10062 RTP/AVP 8 0 3 111 101
    a=rtpmap:8 PCMA/8000
    a=rtpmap:0 PCMU/8000
    a=rtpmap:3 GSM/8000
    a=rtpmap:111 G726-32/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-16
    a=ptime:20
    a=maxptime:150
    a=sendrecv
""")

FREESWITCH = sdp("""
    v=0
    o=FreeSWITCH 1700000000 1700000001 IN IP4 198.51.100.7
    s=FreeSWITCH
    c=IN IP4 198.51.100.7
    t=0 0
    m=audio 24602 RTP/AVP 9 102 0 8 101 13
    a=rtpmap:9 G722/8000
    a=rtpmap:102 opus/48000/2
    a=fmtp:102 useinbandfec=1; maxplaybackrate=48000
    a=rtpmap:0 PCMU/8000
    a=rtpmap:8 PCMA/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-16
    a=rtpmap:13 CN/8000
    a=ptime:20
    a=rtcp:24611 IN IP4 198.51.100.7
    a=sendrecv
""")

CISCO_CUBE = sdp("""
    v=0
    o=CiscoSystemsSIP-GW-UserAgent 4527 1245 IN IP4 10.1.1.1
    s=SIP Call
    c=IN IP4 10.1.1.1
    t=0 0
    m=audio 16384 RTP/AVP 18 0 8 101 19
    c=IN IP4 10.1.1.2
    a=rtpmap:18 G729/8000
    a=fmtp:18 annexb=no
    a=rtpmap:0 PCMU/8000
    a=rtpmap:8 PCMA/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-16
    a=rtpmap:19 CN/8000
    a=ptime:30
""")

# sipp 3.6's embedded uac scenario (`sipp -sd uac`), with its keywords filled in.
SIPP_UAC = sdp("""
    v=0
    o=user1 53655765 2353687637 IN IP4 127.0.0.1
    s=-
    c=IN IP4 127.0.0.1
    t=0 0
    m=audio 6000 RTP/AVP 0
    a=rtpmap:0 PCMU/8000
""")

# SIPREC (RFC 7866) from a Cisco SRC: one sendonly m=audio per leg, labelled.
SIPREC_CISCO = sdp("""
    v=0
    o=CiscoSystemsSIP-GW-UserAgent 1247 9367 IN IP4 172.31.93.236
    s=SIP Call
    c=IN IP4 172.31.93.236
    t=0 0
    m=audio 10292 RTP/AVP 0 101
    c=IN IP4 172.31.93.236
    a=rtpmap:0 PCMU/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-16
    a=ptime:20
    a=sendonly
    a=label:1
    m=audio 10294 RTP/AVP 0 101
    c=IN IP4 172.31.93.236
    a=rtpmap:0 PCMU/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-16
    a=ptime:20
    a=sendonly
    a=label:2
""")

# Avaya/Acme SIPREC: G.729 offered too, and the second leg relies on static PT 8 with no rtpmap.
SIPREC_AVAYA = sdp("""
    v=0
    o=- 15345885 220 IN IP4 10.89.88.243
    s=-
    c=IN IP4 10.89.88.244
    t=0 0
    m=audio 33802 RTP/AVP 8 18 101
    a=rtpmap:8 PCMA/8000
    a=rtpmap:18 G729/8000
    a=rtpmap:101 telephone-event/8000
    a=fmtp:101 0-15
    a=ptime:20
    a=label:201835599
    a=sendonly
    m=audio 33806 RTP/AVP 8 101
    a=rtpmap:101 telephone-event/8000
    a=ptime:20
    a=label:201835600
    a=sendonly
""")


def one(text: str, **kw: object) -> MediaPlan:
    plans = negotiate(parse_sdp(text), **kw).accepted  # type: ignore[arg-type]
    assert len(plans) == 1
    return plans[0]


def test_asterisk_offer_gets_the_first_supported_codec_in_the_offerers_order() -> None:
    plan = one(ASTERISK)
    assert (plan.codec, plan.payload_type, plan.dtmf_payload_type, plan.cn_payload_type) == (
        "PCMA",
        8,
        101,
        None,
    )
    assert (plan.remote_host, plan.remote_port, plan.remote_rtcp_port) == ("192.0.2.10", 10062, 10063)
    assert (plan.direction, plan.on_hold, plan.media_expected, plan.ptime_ms) == ("sendrecv", False, True, 20)


def test_freeswitch_offer_skips_g722_and_opus_and_keeps_cn_and_the_rtcp_port() -> None:
    plan = one(FREESWITCH)
    assert (plan.codec, plan.payload_type, plan.dtmf_payload_type, plan.cn_payload_type) == (
        "PCMU",
        0,
        101,
        13,
    )
    assert plan.remote_rtcp_port == 24611  # RFC 3605 a=rtcp


def test_cisco_cube_offer_uses_the_media_level_address_and_cn_on_pt_19() -> None:
    plan = one(CISCO_CUBE)
    assert (plan.codec, plan.payload_type, plan.cn_payload_type, plan.ptime_ms) == ("PCMU", 0, 19, 30)
    assert plan.remote_host == "10.1.1.2"


def test_sipp_default_offer_negotiates_pcmu_without_dtmf() -> None:
    plan = one(SIPP_UAC)
    assert (plan.codec, plan.dtmf_payload_type, plan.cn_payload_type) == ("PCMU", None, None)


def test_the_operators_codec_allow_list_overrides_the_offer() -> None:
    assert one(ASTERISK, codecs=["PCMU"]).codec == "PCMU"
    with pytest.raises(NegotiationError):
        negotiate(parse_sdp(SIPP_UAC), codecs=["PCMA"])


def test_siprec_offer_accepts_each_leg_when_allowed_and_echoes_labels() -> None:
    neg = negotiate(parse_sdp(SIPREC_CISCO), max_streams=2)
    assert [(p.index, p.label, p.remote_port, p.on_hold) for p in neg.accepted] == [
        (0, "1", 10292, True),
        (1, "2", 10294, True),
    ]
    assert all(p.media_expected for p in neg.accepted)  # sendonly: the SRC sends, we receive
    text = SdpAnswerer("203.0.113.5", session_id=7).answer(neg, [20000, 20002])
    answer = parse_sdp(text)
    assert [m.port for m in answer.media] == [20000, 20002]
    assert [m.attribute("label") for m in answer.media] == ["1", "2"]
    assert [m.direction for m in answer.media] == ["recvonly", "recvonly"]


def test_siprec_offer_beyond_max_streams_rejects_the_extra_leg_with_port_zero() -> None:
    neg = negotiate(parse_sdp(SIPREC_CISCO), max_streams=1)
    assert [p is not None for p in neg.plans] == [True, False]
    answer = parse_sdp(SdpAnswerer("203.0.113.5").answer(neg, [20000]))
    assert [m.port for m in answer.media] == [20000, 0]


def test_avaya_siprec_static_pcma_needs_no_rtpmap_and_session_level_address_applies() -> None:
    neg = negotiate(parse_sdp(SIPREC_AVAYA), max_streams=2)
    assert [(p.codec, p.payload_type, p.dtmf_payload_type, p.remote_host) for p in neg.accepted] == [
        ("PCMA", 8, 101, "10.89.88.244"),
        ("PCMA", 8, 101, "10.89.88.244"),
    ]


def test_a_dynamic_payload_type_for_pcmu_is_accepted_through_its_rtpmap() -> None:
    plan = one(SIPP_UAC.replace("RTP/AVP 0", "RTP/AVP 96").replace("rtpmap:0 PCMU", "rtpmap:96 pcmu"))
    assert (plan.codec, plan.payload_type) == ("PCMU", 96)


def test_rtcp_mux_is_honoured_and_echoed() -> None:
    plan = one(SIPP_UAC + "a=rtcp-mux\r\n")
    assert plan.rtcp_mux and plan.remote_rtcp_port == 6000
    neg = negotiate(parse_sdp(SIPP_UAC + "a=rtcp-mux\r\n"))
    assert parse_sdp(SdpAnswerer("127.0.0.1").answer(neg, [4000])).media[0].has_attribute("rtcp-mux")


@pytest.mark.parametrize(
    ("ptime", "expected"), [("10", 10), ("60", 60), ("20.0", 20), ("5", 20), ("120", 20), ("x", 20)]
)
def test_ptime_in_10_to_60_ms_is_honoured_and_anything_else_falls_back(ptime: str, expected: int) -> None:
    assert one(SIPP_UAC + f"a=ptime:{ptime}\r\n").ptime_ms == expected


@pytest.mark.parametrize(
    ("change", "direction", "on_hold", "expected_media", "ours"),
    [
        ("a=sendrecv", "sendrecv", False, True, "recvonly"),
        ("a=sendonly", "sendonly", True, True, "recvonly"),  # hold with music: they still send
        ("a=recvonly", "recvonly", False, False, "inactive"),
        ("a=inactive", "inactive", True, False, "inactive"),
        ("c=0.0.0.0", "sendrecv", True, False, "inactive"),  # RFC 2543-style hold (RFC 3264 §8.4)
    ],
)
def test_direction_and_hold_follow_rfc3264(
    change: str, direction: str, on_hold: bool, expected_media: bool, ours: str
) -> None:
    text = (
        SIPP_UAC.replace("c=IN IP4 127.0.0.1", "c=IN IP4 0.0.0.0")
        if change == "c=0.0.0.0"
        else SIPP_UAC + change + "\r\n"
    )
    plan = one(text)
    assert (plan.direction, plan.on_hold, plan.media_expected) == (direction, on_hold, expected_media)
    assert answer_direction(plan) == ours
    neg = negotiate(parse_sdp(text))
    assert parse_sdp(SdpAnswerer("127.0.0.1").answer(neg, [4000])).media[0].direction == ours


def test_a_session_level_direction_applies_unless_the_media_level_overrides() -> None:
    text = SIPP_UAC.replace("t=0 0\r\n", "t=0 0\r\na=sendonly\r\n")
    assert one(text).direction == "sendonly"
    assert one(text + "a=sendrecv\r\n").direction == "sendrecv"


@pytest.mark.parametrize(
    ("offer", "why"),
    [
        (SIPP_UAC.replace("RTP/AVP 0", "RTP/AVP 18").replace("0 PCMU", "18 G729"), "no common codec"),
        (FREESWITCH.replace(" 0 8 101 13", " 101 13"), "no common codec"),
        (SIPP_UAC.replace("RTP/AVP", "RTP/SAVP"), "transport"),
        (SIPP_UAC.replace("m=audio 6000", "m=audio 0"), "port 0"),
        (SIPP_UAC.replace("m=audio", "m=video"), "not supported"),
        (SIPP_UAC.replace("PCMU/8000", "PCMU/16000"), "no common codec"),
        (SIPP_UAC.replace("c=IN IP4 127.0.0.1", "c=IN IP4 239.1.2.3/16"), "multicast"),
        (SIPP_UAC.replace("c=IN IP4 127.0.0.1\r\n", ""), "no c= line"),
        (SIPP_UAC.replace("m=audio 6000 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n", ""), "no m= lines"),
    ],
)
def test_offers_with_nothing_we_can_receive_fail_with_488(offer: str, why: str) -> None:
    with pytest.raises(NegotiationError) as err:
        negotiate(parse_sdp(offer))
    assert err.value.status_hint == 488 and err.value.warn_code == 305
    assert why in str(err.value)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "empty"),
        (b"hello world", "expected '<type>=<value>'"),
        (b"\x00\x01\x02\xff\xfe", "not UTF-8"),
        ("o=- 1 1 IN IP4 1.2.3.4\r\nv=0\r\n", "first line must be v=0"),
        ("v=1\r\n", "unsupported SDP version"),
        (SIPP_UAC.replace("o=user1 53655765 2353687637 IN IP4 127.0.0.1\r\n", ""), "missing o="),
        (SIPP_UAC.replace("s=-\r\n", ""), "missing s="),
        (SIPP_UAC.replace("t=0 0\r\n", ""), "missing t="),
        (SIPP_UAC.replace("IN IP4 127.0.0.1\r\ns", "IN IP4\r\ns"), "o= needs 6 fields"),
        (SIPP_UAC.replace("53655765", "abc"), "numeric"),
        (SIPP_UAC.replace("c=IN IP4", "c=IN IPX"), "address type"),
        (SIPP_UAC.replace("m=audio 6000", "m=audio 70000"), "bad port"),
        (SIPP_UAC.replace("m=audio 6000 RTP/AVP 0", "m=audio 6000 RTP/AVP"), "no formats"),
        (SIPP_UAC + "x=unknown\r\n", "unknown type letter"),
        (SIPP_UAC + "s=again\r\n", "not allowed after an m= line"),
        (SIPP_UAC.replace("s=-", "s=-\r\ns=+"), "repeated s="),
        (SIPP_UAC + "a=bad name\r\n", "bad attribute name"),
        ("v=0\r\n" + "a=x\r\n" * 3000, "lines"),
        ("v=0\r\n" + "m=audio 1 RTP/AVP 0\r\n" * 40, "m= lines"),
        (b"v=0\r\n" + b"a=" + b"x" * 70000, "limit"),
    ],
)
def test_garbage_is_rejected_with_a_message_naming_the_problem(body: str | bytes, why: str) -> None:
    with pytest.raises(SdpParseError) as err:
        parse_sdp(body)
    assert err.value.status_hint == 400
    assert why in str(err.value)


def test_line_endings_may_be_bare_lf_and_the_last_line_may_lack_one() -> None:
    text = SIPP_UAC.replace("\r\n", "\n").rstrip("\n") + "\na=ptime:30"
    assert one(text).ptime_ms == 30  # the final a= line without a newline is not lost


def test_a_parsed_offer_serializes_back_to_the_same_text() -> None:
    for text in (ASTERISK, FREESWITCH, CISCO_CUBE, SIPREC_CISCO, SIPREC_AVAYA):
        assert parse_sdp(text).serialize() == text


def test_answer_has_our_address_port_codec_and_rejects_other_streams() -> None:
    offer = ASTERISK + "m=video 5004 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n"
    neg = negotiate(parse_sdp(offer))
    text = SdpAnswerer("203.0.113.5", session_id=99).answer(neg, [20000])
    assert text == sdp("""
        v=0
        o=ttg 99 0 IN IP4 203.0.113.5
        s=ttg
        c=IN IP4 203.0.113.5
        t=0 0
        m=audio 20000 RTP/AVP 8 101
        a=rtpmap:8 PCMA/8000
        a=rtpmap:101 telephone-event/8000
        a=fmtp:101 0-15
        a=ptime:20
        a=recvonly
        m=video 0 RTP/AVP 96
    """)
    assert negotiate(parse_sdp(text)).accepted[0].codec == "PCMA"  # the answer parses back


def test_answer_lists_cn_when_offered_and_uses_ip6_for_an_ipv6_address() -> None:
    neg = negotiate(parse_sdp(FREESWITCH))
    answer = parse_sdp(SdpAnswerer("2001:db8::5").answer(neg, [30000]))
    assert answer.connection is not None and answer.connection.addrtype == "IP6"
    assert answer.origin.addrtype == "IP6"
    assert answer.media[0].formats == ("0", "13", "101")


def test_origin_version_moves_only_when_the_answer_changes() -> None:
    answerer = SdpAnswerer("203.0.113.5", session_id=555)
    first = parse_sdp(answerer.answer(negotiate(parse_sdp(ASTERISK)), [20000]))
    refresh = parse_sdp(answerer.answer(negotiate(parse_sdp(ASTERISK)), [20000]))  # session refresh
    hold = parse_sdp(answerer.answer(negotiate(parse_sdp(ASTERISK.replace("sendrecv", "sendonly"))), [20000]))
    off = parse_sdp(answerer.answer(negotiate(parse_sdp(ASTERISK.replace("sendrecv", "inactive"))), [20000]))
    resume = parse_sdp(answerer.answer(negotiate(parse_sdp(ASTERISK)), [20000]))
    assert [d.origin.session_version for d in (first, refresh, hold, off, resume)] == [0, 0, 0, 1, 2]
    assert {d.origin.session_id for d in (first, resume)} == {"555"}
    assert off.media[0].direction == "inactive" and resume.media[0].direction == "recvonly"


def test_the_answerer_wants_one_port_per_accepted_stream() -> None:
    neg = negotiate(parse_sdp(SIPREC_CISCO), max_streams=2)
    with pytest.raises(ValueError):
        SdpAnswerer("1.2.3.4").answer(neg, [20000])


def test_same_offer_version_spots_a_repeated_offer() -> None:
    a = parse_sdp(ASTERISK)
    assert same_offer_version(a, parse_sdp(ASTERISK))
    assert not same_offer_version(
        a, parse_sdp(ASTERISK.replace("1596459227 1596459227", "1596459227 1596459228"))
    )


def test_an_unknown_codec_in_the_allow_list_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        negotiate(parse_sdp(SIPP_UAC), codecs=["G729"])


def test_delayed_offer_we_offer_recvonly_and_read_the_peers_answer() -> None:
    answerer = SdpAnswerer("203.0.113.5", session_id=321)
    ours = parse_sdp(answerer.offer([20000], codecs=["PCMA", "PCMU"]))
    m = ours.media[0]
    assert (m.port, m.formats, m.direction) == (20000, ("8", "0", "13", "101"), "recvonly")
    reply = sdp("""
        v=0
        o=CUCM 77 1 IN IP4 10.1.1.9
        s=SIP Call
        c=IN IP4 10.1.1.9
        t=0 0
        m=audio 30000 RTP/AVP 0 101
        a=rtpmap:0 PCMU/8000
        a=rtpmap:101 telephone-event/8000
        a=sendonly
    """)
    plan = negotiate_answer(ours, parse_sdp(reply)).accepted[0]
    assert (plan.codec, plan.dtmf_payload_type, plan.remote_port) == ("PCMU", 101, 30000)
    assert (plan.direction, plan.on_hold, plan.media_expected) == ("sendonly", False, True)
    held = negotiate_answer(ours, parse_sdp(reply.replace("sendonly", "inactive"))).accepted[0]
    assert held.on_hold and not held.media_expected
    with pytest.raises(NegotiationError):
        negotiate_answer(ours, parse_sdp(reply + "m=video 0 RTP/AVP 96\r\n"))


def test_our_offers_and_answers_share_one_origin_version_sequence() -> None:
    answerer = SdpAnswerer("203.0.113.5", session_id=9)
    first = parse_sdp(answerer.offer([20000]))
    again = parse_sdp(answerer.offer([20000]))
    answer = parse_sdp(answerer.answer(negotiate(parse_sdp(SIPP_UAC)), [20000]))
    assert [d.origin.session_version for d in (first, again, answer)] == [0, 0, 1]
