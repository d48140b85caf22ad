"""One entry point: ``replystream serve | lab | ...``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
add a row to ``COMMANDS`` to add one. Modules are imported only when their command runs.

Every mistake is one line and exit status 2: a wrong value (``--port 99999``) names the flag
and what it wants; a wrong flag or a missing argument says so and where the flags are listed
(``replystream serve --help``). A flag must be spelled whole: a prefix (``--work``) is refused,
never taken for the flag it begins. A reader of stdout that leaves (``| head -1``) ends the
command quietly with status 141, as a shell reports a writer whose pipe closed; a report's
reader leaving does not stop a command from writing its files. A measuring command (all
but ``serve``) takes SIGTERM as a Ctrl-C and then exits 143; a second SIGTERM ends it at once.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from replystream import __version__, start_hangup, start_interrupt
from replystream.cli_values import DefaultsHelpFormatter

DESCRIPTION = "Stream language-model replies, and measure streams: serve, lab, bench, doctor, kv."

# name, module, one-line help
COMMANDS: list[tuple[str, str, str]] = [
    ("serve", "replystream.server.command", "run the reply server"),
    ("lab", "replystream.lab.command", "measure stream vs wait over real HTTP"),
    (
        "lab-engine",
        "replystream.lab.engine_lab_command",
        "measure the built-in engine: ttft, step, pool, spec",
    ),
    ("bench", "replystream.lab.bench", "load a streaming endpoint: TTFT, TPOT, ITL, goodput"),
    ("doctor", "replystream.lab.doctor", "find the hop that buffers a stream (CI exit status)"),
    ("kv", "replystream.lab.kvcalc", "size the KV cache: bytes per token, fit, decode-step floor"),
]


class OneLineParser(argparse.ArgumentParser):
    """A parser whose mistakes are one line naming what is wrong, not a usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists them)\n")


def build_parser(
    argv: Sequence[str] | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and the parser of each subcommand by name.

    Value errors raise ``argparse.ArgumentError`` (``exit_on_error=False``) so ``main`` can
    print them as one line; only the chosen subcommand's module is imported.
    """
    parser = OneLineParser(
        prog="replystream", description=DESCRIPTION, exit_on_error=False, allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"replystream {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv or () if not a.startswith("-")), None)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for name, module_name, help_text in COMMANDS:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=DefaultsHelpFormatter,
            exit_on_error=False,
            allow_abbrev=False,
        )
        subparsers[name] = sub
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser, subparsers


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line, or exit 2 with one line saying what is wrong."""
    parser, subparsers = build_parser(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    sub = subparsers.get(chosen or "")
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        # An option before any command: argparse would say a command is required, or take
        # the option's value for one, not name the option.
        parser.error(f"unrecognized arguments: {argv[0]}: an option follows its command")
    try:
        args, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        if sub is None or exc.argument_name is None:
            # An unknown command (the top-level --help lists them), or arguments missing
            # (raised rather than passed to ``error`` since Python 3.13).
            (sub or parser).error(str(exc))
        print(f"{sub.prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if extra:
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C stopped
TERMINATED_EXIT = 143  # 128 + SIGTERM, as a shell reports a process a SIGTERM stopped
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader left
ESCAPE_ERRORS = "replystream.escape"
STDOUT_ERRORS = ("strict", "surrogateescape")  # Python's own, which stop at such text


def _discard_stdout() -> None:
    # Python would flush the unwritten rest at exit into the same closed pipe and print
    # "Exception ignored": what is left goes nowhere instead.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (captured, replaced)
        pass


# How long a measuring command sent SIGTERM may take to stop as on Ctrl-C (a local server's
# own stop takes up to 10 s) before SIGTERM ends it as by default.
TERMINATED_STOP_S = 30.0
_terminated = False


def _as_ctrl_c(signum: int, frame: FrameType | None) -> None:
    global _terminated
    _terminated = True
    # A second SIGTERM ends the command at once, as would this one were the Ctrl-C lost
    # (code that catches and drops a KeyboardInterrupt): SIGTERM must always end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ender = threading.Timer(TERMINATED_STOP_S, os.kill, (os.getpid(), signal.SIGTERM))
    ender.daemon = True
    ender.start()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # A background job of a script, deaf to the terminal's Ctrl-C, with no handler of
        # its own for it at this moment: the Ctrl-C is raised here, as Python's own would.
        raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT)  # to whichever handler has Ctrl-C at this moment


def _escape_unencodable(exc: UnicodeError) -> tuple[str | bytes, int]:
    # The bytes of a command line's argument the locale could not decode (a path) are
    # written back as they came, as Python's own surrogateescape does; anything else the
    # encoding cannot hold is written escaped (\xb5).
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    try:
        return codecs.lookup_error("surrogateescape")(exc)
    except UnicodeError:
        return codecs.backslashreplace_errors(exc)


def _escape_what_stdout_cannot_encode() -> None:
    # A report holds text its writer does not choose (a model's reply, a server's error, a
    # path) and a "µs": where stdout's encoding cannot hold a character (LC_ALL=POSIX with
    # UTF-8 mode off, PYTHONIOENCODING=ascii), it is written escaped rather than ending the
    # command with a traceback and its files unwritten. stderr already escapes by default.
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None and getattr(sys.stdout, "errors", None) in STDOUT_ERRORS:
        codecs.register_error(ESCAPE_ERRORS, _escape_unencodable)
        reconfigure(errors=ESCAPE_ERRORS)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _escape_what_stdout_cannot_encode()
    # Every plot a command draws is a PNG file drawn without a display (its module chooses
    # matplotlib's "Agg"): a MPLBACKEND this matplotlib does not know, set for other work,
    # failed its import, after a whole run.
    os.environ.pop("MPLBACKEND", None)
    if next((a for a in argv if not a.startswith("-")), None) == "serve":
        # A reload signal (``systemctl reload``) may come while serve starts: before it
        # knows which files it reads again, it must not stop, and one that came after a file
        # was read must not be lost. ``serve`` decides once it knows (``start_hangup``).
        start_hangup.remember()
        start_interrupt.remember()  # a Ctrl-C while it loads is never lost
    elif (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        and threading.current_thread() is threading.main_thread()
    ):
        # A measuring command sent SIGTERM (``timeout``, ``kill``) stops as on Ctrl-C, as load
        # tools do: its progress bar gives the terminal its cursor back, a server it started
        # is stopped, and a file half written is removed, where dying at once would leave them.
        # So does a background job of a script, whose Ctrl-C the shell ignores: SIGTERM is
        # how such a job is stopped. (A program calling ``main`` from another thread keeps
        # its own: only the main thread may set a handler.)
        signal.signal(signal.SIGTERM, _as_ctrl_c)
    try:
        args = parse(argv)
        code: int = args.run(args)
        if sys.stdout is not None:  # None when started with stdout closed (``>&-``)
            sys.stdout.flush()  # a reader that left (``| head -1``) is found here, not at exit
    except KeyboardInterrupt:  # Ctrl-C before a command took SIGINT (importing, loading)
        return TERMINATED_EXIT if _terminated else INTERRUPTED_EXIT
    except BrokenPipeError:  # the reader of stdout left: stop quietly, as any filter does
        _discard_stdout()
        return BROKEN_PIPE_EXIT
    except Exception:
        # A Ctrl-C that reached us as another error: Python 3.11 wraps one raised inside a
        # class's creation (``__set_name__``, as a dataclass field has) in a RuntimeError.
        if _terminated:
            return TERMINATED_EXIT
        if start_interrupt.interrupted():
            return INTERRUPTED_EXIT
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is _as_ctrl_c:  # a caller's own process again
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return TERMINATED_EXIT if _terminated and code == INTERRUPTED_EXIT else code
