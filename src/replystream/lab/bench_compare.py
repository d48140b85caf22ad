"""``replystream bench --compare A.json B.json``: two runs side by side, with B / A ratios.

This file decides which figures two saved results are compared on (latency percentiles,
throughput, goodput; for two sweeps, the synchronous rate, the maximum and the knee) and how
the table looks. It reads only what ``--json`` wrote and must not compute a metric itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

_LATENCY = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms"))


def load_result(path: Path) -> dict[str, Any]:
    """A result ``--json`` wrote; raises ValueError naming the file when it is not one."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file bench wrote ({exc})") from None
    if not isinstance(result, dict) or not ("sweep" in result or "ttft_ms" in result):
        raise ValueError(f"{path}: not a result bench wrote with --json")
    return result


def rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """(figure, A's value, B's value) for two single runs or two sweeps; raises ValueError
    for a run and a sweep, which share no figures."""
    if ("sweep" in a) != ("sweep" in b):
        raise ValueError("one file holds a sweep and the other a single run: nothing to compare")
    if "sweep" in a:
        keys = (
            ("synchronous rate (req/s)", "synchronous_rate"),
            ("max throughput (req/s)", "max_throughput_rate"),
            ("knee (req/s)", "knee_rate"),
        )
        return [(label, a["sweep"][key], b["sweep"][key]) for label, key in keys]
    out: list[tuple[str, float | None, float | None]] = []
    for label, key in _LATENCY:
        for stat in ("p50", "p90", "p99"):
            out.append((f"{label} {stat} (ms)", a[key][stat], b[key][stat]))
    out.append(("requests/s", a["throughput"]["requests_per_s"], b["throughput"]["requests_per_s"]))
    out.append(
        ("tokens/s", a["throughput"]["output_tokens_per_s"], b["throughput"]["output_tokens_per_s"])
    )
    out.append(
        (
            "good share (%)",
            100 * a["goodput"]["share_of_requests"],
            100 * b["goodput"]["share_of_requests"],
        )
    )
    return out


def render_compare(paths: tuple[Path, Path], console: Console) -> None:
    """Print A and B side by side; raises ValueError for files that cannot be compared."""
    a, b = (load_result(path) for path in paths)
    table = Table(title=f"bench: A = {paths[0]}, B = {paths[1]}")
    for column in ("Figure", "A", "B", "B / A"):
        table.add_column(column, justify="left" if column == "Figure" else "right")
    for label, first, second in rows(a, b):
        ratio = "-"
        if first is not None and second is not None and first != 0:
            ratio = f"{second / first:,.2f}"
        table.add_row(label, _cell(first), _cell(second), ratio)
    console.print(table)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"
