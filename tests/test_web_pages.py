"""The chat pages' routes, without a browser: what is served, how, and what is not."""

from __future__ import annotations

import html
import re
import sys

import aiohttp
import pytest

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import create_app, running
from replystream.server.pages import WEB_DIR
from replystream.server.server_config import ServerConfig
from tests import browser
from tests.conftest import fast_engine
from tests.services import REQUIRE_ENV

MODULES = ["app.js", "reply.js", "render.js", "sse.js", "eventsource.js"]


async def test_pages_and_assets_are_served_uncached_with_their_types():
    expected = {
        "/": "text/html",
        "/eventsource.html": "text/html",
        "/static/style.css": "text/css",
        **{f"/static/{name}": "text/javascript" for name in MODULES},
    }
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        for path, content_type in expected.items():
            async with http.get(f"{url}{path}") as response:
                assert response.status == 200, path
                assert response.content_type == content_type, path
                assert response.headers["Cache-Control"] == "no-cache", path
                assert "ETag" in response.headers, path
                assert response.headers["X-Content-Type-Options"] == "nosniff", path
                policy = response.headers.get("Content-Security-Policy", "")
                # The pages' own: framed by no other site, scripts only from here.
                page = content_type == "text/html"
                assert ("frame-ancestors 'none'" in policy) == page, path
                assert ("script-src 'self';" in policy) == page, path
                await response.read()


async def test_pages_and_assets_go_out_as_they_are_to_a_client_that_takes_gzip():
    # A JSON answer this long is gzipped; the chat page, rendered with the server's defaults,
    # is served as its files are: its strong ETag names its plain bytes.
    paths = ["/", "/eventsource.html", "/static/style.css", *(f"/static/{m}" for m in MODULES)]
    headers = {"Accept-Encoding": "gzip"}
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        for path in paths:
            async with http.get(f"{url}{path}", headers=headers) as response:
                body = await response.read()
                assert response.status == 200, path
                assert len(body) >= 512, path
                assert "Content-Encoding" not in response.headers, path
                assert int(response.headers["Content-Length"]) == len(body), path
        async with http.get(f"{url}/wait", headers=headers) as response:
            await response.read()
            assert response.headers["Content-Encoding"] == "gzip"


async def test_unknown_or_escaping_paths_are_not_found():
    paths = [
        "/static/nope.js",
        "/static/../__init__.py",
        "/static/%2e%2e/__init__.py",
        "/static/",
        "/index.html/../eventsource.html/x",
        "/__init__.py",
    ]
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        for path in paths:
            async with http.get(f"{url}{path}") as response:
                assert response.status == 404, path


@pytest.mark.parametrize("path", ["/", "/eventsource.html", "/static/sse.js"])
async def test_a_revalidated_page_is_not_modified(path: str):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}{path}") as response:
            etag = response.headers["ETag"]
            body = await response.read()
        for held in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            async with http.get(f"{url}{path}", headers={"If-None-Match": held}) as response:
                assert response.status == 304, held
                assert response.headers["ETag"] == etag
                assert response.headers["Cache-Control"] == "no-cache"
        async with http.get(f"{url}{path}", headers={"If-None-Match": '"other"'}) as response:
            assert response.status == 200
            assert await response.read() == body


def _placeholders(page: str) -> dict[str, str]:
    fields = re.findall(r'<input name="(\w+)"[^>]*? placeholder="([^"]*)"', page)
    return {name: html.unescape(text) for name, text in fields}  # as the browser reads them


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (DeliveryPolicy(), {"batch_tokens": "1", "batch_ms": "none", "holdback_tokens": "0"}),
        (
            DeliveryPolicy(batch_tokens=4, batch_ms=12.5, holdback_tokens=3),
            {"batch_tokens": "4", "batch_ms": "12.5", "holdback_tokens": "3"},
        ),
        (DeliveryPolicy(batch_ms=50), {"batch_tokens": "window's", "batch_ms": "50"}),
    ],
)
async def test_the_chat_page_says_the_servers_delivery_defaults(
    policy: DeliveryPolicy, expected: dict[str, str]
):
    # Its fields left empty take the server's defaults: the page shows them, not its own.
    config = ServerConfig(policy=policy)
    async with running(create_app(fast_engine(), config)) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/") as response:
            page = await response.text()
    placeholders = _placeholders(page)
    assert {name: placeholders[name] for name in expected} == expected
    assert placeholders["seed"] == "random"  # the rest of the page as it is
    assert page.count("<input ") == (WEB_DIR / "index.html").read_text().count("<input ")


def test_every_module_the_pages_import_is_in_the_package():
    for name in MODULES:
        source = (WEB_DIR / "static" / name).read_text()
        for line in source.splitlines():
            if line.startswith("import ") and " from './" in line:
                imported = line.split("from './", 1)[1].split("'", 1)[0]
                assert (WEB_DIR / "static" / imported).is_file(), (name, imported)


async def test_missing_playwright_skips_unless_services_are_required(monkeypatch):
    monkeypatch.setitem(sys.modules, "playwright.async_api", None)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="pip install playwright"):
        async with browser.chromium():
            pass
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE_ENV):
        async with browser.chromium():
            pass
