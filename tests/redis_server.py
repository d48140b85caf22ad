"""A real redis-server on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.services import require_binary

# Below Linux's ephemeral range (32768 and up, where the kernel picks ports for outgoing
# connections and for port 0), so a port and its cluster bus port (10000 above) are not taken
# by some test's client socket between choosing them and redis-server binding them.
PORTS = range(10000, 22768)


def redis_port(*, cluster: bool = False) -> int:
    """A loopback port free now (and its cluster bus port too, for a cluster node)."""
    while True:
        port = random.choice(PORTS)
        if all(_free(p) for p in ((port, port + 10000) if cluster else (port,))):
            return port


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisServer:
    """One redis-server, on loopback unless ``host`` names another address of this machine;
    ``launcher`` is the words that run a command where it must run (``Namespace.inside``: on
    a network of its own), none for here."""

    def __init__(
        self,
        workdir: Path,
        *,
        cluster: bool = False,
        extra: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.binary = require_binary("redis-server", "redis-server")
        self.workdir = workdir
        self.host = host
        self.launcher = launcher
        if host != "127.0.0.1":  # else clients from other addresses are refused, no password
            extra += ("--protected-mode", "no")
        self.cluster = cluster
        self.port = redis_port(cluster=cluster)
        self.process: subprocess.Popen[bytes] | None = None
        self.started = False  # once started, the port is known to others and never moves
        self.extra = extra  # more redis-server options (--maxmemory, --replicaof...)
        if cluster:
            self.extra += ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        """Start and wait for PONG. Another process can take the chosen port before
        redis-server binds it; on a first start that is met with a new port."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._spawn():
                self.started = True
                return
            exited = self.process is not None and self.process.poll() is not None
            self.stop()
            if self.started or not exited:
                break
            self.port = redis_port(cluster=self.cluster)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _spawn(self) -> bool:
        """Run redis-server; True once it answers PING, False if it exits or stays silent."""
        self.process = subprocess.Popen(
            [
                *self.launcher,
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                self.host,
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
            # Out of the terminal's reach: a Ctrl-C stops the tests or the benchmark (whose
            # loop may be waiting on a start here), which stops this; stopped under them by it
            # too, a Redis or Sentinel being set up failed the start 30 s later.
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), timeout=0.2) as sock,
            ):
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return True
            time.sleep(0.05)
        return False

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
    made by ``redis-cli --cluster create`` as an operator would (its nodes at ``host``, run
    with ``launcher``, as ``RedisServer``'s)."""

    def __init__(
        self,
        workdir: Path,
        shards: int = 3,
        replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
    ) -> None:
        self.cli = require_binary("redis-cli", "redis-tools")
        self.host = host
        self.nodes = [
            RedisServer(workdir / f"node{n}", cluster=True, host=host, launcher=launcher)
            for n in range(shards * (1 + replicas))
        ]
        self.replicas = replicas

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes[:3])

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"{self.host}:{n.port}" for n in self.nodes]
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
            [self.cli, "-h", self.host, "-p", str(node.port), "cluster", "info"],
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout
        return b"cluster_state:ok" in info

    def command(self, *args: str) -> str:
        """One redis-cli command to the cluster (following redirections)."""
        result = subprocess.run(
            [self.cli, "-c", "-h", self.host, "-p", str(self.nodes[0].port), *args],
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
def redis_cluster(
    workdir: Path,
    shards: int = 3,
    replicas: int = 1,
    *,
    host: str = "127.0.0.1",
    launcher: tuple[str, ...] = (),
) -> Iterator[RedisCluster]:
    cluster = RedisCluster(workdir, shards, replicas, host=host, launcher=launcher)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


class RedisWithSentinel:
    """A primary, a replica of it, and Sentinels watching them (Debian's ``redis-sentinel``),
    on loopback, tuned to fail over within a few seconds of the primary dying."""

    SERVICE = "replystream"

    def __init__(self, workdir: Path, sentinels: int = 1, down_after_ms: int = 1000) -> None:
        self.sentinel_binary = require_binary("redis-sentinel", "redis-sentinel")
        self.workdir = workdir
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(workdir / "replica")
        self.sentinel_ports = [redis_port() for _ in range(sentinels)]
        self.down_after_ms = down_after_ms
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.SERVICE}/0"

    def start(self) -> None:
        try:
            self.primary.start()
            # Named only now: the primary's first start may have moved it to another port.
            self.replica.extra += ("--replicaof", "127.0.0.1", str(self.primary.port))
            self.replica.start()
            for n, port in enumerate(self.sentinel_ports):
                self.sentinels.append(self._start_sentinel(n, port))
            self._wait_for(self._replica_in_sync, "the replica to sync with the primary")
            self._wait_for(self._replicas_known, "Sentinel to see the replica")
        except BaseException:
            self.stop()
            raise

    def _start_sentinel(self, n: int, port: int) -> subprocess.Popen[bytes]:
        folder = self.workdir / f"sentinel{n}"
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.SERVICE} 10000\n"
            f"sentinel parallel-syncs {self.SERVICE} 1\n"
        )
        return subprocess.Popen(
            [self.sentinel_binary, str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # as a RedisServer's
        )

    def _sentinel(self, *args: str) -> str:
        cli = require_binary("redis-cli", "redis-tools")
        result = subprocess.run(
            [cli, "-p", str(self.sentinel_ports[0]), "sentinel", *args],
            capture_output=True,
            timeout=10,
            check=False,
        )
        return result.stdout.decode()

    def _replica_in_sync(self) -> bool:
        cli = require_binary("redis-cli", "redis-tools")
        info = subprocess.run(
            [cli, "-p", str(self.replica.port), "info", "replication"],
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout
        return b"master_link_status:up" in info

    def _replicas_known(self) -> bool:
        return f"{self.replica.port}" in self._sentinel("replicas", self.SERVICE)

    def primary_port(self) -> int:
        """The port Sentinel names as the primary now."""
        lines = self._sentinel("get-master-addr-by-name", self.SERVICE).split()
        return int(lines[1]) if len(lines) == 2 else 0

    def fail_over(self) -> None:
        """``SENTINEL FAILOVER``: the replica is promoted with the primary still up (which
        Sentinel makes a replica only later); returns once Sentinel names the new one. Asked
        again while Sentinel finds no replica it may promote yet (``NOGOODSLAVE``: it has not
        heard from it for long enough)."""
        self._wait_for(
            lambda: self._sentinel("failover", self.SERVICE).startswith("OK"), "a failover"
        )
        self.wait_for_failover()
        # Named above while the failover ends; its state (what clients ask) once it switched.
        switched = f"port\n{self.replica.port}\n"
        self._wait_for(lambda: switched in self._sentinel("master", self.SERVICE), "the switch")

    def wait_for_failover(self, timeout_s: float = 30) -> None:
        self._wait_for(lambda: self.primary_port() == self.replica.port, "a failover", timeout_s)

    def _wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.1)
        raise RuntimeError(f"waited {timeout_s:g}s for {what}")

    def stop(self) -> None:
        for process in self.sentinels:
            if process.poll() is None:
                process.terminate()
                process.wait(10)
        self.sentinels = []
        self.replica.stop()
        self.primary.stop()


@contextlib.contextmanager
def redis_with_sentinel(workdir: Path, sentinels: int = 1) -> Iterator[RedisWithSentinel]:
    running = RedisWithSentinel(workdir, sentinels)
    running.start()
    try:
        yield running
    finally:
        running.stop()
