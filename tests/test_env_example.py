"""ops/env.example lists every setting with its true default (regenerate: python -m tools.gen_env_example)."""

from __future__ import annotations

import re

import pytest

from gateway.config import NEMO_ALIASES, Settings, env_variables
from tools.gen_env_example import OUT, main, render

LINE = re.compile(r"^#(TTG_[A-Z0-9_]+)=(.*)$")


def example_vars() -> dict[str, str]:
    return {m[1]: m[2] for line in OUT.read_text().splitlines() if (m := LINE.match(line))}


def test_env_example_is_the_generated_file() -> None:
    assert main(["--check"]) == 0, "ops/env.example is stale: run python -m tools.gen_env_example"
    assert OUT.read_text() == render()


def test_every_setting_is_listed_once_with_its_description() -> None:
    listed = example_vars()
    names = [name for name, _, _ in env_variables()]
    assert sorted(listed) == sorted(names) and len(names) == len(set(names))
    text = OUT.read_text()
    for name, _, description in env_variables():
        assert description, f"{name} has no description in gateway/config.py"
        assert f"# {description}\n#{name}=" in text


def test_the_listed_defaults_read_back_as_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # Uncommenting any line unchanged must not change the configuration (an empty value means
    # "not set": such lines stay commented out).
    for name in [*example_vars(), *NEMO_ALIASES]:
        monkeypatch.delenv(name, raising=False)
    defaults = Settings().model_dump()
    for name, value in example_vars().items():
        if value != "":
            monkeypatch.setenv(name, value)
    assert Settings().model_dump() == defaults
