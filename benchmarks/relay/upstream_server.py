"""A fast OpenAI-compatible upstream for the relay benchmark: every reply on a fixed schedule.

What this file decides: the one reply every streamed ``POST /v1/chat/completions`` gets
(``CHUNKS`` content chunks ``INTERVAL_MS`` apart, the first with the response head or, with
``--first-chunk-ms``, that long after it, as a model's prefill keeps it;
then a finish chunk, a usage chunk when ``stream_options.include_usage`` asked for one, and
``data: [DONE]``), and how it is sent cheaply enough never to be what a run measures: raw
HTTP/1.1 on an asyncio ``Protocol`` (keep-alive, chunked bodies), every frame built once at
start-up, and one shared 1 ms timer wheel that writes every due chunk of every stream (no task
per stream). ``GET /v1/models`` lists the one model. Each content chunk's text holds
``MARKER`` once, so a client counts chunks with a byte search whatever relay re-encoded them.
With ``--processes N`` the listening socket is shared by N forked processes.

Run: python benchmarks/relay/upstream_server.py [--port 0] [--processes 1]
         [--chunks 100] [--interval-ms 20] [--first-chunk-ms 0]
It prints ``listening on http://127.0.0.1:PORT`` once every process accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from collections import defaultdict

CHUNKS = 100
INTERVAL_MS = 20.0
MODEL = "bench"
MARKER = b"zq"  # in every content chunk's text, and in nothing else any relay writes
WHEEL_S = 0.001
COMPLETION_ID = "chatcmpl-bench"


def chunk_payload(choices: list[dict[str, object]], **extra: object) -> bytes:
    """One ``data:`` message of a chat-completion stream, as vLLM writes it."""
    payload = {
        "id": COMPLETION_ID,
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def text_of(index: int) -> str:
    return f"zq{index} "


def reply_messages(chunks: int, include_usage: bool) -> list[bytes]:
    """The SSE messages of one reply (the body, unframed): what a relay reads upstream."""
    messages = []
    for index in range(chunks):
        delta: dict[str, object] = {"content": text_of(index)}
        if index == 0:
            delta = {"role": "assistant", **delta}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        messages.append(chunk_payload([choice]))
    finish = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    tail = chunk_payload([finish])
    if include_usage:
        usage = {"prompt_tokens": 5, "completion_tokens": chunks, "total_tokens": chunks + 5}
        tail += chunk_payload([], usage=usage)
    tail += b"data: [DONE]\n\n"
    messages[-1] += tail
    return messages


def framed(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
)


class Reply:
    """A reply's prebuilt frames: frame i is sent at i intervals after the request."""

    def __init__(self, chunks: int, include_usage: bool) -> None:
        self.frames = [framed(m) for m in reply_messages(chunks, include_usage)]
        self.frames[-1] += b"0\r\n\r\n"


class Wheel:
    """One timer for every stream of this process: each tick writes every frame that is due."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.slots: defaultdict[int, list[Stream]] = defaultdict(list)
        self.handle: asyncio.TimerHandle | None = None

    def add(self, stream: Stream, due: float) -> None:
        slot = int(due / WHEEL_S) + 1
        self.slots[slot].append(stream)
        if self.handle is None:
            self.handle = asyncio.get_running_loop().call_at(slot * WHEEL_S, self.tick)

    def tick(self) -> None:
        loop = asyncio.get_running_loop()
        now_slot = int(loop.time() / WHEEL_S)
        slots = self.slots
        # Every slot due by now, those the sends add included: a stream behind its schedule
        # (an interval no longer than a slot, or a late tick) adds its next frame to a slot
        # already due, which must be written now, not left behind the ticks to come.
        while slots:
            slot = min(slots)
            if slot > now_slot:
                break
            for stream in slots.pop(slot):
                stream.send_next()
        self.handle = loop.call_at(min(slots) * WHEEL_S, self.tick) if slots else None


class Stream(asyncio.Protocol):
    """One connection: reads requests one after another, streams each reply on the wheel."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.frames: list[bytes] = []
        self.sent = 0
        self.started = 0.0
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # A reply's head and first chunk are two writes; with Nagle's algorithm on, the second
        # waits for the client's delayed ACK (40 ms). asyncio turns it off only for sockets
        # whose ``proto`` says TCP, which this listener's (made with proto 0) does not on
        # every Python (3.12 left it on, a kept-alive connection's replies 40 ms late).
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.frames = []

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.frames:
            self.next_request()

    def next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1")
        lines = head.split("\r\n")
        method, path, version = lines[0].split(" ", 2)
        fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(fields.get("content-length", "0"))
        if len(self.buffer) < end + 4 + length:
            return
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        connection = fields.get("connection", "").lower()
        self.keep_alive = connection != "close" and version == "HTTP/1.1"
        assert self.transport is not None
        if method == "GET" and path.rstrip("/").endswith("/models"):
            self.answer(json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif method == "POST" and path.endswith("/chat/completions"):
            request = json.loads(body or b"{}")
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            if not request.get("stream"):
                self.answer(json.dumps({"error": {"message": "this upstream only streams"}}), 400)
                return
            self.frames = self.server.replies[include_usage].frames
            self.sent = 0
            self.started = asyncio.get_running_loop().time()
            self.transport.write(HEAD + self.close_header() + b"\r\n")
            if self.server.first_s:
                self.server.wheel.add(self, self.started + self.server.first_s)
            else:
                self.send_next()
        else:
            self.answer(json.dumps({"error": {"message": "not found"}}), 404)

    def close_header(self) -> bytes:
        return b"" if self.keep_alive else b"Connection: close\r\n"

    def answer(self, text: str, status: int = 200) -> None:
        assert self.transport is not None
        body = text.encode()
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}[status]
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, reason, len(body), self.close_header(), body)
        )
        self.after_reply()

    def after_reply(self) -> None:
        if self.transport is None:
            return
        if not self.keep_alive:
            self.transport.close()
        elif self.buffer:
            self.next_request()

    def send_next(self) -> None:
        if self.transport is None or not self.frames:
            return
        self.transport.write(self.frames[self.sent])
        self.sent += 1
        if self.sent == len(self.frames):
            self.frames = []
            self.after_reply()
        else:
            server = self.server
            server.wheel.add(self, self.started + server.first_s + self.sent * server.interval_s)


class Server:
    def __init__(self, chunks: int, interval_s: float, first_s: float) -> None:
        self.interval_s = interval_s
        self.first_s = first_s  # from the response head to the first chunk
        self.replies = {usage: Reply(chunks, usage) for usage in (False, True)}
        self.wheel = Wheel(interval_s)


async def serve(sock: socket.socket, chunks: int, interval_s: float, first_s: float) -> None:
    server = Server(chunks, interval_s, first_s)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: Stream(server), sock=sock, backlog=4096)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with listener:
        await stop.wait()


def run_loop(sock: socket.socket, chunks: int, interval_s: float, first_s: float) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(sock, chunks, interval_s, first_s))
    else:
        uvloop.run(serve(sock, chunks, interval_s, first_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=CHUNKS)
    parser.add_argument("--interval-ms", type=float, default=INTERVAL_MS)
    parser.add_argument(
        "--first-chunk-ms",
        type=float,
        default=0.0,
        help="from the response head to the first chunk (default 0: the first comes with it)",
    )
    args = parser.parse_args()
    # Checked by hand: a peer measured against replystream loads none of its code.
    if not 0 <= args.port <= 65535:
        parser.error(
            f"argument --port: want a port from 0 to 65535 (0 picks a free one), got {args.port}"
        )
    if args.processes < 1 or args.chunks < 1 or args.interval_ms <= 0:
        parser.error("--processes and --chunks must be at least 1, --interval-ms positive")
    if args.first_chunk_ms < 0:
        parser.error("--first-chunk-ms must not be negative")
    schedule = (args.chunks, args.interval_ms / 1000, args.first_chunk_ms / 1000)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(4096)
    sock.setblocking(False)
    children = []
    for _ in range(args.processes - 1):
        pid = os.fork()
        if pid == 0:
            run_loop(sock, *schedule)
            os._exit(0)
        children.append(pid)

    def stop_children(*_: object) -> None:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop_children)
    port = sock.getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    run_loop(sock, *schedule)
    stop_children()


if __name__ == "__main__":
    main()
