"""replystream in front of another replystream process, as in front of vLLM or llama.cpp.

The upstream is ``replystream serve --engine simulated`` in a child process (an
OpenAI-compatible streaming server); the relay is ``replystream serve --engine upstream:URL``
in another. Everything goes over loopback sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest

from replystream.client.transport import http_request
from replystream.sse import EventParser
from tests.processes import replica
from tests.sse_client import post_events

pytestmark = pytest.mark.slow

FAST = ("--engine", "simulated", "--delay-ms", "4", "--jitter-ms", "1", "--tokens", "40")


def chat(seed: int, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    return {"messages": messages, "stream": True, "seed": seed, **extra}


async def metric(url: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(selector)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_the_relay_returns_the_upstreams_text_for_the_same_seed():
    async with (
        replica(*FAST, "--seed", "11") as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1") as (_, relay),
    ):
        for seed in (1, 2):
            body = chat(seed, max_tokens=25, stream_options={"include_usage": True})
            direct = await post_events(f"{upstream}/v1/chat/completions", body)
            relayed = await post_events(f"{relay}/v1/chat/completions", body)
            assert relayed.status == direct.status == 200
            assert relayed.chat_text == direct.chat_text != ""
            usage = [json.loads(e.data) for e in relayed.events if e.data != "[DONE]"][-1]
            assert usage["usage"]["completion_tokens"] == 25
            assert relayed.raw.endswith(b"data: [DONE]\n\n")
        # The relay's other routes read the same upstream: the native endpoint, unstreamed.
        native = await post_events(
            f"{relay}/v1/replies", {"prompt": "hi", "seed": 1, "max_tokens": 25, "stream": False}
        )
        direct = await post_events(f"{upstream}/v1/chat/completions", chat(1, max_tokens=25))
        assert json.loads(native.raw)["text"] == direct.chat_text
        assert json.loads(native.raw)["usage"]["completion_tokens"] == 25


def uvloop_loaded(pid: int) -> bool:
    """Whether the process has uvloop's compiled loop in its memory (it is imported only to
    serve on it)."""
    return "/uvloop/loop." in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("loop", [None, "asyncio", "uvloop"])
async def test_the_relay_serves_on_the_loop_asked_for(loop: str | None) -> None:
    """uvloop's transports are not subclasses of asyncio's: the relay's own client must
    take them as they are. With no ``--loop`` the relay serves on uvloop (installed with
    replystream on Linux); asyncio's own loop, asked for, still serves."""
    pytest.importorskip("uvloop", reason="uvloop is a dependency on Linux")
    choice = () if loop is None else ("--loop", loop)
    async with (
        replica(*FAST, "--seed", "11") as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1", *choice) as (process, relay),
    ):
        assert uvloop_loaded(process.pid) == (loop != "asyncio")
        for seed in (1, 2):  # the second reply on the first one's kept-alive connection
            body = chat(seed, max_tokens=25)
            direct = await post_events(f"{upstream}/v1/chat/completions", body)
            relayed = await post_events(f"{relay}/v1/chat/completions", body)
            assert relayed.status == direct.status == 200
            assert relayed.chat_text == direct.chat_text != ""


async def test_our_client_leaving_aborts_the_upstream_generation():
    slow = ("--engine", "simulated", "--delay-ms", "40", "--jitter-ms", "0", "--tokens", "200")
    async with (
        replica(*slow) as (_, upstream),
        replica("--engine", f"upstream:{upstream}/v1") as (_, relay),
    ):
        body = json.dumps(chat(3)).encode()
        async with http_request(
            f"{relay}/v1/chat/completions",
            method="POST",
            body=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            parser = EventParser()
            seen = 0
            async for piece in response:
                seen += len(parser.feed(piece.data))
                if seen >= 3:
                    break  # leave mid-reply: the connection closes on exit
        labels = {"endpoint": "/v1/chat/completions", "outcome": "cancelled"}
        for url in (relay, upstream):  # the relay saw its client go; the upstream saw the relay go

            async def cancelled(url: str = url) -> float:
                return await metric(url, "replystream_replies_total", **labels)

            async with asyncio.timeout(10):
                while await cancelled() < 1:  # noqa: ASYNC110  (polls another process)
                    await asyncio.sleep(0.05)
        finished = {"endpoint": "/v1/chat/completions", "outcome": "finished"}
        assert await metric(upstream, "replystream_replies_total", **finished) == 0


async def test_weights_split_requests_across_upstreams():
    async with (
        replica(*FAST) as (_, first),
        replica(*FAST) as (_, second),
        replica("--engine", f"upstream:{first}/v1=3", "--engine", f"upstream:{second}/v1") as (
            _,
            relay,
        ),
    ):
        for seed in range(8):
            got = await post_events(f"{relay}/v1/chat/completions", chat(seed, max_tokens=3))
            assert got.status == 200
        labels = {"endpoint": "/v1/chat/completions", "outcome": "finished"}
        counts = [await metric(u, "replystream_replies_total", **labels) for u in (first, second)]
        assert counts == [6.0, 2.0]


async def test_an_upstream_api_key_comes_from_configuration_not_from_the_client():
    async with (
        replica(*FAST, "--api-key", "upstream-key") as (_, upstream),
        replica(
            "--engine",
            f"upstream:{upstream}/v1",
            "--upstream-api-key",
            "upstream-key",
            "--upstream-model",
            "simulated",
        ) as (_, relay),
        replica("--engine", f"upstream:{upstream}/v1", "--upstream-model", "simulated") as (
            _,
            keyless,
        ),
    ):
        ok = await post_events(f"{relay}/v1/chat/completions", chat(1, max_tokens=3))
        assert ok.status == 200 and ok.chat_text
        # A client's own key is not passed on: without a configured key the upstream refuses.
        client_key = {"Authorization": "Bearer upstream-key"}
        refused = await post_events(
            f"{keyless}/v1/chat/completions", chat(1, max_tokens=3), client_key
        )
        assert refused.status == 502
        assert json.loads(refused.raw)["error"]["code"] == "upstream_error_status"
