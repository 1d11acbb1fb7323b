"""Write ops/env.example from gateway.config (every TTG_* variable, its default and description).

python -m tools.gen_env_example          # rewrite the file
python -m tools.gen_env_example --check  # exit 1 if it differs (tests/test_env_example.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.config import NEMO_ALIASES, env_variables

OUT = Path(__file__).resolve().parents[1] / "ops" / "env.example"

HEADER = """\
# ttg settings: environment variables TTG_<SECTION>__<FIELD> (pydantic-settings).
# Every variable is listed with its default; uncomment a line to change it. Lists are JSON.
# Generated from gateway/config.py by `python -m tools.gen_env_example`; tests keep it in sync.
# systemd: EnvironmentFile=/etc/ttg/ttg.env; launchd: EnvironmentVariables in the plist.
"""


def render() -> str:
    lines = [HEADER]
    section = ""
    for name, default, description in env_variables():
        this = name.split("__", 1)[0].removeprefix("TTG_").lower()
        if this != section:
            section = this
            lines.append(f"\n# --- {section} " + "-" * (94 - len(section)) + "\n")
        lines.append(f"# {description}\n" if description else "")
        lines.append(f"#{name}={default}\n")
    lines.append("\n# --- aliases of the seed server's variables (a TTG_* variable wins) " + "-" * 30 + "\n")
    for alias, (section, field) in NEMO_ALIASES.items():
        lines.append(f"# {alias} = TTG_{section.upper()}__{field.upper()}\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python -m tools.gen_env_example", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
