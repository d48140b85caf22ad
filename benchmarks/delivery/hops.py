"""The path of one streamed reply through replystream's own modules, counted.

Serves the app in this process on a loopback socket (the simulated engine, one token every
20 ms), sends one ``POST /v1/replies`` from a plain blocking socket in another thread (so the
client is not traced), and traces every Python call and return on the server's thread
(``sys.setprofile``). Counted in replystream's files only:

- **to the first byte**: from the first call into replystream after the request was sent to
  the first socket write of the response (headers and opening events);
- **per token**: between one socket write and the next, while tokens stream (the engine's
  step, the pipeline, the log, the reader, the write), the median over the reply.

For each window: the files entered, the hops (calls from one of our modules into another),
and the doubling back (a hop into a module already further up the call stack: a callback
into a caller). Runs on any revision of the package, so two can be compared.

Run: python benchmarks/delivery/hops.py [--tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import replystream
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.server import create_app, running

# The benchmarks' shared modules (tool_main), beside this folder's own.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from tool_main import tool_main

PACKAGE = str(Path(replystream.__file__).resolve().parent) + "/"
WRITE = "<socket write>"


@dataclass(frozen=True)
class Window:
    files: int
    hops: int
    doubling_back: int


@dataclass(frozen=True)
class Call:
    module: str  # the called function's module (a path under the package)
    hop: bool  # called from another of our modules
    back: bool  # ... into a module already further up the call stack (a callback)


class Tracer:
    """Records each call into replystream's files, and the socket writes."""

    def __init__(self) -> None:
        self.recording = False
        self.trail: list[Call | str] = []
        self._modules: dict[str, str] = {}

    def module(self, filename: str) -> str | None:
        cached = self._modules.get(filename)
        if cached is None:
            cached = filename[len(PACKAGE) :] if filename.startswith(PACKAGE) else ""
            self._modules[filename] = cached
        return cached or None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.recording or event != "call":
            return
        code = frame.f_code
        if code.co_name == "write" and code.co_filename.endswith("asyncio/selector_events.py"):
            self.trail.append(WRITE)
            return
        module = self.module(code.co_filename)
        if module is None:
            return
        # Our modules up the stack, nearest first (the loop and libraries in between skipped).
        above: list[str] = []
        caller = frame.f_back
        while caller is not None:
            found = self.module(caller.f_code.co_filename)
            if found is not None:
                above.append(found)
            caller = caller.f_back
        hop = bool(above) and above[0] != module
        self.trail.append(Call(module, hop, hop and module in above[1:]))


def measure(window: list[Call]) -> Window:
    return Window(
        len({call.module for call in window}),
        sum(call.hop for call in window),
        sum(call.back for call in window),
    )


def client(url: str, tokens: int, started: threading.Event, done: list[bytes]) -> None:
    parts = urlsplit(url)
    body = json.dumps({"prompt": "x", "max_tokens": tokens}).encode()
    request = (
        f"POST /v1/replies HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        started.wait()
        sock.sendall(request)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
    done.append(bytes(received))


async def trace(tokens: int) -> list[Call | str]:
    engine = SimulatedEngine(SimulatedConfig(delay_ms=20.0, jitter_ms=0.0))
    tracer = Tracer()
    async with running(create_app(engine)) as url:
        # One reply untraced first: imports, caches and the first-call paths are warm.
        await asyncio.to_thread(client, url, 3, _set(), [])
        started = threading.Event()
        done: list[bytes] = []
        thread = threading.Thread(target=client, args=(url, tokens, started, done))
        thread.start()
        sys.setprofile(tracer)
        tracer.recording = True
        started.set()
        await asyncio.to_thread(thread.join)  # the waiting thread is not traced
        tracer.recording = False
        sys.setprofile(None)
    if b"event: done" not in done[0]:
        raise SystemExit("the traced reply did not finish")
    return tracer.trail


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def split(trail: list[Call | str]) -> list[list[Call]]:
    windows: list[list[Call]] = [[]]
    for call in trail:
        if isinstance(call, str):  # a socket write ends a window
            if windows[-1]:
                windows.append([])
            continue
        windows[-1].append(call)
    return [window for window in windows if window]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40, help="tokens in the traced reply")
    args = parser.parse_args()
    if args.tokens < 5:
        parser.error("--tokens must be at least 5")
    windows = split(asyncio.run(trace(args.tokens)))
    first = measure(windows[0])
    # Windows between writes while tokens stream (not the opening one, not the ending).
    streaming = [measure(window) for window in windows[1:-1]]
    per_token = Window(
        round(statistics.median(w.files for w in streaming)),
        round(statistics.median(w.hops for w in streaming)),
        round(statistics.median(w.doubling_back for w in streaming)),
    )
    print(f"replystream at {PACKAGE}")
    print(f"{'':22} {'files':>6} {'hops':>6} {'doubling back':>14}")
    for name, window in (("to the first byte", first), ("per token (median)", per_token)):
        print(f"{name:22} {window.files:>6} {window.hops:>6} {window.doubling_back:>14}")
    print("first-byte path:", " > ".join(_runs(windows[0])))
    print("one token's path:", " > ".join(_runs(windows[len(windows) // 2])))


def _runs(window: list[Call]) -> list[str]:
    """The modules the window's hops go into, in order."""
    first = [window[0].module] if window else []
    return [m.removesuffix(".py") for m in first + [c.module for c in window if c.hop]]


if __name__ == "__main__":
    tool_main(main)
