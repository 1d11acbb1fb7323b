"""Recording metadata (RFC 7865, `application/rs-metadata+xml`): who takes part and who sends which stream.

Pure functions and frozen data. `parse_metadata(xml)` reads the document of a SIPREC INVITE or
re-INVITE into `RecordingMetadata`; `merge` applies a `partial` update to what the call knew
(RFC 7865 §5.2); `roles` says which participant placed the communication session (the caller) and
which received it (the callee), where the document says so.

What real SRCs send differs from the RFC's examples (research notes: telephony §1.2), so the reader
goes by local element names and accepts each variant seen in the field:

- the namespace `urn:ietf:params:xml:ns:recording:1` (RFC 7865 §9; Cisco CUBE, Ribbon/Sonus, AudioCodes,
  OpenSIPS) or the draft-era `urn:ietf:params:xml:ns:recording` (Oracle/Acme, Avaya), either as the
  default namespace or behind a prefix (`tns:`);
- identifiers as `participant_id`/`stream_id`/`session_id` (RFC 7865) or `id`/`session` (drafts);
  `datamode` or `dataMode`;
- a participant's streams in `<participantstreamassoc>` (RFC 7865 §6.6) or as `<send>`/`<recv>` inside
  `<participant>` (drafts; Avaya);
- who called: Oracle/Acme `<apkt:callingParty>true</apkt:callingParty>` in a participant's
  `<extensiondata>`; `<callingParty participant_id=…>`/`<calledParty …>` elements; or the original
  From/To headers in a `<callData>` extension of `<group>` (Ribbon/Sonus), matched to the participants'
  AoRs. RFC 7865 itself has no roles: without such an extension a participant is known by its id.
- `<mode>mixed</mode>` on a stream (drafts; Avaya's third stream, BroadWorks) marks a mix of all sides.

Safety: a hostile SRC must not cost memory or time. The document is size-capped, parsed with
defusedxml, which refuses DTDs, entity declarations and external references (no "billion laughs",
no quadratic blow-up, no network or file access), and the counts of what it may declare are capped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal
from xml.etree.ElementTree import Element

import defusedxml.ElementTree as DefusedET
from defusedxml import DefusedXmlException

Role = Literal["caller", "callee"]

NS_RFC7865 = "urn:ietf:params:xml:ns:recording:1"
NS_DRAFT = "urn:ietf:params:xml:ns:recording"
ROOT_NAMES = frozenset({"recording", "recording_metadata"})

# A two-party recording is ~3 KiB; conferences and vendor extensions stay well under this.
MAX_METADATA_BYTES = 64 * 1024
MAX_PARTICIPANTS = 64
MAX_STREAMS = 64
MAX_TEXT = 512  # characters kept of any one value (names, AoRs, header copies)


class MetadataError(ValueError):
    """Metadata that cannot be read: the SIP side answers 400 with this text in a Warning."""

    status = 400


@dataclass(frozen=True, slots=True)
class Participant:
    """A participant of the recorded communication session (RFC 7865 §6.5)."""

    id: str
    aor: str = ""  # nameID/@aor, as sent (Ribbon/Sonus send it without the sip: scheme)
    name: str = ""  # nameID/name: the display name
    send: tuple[str, ...] = ()  # stream ids this participant sends
    recv: tuple[str, ...] = ()
    calling_party: bool | None = None  # what a vendor extension says about this participant

    @property
    def name_addr(self) -> str:
        """`"Name" <aor>` (RFC 3261 §25.1 name-addr), `<aor>` without a name, '' without an AoR."""
        if not self.aor:
            return ""
        if not self.name:
            return f"<{self.aor}>"
        escaped = self.name.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}" <{self.aor}>'


@dataclass(frozen=True, slots=True)
class MetaStream:
    """A recorded stream (RFC 7865 §6.4): `label` names the SDP m= line with the same `a=label`."""

    id: str
    label: str = ""
    mode: str = ""  # "separate" / "mixed" where the SRC says (drafts); '' otherwise


@dataclass(frozen=True, slots=True)
class RecordingMetadata:
    """One metadata document, or the merge of a call's documents."""

    namespace: str = ""
    datamode: str = "complete"  # "complete" or "partial" (RFC 7865 §5.2)
    session_ids: tuple[str, ...] = ()
    participants: tuple[Participant, ...] = ()
    streams: tuple[MetaStream, ...] = ()
    # Explicit role references by participant id (<callingParty participant_id=…> and the like).
    role_refs: tuple[tuple[str, Role], ...] = ()
    # The communication session's own headers where an extension carries them (Ribbon/Sonus callData).
    cs_from: str = ""
    cs_to: str = ""
    cs_call_id: str = ""
    ucid: str = ""  # Oracle/Acme and Avaya universal call id
    # What the document refers to but does not declare (an unknown stream id in a send/recv, …).
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def participant(self, participant_id: str) -> Participant | None:
        return next((p for p in self.participants if p.id == participant_id), None)

    def stream_by_label(self, label: str) -> MetaStream | None:
        return next((s for s in self.streams if s.label == label), None)

    def senders(self, stream_id: str) -> tuple[Participant, ...]:
        """The participants that send the stream (RFC 7865 §6.6 <send>)."""
        return tuple(p for p in self.participants if stream_id in p.send)


# --- parsing ----------------------------------------------------------------------------------------


def _local(tag: object) -> str:
    """The element's name without its namespace ('{urn:…}participant' -> 'participant')."""
    text = tag if isinstance(tag, str) else ""
    return text.rsplit("}", 1)[-1]


def _namespace(tag: str) -> str:
    return tag[1:].split("}", 1)[0] if tag.startswith("{") else ""


def _attr(el: Element, *names: str) -> str:
    """The first of the attributes present (RFC name first, then the draft-era one), trimmed."""
    for name in names:
        value = el.get(name)
        if value is not None and value.strip():
            return value.strip()[:MAX_TEXT]
    return ""


def _text(el: Element | None) -> str:
    return "" if el is None or el.text is None else el.text.strip()[:MAX_TEXT]


def _children(el: Element, name: str) -> Iterator[Element]:
    return (c for c in el if _local(c.tag) == name)


def _child(el: Element, name: str) -> Element | None:
    return next(_children(el, name), None)


def _descendants(el: Element, name: str) -> Iterator[Element]:
    return (c for c in el.iter() if _local(c.tag) == name)


def _bool(text: str) -> bool | None:
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    return None


def parse_metadata(data: bytes | str) -> RecordingMetadata:
    """Read an rs-metadata document; MetadataError when it is not one (or is hostile)."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_METADATA_BYTES:
        raise MetadataError(f"recording metadata is {len(raw)} bytes (limit {MAX_METADATA_BYTES})")
    if not raw.strip():
        raise MetadataError("empty recording metadata")
    try:
        root = DefusedET.fromstring(raw, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as e:
        raise MetadataError(
            f"recording metadata refused: {type(e).__name__} (DTDs/entities not allowed)"
        ) from None
    except Exception as e:  # xml.etree.ElementTree.ParseError (expat) and decoding errors
        raise MetadataError(f"recording metadata is not well-formed XML: {str(e)[:120]}") from None
    if _local(root.tag) not in ROOT_NAMES:
        raise MetadataError(f"root element <{_local(root.tag)[:40]}> is not <recording> (RFC 7865 §9)")

    warnings: list[str] = []
    datamode = (_text(_child(root, "datamode")) or _text(_child(root, "dataMode")) or "complete").lower()
    if datamode not in ("complete", "partial"):
        warnings.append(f"unknown datamode {datamode[:20]!r}: read as complete")
        datamode = "complete"

    sessions = tuple(s for s in (_attr(el, "session_id", "id") for el in _children(root, "session")) if s)

    streams: list[MetaStream] = []
    for el in _children(root, "stream"):
        stream_id = _attr(el, "stream_id", "id")
        if not stream_id:
            warnings.append("a <stream> without stream_id was ignored")
            continue
        mode = (_text(_child(el, "mode")) or _attr(el, "mode")).lower()
        streams.append(MetaStream(stream_id, _text(_child(el, "label")), mode))
    if len(streams) > MAX_STREAMS:
        raise MetadataError(f"recording metadata declares {len(streams)} streams (limit {MAX_STREAMS})")

    participants: dict[str, Participant] = {}
    for el in _children(root, "participant"):
        pid = _attr(el, "participant_id", "id")
        if not pid:
            warnings.append("a <participant> without participant_id was ignored")
            continue
        aor, name = _name_id(el)
        calling: bool | None = None
        for ext in _descendants(el, "callingParty"):  # Oracle/Acme extensiondata
            calling = _bool(_text(ext))
        participants[pid] = Participant(
            id=pid,
            aor=aor,
            name=name,
            send=tuple(_text(s) for s in _children(el, "send") if _text(s)),  # draft style (Avaya)
            recv=tuple(_text(s) for s in _children(el, "recv") if _text(s)),
            calling_party=calling,
        )
        if len(participants) > MAX_PARTICIPANTS:
            raise MetadataError(f"recording metadata declares more than {MAX_PARTICIPANTS} participants")

    for el in _children(root, "participantstreamassoc"):
        pid = _attr(el, "participant_id", "id")
        if pid not in participants:
            warnings.append(f"participantstreamassoc for unknown participant {pid[:40]!r} ignored")
            continue
        p = participants[pid]
        send = tuple(_text(s) for s in _children(el, "send") if _text(s))
        recv = tuple(_text(s) for s in _children(el, "recv") if _text(s))
        participants[pid] = replace(p, send=_union(p.send, send), recv=_union(p.recv, recv))

    role_refs: list[tuple[str, Role]] = []
    for tag, role in (("callingParty", "caller"), ("calledParty", "callee")):
        for el in _descendants(root, tag):
            pid = _attr(el, "participant_id")
            if pid:
                role_refs.append((pid, role))  # type: ignore[arg-type]

    call_data = next(_descendants(root, "callData"), None)
    cs_from = cs_to = cs_call_id = ""
    if call_data is not None:
        cs_from = _text(_child(call_data, "fromhdr"))
        cs_to = _text(_child(call_data, "tohdr"))
        cs_call_id = _text(_child(call_data, "callid"))
    ucid = next((_text(el) for el in _descendants(root, "ucid") if _text(el)), "")

    metadata = RecordingMetadata(
        namespace=_namespace(root.tag if isinstance(root.tag, str) else ""),
        datamode=datamode,
        session_ids=sessions,
        participants=tuple(participants.values()),
        streams=tuple(streams),
        role_refs=tuple(role_refs),
        cs_from=cs_from,
        cs_to=cs_to,
        cs_call_id=cs_call_id,
        ucid=ucid.split(";", 1)[0],  # "00FA08…;encoding=hex"
    )
    return replace(metadata, warnings=tuple(warnings) + _dangling(metadata))


def _name_id(el: Element) -> tuple[str, str]:
    """(aor, display name) of the first <nameID> that has them (RFC 7865 §6.5)."""
    aor = name = ""
    for name_id in _children(el, "nameID"):
        aor = aor or _attr(name_id, "aor")
        name = name or _text(_child(name_id, "name"))
    return aor, name


def _union(a: tuple[str, ...], b: Iterable[str]) -> tuple[str, ...]:
    out = list(a)
    out += [x for x in b if x not in out]
    return tuple(out)


def _dangling(m: RecordingMetadata) -> tuple[str, ...]:
    """Stream ids that participants send or receive but that no <stream> declares."""
    known = {s.id for s in m.streams}
    out: list[str] = []
    for p in m.participants:
        out += [
            f"participant {p.id[:40]!r} refers to unknown stream {s[:40]!r}"
            for s in (*p.send, *p.recv)
            if s not in known
        ]
    return tuple(out)


# --- updates ------------------------------------------------------------------------------------------


def merge(previous: RecordingMetadata | None, update: RecordingMetadata) -> RecordingMetadata:
    """The call's metadata after `update` (RFC 7865 §5.2).

    A `complete` document replaces what was known. A `partial` one carries only what changed:
    participants and streams it names replace those with the same id (their stream associations
    are added to), the rest is kept.
    """
    if previous is None or update.datamode != "partial":
        return replace(update, datamode="complete")
    participants = {p.id: p for p in previous.participants}
    for p in update.participants:
        old = participants.get(p.id)
        if old is None:
            participants[p.id] = p
            continue
        participants[p.id] = replace(
            p,
            aor=p.aor or old.aor,
            name=p.name or old.name,
            send=_union(old.send, p.send),
            recv=_union(old.recv, p.recv),
            calling_party=p.calling_party if p.calling_party is not None else old.calling_party,
        )
    streams = {s.id: s for s in previous.streams}
    streams.update({s.id: s for s in update.streams})
    merged = replace(
        previous,
        session_ids=_union(previous.session_ids, update.session_ids),
        participants=tuple(participants.values()),
        streams=tuple(streams.values()),
        role_refs=previous.role_refs + update.role_refs,
        cs_from=update.cs_from or previous.cs_from,
        cs_to=update.cs_to or previous.cs_to,
        cs_call_id=update.cs_call_id or previous.cs_call_id,
        ucid=update.ucid or previous.ucid,
        datamode="complete",
    )
    return replace(merged, warnings=_dangling(merged))


# --- roles --------------------------------------------------------------------------------------------

_URI_IN_BRACKETS = re.compile(r"<([^>]*)>")


def _user_host(uri_or_header: str) -> tuple[str, str]:
    """(user, host) of a SIP/tel URI, a bare `user@host`, or a name-addr header value; lower case."""
    text = uri_or_header.strip()
    m = _URI_IN_BRACKETS.search(text)
    if m is not None:
        text = m.group(1)
    text = text.split(";", 1)[0].split("?", 1)[0]
    for scheme in ("sips:", "sip:", "tel:"):
        if text.lower().startswith(scheme):
            text = text[len(scheme) :]
            break
    user, at, host = text.rpartition("@")
    if not at:
        user, host = text, ""
    return user.lower(), host.split(":", 1)[0].lower()


def roles(metadata: RecordingMetadata) -> dict[str, Role]:
    """Participant id -> `caller`/`callee` where the metadata says who placed the call.

    Sources, strongest first: an explicit reference (`<callingParty participant_id=…>`), a participant's
    own `callingParty` flag (Oracle/Acme), the original From/To headers (Ribbon/Sonus `callData`)
    matched by user part to the participants' AoRs. In a two-party session one known role gives the
    other. Contradictions (two callers) leave the roles unknown: a wrong `leg` is worse than an id.
    """
    out: dict[str, Role] = {}
    known = {p.id for p in metadata.participants}
    for pid, role in metadata.role_refs:
        if pid in known:
            out.setdefault(pid, role)
    for p in metadata.participants:
        if p.id not in out and p.calling_party is not None:
            out[p.id] = "caller" if p.calling_party else "callee"
    if metadata.cs_from or metadata.cs_to:
        from_user = _user_host(metadata.cs_from)[0] if metadata.cs_from else ""
        to_user = _user_host(metadata.cs_to)[0] if metadata.cs_to else ""
        if from_user != to_user:
            for p in metadata.participants:
                user = _user_host(p.aor)[0] if p.aor else ""
                if p.id in out or not user:
                    continue
                if user == from_user:
                    out[p.id] = "caller"
                elif user == to_user:
                    out[p.id] = "callee"
    if len(metadata.participants) == 2 and len(out) == 1:
        pid, role = next(iter(out.items()))
        other = next(p.id for p in metadata.participants if p.id != pid)
        out[other] = "callee" if role == "caller" else "caller"
    values = list(out.values())
    if values.count("caller") > 1 or values.count("callee") > 1:
        return {}
    return out
