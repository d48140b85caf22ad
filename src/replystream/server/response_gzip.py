"""gzip for a finished JSON, HTML or plain-text answer, when the client accepts it.

This file decides which answers are compressed, how hard, and where the work runs:
- only a whole body (a ``web.Response`` not yet sent) of JSON, HTML or plain text (the
  metrics a Prometheus server scrapes, asking for gzip) of at least ``min_bytes``; never an
  event stream, which is on the wire by the time its handler returns, nor the chat page,
  served as its files are (``AS_IS``);
- only for a client whose ``Accept-Encoding`` takes gzip (its q-values read: ``gzip;q=0``
  refuses it, ``*`` takes it unless gzip is refused by name);
- at zlib's fastest level, nginx's default (``gzip_comp_level 1``): several times faster than
  zlib's default level, which aiohttp's own compression uses, for a body a few per cent
  larger (measured in docs/performance.md, "A large answer gzipped");
- a large body in a worker thread (zlib lets go of the GIL while it works), so the event loop,
  and every stream it carries, goes on meanwhile; a megabyte at a time, so that it stops soon
  after the request is cancelled (its client gone).
Such an answer says ``Vary: Accept-Encoding``, compressed or not (a client that refuses gzip
gets it plain), so a cache between keeps the two forms apart.
"""

from __future__ import annotations

import asyncio
import threading
import zlib

from aiohttp import hdrs, web

LEVEL = 1
# A body at least this large is compressed off the loop: a few milliseconds of work or more,
# STEP_BYTES at a time, so that the work stops soon after its client has gone.
IN_THREAD_BYTES = 256 * 1024
STEP_BYTES = 1024 * 1024
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate stream
_COMPRESSED_TYPES = ("application/json", "text/html", "text/plain")
# Set on an answer that goes out as it is, as a file would: the chat page, whose ETag is its
# plain bytes' (a gzipped body under the same strong tag would be another representation).
AS_IS = web.ResponseKey("as_is", bool)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header takes gzip (RFC 9110, section 12.5.3)."""
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        taken = _weight(params) > 0.0
        if coding == "*":
            star = taken
        else:
            return taken  # named: its own weight decides, whatever "*" says
    return bool(star)


def _weight(params: str) -> float:
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return float(value.strip())
            except ValueError:
                return 0.0  # a weight that is no number takes nothing
    return 1.0


def gzipped(body: bytes, stop: threading.Event | None = None) -> bytes:
    """``body`` in gzip's format, at ``LEVEL``. ``stop``: compressed ``STEP_BYTES`` at a time,
    given up (``b""``) once it is set."""
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, _GZIP_WBITS)
    if stop is None:
        return compressor.compress(body) + compressor.flush()
    parts = []
    whole = memoryview(body)
    for start in range(0, len(body), STEP_BYTES):
        if stop.is_set():
            return b""
        parts.append(compressor.compress(whole[start : start + STEP_BYTES]))
    parts.append(compressor.flush())
    return b"".join(parts)


async def gzip_if_worthwhile(
    request: web.Request, response: web.StreamResponse, min_bytes: int
) -> None:
    """Compress ``response``'s body in place when it is worth it (see above)."""
    if not (
        isinstance(response, web.Response)
        and not response.prepared
        and not response.get(AS_IS, False)
        and response.content_type in _COMPRESSED_TYPES
        and isinstance(response.body, bytes)
        and len(response.body) >= min_bytes
        and hdrs.CONTENT_ENCODING not in response.headers
    ):
        return
    # Which form goes out depends on the request's Accept-Encoding, so the plain one says so
    # too: a cache that kept it unmarked would hand it to every client, gzip-taking or not.
    headers = response.headers
    headers.add(hdrs.VARY, hdrs.ACCEPT_ENCODING)
    if not accepts_gzip(request.headers.get(hdrs.ACCEPT_ENCODING, "")):
        return
    body = response.body
    if len(body) >= IN_THREAD_BYTES:
        stop = threading.Event()
        try:
            response.body = await asyncio.to_thread(gzipped, body, stop)
        except asyncio.CancelledError:  # the client left: the thread stops at its next step
            stop.set()
            raise
    else:
        response.body = gzipped(body)
    headers[hdrs.CONTENT_ENCODING] = "gzip"
    # A length a handler set is the plain body's: aiohttp writes the one it is left, so the
    # compressed body's is made when it is sent.
    headers.popall(hdrs.CONTENT_LENGTH, None)
