"""A telephony front end on loopback with real RTP sockets, a recording ASR engine and an in-memory
publisher; sipp (Debian's sip-tester) is the caller. Audio files are made with espeak-ng + sox."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from gateway.call.core import CallConfig
from gateway.call.frontend import FrontEndConfig, TelephonyFrontEnd
from gateway.call.legs import LocalLegs
from gateway.rtp.media import MediaConfig
from gateway.rtp.receiver import MediaManager
from tests.fixtures import peers
from tests.fixtures.telephony import MemoryPublisher, RecordingEngine, SippResult, run_sipp


@dataclass
class Gateway:
    frontend: TelephonyFrontEnd
    engine: RecordingEngine
    publisher: MemoryPublisher
    media: MediaManager
    tmp_path: Path

    @property
    def port(self) -> int:
        return self.frontend.sip_port

    async def sipp(self, scenario: str, *, keys: dict[str, str] | None = None, **kw: Any) -> SippResult:
        """Run sipp in a thread (it blocks) so the gateway's loop keeps serving. `keys` are sipp -key
        values on top of the defaults every scenario here uses."""
        values = {"dnis": "1000", "lang": "en-US", "pt": "0", "codec": "PCMU", "pad": "x"} | (keys or {})
        extra = tuple(a for k, v in values.items() for a in ("-key", k, v)) + tuple(kw.pop("extra", ()))
        return await asyncio.to_thread(run_sipp, scenario, self.port, self.tmp_path, extra=extra, **kw)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until every call has published call_end (sessions gone from the registry)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while self.frontend.active_calls and loop.time() < end:
            await asyncio.sleep(0.02)


GatewayFactory = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[GatewayFactory]:
    made: list[Gateway] = []

    async def make(media_config: MediaConfig | None = None, **config: Any) -> Gateway:
        base = random.randrange(32000, 60000, 2)
        media = MediaManager(
            media_config or MediaConfig(idle_fill_after_s=0.0, inactivity_timeout_s=0.0),
            host="127.0.0.1",
            port_min=base,
            port_max=base + 400,
            quarantine_s=0.0,
        )
        call_fields = {f.name for f in fields(CallConfig)}
        call = replace(
            CallConfig(finish_timeout_s=5.0), **{k: v for k, v in config.items() if k in call_fields}
        )
        sip = {k: v for k, v in config.items() if k not in call_fields}
        cfg = FrontEndConfig(sip_host="127.0.0.1", sip_port=0, call=call, **sip)
        engine = RecordingEngine()
        publisher = MemoryPublisher()
        frontend = TelephonyFrontEnd(cfg, LocalLegs(engine, media), publisher)
        await frontend.start()
        gw = Gateway(frontend, engine, publisher, media, tmp_path)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        await gw.frontend.close(timeout_s=5.0)


@dataclass(frozen=True)
class Speech:
    path: Path  # raw 8 kHz G.711 (no header: sipp's rtp_stream would play a WAV header as audio)
    law: str  # "ulaw" or "alaw"
    samples: int

    @property
    def codes(self) -> NDArray[np.uint8]:
        return np.frombuffer(self.path.read_bytes(), np.uint8)


def make_speech(directory: Path, text: str, law: str = "ulaw") -> Speech:
    espeak, sox = peers.tool("espeak-ng"), peers.tool("sox")
    wav = directory / "speech.wav"
    raw = directory / f"speech.{law}"
    subprocess.run([espeak, "-v", "en-us", "-s", "175", "-w", str(wav), text], check=True, timeout=30)
    encoding = "u-law" if law == "ulaw" else "a-law"
    subprocess.run(
        [sox, str(wav), "-r", "8000", "-c", "1", "-e", encoding, "-t", "raw", str(raw)], check=True
    )
    # The same audio before G.711 (for the quantization-error check).
    linear = raw.with_suffix(".s16")
    subprocess.run(
        [sox, str(wav), "-r", "8000", "-c", "1", "-e", "signed", "-b", "16", "-t", "raw", str(linear)],
        check=True,
    )
    data = raw.read_bytes()
    data = data[: len(data) // 160 * 160]  # whole 20 ms packets: rtp_stream sends every byte we give it
    raw.write_bytes(data)
    return Speech(raw, law, len(data))


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Speech:
    return make_speech(tmp_path_factory.mktemp("speech"), "The quick brown fox jumps over the lazy dog.")
