"""The suite skips nothing but platform checks: a missing peer or extra fails (tests/fixtures/peers.py)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SKIPS = re.compile(r"pytest\.skip\(|\.skipif\(|pytest\.mark\.skip\b|importorskip\(|allow_module_level")


def test_only_the_platform_checks_in_peers_skip() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{n}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path.name not in {"peers.py", Path(__file__).name}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SKIPS.search(line)
    ]
    hint = "a missing peer fails: use tests.fixtures.peers (tool, module and the platform marks)"
    assert found == [], hint + "\n" + "\n".join(found)
