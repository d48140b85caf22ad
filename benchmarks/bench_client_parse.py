"""How many events per second the load client's whole read path handles on one core.

This script decides only what a fair measurement of the client looks like: a server in a
separate process sends precomputed event streams over loopback, and the client reads them with
``measure_reply``, the same path ``replystream bench`` uses (socket -> transport stamps chunks
-> h11 framing -> SSE parser -> format interpretation -> timings). The figure is events per
second of the client process's CPU time, so it holds for one core whatever else the machine
does; wall-clock events per second are printed too. (``parse_throughput.py`` measures the bare
parser.) It must not know how the client works inside.

Cases:
- bulk lab events: one stream of ``data: "word "`` events sent as fast as the socket takes them;
- bulk OpenAI chunks: the same as ``chat.completion.chunk`` JSON objects;
- paced streams: many concurrent streams, one event every 5 ms each, so most reads carry one
  event (what a live load test sees).

Run: ``python benchmarks/bench_client_parse.py [--events N] [--streams N] [--runs N]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import signal
import statistics
import time
from urllib.parse import parse_qs, urlsplit

from replystream.cli_values import positive_int
from replystream.client import measure_reply
from replystream.sse import encode_data
from tool_main import tool_main

PACE_S = 0.005
_FINAL = b"data: [DONE]\n\n"


def event_bytes(kind: str, i: int) -> bytes:
    word = f"word{i % 100} "
    if kind == "openai":
        chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
        return encode_data(json.dumps(chunk))
    return encode_data(json.dumps(word))


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    target = head.split(" ", 2)[1]
    query = {k: v[0] for k, v in parse_qs(urlsplit(target).query).items()}
    kind, events, paced = query["kind"], int(query["events"]), query.get("paced") == "1"
    frames = [event_bytes(kind, i) for i in range(events)] + [_FINAL]
    length = sum(len(f) for f in frames)
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        + f"Content-Length: {length}\r\nConnection: close\r\n\r\n".encode()
    )
    if paced:
        start = time.perf_counter()
        for i, frame in enumerate(frames):
            writer.write(frame)
            await writer.drain()
            delay = start + (i + 1) * PACE_S - time.perf_counter()
            await asyncio.sleep(max(0.0, delay))
    else:
        writer.write(b"".join(frames))
        await writer.drain()
    writer.close()


def _serve(port_out: multiprocessing.SimpleQueue[int]) -> None:
    # A terminal's Ctrl-C reaches this process too: the measuring one stops it (SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def main() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", 0, backlog=1024)
        port_out.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


async def read_streams(base: str, kind: str, events: int, streams: int, paced: bool) -> int:
    url = f"{base}/s?kind={kind}&events={events}&paced={int(paced)}"
    timings = await asyncio.gather(*(measure_reply(url) for _ in range(streams)))
    bad = [t.error for t in timings if not t.complete]
    if bad:
        raise SystemExit(f"{len(bad)} streams failed: {bad[0]}")
    return sum(len(t.text_event_ms) for t in timings)


def measure(base: str, kind: str, events: int, streams: int, paced: bool) -> tuple[float, float]:
    """(events per CPU second, events per wall second) of one run."""
    cpu, wall = time.process_time(), time.perf_counter()
    got = asyncio.run(read_streams(base, kind, events, streams, paced))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if got != events * streams:
        raise SystemExit(f"read {got} events, expected {events * streams}")
    return got / cpu, got / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--events", type=positive_int, default=100_000, help="events in each bulk stream"
    )
    ap.add_argument("--streams", type=positive_int, default=100, help="concurrent paced streams")
    ap.add_argument(
        "--paced-events", type=positive_int, default=200, help="events per paced stream"
    )
    ap.add_argument("--runs", type=positive_int, default=5)
    args = ap.parse_args()

    spawn = multiprocessing.get_context("spawn")
    ports: multiprocessing.SimpleQueue[int] = spawn.SimpleQueue()
    server = spawn.Process(target=_serve, args=(ports,))
    server.start()
    try:
        base = f"http://127.0.0.1:{ports.get()}"
        cases = [
            ("bulk lab events", "lab", args.events, 1, False),
            ("bulk OpenAI chunks", "openai", args.events, 1, False),
            (
                f"{args.streams} paced streams",
                "lab",
                args.paced_events,
                args.streams,
                True,
            ),
        ]
        print(f"client read path (measure_reply), median of {args.runs} runs")
        for name, kind, events, streams, paced in cases:
            measure(base, kind, min(events, 1000), 1, False)  # warm up code paths
            runs = [measure(base, kind, events, streams, paced) for _ in range(args.runs)]
            cpu_rate = statistics.median(r[0] for r in runs)
            wall_rate = statistics.median(r[1] for r in runs)
            print(
                f"  {name:<22} {cpu_rate:>10,.0f} events per CPU second (one core)"
                f"   {wall_rate:>10,.0f} events/s wall"
            )
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    tool_main(main)
