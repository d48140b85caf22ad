"""The load client: C streams opened at once, every token's arrival stamped, in its own process.

What this file decides: how a run is driven and summarised, and how an SSE stream is read and
timed (a WebSocket stream is ``wsclient.WsStream``). It is built to cost less CPU per event
than any server it measures, so it does not parse events. Each connection is an asyncio
``Protocol`` that writes pre-built request bytes, finds the end of the response head, then
counts ``event: token`` markers with a byte search (keeping the last bytes of each read so a
marker split across two reads is counted once) and stamps arrivals in ``data_received``, the
moment the event loop hands the bytes over. Everything else (lateness against the schedule,
percentiles) is computed after the run, outside the measured CPU time.

Run: python benchmarks/delivery/loadclient.py < config.json > result.json, where the config
is ``{"url": ..., "transport": "sse" | "ws", "seeds": [...], "max_tokens": null,
"timeout_s": 60}``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from clientstream import Run, Stream
from procstats import raise_nofile
from workload import (
    DONE_MARKER,
    TOKEN_MARKER,
    TOKENS,
    WS_PATH,
    WS_TAG,
    request_body,
    schedule,
    ws_reply_message,
)
from wsclient import WsStream, upgrade_request

from replystream.stats import percentile

TAIL = len(TOKEN_MARKER) - 1  # enough to complete a split marker, too short to hold a whole one
RETRY_ERRNOS = {errno.ECONNREFUSED, errno.EAGAIN, errno.ECONNRESET}
MAX_CONNECT_ATTEMPTS = 12


class SseStream(Stream):
    """One reply over SSE: sends its request on connect, counts and stamps token events."""

    def __init__(self, run: Run, request: bytes) -> None:
        super().__init__(run)
        self.request = request
        self.head = b""
        self.tail = b""

    def transport_ready(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.ended:
            return  # a failed stream being closed, or the chunked ending after done
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.head[: self.head.find(b"\r\n")]
            if not status.startswith(b"HTTP/1.1 200"):
                self.finish(f"status {status[9:12].decode(errors='replace')}")
                return
            self.opened()
            data = self.head[end + 4 :]
            self.head = b""
        chunk = self.tail + data
        found = chunk.count(TOKEN_MARKER)
        if found:
            self.arrivals.extend([now] * found)
        if DONE_MARKER in chunk:
            self.done_at = now
            self.finish(None)
        self.tail = chunk[-TAIL:]


async def connect(run: Run, stream: Stream, host: str, port: int) -> None:
    """Open the stream's connection, retrying refused or busy connects with a short backoff."""
    loop = asyncio.get_running_loop()
    for attempt in range(MAX_CONNECT_ATTEMPTS):
        try:
            await loop.create_connection(lambda: stream, host, port)
            return
        except OSError as error:
            if error.errno not in RETRY_ERRNOS or attempt == MAX_CONNECT_ATTEMPTS - 1:
                stream.ended = True
                stream.failure = f"connect: {error.strerror or error!r}"
                run.failures[stream.failure] += 1
                run.end()
                return
            run.retries += 1
            await asyncio.sleep(min(0.02 * 2**attempt, 1.0))


def request_bytes(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def load(config: dict[str, Any]) -> dict[str, Any]:
    """Run every stream of ``config`` at once; return the run's measurements."""
    url = urlsplit(config["url"])
    host, port = url.hostname or "127.0.0.1", url.port or 80
    seeds: list[int] = config["seeds"]
    max_tokens: int | None = config.get("max_tokens")
    run = Run(len(seeds))
    streams: list[Stream]
    if config.get("transport", "sse") == "ws":
        # The same seeds and fields as the SSE request, one reply per socket.
        streams = [
            WsStream(
                run,
                upgrade_request(host, port, WS_PATH),
                ws_reply_message(WS_TAG, seed, max_tokens),
            )
            for seed in seeds
        ]
    else:
        path = "/v1/replies"
        streams = [
            SseStream(run, request_bytes(host, port, path, request_body(seed, max_tokens)))
            for seed in seeds
        ]
    cpu_before = time.process_time()
    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for stream in streams:
            group.create_task(connect(run, stream, host, port))
    try:
        async with asyncio.timeout(config.get("timeout_s", 60.0)):
            await run.all_ended.wait()
    except TimeoutError:
        for stream in streams:
            if not stream.ended:
                stream.finish("timeout")
    ended = time.perf_counter()
    client_cpu = time.process_time() - cpu_before
    return summarize(config, run, streams, started, ended, client_cpu)


def summarize(
    config: dict[str, Any],
    run: Run,
    streams: list[Stream],
    started: float,
    ended: float,
    client_cpu: float,
) -> dict[str, Any]:
    tokens = TOKENS if config.get("max_tokens") is None else config["max_tokens"]
    events = sum(len(s.arrivals) for s in streams)
    completion: list[float] = []
    ideal: list[float] = []
    overrun: list[float] = []
    lateness: list[float] = []
    first_text: list[float] = []
    # Over a WebSocket, from the connection to the reply message written after the upgrade.
    ws = config.get("transport", "sse") == "ws"
    upgrade = [s.sent - s.connected for s in streams if s.in_body] if ws else []
    for seed, stream in zip(config["seeds"], streams, strict=True):
        due = schedule(seed, tokens)
        if stream.arrivals:
            first_text.append(stream.arrivals[0] - stream.sent)
        lateness.extend(
            arrived - stream.sent - at for arrived, at in zip(stream.arrivals, due, strict=False)
        )
        if stream.failure is None and stream.ended:
            completion.append(stream.done_at - stream.sent)
            ideal.append(due[-1])
            overrun.append(stream.done_at - stream.sent - due[-1])
    last_done = max((s.done_at for s in streams if s.failure is None), default=ended)
    span = max(last_done - started, 1e-9)
    lateness.sort()
    ms = 1000.0
    return {
        "streams": len(streams),
        "completed": len(completion),
        "failed": sum(run.failures.values()),
        "failures": dict(run.failures),
        "connect_retries": run.retries,
        "events": events,
        "events_per_s": events / span,
        "span_s": span,
        "completion_ms": {
            "p50": percentile(completion, 50) * ms,
            "p95": percentile(completion, 95) * ms,
        },
        "ideal_ms": {"p50": percentile(ideal, 50) * ms, "p95": percentile(ideal, 95) * ms},
        "overrun_ms": {"p50": percentile(overrun, 50) * ms, "p95": percentile(overrun, 95) * ms},
        "lateness_ms": {
            p: percentile(lateness, q) * ms for p, q in (("p50", 50), ("p95", 95), ("p99", 99))
        },
        "first_text_ms": {
            "p50": percentile(first_text, 50) * ms,
            "p95": percentile(first_text, 95) * ms,
        },
        "upgrade_ms": {"p50": percentile(upgrade, 50) * ms, "p95": percentile(upgrade, 95) * ms},
        "peak_open": run.peak_open,
        "client_cpu_s": client_cpu,
        "client_us_per_event": client_cpu / events * 1e6 if events else math.nan,
        "client_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
    }


def run_from_stdin(run: Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]) -> None:
    """A load client process: its config as JSON on stdin, ``run``'s result as JSON on
    stdout, on uvloop when it is installed (the client must cost less than the server)."""
    raise_nofile()
    config = json.load(sys.stdin)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(config))
    else:
        result = uvloop.run(run(config))
    json.dump(result, sys.stdout)


def main() -> None:
    run_from_stdin(load)


if __name__ == "__main__":
    main()
