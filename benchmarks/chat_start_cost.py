"""What one streamed chat completion costs the server to start, at zero load: CPU per request
and time to the first token, relayed and simulated, on new and kept-alive connections.

At C = 500 a relay starts about 250 requests a second; what each start costs (accept, parse,
validate, start the engine, headers, the end, close) then takes a large share of the core,
and it is what a lone request waits for before its first token. This measures it alone:
one client sends N ``POST /v1/chat/completions`` (``stream: true``, one content chunk per
reply) one after another, reading each to ``[DONE]``, to each target in turn:
- ``upstream``: the relay benchmark's upstream (``relay/upstream_server.py --chunks 1``)
  answering directly: the peer every figure is set against, measured in the same round;
- ``bare aiohttp``: the least aiohttp does for such a request (this file's ``--bare-server``:
  parse the body, three writes as replystream makes them): what is aiohttp's, not ours;
- ``relay``: ``replystream serve --engine upstream:URL`` in front of it;
- ``simulated``: ``replystream serve --engine simulated`` with a one-token, no-delay reply.
Each in two modes: ``new`` (a new connection per request, as the relay benchmark's client
makes) and ``keepalive`` (one connection for the whole run). Per target and mode: the
target process's CPU (user + system, /proc) per request, and the client-seen time to the
first content chunk (p50), medians over the rounds; the ratios against the upstream's own
figures. ``--src LABEL=PATH`` (repeatable) runs replystream's processes from each source
tree (``PYTHONPATH=PATH``), interleaved round by round, so two versions are compared under
the same noise. ``--pause-ms`` (one table per value) makes the client wait that long before
each request, so that every target meets each request after being idle that long, as a
server of sparse requests does (its CPU figure then includes what it spends idle: timers).
(``benchmarks/delivery/start_cost.py`` measures a burst of native replies.)

Run: python benchmarks/chat_start_cost.py [-N 1000] [--rounds 3] [--pause-ms 0 20 ...]
         [--src before=/path/src ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from replystream.cli_values import non_negative_float, positive_int
from replystream.lab.local_server import READY as SERVE_READY
from replystream.lab.local_server import announced_process
from source_trees import source_trees
from tool_main import tool_main

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "relay" / "upstream_server.py"
UPSTREAM_READY = re.compile(r"listening on (http://\S+)")
# The first content chunk: the upstream's text is "zq0 ", the simulated engine's "zq0".
CONTENT = re.compile(rb'"content":\s*"zq')
BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hello"}], "stream": True}
).encode()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MODES = ("new", "keepalive")
SIMULATED = ["--engine", "simulated", "--reply-text", "zq0", "--tokens", "1"]
SIMULATED += ["--delay-ms", "0", "--jitter-ms", "0"]


def bare_event(seq: int, payload: object) -> bytes:
    return f"id: {seq}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def bare_chat(request: web.Request) -> web.StreamResponse:
    """The least aiohttp can do for one of these requests: parse the body, then the three
    writes replystream makes (headers with the role chunk, the content chunk, the finish
    chunk with ``[DONE]`` and the body's end)."""
    body = json.loads(await request.read())
    chunk = {"id": "chatcmpl-bare", "object": "chat.completion.chunk", "model": body["model"]}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    role = {"role": "assistant", "content": ""}
    await response.write(bare_event(1, {**chunk, "choices": [{"index": 0, "delta": role}]}))
    content = {"content": "zq0"}
    await response.write(bare_event(2, {**chunk, "choices": [{"index": 0, "delta": content}]}))
    finish = {"index": 0, "delta": {}, "finish_reason": "stop"}
    await response.write_eof(
        bare_event(3, {**chunk, "choices": [finish]}) + b"id: 4\ndata: [DONE]\n\n"
    )
    return response


def serve_bare() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", bare_chat)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None)


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    host: str
    port: int
    pid: int


def cpu_seconds(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def request_bytes(host: str, port: int) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    )
    return head.encode() + BODY


def one_request(sock: socket.socket, request: bytes) -> float:
    """Send one request on ``sock``; read its stream to the end. Seconds to first content."""
    sent = time.perf_counter()
    sock.sendall(request)
    buffer = b""
    first = None
    while True:
        data = sock.recv(65536)
        if not data:
            raise RuntimeError(f"the server closed the connection mid-reply: {buffer[-200:]!r}")
        buffer += data
        if first is None and CONTENT.search(buffer):
            first = time.perf_counter() - sent
        if buffer.endswith(b"0\r\n\r\n") and b"data: [DONE]" in buffer:
            break
    if first is None or not buffer.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"not a streamed reply with content: {buffer[:300]!r}")
    return first


def run(target: Target, mode: str, requests: int, pause_s: float = 0.0) -> tuple[float, float]:
    """``requests`` sequential requests, ``pause_s`` before each: CPU µs per request, first
    content p50 in ms."""
    request = request_bytes(target.host, target.port)
    address = (target.host, target.port)
    firsts = []
    kept = socket.create_connection(address) if mode == "keepalive" else None
    before = cpu_seconds(target.pid)
    try:
        for _ in range(requests):
            if pause_s:
                time.sleep(pause_s)
            if kept is not None:
                firsts.append(one_request(kept, request))
                continue
            with socket.create_connection(address) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                firsts.append(one_request(sock, request))
        time.sleep(0.05)  # the server's last steps after the client saw [DONE]
    finally:
        if kept is not None:
            kept.close()
    cpu = cpu_seconds(target.pid) - before
    return cpu / requests * 1e6, statistics.median(firsts) * 1e3


@contextlib.asynccontextmanager
async def started(name: str, command: list[str], ready: re.Pattern[str]) -> AsyncIterator[Target]:
    async with announced_process(command, ready, name=name) as server:
        url = urlsplit(server.url)
        assert url.hostname is not None and url.port is not None
        yield Target(name, url.hostname, url.port, server.pid)


def serve_command(src: str | None, args: list[str]) -> list[str]:
    # ``env`` executes the server in its own place: the pid is the server's.
    env = ["env", f"PYTHONPATH={src}"] if src else []
    serve = [sys.executable, "-m", "replystream", "serve", "--host", "127.0.0.1", "--port", "0"]
    return [*env, *serve, *args, "--model-name", "bench", "--log-level", "WARNING"]


async def main(args: argparse.Namespace) -> None:
    sources: list[tuple[str, str | None]] = [
        (label, path) for label, _, path in (s.partition("=") for s in args.src)
    ] or [("", None)]
    async with contextlib.AsyncExitStack() as stack:
        upstream_command = [sys.executable, str(UPSTREAM), "--port", "0", "--chunks", "1"]
        upstream = await stack.enter_async_context(
            started("upstream", upstream_command, UPSTREAM_READY)
        )
        bare_command = [sys.executable, str(HERE / "chat_start_cost.py"), "--bare-server"]
        bare = await stack.enter_async_context(
            started("bare aiohttp", bare_command, UPSTREAM_READY)
        )
        targets = [upstream, bare]
        upstream_url = f"http://{upstream.host}:{upstream.port}/v1"
        relay_args = ["--engine", f"upstream:{upstream_url}", "--upstream-model", "bench"]
        for label, src in sources:
            prefix = f"{label} " if label else ""
            for name, engine in (("relay", relay_args), ("simulated", SIMULATED)):
                command = serve_command(src, engine)
                targets.append(
                    await stack.enter_async_context(started(prefix + name, command, SERVE_READY))
                )
        for target in targets:  # warm-up: imports, caches, the relay's upstream connections
            for mode in MODES:
                await asyncio.to_thread(run, target, mode, 30)
        results: dict[tuple[float, str, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for pause_ms in args.pause_ms:
                for mode in MODES:
                    for target in targets:
                        figures = await asyncio.to_thread(
                            run, target, mode, args.requests, pause_ms / 1000
                        )
                        results.setdefault((pause_ms, target.name, mode), []).append(figures)
    print(f"{args.requests} sequential one-chunk streamed chat completions per run, ", end="")
    print(f"median of {args.rounds} rounds")
    for pause_ms in args.pause_ms:
        if len(args.pause_ms) > 1 or pause_ms:
            print(f"each request after {pause_ms:g} ms idle")
        table(targets, {(t, m): r for (p, t, m), r in results.items() if p == pause_ms})
    print(f"(CPU is read in 10 ms clock ticks: about {1e4 / args.requests:.0f} µs per request)")


def table(targets: list[Target], results: dict[tuple[str, str], list[tuple[float, float]]]) -> None:
    print(f"{'target':>20} {'mode':>9} {'CPU µs/req':>11} {'x upstream':>11} ", end="")
    print(f"{'TTFT p50 ms':>12} {'added ms':>9}")
    for mode in MODES:
        peer_cpu = statistics.median(r[0] for r in results[("upstream", mode)])
        peer_first = statistics.median(r[1] for r in results[("upstream", mode)])
        for target in targets:
            rounds = results[(target.name, mode)]
            cpu = statistics.median(r[0] for r in rounds)
            first = statistics.median(r[1] for r in rounds)
            print(
                f"{target.name:>20} {mode:>9} {cpu:11.0f} {ratio(cpu, peer_cpu):>11} "
                f"{first:12.3f} {first - peer_first:9.3f}"
            )


def ratio(value: float, peer: float) -> str:
    return f"{value / peer:.1f}" if peer > 0 else "-"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-N", "--requests", type=positive_int, default=1000)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument(
        "--pause-ms",
        type=non_negative_float,
        nargs="+",
        default=[0.0],
        help="the client's pause before each request (one table per value; default 0)",
    )
    parser.add_argument(
        "--src",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="run replystream from this source tree (repeatable; default: as installed)",
    )
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    source_trees(parser, args.src)
    return args


def cli() -> None:
    arguments = parse_args()
    if arguments.bare_server:
        serve_bare()
    else:
        asyncio.run(main(arguments))


if __name__ == "__main__":
    tool_main(cli)
