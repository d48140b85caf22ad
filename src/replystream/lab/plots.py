"""PNG plots of lab results (matplotlib without a display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # the backend is chosen first, above

LEGEND_REASON = 60  # characters of an incomplete call's reason shown in the legend


def legend_label(mode: str, data: dict[str, Any]) -> str:
    """A mode's name in the legend; a call that did not complete says so and why, so that its
    text so far does not read as a whole, shorter reply."""
    if data.get("complete", True):
        return mode
    why = str(data.get("error"))
    why = why if len(why) <= LEGEND_REASON else why[: LEGEND_REASON - 3] + "..."
    return f"{mode}: incomplete ({why})"


def plot_timeline(timeline: dict[str, Any], path: Path) -> None:
    """Text received over time, one line per mode: a staircase for stream, one step for wait."""
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colours = {"wait": "#c0392b", "stream": "#2471a3"}
    for mode, data in timeline.items():
        times = [0.0]
        chars = [0]
        for arrival in data["arrivals"]:
            times.append(arrival["t_ms"])
            chars.append(chars[-1] + len(arrival["text"]))
        label = legend_label(mode, data)
        ax.step(times, chars, where="post", label=label, color=colours.get(mode), linewidth=2)
        if data.get("first_text_ms") is not None:
            ax.axvline(data["first_text_ms"], color=colours.get(mode), linestyle=":", alpha=0.6)
    ax.set_xlabel("time since request (ms)")
    ax.set_ylabel("characters of reply text received")
    calls = {data.get("call") for data in timeline.values()} - {None}
    which = "".join(f" (call {call})" for call in calls)
    ax.set_title(f"Same generation, two deliveries: text received over time{which}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
