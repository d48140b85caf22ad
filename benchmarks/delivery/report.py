"""The benchmark's table: every metric per server and concurrency, with replystream's ratios.

Printed as a Markdown table so a run can be pasted into docs/performance.md as it is. Ratios
compare columns of the same transport (replystream ws / bare ws, never ws / sse); the
WebSocket upgrade rows appear only when a WebSocket run is in the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Run = dict[str, Any]
RATIO_METRICS = ("server CPU s / 1,000 events", "server memory / stream (KiB)", "completion p95")
# Only in a table with a Redis-backed server: the rows its Redis and nginx fill in.
TIER_ROWS = ("Redis CPU µs / event", "Redis memory / reply logged (KiB)", "nginx CPU µs / event")


def _get(run: Run, key: str) -> float:
    """A metric only some servers have (Redis's, nginx's): NaN for the others."""
    value = run.get(key)
    return math.nan if value is None else float(value)


def _ms(section: str, point: str) -> Callable[[Run], float]:
    return lambda run: float(run["client"][section][point])


ROWS: list[tuple[str, Callable[[Run], float], str]] = [
    ("streams completed", lambda r: r["client"]["completed"], "{:,.0f}"),
    ("failures", lambda r: r["client"]["failed"], "{:,.0f}"),
    ("connect retries", lambda r: r["client"]["connect_retries"], "{:,.0f}"),
    ("listen queue overflows (kernel)", lambda r: r["listen_overflows"], "{:,.0f}"),
    ("peak streams open at once", lambda r: r["client"]["peak_open"], "{:,.0f}"),
    ("events / s delivered", lambda r: r["client"]["events_per_s"], "{:,.0f}"),
    ("completion median (ms)", _ms("completion_ms", "p50"), "{:,.0f}"),
    ("completion p95", _ms("completion_ms", "p95"), "{:,.0f}"),
    ("ideal completion median / p95", lambda r: math.nan, ""),
    ("lateness p50 (ms)", _ms("lateness_ms", "p50"), "{:,.1f}"),
    ("lateness p95", _ms("lateness_ms", "p95"), "{:,.1f}"),
    ("lateness p99", _ms("lateness_ms", "p99"), "{:,.1f}"),
    ("first text median (ms)", _ms("first_text_ms", "p50"), "{:,.1f}"),
    ("first text p95", _ms("first_text_ms", "p95"), "{:,.1f}"),
    ("WebSocket upgrade median (ms)", _ms("upgrade_ms", "p50"), "{:,.1f}"),
    ("WebSocket upgrade p95", _ms("upgrade_ms", "p95"), "{:,.1f}"),
    ("server CPU s / 1,000 events", lambda r: r["server_cpu_s_per_1k_events"], "{:.4f}"),
    ("server CPU µs / event", lambda r: r["server_us_per_event"], "{:.1f}"),
    ("server memory / stream (KiB)", lambda r: r["memory_per_stream_kib"], "{:.1f}"),
    ("server memory / peak open stream", lambda r: r["memory_per_open_stream_kib"], "{:.1f}"),
    ("server RSS at rest (MiB)", lambda r: r["rest_rss_kib"] / 1024, "{:.1f}"),
    ("Redis CPU µs / event", lambda r: _get(r, "redis_us_per_event"), "{:.1f}"),
    (
        "Redis memory / reply logged (KiB)",
        lambda r: _get(r, "redis_memory_per_reply_kib"),
        "{:.1f}",
    ),
    ("nginx CPU µs / event", lambda r: _get(r, "proxy_us_per_event"), "{:.1f}"),
    ("client CPU µs / event", lambda r: r["client"]["client_us_per_event"], "{:.1f}"),
    ("other load on the machine (cores)", lambda r: r["other_cores_during"], "{:.2f}"),
]


def _cell(value: float, fmt: str) -> str:
    return "n/a" if math.isnan(value) else fmt.format(value)


def memory_peer(label: str, servers: list[str]) -> str | None:
    """The column a Redis-backed server is compared with: the memory store's, with resumable
    replies if that was measured (the same work but for where the log lives)."""
    kind = label.removeprefix("replystream-redis-2").removeprefix("replystream-redis")
    for peer in (f"replystream-resumable{kind}", f"replystream{kind}"):
        if peer in servers:
            return peer
    return None


def table(runs: list[Run], servers: list[str], concurrencies: list[int]) -> str:
    """The Markdown table of ``runs``; a ratio column per replystream column and baseline,
    and per Redis-backed column against the memory store's."""
    ours_labels = [s for s in servers if s.startswith("replystream")]
    baselines = [s for s in servers if not s.startswith("replystream")]
    transport = {r["server"]: r.get("transport", "sse") for r in runs}
    pairs = [
        (ours, theirs)
        for ours in ours_labels
        for theirs in baselines
        if transport.get(ours) == transport.get(theirs)
    ]
    for label in ours_labels:
        peer = memory_peer(label, servers) if label.startswith("replystream-redis") else None
        if peer is not None and transport.get(label) == transport.get(peer):
            pairs.append((label, peer))
    rows = ROWS if "ws" in transport.values() else [r for r in ROWS if "WebSocket" not in r[0]]
    if not any(r.get("redis_cpu_s") is not None for r in runs):
        rows = [r for r in rows if r[0] not in TIER_ROWS]
    header = ["metric", *servers, *(f"{ours} / {theirs}" for ours, theirs in pairs)]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    by_key = {(r["server"], r["concurrency"]): r for r in runs}
    for concurrency in concurrencies:
        present = {s: by_key[(s, concurrency)] for s in servers if (s, concurrency) in by_key}
        if not present:
            continue
        lines.append(f"| **C = {concurrency:,}** |" + " |" * (len(header) - 1))
        for label, get, fmt in rows:
            if label.startswith("ideal"):
                any_run = next(iter(present.values()))["client"]["ideal_ms"]
                ideal = f"{any_run['p50']:,.0f} / {any_run['p95']:,.0f} (same seeds everywhere)"
                lines.append(f"| {label} | {ideal} |" + " |" * (len(header) - 2))
                continue
            cells = [_cell(get(present[s]), fmt) if s in present else "" for s in servers]
            ratios = []
            for ours_label, baseline in pairs:
                ours, theirs = present.get(ours_label), present.get(baseline)
                if label in RATIO_METRICS and ours is not None and theirs is not None:
                    ratios.append(
                        _cell(get(ours) / get(theirs) if get(theirs) else math.nan, "{:.2f}x")
                    )
                else:
                    ratios.append("")
            lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    return "\n".join(lines)


def failure_notes(runs: list[Run]) -> list[str]:
    """One line per run whose streams failed, with the reasons and their counts."""
    notes = []
    for run in runs:
        failures = run["client"]["failures"]
        if failures:
            reasons = ", ".join(f"{reason} x{count}" for reason, count in failures.items())
            notes.append(f"{run['server']} at C = {run['concurrency']}: {reasons}")
    return notes
