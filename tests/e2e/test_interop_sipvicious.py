"""Password guessing with sipvicious' svcrack (INVITE, MD5 digest) against `ttg serve` with a trunk
password. With the default ban the dictionary is stopped before it reaches the password; every failure
is one log line naming the source and the user, which the fail2ban filter in ops/ matches. The same
dictionary against a gateway with bans off finds the password: the test itself can fail, and an
MD5-only client authenticates against the default challenge order."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Serve
from tests.fixtures.peers import tool
from tools.ports import port_block

pytestmark = [pytest.mark.slow]

PASSWORD = "bluebird"
# 40 words, the password at 16: past the 5 failures that ban a source.
WORDS = (  # noqa: SIM905 (a word list reads better than 40 quoted strings)
    "123456 password 12345678 qwerty 123456789 12345 1234 111111 1234567 dragon 123123 baseball "
    "abc123 football monkey bluebird 696969 shadow master 666666 qwertyuiop 123321 mustang "
    "1234567890 michael 654321 sunshine superman 1qaz2wsx 7777777 121212 000000 qazwsx 123qwe "
    "killer trustno1 jordan jennifer zxcvbnm asdfgh"
).split()
FILTER = REPO / "ops" / "fail2ban" / "filter.d" / "ttg-sip.conf"


def svcrack(gw: Serve, dictionary: Path, workdir: Path) -> str:
    binary = tool("svcrack")
    proc = subprocess.run(
        [binary, "-u", "trunk", "-d", str(dictionary), "-m", "INVITE", "-b", "127.0.0.1",
         "-P", str(port_block(2)), f"udp://127.0.0.1:{gw.sip_port}"],
        cwd=workdir, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return proc.stdout + proc.stderr


# Two gateways of several processes each: run in the multi-process model only (the shipping default on
# machines of 4 cores or more; SIP, where this is decided, is the same code in both models).
@pytest.mark.parametrize("serve", ["media_workers"], indirect=True)
async def test_svcrack_is_banned_before_it_reaches_the_password_and_every_failure_is_logged(
    serve: Callable[..., Serve], tiny_bundle: Path, redis_url: str, tmp_path: Path
) -> None:
    assert len(WORDS) == 40 and WORDS.index(PASSWORD) == 15
    dictionary = tmp_path / "words.txt"
    dictionary.write_text("\n".join(WORDS) + "\n")
    auth = {"TTG_SIP__DIGEST_USER": "trunk", "TTG_SIP__DIGEST_PASSWORD": PASSWORD}
    guarded = serve(bundle=tiny_bundle, redis_url=redis_url, env=auth)
    no_ban = {**auth, "TTG_SIP__AUTH_MAX_FAILURES": "0"}
    open_door = serve(bundle=tiny_bundle, redis_url=redis_url, env=no_ban)
    await asyncio.gather(asyncio.to_thread(guarded.start), asyncio.to_thread(open_door.start))

    found = await asyncio.to_thread(svcrack, open_door, dictionary, tmp_path)
    assert re.search(rf"\|\s*trunk\s*\|\s*{PASSWORD}\s*\|", found), found  # svcrack's result table

    report = await asyncio.to_thread(svcrack, guarded, dictionary, tmp_path)
    assert "found nothing" in report and PASSWORD not in report, report
    log = guarded.log()
    failures = re.findall(r'SIP auth failed: source=(127\.0\.0\.1):\d+ user="trunk" realm="ttg"', log)
    assert len(failures) == 5, log[-3000:]
    assert "SIP source 127.0.0.1 banned for 600 s after 5 failed authentications" in log
    assert guarded.metric("ttg_sip_auth_failures_total") == 5
    assert guarded.metric("ttg_sip_auth_bans_total") == 1
    assert guarded.metric("ttg_sip_errors_total", reason="banned") >= 1
    assert guarded.metric("ttg_calls_total", result="admitted") == 0

    tool("fail2ban-regex")
    f2b = subprocess.run(
        ["fail2ban-regex", "--print-all-matched", str(guarded.log_path), str(FILTER)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f2b.returncode == 0, f2b.stdout + f2b.stderr
    assert re.search(r"Lines: \d+ lines, 0 ignored, 5 matched", f2b.stdout), f2b.stdout
