"""The relay benchmark's load client: C chat-completion streams open at once, in its own process.

What this file decides: how one run against one target (the upstream itself, or a relay in
front of it) is driven and what is kept of it. A run is C slots, each streaming replies one
after another on a new connection each; the slots start spread evenly over ``spread_s``
(the length of one reply: then C streams are open at once, starting and ending at a steady
rate, as a served relay sees them) or all at once (``spread_s`` 0: a burst of C requests).
Streams and the run's counters are the delivery benchmark's (``clientstream``), and so is
the connect-with-retry; a stream here sends ``POST /v1/chat/completions`` and stamps, in
``data_received``, every content chunk (counted by the upstream's ``MARKER`` with a byte
search, so no relay's re-encoding matters and the client parses nothing). Per stream it
returns the time to the first chunk and the largest gap between two chunks; percentiles are
the harness's.

Run: python benchmarks/relay/relay_client.py < config.json > result.json, where the config is
``{"url": ..., "streams": C, "replies_per_slot": 2, "spread_s": 2.0, "api_key": ...,
"model": "bench", "timeout_s": 30}``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if __package__ in (None, ""):  # run as a script: the delivery benchmark's modules, and ours
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "delivery")]

from clientstream import Run, Stream
from loadclient import connect, run_from_stdin

from relay.upstream_server import MARKER

TAIL = len(MARKER) - 1
DONE = b"data: [DONE]"


class ChatStream(Stream):
    """One streamed chat completion: sends its request on connect, stamps content chunks."""

    def __init__(self, run: Run, request: bytes) -> None:
        super().__init__(run)
        self.request = request
        self.head = b""
        self.tail = b""
        self.done = asyncio.Event()

    def finish(self, failure: str | None) -> None:
        super().finish(failure)
        self.done.set()

    def transport_ready(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.ended:
            return
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.head[: self.head.find(b"\r\n")]
            if not status.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                self.finish(f"status {status[9:12].decode(errors='replace')}")
                return
            self.opened()
            data = self.head[end + 4 :]
            self.head = b""
        chunk = self.tail + data
        found = chunk.count(MARKER)
        if found:
            self.arrivals.extend([now] * found)
        if DONE in chunk:
            self.done_at = now
            self.finish(None)
        self.tail = chunk[-len(DONE) :]


def request_bytes(host: str, port: int, path: str, model: str, api_key: str) -> bytes:
    """One streamed chat completion request, one per connection."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "stream": True,
    }
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {api_key}\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + data


async def one_slot(
    run: Run, streams: list[ChatStream], request: bytes, host: str, port: int, delay_s: float
) -> None:
    """One of the C slots: after ``delay_s``, its replies one after another."""
    await asyncio.sleep(delay_s)
    for stream in streams:
        await connect(run, stream, host, port)
        if not stream.ended:
            await stream.done.wait()


async def load(config: dict[str, Any]) -> dict[str, Any]:
    """Run C slots; the result covers every stream of every slot."""
    url = urlsplit(config["url"])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    path = (url.path.rstrip("/") or "") + "/v1/chat/completions"
    request = request_bytes(host, port, path, config.get("model", "bench"), config["api_key"])
    slots, per_slot = config["streams"], config.get("replies_per_slot", 1)
    spread_s = config.get("spread_s", 0.0)
    run = Run(slots * per_slot)
    by_slot = [[ChatStream(run, request) for _ in range(per_slot)] for _ in range(slots)]
    streams = [stream for slot in by_slot for stream in slot]
    started = time.perf_counter()
    try:
        async with asyncio.timeout(config.get("timeout_s", 30.0)), asyncio.TaskGroup() as group:
            for index, slot in enumerate(by_slot):
                delay_s = spread_s * index / slots
                group.create_task(one_slot(run, slot, request, host, port, delay_s))
    except TimeoutError:
        for stream in streams:
            if not stream.ended:
                stream.finish("timeout")
    first: list[float] = []
    max_gap: list[float] = []
    for stream in streams:
        arrivals = stream.arrivals
        if arrivals:
            first.append(arrivals[0] - stream.sent)
        if stream.failure is None and len(arrivals) > 1:
            max_gap.append(max(b - a for a, b in itertools.pairwise(arrivals)))
    return {
        "streams": len(streams),
        "completed": sum(1 for s in streams if s.failure is None and s.ended),
        "failures": dict(run.failures),
        "chunks": sum(len(s.arrivals) for s in streams),
        "first_s": first,
        "max_gap_s": max_gap,
        "span_s": time.perf_counter() - started,
    }


def main() -> None:
    run_from_stdin(load)


if __name__ == "__main__":
    main()
