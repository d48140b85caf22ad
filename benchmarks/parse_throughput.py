"""How many events per second `EventParser` handles on one core for a token stream.

This script decides only what a realistic stream and a fair timing look like: 100k short
token events (``id: 17\\ndata: {"text":"word "}\\n\\n``), fed in 4 KiB chunks and as one
whole body, median of several runs. It must not know how the parser works inside.

Run: ``python benchmarks/parse_throughput.py [--events N] [--runs N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

from replystream.cli_values import positive_int
from replystream.sse import EventParser, encode_data
from tool_main import tool_main


def token_stream(n_events: int) -> bytes:
    return b"".join(encode_data('{"text":"word "}', id=str(i)) for i in range(n_events))


def chunked(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


def parse_all(chunks: list[bytes]) -> int:
    parser = EventParser()
    count = 0
    for chunk in chunks:
        count += len(parser.feed(chunk))
    parser.close()
    return count


def median_rate(run: Callable[[], int], n_events: int, runs: int) -> float:
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        got = run()
        elapsed = time.perf_counter() - start
        if got != n_events:
            raise SystemExit(f"parsed {got} events, expected {n_events}")
        rates.append(n_events / elapsed)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--events", type=positive_int, default=100_000)
    ap.add_argument("--runs", type=positive_int, default=7)
    args = ap.parse_args()

    body = token_stream(args.events)
    cases = {
        "4 KiB chunks": chunked(body, 4096),
        "whole body": [body],
        # What a live client reading a slow token stream sees.
        "one event per feed": [event + b"\n\n" for event in body.split(b"\n\n")[:-1]],
    }

    print(f"{args.events} events, {len(body)} bytes, median of {args.runs} runs")
    for name, chunks in cases.items():
        rate = median_rate(partial(parse_all, chunks), args.events, args.runs)
        print(f"  {name:<20} {rate:>12,.0f} events/s  ({len(chunks)} feeds)")


if __name__ == "__main__":
    tool_main(main)
