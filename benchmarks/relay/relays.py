"""The relay benchmark's processes: the upstream, and each relay in front of it on one process.

What this file decides: how each target is started fresh, configured alike (one process, no
access log, streaming passed through), and known to be ready:
- ``upstream``: ``upstream_server.py`` (the fixed schedule), also measured directly;
- ``replystream``: ``replystream serve --engine upstream:URL --upstream-model bench``;
- ``litellm``: LiteLLM's proxy (``litellm --config``), one uvicorn worker, the upstream as an
  ``openai/`` model with its ``api_base``; offline: the bundled model cost map, no telemetry,
  no database;
- ``nginx``: ``proxy_pass`` with ``proxy_buffering off`` and upstream keep-alive, one worker
  process (``master_process off``), the floor for any relay;
- ``pipe``: ``byte_pipe.py``, bytes piped through asyncio with nothing parsed, on the same
  loop as replystream: the floor for any relay written in Python;
- ``parse-pipe``: ``byte_pipe.py --parse``, the same pipe parsing each chunk and writing one
  of its own, nothing else: the floor for a Python relay that reads what it relays;
- ``native``: not a relay: replystream making the same replies itself (the simulated engine,
  the upstream's words on the upstream's schedule, no jitter), on the same route, loop and
  process count as the ``replystream`` relay: what native delivery costs beside relaying.
  Its first token is due one interval after the request, or when the upstream sends its
  first if that is later (``first_chunk_ms``): then the two schedules are the same, and
  what native delivery adds to the first token is measured as a relay's is.
A process's output goes to a log file in the run's directory, so no pipe can fill and stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import socket
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from relay.upstream_server import text_of
from replystream.lab.local_server import (
    announced_process,
    owned_child,
    serve_process,
    stop_process,
)

HERE = Path(__file__).resolve().parent
RELAYS = ("replystream", "litellm", "nginx", "pipe", "parse-pipe", "native")
# LiteLLM refuses to start without a master key; every target is sent it (the others ignore it).
API_KEY = "sk-bench-" + secrets.token_hex(24)
READY = re.compile(r"listening on (http://\S+)")

NGINX_CONF = """daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 65536;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log error;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream bench {{ server {upstream}; keepalive 1024; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""

LITELLM_CONF = """model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: {upstream}/v1
      api_key: none
litellm_settings:
  telemetry: false
  drop_params: true
  turn_off_message_logging: true
general_settings:
  master_key: {key}
  disable_spend_logs: true
"""

# LiteLLM offline and quiet: its bundled cost map instead of one fetched at start-up, no
# telemetry, logging at errors only.
LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "DISABLE_SCHEMA_UPDATE": "True",
    "NO_DOCS": "True",
}


@dataclass(frozen=True, slots=True)
class Target:
    """A server the load client streams from: its name, URL and process id."""

    name: str
    url: str
    pid: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_http(url: str, timeout_s: float, process: asyncio.subprocess.Process) -> None:
    """Wait until ``url`` answers 200 (or fail if the process exits first)."""

    def ask() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    async with asyncio.timeout(timeout_s):
        while not await asyncio.to_thread(ask):
            if process.returncode is not None:
                raise RuntimeError(f"{url}: the process exited with {process.returncode}")
            await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def upstream_server(
    processes: int, chunks: int, interval_ms: float, first_chunk_ms: float = 0.0
) -> AsyncIterator[Target]:
    command = [sys.executable, str(HERE / "upstream_server.py"), "--processes", str(processes)]
    command += ["--chunks", str(chunks), "--interval-ms", str(interval_ms)]
    command += ["--first-chunk-ms", str(first_chunk_ms)]
    async with announced_process(command, READY, name="upstream") as server:
        yield Target("upstream", server.url, server.pid)


@contextlib.asynccontextmanager
async def replystream_relay(upstream: str, loop: str, workers: int = 1) -> AsyncIterator[Target]:
    args = ["--engine", f"upstream:{upstream}/v1", "--upstream-model", "bench", "--loop", loop]
    if workers > 1:  # worker processes on one socket (their CPU and memory are counted too)
        args += ["--workers", str(workers)]
    args += ["--model-name", "bench"]  # the name every client of the benchmark asks for
    async with serve_process([*args, "--log-level", "WARNING"]) as server:
        yield Target("replystream", server.url, server.pid)


@contextlib.asynccontextmanager
async def native_server(
    chunks: int, interval_ms: float, loop: str, workers: int = 1, first_chunk_ms: float = 0.0
) -> AsyncIterator[Target]:
    words = " ".join(text_of(index).strip() for index in range(chunks))
    args = ["--engine", "simulated", "--reply-text", words, "--tokens", str(chunks)]
    args += ["--delay-ms", f"{interval_ms:g}", "--jitter-ms", "0", "--loop", loop]
    # The simulated engine's first token comes one delay after its own first-token time.
    args += ["--first-token-ms", f"{max(0.0, first_chunk_ms - interval_ms):g}"]
    if workers > 1:
        args += ["--workers", str(workers)]
    args += ["--model-name", "bench", "--log-level", "WARNING"]
    async with serve_process(args) as server:
        yield Target("native", server.url, server.pid)


@contextlib.asynccontextmanager
async def pipe_relay(upstream: str, loop: str, parse: bool) -> AsyncIterator[Target]:
    name = "parse-pipe" if parse else "pipe"
    command = [sys.executable, str(HERE / "byte_pipe.py"), "--upstream", upstream.split("//")[1]]
    command += ["--loop", loop, *(["--parse"] if parse else [])]
    async with announced_process(command, READY, name=name) as server:
        yield Target(name, server.url, server.pid)


@contextlib.asynccontextmanager
async def spawned(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, **owned_child()
        )
    try:
        yield process
    finally:
        await stop_process(process)


def nginx_binary() -> str | None:
    """Where nginx is (sbin is not on every user's PATH); None if it is not installed."""
    return shutil.which("nginx") or shutil.which("/usr/sbin/nginx")


@contextlib.asynccontextmanager
async def nginx_relay(upstream: str, tmp: Path) -> AsyncIterator[Target]:
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed")
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=upstream.split("//")[1]))
    async with spawned([binary, "-c", str(conf), "-p", str(tmp)], tmp / "nginx.log") as process:
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"{url}/v1/models", 30, process)
        yield Target("nginx", url, process.pid)


@contextlib.asynccontextmanager
async def litellm_relay(upstream: str, tmp: Path, binary: str) -> AsyncIterator[Target]:
    port = free_port()
    conf = tmp / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(upstream=upstream, key=API_KEY))
    command = [binary, "--config", str(conf), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--num_workers", "1"]
    env = {**os.environ, **LITELLM_ENV}
    env.pop("PYTHONPATH", None)  # its own environment, not our source tree
    async with spawned(command, tmp / "litellm.log", env) as process:
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"{url}/health/liveliness", 180, process)  # needs no key
        yield Target("litellm", url, process.pid)
