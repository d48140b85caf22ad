"""What gzipping a finished answer costs: the server's level against aiohttp's, side by side.

The front door gzips a JSON answer for a client that takes gzip (the OpenAI SDK asks for it
by default) at zlib's fastest level (``server.response_gzip``). The peer is zlib's default
level, which aiohttp's own ``enable_compression`` uses (and the server used before). For
each answer, as the server writes them: the median time of ``--repeats`` compressions of
each, and the size each makes. The answers: embeddings of ``--inputs`` inputs of ``--dims``
numbers (as JSON numbers, and as base64, the SDK's default), and two chat completions (a
paragraph, and a long reply).

Run: python benchmarks/response_gzip.py [--inputs 256 2048] [--dims 1536] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the relay benchmark's answers
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from relay.embeddings_answer import answer_of
from replystream.server.response_gzip import LEVEL, gzipped
from tool_main import tool_main


def default_level(body: bytes) -> bytes:
    """As aiohttp compresses a response body: zlib's default level, gzip's wrapper."""
    compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return compressor.compress(body) + compressor.flush()


def chat_answer(words: int) -> bytes:
    text = " ".join(f"word{i % 997}" for i in range(words))
    answer = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": words, "total_tokens": words + 9},
    }
    return json.dumps(answer).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--dims", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1 or args.dims < 1 or min(args.inputs) < 1:
        parser.error("--repeats, --dims and --inputs must be at least 1")
    bodies = {"chat, 200 words": chat_answer(200), "chat, 20,000 words": chat_answer(20_000)}
    for inputs in args.inputs:
        for packed in (False, True):
            kind = "base64" if packed else "numbers"
            bodies[f"embeddings {inputs} x {args.dims} {kind}"] = answer_of(
                inputs, args.dims, packed
            )
    compressors = {f"level {LEVEL} (ours)": gzipped, "default level": default_level}
    print(f"{'answer':>36} {'KB':>9} {'compressor':>15} {'ms':>9} {'KB out':>9} {'MB/s':>7}")
    for label, body in bodies.items():
        times: dict[str, list[float]] = {name: [] for name in compressors}
        sizes: dict[str, int] = {}
        for _ in range(args.repeats):  # alternated, so that noise falls on both
            for name, compress in compressors.items():
                began = time.perf_counter()
                sizes[name] = len(compress(body))
                times[name].append(time.perf_counter() - began)
        for name in compressors:
            took = statistics.median(times[name])
            print(
                f"{label:>36} {len(body) / 1e3:9.1f} {name:>15} {took * 1000:9.2f} "
                f"{sizes[name] / 1e3:9.1f} {len(body) / took / 1e6:7.0f}"
            )


if __name__ == "__main__":
    tool_main(main)
