"""The chat pages in headless Chromium against a real server on loopback.

Timings here are only compared with the server's own, with generous margins: the page's
clocks start before the request leaves and stop after the text is painted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
import pytest
from aiohttp import web

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import MemoryReplayStore
from replystream.engine.simulated import SimulatedEngine, split_words
from replystream.engine.tiny import load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.browser import LoopbackProxy, TimedEngine, chromium
from tests.chat_upstream import ChatUpstream, relaying_to
from tests.conftest import fast_engine, wait_for
from tests.thinking_upstream import ANSWER, THINK_S, THOUGHTS, relay

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page, Route

pytestmark = pytest.mark.slow

# The picture in the docs is refreshed only when asked: a test run leaves the work tree clean.
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "chat-side-by-side.png"
UPDATE_DOCS = os.environ.get("REPLYSTREAM_UPDATE_DOCS") == "1"
# How much later than the server a page timer may stop: request, parse and paint on a noisy
# 2-core machine. It bounds nothing the tests claim; it only catches a timer that is wrong.
SLACK_S = 1.5
TURN = ".turn.assistant:last-child"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as launched:
        yield launched


async def open_page(browser: Browser, url: str, width: int = 1200, height: int = 760) -> Page:
    page = await browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    await page.goto(url)
    page.set_default_timeout(30_000)
    return page


async def set_delivery(page: Page, **values: int | str) -> None:
    await page.click(".settings summary")
    for name, value in values.items():
        await page.fill(f'#settings input[name="{name}"]', str(value))
    await page.click(".settings summary")


async def send(page: Page, prompt: str) -> None:
    await page.fill("#prompt", prompt)
    await page.press("#prompt", "Enter")


def pane(kind: str) -> str:
    return f'{TURN} [data-pane="{kind}"]'


async def wait_state(page: Page, kind: str, state: str) -> None:
    await page.wait_for_selector(f'{pane(kind)}[data-state="{state}"]')


async def shown_text(page: Page, kind: str) -> str:
    return await page.locator(f"{pane(kind)} .reply-text").text_content() or ""


async def timer_s(page: Page, kind: str, which: str) -> float:
    value = await page.get_attribute(f'{pane(kind)} [data-timer="{which}"]', "data-ms")
    assert value is not None, f"{kind} pane has no final {which} timer"
    return float(value) / 1000.0


async def words_shown(page: Page, kind: str, at_least: int) -> None:
    await page.wait_for_function(
        """([selector, n]) => {
            const node = document.querySelector(selector);
            return node !== null && node.textContent.split(' ').length > n;
        }""",
        arg=[f"{pane(kind)} .reply-text", at_least],
    )


def reply_text(engine: TimedEngine, tokens: int) -> str:
    return "".join(split_words(engine.inner.config.reply_text)[:tokens])


def replies_count(metrics: str, outcome: str) -> float:
    sample = f'replystream_replies_total{{endpoint="/v1/replies",outcome="{outcome}"}} '
    for line in metrics.splitlines():
        if line.startswith(sample):
            return float(line.removeprefix(sample))
    return 0.0


async def test_side_by_side_stream_shows_text_while_the_wait_pane_is_blank(
    browser: Browser, tmp_path: Path
):
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url, height=600)
        bodies: list[dict[str, Any]] = []
        page.on(
            "request",
            lambda request: (
                bodies.append(json.loads(request.post_data or "{}"))
                if request.url.endswith("/v1/replies")
                else None
            ),
        )
        await page.get_by_label("Wait vs stream").check()
        await set_delivery(page, seed=7, max_tokens=90, batch_tokens=1)
        await send(page, "Why stream a reply instead of waiting for all of it?")

        # 40 of 90 tokens: the buffered reply cannot have been sent yet (it needs all 90).
        await words_shown(page, "stream", 40)
        assert await shown_text(page, "wait") == ""
        screenshot = DOCS_SCREENSHOT if UPDATE_DOCS else tmp_path / DOCS_SCREENSHOT.name
        await page.screenshot(path=str(screenshot))
        assert screenshot.stat().st_size > 0

        await wait_state(page, "stream", "cut")
        await wait_state(page, "wait", "cut")
        expected = reply_text(engine, 90)
        assert await shown_text(page, "stream") == expected
        assert await shown_text(page, "wait") == expected

        # Both deliveries asked for the same generation: same messages, same seed.
        sent = {body.get("stream", True): body for body in bodies if "messages" in body}
        assert set(sent) == {True, False}
        assert sent[True]["seed"] == sent[False]["seed"] == 7
        assert sent[True]["messages"] == sent[False]["messages"]
        assert sent[True]["batch_tokens"] == 1

        # The page's timers against the engine's: never earlier, not much later.
        assert len(engine.replies) == 2
        server_first = min(r.first_token_s for r in engine.replies)
        server_last = min(r.last_token_s for r in engine.replies)
        stream_first = await timer_s(page, "stream", "first")
        stream_total = await timer_s(page, "stream", "total")
        wait_first = await timer_s(page, "wait", "first")
        wait_total = await timer_s(page, "wait", "total")
        assert server_first <= stream_first + 0.005 < server_first + SLACK_S
        assert server_last <= stream_total + 0.005 < server_last + SLACK_S
        assert server_last <= wait_first + 0.005 < server_last + SLACK_S
        assert wait_first <= wait_total + 0.005
        assert stream_first < wait_first


async def test_stop_cancels_the_reply_on_the_server(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        await send(page, "Tell me everything.")
        await words_shown(page, "stream", 5)
        await page.click("#stop")
        await wait_state(page, "stream", "stopped")
        await wait_for(lambda: engine.stats().cancelled == 1, timeout_s=10)
        stats = engine.stats()
        assert stats.active == 0 and stats.finished == 0
        # The engine stopped early: it did not go on making the rest of the reply.
        assert stats.steps < len(split_words(engine.inner.config.reply_text))
        assert await page.is_visible(f"{TURN} .turn-actions button:has-text('Retry')")
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
            metrics = await response.text()
        assert replies_count(metrics, "cancelled") == 1


async def test_dropped_connection_is_resumed_without_repeating_the_prompt(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    async with running(create_app(engine)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with LoopbackProxy(host, int(port)) as proxy:
            page = await open_page(browser, proxy.url)
            await page.evaluate(
                """() => {
                    window.statusSeen = [];
                    const line = document.querySelector('#status');
                    new MutationObserver(() => statusSeen.push(line.textContent))
                        .observe(line, {childList: true, characterData: true, subtree: true});
                }"""
            )
            await set_delivery(page, max_tokens=60)
            await send(page, "Keep going.")
            await words_shown(page, "stream", 10)
            proxy.cut()
            await wait_state(page, "stream", "cut")
            await assert_resumed_whole(page, engine, proxy)
            assert "reconnecting…" in await page.evaluate("statusSeen")
            assert await page.text_content("#status") == ""


async def test_a_connection_gone_silent_is_resumed_after_three_keepalive_periods(
    browser: Browser,
):
    # The path loses the connection without closing it (a phone in a tunnel): no byte comes,
    # and a browser's read never ends by itself. The server's keep-alives keep a live
    # stream busy, so three of them missed is a dropped connection, resumed as a reset one.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    config = ServerConfig(policy=DeliveryPolicy(keepalive_s=0.5))
    async with running(create_app(engine, config)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with LoopbackProxy(host, int(port)) as proxy:
            page = await open_page(browser, proxy.url)
            await set_delivery(page, max_tokens=60)
            await send(page, "Keep going.")
            await words_shown(page, "stream", 10)
            proxy.stall()
            await wait_state(page, "stream", "cut")
            await assert_resumed_whole(page, engine, proxy)


async def assert_resumed_whole(page: Page, engine: TimedEngine, proxy: LoopbackProxy) -> None:
    """The 60-token reply is shown whole, from one generation, resumed by a stream request
    that named the last event the page had."""
    assert await shown_text(page, "stream") == reply_text(engine, 60)
    assert engine.stats().started == 1  # resumed, never asked again
    sent = proxy.sent.decode("latin-1").lower()
    assert re.search(r"get /v1/replies/[^/ ]+/stream http/1.1\r\n", sent)
    assert re.search(r"\r\nlast-event-id: \d+\r\n", sent)


# Records each refusal of the page's content security policy, from the page's first script on.
RECORD_VIOLATIONS = """
window.violations = [];
document.addEventListener('securitypolicyviolation',
    (e) => window.violations.push(`${e.effectiveDirective} ${e.blockedURI}`));
"""
# Markup a page might one day insert by mistake: an image whose inline handler would run.
INJECTED = """document.body.insertAdjacentHTML('beforeend',
    '<img src="/static/none.png" onerror="window.ran = true">')"""


async def test_both_pages_work_under_their_policy_and_it_refuses_injected_script(
    browser: Browser,
):
    async with running(create_app(fast_engine(delay_ms=2.0, jitter_ms=0.0))) as url:
        for path, done in (
            ("/", f'{pane("stream")}[data-state="done"]'),
            ("/eventsource.html", '#pane[data-state="done"]'),
        ):
            page = await browser.new_page()
            await page.add_init_script(RECORD_VIOLATIONS)
            await page.goto(f"{url}{path}")
            page.set_default_timeout(30_000)
            if path == "/":
                await send(page, "Hello")
            else:
                await page.click("#go")
            await page.wait_for_selector(done)
            assert await page.evaluate("window.violations") == [], path
            await page.evaluate(INJECTED)
            # A function, not an expression: Playwright evals an expression in the page, which
            # the policy refuses.
            await page.wait_for_function("() => window.violations.length > 0 || window.ran")
            assert await page.evaluate("window.violations") == ["script-src-attr inline"], path
            assert await page.evaluate("window.ran === undefined"), path
            await page.close()


async def test_eventsource_page_reconnects_with_last_event_id(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    async with running(create_app(engine)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with LoopbackProxy(host, int(port)) as proxy:
            page = await open_page(browser, f"{proxy.url}/eventsource.html")
            await page.click("#go")
            await page.wait_for_function(
                "() => document.querySelector('#text').textContent.split(' ').length > 10"
            )
            proxy.cut()
            await page.wait_for_selector('#pane[data-state="done"]')
            full = reply_text(engine, len(split_words(engine.inner.config.reply_text)))
            assert await page.text_content("#text") == full
            assert int(await page.text_content("#opens") or 0) >= 2
            assert engine.stats().started == 1
            sent = proxy.sent.decode("latin-1").lower()
            assert re.search(r"\r\nlast-event-id: \d+\r\n", sent)
            log = await page.locator("#log li").all_text_contents()
            assert "source closed" in log[-1]
            # Closed on `done`: EventSource would otherwise reconnect after its retry delay
            # (3 s in Chromium unless the server sets one).
            streams = sent.count("/stream http/1.1")
            await asyncio.sleep(4)
            assert proxy.sent.decode("latin-1").lower().count("/stream http/1.1") == streams


async def test_eventsource_page_tells_a_cut_reply_and_a_refusal_as_they_are(browser: Browser):
    # A reply at its token limit was badged complete, and every refusal but a 401 was said
    # to be a server without resumable replies.
    engine = load_default_engine(TinyEngineConfig(default_max_tokens=6))
    config = ServerConfig(api_keys=("sk-page-test",))
    async with running(create_app(engine, config)) as url:
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.fill("#api-key", "sk-page-test")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="cut"]')
        assert await page.text_content("#badge") == "cut"
        await page.fill("#api-key", "sk-wrong")
        await page.click("#go")
        await page.wait_for_function(
            "() => document.querySelector('#log').textContent.includes('HTTP 401')"
        )
        log = await page.locator("#log li").all_text_contents()
        assert "Incorrect API key provided. (HTTP 401)" in log[-1], log


async def test_a_rate_limit_says_when_to_try_again_and_a_gone_server_that_it_is_gone(
    browser: Browser,
):
    # A 429's Retry-After was not shown; a server that could not be reached was "The
    # connection failed: Failed to fetch", as if a reply had been cut.
    engine = TimedEngine(fast_engine(delay_ms=1.0, jitter_ms=0.0))
    config = ServerConfig(guard=GuardConfig(per_minute=2))  # one turn: its stream and its wait
    async with running(create_app(engine, config)) as url:
        page = await open_page(browser, url)
        await page.get_by_label("Wait vs stream").check()
        await send(page, "First.")
        await wait_state(page, "stream", "done")
        await wait_state(page, "wait", "done")
        await send(page, "Second.")
        for kind in ("stream", "wait"):
            await wait_state(page, kind, "error")
            note = await page.text_content(f"{pane(kind)} .pane-note") or ""
            assert re.search(r"; retry later \(try again in [0-9]+ s\)$", note), note
        events = await open_page(browser, f"{url}/eventsource.html")
    # The server is gone; the pages it served are still open.
    await send(page, "Third.")
    for kind in ("stream", "wait"):
        await wait_state(page, kind, "error")
        note = await page.text_content(f"{pane(kind)} .pane-note") or ""
        assert note.startswith("The server could not be reached ("), note
    await events.click("#go")
    await events.wait_for_selector('#pane[data-state="error"]')
    log = await events.locator("#log li").all_text_contents()
    assert "The server could not be reached (" in log[-1], log


async def test_a_setting_out_of_the_fields_steps_or_range_is_sent_not_dropped(browser: Browser):
    # Temperature 0.25 failed the field's step check and 5 its range: either was left out of
    # the request, and the server's default served without a word.
    engine = TimedEngine(fast_engine(delay_ms=2.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await set_delivery(page, temperature="0.25", max_tokens=4)
        await send(page, "Hello")
        await wait_state(page, "stream", "cut")
        await set_delivery(page, temperature="5")
        await send(page, "Again")
        await wait_state(page, "stream", "error")
        note = await page.text_content(f"{TURN} .pane-note") or ""
        assert "temperature" in note, note
    assert [body.get("temperature") for body in bodies] == [0.25, 5]


async def test_phone_width_stacks_the_panes_and_keyboard_sends(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=5.0, jitter_ms=1.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url, width=390, height=780)
        await page.get_by_label("Wait vs stream").check()
        await set_delivery(page, max_tokens=8)
        await page.focus("#prompt")
        await page.keyboard.type("first line")
        await page.keyboard.press("Shift+Enter")
        await page.keyboard.type("second line")
        assert await page.input_value("#prompt") == "first line\nsecond line"
        await page.keyboard.press("Enter")
        # 8 tokens of a longer reply: cut at max_tokens, shown as cut in both panes.
        await wait_state(page, "stream", "cut")
        await wait_state(page, "wait", "cut")
        assert await page.text_content(".turn.user .bubble") == "first line\nsecond line"
        wait_box = await page.locator(pane("wait")).bounding_box()
        stream_box = await page.locator(pane("stream")).bounding_box()
        assert wait_box is not None and stream_box is not None
        assert stream_box["y"] >= wait_box["y"] + wait_box["height"]  # stacked, not side by side
        overflow = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        assert await page.get_attribute("#conversation", "aria-live") is None
        assert await page.get_attribute("#announcer", "aria-live") == "polite"
        # Send and Stop are real buttons reachable with the keyboard.
        await page.focus("#prompt")
        focused = []
        for _ in range(2):
            await page.keyboard.press("Tab")
            focused.append(await page.evaluate("document.activeElement.id"))
        assert "send" in focused


async def test_api_key_from_the_settings_reaches_every_route_the_pages_use(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=20.0, jitter_ms=2.0))
    config = ServerConfig(api_keys=("sk-page-test",))
    async with running(create_app(engine, config)) as url:
        page = await open_page(browser, url)
        await page.get_by_label("Wait vs stream").check()
        await send(page, "No key yet.")
        # The server's words ask for an Authorization header, which the reader of a page
        # cannot send: the page says where its key goes.
        for kind in ("stream", "wait"):
            await wait_state(page, kind, "error")
            note = await page.text_content(f"{pane(kind)} .pane-note") or ""
            assert "API key" in note and "Delivery" in note, note
        await page.get_by_label("Chat").check()

        await set_delivery(page, api_key="sk-page-test")
        await send(page, "Now with the key.")
        await words_shown(page, "stream", 5)
        await page.click("#stop")  # the cancel must carry the key that started the reply
        await wait_state(page, "stream", "stopped")
        await wait_for(lambda: engine.stats().cancelled == 1, timeout_s=10)

        await page.goto(f"{url}/eventsource.html")
        await page.fill("#api-key", "sk-page-test")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="done"]')
        assert engine.stats().finished == 1


def posted_bodies(page: Page) -> list[dict[str, Any]]:
    """The JSON body of every reply request the page sends, in order."""
    bodies: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda request: (
            bodies.append(json.loads(request.post_data or "{}"))
            if request.url.endswith("/v1/replies")
            else None
        ),
    )
    return bodies


async def test_a_reply_cut_at_max_tokens_is_shown_as_cut_not_complete(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=5.0, jitter_ms=1.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        await set_delivery(page, max_tokens=6)
        await send(page, "Say a lot.")
        await wait_state(page, "stream", "cut")
        assert await page.text_content(f"{pane('stream')} .badge") == "cut"
        note = await page.text_content(f"{pane('stream')} .pane-note") or ""
        assert "token limit" in note
        assert await shown_text(page, "stream") == reply_text(engine, 6)

        await set_delivery(page, max_tokens=500)  # more than the reply has: it ends on its own
        await send(page, "Now all of it.")
        await wait_state(page, "stream", "done")
        assert await page.is_hidden(f"{pane('stream')} .pane-note")


async def test_a_conversation_past_the_servers_prompt_limit_drops_its_oldest_turns_too(
    browser: Browser,
):
    # --max-prompt-chars refuses with prompt_too_long, which the page did not read as the
    # conversation outgrowing what is sent: every later message failed until a new chat.
    engine = TimedEngine(fast_engine(delay_ms=1.0, jitter_ms=0.0))
    async with running(create_app(engine, ServerConfig(max_prompt_chars=300))) as url:
        page = await open_page(browser, url)
        await set_delivery(page, max_tokens=12)
        for sent in range(1, 6):
            await send(page, f"{sent}: tell me about the river and the road home")
            await page.wait_for_selector(
                f'{pane("stream")}:is([data-state="done"], [data-state="cut"])'
            )
        notice = await page.text_content(".context-notice") or ""
        assert "no longer fit" in notice, notice
        assert await page.locator(".turn.user.out-of-context").count() > 0


async def test_a_conversation_longer_than_the_context_drops_its_oldest_turns_and_says_so(
    browser: Browser,
):
    # The built-in tiny model holds 256 tokens: a few long messages outgrow it.
    async with running(create_app(load_default_engine())) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await set_delivery(page, max_tokens=16, seed=3)
        long_message = "Tell me about the river and the mountains and the long road home. " * 3
        for sent in range(1, 11):  # the tenth message of one conversation still works
            await send(page, f"{sent}: {long_message}")
            await page.wait_for_selector(
                f'{pane("stream")}:is([data-state="done"], [data-state="cut"])'
            )
            assert await page.locator(f"{TURN} .reply-text").text_content()
        notice = await page.text_content(".context-notice") or ""
        assert "no longer fit the model's context" in notice
        dropped = await page.locator(".turn.user.out-of-context").count()
        assert 1 <= dropped < 10
        # What was sent last starts after the dropped turns and ends with the newest message.
        last = [body for body in bodies if "messages" in body][-1]["messages"]
        assert last[0] == {"role": "user", "content": f"{dropped + 1}: {long_message.strip()}"}
        assert last[-1] == {"role": "user", "content": f"10: {long_message.strip()}"}
        # Every turn still sent got its reply; a refused try is never left on screen.
        assert await page.locator('.pane[data-state="error"]').count() == 0


async def test_new_chat_stops_the_reply_and_starts_an_empty_conversation(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=5.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await set_delivery(page, max_tokens=4)
        await send(page, "First question.")
        await wait_state(page, "stream", "cut")
        await set_delivery(page, max_tokens=500)
        await send(page, "Second question, a long reply.")
        await words_shown(page, "stream", 5)

        await page.click("#new-chat")
        await wait_for(lambda: engine.stats().cancelled == 1, timeout_s=10)
        assert await page.locator(".turn").count() == 0
        assert await page.is_visible("#intro")
        assert await page.is_enabled("#send")

        await send(page, "A fresh start.")
        await wait_state(page, "stream", "done")
        messages = [body for body in bodies if "messages" in body][-1]["messages"]
        assert messages == [{"role": "user", "content": "A fresh start."}]


async def test_a_reasoning_models_thinking_is_shown_above_its_answer_never_sent_back(
    browser: Browser,
):
    async with relay("deepseek") as (url, upstream):
        page = await open_page(browser, url)
        await send(page, "What is 2 + 2?")
        # Shown, open, while it comes: the pane says it is thinking, and no answer is there.
        await page.wait_for_selector(f"{pane('stream')}[data-state='thinking'] .thinking[open]")
        assert await shown_text(page, "stream") == ""
        await wait_state(page, "stream", "done")
        thinking = f"{pane('stream')} .thinking"
        assert await page.text_content(f"{thinking} .thinking-text") == "".join(THOUGHTS)
        assert await page.get_attribute(thinking, "open") is None  # folded once the answer came
        assert await shown_text(page, "stream") == "".join(ANSWER)
        # The first-text timer is the answer's: it came after all the thinking.
        assert await timer_s(page, "stream", "first") >= len(THOUGHTS) * THINK_S

        await page.get_by_label("Wait vs stream").check()
        await send(page, "And 3 + 3?")
        await wait_state(page, "wait", "done")
        await wait_state(page, "stream", "done")
        for kind in ("wait", "stream"):
            shown = await page.text_content(f"{pane(kind)} .thinking-text")
            assert shown == "".join(THOUGHTS), kind
    # What the page sent back as history is the answer alone, never the thinking.
    earlier = [m for m in upstream.bodies[-1]["messages"] if m["role"] == "assistant"]
    assert earlier == [{"role": "assistant", "content": "".join(ANSWER)}]


async def test_an_unanswered_message_is_left_out_and_a_message_too_long_alone_drops_nothing(
    browser: Browser,
):
    # A message the server refused was sent again with every later turn (refused again, or
    # an unanswered user message); one too long on its own had the page drop every earlier
    # turn first, and keep them dropped.
    config = ServerConfig(max_prompt_chars=300)
    async with running(create_app(fast_engine(delay_ms=1.0, jitter_ms=0.0), config)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await set_delivery(page, max_tokens=3)
        await send(page, "alpha")
        await wait_state(page, "stream", "cut")
        first_reply = await shown_text(page, "stream")
        await send(page, "x" * 400)
        await wait_state(page, "stream", "error")
        note = await page.text_content(f"{TURN} .pane-note") or ""
        assert "300" in note, note  # the server's words for the limit
        assert await page.locator(".out-of-context").count() == 0
        assert await page.locator(".context-notice").count() == 0
        await send(page, "    indented():\n        beta")
        await wait_state(page, "stream", "cut")
    assert bodies[-1]["messages"] == [
        {"role": "user", "content": "alpha"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "    indented():\n        beta"},  # its indentation kept
    ]


async def test_focus_stays_where_the_reader_put_it_and_an_unreadable_number_is_not_sent(
    browser: Browser,
):
    engine = TimedEngine(fast_engine(delay_ms=30.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await set_delivery(page, max_tokens=8)
        await send(page, "Hello")
        await words_shown(page, "stream", 2)
        await page.click(".settings summary")
        await page.focus('#settings input[name="seed"]')
        await page.keyboard.type("7")
        await wait_state(page, "stream", "cut")
        await page.keyboard.type("1")  # the reply ended: the field still has the focus
        assert await page.input_value('#settings input[name="seed"]') == "71"
        assert await page.input_value("#prompt") == ""
        # A number the browser cannot read reads as empty: said, and nothing is sent.
        await page.fill('#settings input[name="max_tokens"]', "")
        await page.focus('#settings input[name="max_tokens"]')
        await page.keyboard.type("1e400")
        await send(page, "Again")
        await page.wait_for_function(
            "() => document.querySelector('#status').textContent.includes('not a number')"
        )
        assert len(bodies) == 1
        assert await page.input_value("#prompt") == "Again"  # kept, to send once fixed
        # A reply or message in a right-to-left script is laid out as one.
        assert await page.get_attribute(f"{pane('stream')} .reply-text", "dir") == "auto"
        assert await page.get_attribute(".turn.user .bubble", "dir") == "auto"


async def test_the_eventsource_page_gives_up_once_the_server_cannot_be_reached(browser: Browser):
    # EventSource retries for ever while nothing answers (every 3 s in Chromium): the page
    # said "reconnecting" and kept Start disabled for good.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        proxy = LoopbackProxy(host, int(port))
        await proxy.__aenter__()
        page = await open_page(browser, f"{proxy.url}/eventsource.html")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="streaming"]')
        await proxy.__aexit__()  # no longer listening: each reconnect is refused
        await page.wait_for_selector('#pane[data-state="incomplete"]', timeout=60_000)
        assert await page.is_enabled("#go")
        log = await page.locator("#log li").all_text_contents()
        assert "could not be reached in 8 attempts to reconnect" in log[-1], log


async def test_an_api_key_a_header_cannot_carry_is_said_so_not_taken_for_a_server_out_of_reach(
    browser: Browser,
):
    # A key pasted with an invisible character past U+00FF (a zero-width space) makes fetch
    # refuse the Authorization header before anything is sent: the pages said the server
    # "could not be reached", though it was up and was never asked.
    engine = TimedEngine(fast_engine(delay_ms=5.0, jitter_ms=0.0))
    config = ServerConfig(api_keys=("sk-page-test",))
    async with running(create_app(engine, config)) as url:
        page = await open_page(browser, url)
        await page.get_by_label("Wait vs stream").check()
        await set_delivery(page, api_key="sk-page-test\u200b", max_tokens=4)
        await send(page, "Hello")
        for kind in ("stream", "wait"):
            await wait_state(page, kind, "error")
            note = await page.text_content(f"{pane(kind)} .pane-note") or ""
            assert "U+200B" in note and "could not be reached" not in note, note
        assert engine.replies == []

        await set_delivery(page, api_key="sk-page-test")
        await page.click(f"{TURN} .turn-actions button:has-text('Retry')")
        await wait_state(page, "stream", "cut")
        await wait_state(page, "wait", "cut")

        await page.goto(f"{url}/eventsource.html")
        await page.fill("#api-key", "sk-page-test\u200b")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="error"]')
        log = await page.locator("#log li").all_text_contents()
        assert "U+200B" in log[-1] and "could not be reached" not in log[-1], log


async def test_leaving_the_eventsource_page_cancels_its_reply_on_the_server(browser: Browser):
    # A resumable reply keeps generating for --detach-grace-s (30 s) once its reader is gone:
    # the chat page cancels its reply when closed, the EventSource page left it running.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    config = ServerConfig(api_keys=("sk-page-test",))
    async with running(create_app(engine, config)) as url:
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.fill("#api-key", "sk-page-test")  # the cancel must carry it
        await page.click("#go")
        await page.wait_for_function(
            "() => document.querySelector('#text').textContent.split(' ').length > 5"
        )
        await page.goto("about:blank")
        await wait_for(lambda: engine.stats().cancelled == 1, timeout_s=10)
        assert engine.stats().finished == 0

        # A reply that already ended is not cancelled again when the page is left.
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.fill("#api-key", "sk-page-test")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="done"]')
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        await page.goto("about:blank")
        assert not [sent for sent in requests if sent.endswith("/cancel")], requests


# Every text on the page with its contrast against what is painted behind it (WCAG 2.2
# 1.4.3): its colour over the backgrounds of its ancestors, each element's opacity applied,
# and the placeholders of the fields. Disabled controls are exempt.
CONTRAST_JS = """() => {
  const canvas = document.createElement('canvas');
  canvas.width = canvas.height = 1;
  const context = canvas.getContext('2d', { willReadFrequently: true });
  const rgba = (color) => {
    context.clearRect(0, 0, 1, 1);
    context.fillStyle = color;
    context.fillRect(0, 0, 1, 1);
    const [r, g, b, a] = context.getImageData(0, 0, 1, 1).data;
    return [r, g, b, a / 255];
  };
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3]))
    .concat(1);
  const channel = (v) => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  const luminance = ([r, g, b]) =>
    0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b);
  const ratio = (a, b) => {
    const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
    return (hi + 0.05) / (lo + 0.05);
  };
  const chain = (node) => {
    const nodes = [];
    for (let at = node; at; at = at.parentElement) nodes.unshift(at);
    return nodes;
  };
  // Painted back to front: each ancestor's background over what is under it, its opacity
  // fading it (and the text on it) toward what is under the faded element.
  const painted = (node, foreground) => {
    let under = [255, 255, 255, 1];
    let back = under;
    for (const at of chain(node)) {
      const style = getComputedStyle(at);
      const opacity = parseFloat(style.opacity);
      if (opacity < 1) under = back;
      back = over(rgba(style.backgroundColor), back);
      if (opacity < 1) back = over([...back.slice(0, 3), opacity], under);
    }
    let text = over(rgba(foreground), back);
    let fade = 1;
    for (const at of chain(node)) fade *= parseFloat(getComputedStyle(at).opacity);
    if (fade < 1) text = over([...text.slice(0, 3), fade], back);
    return [text, back];
  };
  const found = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const seen = new Set();
  for (let text = walker.nextNode(); text; text = walker.nextNode()) {
    const node = text.parentElement;
    if (!text.data.trim() || seen.has(node)) continue;
    seen.add(node);
    if (!node.checkVisibility() || node.closest(':disabled')) continue;
    const style = getComputedStyle(node);
    const size = parseFloat(style.fontSize);
    const large = size >= 24 || (parseInt(style.fontWeight, 10) >= 700 && size >= 18.66);
    const [fore, back] = painted(node, style.color);
    const need = large ? 3 : 4.5;
    found.push({ text: text.data.trim().slice(0, 40), ratio: ratio(fore, back), need });
  }
  for (const field of document.querySelectorAll('[placeholder]')) {
    if (!field.checkVisibility() || field.value) continue;
    const [fore, back] = painted(field, getComputedStyle(field, '::placeholder').color);
    found.push({ text: `placeholder ${field.placeholder}`, ratio: ratio(fore, back), need: 4.5 });
  }
  return found.filter((item) => item.ratio < item.need)
    .map((item) => `${item.text}: ${item.ratio.toFixed(2)} < ${item.need}`);
}"""


async def low_contrast(page: Page) -> list[str]:
    found: list[str] = await page.evaluate(CONTRAST_JS)
    return found


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_text_and_controls_have_enough_contrast_in_both_schemes(
    browser: Browser, scheme: Literal["light", "dark"]
):
    # The dark scheme's Send button was white on a light blue (3.1:1), the light scheme's
    # badges (streaming, complete, cut) 3.9 to 4.3:1, and the fields' placeholders, which
    # show the server's defaults, the browser's own grey (4.0 to 4.3:1; 3.6 in the dark).
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await browser.new_page(viewport={"width": 1200, "height": 900}, color_scheme=scheme)
        page.set_default_timeout(30_000)
        await page.goto(url)
        problems = await low_contrast(page)
        await send(page, "Hello")
        await words_shown(page, "stream", 2)
        problems += await low_contrast(page)  # streaming
        await wait_state(page, "stream", "done")
        problems += await low_contrast(page)
        await set_delivery(page, max_tokens=3)
        await page.click('input[value="compare"]', force=True)
        await send(page, "Again")
        await wait_state(page, "stream", "cut")
        await wait_state(page, "wait", "cut")
        await page.click(".settings summary")
        problems += await low_contrast(page)  # cut, with the settings open
        await page.fill('#settings input[name="temperature"]', "9")
        await page.click(".settings summary")
        await send(page, "Refused")
        await wait_state(page, "stream", "error")
        problems += await low_contrast(page)
        assert not problems, sorted(set(problems))


@pytest.mark.parametrize(("width", "height"), [(320, 256), (844, 390)])
async def test_every_setting_can_be_reached_on_a_short_screen(
    browser: Browser, width: int, height: int
):
    # 320 by 256 is a 1280 by 1024 screen zoomed to 400% (WCAG 2.2 1.4.10), 844 by 390 a
    # phone held sideways. The settings panel moves with the sticky bar, so the page cannot
    # scroll it: its last fields (the API key) and its link were below the screen for good.
    engine = TimedEngine(fast_engine())
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url, width=width, height=height)
        await page.click(".settings summary")
        for control in ['#settings input[name="api_key"]', "#settings a"]:
            await page.focus(control)
            shown = await page.evaluate(
                """(selector) => {
                    const node = document.querySelector(selector);
                    const box = node.getBoundingClientRect();
                    const at = document.elementFromPoint(box.left + box.width / 2,
                                                         box.top + box.height / 2);
                    return box.bottom <= innerHeight && node.contains(at);
                }""",
                control,
            )
            assert shown, f"{control} is out of reach at {width}x{height}"
        sideways = await page.evaluate("document.documentElement.scrollWidth - innerWidth")
        assert sideways <= 0


async def test_the_send_and_retry_buttons_pressed_leave_the_focus_in_the_message_box(
    browser: Browser,
):
    # Pressed from the keyboard, Send is disabled and Retry hidden under the focus: it fell
    # to the page itself for the whole reply, where a screen reader says nothing useful and
    # the next Tab starts wherever the browser chooses.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        focused = "() => document.activeElement.id || document.activeElement.tagName"
        await page.fill("#prompt", "Hello")
        await page.keyboard.press("Tab")
        assert await page.evaluate(focused) == "send"
        await page.keyboard.press("Enter")
        await words_shown(page, "stream", 2)
        assert await page.evaluate(focused) == "prompt"
        await page.keyboard.press("Tab")  # Stop is next, and stops
        assert await page.evaluate(focused) == "stop"
        await page.keyboard.press("Enter")
        await wait_state(page, "stream", "stopped")
        await page.wait_for_function("() => document.activeElement.id === 'prompt'")
        await page.keyboard.press("Shift+Tab")  # back to Retry, the control before the box
        assert await page.evaluate("() => document.activeElement.textContent") == "Retry"
        await page.keyboard.press("Enter")
        await words_shown(page, "stream", 2)
        assert await page.evaluate(focused) == "prompt"


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_turns_the_model_no_longer_sees_stay_readable(
    browser: Browser, scheme: Literal["light", "dark"]
):
    # They were faded with opacity: the light scheme's messages fell to 2.2:1, the timers
    # and notes under the replies to 2.1 to 3.8:1.
    engine = TimedEngine(fast_engine(delay_ms=1.0, jitter_ms=0.0))
    async with running(create_app(engine, ServerConfig(max_prompt_chars=300))) as url:
        page = await browser.new_page(viewport={"width": 1200, "height": 900}, color_scheme=scheme)
        page.set_default_timeout(30_000)
        await page.goto(url)
        await set_delivery(page, max_tokens=4)
        for sent in range(1, 5):
            await send(page, f"{sent}: tell me about the river and the road home, and more")
            await wait_state(page, "stream", "cut")
        assert await page.locator(".turn.out-of-context").count() > 0
        problems = await low_contrast(page)
        assert not problems, sorted(set(problems))


async def test_the_eventsource_page_fits_a_320_pixel_screen(browser: Browser):
    # Its prompt, key and Start sat on one line: at 320 px (a page zoomed to 400%, WCAG 2.2
    # 1.4.10) Start ran past the screen's edge, with a sideways scroll, and the key field was
    # squeezed to almost nothing.
    engine = TimedEngine(fast_engine())
    async with running(create_app(engine)) as url:
        page = await open_page(browser, f"{url}/eventsource.html", width=320, height=640)
        assert await page.evaluate("document.documentElement.scrollWidth - innerWidth") <= 0
        for control in ["#prompt", "#api-key", "#go"]:
            box = await page.locator(control).bounding_box()
            assert box is not None
            assert box["x"] >= 0 and box["x"] + box["width"] <= 320, (control, box)
            assert box["width"] >= 60, (control, box)


async def test_the_streaming_caret_blinks_only_without_a_request_for_less_motion(
    browser: Browser,
):
    # The reduced-motion rule was out-ranked by the streaming state's own selector: the caret
    # blinked for a reader who had asked the system for less motion.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        cases: list[tuple[Literal["reduce", "no-preference"], str]] = [
            ("reduce", "none"),
            ("no-preference", "blink"),
        ]
        for motion, animation in cases:
            page = await browser.new_page(reduced_motion=motion)
            page.set_default_timeout(30_000)
            await page.goto(url)
            await send(page, "Hello")
            await words_shown(page, "stream", 2)
            shown = await page.evaluate(
                """(selector) => getComputedStyle(document.querySelector(selector), '::after')
                    .animationName""",
                f'{pane("stream")}[data-state="streaming"] .reply-text',
            )
            assert shown == animation, motion
            await page.close()


# Every change inside a live region of the page (role=status is one), counted.
COUNT_LIVE_CHANGES = """() => {
    window.liveChanges = 0;
    const observer = new MutationObserver((changes) => {
        for (const change of changes) {
            const node = change.target.nodeType === 1 ? change.target : change.target.parentElement;
            if (node && node.closest('[aria-live], [role="status"], [role="alert"]')) {
                window.liveChanges += 1;
            }
        }
    });
    observer.observe(document.body, { subtree: true, childList: true, characterData: true });
}"""


async def test_a_screen_reader_is_told_a_reply_once_whole_as_it_ends(browser: Browser):
    # The whole conversation was the live region: each frame's text and each tick of the
    # timers was a change a screen reader would be told of (some 600 a reply), aria-busy on
    # the turn holding them back in some readers and not others.
    engine = TimedEngine(fast_engine(delay_ms=20.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        await page.evaluate(COUNT_LIVE_CHANGES)
        await send(page, "Hello")
        await words_shown(page, "stream", 3)
        assert await page.text_content("#announcer") == ""
        await wait_state(page, "stream", "done")
        told = await page.text_content("#announcer")
        assert told == f"Reply complete. {await shown_text(page, 'stream')}"
        assert await page.evaluate("() => window.liveChanges") <= 2  # cleared, then told
        live = await page.eval_on_selector_all("[aria-live]", "nodes => nodes.map(n => n.id)")
        assert live == ["announcer"]


async def test_an_empty_message_is_told_on_the_status_line(browser: Browser):
    # The box was `required`: the browser's own bubble answered, the status line said
    # nothing, and screen readers called the empty box invalid from the start.
    async with running(create_app(fast_engine())) as url:
        page = await open_page(browser, url)
        await page.press("#prompt", "Enter")
        assert await page.text_content("#status") == "Nothing to send: the message is empty."
        assert await page.get_attribute("#prompt", "required") is None


async def test_the_eventsource_page_tells_its_reply_once_whole_as_it_ends(browser: Browser):
    engine = TimedEngine(fast_engine(delay_ms=20.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.evaluate(COUNT_LIVE_CHANGES)
        await page.fill("#prompt", "Hello")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="done"]')
        text = await page.text_content("#text")
        assert text
        assert await page.text_content("#announcer") == f"Reply complete. {text}"
        live = await page.eval_on_selector_all("[aria-live]", "nodes => nodes.map(n => n.id)")
        assert live == ["announcer"]
        assert await page.evaluate("() => window.liveChanges") <= 2


async def in_flight(url: str) -> dict[str, float]:
    """The server's gauges of what is still open: replies, streams, readers."""
    names = (
        "replystream_replies_in_flight",
        "replystream_active_streams",
        "replystream_open_readers",
    )
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as response:
        lines = (await response.text()).splitlines()
    return {
        name: float(line.split()[-1])
        for line in lines
        for name in names
        if line.startswith(f"{name} ")
    }


def resume_after(
    engine: SimulatedEngine, steps: int, first: int
) -> Callable[[Route], Awaitable[None]]:
    """A route handler that lets the first ``first`` requests through, and later ones once
    the engine has made more than ``steps`` tokens."""
    seen = 0

    async def handle(route: Route) -> None:
        nonlocal seen
        seen += 1
        if seen > first:
            await wait_for(lambda: engine.stats().steps > steps, timeout_s=20)
        await route.continue_()

    return handle


async def test_a_reply_that_lost_text_on_the_way_says_so_and_is_not_called_complete(
    browser: Browser,
):
    # A resume that came back after the server's log had dropped the events it needed: the
    # gap was marked in the text, but the reply was badged complete, no Retry was offered,
    # and a screen reader was told "Reply complete." and the text with the hole closed up.
    words = [f"w{i} " for i in range(150)]
    engine = fast_engine(delay_ms=8.0, jitter_ms=0.0, reply_text="".join(words))
    store = MemoryReplayStore(max_entries=20)  # a log that keeps the last 20-odd events
    async with running(create_app(engine, store=store)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with LoopbackProxy(host, int(port)) as proxy:
            # The chat page reads its first connection from the POST, the EventSource page
            # from the resume URL: only the one after the cut waits.
            for page_path, reply, first in [
                ("/", pane("stream"), 0),
                ("/eventsource.html", "#pane", 1),
            ]:
                page = await open_page(browser, proxy.url + page_path)
                # The resume waits for the whole reply to be made: it finds the last 20-odd
                # events of an ended log, one gap before them, and no more (a resume into
                # a reply still being made could fall behind the short log again, on a
                # loaded machine, and be told a second gap).
                steps = engine.stats().steps + len(words) - 1
                await page.route("**/stream*", resume_after(engine, steps, first))
                if page_path == "/":
                    await send(page, "Count.")
                else:
                    await page.click("#go")
                text = f"{reply} .reply-text"
                await page.wait_for_function(
                    "(sel) => document.querySelector(sel).textContent.length > 20", arg=text
                )
                proxy.cut()
                await page.wait_for_selector(
                    f'{reply}:is([data-state="done"], [data-state="incomplete"])'
                )
                assert await page.get_attribute(reply, "data-state") == "incomplete"
                marker = page.locator(f"{text} .gap")
                assert await marker.count() == 1
                shown = await page.text_content(text) or ""
                before, after = shown.split(await marker.text_content() or "")
                full = "".join(words)
                assert full.startswith(before) and full.endswith(after)
                assert len(before) + len(after) < len(full) - 40  # whole events lost between
                told = await page.text_content("#announcer") or ""
                assert told.startswith(f"Reply incomplete. {shown}"), told
                assert "lost" in told.removeprefix(f"Reply incomplete. {shown}")
                if page_path == "/":
                    assert "lost while reconnecting" in (
                        await page.text_content(f"{pane('stream')} .pane-note") or ""
                    )
                    assert await page.is_visible(f"{TURN} .turn-actions button:has-text('Retry')")
                    assert await page.is_enabled("#send") and await page.is_disabled("#stop")
                else:
                    assert await page.is_enabled("#go")
                await wait_for(lambda: engine.stats().active == 0, timeout_s=10)
                assert set((await in_flight(url)).values()) == {0.0}
                await page.close()


async def test_a_moderated_or_failed_reply_tells_why_in_words_on_screen_and_aloud(
    browser: Browser,
):
    # A moderated reply was "Stopped by the banned_phrase check: banned phrase" (the wait
    # pane: "Stopped by the banned_phrase check."), never saying text was withheld; and a
    # screen reader was told "Reply moderated." or "Reply error." with the text, never why.
    policy = DeliveryPolicy(holdback_tokens=4, checks=(BannedPhrases(["one token"]),))
    engine = fast_engine(delay_ms=5.0, jitter_ms=0.0)
    async with running(create_app(engine, ServerConfig(policy=policy))) as url:
        page = await open_page(browser, url)
        await page.get_by_label("Wait vs stream").check()
        await send(page, "Explain streaming.")
        await wait_state(page, "stream", "moderated")
        await wait_state(page, "wait", "moderated")
        withheld = "Stopped by moderation (banned phrase): the text from there on was withheld."
        for kind in ("stream", "wait"):
            assert await page.text_content(f"{pane(kind)} .pane-note") == withheld
            assert "one token" not in await shown_text(page, kind)
        told = await page.text_content("#announcer")
        assert told == f"Reply moderated. {await shown_text(page, 'stream')} {withheld}"
        assert await page.is_enabled("#send") and await page.is_disabled("#stop")
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="moderated"]')
        text = await page.text_content("#text") or ""
        assert await page.text_content("#announcer") == f"Reply moderated. {text} {withheld}"
        assert "one token" not in text

    async with running(create_app(fast_engine(delay_ms=5.0, fail_after=4))) as url:
        page = await open_page(browser, url)
        await send(page, "Explain streaming.")
        await wait_state(page, "stream", "error")
        note = await page.text_content(f"{pane('stream')} .pane-note") or ""
        assert "simulated failure after 4 tokens" in note
        told = await page.text_content("#announcer")
        assert told == f"Reply error. {await shown_text(page, 'stream')} {note}"
        assert set((await in_flight(url)).values()) == {0.0}


class LongWordUpstream(ChatUpstream):
    """Refuses every chat with words holding one very long word (a path, a hash, a model's
    id), which the relay passes on in its own."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        error = {"message": "no adapter at /models/" + "x" * 400, "type": "invalid_request_error"}
        return web.json_response({"error": error}, status=400)


async def sideways_overflow(page: Page) -> int:
    overflow: int = await page.evaluate(
        "document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    return overflow


async def test_a_long_unbroken_word_in_an_error_wraps_inside_the_page(browser: Browser):
    # A refusal's words are the server's, and a relay's hold its upstream's: a long word in
    # them (a path, an id) ran past the note's box, and the page scrolled sideways by 2,000
    # pixels on a phone.
    async with relaying_to(LongWordUpstream()) as url:
        page = await open_page(browser, url, width=390, height=780)
        await page.get_by_label("Wait vs stream").check()
        await send(page, "Hello")
        for kind in ("stream", "wait"):
            await wait_state(page, kind, "error")
            assert "x" * 150 in (await page.text_content(f"{pane(kind)} .pane-note") or "")
        assert await sideways_overflow(page) <= 0
        page = await open_page(browser, f"{url}/eventsource.html", width=390, height=780)
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="error"]')
        assert "x" * 150 in (await page.text_content("#log") or "")
        assert await sideways_overflow(page) <= 0


async def test_a_message_with_half_a_character_is_sent_as_shown(browser: Browser):
    # Text cut in the middle of an emoji (a copy of a truncated preview) holds a lone
    # surrogate: JSON.stringify sent it as a "\ud83d" escape, which the server's parser refuses,
    # and the reader was told "body is not valid JSON: unexpected end of hex escape".
    engine = TimedEngine(fast_engine(delay_ms=2.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await page.evaluate(
            """() => {
                const box = document.querySelector('#prompt');
                box.value = 'Nice \\ud83d';  // the first half of 😀 alone
                box.dispatchEvent(new Event('input'));
            }"""
        )
        await page.press("#prompt", "Enter")
        ended = f'{pane("stream")}:is([data-state="done"], [data-state="error"])'
        await page.wait_for_selector(ended)
        note = await page.text_content(f"{pane('stream')} .pane-note")
        assert await page.get_attribute(pane("stream"), "data-state") == "done", note
        assert await page.text_content(".turn.user .bubble") == "Nice \ufffd"
        assert bodies[-1]["messages"] == [{"role": "user", "content": "Nice \ufffd"}]
        page = await open_page(browser, f"{url}/eventsource.html")
        await page.fill("#prompt", "")
        await page.evaluate("() => { document.querySelector('#prompt').value = 'Nice \\ud83d'; }")
        await page.click("#go")
        await page.wait_for_selector('#pane:is([data-state="done"], [data-state="error"])')
        assert await page.get_attribute("#pane", "data-state") == "done", await page.text_content(
            "#log"
        )


async def test_enter_while_a_reply_comes_says_why_nothing_was_sent(browser: Browser):
    # The next message typed while a reply streamed, Enter did nothing and said nothing: the
    # disabled Send button was the only sign, which a keyboard reader never meets.
    engine = TimedEngine(fast_engine(delay_ms=40.0, jitter_ms=0.0))
    async with running(create_app(engine)) as url:
        page = await open_page(browser, url)
        bodies = posted_bodies(page)
        await send(page, "Tell me everything.")
        await words_shown(page, "stream", 3)
        await send(page, "And then?")
        status = await page.text_content("#status") or ""
        assert "still coming" in status and "Stop" in status, status
        assert await page.input_value("#prompt") == "And then?"  # kept, to send later
        await page.click("#stop")
        await wait_state(page, "stream", "stopped")
        assert await page.text_content("#status") == ""
        await page.press("#prompt", "Enter")
        await page.wait_for_selector(".turn.user:has-text('And then?')")
    assert [body["messages"][-1]["content"] for body in bodies] == [
        "Tell me everything.",
        "And then?",
    ]


async def test_the_eventsource_page_says_its_key_goes_in_a_url(browser: Browser):
    # EventSource cannot send a header, so this page puts the key in the stream's URL, where
    # a proxy in front may log it; the page never said so, beside the key or anywhere.
    engine = TimedEngine(fast_engine(delay_ms=2.0, jitter_ms=0.0))
    async with running(create_app(engine, ServerConfig(api_keys=("sk-page-test",)))) as url:
        page = await open_page(browser, f"{url}/eventsource.html")
        streams: list[str] = []
        page.on("request", lambda request: streams.append(request.url))
        described = await page.evaluate(
            """() => document.querySelector('#api-key').getAttribute('aria-describedby')
                .split(' ').map((id) => document.getElementById(id).textContent).join(' ')"""
        )
        assert "URL" in described and "log" in described, described
        await page.fill("#api-key", "sk-page-test")
        await page.click("#go")
        await page.wait_for_selector('#pane[data-state="done"]')
    assert any("/stream?api_key=sk-page-test" in sent for sent in streams), streams
