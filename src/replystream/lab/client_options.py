"""The options of the tools that send requests to a server as a client (``bench``,
``doctor``): how they trust an https server (``--cacert``, ``--insecure``) and the headers
they add (``--header``). This file decides those flags and their checks; it must not know
what the tools send or measure.
"""

from __future__ import annotations

import argparse
import re
import ssl
from collections.abc import Sequence
from pathlib import Path

from replystream.cli_values import Checker, readable_file
from replystream.client.transport import tls_context

_OWN_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not colon or not _TOKEN.fullmatch(name) or any(c in value for c in "\r\n\0"):
        raise argparse.ArgumentTypeError(f"want 'NAME: VALUE' (one line), got {text!r}")
    # HTTP/1.1 fields are ASCII in practice: other bytes a server may read as Latin-1, as
    # UTF-8 (how the client sends them) or not at all, so a value given here is ASCII.
    if not all(c == "\t" or " " <= c <= "~" for c in value):
        raise argparse.ArgumentTypeError(
            f"a header value is printable ASCII (percent- or base64-encode the rest), got {text!r}"
        )
    if name.lower() in _OWN_HEADERS:
        raise argparse.ArgumentTypeError(f"{name} is written by the client itself")
    return name, value


header = Checker("'NAME: VALUE', a header the client does not write itself", _header)


def add_client_arguments(parser: argparse.ArgumentParser, *, header_help: str) -> None:
    """``--cacert``, ``--insecure`` and ``--header`` (repeatable; ``header_help`` says where
    it goes)."""
    parser.add_argument(
        "--cacert",
        type=readable_file,
        metavar="FILE",
        help="https: verify the server's certificate against the CAs in this PEM file "
        "(default: the system's)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="https: do not verify the server's certificate or name (a self-signed test "
        "server; the figures are a TLS server's, the trust is none)",
    )
    add_header_argument(parser, header_help)


def add_header_argument(parser: argparse.ArgumentParser, header_help: str) -> None:
    """``--header`` (repeatable), ``header_help`` saying where it goes."""
    parser.add_argument(
        "--header",
        action="append",
        type=header,
        default=[],
        metavar="'NAME: VALUE'",
        help=header_help,
    )


def tls_for(urls: Sequence[str], cacert: Path | None, insecure: bool) -> ssl.SSLContext | None:
    """The TLS context for the https ones of ``urls`` (None when none is https); raises
    ValueError for a flag that does not fit."""
    if not any(url.lower().startswith("https://") for url in urls):
        which = "the URL is http://" if len(urls) == 1 else "no URL is https://"
        if cacert is not None:
            raise ValueError(f"--cacert verifies an https server: {which}")
        if insecure:
            raise ValueError(f"--insecure skips verifying an https server: {which}")
        return None
    if insecure and cacert is not None:
        raise ValueError("--insecure verifies nothing, so --cacert would not be used: drop one")
    try:
        return tls_context(cacert, verify=not insecure)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--cacert: {cacert} holds no usable PEM certificate ({exc})") from None
