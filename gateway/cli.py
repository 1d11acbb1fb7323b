"""The one `ttg` command. Each subcommand lives in its own module, imported only when used, so that
`ttg tail` does not load MLX and `ttg serve` does not load torch.

A subcommand module defines `add_arguments(parser)` and `main(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Keep in sync with the README's command list.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.daemon", "run the gateway daemon (SIP/RTP in, transcripts to Redis)"),
    "transcribe": ("tools.transcribe", "stream audio files through the engine and print the transcript"),
    "tail": ("gateway.tail", "print transcripts from Redis as they arrive"),
    "replay": ("tools.replay.cli", "synthetic call-load replay against a running gateway"),
    "bench": ("tools.bench.cli", "benchmarks (encoder, engine, decoder, media, sip, sink, speechlike)"),
    "make-bundle": ("tools.make_bundle", "write a complete model bundle with deterministic random weights"),
    "export": ("tools.export", "convert an upstream checkpoint into the bundle format"),
    "eval": ("tools.eval", "word/character error rate of a model on a labelled set"),
}
# The commands that run MLX: their process is set up for it (asr_core.configure_process: MLX's CPU BLAS,
# its CUDA graphs) before the command's module (which imports mlx) is loaded.
MLX_COMMANDS = frozenset({"serve", "transcribe", "bench", "make-bundle", "export", "eval"})
# Of those, the ones that may run torch in the same process (the reference, a .nemo checkpoint).
TORCH_COMMANDS = frozenset({"bench", "make-bundle", "export"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttg", description="telephony transcription gateway")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Only the chosen subcommand's module is imported (see main); others get a lazy hook.
        p.set_defaults(_lazy=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Find the subcommand first so only its module gets imported to add its arguments.
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in MLX_COMMANDS:
        from asr_core import configure_process

        configure_process(torch=name in TORCH_COMMANDS)
    if name in COMMANDS:
        module = importlib.import_module(COMMANDS[name][0])
        sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        add = module.add_arguments
        # A module with nested subcommands (`ttg bench NAME`) needs the argv to import only its own.
        if "argv" in inspect.signature(add).parameters:
            add(sub_action.choices[name], argv=argv)
        else:
            add(sub_action.choices[name])
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
