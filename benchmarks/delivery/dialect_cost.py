"""What a wire dialect costs the server per delivered event: the same replies as OpenAI chat
chunks and as Responses API events, side by side.

One ``replystream serve --engine simulated`` process (fast tokens, no jitter) serves C streamed
replies of N tokens at once on each route in turn, rounds interleaved. Measured: the server's
CPU (user + system, /proc) per text event the clients parsed, and the bytes each event takes
on the wire; medians over the rounds, and the ratio Responses / chat.

Run: python benchmarks/delivery/dialect_cost.py [-C 200] [--tokens 120] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import aiohttp
from procstats import cpu_seconds, process_tree

from replystream.cli_values import int_between, positive_int
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.local_server import serve_process
from replystream.sse import EventParser

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main

ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def is_text(route: str, kind: str, data: str) -> bool:
    """Whether an event carries a piece of the reply's text."""
    if route == "responses":
        return kind == "response.output_text.delta"
    if data == "[DONE]":
        return False
    choices = json.loads(data).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def body(route: str, tokens: int) -> dict[str, object]:
    if route == "chat":
        return {
            "model": "simulated",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": tokens,
            "stream": True,
        }
    return {"model": "simulated", "input": "x", "max_output_tokens": tokens, "stream": True}


async def one_stream(
    http: aiohttp.ClientSession, url: str, route: str, tokens: int
) -> tuple[int, int]:
    """(text events, body bytes) of one streamed reply."""
    path = ROUTES[route]
    parser = EventParser()
    events = size = 0
    async with http.post(url + path, json=body(route, tokens)) as response:
        async for chunk in response.content.iter_any():
            size += len(chunk)
            events += sum(is_text(route, event.type, event.data) for event in parser.feed(chunk))
    return events, size


async def one_round(
    url: str, pid: int, route: str, streams: int, tokens: int
) -> tuple[float, float]:
    """(CPU µs per text event, bytes per text event) of ``streams`` replies at once."""
    pids = process_tree(pid)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        before = cpu_seconds(pids)
        results = await asyncio.gather(
            *(one_stream(http, url, route, tokens) for _ in range(streams))
        )
        spent = cpu_seconds(pids) - before
    events = sum(count for count, _ in results)
    size = sum(nbytes for _, nbytes in results)
    if events != streams * tokens:
        raise RuntimeError(f"{route}: {events} text events, expected {streams * tokens}")
    return spent * 1e6 / events, size / events


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-C", "--streams", type=positive_int, default=200, help="replies at once")
    parser.add_argument(
        "--tokens", type=int_between(1, MAX_TOKENS_LIMIT), default=120, help="tokens per reply"
    )
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args()
    server_args = ["--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "0"]
    async with serve_process(server_args) as server:
        runs: dict[str, list[tuple[float, float]]] = {route: [] for route in ROUTES}
        for route in ROUTES:  # warm-up
            await one_round(server.url, server.pid, route, 20, 5)
        for _ in range(args.rounds):
            for route in ROUTES:
                runs[route].append(
                    await one_round(server.url, server.pid, route, args.streams, args.tokens)
                )
    medians = {
        route: (statistics.median(c for c, _ in rounds), statistics.median(b for _, b in rounds))
        for route, rounds in runs.items()
    }
    print(f"{args.streams} replies of {args.tokens} tokens at once, median of {args.rounds} rounds")
    print(f"{'route':>22} {'CPU µs / event':>15} {'bytes / event':>14}")
    for route, (cpu, size) in medians.items():
        print(f"{ROUTES[route]:>22} {cpu:>15.1f} {size:>14.0f}")
    chat, responses = medians["chat"], medians["responses"]
    print(
        f"responses / chat: CPU {responses[0] / chat[0]:.2f}x, bytes {responses[1] / chat[1]:.2f}x"
    )
    print(
        "RESULT "
        + json.dumps(
            {
                route: {"cpu_us_per_event": c, "bytes_per_event": b}
                for route, (c, b) in medians.items()
            }
        )
    )


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main()))
