"""The console report of ``replystream bench``: one table of distributions, then the counts.

This file decides how a summary (``benchstats.summarize``) is shown to a person; it must not
compute any metric itself.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from replystream.lab.benchstats import DEFINITIONS
from replystream.stats import PERCENTILES

_ROWS = (
    ("TTFT", "ttft_ms"),
    ("TPOT", "tpot_ms"),
    ("ITL (gaps)", "itl_ms"),
    ("E2EL", "e2el_ms"),
    ("First byte", "first_byte_ms"),
    ("First chunk", "first_chunk_ms"),
    ("Tokens/event", "tokens_per_event"),
)


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}" if unit == "ms" else f"{value:,.2f}"


def render(summary: dict[str, Any], console: Console) -> None:
    """Print the distributions table, their definitions, counts, throughput and client CPU."""
    config = summary["config"]
    table = Table(title=f"bench {config['url']} ({config['api']}, {config['mode']})")
    columns = ["Metric", "n", "mean", *(f"p{p}" for p in PERCENTILES), "min", "max"]
    for column in columns:
        table.add_column(column, justify="left" if column == "Metric" else "right", no_wrap=True)
    for label, key in _ROWS:
        dist = summary[key]
        unit = "ms" if key.endswith("_ms") else ""
        name = f"{label} (ms)" if unit else label
        values = [dist["mean"], *(dist[f"p{p}"] for p in PERCENTILES), dist["min"], dist["max"]]
        table.add_row(name, str(dist["count"]), *(_cell(v, unit) for v in values))
    console.print(table)
    for label, key in _ROWS:
        console.print(f"  [bold]{label}[/]: {DEFINITIONS[key]}", highlight=False)
    console.print(f"  Percentiles: {summary['percentile_method']}.", highlight=False)

    counts = summary["counts"]
    console.print(
        f"Requests: {counts['requests']} sent, {counts['complete']} complete, "
        f"{counts['incomplete']} incomplete, {counts['failed']} failed",
        highlight=False,
    )
    for kind in ("incomplete", "failed"):
        for reason, n in counts[f"{kind}_reasons"].items():
            console.print(f"  {kind}: {n} x {reason}", highlight=False, markup=False)
    rate = summary["throughput"]
    console.print(
        f"Throughput over {rate['wall_s']:,.2f} s: {rate['requests_per_s']:,.2f} req/s, "
        f"{rate['output_tokens_per_s']:,.1f} tokens/s, {rate['events_per_s']:,.1f} events/s",
        highlight=False,
    )
    goodput = summary["goodput"]
    if goodput["slos"]:
        slos = " and ".join(f"{k} <= {v:g} ms" for k, v in goodput["slos"].items())
        console.print(
            f"Goodput ({slos}): {goodput['good_requests']} requests, "
            f"{goodput['requests_per_s']:,.2f} req/s "
            f"({100 * goodput['share_of_requests']:.1f} % of requests)",
            highlight=False,
        )
    client = summary["client"]
    share = client["cpu_share_of_one_core"]
    warning = "  [bold red]the client may be the bottleneck[/]" if share > 0.8 else ""
    console.print(
        f"Load client CPU: {client['cpu_s']:,.2f} s over {rate['wall_s']:,.2f} s wall = "
        f"{100 * share:.1f} % of one core{warning}",
        highlight=False,
    )
