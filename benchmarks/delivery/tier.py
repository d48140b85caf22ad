"""The distributed tier of the delivery benchmark: a Redis and an nginx started for one run.

replystream's Redis-backed servers keep every resumable reply's log in Redis Streams. For
each run the benchmark starts a fresh ``redis-server`` on a free loopback port (no
persistence, so its CPU is the log's alone, and its memory starts empty), and, for two
replicas, one nginx process in front of them (round robin, no buffering, as
docs/deploy/replicas.md configures it). Both are stopped with the run. Nothing here knows
about the load or the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from replystream.lab.local_server import owned_child, stop_process

READY_TIMEOUT_S = 15.0


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


# Where a program is looked for past PATH, as the tests look: Debian installs daemons in sbin,
# which is not on every user's PATH.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def find_binary(name: str) -> str | None:
    """The path of program ``name`` (``redis-server``, ``nginx``), None if not installed."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN_DIRS))


def binary(name: str) -> str:
    """The path of program ``name``; a run without it cannot measure this server."""
    found = find_binary(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed: the Redis-backed servers need it")
    return found


@dataclass(frozen=True, slots=True)
class RedisProcess:
    """A running redis-server: where it listens, and its process (its CPU is read by pid)."""

    pid: int
    url: str

    async def used_memory(self) -> int:
        """Bytes Redis has allocated for data now (``INFO memory``'s ``used_memory``)."""
        client = aioredis.Redis.from_url(self.url)
        try:
            info = await client.info("memory")
        finally:
            await client.aclose()
        return int(info["used_memory"])


async def _wait_listening(port: int, process: asyncio.subprocess.Process, what: str) -> None:
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"{what} exited with status {process.returncode}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                await writer.wait_closed()
                return
    except TimeoutError:
        raise RuntimeError(f"{what} did not listen within {READY_TIMEOUT_S:.0f} s") from None


@contextlib.asynccontextmanager
async def started_redis() -> AsyncIterator[RedisProcess]:
    """A fresh redis-server on a free loopback port, without persistence; stopped on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as workdir:
        command = [binary("redis-server"), "--port", str(port)]
        command += ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
        command += ["--maxclients", "10000"]
        process = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            **owned_child(),
        )
        try:
            await _wait_listening(port, process, "redis-server")
            yield RedisProcess(process.pid, f"redis://127.0.0.1:{port}/0")
        finally:
            await stop_process(process)


_NGINX = """daemon off;
master_process off;
worker_rlimit_nofile {nofile};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log error;
events {{ worker_connections {connections}; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream replicas {{
{servers}
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://replicas;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""


@dataclass(frozen=True, slots=True)
class ProxyProcess:
    pid: int
    url: str


@contextlib.asynccontextmanager
async def started_nginx(upstreams: Sequence[str], nofile: int) -> AsyncIterator[ProxyProcess]:
    """One nginx process balancing ``upstreams`` (``host:port``) round robin; stopped on exit.

    One process (``master_process off``), so its CPU is read from one pid; its connection
    limit is set for two sockets per stream (the client's and the replica's)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as workdir:
        tmp = Path(workdir)
        servers = "\n".join(f"        server {upstream};" for upstream in upstreams)
        conf = tmp / "nginx.conf"
        conf.write_text(
            _NGINX.format(
                tmp=tmp,
                nofile=nofile,
                connections=max(1024, nofile // 2),
                servers=servers,
                port=port,
            )
        )
        command = [binary("nginx"), "-p", workdir, "-c", str(conf)]
        process = await asyncio.create_subprocess_exec(
            *command,
            "-e",
            str(tmp / "error.log"),
            stderr=asyncio.subprocess.DEVNULL,
            **owned_child(),
        )
        try:
            await _wait_listening(port, process, "nginx")
            yield ProxyProcess(process.pid, f"http://127.0.0.1:{port}")
        finally:
            await stop_process(process)
