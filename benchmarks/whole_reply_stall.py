"""How long a whole (non-streamed) reply with log probabilities stops every other stream.

A whole reply's body is made and written on the server's event loop when the reply ends;
with ``--tokens`` tokens and ``--top`` log probabilities each it is several megabytes of
JSON. Meanwhile no other stream the server carries moves. This measures it from outside, as
a client of another stream sees it: a server (``replystream serve --engine simulated``, a
token every ``--delay-ms``) streams one long reply to a reader that stamps each event's
arrival; while it flows, a whole chat completion with ``logprobs`` is asked for, and the
longest gap between two events of the stream while that request was open is its stall (the
stream's own interval is the floor). Both clients are threads with blocking sockets, so that
the client's own reading of the large body cannot delay the stamps.

``--src LABEL=PATH`` (repeatable) runs the server from each source tree
(``PYTHONPATH=PATH``), the trees alternated round by round, so two versions are compared
under the same load. Printed per tree: medians over ``--rounds`` of the stream's longest gap
while the whole reply was made and sent, of its longest gap in the half second or so before
it was asked for (the floor), and of the whole reply's time and size. ``--api responses``
asks for the whole reply on ``POST /v1/responses`` instead of chat; ``--api previous`` asks
for a one-token response whose ``previous_response_id`` is such a reply, stored before the
stream began (its history is read from that reply's log); ``--api cancel`` cancels such a
reply made in the background and ended before the stream began (the answer is its object);
``--redis-url`` has the
servers keep their logs in a running Redis.

Run: python benchmarks/whole_reply_stall.py [--tokens 4096] [--top 20] [--rounds 5]
         [--delay-ms 1] [--api chat|responses|previous|cancel] [--redis-url redis://127.0.0.1:6379/0]
         [--src before=/path/src --src after=/path/src]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from replystream.cli_values import float_between, int_between, positive_int
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.local_server import READY, announced_process
from source_trees import source_trees
from tool_main import tool_main


@dataclass
class Round:
    longest_gap_ms: float
    longest_before_ms: float  # the same stream's, before the whole reply was asked for
    whole_ms: float
    whole_bytes: int


def _post(
    host: str, port: int, body: dict[str, object], path: str = "/v1/chat/completions"
) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(host, port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:300]!r}")
    return response


def _whole_ask(api: str, tokens: int, top: int) -> tuple[str, dict[str, object]]:
    if api == "responses":
        return "/v1/responses", {
            "model": "bench",
            "input": "hello",
            "max_output_tokens": tokens,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": top,
        }
    message = [{"role": "user", "content": "hello"}]
    ask = {"model": "bench", "messages": message, "max_tokens": tokens, "logprobs": True}
    return "/v1/chat/completions", {**ask, "top_logprobs": top}


def _tokens_in(api: str, body: bytes) -> int:
    answer = json.loads(body)
    if api == "responses":
        return len(answer["output"][0]["content"][0]["logprobs"])
    return len(answer["choices"][0]["logprobs"]["content"])


def _follow_up(host: str, port: int, tokens: int, top: int) -> tuple[str, dict[str, object]]:
    """A one-token response continuing a stored one of ``tokens`` tokens with log
    probabilities (made now, before the stream starts)."""
    path, ask = _whole_ask("responses", tokens, top)
    stored = json.loads(_post(host, port, ask, path).read())
    ask = {"model": "bench", "input": "and?", "max_output_tokens": 1}
    return path, {**ask, "previous_response_id": stored["id"]}


def _cancel_ended(host: str, port: int, tokens: int, top: int) -> tuple[str, dict[str, object]]:
    """A cancel of a background response of ``tokens`` tokens with log probabilities that
    has ended (made now, before the stream starts): answered with its object."""
    path, ask = _whole_ask("responses", tokens, top)
    queued = json.loads(_post(host, port, {**ask, "background": True}, path).read())
    connection = http.client.HTTPConnection(host, port, timeout=120)
    try:
        while True:
            connection.request("GET", f"{path}/{queued['id']}")
            status = json.loads(connection.getresponse().read())["status"]
            if status not in ("queued", "in_progress"):
                break
            time.sleep(0.1)
    finally:
        connection.close()
    return f"{path}/{queued['id']}/cancel", {}


def one_round(host: str, port: int, api: str, tokens: int, top: int) -> Round:
    if api == "previous":
        path, ask = _follow_up(host, port, tokens, top)
    elif api == "cancel":
        path, ask = _cancel_ended(host, port, tokens, top)
    else:
        path, ask = _whole_ask(api, tokens, top)
    arrivals: list[float] = []
    stop = threading.Event()
    message = [{"role": "user", "content": "hello"}]

    def stream() -> None:
        ask = {"model": "bench", "messages": message, "stream": True, "max_tokens": 5 * tokens // 2}
        response = _post(host, port, ask)
        try:
            for line in response:
                if line.startswith(b"data:"):
                    arrivals.append(time.perf_counter())
                if stop.is_set():
                    return
        finally:
            response.close()

    reader = threading.Thread(target=stream)
    reader.start()
    while len(arrivals) < 50:  # the stream flows
        time.sleep(0.01)
    began = time.perf_counter()
    body = _post(host, port, ask, path).read()
    ended = time.perf_counter()
    time.sleep(0.05)  # an event after the body: the gap the body's end closed
    stop.set()
    reader.join()
    made = 1 if api == "previous" else _tokens_in("chat" if api == "chat" else "responses", body)
    if made != (1 if api == "previous" else tokens):
        raise RuntimeError(f"the whole reply has {made} tokens, not {tokens}")
    split = sum(1 for t in arrivals if t < began)
    ahead, spanned = arrivals[:split], [t for t in arrivals[split - 1 :] if t <= ended + 0.05]
    return Round(_longest_gap(spanned), _longest_gap(ahead), (ended - began) * 1000, len(body))


def _longest_gap(stamps: list[float]) -> float:
    return max((b - a) * 1000 for a, b in itertools.pairwise(stamps))


def serve_command(
    src: str | None, tokens: int, delay_ms: float, redis_url: str | None
) -> list[str]:
    env = ["env", f"PYTHONPATH={src}"] if src else []  # the pid is the server's
    words = " ".join(f"w{i % 97}" for i in range(3 * tokens))  # argv: under 128 KiB
    return [
        *env,
        sys.executable,
        "-m",
        "replystream",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--engine",
        "simulated",
        "--delay-ms",
        str(delay_ms),
        "--jitter-ms",
        "0",
        "--reply-text",
        words,
        "--model-name",
        "bench",
        "--log-level",
        "WARNING",
        *(["--redis-url", redis_url] if redis_url else []),
    ]


async def main(args: argparse.Namespace) -> None:
    sources: list[tuple[str, str | None]] = [
        (label, path) for label, _, path in (s.partition("=") for s in args.src)
    ] or [("replystream", None)]
    results: dict[str, list[Round]] = {label: [] for label, _ in sources}
    async with contextlib.AsyncExitStack() as stack:
        servers = []
        for label, src in sources:
            command = serve_command(src, args.tokens, args.delay_ms, args.redis_url)
            server = await stack.enter_async_context(announced_process(command, READY, name=label))
            url = urlsplit(server.url)
            assert url.hostname is not None and url.port is not None
            servers.append((label, url.hostname, url.port))
        for _label, host, port in servers:  # warm-up: imports, caches
            await asyncio.to_thread(one_round, host, port, args.api, 64, args.top)
        for _ in range(args.rounds):
            for label, host, port in servers:
                figures = await asyncio.to_thread(
                    one_round, host, port, args.api, args.tokens, args.top
                )
                results[label].append(figures)
                print(
                    f"{label}: longest gap {figures.longest_gap_ms:.1f} ms, whole reply "
                    f"{figures.whole_ms:.0f} ms, {figures.whole_bytes / 1e6:.2f} MB",
                    flush=True,
                )
    asked = {
        "previous": f"a one-token response continues a stored one of {args.tokens} tokens",
        "cancel": f"a background response of {args.tokens} tokens, ended, is cancelled",
    }.get(args.api, f"a whole {args.api} reply of {args.tokens} tokens is made and sent")
    print(
        f"\nA stream of a token every {args.delay_ms:g} ms while {asked}, with {args.top} log "
        f"probabilities each; medians of {args.rounds} rounds"
    )
    print(f"{'server':<16}{'longest gap':>14}{'before it':>12}{'whole reply':>13}{'size':>9}")
    for label, rounds in results.items():
        longest = statistics.median(r.longest_gap_ms for r in rounds)
        ahead = statistics.median(r.longest_before_ms for r in rounds)
        whole = statistics.median(r.whole_ms for r in rounds)
        size = statistics.median(r.whole_bytes for r in rounds) / 1e6
        print(f"{label:<16}{longest:>11.1f} ms{ahead:>9.1f} ms{whole:>10.0f} ms{size:>6.2f} MB")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int_between(1, MAX_TOKENS_LIMIT), default=4096)
    parser.add_argument("--top", type=int_between(0, 20), default=20, help="top_logprobs (0-20)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument(
        "--api",
        choices=["chat", "responses", "previous", "cancel"],
        default="chat",
        help="the whole reply's route; previous: a one-token response continuing one of "
        "--tokens tokens (previous_response_id); cancel: a cancel of such a background "
        "response, ended",
    )
    parser.add_argument(
        "--delay-ms",
        type=float_between(0.0, 60_000.0, strict=True),
        default=1.0,
        help="the server's token time",
    )
    parser.add_argument("--src", action="append", default=[], metavar="LABEL=PATH")
    parser.add_argument(
        "--redis-url", help="the servers keep their reply logs in this Redis (a running one)"
    )
    args = parser.parse_args(argv)
    source_trees(parser, args.src)
    return args


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main(parse_args())))
