"""The relay's own work per relayed chunk, apart from its sockets: parse, pipeline, re-encode.

What this file decides: how the per-chunk cost of relaying is split and timed in one process,
with no socket and no other process. The input is one reply as the benchmark's upstream sends
it (``upstream_server.reply_messages``: 100 OpenAI chat chunks, each read as one body chunk).
- ``parse, iterated``: the body chunks handed to ``UpstreamStream`` as its connection hands
  them (``body_data``), then read through its iterator (event parser, chunk JSON, ``Delta``s);
- ``pipeline + encode``: each ``Delta`` through a ``ReplyPipeline`` with the chat dialect
  (``OpenAIStreamFormat``) and written as SSE bytes (``sse_event``), as the chat route does;
- ``attached, all of it``: the relay's HTTP client connection
  (``upstream_http_connection.Connection``) over a stand-in transport (no socket) given the
  response as the upstream writes it (the head, then each chunk in HTTP chunked framing, one
  ``data_received`` each, then the terminator), the stream attached to a sink that does the
  pipeline and encoding: HTTP parse, event parse, pipeline and re-encode, as a served relay
  does them in one call per read.
Reported: microseconds per relayed chunk, the median of several repeats.

Run: python benchmarks/relay/parse_cost.py [--replies 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # run as a script: make the ``relay`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.upstream_server import CHUNKS, reply_messages
from replystream.delivery.openai_formats import OpenAIStreamFormat
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, EngineError
from replystream.engine.upstream_http import HttpOrigin
from replystream.engine.upstream_http_connection import BodyReceiver, Connection, Response
from replystream.engine.upstream_stream import UpstreamStream
from replystream.server.sse_transport import sse_event
from tool_main import tool_main

BODY = reply_messages(CHUNKS, include_usage=True)
UPSTREAM = "http://upstream.invalid/v1"  # the recorded replies' upstream, as their errors name it


class RecordedResponse:
    """The part of an ``upstream_http_connection.Response`` a relayed stream uses (no
    connection)."""

    def set_receiver(self, receiver: BodyReceiver) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def release(self, wait_s: float) -> None:
        pass

    def close(self) -> None:
        pass


async def parse_replies(replies: int) -> tuple[float, list[Delta]]:
    """Seconds to read ``replies`` recorded replies into deltas, and the last reply's deltas."""
    deltas: list[Delta] = []
    started = time.perf_counter()
    for _ in range(replies):
        stream = UpstreamStream(
            cast(Response, RecordedResponse()), name=UPSTREAM, max_event_size=1 << 20
        )
        for piece in BODY:
            stream.body_data(piece)
        stream.body_end(None)
        deltas = [delta async for delta in stream]
    return time.perf_counter() - started, deltas


class StandInTransport(asyncio.Transport):
    """Where the relay's connection writes its request and pauses its reading: nowhere."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # every write went at once

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
FRAMED = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in BODY]
TERMINATOR = b"0\r\n\r\n"


class EncodingSink:
    """A reply's sink reduced to what this measures: the chat pipeline and SSE bytes."""

    def __init__(self, index: int) -> None:
        self.pipeline = ReplyPipeline(
            OpenAIStreamFormat("chat", "bench", 1700000000), DeliveryPolicy()
        )
        self.pipeline.start(f"reply{index}")
        self.events = 0
        self.ended = False

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        now = time.monotonic()
        pipeline = self.pipeline
        for delta in deltas:
            for entry in pipeline.push(delta, now):
                sse_event(entry, True)
                self.events += 1

    def on_end(self, error: EngineError | None) -> None:
        if error is not None:
            raise error
        self.ended = True


async def attached_replies(replies: int) -> float:
    """Seconds to relay ``replies`` recorded replies through attached streams."""
    origin = HttpOrigin(UPSTREAM)
    started = time.perf_counter()
    for index in range(replies):
        connection = Connection(origin)
        connection.connection_made(StandInTransport())
        head = connection.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
        connection.data_received(HEAD)
        stream = UpstreamStream(head.result(), name=UPSTREAM, max_event_size=1 << 20)
        sink = EncodingSink(index)
        stream.attach(sink)
        for framed in FRAMED:
            connection.data_received(framed)  # parsed and delivered in this call
        connection.data_received(TERMINATOR)
        if not sink.ended or sink.events != CHUNKS:
            raise SystemExit(f"attached: {sink.events} text events, ended {sink.ended}")
    return time.perf_counter() - started


def encode_replies(replies: int, deltas: list[Delta]) -> float:
    """Seconds to put ``replies`` replies' deltas through the chat pipeline into SSE bytes."""
    policy = DeliveryPolicy()
    started = time.perf_counter()
    for index in range(replies):
        pipeline = ReplyPipeline(OpenAIStreamFormat("chat", "bench", 1700000000), policy)
        pipeline.start(f"reply{index}")
        now = time.monotonic()
        for delta in deltas:
            for entry in pipeline.push(delta, now):
                sse_event(entry, True)
    return time.perf_counter() - started


def measure(replies: int, repeats: int) -> dict[str, Any]:
    """Median microseconds per relayed chunk of each stage."""
    parse: list[float] = []
    encode: list[float] = []
    attached: list[float] = []
    for _ in range(repeats):
        seconds, deltas = asyncio.run(parse_replies(replies))
        if sum(1 for d in deltas if d.text) != CHUNKS:
            raise SystemExit(f"parsed {len(deltas)} deltas, expected {CHUNKS} with text")
        parse.append(seconds / (replies * CHUNKS) * 1e6)
        encode.append(encode_replies(replies, deltas) / (replies * CHUNKS) * 1e6)
        attached.append(asyncio.run(attached_replies(replies)) / (replies * CHUNKS) * 1e6)
    return {
        "parse_us": statistics.median(parse),
        "encode_us": statistics.median(encode),
        "attached_us": statistics.median(attached),
    }


def report(result: dict[str, Any]) -> str:
    total = result["parse_us"] + result["encode_us"]
    return (
        f"relay work per chunk, no sockets: parse, iterated {result['parse_us']:.1f} µs + "
        f"pipeline and encode {result['encode_us']:.1f} µs = {total:.1f} µs; "
        f"attached, all of it: {result['attached_us']:.1f} µs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.replies < 1 or args.repeats < 1:
        parser.error("--replies and --repeats must be at least 1")
    print(report(measure(args.replies, args.repeats)))


if __name__ == "__main__":
    tool_main(main)
