"""CPU time and memory of a process tree, read from Linux's /proc.

A server may be one process or a parent with worker children, so every reading sums over the
process and all its descendants (found by scanning the ppid field of /proc/*/stat).
"""

from __future__ import annotations

import os
import re
import resource
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (children inherit it)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _stat_fields(pid: int) -> list[str]:
    # The command name is in parentheses and may hold spaces; fields after it split cleanly.
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    tree = [pid]
    for parent in tree:
        tree.extend(children.get(parent, []))
    return tree


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """User and system CPU seconds used so far by ``pids`` (utime, stime)."""
    user = system = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        user += int(fields[11])  # stat field 14
        system += int(fields[12])  # stat field 15
    return user / CLOCK_TICKS, system / CLOCK_TICKS


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds used so far by ``pids`` (utime + stime)."""
    return sum(cpu_split(pids))


def memory_kib(pids: list[int], field: str) -> int:
    """The sum of a /proc/PID/status memory field (``VmRSS``, ``VmHWM``) over ``pids``."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
        if found:
            total += int(found.group(1))
    return total


def listen_overflows() -> int:
    """The kernel's count of connections dropped from full listen queues (all sockets).

    A server whose accept queue is too short for a burst loses the handshake's last packet;
    the client believes it is connected and waits for the retransmitted SYN-ACK, seconds later.
    """
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(fields.get("ListenOverflows", 0))
    return 0


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O), all cores."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS
