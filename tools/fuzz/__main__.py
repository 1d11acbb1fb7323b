"""`python -m tools.fuzz TARGET`: coverage-guided fuzzing of one target with atheris (libFuzzer).

    python -m tools.fuzz sip --runs 1000000 --corpus var/fuzz/sip      # the long run (docs/fuzzing.md)
    python -m tools.fuzz rtp --max-time 5                                # a short one

The gateway's modules are instrumented for coverage, the target's seeds are written into the corpus
directory when it is empty, and libFuzzer prints its statistics at the end (`Done N runs in S
second(s)`, `stat::number_of_executed_units`). An exception other than the target's own parse error
stops the run with the input saved under `--artifacts` (exit status 1 from libFuzzer's crash handler).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["gateway"]):
    from tools.fuzz.targets import TARGETS, check

MAX_LEN = {"sip": 4096, "framer": 2048, "agent": 4096, "sdp": 4096, "rtp": 1500, "dtmf": 512, "media": 4096}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("target", choices=sorted(TARGETS))
    p.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0 = no limit)")
    p.add_argument("--max-time", type=int, default=0, help="stop after this many seconds (0 = no limit)")
    p.add_argument("--corpus", type=Path, help="corpus directory (kept between runs); default: none")
    p.add_argument("--artifacts", type=Path, default=Path("var/fuzz/artifacts"), help="where crashes go")
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed")
    args, extra = p.parse_known_args(argv)
    target = TARGETS[args.target]
    args.artifacts.mkdir(parents=True, exist_ok=True)
    libfuzzer = [
        sys.argv[0],
        f"-max_len={MAX_LEN[target.name]}",
        f"-seed={args.seed}",
        f"-artifact_prefix={args.artifacts}/{target.name}-",
        "-print_final_stats=1",
        "-close_fd_mask=1",  # the targets' own log lines are not wanted on stdout
    ]
    if target.tokens:
        words = args.artifacts / f"{target.name}.dict"
        words.write_text("".join(f'"{_escape(t)}"\n' for t in target.tokens))
        libfuzzer.append(f"-dict={words}")
    if args.runs:
        libfuzzer.append(f"-runs={args.runs}")
    if args.max_time:
        libfuzzer.append(f"-max_total_time={args.max_time}")
    libfuzzer += extra
    if args.corpus is not None:
        args.corpus.mkdir(parents=True, exist_ok=True)
        if not any(args.corpus.iterdir()):
            for i, seed in enumerate(target.seeds()):
                (args.corpus / f"seed-{i}").write_bytes(seed)
        libfuzzer.append(str(args.corpus))
    else:
        # No corpus directory: start from the seeds all the same (libFuzzer reads them from a temp dir).
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=f"ttg-fuzz-{target.name}-"))
        for i, seed in enumerate(target.seeds()):
            (tmp / f"seed-{i}").write_bytes(seed)
        libfuzzer.append(str(tmp))

    def one_input(data: bytes) -> None:
        check(target, data)

    atheris.Setup(libfuzzer, one_input)
    atheris.Fuzz()


def _escape(token: bytes) -> str:
    """A libFuzzer dictionary string: printable ASCII as is, the rest (and quote, backslash) as \\xHH."""
    return "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\x{b:02X}" for b in token)


if __name__ == "__main__":
    main()
