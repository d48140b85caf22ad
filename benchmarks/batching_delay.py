"""Holding delay of batched delivery, measured next to the reference formula.

With k tokens per event at d ms per token, the first token of a full batch waits (k - 1) x d
and the average token (k - 1) x d / 2; with a time window W, a batch leaves W after its first
token. Each setting streams the same seeded reply as the k = 1 baseline in the same run; a
token's holding delay is when the client parsed it minus when the baseline client parsed it.

Run: python benchmarks/batching_delay.py [--tokens 96] [--delay-ms 33] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from replystream.cli_values import float_between, int_between, positive_int
from replystream.client.transport import http_request
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.local_server import local_server
from replystream.sse import EventParser
from tool_main import tool_main


async def token_arrivals(url: str, body: dict[str, object]) -> list[float]:
    """Arrival time (ms from request) of every token, taking each event's token count."""
    arrivals: list[float] = []
    parser = EventParser()
    async with http_request(
        f"{url}/v1/replies",
        method="POST",
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    ) as response:
        start = None
        async for chunk in response:
            start = start if start is not None else response.head_at
            for event in parser.feed(chunk.data):
                if event.type == "token":
                    tokens = json.loads(event.data)["tokens"]
                    arrivals += [(chunk.at - response.head_at) * 1000.0] * tokens
    return arrivals


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int_between(1, MAX_TOKENS_LIMIT), default=96)
    # Above 0: the 50 ms window's row divides by it. At most serve's own bound.
    parser.add_argument("--delay-ms", type=float_between(0.0, 60_000.0, strict=True), default=33.0)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args()
    d = args.delay_ms
    settings: list[tuple[str, dict[str, object], str, str]] = [
        (f"k={k}", {"batch_tokens": k}, f"{(k - 1) * d:.1f}", f"{(k - 1) * d / 2:.1f}")
        for k in (1, 2, 4, 8)
    ]
    # A 50 ms window holds the n = floor(W / d) + 1 tokens made within it; token i waits
    # W - i x d, so the average is W - d x (n - 1) / 2.
    window = 50.0
    n = int(window // d) + 1
    settings.append(
        (
            "W=50 ms",
            {"batch_tokens": 4096, "batch_ms": window},
            f"{window:.1f}",
            f"{window - d * (n - 1) / 2:.1f}",
        )
    )
    server_args = ["--tokens", str(args.tokens), "--delay-ms", f"{d:g}", "--jitter-ms", "0"]
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name, *_ in settings}
    async with local_server(server_args) as url:
        for repeat in range(args.repeats):
            base_body = {"prompt": "x", "seed": repeat}
            baseline = await token_arrivals(url, base_body)
            for name, extra, _, _ in settings:
                got = await token_arrivals(url, {**base_body, **extra})
                holds = [g - b for g, b in zip(got, baseline, strict=True)]
                k = int(extra["batch_tokens"])  # type: ignore[call-overload]
                firsts = holds[::k] if k < 4096 else [holds[0]]
                events = len(set(got))
                rows[name].append((statistics.mean(firsts), statistics.mean(holds), events))
    print(
        f"Holding delay per token, {args.tokens} tokens at {d:g} ms, median of "
        f"{args.repeats} runs (ms)"
    )
    print(
        f"{'setting':<9} {'events':>6} {'first of batch':>15} {'formula':>8} "
        f"{'average':>8} {'formula':>8}"
    )
    for name, _, first_formula, avg_formula in settings:
        first_ms = statistics.median(r[0] for r in rows[name])
        average_ms = statistics.median(r[1] for r in rows[name])
        event_count = statistics.median(r[2] for r in rows[name])
        print(
            f"{name:<9} {event_count:>6.0f} {first_ms:>15.1f} {first_formula:>8} "
            f"{average_ms:>8.1f} {avg_formula:>8}"
        )


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main()))
