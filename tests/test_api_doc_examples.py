"""The SDK and client examples of docs/api.md, run as written against a real server.

Each Python block is taken from the page, its address (``http://127.0.0.1:8000``) swapped
for the test server's, and run with the installed openai, anthropic and aiohttp clients: a
renamed method, field or event in the page, or a route that stops answering as it shows,
fails here rather than in a reader's first minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from pathlib import Path

from replystream.engine import SimulatedConfig, SimulatedEngine
from tests.conftest import serve_engine

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
DOC_ADDRESS = "http://127.0.0.1:8000"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", API_DOC.read_text(), re.S)


def block_with(marker: str) -> str:
    found = [block for block in python_blocks() if marker in block]
    assert len(found) == 1, f"docs/api.md: {len(found)} Python blocks hold {marker!r}"
    return found[0]


def run_block(source: str, url: str, names: dict[str, object]) -> str:
    """Run ``source`` with the server at ``url``; return what it printed."""
    assert DOC_ADDRESS in source or "client" in names, source
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source.replace(DOC_ADDRESS, url), str(API_DOC), "exec"), names)
    return printed.getvalue()


def fast_engine() -> SimulatedEngine:
    return SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))


async def test_the_openai_sdk_examples_run_as_written():
    async with serve_engine(fast_engine()) as url:
        names: dict[str, object] = {}
        chat = await asyncio.to_thread(run_block, block_with("chat.completions"), url, names)
        legacy = block_with("client.completions.create").strip()
        text = await asyncio.to_thread(eval, legacy, names)
        models = block_with("client.models.list()").split("#")[0].strip()
        listed = await asyncio.to_thread(eval, models, names)
    whole, streamed = chat.split("\n", 1)
    assert whole.startswith("A language model")
    assert streamed.startswith("A language model") and "CompletionUsage(" in streamed
    assert isinstance(text, str) and text.startswith("A language model")
    assert listed == ["simulated"]


async def test_the_anthropic_sdk_example_runs_as_written():
    async with serve_engine(fast_engine()) as url:
        printed = await asyncio.to_thread(run_block, block_with("messages.stream("), url, {})
    assert printed.startswith("A language model")


async def test_the_websocket_example_runs_as_written():
    async with serve_engine(fast_engine()) as url:
        printed = await asyncio.to_thread(run_block, block_with("ws_connect"), url, {})
    lines = [line.rstrip() for line in printed.splitlines()]
    assert lines[:2] == ["a A", "a language"], lines
    assert all(line.split(" ", 1)[0] in ("a", "b") for line in lines)
