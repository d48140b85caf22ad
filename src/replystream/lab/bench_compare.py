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
from rich.markup import escape
from rich.table import Table

_LATENCY = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms"))


def load_result(path: Path) -> dict[str, Any]:
    """A result ``--json`` wrote; raises ValueError naming the file when it is not one."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file bench wrote ({exc})") from None
    except RecursionError:  # json.loads recurses; a file may nest past the limit
        raise ValueError(f"{path}: not a JSON file bench wrote (nested too deeply)") from None
    if not isinstance(result, dict) or not ("sweep" in result or "ttft_ms" in result):
        raise ValueError(f"{path}: not a result bench wrote with --json")
    return result


_SWEEP = (
    ("synchronous rate (req/s)", "synchronous_rate"),
    ("max throughput (req/s)", "max_throughput_rate"),
    ("knee (req/s)", "knee_rate"),
)


def rows(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")
) -> list[tuple[str, float | None, float | None]]:
    """(figure, A's value, B's value) for two single runs or two sweeps; raises ValueError
    for a run and a sweep, which share no figures, or for a file (named by ``names``) that
    lacks a figure."""
    if ("sweep" in a) != ("sweep" in b):
        raise ValueError("one file holds a sweep and the other a single run: nothing to compare")
    first, second = _figures(a, names[0]), _figures(b, names[1])
    return [(label, value, second[label]) for label, value in first.items()]


def _figures(result: dict[str, Any], name: str) -> dict[str, float | None]:
    """The figures compared, by label; raises ValueError naming ``name`` when one is missing
    or is not a number (a file edited, cut, or written by something else)."""
    try:
        if "sweep" in result:
            found = {label: result["sweep"][key] for label, key in _SWEEP}
        else:
            found = {
                f"{label} {stat} (ms)": result[key][stat]
                for label, key in _LATENCY
                for stat in ("p50", "p90", "p99")
            }
            found["requests/s"] = result["throughput"]["requests_per_s"]
            found["tokens/s"] = result["throughput"]["output_tokens_per_s"]
            found["good share (%)"] = result["goodput"]["share_of_requests"]
    except (KeyError, TypeError) as exc:
        why = f"no {exc}" if isinstance(exc, KeyError) else "a figure is not where bench puts it"
        raise ValueError(f"{name}: not a result bench wrote with --json ({why})") from None
    for label, value in found.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{name}: not a result bench wrote with --json ({label}: {value!r})")
    share = found.get("good share (%)")
    if share is not None:
        found["good share (%)"] = 100 * share
    return found


def render_compare(paths: tuple[Path, Path], console: Console) -> None:
    """Print A and B side by side; raises ValueError for files that cannot be compared."""
    a, b = (load_result(path) for path in paths)
    table = Table(title=escape(f"bench: A = {paths[0]}, B = {paths[1]}"))
    for column in ("Figure", "A", "B", "B / A"):
        table.add_column(column, justify="left" if column == "Figure" else "right")
    for label, first, second in rows(a, b, (str(paths[0]), str(paths[1]))):
        ratio = "-"
        if first is not None and second is not None and first != 0:
            ratio = f"{second / first:,.2f}"
        table.add_row(label, _cell(first), _cell(second), ratio)
    console.print(table)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"
