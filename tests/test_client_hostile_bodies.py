"""The clients against bodies a hostile or odd server sends: a small gzip body that inflates
without end, bodies of several gzip members. Each over a real server on a loopback socket."""

from __future__ import annotations

import asyncio
import gzip
import json
import select
import socket
import threading
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import pytest

from replystream.client import ResumeFailed, ResumingReader, measure_reply
from replystream.client.resume import Backoff
from replystream.client.transport import http_request
from tests.conftest import wait_for

MiB = 1 << 20


def gzip_bomb(block: bytes) -> tuple[bytes, bytes]:
    """A gzip stream of ``block`` without end: its start, then bytes that, sent again and
    again, each inflate to ``block`` once more (zlib's output for a block after the same block
    is the same once the window holds it). The end never comes, so no trailer is needed."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    start = compressor.compress(block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    again = compressor.compress(block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    assert again == compressor.compress(block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    return start, again


@asynccontextmanager
async def body_server(head: bytes, body: Iterable[bytes]) -> AsyncIterator[tuple[str, list[int]]]:
    """A server that answers each request with ``head``, then writes ``body`` piece by piece
    (each drained) until it ends or the client hangs up. Yields its URL and the connections
    it served."""
    served: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(len(served))
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            for piece in body:
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass  # the client hung up, as it should once it has read enough
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served
    finally:
        server.close()
        await server.wait_closed()


def bomb_body(block: bytes, inflated: int) -> Iterable[bytes]:
    """A gzip body that inflates to ``inflated`` bytes of ``block`` (never to its end), in
    writes of about 64 KiB."""
    start, again = gzip_bomb(block)
    batch = again * (64 * 1024 // len(again))
    writes = inflated // (len(block) * (len(batch) // len(again)))
    return [start, *(batch for _ in range(writes))]


def gzip_head(content_type: str) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Encoding: gzip\r\n"
        "X-Reply-Id: R1\r\nConnection: close\r\n\r\n"
    ).encode()


# A mebibyte of comment lines: an event stream that is all keep-alive, as far as it goes.
COMMENTS = (b":" + b" " * (64 * 1024 - 2) + b"\n") * 16


async def test_a_gzip_stream_that_inflates_to_ten_gigabytes_stops_at_the_body_bound():
    # 10 MB of gzip, 10 GiB of comment lines: the read stops at the documented 1 GiB bound,
    # saying so, and never holds more than a few mebibytes at once.
    body = bomb_body(COMMENTS, 10 << 30)
    assert sum(len(piece) for piece in body) < 12_000_000
    async with body_server(gzip_head("text/event-stream"), body) as (url, _):
        tracemalloc.start()
        try:
            timing = await measure_reply(url, timeout_s=120)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not timing.complete
    assert timing.error == (
        "read failed: the body is larger than max_body_size=1073741824 bytes, counted once "
        "its gzip is undone"
    )
    assert timing.body_bytes <= 1 << 30
    assert peak < 64 * MiB, peak


async def test_a_whole_reply_that_inflates_past_its_bound_fails_holding_no_more_than_it():
    body = bomb_body(b"\0" * MiB, 4 << 30)
    async with body_server(gzip_head("application/json"), body) as (url, _):
        tracemalloc.start()
        try:
            timing = await measure_reply(url, max_body_size=16 * MiB)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not timing.complete and timing.error is not None
    assert "max_body_size=16777216 bytes" in timing.error
    assert peak < 48 * MiB, peak


async def test_a_resuming_reader_stops_at_the_body_bound_without_resuming():
    body = bomb_body(COMMENTS, 4 << 30)
    async with body_server(gzip_head("text/event-stream"), body) as (url, served):
        reader = ResumingReader(url, backoff=Backoff(0.001, 0.002, 3), max_body_size=16 * MiB)
        with pytest.raises(ResumeFailed, match=r"longer than this reader takes: .*=16777216"):
            async with asyncio.timeout(60):
                _ = [event async for event in reader.events()]
    assert served == [0] and reader.reconnects == 0


@pytest.mark.parametrize("cut", [-1, 0, 1, None])
async def test_a_gzip_body_of_several_members_is_read_whole(cut: int | None):
    # Each event its own gzip member, as a server that compresses what it flushes may send:
    # the reply goes on past the first member's end, and bytes that are no member after the
    # last are dropped. ``cut``: where the writes split the body, from the second member's
    # start (1: within its magic number).
    events = [b'data: "one "\n\n', b'data: "two"\n\n', b"data: [DONE]\n\n"]
    whole = b"".join(gzip.compress(event) for event in events) + b"\0\0"
    first = len(gzip.compress(events[0]))
    pieces = [whole] if cut is None else [whole[: first + cut], whole[first + cut :]]
    async with body_server(gzip_head("text/event-stream"), pieces) as (url, _):
        timing = await measure_reply(url)
    assert timing.complete, timing.error
    assert timing.text == "one two" and timing.body_bytes == len(b"".join(events))


async def test_a_whole_reply_in_a_gzip_body_of_several_members_is_read_whole():
    reply = json.dumps({"text": "one two"}).encode()
    body = gzip.compress(reply[:5]) + gzip.compress(reply[5:])
    length = b"Content-Length: %d\r\nConnection" % len(body)
    head = gzip_head("application/json").replace(b"Connection", length)
    async with body_server(head, [body]) as (url, _):
        timing = await measure_reply(url)
    assert timing.complete and timing.text == "one two"


class FastSender(threading.Thread):
    """A server in a thread of its own (so the reader's loop cannot slow it): answers one
    request with ``total`` body bytes as fast as the socket takes them. ``blocked`` is set
    once the socket has taken nothing for ``stall_s`` (the reader stopped reading)."""

    def __init__(self, total: int, stall_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.total, self.stall_s = total, stall_s
        self.sent = 0
        self.blocked = threading.Event()
        self.finished = threading.Event()

    def run(self) -> None:
        with self.listener, self.listener.accept()[0] as peer:
            peer.recv(65536)  # the request: one read holds it
            head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.total
            peer.sendall(head)
            peer.setblocking(False)
            block = b"x" * MiB
            while self.sent < self.total:
                if not select.select([], [peer], [], self.stall_s)[1]:
                    self.blocked.set()
                    select.select([], [peer], [], 30)  # until the reader reads again
                    continue
                self.sent += peer.send(block[: self.total - self.sent])
            self.finished.set()


async def test_a_reader_that_falls_behind_holds_a_bounded_part_of_the_body():
    # A server faster than its reader (here: one that reads nothing for a while) once filled
    # the connection's queue with the whole body; reading now stops at 16 MiB held, so the
    # kernel's buffers fill (up to 32 MiB of receive buffer here) and the server waits, and
    # goes on when the reader does.
    sender = FastSender(256 * MiB)
    sender.start()
    async with http_request(sender.url) as response:
        await wait_for(lambda: sender.blocked.is_set() or sender.finished.is_set(), 30)
        assert sender.blocked.is_set() and sender.sent < 128 * MiB, sender.sent
        read = 0
        async for chunk in response:
            read += len(chunk.data)
    assert read == 256 * MiB and sender.finished.is_set()
    sender.join(10)
