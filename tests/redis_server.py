"""A real redis-server on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.services import free_port, require_binary


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisServer:
    def __init__(
        self, workdir: Path, *, cluster: bool = False, extra: tuple[str, ...] = ()
    ) -> None:
        self.binary = require_binary("redis-server", "redis-server")
        self.workdir = workdir
        self.port = cluster_port() if cluster else free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.extra = extra  # more redis-server options (--maxmemory, --replicaof...)
        if cluster:
            self.extra += ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing flushed, as a crashed primary."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def redis_server(workdir: Path, *extra: str) -> Iterator[RedisServer]:
    server = RedisServer(workdir, extra=extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisCluster:
    """A real Redis Cluster on loopback: ``shards`` primaries, each with ``replicas`` replicas,
    made by ``redis-cli --cluster create`` as an operator would."""

    def __init__(self, workdir: Path, shards: int = 3, replicas: int = 1) -> None:
        self.cli = require_binary("redis-cli", "redis-tools")
        self.nodes = [
            RedisServer(workdir / f"node{n}", cluster=True) for n in range(shards * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(self._state_ok(node) for node in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def _state_ok(self, node: RedisServer) -> bool:
        info = subprocess.run(
            [self.cli, "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout
        return b"cluster_state:ok" in info

    def command(self, *args: str) -> str:
        """One redis-cli command to the cluster (following redirections)."""
        result = subprocess.run(
            [self.cli, "-c", "-p", str(self.nodes[0].port), *args],
            capture_output=True,
            timeout=10,
            check=True,
        )
        return result.stdout.decode().strip()

    def owner_of(self, key: str) -> str:
        """The ``host:port`` of the primary that holds ``key``'s slot."""
        slot = int(self.command("cluster", "keyslot", key))
        for line in self.command("cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return fields[1].split("@", 1)[0]
        raise LookupError(f"no primary holds slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def redis_cluster(workdir: Path, shards: int = 3, replicas: int = 1) -> Iterator[RedisCluster]:
    cluster = RedisCluster(workdir, shards, replicas)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
