"""The chat pages: ``/`` (the chat), ``/eventsource.html`` and their assets under ``/static/``.

The files live in the ``replystream.web`` package and are served as they are: no build step.
Only files present when the application is created are served, read then and kept in memory
(about 70 KB), looked up by name in a table, so no request path ever reaches the filesystem
and no request needs a file descriptor or a worker thread of its own. Every answer carries
``Cache-Control: no-cache`` (revalidate with the ETag each time), so an upgraded package is
never mixed with a stale cached module, and ``X-Content-Type-Options: nosniff``. The pages
carry a content security policy that lets them run only this server's own scripts and styles
and talk only to it, and no other site frame them: a reply is model text, shown as text, and
were a page ever to insert some as markup, the policy would still refuse the scripts it runs
and the requests it makes (to send the API key the settings keep elsewhere, say).

The chat page's delivery fields say, empty, what the server does when a request leaves them
out: the page is rendered once, as the application is made, with this server's defaults in
their placeholders, and served from memory with an ETag of its bytes. It is told the server's
keep-alive period too (``<meta name="keepalive-s">``, 0: none), after three of which with no
byte a stream counts as dropped.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

import replystream.web
from replystream.delivery.policy import DeliveryPolicy
from replystream.server.front_door import expect_later
from replystream.server.response_gzip import AS_IS

WEB_DIR = Path(replystream.web.__file__).parent
PAGES = {"/": "index.html", "/eventsource.html": "eventsource.html"}
# Module scripts must be served with a JavaScript MIME type; do not rely on the host's
# mime.types for it.
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


# The pages load their modules and style sheet from /static/ and have no inline script or
# style; their icon is a data: URL. CSSOM (``element.style.height = ...``) is not restricted.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def delivery_placeholders(policy: DeliveryPolicy) -> dict[str, str]:
    """What each delivery field of the chat page does when left empty, under ``policy``."""
    if policy.batch_tokens is not None:
        batch_tokens = str(policy.batch_tokens)
    else:  # every token, or, with a window, as many as the window gathers
        batch_tokens = "1" if policy.batch_ms is None else "window's"
    return {
        "batch_tokens": batch_tokens,
        "batch_ms": "none" if policy.batch_ms is None else f"{policy.batch_ms:g}",
        "holdback_tokens": str(policy.holdback_tokens),
    }


def render_keepalive(page: str, policy: DeliveryPolicy) -> str:
    """``page`` with its ``keepalive-s`` meta saying ``policy``'s period (0: none)."""
    seconds = 0.0 if policy.keepalive_s is None else policy.keepalive_s
    field = re.compile(r'(<meta name="keepalive-s" content=")[^"]*(")')
    page, found = field.subn(rf"\g<1>{seconds:g}\g<2>", page)
    if found != 1:
        raise ValueError(f"the page has {found} keepalive-s metas")
    return page


def render_placeholders(page: str, placeholders: dict[str, str]) -> str:
    """``page`` with the placeholder of each named input set; every name must be there once."""
    for name, text in placeholders.items():
        field = re.compile(rf'(<input name="{name}"[^>]*? placeholder=")[^"]*(")')
        attribute = html.escape(text).replace("\\", "\\\\")  # as re.sub's template
        page, found = field.subn(rf"\g<1>{attribute}\g<2>", page)
        if found != 1:
            raise ValueError(f"the page has {found} inputs named {name!r}")
    return page


def _headers(path: Path) -> dict[str, str]:
    headers = {
        "Cache-Control": "no-cache",
        "Content-Type": CONTENT_TYPES.get(path.suffix, "application/octet-stream"),
        "X-Content-Type-Options": "nosniff",
    }
    if path.suffix == ".html":
        headers["Content-Security-Policy"] = PAGE_POLICY
        headers["Referrer-Policy"] = "no-referrer"
    return headers


def _held_handler(
    path: Path, body: bytes
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Serve ``body`` (the file at ``path``, or the page there rendered) from memory as
    ``FileResponse`` serves a file: with a strong ETag, a ``304`` to a request that holds it,
    and never compressed. Read once, as the application is made: a file opened per request
    (``FileResponse``, in a worker thread) was a ``404`` with no body and no log line for a
    process out of file descriptors, and waited behind whatever else held the threads."""
    etag = hashlib.sha256(body).hexdigest()[:32]
    headers = _headers(path)

    async def handle(request: web.Request) -> web.StreamResponse:
        held = request.if_none_match or ()
        if any(tag.value in (etag, "*") for tag in held):
            response = web.Response(status=304, headers=headers)
        else:
            response = web.Response(body=body, headers=headers)
        response.etag = etag
        response[AS_IS] = True
        return response

    return handle


def add_page_routes(app: web.Application, policy: DeliveryPolicy) -> None:
    """Serve the chat pages and their static assets from the installed package, the chat
    page's delivery fields saying ``policy``'s defaults."""
    for route, name in PAGES.items():
        path = WEB_DIR / name
        if name == "index.html":
            page = render_placeholders(path.read_text("utf-8"), delivery_placeholders(policy))
            page = render_keepalive(page, policy)
            handler = _held_handler(path, page.encode())
        else:
            handler = _held_handler(path, path.read_bytes())
        app.router.add_get(route, handler, expect_handler=expect_later)
    static = WEB_DIR / "static"
    for path in sorted(static.iterdir()):
        if path.is_file() and path.suffix in CONTENT_TYPES:
            app.router.add_get(
                f"/static/{path.name}",
                _held_handler(path, path.read_bytes()),
                expect_handler=expect_later,
            )
