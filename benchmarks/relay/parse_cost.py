"""The relay's own work per relayed chunk, apart from its sockets: parse, pipeline, re-encode.

What this file decides: how the per-chunk cost of relaying is split and timed in one process,
with no socket and no other process. The input is one reply as the benchmark's upstream sends
it (``upstream_server.reply_messages``: 100 OpenAI chat chunks, each read as one body chunk).
- ``parse, iterated``: the body chunks through ``UpstreamStream``'s iterator (event parser,
  chunk JSON, ``Delta``s) from a response object that hands the recorded chunks over at
  once, as a producer task reads them (no socket, no waiting);
- ``pipeline + encode``: each ``Delta`` through a ``ReplyPipeline`` with the chat dialect
  (``OpenAIStreamFormat``) and written as SSE bytes (``sse_event``), as the chat route does;
- ``attached, all of it``: the stream attached to a sink that does the pipeline and encoding,
  each chunk fed to aiohttp's own body reader (``aiohttp.StreamReader.feed_data``) as the
  connection's parser feeds it, then one turn of the loop (where woken streams are read):
  parse, pipeline and re-encode, as a served relay does them.
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

import aiohttp

from relay.upstream_server import CHUNKS, reply_messages
from replystream.delivery.openai_formats import OpenAIStreamFormat
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, EngineError
from replystream.engine.upstream_stream import UpstreamStream
from replystream.server.sse_transport import sse_event

BODY = reply_messages(CHUNKS, include_usage=True)


class RecordedBody:
    """``response.content``: the recorded body chunks, one per read, then the end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = iter(chunks)
        self._eof = False

    async def readany(self) -> bytes:
        chunk = next(self._chunks, b"")
        self._eof = not chunk
        return chunk

    def is_eof(self) -> bool:
        return self._eof


class RecordedResponse:
    """The part of an ``aiohttp.ClientResponse`` a relayed stream reads."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.content: Any = RecordedBody(chunks)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


async def parse_replies(replies: int) -> tuple[float, list[Delta]]:
    """Seconds to read ``replies`` recorded replies into deltas, and the last reply's deltas."""
    deltas: list[Delta] = []
    started = time.perf_counter()
    for _ in range(replies):
        response = cast(aiohttp.ClientResponse, RecordedResponse(BODY))
        stream = UpstreamStream(response, stall_s=60.0, max_event_size=1 << 20)
        deltas = [delta async for delta in stream]
    return time.perf_counter() - started, deltas


class NoSocket:
    """The connection protocol an ``aiohttp.StreamReader`` pauses and resumes (none here)."""

    _reading_paused = False  # as aiohttp's protocols say it (read by an attached stream)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


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
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    for index in range(replies):
        response = RecordedResponse([])
        reader = aiohttp.StreamReader(cast(Any, NoSocket()), 1 << 16, loop=loop)
        response.content = cast(Any, reader)
        stream = UpstreamStream(
            cast(aiohttp.ClientResponse, response), stall_s=60.0, max_event_size=1 << 20
        )
        sink = EncodingSink(index)
        stream.attach(sink)
        for chunk in BODY:
            reader.feed_data(chunk)
            await asyncio.sleep(0)  # woken streams are read once per loop turn
        reader.feed_eof()
        await asyncio.sleep(0)
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
    print(report(measure(args.replies, args.repeats)))


if __name__ == "__main__":
    main()
