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

Run: python benchmarks/relay/embeddings_answer.py [--inputs 256 2048] [--dims 1536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import statistics
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable

from pydantic_core import from_json, to_json

from replystream.engine.embeddings_answer import checked_answer

Reader = Callable[[bytes], Awaitable[object]]


async def relayed(raw: bytes) -> object:
    answer = await checked_answer(raw, "asked")
    assert answer is not None
    return answer


async def parsed_whole(raw: bytes) -> object:
    answer = from_json(raw)
    data = answer["data"]
    assert all(isinstance(item.get("embedding"), list | str) for item in data)
    answer["model"] = "asked"
    return to_json(answer)


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
    held, watching = 0.0, True

    async def watch() -> None:
        nonlocal held
        while watching:
            began = time.perf_counter()
            await asyncio.sleep(0)
            held = max(held, time.perf_counter() - began)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    began = time.perf_counter()
    await read(raw)
    took = time.perf_counter() - began
    watching = False
    await watcher
    return took, held


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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--dims", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
