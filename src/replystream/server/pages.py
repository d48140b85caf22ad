"""The chat pages: ``/`` (the chat), ``/eventsource.html`` and their assets under ``/static/``.

The files live in the ``replystream.web`` package and are served as they are: no build step.
Only files present when the application is created are served, looked up by name in a table,
so no request path ever reaches the filesystem. Every answer carries ``Cache-Control:
no-cache`` (revalidate with the ETag each time), so an upgraded package is never mixed with
a stale cached module, and ``X-Content-Type-Options: nosniff``. The pages carry a content
security policy that lets them run only this server's own scripts and styles and talk only
to it, and no other site frame them: a reply is model text, shown as text, and were a page
ever to insert some as markup, the policy would still refuse the scripts it runs and the
requests it makes (to send the API key the settings keep elsewhere, say).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

import replystream.web
from replystream.server.front_door import expect_later

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


def _file_handler(path: Path) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    headers = {
        "Cache-Control": "no-cache",
        "Content-Type": CONTENT_TYPES.get(path.suffix, "application/octet-stream"),
        "X-Content-Type-Options": "nosniff",
    }
    if path.suffix == ".html":
        headers["Content-Security-Policy"] = PAGE_POLICY
        headers["Referrer-Policy"] = "no-referrer"

    async def handle(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(path, headers=headers)

    return handle


def add_page_routes(app: web.Application) -> None:
    """Serve the chat pages and their static assets from the installed package."""
    for route, name in PAGES.items():
        app.router.add_get(route, _file_handler(WEB_DIR / name), expect_handler=expect_later)
    static = WEB_DIR / "static"
    for path in sorted(static.iterdir()):
        if path.is_file() and path.suffix in CONTENT_TYPES:
            app.router.add_get(
                f"/static/{path.name}", _file_handler(path), expect_handler=expect_later
            )
