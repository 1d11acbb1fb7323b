"""sipsak (a SIP swiss-army knife) sends hand-written requests to `ttg serve` over UDP and TCP: an
OPTIONS with an ISO-8859-1 display name gets its 200 (header bytes echoed as sent), a Content-Length
written with a Unicode digit gets a 400; never silence, and the daemon keeps serving."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import Serve
from tests.fixtures.peers import tool
from tools.ports import port_block

pytestmark = [pytest.mark.slow]

OPTIONS = (
    "OPTIONS sip:1000@127.0.0.1:{port} SIP/2.0\r\n"
    'From: "J\xfcrgen M\xfcller" <sip:juergen@127.0.0.1>;tag=latin1\r\n'
    "To: <sip:1000@127.0.0.1:{port}>\r\n"
    "Call-ID: {call_id}@127.0.0.1\r\n"
    "CSeq: 1 OPTIONS\r\n"
    "Max-Forwards: 70\r\n"
    "Content-Length: {length}\r\n"
    "\r\n"
)


def sipsak(gw: Serve, message: bytes, transport: str, workdir: Path) -> bytes:
    """Send `message` (sipsak adds its own Via on top) and return what sipsak printed of the reply."""
    path = workdir / f"msg-{transport}-{abs(hash(message))}.sip"
    path.write_bytes(message)
    proc = subprocess.run(
        [tool("sipsak"), "-vvv", "-L", "-f", str(path), "-s", f"sip:1000@127.0.0.1:{gw.sip_port}",
         "-H", "127.0.0.1", "-l", str(port_block(2, tcp=True)), "-E", transport],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    return proc.stdout + proc.stderr


async def test_a_latin1_header_gets_an_answer_and_a_unicode_digit_length_a_400_over_udp_and_tcp(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, tmp_path: Path
) -> None:
    gw = serve(bundle=tiny_bundle, redis_url=redis_url)
    await asyncio.to_thread(gw.start)
    for transport in ("udp", "tcp"):
        latin1 = OPTIONS.format(port=gw.sip_port, call_id=f"l1-{transport}", length="0").encode("latin-1")
        reply = await asyncio.to_thread(sipsak, gw, latin1, transport, tmp_path)
        assert b"SIP/2.0 200 OK" in reply, reply.decode("latin-1")
        assert b'From: "J\xfcrgen M\xfcller" <sip:juergen@127.0.0.1>;tag=latin1' in reply

        digit = OPTIONS.format(port=gw.sip_port, call_id=f"sup-{transport}", length="\xb2").encode("utf-8")
        digit = digit.replace("J\xfcrgen M\xfcller".encode(), b"Juergen")
        reply = await asyncio.to_thread(sipsak, gw, digit, transport, tmp_path)
        assert b"SIP/2.0 400 Bad Request" in reply, reply.decode("latin-1")
    assert gw.running and "Traceback" not in gw.log()
    assert gw.metric("ttg_sip_errors_total", reason="internal") == 0
