"""What a command-line value may be: argparse types that say what they want.

This file decides the ranges of the command line's numbers, URLs and files, once for every
subcommand, so a mistake is refused while parsing with one line that names the flag (argparse
adds it) and says what would be accepted. It must not know what any option means.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar
from urllib.parse import SplitResult, urlsplit

from replystream.settings import default_worth_stating

Parse = Callable[[str], object]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Checker(Generic[T]):
    """An argparse type that can say what it accepts, so the settings reference states the
    same words the refusal does (``want a whole number >= 1, got 0``)."""

    wants: str
    parse: Callable[[str], T]

    def __call__(self, text: str) -> T:
        return self.parse(text)


# As a number is written on a command line: ASCII digits, no grouping underscores (Python's
# int() and float() also take "80_00" and other scripts' digits, which no one means).
_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    pattern = _WHOLE if kind is int else _DECIMAL
    if kind is float and text.strip().lstrip("+-").lower() in ("inf", "infinity", "nan"):
        raise argparse.ArgumentTypeError(f"want a finite number, got {text!r}")
    if pattern.fullmatch(text.strip()) is None:
        noun = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"want {noun}, got {text!r}")
    value = kind(text)
    if kind is float and not (value == value and abs(value) != float("inf")):
        raise argparse.ArgumentTypeError(f"want a finite number, got {text!r}")
    return value


def int_at_least(low: int, note: str = "") -> Checker[int]:
    """A whole number >= ``low``; ``note`` explains a special value (``0: off``)."""
    wants = f"a whole number >= {low}" + (f" ({note})" if note else "")

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"want {wants}, got {text}")
        return value

    return Checker(wants, parse)


def float_at_least(low: float, *, strict: bool = False, note: str = "") -> Checker[float]:
    """A finite number >= ``low`` (> ``low`` when ``strict``)."""
    bound = f"> {low:g}" if strict else f">= {low:g}"
    wants = f"a number {bound}" + (f" ({note})" if note else "")

    def parse(text: str) -> float:
        value = float(_number(text, float))
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"want {wants}, got {text}")
        return value

    return Checker(wants, parse)


def int_between(low: int, high: int) -> Checker[int]:
    """A whole number from ``low`` to ``high``, both included."""
    wants = f"a whole number from {low} to {high}"

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"want {wants}, got {text}")
        return value

    return Checker(wants, parse)


def float_between(
    low: float, high: float, *, zero: str = "", strict: bool = False
) -> Checker[float]:
    """A finite number from ``low`` to ``high``, both included (``low`` excluded when
    ``strict``), for a quantity whose arithmetic leaves the floats' range outside of it; with
    ``zero`` (what 0 means, as ``never``), 0 as well."""
    span = f"> {low:.10g} and <= {high:.10g}" if strict else f"from {low:.10g} to {high:.10g}"
    wants = f"a number {span}" + (f", or 0 ({zero})" if zero else "")

    def parse(text: str) -> float:
        value = float(_number(text, float))
        if not (low < value <= high or (not strict and value == low) or (zero and value == 0)):
            raise argparse.ArgumentTypeError(f"want {wants}, got {text}")
        return value

    return Checker(wants, parse)


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
positive_float = float_at_least(0.0, strict=True)
non_negative_float = float_at_least(0.0)
# A simulated schedule's times (a token's delay, its jitter, the prefill): up to a minute, far
# past any model's, so that a typing slip such as 1e300 is refused rather than a reply that
# never ends.
schedule_ms = float_between(0.0, 60_000.0)


def _port(text: str) -> int:
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"want {port.wants}, got {text}")
    return value


# A TCP port number (0: the kernel picks a free one).
port = Checker("a port from 0 to 65535 (0 picks a free one)", _port)


def _split_url(text: str, wants: str) -> SplitResult:
    try:
        return urlsplit(text)
    except ValueError:  # an unclosed [, or brackets around what is no IPv6 address
        raise argparse.ArgumentTypeError(
            f"{wants} (an IPv6 host in brackets: http://[::1]:8000), got {text!r}"
        ) from None


def http_url(text: str) -> str:
    """An ``http://HOST[:PORT]/...`` URL, for the tools that measure plain HTTP only."""
    parts = _split_url(text, "want http://HOST[:PORT]/PATH")
    if parts.scheme != "http" or not parts.hostname:
        why = (
            "https is not spoken here (measure the app's own http:// address, or a "
            "TLS-terminating proxy's http:// side; replystream bench speaks https)"
            if parts.scheme == "https"
            else "want http://HOST[:PORT]/PATH"
        )
        raise argparse.ArgumentTypeError(f"{why}, got {text!r}")
    return _measured_target(text)


def web_url(text: str) -> str:
    """An ``http://`` or ``https://HOST[:PORT]/...`` URL."""
    parts = _split_url(text, "want http(s)://HOST[:PORT]/PATH")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"want http(s)://HOST[:PORT]/PATH, got {text!r}")
    return _measured_target(text)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(text: str) -> str:
    # A browser sends its page's origin as scheme://host[:port], lower case, with no default
    # port and nothing after it; the allow-list is compared with that string as it is, so a
    # value in any other shape would silently match no page.
    if text == "*":
        return text
    try:
        parts = urlsplit(text)
    except ValueError:  # an unclosed [, or brackets around what is no IPv6 address
        raise argparse.ArgumentTypeError(f"want {origin.wants}, got {text!r}") from None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in _DEFAULT_PORTS or not host or any(c.isspace() for c in host):
        hint = f" (https://{text}?)" if "://" not in text and "." in text else ""
        raise argparse.ArgumentTypeError(f"want {origin.wants}, got {text!r}{hint}")
    if "[" in parts.netloc:
        host = _ipv6_as_browsers_write(host, text)
    if "@" in parts.netloc:
        raise argparse.ArgumentTypeError(f"an origin has no user name or password, got {text!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0 or parts.netloc.endswith(":"):
        raise argparse.ArgumentTypeError(f"want a port from 1 to 65535, got {text!r}")
    canonical = f"{scheme}://" + (f"[{host}]" if ":" in host else host)
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        canonical += f":{port}"
    if parts.path == "/" and not (parts.query or parts.fragment or text.endswith("?")):
        raise argparse.ArgumentTypeError(
            f"an origin ends at its host or port: drop the trailing slash ({canonical}), "
            f"got {text!r}"
        )
    if parts.path or parts.query or parts.fragment or text.endswith(("?", "#")):
        raise argparse.ArgumentTypeError(
            f"an origin has no path, query or fragment: want {canonical}, got {text!r}"
        )
    return canonical


def _ipv6_as_browsers_write(host: str, text: str) -> str:
    """The IPv6 address ``host`` (from ``text``'s brackets) as a browser writes it in an
    origin (the URL Standard's serializer, RFC 5952's form): lower-case hex without leading
    zeros, the first longest run of two or more zero groups as ``::``, an IPv4-mapped one in
    hex too (``::ffff:7f00:1``). Any other spelling would match no page's origin."""
    try:
        address = ipaddress.IPv6Address(host)
    except ValueError:
        address = None
    if address is None or address.scope_id is not None:
        # A zone (fe80::1%25eth0): browsers take no URL with one.
        raise argparse.ArgumentTypeError(
            f"want {origin.wants} (an IPv6 address in brackets, with no zone), got {text!r}"
        )
    groups = [int.from_bytes(address.packed[i : i + 2], "big") for i in range(0, 16, 2)]
    start, length = -1, 1
    for i in range(8):
        run = 0
        while i + run < 8 and groups[i + run] == 0:
            run += 1
        if run > length:
            start, length = i, run
    words = [f"{group:x}" for group in groups]
    if start < 0:
        return ":".join(words)
    return ":".join(words[:start]) + "::" + ":".join(words[start + length :])


# A browser page's origin for the CORS allow-list, made canonical (lower case, no default
# port), or * for any.
origin = Checker("an origin, http(s)://HOST[:PORT], or *", _origin)

_HOST_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def _host_name(text: str) -> str:
    # Compared with the Host header's name as it is, lower-cased: a value in another shape (a
    # port, a scheme) would match no request, silently.
    name = text.strip().lower().removesuffix(".")
    if name == "*":
        return name
    labels = name.removeprefix("*.").split(".")
    if not all(_HOST_LABEL.match(label) for label in labels):
        hint = " (the name alone: no scheme, port or path)" if any(c in name for c in ":/") else ""
        raise argparse.ArgumentTypeError(f"want {host_name.wants}, got {text!r}{hint}")
    return name


host_name = Checker("a host name, *.DOMAIN for its subdomains, or *", _host_name)


def _measured_target(text: str) -> str:
    # An HTTP/1.1 request line and Host header are printable ASCII: a space or a letter
    # outside it cannot be sent as typed (a browser percent-encodes it first).
    if not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError(
            f"a URL is printable ASCII with no spaces: percent-encode the rest "
            f"(%20 for a space; a host in its xn-- form), got {text!r}"
        )
    # The client writes the URL's host:port as the Host header: a user name and password
    # there would travel in clear to every hop (and into its logs) and authenticate nothing.
    if "@" in urlsplit(text).netloc:
        raise argparse.ArgumentTypeError(
            "a URL with a user name or password: they would not be sent as credentials; "
            "drop them from the URL and send the key with --header 'Authorization: Bearer KEY'"
        )
    return _with_valid_port(text)


def _with_valid_port(text: str) -> str:
    # A URL names the port to connect to: 0 is no such port (only a listener's "any").
    try:
        port = urlsplit(text).port
    except ValueError:
        port = 0
    if port == 0:
        raise argparse.ArgumentTypeError(f"want a port from 1 to 65535, got {text!r}")
    return text


def _readable_file(text: str) -> Path:
    if not text:  # Path("") is the current folder: "  is a folder" would name nothing
        raise argparse.ArgumentTypeError("want a file name, got an empty one")
    path = Path(text)
    if not path.is_file():
        if path.is_dir():
            what = "is a folder"
        elif path.exists():  # a device, a pipe, a socket: no file to read whole
            what = "is not a regular file"
        else:
            what = "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; want a readable file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text} is not readable by this user")
    return path


# A file that exists and this process may read.
readable_file = Checker("a readable file", _readable_file)


def _readable_text_file(text: str) -> Path:
    path = _readable_file(text)
    try:
        path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text} cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise argparse.ArgumentTypeError(
            f"{text} is not UTF-8 text (byte 0x{byte:02x} at offset {exc.start}: {exc.reason})"
        ) from None
    return path


# A file of lines this process may read, in UTF-8 (read whole here, to say which byte is not).
readable_text_file = Checker("a readable UTF-8 text file", _readable_text_file)


def _utf8_text(text: str) -> str:
    # Python decodes a command line in the locale's encoding, keeping bytes it cannot decode
    # as lone surrogates; os.fsencode gives back the bytes given. Those must be UTF-8, the
    # encoding a request carries (a URL's query, a JSON body), whatever the locale: under
    # LC_ALL=POSIX with UTF-8 mode off, "café" in UTF-8 reaches Python as surrogates, and
    # under a Latin-1 locale as "cafÃ©".
    try:
        given = os.fsencode(text)
    except UnicodeEncodeError:  # not from a command line (a caller's own str)
        given = text.encode("utf-8", "surrogateescape")
    try:
        return given.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not UTF-8 text (byte 0x{given[exc.start]:02x} at offset {exc.start}); check the "
            "terminal's or the script's encoding"
        ) from None


# Text sent in a request (a prompt, a model name): it must be the UTF-8 the wire carries.
utf8_text = Checker("UTF-8 text", _utf8_text)


def _non_empty_text(text: str) -> str:
    # An empty name or phrase would be taken and do nothing (no model answers to it, no text
    # contains it as a ban): refused, as an empty --api-key is.
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return _utf8_text(text)


non_empty_text = Checker("UTF-8 text, not empty", _non_empty_text)
# A name in any case, folded to upper case (a log level).
upper_case = Checker("a name in any case", str.upper)


def output_file(text: str) -> Path:
    """A file to write: its folder exists or can be made, and it is not a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; want a file name")
    if path.is_file():  # not a pipe such as /dev/stdout: opening one could wait for a reader
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # neither made nor emptied
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"{text}: cannot write it ({exc.strerror})") from None
        return path
    _check_folder(path.parent, text)
    return path


def output_folder(text: str) -> Path:
    """A folder to write into: it exists or can be made."""
    path = Path(text)
    _check_folder(path, text)
    return path


def _check_folder(folder: Path, text: str) -> None:
    problem = folder_problem(folder)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")


def folder_problem(folder: Path) -> str | None:
    """Why files cannot be written in ``folder`` (made first when missing); None if they can.

    Permission bits do not tell: root passes every check, and /proc or /sys refuse new
    files whatever their bits say. So this makes what the command would make, and removes
    it: a file in the folder when it exists, else a folder in its nearest existing ancestor.
    """
    existing = folder.absolute()  # named in full: "cannot make a file in ." says little
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    try:
        if existing == folder.absolute():
            with tempfile.TemporaryFile(dir=existing):
                pass
        else:
            with tempfile.TemporaryDirectory(dir=existing):
                pass
    except OSError as exc:
        what = "a file" if existing == folder.absolute() else "a folder"
        return f"cannot make {what} in {existing} ({exc.strerror})"
    return None


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that states each option's default, unless the help already speaks of it or the
    option has no value worth stating (off, empty, none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.option_strings and default_worth_stating(action.default, text):
            text += " (default: %(default)s)"
        return text
