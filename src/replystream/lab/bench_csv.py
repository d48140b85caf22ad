"""``--csv FILE``: one row per request of a run or a sweep, for a spreadsheet.

This file decides the columns (the per-request entries of the JSON, flattened; a sweep adds
which run each request belongs to). It must not compute a metric itself.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from replystream.lab.whole_file import written_whole

COLUMNS = (
    "run",
    "profile",
    "target_rate",
    "index",
    "turn",
    "start_s",
    "scheduled_s",
    "send_lag_ms",
    "warmup",
    "status",
    "complete",
    "error",
    "prompt_words",
    "max_tokens",
    "tokens",
    "events",
    "ttft_ms",
    "tpot_ms",
    "max_itl_ms",
    "e2el_ms",
    "first_byte_ms",
    "first_chunk_ms",
    "reconnect_ms",
    "lost",
    "duplicated",
)


def _runs(result: dict[str, Any]) -> list[tuple[dict[str, Any], float | None]]:
    """(summary, target rate) of each run: a sweep's runs, or the one run."""
    if "runs" in result:
        return [(run["summary"], run["target_rate"]) for run in result["runs"]]
    return [(result, result["config"]["rate"])]


def write_csv(result: dict[str, Any], path: Path) -> None:
    """Write every request of ``result`` (a summary or a sweep) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path, newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        for number, (summary, target) in enumerate(_runs(result)):
            for request in summary["requests"]:
                resume = request["resume"] or {}
                writer.writerow(
                    {
                        **{key: request.get(key) for key in COLUMNS if key in request},
                        "run": number,
                        "profile": summary["config"]["profile"],
                        "target_rate": target,
                        "reconnect_ms": resume.get("reconnect_ms"),
                        "lost": resume.get("lost"),
                        "duplicated": resume.get("duplicated"),
                    }
                )
