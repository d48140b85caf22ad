"""What reading an upstream's embeddings answer costs the relay: its time, the longest it
holds the event loop, and the memory it takes, against a full parse and rewrite.

The relay checks an answer and names it as the client asked (``engine.embeddings_answer``:
in slices, the loop turning between them). The peer, measured side by side on the same
bytes, is the full parse: the answer made Python objects (``pydantic_core.from_json``, the
fastest parser at hand), checked, renamed and written again (``to_json``), the way the relay
read answers before and the way a relay that parses JSON does. Answers as OpenAI's shape
has them, for ``--inputs`` inputs of ``--dims`` numbers each: as JSON numbers, and as base64
(the OpenAI SDK's default). For each: the median time of ``--repeats`` reads, the longest
stretch without a turn of the loop (a task on the same loop timing its turns), and the peak
of memory allocated while reading (``tracemalloc``, in a read of its own).

``--through-relay`` measures the whole way instead: a relay (``UpstreamEngine`` behind our
app, on this process's loop, ``--loop``) between an upstream serving the answer of numbers
and a client reading it, each a process of its own; per read, the longest turn of the relay's
loop while the answer goes through it (its read, its check, its write to the client) and the
client's time to the whole answer (``--accept-encoding gzip``: gzipped on the way, as the
OpenAI SDK asks), the relay as it is against one whose check is the full parse, alternated.

Run: python benchmarks/relay/embeddings_answer.py [--inputs 256 2048] [--dims 1536] [--repeats 5]
         [--through-relay [--loop uvloop|asyncio] [--accept-encoding gzip]]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import statistics
import struct
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the relay benchmark's modules
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop
from aiohttp import web
from pydantic_core import from_json, to_json

from relay.relays import free_port, wait_http
from replystream.cli_values import positive_int
from replystream.engine import upstream_embeddings
from replystream.engine.base import Embeddings
from replystream.engine.embeddings_answer import checked_answer
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.lab.local_server import owned_child
from replystream.server import create_app, running
from tool_main import tool_main

Reader = Callable[[bytes], Awaitable[object]]


async def relayed(raw: bytes) -> object:
    answer = await checked_answer(raw, "asked")
    assert answer is not None
    return answer


async def parsed_whole(raw: bytes) -> object:
    return await parsed_whole_as(raw, "asked")


async def parsed_whole_as(raw: bytes, answer_as: str) -> Embeddings | None:
    """The peer: the answer made Python objects, checked, renamed and written again."""
    answer = from_json(raw)
    data = answer["data"]
    assert all(isinstance(item.get("embedding"), list | str) for item in data)
    answer["model"] = answer_as
    return Embeddings(to_json(answer), answer["usage"]["prompt_tokens"])


def answer_of(inputs: int, dims: int, packed: bool) -> bytes:
    rng = random.Random(7)
    items = []
    for index in range(inputs):
        numbers = [rng.uniform(-0.1, 0.1) for _ in range(dims)]
        embedding = (
            base64.b64encode(struct.pack(f"<{dims}f", *numbers)).decode() if packed else numbers
        )
        items.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = {"prompt_tokens": inputs, "total_tokens": inputs}
    return to_json({"object": "list", "data": items, "model": "m", "usage": usage})


async def timed(read: Reader, raw: bytes) -> tuple[float, float]:
    """Seconds to read ``raw``, and the longest the loop went without a turn meanwhile."""
    began = time.perf_counter()
    held = await held_while(read(raw))
    return time.perf_counter() - began, held


async def peak_bytes(read: Reader, raw: bytes) -> int:
    tracemalloc.start()
    try:
        await read(raw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def main(args: argparse.Namespace) -> None:
    readers: dict[str, Reader] = {"replystream": relayed, "full parse": parsed_whole}
    print(f"{'answer':>26} {'reader':>12} {'time ms':>9} {'loop held ms':>13} {'peak MB':>8}")
    for inputs in args.inputs:
        for packed in (False, True):
            raw = answer_of(inputs, args.dims, packed)
            label = f"{inputs} x {args.dims} {'base64' if packed else 'numbers'}"
            label += f" {len(raw) / 1e6:.1f} MB"
            figures: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
            for _ in range(args.repeats):  # the two alternated, so that noise falls on both
                for name, read in readers.items():
                    figures[name].append(await timed(read, raw))
            for name, read in readers.items():
                took = statistics.median(t for t, _ in figures[name]) * 1000
                held = statistics.median(h for _, h in figures[name]) * 1000
                peak = await peak_bytes(read, raw) / 1e6
                print(f"{label:>26} {name:>12} {took:9.1f} {held:13.1f} {peak:8.1f}")


CLIENT = """
import json, sys, time, urllib.request
url, inputs, accept = sys.argv[1], int(sys.argv[2]), sys.argv[3]
body = json.dumps({"model": "e", "input": ["x"] * inputs, "encoding_format": "float"}).encode()
headers = {"Content-Type": "application/json", "Accept-Encoding": accept}
began = time.perf_counter()
answer = urllib.request.urlopen(urllib.request.Request(url, body, headers)).read()
print(time.perf_counter() - began, len(answer))
"""


def serve_answer(port: int, inputs: int, dims: int) -> None:
    """The upstream of ``--through-relay``: the one answer, to every embeddings request."""
    answer = answer_of(inputs, dims, packed=False)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "e"}]})

    async def embeddings(_: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/embeddings", embeddings)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def held_while(relayed: Awaitable[object]) -> float:
    """The longest turn of this loop, in seconds, while ``relayed`` runs."""
    held, watching = 0.0, True

    async def watch() -> None:
        nonlocal held
        while watching:
            began = time.perf_counter()
            await asyncio.sleep(0)
            held = max(held, time.perf_counter() - began)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)  # the watcher's clock runs before ``relayed`` does
    try:
        await relayed
    finally:
        watching = False
        await watcher
    return held


async def through_relay(args: argparse.Namespace) -> None:
    checks = {"replystream": checked_answer, "full parse": parsed_whole_as}
    for inputs in args.inputs:
        port = free_port()
        serve = [sys.executable, __file__, "--serve-answer", str(port), str(inputs)]
        upstream = await asyncio.create_subprocess_exec(
            *serve, "--dims", str(args.dims), **owned_child()
        )
        try:
            await wait_http(f"http://127.0.0.1:{port}/v1/models", 60.0, upstream)
            engine = UpstreamEngine(
                UpstreamConfig((UpstreamTarget(f"http://127.0.0.1:{port}/v1"),))
            )
            async with running(create_app(engine)) as url:
                held: dict[str, list[float]] = {name: [] for name in checks}
                took: dict[str, list[float]] = {name: [] for name in checks}
                for _ in range(args.repeats):
                    for name, check in checks.items():
                        upstream_embeddings.checked_answer = check  # type: ignore[attr-defined]
                        client = await asyncio.create_subprocess_exec(
                            sys.executable,
                            "-c",
                            CLIENT,
                            f"{url}/v1/embeddings",
                            str(inputs),
                            args.accept_encoding,
                            stdout=asyncio.subprocess.PIPE,
                            **owned_child(),
                        )
                        answered = asyncio.ensure_future(client.communicate())
                        held[name].append(await held_while(answered))
                        if client.returncode != 0:
                            raise RuntimeError("the client's request failed")
                        took[name].append(float(answered.result()[0].split()[0]))
        finally:
            upstream_embeddings.checked_answer = checked_answer  # type: ignore[attr-defined]
            upstream.kill()
            await upstream.wait()
        for name, stretches in held.items():
            longest = statistics.median(stretches) * 1000
            answer_s = statistics.median(took[name])
            print(
                f"{inputs} x {args.dims} numbers through the relay ({args.loop}, "
                f"Accept-Encoding: {args.accept_encoding}), {name}: longest turn of its loop "
                f"{longest:.1f} ms, the client's whole answer in {answer_s * 1000:.0f} ms "
                f"(medians of {args.repeats})"
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=positive_int, nargs="+", default=[256, 2048])
    parser.add_argument("--dims", type=positive_int, default=1536)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--through-relay", action="store_true")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument(
        "--accept-encoding",
        default="identity",
        help="the client's Accept-Encoding through the relay (gzip: as the OpenAI SDK asks)",
    )
    parser.add_argument("--serve-answer", type=int, nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_answer:
        serve_answer(arguments.serve_answer[0], arguments.serve_answer[1], arguments.dims)
    elif arguments.through_relay:
        run = uvloop.run if arguments.loop == "uvloop" else asyncio.run
        run(through_relay(arguments))
    else:
        asyncio.run(main(arguments))


if __name__ == "__main__":
    tool_main(cli)
