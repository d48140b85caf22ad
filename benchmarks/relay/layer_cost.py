"""Where a relayed chunk's CPU goes in a running relay, layer by layer.

``parse_cost.py`` measures the relay's per-chunk work with no sockets, each function called
again and again on warm caches. This measures the same functions where they run: a
``replystream serve --engine upstream:...`` (``layer_probe.py``) behind the relay
benchmark's upstream, C streams of long replies read by raw sockets (so that no request's
start counts), and, for each layer of ``layer_probe.LAYERS``, one run with that layer's
function timed in CPU time. Each layer's own share is its time less that of the layer it
calls; what no layer holds (the event loop, the socket reads, timers) is the process's CPU
per chunk less the outermost layer's. Every figure is per relayed chunk: each layer's the
median of its ``--rounds`` runs (the layers taken in turn, round after round), the
process's the median of all runs (each run's wrapper adds its own clock reads to it).

Run: python benchmarks/relay/layer_cost.py [-C 100] [--seconds 8] [--rounds 3] [--loop uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the delivery benchmark's modules, and ours
    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "delivery")]

from procstats import cpu_seconds, raise_nofile

from relay.layer_probe import LAYERS
from relay.relays import upstream_server
from relay.upstream_server import MARKER
from replystream.cli_values import positive_float, positive_int
from replystream.lab.local_server import READY, announced_process
from tool_main import tool_main

PROBE = Path(__file__).resolve().parent / "layer_probe.py"
CHUNKS = 20_000  # per reply: longer than any run (400 s), so that no reply ends or starts anew
INTERVAL_MS = 20.0
WARMUP_S = 3.0
# Each layer's own share: its time less that of the layer it calls (None: it calls none).
CALLS = {
    "read": ("parse", "relay"),
    "parse": (),
    "relay": ("reply",),
    "reply": ("follower",),
    "follower": ("write",),
    "write": (),
}
SAYS = {
    "read": "framing, hand-over",
    "parse": "parse: SSE, JSON, checks",
    "relay": "relayed reply's checks",
    "reply": "reply: pipeline, encode, log, metrics",
    "follower": "follower",
    "write": "transport checks and send()",
}
REQUEST = {"model": "bench", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


async def stream(port: int, chunks: list[int]) -> None:
    """One streamed chat reply, read to its end (or until cancelled), its chunks counted."""
    body = json.dumps(REQUEST).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        while data := await reader.read(65536):
            chunks[0] += data.count(MARKER)
    finally:
        writer.close()


def written(out: Path) -> dict[str, int] | None:
    """What the probed relay wrote to ``out`` (None: nothing yet), taken away so that the
    next signal's sums are new ones."""
    if not out.exists():
        return None
    got: dict[str, int] = json.loads(out.read_text())
    out.unlink()
    return got


async def sums(pid: int, out: Path) -> dict[str, int]:
    """The probed relay's sums now (it writes them to ``out`` on SIGUSR1)."""
    os.kill(pid, signal.SIGUSR1)
    for _ in range(200):
        got = written(out)
        if got is not None:
            return got
        await asyncio.sleep(0.01)
    raise RuntimeError("the probed relay wrote no sums within 2 s")


async def one_run(
    layer: str, upstream: str, concurrency: int, seconds: float, loop: str, folder: Path
) -> tuple[float, float]:
    """The relay's CPU per chunk, and the layer's, over ``seconds`` of steady streams."""
    out = folder / f"{layer}.json"
    command = [sys.executable, str(PROBE), str(out), layer, "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--engine", f"upstream:{upstream}/v1", "--upstream-model"]
    command += ["bench", "--model-name", "bench", "--loop", loop, "--log-level", "ERROR"]
    async with announced_process(command, READY, name="relay") as relay:
        port = int(relay.url.rsplit(":", 1)[1])
        chunks = [0]
        tasks = []
        try:
            for _ in range(concurrency):  # the streams' chunks spread over one interval
                tasks.append(asyncio.create_task(stream(port, chunks)))
                await asyncio.sleep(INTERVAL_MS / 1000 / concurrency)
            await asyncio.sleep(WARMUP_S)
            marks = []
            for wait in (0.0, seconds):
                await asyncio.sleep(wait)
                marks.append((chunks[0], cpu_seconds([relay.pid]), await sums(relay.pid, out)))
        finally:  # interrupted too: a relay stopped with streams open waits out its grace
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.5)  # the relay sees its clients gone before it is stopped
    (chunks0, cpu0, at0), (chunks1, cpu1, at1) = marks
    relayed = chunks1 - chunks0
    if relayed <= 0:
        raise RuntimeError(f"no chunk relayed in {seconds:g} s")
    return (cpu1 - cpu0) / relayed * 1e6, (at1["ns"] - at0["ns"]) / relayed / 1000


async def main(args: argparse.Namespace) -> None:
    raise_nofile()
    process: list[float] = []
    runs: dict[str, list[float]] = {layer: [] for layer in LAYERS}
    with tempfile.TemporaryDirectory() as folder:
        async with upstream_server(1, CHUNKS, INTERVAL_MS) as upstream:
            for round_ in range(1, args.rounds + 1):
                for layer in LAYERS:
                    cpu, spent = await one_run(
                        layer, upstream.url, args.concurrency, args.seconds, args.loop, Path(folder)
                    )
                    process.append(cpu)
                    runs[layer].append(spent)
                    said = f"{spent:.1f} µs a chunk in it (process {cpu:.1f})"
                    print(f"  round {round_} {layer}: {said}", flush=True)
    inclusive = {layer: statistics.median(spent) for layer, spent in runs.items()}
    whole = statistics.median(process)
    print(
        f"relay CPU per chunk, C = {args.concurrency}, {args.loop} "
        f"(median of {len(process)} runs): {whole:.1f} µs; of it, per layer (medians):"
    )
    print(f"  {'the loop, socket reads, timers':38} {whole - inclusive['read']:6.1f} µs")
    for layer, called in CALLS.items():
        own = inclusive[layer] - sum(inclusive[c] for c in called)
        print(f"  {SAYS[layer]:38} {own:6.1f} µs")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-C", "--concurrency", type=positive_int, default=100)
    parser.add_argument("--seconds", type=positive_float, default=8.0, help="measured per run")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs per layer")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    tool_main(cli)
