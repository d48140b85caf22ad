"""PNG plots of a load run (matplotlib without a display): TTFT CDF, gap histogram, timeline;
and of a sweep: latency against rate, and each run's TTFT and gap distributions.

This file decides how a summary's per-request timings are drawn; it must not compute metrics.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen first, above
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from replystream.lab.bench_config import RUN_PLOTS, SWEEP_PLOTS


def plot_all(summary: dict[str, Any], folder: Path) -> list[Path]:
    """Write ``ttft_cdf.png``, ``gap_histogram.png`` and ``timeline.png``; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    # The requests every figure counts: complete, and sent after the warm-up window.
    done = [r for r in summary["requests"] if r["complete"] and not r.get("warmup", False)]
    paths = [folder / name for name in RUN_PLOTS]
    _ttft_cdf(done, paths[0])
    _gap_histogram(done, paths[1])
    _timeline(summary["requests"], paths[2])
    return paths


def _ttft_cdf(done: list[dict[str, Any]], path: Path) -> None:
    values = sorted(r["ttft_ms"] for r in done if r["ttft_ms"] is not None)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if values:
        shares = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, shares, where="post", color="#2471a3", linewidth=2)
    ax.set_xlabel("TTFT: request sent to first parsed text (ms)")
    ax.set_ylabel("share of complete requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT, cumulative ({len(values)} requests)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _gap_histogram(done: list[dict[str, Any]], path: Path) -> None:
    gaps = [b - a for r in done for a, b in itertools.pairwise(r["text_event_ms"])]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if gaps:
        ax.hist(gaps, bins=min(60, max(5, len(gaps) // 10)), color="#2471a3")
    ax.set_xlabel("gap between consecutive text events (ms)")
    ax.set_ylabel("gaps")
    ax.set_title(f"Inter-event gaps ({len(gaps)} gaps, all requests)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _timeline(requests: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, max(3.0, min(12.0, 0.12 * len(requests) + 2))), dpi=110)
    for row, r in enumerate(requests):
        start = r["start_s"] * 1000
        colour = "#2471a3" if r["complete"] else "#c0392b"
        ax.plot([start, start + r["e2el_ms"]], [row, row], color=colour, linewidth=1.5)
        if r["ttft_ms"] is not None:
            ax.plot(start + r["ttft_ms"], row, marker="|", color="black", markersize=6)
    ax.set_xlabel("time since the run started (ms); tick: first text; red: not complete")
    ax.set_ylabel("request")
    ax.set_title("Per-request timeline: sent to end of reply")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sweep(result: dict[str, Any], folder: Path) -> list[Path]:
    """Write ``sweep_latency.png`` (latency and good share against rate, the knee marked) and
    ``sweep_distributions.png`` (each run's TTFT and gap CDFs); return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    return [_sweep_latency(result, folder), _sweep_distributions(result, folder)]


def _run_label(run: dict[str, Any], knee: float | None) -> str:
    rate = run["rate"]
    label = run["profile"] if rate is None else f"{run['profile']} {rate:,.2f} req/s"
    return f"{label} (knee)" if knee is not None and rate == knee else label


def _cdf(ax: Any, values: list[float], label: str, style: str) -> None:
    values = sorted(values)
    if values:
        shares = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, shares, style, where="post", label=label, linewidth=1.5)


def _sweep_distributions(result: dict[str, Any], folder: Path) -> Path:
    """One curve per run: how TTFT and the gaps between text events spread as the rate rises
    (a percentile table hides whether a whole run shifted or only its tail grew)."""
    path = folder / SWEEP_PLOTS[1]
    knee = result["sweep"]["knee_rate"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110)
    for run in result["runs"]:
        done = [
            r for r in run["summary"]["requests"] if r["complete"] and not r.get("warmup", False)
        ]
        label = _run_label(run, knee)
        style = "--" if run["rate"] is None else "-"
        _cdf(left, [r["ttft_ms"] for r in done if r["ttft_ms"] is not None], label, style)
        gaps = [b - a for r in done for a, b in itertools.pairwise(r["text_event_ms"])]
        _cdf(right, gaps, label, style)
    left.set_xlabel("TTFT: request sent to first parsed text (ms)")
    right.set_xlabel("gap between consecutive text events (ms)")
    for ax, title in ((left, "TTFT by run"), (right, "Inter-event gaps by run")):
        ax.set_ylabel("share")
        ax.set_ylim(0, 1.02)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{title}, cumulative (complete requests)")
        ax.grid(alpha=0.3, which="both")
    left.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _sweep_latency(result: dict[str, Any], folder: Path) -> Path:
    path = folder / SWEEP_PLOTS[0]
    runs = sorted((r for r in result["runs"] if r["rate"] is not None), key=lambda r: r["rate"])
    rates = [r["rate"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for key, label, style in (
        ("ttft_ms", "TTFT p50", "-o"),
        ("ttft_ms", "TTFT p99", "--o"),
        ("e2el_ms", "E2EL p50", "-s"),
    ):
        stat = "p99" if label.endswith("p99") else "p50"
        values = [r["summary"][key][stat] for r in runs]
        ax.plot(rates, [float("nan") if v is None else v for v in values], style, label=label)
    knee = result["sweep"]["knee_rate"]
    if knee is not None:
        ax.axvline(knee, color="#c0392b", linestyle=":", label=f"knee {knee:,.2f} req/s")
    # Goodput decides the knee as much as latency does (a server that refuses work keeps its
    # latency flat), so its share is drawn too, on its own axis.
    share = ax.twinx()
    share.plot(
        rates,
        [100 * r["summary"]["goodput"]["share_of_requests"] for r in runs],
        ":^",
        color="#7d3c98",
        label="good %",
    )
    share.set_ylabel("good requests (%)")
    share.set_ylim(0, 105)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms")
    ax.set_title("Latency and goodput against rate")
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = share.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="center left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
