"""A real ``serve`` out of file descriptors: it pauses accepting, says so in one line a pause,
serves the connections it has, and accepts again once clients leave; a relay with no
descriptor left for an upstream connection says so, and takes no upstream out for it."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import resource
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from replystream.server.pages import WEB_DIR


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


def started(
    command: tuple[str, ...], most: int | None = None, stderr: Path | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``replystream serve`` with ``command``'s flags (under ``ulimit -n most``; its log in
    the file ``stderr``), and its URL once it listens."""
    with contextlib.ExitStack() as files:
        log = subprocess.DEVNULL if stderr is None else files.enter_context(stderr.open("w"))
        process = subprocess.Popen(
            (sys.executable, "-m", "replystream", "serve", "--port", "0", *command),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=None if most is None else lambda: limited(most),
        )
    assert process.stdout is not None
    found = re.search(r"listening on (http://\S+)", process.stdout.readline())
    assert found is not None
    return process, found.group(1)


def chat(url: str) -> tuple[int, dict[str, object]]:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_relay_out_of_file_descriptors_says_so_and_takes_no_upstream_out() -> None:
    """Each connect to the upstream that failed with EMFILE was counted on the upstream's
    circuit: 502 "cannot connect to the upstream", then, three on, the healthy upstream was
    taken out, and every request for 10 s was a 503 saying its circuit was open."""
    upstream, upstream_url = started(("--engine", "simulated", "--delay-ms", "50"))
    relay, url = started(("--engine", f"upstream:{upstream_url}/v1"), most=48)
    clients: list[socket.socket] = []
    try:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
        request = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        for _ in range(30):  # each holds one descriptor, and its upstream connection one
            client = socket.create_connection((host, int(port)))
            client.sendall(request)
            clients.append(client)
        time.sleep(2)
        heads: list[bytes] = []
        for client in clients:
            client.settimeout(0.2)
            try:
                heads.append(client.recv(4096))
            except TimeoutError:
                pass  # not accepted yet: no descriptor for it
        statuses = {head.split(b" ", 2)[1] for head in heads}
        assert statuses == {b"200", b"503"}, statuses
        refused = next(head for head in heads if head.startswith(b"HTTP/1.1 503"))
        assert b"Retry-After: 1\r\n" in refused, refused
        error = json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "server_out_of_resources", error
        assert error["message"] == (
            f"this server cannot open a connection to the upstream at {upstream_url}/v1 now: "
            "too many open files"
        )
        for client in clients:
            client.close()
        clients.clear()
        time.sleep(0.5)
        status, answer = chat(url)  # the upstream was never at fault: taken at once
        assert status == 200, answer
    finally:
        for client in clients:
            client.close()
        for process in (relay, upstream):
            process.terminate()
            process.communicate(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_stdout_on_a_full_disk_is_told_in_a_line_and_the_server_serves(
    workers: str, tmp_path: Path
) -> None:
    """Printing the address once listening raised ENOSPC out of the serving loop: a
    traceback, exit 1, a server that never served."""
    port = free_port()
    command = (
        sys.executable, "-m", "replystream", "serve", "--engine", "simulated",
        "--port", str(port), "--workers", workers,
    )  # fmt: skip
    with open("/dev/full", "w") as full, (tmp_path / "stderr").open("w") as log:
        process = subprocess.Popen(command, stdout=full, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert process.poll() is None, (tmp_path / "stderr").read_text()
                assert time.monotonic() < deadline
                time.sleep(0.2)
        status, answer = chat(f"http://127.0.0.1:{port}")
        assert status == 200, answer
        # With --workers the parent announces once every worker is ready, which may be
        # after one of them has answered.
        while "stdout" not in (tmp_path / "stderr").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        process.terminate()
        returncode = process.wait(timeout=30)
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert returncode == 0, lines
    assert not any("Traceback" in line or "Exception ignored" in line for line in lines), lines
    told = [line for line in lines if "stdout" in line]
    assert len(told) == 1 and told[0].endswith(
        "serving, but stdout cannot be written (the address was not printed): "
        "no space left on device"
    ), lines


def test_out_of_file_descriptors_the_chat_pages_assets_are_still_served() -> None:
    """Each asset was opened per request (``FileResponse``): with no descriptor left it was
    a 404 with an empty body, nothing logged, the chat page broken for a file it ships."""
    process, url = started(("--engine", "simulated", "--delay-ms", "50"), most=40)
    host, port = url.removeprefix("http://").split(":")
    kept = http.client.HTTPConnection(host, int(port), timeout=10)  # accepted while there is room
    clients: list[socket.socket] = []
    try:
        kept.request("GET", "/healthz")
        assert kept.getresponse().read()
        for _ in range(60):  # more than the server may open: it opens all it can
            client = socket.create_connection((host, int(port)))
            client.sendall(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            clients.append(client)
        time.sleep(1.5)  # accepting has paused
        for name in ("app.js", "style.css"):
            kept.request("GET", f"/static/{name}")
            response = kept.getresponse()
            body = response.read()
            assert response.status == 200, (name, response.status, body)
            assert body == (WEB_DIR / "static" / name).read_bytes()
    finally:
        kept.close()
        for client in clients:
            client.close()
        process.terminate()
        process.communicate(timeout=30)


def streaming_request(stream: bool) -> bytes:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 900}
    )
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def test_a_request_waiting_for_room_out_of_descriptors_tells_it_once_as_it_begins_and_ends(
    tmp_path: Path,
) -> None:
    """While a request waited for room at an upstream whose limit the workers share, each
    poll of its line (every 10-30 ms) logged ``cannot see the other workers' lines: [Errno
    24] Too many open files``: about 140 lines in 3 s of shortage."""
    upstream, upstream_url = started(("--engine", "simulated", "--delay-ms", "100"))
    options = (
        "--engine", f"upstream:{upstream_url}/v1", "--workers", "2",
        "--upstream-max-outstanding", "1", "--upstream-queue-s", "60",
    )  # fmt: skip
    relay, url = started(options, most=64, stderr=tmp_path / "stderr")
    host, port = url.removeprefix("http://").split(":")
    clients: list[socket.socket] = []
    try:
        holding = socket.create_connection((host, int(port)), timeout=10)
        clients.append(holding)
        holding.sendall(streaming_request(True))  # 90 s of tokens: it holds the only slot
        assert holding.recv(20).startswith(b"HTTP/1.1 200")
        waiting = socket.create_connection((host, int(port)), timeout=10)
        clients.append(waiting)
        waiting.sendall(streaming_request(False))  # waits in its worker's line, which polls
        time.sleep(0.3)
        for _ in range(300):  # more than both workers may open: they open all they can
            try:
                clients.append(socket.create_connection((host, int(port)), timeout=1))
            except OSError:
                break  # the listening socket's backlog is full
        time.sleep(2)
        for client in clients[2:]:
            client.close()
        del clients[2:]
        deadline = time.monotonic() + 10  # its next poll finds room for descriptors again
        while "succeeds again" not in (tmp_path / "stderr").read_text():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for client in clients:
            client.close()
        for process in (relay, upstream):
            process.terminate()
            process.communicate(timeout=30)
    lines = (tmp_path / "stderr").read_text().splitlines()
    told = [line for line in lines if "the other workers' lines" in line]
    assert len(told) == 2, (len(told), told[:3])
    assert told[0].endswith("(told again once it succeeds)") and "Too many open files" in told[0]
    assert "succeeds again, after failing for" in told[1], told
