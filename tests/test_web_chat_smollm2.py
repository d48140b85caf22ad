"""The chat page in headless Chromium on the real model: `serve --engine smollm2` on loopback.

One server (the model loads once, in seconds) serves the module. Replies are greedy
(temperature 0 from the page's own settings) and short, so they are quick and repeatable;
what they must contain is only what this model answers to a plain question ("Paris").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

from tests.browser import chromium
from tests.processes import replica
from tests.services import require_smollm2
from tests.test_web_chat import TURN, open_page, pane, posted_bodies, send, set_delivery

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FINISHED = f'{pane("stream")}:is([data-state="done"], [data-state="cut"])'
# A real model on a shared 2-core machine: a reply may take seconds (prefill of the history
# included); the page must still finish it.
REPLY_TIMEOUT_MS = 180_000


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smollm2_url() -> AsyncIterator[str]:
    require_smollm2()
    async with replica("--engine", "smollm2", ready_s=240) as (_, url):
        yield url


@pytest_asyncio.fixture(loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as launched:
        yield launched


async def greedy_page(browser: Browser, url: str, max_tokens: int) -> Page:
    page = await open_page(browser, url)
    page.set_default_timeout(REPLY_TIMEOUT_MS)
    await set_delivery(page, temperature=0, max_tokens=max_tokens, batch_tokens=1)
    return page


async def record_paints(page: Page) -> None:
    """From now on, note the newest reply's text at every animation frame where it changed."""
    await page.evaluate(
        """(selector) => {
            window.paints = [];
            const look = () => {
                const node = document.querySelector(selector);
                const text = node === null ? '' : node.textContent;
                if (text !== '' && text !== paints.at(-1)) paints.push(text);
                requestAnimationFrame(look);
            };
            requestAnimationFrame(look);
        }""",
        f"{pane('stream')} .reply-text",
    )


async def test_a_question_gets_an_english_answer_that_grows_token_by_token(
    smollm2_url: str, browser: Browser
) -> None:
    page = await greedy_page(browser, smollm2_url, max_tokens=40)
    await record_paints(page)
    await send(page, "What is the capital of France?")
    await page.wait_for_selector(FINISHED)

    answer = await page.locator(f"{pane('stream')} .reply-text").text_content() or ""
    assert "Paris" in answer and len(answer.split()) >= 3, answer
    # It ended on its own (the model's end of turn), so the page calls it complete.
    assert await page.get_attribute(pane("stream"), "data-state") == "done"
    paints: list[str] = await page.evaluate("paints")
    # Seen growing before it was done: several frames, each a longer start of the answer.
    assert len(paints) >= 3, paints
    assert paints[-1] == answer
    for shorter, longer in pairwise(paints):
        assert longer.startswith(shorter) and len(longer) > len(shorter), paints


QUESTIONS = (
    "Hello! Please answer in one short sentence.",
    "What colour is the sky on a clear day?",
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "How many legs does a dog have?",
    "What do bees make?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What is frozen water called?",
    "And once more: what is the capital of France?",
)


async def test_the_third_and_the_tenth_message_of_one_conversation_still_work(
    smollm2_url: str, browser: Browser
) -> None:
    page = await greedy_page(browser, smollm2_url, max_tokens=16)
    bodies = posted_bodies(page)
    answers: list[str] = []
    for question in QUESTIONS:
        await send(page, question)
        await page.wait_for_selector(FINISHED)
        answers.append(await page.locator(f"{TURN} .reply-text").text_content() or "")
        assert answers[-1].strip(), f"no answer to {question!r}"
    assert "Paris" in answers[2], answers
    assert "Paris" in answers[9], answers
    # Ten short exchanges fit the 8,192-token context: nothing was dropped, no turn failed,
    # and the tenth request carried the whole conversation as the page showed it.
    assert await page.locator(".context-notice").count() == 0
    assert await page.locator(".turn.user.out-of-context").count() == 0
    assert await page.locator('.pane[data-state="error"]').count() == 0
    sent: list[dict[str, Any]] = [b for b in bodies if "messages" in b]
    assert len(sent) == 10 and all(b["temperature"] == 0 for b in sent)
    last = sent[-1]["messages"]
    assert len(last) == 19
    assert [m["content"] for m in last if m["role"] == "user"] == list(QUESTIONS)
    assert [m["content"] for m in last if m["role"] == "assistant"] == answers[:9]


async def test_the_eventsource_page_asks_its_prompt_as_a_chat_message(
    smollm2_url: str, browser: Browser
) -> None:
    # Sent as a bare `prompt`, the question was text for the instruction-tuned model to
    # continue, not a user's message: it ended at once, an empty reply badged complete.
    page = await open_page(browser, f"{smollm2_url}/eventsource.html")
    page.set_default_timeout(REPLY_TIMEOUT_MS)
    await page.fill("#prompt", "What is the capital of France?")
    await page.click("#go")
    await page.wait_for_selector('#pane:is([data-state="done"], [data-state="cut"])')
    answer = await page.text_content("#text") or ""
    assert len(answer.split()) >= 3, answer
