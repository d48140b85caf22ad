"""What a replystream relay adds: time to first text and per event, against the upstream direct.

The upstream is ``replystream serve --engine simulated`` (jitter 0, so every reply with the same
seed has the same token schedule) in one child process; the relay is ``replystream serve
--engine upstream:URL`` in another. Each round streams the same chat request (same seed) to the
upstream directly and then through the relay, in one run, and stamps every content event when
the socket delivered it (``perf_counter`` inside the client transport's ``data_received``),
from the moment the request was written. Event i of the relayed reply minus event i of the
direct reply is what the relay added to that event.

Run: python benchmarks/relay_latency.py [--rounds 20] [--tokens 60] [--delay-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from replystream.cli_values import int_between, positive_int, schedule_ms
from replystream.client.transport import connect, http_request
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.local_server import local_server
from replystream.sse import EventParser
from replystream.stats import percentile
from tool_main import tool_main


async def content_arrivals(url: str, seed: int) -> list[float]:
    """Arrival (ms since the request was written) of each event that carries text."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "seed": seed}
    connection = await connect(url)  # connected first: the clock covers the request alone
    parser = EventParser()
    arrivals: list[float] = []
    sent = time.perf_counter()
    async with http_request(
        f"{url}/v1/chat/completions",
        method="POST",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        connection=connection,
    ) as response:
        async for chunk in response:
            for event in parser.feed(chunk.data):
                if event.data == "[DONE]" or event.type != "message":
                    continue
                choices = json.loads(event.data)["choices"]
                if any(c["delta"].get("content") for c in choices):
                    arrivals.append((chunk.at - sent) * 1000.0)
    return arrivals


async def main(rounds: int, tokens: int, delay_ms: float) -> None:
    upstream_args = ["--delay-ms", str(delay_ms), "--jitter-ms", "0", "--tokens", str(tokens)]
    async with local_server(upstream_args) as upstream:
        async with local_server(["--engine", f"upstream:{upstream}/v1"]) as relay:
            await content_arrivals(relay, 0)  # warm-up: model discovery, imports, pools
            first_direct, first_relay, added_first, added_event = [], [], [], []
            for seed in range(1, rounds + 1):
                direct = await content_arrivals(upstream, seed)
                relayed = await content_arrivals(relay, seed)
                if len(direct) != len(relayed):
                    raise SystemExit(f"seed {seed}: {len(direct)} events direct, {len(relayed)}")
                first_direct.append(direct[0])
                first_relay.append(relayed[0])
                added_first.append(relayed[0] - direct[0])
                added_event += [r - d for r, d in zip(relayed, direct, strict=True)]
    print(
        f"upstream: simulated, {tokens} tokens every {delay_ms:g} ms (jitter 0); "
        f"{rounds} rounds, direct then relayed, same seed"
    )
    print(f"{'':28}{'direct':>10}{'relayed':>10}{'added':>10}")
    print(
        f"{'time to first text, median':28}{statistics.median(first_direct):>8.2f}ms"
        f"{statistics.median(first_relay):>8.2f}ms{statistics.median(added_first):>8.2f}ms"
    )
    print(
        f"{'added per event, median':28}{'':>20}{statistics.median(added_event):>8.2f}ms"
        f"   (p95 {percentile(added_event, 95):.2f} ms, {len(added_event)} events)"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=20)
    parser.add_argument("--tokens", type=int_between(1, MAX_TOKENS_LIMIT), default=60)
    parser.add_argument("--delay-ms", type=schedule_ms, default=20.0)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.tokens, args.delay_ms))


if __name__ == "__main__":
    tool_main(cli)
