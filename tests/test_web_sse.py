"""The page's SSE parser (sse.js) in Chromium, against the Python parser and odd chunkings.

A small test server serves the real page and a scripted ``POST /v1/replies`` that writes a
canned event stream in a chosen chunking (one byte at a time, CR at chunk ends, three events
per chunk) or with a chosen ending (error, moderated, end of file without ``done``).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from replystream.delivery.policy import DeliveryPolicy
from replystream.server import running
from replystream.server.pages import add_page_routes
from replystream.sse import EventParser
from tests.browser import chromium

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page

pytestmark = pytest.mark.slow

WORDS = ["Naïve ", "café ", "—  ", "emoji 😀 ", "and ", "CJK 漢字 ", "done."]
TEXT = "".join(WORDS)

# Streams that exercise every parsing rule; each is also cut at every byte and at random.
BODIES: list[bytes] = [
    b"data: hi\n\n",
    b"event: token\r\ndata: a\r\rdata: b\r\n\r\n",
    b"data: one\ndata:two\ndata:  three\n\n",
    b": keep-alive\ndata\n\ndata:\n\n:comment only\n\n",
    b"id: 1\ndata: a\n\nid: 2\x00x\ndata: b\n\nid\ndata: c\n\n",
    b"retry: 1500\ndata: x\n\nretry: 12a\n\nretry: \xc2\xb2\n\n",
    b"\xef\xbb\xbfdata: bom\n\ndata: \xef\xbb\xbfkept\n\n",
    "data: é😀 漢字\n\n".encode(),
    b"data: \xff\xfe ok\n\ndata: \xe2\x82x\n\n",
    b"data: a\n\ndata: incomplete",
    b"event: ping\n\nevent: named\ndata: d\n\n",
    b"foo: bar\ndata: x\nevent\n\n",
    b"\r\n\r\n\n\rdata: after blanks\r\n\r\n",
    b"data:no space\ndata: \ttab\n\n",
    b'id: 7\nevent: token\ndata: {"text": "x"}\n\nid: 8\ndata: y\r',
]


def chunkings(body: bytes, seed: int) -> list[list[bytes]]:
    """Whole, byte by byte, cut in two at every point, and 10 random cuts into 2-6 pieces."""
    ways = [[body], [body[i : i + 1] for i in range(len(body))]]
    ways += [[body[:i], body[i:]] for i in range(1, len(body))]
    rng = random.Random(seed)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(body)), k=min(len(body) - 1, rng.randint(1, 5))))
        ways.append([body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)])
    return ways


def python_parse(chunks: list[bytes]) -> dict[str, Any]:
    parser = EventParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    parser.close()
    return {
        "events": [[e.type, e.data, e.id] for e in events],
        "lastEventId": parser.last_event_id,
        "retry": parser.retry,
        "discarded": parser.discarded_incomplete,
    }


JS_PARSE = """async (cases) => {
    const { SSEParser } = await import('/static/sse.js');
    return cases.map((chunks) => {
        const parser = new SSEParser();
        const decoder = new TextDecoder();
        const events = [];
        for (const chunk of chunks) {
            events.push(...parser.feed(decoder.decode(new Uint8Array(chunk), { stream: true })));
        }
        events.push(...parser.feed(decoder.decode()));
        const discarded = parser.end();
        return {
            events: events.map((e) => [e.type, e.data, e.id]),
            lastEventId: parser.lastEventId,
            retry: parser.retry,
            discarded,
        };
    });
}"""


def event(kind: str, data: object, seq: int | None, eol: str = "\n") -> str:
    lines = [f"event: {kind}"] + ([f"id: {seq}"] if seq is not None else [])
    text = json.dumps(data, ensure_ascii=False)
    if kind == "token":  # split across two data lines: the parser joins them with LF
        cut = text.index(",") + 1
        lines += [f"data: {text[:cut]}", f"data:{text[cut:]}"]
    else:
        lines.append(f"data: {text}")
    return eol.join(lines) + eol + eol


def reply_events(ending: str, eol: str = "\n", with_id: bool = True) -> list[bytes]:
    """A reply as a list of whole events (bytes), ending as asked."""
    seq = iter(range(1, 100))
    events = [f"retry: 200{eol}: keep-alive{eol}{eol}"]
    if with_id:
        events.append(event("reply", {"reply_id": "r1"}, next(seq), eol))
    events += [event("token", {"text": w, "tokens": 1}, next(seq), eol) for w in WORDS]
    if ending == "done":
        events.append(event("usage", {"completion_tokens": len(WORDS)}, next(seq), eol))
        events.append(event("done", {"finish_reason": "stop"}, next(seq), eol))
    elif ending == "error":
        events.append(event("error", {"error": {"message": "engine fell over", "code": "x"}}, 99))
    elif ending == "moderated":
        moderated = {"check": "banned", "reason": "phrase", "released_chars": 3}
        events.append(event("moderated", moderated, 99))
    return [e.encode() for e in events]


def split_after_cr(body: bytes) -> list[bytes]:
    pieces = body.split(b"\r")
    return [p + b"\r" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])


Chunker = Callable[[], list[bytes]]
DROPPED_AFTER = 3  # tokens sent before the scripted connection drop
NOT_SSE = "not-sse"  # a reply whose resume URL answers 200 with an HTML page
SCENARIOS: dict[str, Chunker] = {
    "one byte at a time": lambda: [
        bytes([b]) for b in b"".join(reply_events("done", with_id=False))
    ],
    "CR at every chunk end": lambda: split_after_cr(b"".join(reply_events("done", "\r"))),
    "CRLF split between CR and LF": lambda: split_after_cr(b"".join(reply_events("done", "\r\n"))),
    "three events per chunk": lambda: [
        b"".join(group)
        for events in [reply_events("done")]
        for group in (events[i : i + 3] for i in range(0, len(events), 3))
    ],
    "error": lambda: reply_events("error", with_id=False),
    "moderated": lambda: reply_events("moderated", with_id=False),
    "end of file without done": lambda: reply_events("eof", with_id=False),
    # As the server sends it: a gap has no id of its own (it carries id 3, the last before
    # it), and is no repeat of event 3.
    "gap": lambda: [
        *reply_events("done")[:4],
        event("gap", {"lost_from": 4, "lost_to": 6}, None).encode(),
        *reply_events("done")[7:],
    ],
    "cut as a slow client": lambda: [
        *reply_events("done")[1 : 2 + DROPPED_AFTER],
        event("error", {"error": {"message": "too slow", "code": "slow_client"}}, None).encode(),
    ],
    # reply (id 1) and three tokens (ids 2-4), then the connection ends without `done`.
    "300 events in 6 reads": lambda: [
        b"".join(
            event("token", {"text": f"w{i} ", "tokens": 1}, i + 1).encode()
            for i in range(start, start + 50)
        )
        + (event("done", {"finish_reason": "stop"}, 301).encode() if start == 250 else b"")
        for start in range(0, 300, 50)
    ],
    "dropped, then replayed with overlap": lambda: reply_events("done")[1 : 2 + DROPPED_AFTER],
    # As above, but the resume is answered with a page that is no event stream.
    "dropped, then resumed at an HTML page": lambda: [
        event("reply", {"reply_id": NOT_SSE}, 1).encode(),
        *reply_events("done")[2 : 2 + DROPPED_AFTER],
    ],
}
CALLS = web.AppKey("calls", dict[str, int])
RESUMES = web.AppKey("resumes", list[str])


async def scripted_replies(request: web.Request) -> web.StreamResponse:
    """Write the scenario named by the last user message, chunk by chunk with pauses."""
    body = await request.json()
    scenario = body["messages"][-1]["content"]
    calls = request.app[CALLS]
    calls[scenario] = calls.get(scenario, 0) + 1
    # A retried reply that first ended without `done` gets a whole one.
    chunks = SCENARIOS[scenario]()
    if scenario == "end of file without done" and calls[scenario] > 1:
        chunks = reply_events("done", with_id=False)
    return await write_chunks(request, chunks)


async def scripted_resume(request: web.Request) -> web.StreamResponse:
    """Replay from two events before the client's Last-Event-ID: the client must drop those."""
    last = request.headers.get("Last-Event-ID", "")
    request.app[RESUMES].append(last)
    if request.match_info["reply_id"] == NOT_SSE:  # a proxy's page, say
        return web.Response(text="<html>not here</html>", content_type="text/html")
    events = reply_events("done")[1:]  # reply event has id 1, so events[k] has id k + 1
    return await write_chunks(request, events[max(0, int(last) - 3) :])


async def write_chunks(request: web.Request, chunks: list[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    # Pause after each write so that it reaches the page as a read of its own (the browser
    # coalesces writes that arrive close together, and more of them on a busy machine: four
    # writes 20 ms apart were once read in one). Few writes get long pauses; many, short ones
    # (their tests ask for a share of the writes read apart, not each).
    pause = 0.003 if len(chunks) > 100 else 0.02 if len(chunks) > 10 else 0.1
    for chunk in chunks:
        await response.write(chunk)
        await asyncio.sleep(pause)
    await response.write_eof()
    return response


@pytest.fixture
def app() -> web.Application:
    app = web.Application()
    app[CALLS] = {}
    app[RESUMES] = []
    add_page_routes(app, DeliveryPolicy())
    app.router.add_post("/v1/replies", scripted_replies)
    app.router.add_get("/v1/replies/{reply_id}/stream", scripted_resume)
    return app


@pytest.fixture
async def page(app: web.Application) -> AsyncIterator[Page]:
    browser: Browser
    async with running(app) as url, chromium() as browser:
        page = await browser.new_page()
        page.set_default_timeout(30_000)
        await page.goto(url)
        yield page


async def test_sse_js_matches_the_python_parser_on_every_chunking(page: Page):
    cases = [ways for n, body in enumerate(BODIES) for ways in chunkings(body, seed=n)]
    got = await page.evaluate(JS_PARSE, [[list(chunk) for chunk in ways] for ways in cases])
    assert len(got) == len(cases)
    for ways, js in zip(cases, got, strict=True):
        assert js == python_parse(ways), ways


COUNT_READS = """() => {
    window.bodyReads = 0;
    const read = ReadableStreamDefaultReader.prototype.read;
    ReadableStreamDefaultReader.prototype.read = function () {
        window.bodyReads += 1;
        return read.call(this);
    };
}"""


@pytest.mark.parametrize(
    "scenario",
    [
        "one byte at a time",
        "CR at every chunk end",
        "CRLF split between CR and LF",
        "three events per chunk",
    ],
)
async def test_reply_renders_whole_in_any_chunking(page: Page, scenario: str):
    await page.evaluate(COUNT_READS)
    await page.fill("#prompt", scenario)
    await page.press("#prompt", "Enter")
    await page.wait_for_selector('[data-pane="stream"][data-state="done"]')
    assert await page.text_content('[data-pane="stream"] .reply-text') == TEXT
    assert await page.is_hidden(".turn-actions button")  # nothing to retry
    # The page really got the stream in pieces, not in one read.
    assert await page.evaluate("window.bodyReads") > len(SCENARIOS[scenario]()) // 4


@pytest.mark.parametrize(
    ("scenario", "state", "note"),
    [
        ("error", "error", "engine fell over"),
        ("moderated", "moderated", "Stopped by moderation (phrase): the text from there on"),
        ("end of file without done", "incomplete", "closed before the reply finished"),
    ],
)
async def test_reply_without_done_is_shown_incomplete_with_retry(
    page: Page, scenario: str, state: str, note: str
):
    await page.fill("#prompt", scenario)
    await page.press("#prompt", "Enter")
    await page.wait_for_selector(f'[data-pane="stream"][data-state="{state}"]')
    assert await page.text_content('[data-pane="stream"] .reply-text') == TEXT
    assert note in (await page.text_content(".pane-note") or "")
    retry = page.locator(".turn-actions button", has_text="Retry")
    assert await retry.is_visible()
    if scenario == "end of file without done":
        await retry.click()
        await page.wait_for_selector('[data-pane="stream"][data-state="done"]')
        assert await page.text_content('[data-pane="stream"] .reply-text') == TEXT
        assert await retry.is_hidden()


# A dropped connection, and one cut as a slow reader (an unnumbered notice about the
# connection, not an end of the reply): each resumed.
@pytest.mark.parametrize(
    "scenario", ["dropped, then replayed with overlap", "cut as a slow client"]
)
async def test_resumed_reply_drops_replayed_events_it_already_showed(
    page: Page, app: web.Application, scenario: str
):
    await page.fill("#prompt", scenario)
    await page.press("#prompt", "Enter")
    await page.wait_for_selector('[data-pane="stream"][data-state="done"]')
    assert await page.text_content('[data-pane="stream"] .reply-text') == TEXT
    # One reconnect, naming the last event seen: the reply event and three tokens.
    assert app[RESUMES] == [str(1 + DROPPED_AFTER)]
    assert app[CALLS][scenario] == 1  # the prompt went once


async def test_resume_answered_with_no_event_stream_ends_incomplete(
    page: Page, app: web.Application
):
    # EventSource fails the connection on a 200 that is not text/event-stream: the page
    # must too, not read it as an empty stream and resume again without end.
    await page.fill("#prompt", "dropped, then resumed at an HTML page")
    await page.press("#prompt", "Enter")
    await page.wait_for_selector('[data-pane="stream"][data-state="incomplete"]')
    assert await page.text_content('[data-pane="stream"] .reply-text') == "".join(
        WORDS[:DROPPED_AFTER]
    )
    assert "not an event stream" in (await page.text_content(".pane-note") or "")
    assert app[RESUMES] == [str(1 + DROPPED_AFTER)]


async def test_gap_in_a_replayed_reply_is_marked(page: Page):
    await page.fill("#prompt", "gap")
    await page.press("#prompt", "Enter")
    # It reached `done`, but not all of it reached the page: not complete.
    await page.wait_for_selector('[data-pane="stream"][data-state="incomplete"]')
    gap = page.locator('[data-pane="stream"] .reply-text .gap')
    assert await gap.count() == 1
    shown = await page.text_content('[data-pane="stream"] .reply-text') or ""
    marker = await gap.text_content() or ""
    lost = "".join(WORDS[2:5])  # ids 4-6 never came
    assert shown.replace(marker, "") == TEXT.replace(lost, "")


async def test_text_is_appended_once_per_frame_not_per_event(page: Page):
    await page.evaluate(COUNT_READS)
    await page.evaluate(
        """() => {
            window.textWrites = 0;
            new MutationObserver((records) => { window.textWrites += records.length; })
                .observe(document.querySelector('#conversation'),
                         { subtree: true, characterData: true });
        }"""
    )
    await page.fill("#prompt", "300 events in 6 reads")
    await page.press("#prompt", "Enter")
    await page.wait_for_selector('[data-pane="stream"][data-state="done"]')
    text = await page.text_content('[data-pane="stream"] .reply-text')
    assert text == "".join(f"w{i} " for i in range(300))
    # 300 token events, a handful of reads: text waits for the next frame, so there is at
    # most one write per read (plus the flush at the end), all to the same one text node.
    writes, reads = await page.evaluate("[window.textWrites, window.bodyReads]")
    assert writes <= reads + 1 < 300 // 5
    nodes = await page.evaluate(
        """() => [...document.querySelector('[data-pane="stream"] .reply-text').childNodes]
                .map((node) => node.nodeType)"""
    )
    assert nodes == [3]  # Node.TEXT_NODE
