"""The relay as a gateway, as real processes: failover before the first token, circuits and
health probes, and continuation of a reply whose upstream dies mid-reply.

The upstreams are ``replystream serve --engine simulated`` child processes (one killed, one
whose first token comes later than the relay's time-to-first-token limit) and one small
aiohttp app in this process that answers every request 503; the relay is ``replystream serve
--engine upstream:...`` in another child process. Clients read over loopback sockets.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from replystream.engine.simulated import DEFAULT_REPLY, reply_of_length
from replystream.server import running
from replystream.server.metrics import STATE_REFRESH_S
from replystream.sse import Event, EventParser
from tests.processes import replica, start_server, stop

pytestmark = pytest.mark.slow

SHORT = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0", "--tokens", "6")
SHORT_TEXT = reply_of_length(DEFAULT_REPLY, 6) + " "


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as response:
        return await response.text()


def metric(text: str, name: str, **labels: str) -> float:
    """One series' value in a Prometheus text (0 when absent)."""
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{selector}}}" if labels else name
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[int, list[Event]]:
    async with session.post(f"{url}/v1/replies", json=body) as response:
        parser, events = EventParser(), []
        async for data in response.content.iter_any():
            events += parser.feed(data)
        return response.status, events


def text_of(events: list[Event]) -> str:
    return "".join(json.loads(e.data)["text"] for e in events if e.type == "token")


async def refusing_upstream() -> web.Application:
    """An OpenAI-compatible server that is up, lists a model, and answers every reply 503."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "simulated"}]})

    async def busy(_: web.Request) -> web.Response:
        error = {"error": {"message": "overloaded", "type": "server_error"}}
        return web.json_response(error, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", busy)
    return app


async def test_a_thousand_requests_over_dead_slow_and_refusing_upstreams_all_succeed():
    dead, dead_url = await start_server(*SHORT)
    try:
        async with (
            replica(*SHORT) as (_, good),
            replica(*SHORT, "--first-token-ms", "5000") as (_, slow),
            running(await refusing_upstream()) as refusing,
        ):
            upstreams = {"good": good, "dead": dead_url, "slow": slow, "refusing": refusing}
            relay_args = [f"--engine=upstream:{u}/v1" for u in upstreams.values()]
            # Probes 3 s apart: the first (at start, while the dead one still answers) passes,
            # so the load, not a probe, finds it dead and opens its circuit; later probes fail.
            # A first token within 1 s, where the slow one takes 5 s: at 0.3 s, the good one
            # beside the whole suite once took longer, and every circuit opened.
            relay_args += ["--upstream-ttft-s", "1", "--upstream-health-s", "3"]
            relay_args += ["--upstream-cooldown-s", "1", "--upstream-continue"]
            async with replica(*relay_args) as (_, relay), aiohttp.ClientSession() as session:
                await stop(dead)  # killed: connections to it are refused from now on
                results: list[tuple[int, str, list[str]]] = []
                gate = asyncio.Semaphore(50)

                async def one(seed: int) -> None:
                    async with gate:
                        status, events = await stream(
                            session, relay, {"prompt": "hi", "seed": seed, "max_tokens": 6}
                        )
                    results.append((status, text_of(events), [e.type for e in events]))

                async with asyncio.timeout(240):
                    await asyncio.gather(*(one(seed) for seed in range(1000)))
                failed = [r for r in results if r[0] != 200 or r[1] != SHORT_TEXT]
                assert len(results) == 1000 and failed == [], failed[:3]
                assert all(r[2][-1] == "done" for r in results)
                dead_base = f"{dead_url}/v1"
                probes_then = metric(
                    await scrape(session, relay),
                    "replystream_upstream_probes",
                    result="failed",
                    upstream=dead_base,
                )
                await asyncio.sleep(3.5)  # at least one more probe round
                seen = await scrape(session, relay)
    finally:
        await stop(dead)

    def of(name: str, base: str, **labels: str) -> float:
        return metric(seen, name, upstream=f"{base}/v1", **labels)

    # The dead upstream's circuit is open, and it is still probed (and found dead).
    assert of("replystream_upstream_circuit", dead_url) == 2.0
    assert of("replystream_upstream_probe_ok", dead_url) == 0.0
    assert of("replystream_upstream_probes", dead_url, result="failed") > probes_then
    assert of("replystream_upstream_attempts", dead_url, result="connect_error") >= 1
    # The slow one timed out before its first token; the refusing one answered 503.
    assert of("replystream_upstream_attempts", slow, result="ttft_timeout") >= 1
    assert of("replystream_upstream_attempts", refusing, result="overloaded") >= 1
    assert of("replystream_upstream_attempts", good, result="ok") >= 500
    assert metric(seen, "replystream_upstream_failovers") >= 3
    finished = metric(seen, "replystream_replies_total", endpoint="/v1/replies", outcome="finished")
    assert finished == 1000


def histogram(text: str, name: str, upstream: str, le: str | None = None) -> float:
    """One series of a histogram labelled by ``upstream`` (and ``le``, for a bucket), in
    whatever order the exposition lists the labels (0 when absent)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if not series.startswith(name + "{") or f'upstream="{upstream}"' not in series:
            continue
        if le is None or f'le="{le}"' in series:
            return float(value)
    return 0.0


@pytest.mark.parametrize("workers", [1, 2])
async def test_each_upstreams_time_to_first_token_is_a_histogram(workers: int):
    fast_args = (*SHORT, "--model-name", "fast")
    slow_args = (*SHORT, "--model-name", "slow", "--first-token-ms", "300")
    async with replica(*fast_args) as (_, fast), replica(*slow_args) as (_, slow):
        relay_args = [f"--engine=upstream:{fast}/v1", f"--engine=upstream:{slow}/v1"]
        relay_args += ["--workers", str(workers)]
        async with replica(*relay_args) as (_, relay), aiohttp.ClientSession() as session:
            for model in ("fast", "slow", "fast", "slow", "slow"):  # each model, one upstream
                body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(
                    f"{relay}/v1/chat/completions", json={**body, "stream": True}
                ) as response:
                    assert response.status == 200, await response.text()
                    assert (await response.text()).endswith("data: [DONE]\n\n")
            if workers > 1:  # each worker writes its counts to the shared files this often
                await asyncio.sleep(STATE_REFRESH_S * 1.5)
            seen = await scrape(session, relay)

    name = "replystream_upstream_time_to_first_token_seconds"
    fast_base, slow_base = f"{fast}/v1", f"{slow}/v1"
    assert histogram(seen, name + "_count", fast_base) == 2
    assert histogram(seen, name + "_count", slow_base) == 3
    # The slow upstream's first token comes 300 ms into each reply; the fast one's at once.
    assert histogram(seen, name + "_bucket", slow_base, le="0.25") == 0
    assert histogram(seen, name + "_bucket", slow_base, le="+Inf") == 3
    assert histogram(seen, name + "_sum", slow_base) >= 0.9
    assert histogram(seen, name + "_bucket", fast_base, le="1.0") == 2
    assert histogram(seen, name + "_sum", fast_base) < histogram(seen, name + "_sum", slow_base)


LONG = ("--engine", "simulated", "--delay-ms", "40", "--jitter-ms", "0", "--tokens", "60")
LONG_TEXT = reply_of_length(DEFAULT_REPLY, 60) + " "


async def kill_mid_reply(continuation: bool) -> tuple[list[Event], str]:
    """A reply through a relay in front of two upstreams; the one serving it is killed after
    a few tokens. The events the client read, and the base URL of the upstream killed."""
    first, first_url = await start_server(*LONG)
    second, second_url = await start_server(*LONG)
    processes = {f"{first_url}/v1": first, f"{second_url}/v1": second}
    try:
        relay_args = [f"--engine=upstream:{u}" for u in processes]
        async with replica(*relay_args) as (_, relay), aiohttp.ClientSession() as session:
            body = {"prompt": "hi", "upstream_continue": continuation}
            events: list[Event] = []
            parser = EventParser()
            killed_url = ""
            async with (
                asyncio.timeout(60),
                session.post(f"{relay}/v1/replies", json=body) as response,
            ):
                assert response.status == 200
                killed = False
                async for data in response.content.iter_any():
                    events += parser.feed(data)
                    tokens = sum(e.type == "token" for e in events)
                    if tokens >= 5 and not killed:
                        killed = True
                        seen = await scrape(session, relay)
                        serving = [
                            u
                            for u in processes
                            if metric(seen, "replystream_upstream_outstanding", upstream=u) == 1
                        ]
                        assert len(serving) == 1, seen
                        killed_url = serving[0]
                        processes[killed_url].send_signal(signal.SIGKILL)
            return events, killed_url
    finally:
        for process in processes.values():
            await stop(process)


async def test_an_upstream_killed_mid_reply_is_continued_elsewhere_without_gap_or_repeat():
    events, _ = await kill_mid_reply(continuation=True)
    assert text_of(events) == LONG_TEXT  # every word once, in order, across the seam
    types = [e.type for e in events]
    assert types.count("continued") == 1 and types[-2:] == ["usage", "done"]
    continued = json.loads(events[types.index("continued")].data)
    assert continued["reason"] == "upstream_disconnected" and continued["after_tokens"] >= 5
    ids = [int(e.id or 0) for e in events]
    assert ids == list(range(1, len(events) + 1))  # event numbers go on without a hole
    usage = json.loads(events[-2].data)
    assert usage["completion_tokens"] == 60


async def test_an_upstream_killed_mid_reply_without_continuation_is_a_named_error():
    events, killed_url = await kill_mid_reply(continuation=False)
    errors = [json.loads(e.data)["error"] for e in events if e.type == "error"]
    assert [e["code"] for e in errors] == ["upstream_disconnected"]
    assert errors[0]["message"] == f"the upstream at {killed_url} closed the connection mid-reply"
    assert "continued" not in [e.type for e in events] and events[-1].type == "error"
    assert LONG_TEXT.startswith(text_of(events)) and len(text_of(events)) < len(LONG_TEXT)


async def stall_mid_reply(tmp_path: Path, continuation: bool) -> tuple[list[Event], str, str]:
    """A reply through a relay in front of an upstream whose fourth word comes 20 s after
    the third (keep-alives between) and one steady upstream with the same text: the events
    the client read, the relay's metrics after it, and the stalling upstream's base URL."""
    words = ("one ", "two ", "three ", "four ", "five ")
    steps = [{"text": w, "delay_ms": 20_000 if w == "four " else 5} for w in words]
    script = tmp_path / "stalls.json"
    script.write_text(json.dumps(steps))
    steady = ("--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "0")
    async with (
        replica("--engine", "simulated", "--reply-script", str(script)) as (_, stalling),
        replica(*steady, "--reply-text", "".join(words)) as (_, other),
        # The first listed upstream takes a fresh relay's first request.
        replica(
            f"--engine=upstream:{stalling}/v1",
            f"--engine=upstream:{other}/v1",
            "--upstream-stall-s",
            "0.5",
        ) as (_, relay),
        aiohttp.ClientSession() as session,
    ):
        body = {"prompt": "hi", "upstream_continue": continuation}
        async with asyncio.timeout(60):
            status, events = await stream(session, relay, body)
        assert status == 200
        return events, await scrape(session, relay), f"{stalling}/v1"


async def test_an_upstream_stalled_mid_reply_is_continued_elsewhere(tmp_path: Path):
    events, seen, stalling = await stall_mid_reply(tmp_path, continuation=True)
    assert text_of(events) == "one two three four five "
    types = [e.type for e in events]
    assert types.count("continued") == 1 and types[-2:] == ["usage", "done"]
    continued = json.loads(events[types.index("continued")].data)
    assert continued == {"reason": "upstream_stalled", "after_tokens": 3}
    assert [int(e.id or 0) for e in events] == list(range(1, len(events) + 1))
    assert metric(seen, "replystream_upstream_continuations") == 1
    assert metric(seen, "replystream_upstream_attempts", result="stalled", upstream=stalling) == 1


async def test_an_upstream_stalled_mid_reply_without_continuation_is_a_named_error(
    tmp_path: Path,
):
    events, seen, stalling = await stall_mid_reply(tmp_path, continuation=False)
    assert text_of(events) == "one two three "
    errors = [json.loads(e.data)["error"] for e in events if e.type == "error"]
    assert [e["code"] for e in errors] == ["upstream_stalled"] and events[-1].type == "error"
    assert metric(seen, "replystream_upstream_continuations") == 0
    assert metric(seen, "replystream_upstream_attempts", result="stalled", upstream=stalling) == 1
