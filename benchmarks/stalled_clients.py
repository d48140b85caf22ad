"""Server memory per stalled stream: clients that send a request and never read.

Starts ``replystream serve`` with a fast reply of large tokens, opens N raw sockets that
request a stream and never read, waits until the server has cut them all as slow clients,
and prints the server's peak resident memory per stalled stream (Linux /proc). The bound is
the slow-client byte limit plus the socket writer's high-water mark (64 KiB) per stream.
It exits 1, saying why on its last line, when not every client was cut within
``--wait-s`` or a stalled stream held more than that bound.

Run: python benchmarks/stalled_clients.py [--clients 500] [--slow-client-bytes 1048576]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

from replystream.cli_values import positive_float, positive_int
from replystream.lab.local_server import serve_process
from tool_main import tool_main


def memory_kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert found, field
    return int(found.group(1))


def metric(url: str, pattern: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    found = re.search("^" + pattern + r" (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else 0


def slow_cuts(url: str) -> int:
    return metric(url, r'replystream_replies_total\{endpoint="/stream",outcome="slow_client"\}')


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=positive_int, default=500)
    parser.add_argument("--slow-client-bytes", type=positive_int, default=1 << 20)
    parser.add_argument("--slow-client-s", type=positive_float, default=5.0)
    parser.add_argument(
        "--wait-s", type=positive_float, default=120.0, help="how long every client has to be cut"
    )
    args = parser.parse_args()
    word = "z" * 16000  # big tokens: the socket fills after a few hundred of them
    server_args = ["--engine", "simulated", "--reply-text", word, "--tokens", "2000"]
    server_args += ["--delay-ms", "0.5", "--jitter-ms", "0"]
    server_args += ["--slow-client-bytes", str(args.slow_client_bytes)]
    server_args += ["--slow-client-s", str(args.slow_client_s)]
    async with serve_process(server_args) as server:
        url = server.url
        host, port = url.removeprefix("http://").split(":")
        await asyncio.to_thread(slow_cuts, url)  # warm the server up
        baseline = memory_kib(server.pid, "VmRSS")
        sockets = []
        try:
            for _ in range(args.clients):
                sock = socket.socket()
                sockets.append(sock)
                # A small receive window (set before connecting), so the reader's kernel does
                # not absorb the stream on the client's behalf.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((host, int(port)))
                sock.sendall(f"GET /stream HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            started = time.monotonic()
            while (cut := await asyncio.to_thread(slow_cuts, url)) < args.clients:
                if time.monotonic() - started > args.wait_s:
                    break
                await asyncio.sleep(0.5)
            peak = memory_kib(server.pid, "VmHWM")
            elapsed = time.monotonic() - started
        finally:  # interrupted too: a server stopped with its streams open waits out its grace
            for sock in sockets:
                sock.close()
        while await asyncio.to_thread(metric, url, "replystream_active_streams"):  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        after = memory_kib(server.pid, "VmRSS")
    per_stream = (peak - baseline) / args.clients
    bound = (args.slow_client_bytes + 65536) / 1024
    print(f"stalled clients           {args.clients}")
    print(f"cut as slow clients       {cut} in {elapsed:.1f} s")
    print(f"server RSS before         {baseline / 1024:.1f} MiB")
    print(f"server peak RSS           {peak / 1024:.1f} MiB")
    print(f"server RSS after closing  {after / 1024:.1f} MiB")
    print(f"peak per stalled stream   {per_stream:.1f} KiB (bound: {bound:.0f} KiB)")
    if cut < args.clients:
        print(
            f"failed: {args.clients - cut} of {args.clients} stalled clients not cut within "
            f"{args.wait_s:g} s",
            file=sys.stderr,
        )
        return 1
    if per_stream > bound:
        print(
            f"failed: a stalled stream held {per_stream:.1f} KiB, past its bound of "
            f"{bound:.0f} KiB",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main()))
