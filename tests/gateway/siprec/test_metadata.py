"""Recording metadata (RFC 7865): what is read from each SRC's documents, and what is refused."""

from __future__ import annotations

import pytest

from gateway.siprec.metadata import (
    MAX_METADATA_BYTES,
    MetadataError,
    merge,
    parse_metadata,
    roles,
)
from gateway.siprec.recording import read_offer_body
from tools.replay.siprec import VENDORS, build_offer

RFC = "urn:ietf:params:xml:ns:recording:1"


def doc(body: str, root: str = f'xmlns="{RFC}"') -> str:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<recording {root}>\n{body}\n</recording>'


TWO_PARTY = doc(
    """<datamode>complete</datamode>
<session session_id="S1"><sipSessionID>abc@host</sipSessionID></session>
<participant participant_id="P1">
  <nameID aor="sip:alice@example.com"><name xml:lang="en">Alice</name></nameID>
</participant>
<participant participant_id="P2"><nameID aor="sip:bob@example.com"/></participant>
<stream stream_id="S-A" session_id="S1"><label>1</label></stream>
<stream stream_id="S-B" session_id="S1"><label>2</label></stream>
<participantstreamassoc participant_id="P1"><send>S-A</send><recv>S-B</recv></participantstreamassoc>
<participantstreamassoc participant_id="P2"><send>S-B</send><recv>S-A</recv></participantstreamassoc>"""
)


def test_rfc7865_document() -> None:
    m = parse_metadata(TWO_PARTY)
    assert m.namespace == RFC and m.datamode == "complete" and m.session_ids == ("S1",)
    alice, bob = m.participants
    assert (alice.id, alice.aor, alice.name, alice.send, alice.recv) == (
        "P1",
        "sip:alice@example.com",
        "Alice",
        ("S-A",),
        ("S-B",),
    )
    assert alice.name_addr == '"Alice" <sip:alice@example.com>'
    assert bob.name_addr == "<sip:bob@example.com>"
    assert [(s.id, s.label) for s in m.streams] == [("S-A", "1"), ("S-B", "2")]
    assert m.senders("S-B") == (bob,)
    assert m.warnings == ()
    assert roles(m) == {}  # RFC 7865 has no caller/callee


@pytest.mark.parametrize("vendor", sorted(VENDORS))
def test_every_vendor_offer_is_read_with_its_participants_and_streams(vendor: str) -> None:
    offer = build_offer(vendor, index=7, ip="192.0.2.10", ports=(4000, 4002), session_id=99)
    body = read_offer_body(offer.content_type, offer.body)
    assert body.sdp is not None and body.sdp.startswith(b"v=0")
    m = body.metadata
    assert m is not None and m.warnings == ()
    assert {p.id for p in m.participants} == {leg.sender.id for leg in offer.legs}
    for leg in offer.legs:
        stream = m.stream_by_label(leg.label)
        assert stream is not None and stream.id == leg.stream_id
        participant = m.participant(leg.sender.id)
        assert participant is not None and participant.name == leg.sender.name
        assert leg.sender.user in participant.aor
        assert m.senders(stream.id) == (participant,)
    expected_roles = {
        leg.sender.id: leg.expected_leg for leg in offer.legs if leg.expected_leg in ("caller", "callee")
    }
    assert roles(m) == expected_roles


def test_oracle_calling_party_and_ucid() -> None:
    m = read_offer_body(*_ct_body("oracle")).metadata
    assert m is not None and m.namespace == "urn:ietf:params:xml:ns:recording"
    assert [p.calling_party for p in m.participants] == [True, False]
    assert m.ucid.startswith("00FA0800") and ";" not in m.ucid


def test_sonus_caller_is_found_from_call_data_even_on_label_2() -> None:
    offer = build_offer("sonus", index=1, ip="192.0.2.10", ports=(4000, 4002), session_id=5)
    m = read_offer_body(offer.content_type, offer.body).metadata
    assert m is not None and m.cs_call_id.endswith("-orig") and "Customer" in m.cs_from
    label2 = next(leg for leg in offer.legs if leg.label == "2")
    assert roles(m)[label2.sender.id] == "caller"


def _ct_body(vendor: str) -> tuple[str, bytes]:
    offer = build_offer(vendor, index=3, ip="192.0.2.10", ports=(4000, 4002), session_id=5)
    return offer.content_type, offer.body


def test_draft_era_ids_and_participant_level_send_and_mixed_mode() -> None:
    m = parse_metadata(
        doc(
            """<dataMode>complete</dataMode>
<session id="S"/>
<participant id="A" session="S"><nameID aor="sip:a@x"/><send>s1</send></participant>
<participant id="B" session="S"><nameID aor="sip:b@x"/><send>s1</send></participant>
<stream id="s1" session="S"><label>1</label><mode>mixed</mode></stream>""",
            root='xmlns="urn:ietf:params:xml:ns:recording"',
        )
    )
    assert [p.send for p in m.participants] == [("s1",), ("s1",)]
    assert m.streams[0].mode == "mixed"


def test_explicit_calling_and_called_party_references() -> None:
    m = parse_metadata(
        TWO_PARTY.replace(
            "</recording>",
            '<ext xmlns="urn:example"><callingParty participant_id="P2"/>'
            '<calledParty participant_id="P1"/></ext>'
            "</recording>",
        )
    )
    assert roles(m) == {"P2": "caller", "P1": "callee"}


def test_one_known_role_in_a_two_party_call_gives_the_other() -> None:
    m = parse_metadata(
        TWO_PARTY.replace(
            '<participant participant_id="P2"><nameID aor="sip:bob@example.com"/>',
            '<participant participant_id="P2"><nameID aor="sip:bob@example.com"/>'
            '<extensiondata xmlns:apkt="http://acmepacket.com/siprec/extensiondata">'
            "<apkt:callingParty>true</apkt:callingParty></extensiondata>",
        )
    )
    assert roles(m) == {"P2": "caller", "P1": "callee"}


def test_contradictory_roles_are_dropped() -> None:
    flag = (
        '<extensiondata xmlns:apkt="http://acmepacket.com/siprec/extensiondata">'
        "<apkt:callingParty>true</apkt:callingParty></extensiondata>"
    )
    m = parse_metadata(TWO_PARTY.replace("<nameID aor=", f"{flag}<nameID aor="))
    assert [p.calling_party for p in m.participants] == [True, True]
    assert roles(m) == {}


def test_unknown_stream_ids_and_unknown_participants_are_warnings_not_errors() -> None:
    m = parse_metadata(
        TWO_PARTY.replace("<send>S-B</send>", "<send>S-GHOST</send>").replace(
            "</recording>",
            '<participantstreamassoc participant_id="NOBODY"><send>S-A</send></participantstreamassoc>'
            "</recording>",
        )
    )
    assert any("S-GHOST" in w for w in m.warnings)
    assert any("NOBODY" in w for w in m.warnings)
    assert m.senders("S-B") == ()


def test_partial_update_replaces_and_adds() -> None:
    first = parse_metadata(TWO_PARTY)
    update = parse_metadata(
        doc(
            """<datamode>partial</datamode>
<participant participant_id="P3"><nameID aor="sip:carol@example.com"><name>Carol</name></nameID></participant>
<participant participant_id="P2"><nameID aor="sip:bob@example.com"><name>Bob</name></nameID></participant>
<stream stream_id="S-C"><label>3</label></stream>
<participantstreamassoc participant_id="P3"><send>S-C</send></participantstreamassoc>"""
        )
    )
    merged = merge(first, update)
    assert merged.datamode == "complete"
    assert [p.id for p in merged.participants] == ["P1", "P2", "P3"]
    bob = merged.participant("P2")
    assert bob is not None and bob.name == "Bob" and bob.send == ("S-B",)  # the association is kept
    assert [s.label for s in merged.streams] == ["1", "2", "3"]
    assert merged.senders("S-C")[0].name == "Carol"
    # A complete document replaces everything.
    assert merge(merged, first) == first


@pytest.mark.parametrize(
    ("xml", "why"),
    [
        ("", "empty"),
        ("<recording", "not well-formed"),
        ("<recording><participant></recording>", "not well-formed"),
        ('<?xml version="1.0"?><notrecording/>', "not <recording>"),
        (b"\xff\xfe<rec", "not well-formed"),
    ],
)
def test_malformed_documents(xml: str | bytes, why: str) -> None:
    with pytest.raises(MetadataError, match=why):
        parse_metadata(xml)


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE recording [
 <!ENTITY a "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa">
 <!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">
 <!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">
 <!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">
 <!ENTITY e "&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;&d;">
 <!ENTITY f "&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;&e;">
]>
<recording xmlns="urn:ietf:params:xml:ns:recording:1"><participant participant_id="&f;"/></recording>"""

EXTERNAL_ENTITY = """<?xml version="1.0"?>
<!DOCTYPE recording [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<recording xmlns="urn:ietf:params:xml:ns:recording:1"><participant participant_id="&x;"/></recording>"""

DTD_ONLY = """<?xml version="1.0"?>
<!DOCTYPE recording SYSTEM "http://192.0.2.1/evil.dtd">
<recording xmlns="urn:ietf:params:xml:ns:recording:1"/>"""


@pytest.mark.parametrize(
    "xml", [BILLION_LAUGHS, EXTERNAL_ENTITY, DTD_ONLY], ids=["laughs", "external", "dtd"]
)
def test_hostile_documents_are_refused_without_expanding_anything(xml: str) -> None:
    with pytest.raises(MetadataError, match="refused"):
        parse_metadata(xml)


def test_oversized_document_is_refused_before_parsing() -> None:
    big = doc("<!--" + "x" * MAX_METADATA_BYTES + "-->")
    with pytest.raises(MetadataError, match="limit"):
        parse_metadata(big)


def test_too_many_participants_is_refused() -> None:
    many = "".join(f'<participant participant_id="p{i}"/>' for i in range(100))
    with pytest.raises(MetadataError, match="participants"):
        parse_metadata(doc(many))
