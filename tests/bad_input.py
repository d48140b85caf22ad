"""A ``replystream serve`` process whose log is read, and plain clients to send it bad input.

The server runs as a child process (one per test module), its log (the ``replystream`` and
``aiohttp`` loggers at WARNING and above) going to a file that tests read after each
request: bad input must never leave an ERROR or a traceback there. Requests go over
``http.client`` so any bytes can be sent (no client library fixes them up on the way).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from replystream.lab.local_server import READY_PREFIX

# A fast engine: three tokens a reply, no delays, so a request that passes is over at once.
SERVER_ARGS = (
    "--engine",
    "simulated",
    "--tokens",
    "3",
    "--delay-ms",
    "0",
    "--jitter-ms",
    "0",
    "--first-token-ms",
    "0",
    "--log-level",
    "WARNING",
)
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes

    def error(self) -> dict[str, Any]:
        """The API's error object; fails the test if the body is not in that shape."""
        assert self.content_type == "application/json", (self.status, self.body[:200])
        payload = json.loads(self.body)
        # Anthropic's shape on its route: the same object, under a "type": "error" envelope
        # with the request's id (none for a refusal of the request's head, which has none).
        anthropic_shapes = ({"type", "error"}, {"type", "error", "request_id"})
        assert set(payload) in ({"error"}, *anthropic_shapes), payload
        assert payload.get("type", "error") == "error", payload
        error = payload["error"]
        assert set(error) == ERROR_KEYS, error
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["code"], str) and error["code"]
        assert error["param"] is None or isinstance(error["param"], str)
        return dict(error)


@dataclass
class LoggedServer:
    url: str
    log_path: Path
    _read_upto: int = 0

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname and parts.port
        return parts.hostname, parts.port

    def new_log_problems(self) -> list[str]:
        """Log lines at ERROR or above, or of a traceback, since the last call."""
        text = self.log_path.read_bytes()
        fresh, self._read_upto = text[self._read_upto :], len(text)
        lines = fresh.decode(errors="replace").splitlines()
        return [
            line
            for line in lines
            if " ERROR " in line or " CRITICAL " in line or "Traceback" in line
        ]

    def request(
        self,
        method: str,
        target: str,
        body: bytes = b"",
        headers: dict[str, str | bytes] | list[tuple[str, str | bytes]] | None = None,
    ) -> Answer:
        """One request on its own connection; the whole response is read (a stream to its end).
        ``headers`` as pairs may name a header twice."""
        host, port = self.host_port
        connection = http.client.HTTPConnection(host, port, timeout=30)
        try:
            connection.putrequest(method, target, skip_accept_encoding=True)
            pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
            for name, value in [("Content-Length", str(len(body))), *pairs]:
                connection.putheader(name, value)
            connection.endheaders(body or None)
            response = connection.getresponse()
            return Answer(
                response.status,
                response.getheader("Content-Type", "").split(";")[0],
                response.read(),
            )
        finally:
            connection.close()

    def post_json_text(self, path: str, text: str | bytes, **headers: str) -> Answer:
        body = text.encode() if isinstance(text, str) else text
        return self.request("POST", path, body, {"Content-Type": "application/json", **headers})

    def websocket(self, messages: list[str]) -> list[dict[str, Any]]:
        """Send ``messages`` on one socket; return every message received until each was
        answered and every reply started has ended (the socket must stay open)."""
        return asyncio.run(_websocket_exchange(self.url, messages))


ENDINGS = frozenset({"done", "error", "moderated"})


async def _websocket_exchange(url: str, messages: list[str]) -> list[dict[str, Any]]:
    received: list[dict[str, Any]] = []
    running: set[object] = set()  # tags whose reply has started and not ended
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/v1/ws") as ws:
        for message in messages:
            await ws.send_str(message)
        # Answered once every message before it was taken (messages are taken in order).
        await ws.send_str(json.dumps({"type": "cancel", "id": "\x00last"}))
        answered = False
        async with asyncio.timeout(20):
            while True:  # until quiet for a moment, every message answered, every reply ended
                try:
                    msg = await asyncio.wait_for(ws.receive(), 0.2)
                except TimeoutError:
                    if answered and not running:
                        break
                    continue
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                payload = json.loads(msg.data)
                received.append(payload)
                tag = payload.get("id")
                if payload.get("type") == "reply":
                    running.add(tag)
                elif payload.get("type") in ENDINGS:
                    running.discard(tag)
                answered = answered or tag == "\x00last"
        assert not ws.closed
    return received


@contextlib.contextmanager
def logged_server(
    workdir: Path, *extra: str, engine: Sequence[str] = SERVER_ARGS
) -> Iterator[LoggedServer]:
    """``replystream serve`` with ``engine``'s arguments (a fast simulated engine unless
    given), its log in ``workdir``."""
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "replystream", "serve", "--port", "0", *engine, *extra],
            stdout=subprocess.PIPE,
            stderr=log,
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()
        assert line.startswith(READY_PREFIX), (line, log_path.read_text())
        yield LoggedServer(line[len(READY_PREFIX) :].strip(), log_path)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
