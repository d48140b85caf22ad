"""A stderr nobody reads (a stuck log collector) does not stop the server: its log lines are
written by a thread of their own, and past a bound dropped, counted and said. Processes
sharing one stderr (the workers of ``--workers``) never tear each other's lines."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import unquote

import pytest

from replystream.server import create_app, running
from replystream.server.log_sink import FORMAT, ThreadedLineHandler
from tests.conftest import fast_engine, wait_for
from tests.rawhttp import raw_request


def test_a_stderr_nobody_reads_stops_no_stream_and_no_request() -> None:
    """The access-log line of each request was written to stderr in the event loop's
    thread: once the pipe's 64 KiB were full (the 272nd request), the loop waited in that
    write, and every stream, request and signal of the server with it."""
    command = (
        sys.executable, "-m", "replystream", "serve", "--engine", "simulated", "--port", "0",
        "--log-level", "INFO", "--delay-ms", "20", "--tokens", "100000",
    )  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # never read until the end
    )
    try:
        assert process.stdout is not None
        found = re.search(r"listening on http://([\d.]+):(\d+)", process.stdout.readline().decode())
        assert found is not None
        host, port = found.group(1), int(found.group(2))
        stream = socket.create_connection((host, port))
        stream.sendall(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
        stream.settimeout(5)
        received = [0]

        def read_stream() -> None:
            with contextlib.suppress(OSError):  # closed at the end
                while chunk := stream.recv(65536):
                    received[0] += len(chunk)

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        requests = http.client.HTTPConnection(host, port, timeout=5)
        for _ in range(600):  # an access-log line each: about three pipes' worth
            requests.request("GET", "/healthz?" + "x" * 200)
            assert requests.getresponse().read()
        requests.request("GET", "/metrics")
        metrics = requests.getresponse().read().decode()
        assert re.search(r"^replystream_log_lines_dropped 0(\.0)?$", metrics, re.M), metrics
        before = received[0]
        time.sleep(1)  # 50 tokens' time
        assert received[0] > before, "the stream stopped"
        requests.close()
        stream.shutdown(socket.SHUT_RDWR)
        reader.join()
        stream.close()
        started = time.monotonic()  # a stop whose last lines nobody reads is not held up
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
        assert time.monotonic() - started < 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pipe in (process.stdout, process.stderr):
            assert pipe is not None
            pipe.close()


def test_lines_past_the_bound_are_dropped_counted_and_said() -> None:
    read_end, write_end = os.pipe()
    handler = ThreadedLineHandler(write_end, max_pending_bytes=4096)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("replystream.tests.log_sink")
    log.propagate = False
    log.addHandler(handler)
    try:
        line = "x" * 100
        started = time.monotonic()
        for _ in range(5000):  # 500 KB: the pipe's 64 KiB, the queue's 4 KiB, and drops
            log.warning(line)
        assert time.monotonic() - started < 5, "logging waited for the reader"
        assert handler.dropped_lines > 4000
        os.set_blocking(read_end, False)
        written = b""
        deadline = time.monotonic() + 10
        while b"dropped" not in written and time.monotonic() < deadline:
            try:
                written += os.read(read_end, 1 << 20)
            except BlockingIOError:
                time.sleep(0.01)
        log.warning("after")  # the reader is back: a line now is written
        handler.drain()
        written += os.read(read_end, 1 << 20)
        # Said once per write that follows a gap, as many as that gap dropped.
        said = re.findall(rb"WARNING (\d+) log lines dropped: stderr was not read", written)
        assert sum(int(count) for count in said) == handler.dropped_lines
        assert written.endswith(b"WARNING after\n")
    finally:
        log.removeHandler(handler)
        os.close(read_end)
        os.close(write_end)


# A process that logs as many lines of about 1.5 KB as it is told through the server's log
# writer, as fast as it can, to the stderr it was given (each of the workers of
# ``--workers`` does so to the one stderr they share).
_WRITER = """
import logging, sys
from replystream.server import log_sink
log_sink.install("INFO")
log = logging.getLogger("t")
sys.stdin.readline()  # both ready: they write at once
for i in range(int(sys.argv[2])):
    log.info("%s %d %s", sys.argv[1], i, "x" * 1500)
"""


def test_processes_sharing_one_stderr_pipe_never_tear_each_others_lines() -> None:
    """Each writer joined every line waiting into one write: a write of more than the pipe's
    atomic size (PIPE_BUF, 4096 bytes) is put in the pipe a part at a time as the reader makes
    room, so with ``--workers`` and a log collector reading a pipe more slowly than the lines
    came, another worker's lines went into the middle of a line (279 of 5,000 access-log
    lines of two workers torn so), and neither line could be read."""
    lines = 300
    read_end, write_end = os.pipe()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, name, str(lines)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=write_end,
        )
        for name in ("first", "second")
    ]
    os.close(write_end)
    written = bytearray()
    try:
        for writer in writers:
            assert writer.stdin is not None
            writer.stdin.write(b"go\n")
            writer.stdin.close()
        while chunk := os.read(read_end, 4096):  # a collector slower than the writers
            written += chunk
            time.sleep(0.002)
        for writer in writers:
            assert writer.wait(timeout=30) == 0
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        os.close(read_end)
    line = re.compile(rb"[\d-]+ [\d:,]+ INFO t (first|second) (\d+) x{1500}")
    seen: dict[bytes, list[int]] = {b"first": [], b"second": []}
    torn = 0
    for text in bytes(written).splitlines():
        found = line.fullmatch(text)
        if found is None:
            torn += 1
        else:
            seen[found.group(1)].append(int(found.group(2)))
    assert torn == 0, f"{torn} torn lines"
    assert seen == {name: list(range(lines)) for name in seen}


@pytest.mark.parametrize("part", ["x", "%01", "%F0%9F%98%80"])
async def test_an_access_log_line_of_the_longest_path_fits_one_whole_write(
    caplog: pytest.LogCaptureFixture, part: str
) -> None:
    """A request line may be 8 KiB (``--max-header-bytes``), and a path's characters up to 12
    bytes each as the line's JSON writes them: the line took up to 16 KiB, past the write a
    pipe keeps whole, so another worker's lines could still go into its middle."""
    caplog.set_level(logging.INFO, logger="replystream.access")
    path = "/" + part * (8000 // len(part))
    async with running(create_app(fast_engine())) as url:
        await (await raw_request(f"{url}{path}")).read_body()
        await wait_for(lambda: any(r.name == "replystream.access" for r in caplog.records))
    (record,) = (r for r in caplog.records if r.name == "replystream.access")
    line = logging.Formatter(FORMAT).format(record) + "\n"
    assert len(line.encode()) <= select.PIPE_BUF  # (4096 on Linux)
    said, decoded = json.loads(record.getMessage()), unquote(path)
    assert said["status"] == 404
    assert said["path"].startswith(decoded[:100])
    assert said["path"].endswith(f"… ({len(decoded)} characters)")
