"""The soak's server: a ``replystream serve`` child process, what it holds, and its metrics.

Memory and file descriptors are read from Linux ``/proc``; asyncio tasks, KV blocks, reply
logs and replies by outcome from the server's own ``/metrics`` gauges and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from replystream.client.transport import http_request
from replystream.lab.local_server import LocalServer

# Gauges the server exposes about what it holds (``replystream.server.state``).
GAUGES = {
    "tasks": "replystream_open_tasks",
    "readers": "replystream_open_readers",
    "in_flight": "replystream_replies_in_flight",
    "engine_requests": "replystream_engine_requests",
    "kv_blocks": "replystream_kv_blocks_used",
    "local_logs": 'replystream_reply_logs{store="local"}',
    "resumable_logs": 'replystream_reply_logs{store="resumable"}',
}
FD_POLL_S = 0.05
_OUTCOME = re.compile(
    r'^replystream_replies_total\{endpoint="([^"]*)",outcome="([^"]*)"\} (\S+)$', re.MULTILINE
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the server holds at one moment."""

    rss_kib: int
    peak_rss_kib: int  # the most RSS the server has had so far
    fds: int
    gauges: dict[str, float]

    def line(self) -> str:
        g = self.gauges
        return (
            f"RSS {self.rss_kib / 1024:7.1f} MiB, fds {self.fds:4d}, "
            f"tasks {g['tasks']:4.0f}, readers {g['readers']:3.0f}, "
            f"in flight {g['in_flight']:3.0f}, engine requests {g['engine_requests']:3.0f}, "
            f"KV blocks {g.get('kv_blocks', 0):4.0f}, "
            f"reply logs {g['local_logs']:.0f}+{g.get('resumable_logs', 0):.0f}"
        )


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident memory now (``VmRSS``), or its peak since the process started (``VmHWM``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert found
    return int(found.group(1))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def lasting_fds(pid: int, within_s: float = 0.5) -> int:
    """The descriptors a quiet server holds for good: the fewest seen over ``within_s``. A
    connection its client has just closed (a scrape of ``/metrics``, the request before it)
    is still open for a moment, until the server reads the close: counted once, at the
    baseline or at the end at random, it failed the check on a healthy server."""
    fewest = open_fds(pid)
    for _ in range(int(within_s / FD_POLL_S)):
        await asyncio.sleep(FD_POLL_S)
        fewest = min(fewest, open_fds(pid))
    return fewest


def holds_connection(pid: int, peer_port: int) -> bool:
    """Whether process ``pid`` still has a socket open to a loopback peer on ``peer_port``.

    Reads the kernel's TCP table (``/proc/net/tcp``, ``tcp6``) for a socket whose remote port
    is ``peer_port`` and looks for its inode among the process's descriptors. A socket the
    process closed may linger in the kernel (unsent data), but with no descriptor.
    """
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == peer_port and fields[9] != "0":
                    inodes.add(fields[9])
    if not inodes:
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


async def metrics_text(url: str) -> str:
    async with http_request(f"{url}/metrics") as response:
        return b"".join([chunk.data async for chunk in response]).decode()


def gauge(text: str, name: str) -> float | None:
    found = re.search("^" + re.escape(name) + r" (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def outcomes(text: str) -> dict[str, int]:
    """Replies the server counted, by how they ended (all endpoints together)."""
    counts: dict[str, int] = {}
    for _endpoint, outcome, value in _OUTCOME.findall(text):
        counts[outcome] = counts.get(outcome, 0) + int(float(value))
    return counts


async def snapshot(server: LocalServer, *, quiet: bool = False) -> Snapshot:
    """Memory and descriptors from /proc, the rest from the server's gauges. ``quiet``: the
    server is idle, and its descriptors are those it keeps (``lasting_fds``).

    Raises:
        RuntimeError: the server does not expose the state gauges.
    """
    text = await metrics_text(server.url)
    gauges: dict[str, float] = {}
    for key, name in GAUGES.items():
        value = gauge(text, name)
        if value is not None:
            gauges[key] = value
    missing = {"tasks", "readers", "in_flight", "engine_requests", "local_logs"} - set(gauges)
    if missing:
        raise RuntimeError(f"the server exposes no {sorted(missing)} gauges (/metrics)")
    pid = server.pid
    fds = await lasting_fds(pid) if quiet else open_fds(pid)
    return Snapshot(rss_kib(pid), rss_kib(pid, "VmHWM"), fds, gauges)
