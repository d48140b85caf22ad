"""Request bodies still arriving take bounded memory over every connection: past
``--max-reading-bytes`` a request is refused with a 503 before its body is read, rather
than the process growing until a container's memory limit kills it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

MIB = 1024 * 1024


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def upload_held_back(host: str, port: int) -> socket.socket:
    """A chat request whose 1 MiB body stops one byte short (a slow or hostile uploader)."""
    content = "a" * (MIB - 200)
    text = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    body = text.encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    client = socket.create_connection((host, port))
    client.sendall(head + body[:-1])  # the closing brace
    return client


def test_uploads_past_the_room_are_refused_and_memory_stays_bounded() -> None:
    """Uploads of 1 MiB held one byte short took about 2 MiB of the server each (200: from
    58 to 440 MiB), every one of them held until the body timeout, and no bound on them."""
    command = (
        sys.executable, "-m", "replystream", "serve", "--engine", "simulated", "--port", "0",
        "--max-reading-bytes", str(8 * MIB), "--max-prompt-chars", str(2 * MIB),
    )  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    clients: list[socket.socket] = []
    try:
        assert process.stdout is not None
        found = re.search(r"listening on http://([\d.]+):(\d+)", process.stdout.readline().decode())
        assert found is not None
        host, port = found.group(1), int(found.group(2))
        at_rest = resident_mib(process.pid)
        clients = [upload_held_back(host, port) for _ in range(100)]
        time.sleep(2)
        grown = resident_mib(process.pid) - at_rest
        refused = waiting = 0
        for client in clients:
            client.settimeout(0.2)
            try:
                answer = client.recv(65536)
            except TimeoutError:
                waiting += 1
                continue
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"\r\nRetry-After: 1\r\n" in answer, answer
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "server_busy", error
            refused += 1
        assert waiting <= 8 and refused == 100 - waiting, (waiting, refused)
        assert grown < 80, f"{grown:.0f} MiB more for uploads still arriving"
        for client in clients:
            client.close()
        clients.clear()
        time.sleep(0.5)  # the room given back as the waiting ones' connections closed
        # One more upload needs room, for its whole size: there is, the room given back.
        with upload_held_back(host, port) as late:
            time.sleep(0.3)
            late.sendall(b"}")
            late.settimeout(10)
            assert late.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for client in clients:
            client.close()
        process.terminate()
        process.communicate(timeout=30)
