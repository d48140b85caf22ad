"""A real ``serve`` out of file descriptors: it pauses accepting, says so in one line a pause,
serves the connections it has, and accepts again once clients leave."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def limited(most: int) -> None:
    """In the child: ``ulimit -n most``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, hard))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_out_of_file_descriptors_the_log_says_so_in_a_line_a_pause(
    loop: str, tmp_path: Path
) -> None:
    """On asyncio's own loop, each accept that found no descriptor left logged a traceback,
    and asyncio's server kept going through its backlog and scheduled a restart for each:
    tens of thousands of lines in seconds."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    command = (
        sys.executable, "-m", "replystream", "serve", "--engine", "simulated", "--port", "0",
        "--loop", loop, "--delay-ms", "50", "--tokens", "1000",
    )  # fmt: skip
    log = (tmp_path / "stderr").open("w")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        preexec_fn=lambda: limited(48),
    )
    clients: list[socket.socket] = []
    try:
        assert process.stdout is not None
        found = re.search(r"listening on http://([\d.]+):(\d+)", process.stdout.readline())
        assert found is not None
        address = (found.group(1), int(found.group(2)))
        request = b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n"
        for _ in range(80):  # more than the server may open
            client = socket.create_connection(address)
            client.sendall(request)
            clients.append(client)
        time.sleep(2.5)  # two pauses or three
        streaming = 0
        for client in clients:
            client.settimeout(0.01)
            try:
                streaming += client.recv(20).startswith(b"HTTP/1.1 200")
            except TimeoutError:
                pass
        assert 10 < streaming < 48, streaming  # served the ones it had room for
        for client in clients:
            client.close()
        clients.clear()
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/healthz", timeout=10) as r:
            assert r.status == 200  # accepting again
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.communicate(timeout=30)
        log.close()
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert not any("Traceback" in line for line in lines), lines[:20]
    paused = [line for line in lines if "accepting connections paused" in line]
    assert 1 <= len(paused) <= 5, len(lines)
    assert all(line.endswith("paused for 1 s: too many open files") for line in paused), paused
