"""One entry point: ``replystream serve | lab | ...``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
add a row to ``COMMANDS`` to add one. Modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from replystream import __version__

# name, module, one-line help
COMMANDS: list[tuple[str, str, str]] = [
    ("serve", "replystream.server.command", "run the reply server"),
    ("lab", "replystream.lab.command", "measure stream vs wait over real HTTP"),
    (
        "lab-engine",
        "replystream.lab.engine_lab",
        "measure the built-in engine: ttft, step, pool, spec",
    ),
    ("bench", "replystream.lab.bench", "load a streaming endpoint: TTFT, TPOT, ITL, goodput"),
    ("doctor", "replystream.lab.doctor", "find the hop that buffers a stream (CI exit status)"),
    ("kv", "replystream.lab.kvcalc", "size the KV cache: bytes per token, fit, decode-step floor"),
]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replystream", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"replystream {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv or () if not a.startswith("-")), None)
    for name, module_name, help_text in COMMANDS:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args_in = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_in).parse_args(args_in)
    code: int = args.run(args)
    return code
