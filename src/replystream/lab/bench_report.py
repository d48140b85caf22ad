"""The console report of ``replystream bench``: one table of distributions, then the counts.

This file decides how a summary (``benchstats.summarize``) is shown to a person; it must not
compute any metric itself.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from replystream.lab.benchstats import DEFINITIONS
from replystream.lab.sweep import knee
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
    # The URL is the user's text, not Rich markup ("?q=[/b]" would end the report).
    table = Table(title=escape(f"bench {config['url']} ({config['api']}, {config['mode']})"))
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
    warmup = ""
    if counts["warmup_requests"]:
        warmup = (
            f" (and {counts['warmup_requests']} in the first "
            f"{config['warmup_s']:g} s warm-up, left out)"
        )
    console.print(
        f"Requests: {counts['sent']} sent, {counts['complete']} complete, "
        f"{counts['incomplete']} incomplete, {counts['failed']} failed, "
        f"{counts['cancelled']} cancelled on purpose{warmup}",
        highlight=False,
    )
    for kind in ("incomplete", "failed"):
        for reason, n in counts[f"{kind}_reasons"].items():
            console.print(f"  {kind}: {n} x {reason}", highlight=False, markup=False)
    if counts["interrupted"]:
        console.print(
            f"  interrupted (Ctrl-C): {counts['in_flight_cancelled']} in flight were "
            "cancelled and are in no other count or figure; the rest are the requests that "
            "ended before it",
            highlight=False,
        )
    rate = summary["throughput"]
    console.print(
        f"Throughput over {rate['wall_s']:,.2f} s: {rate['requests_per_s']:,.2f} req/s, "
        f"{rate['output_tokens_per_s']:,.1f} tokens/s, {rate['events_per_s']:,.1f} events/s",
        highlight=False,
    )
    lag = summary["send_lag_ms"]
    if lag["count"]:
        console.print(
            f"Sends behind schedule (open loop): p50 {lag['p50']:,.1f} ms, p99 "
            f"{lag['p99']:,.1f} ms, max {lag['max']:,.1f} ms; every latency runs from the "
            "actual send, so this lag is in none of them",
            highlight=False,
        )
    goodput = summary["goodput"]
    if goodput["slos"]:
        slos = " and ".join(f"{k} <= {v:g} ms" for k, v in goodput["slos"].items())
        unjudged = goodput["no_tpot"] if "tpot" in goodput["slos"] else 0
        console.print(
            f"Goodput ({slos}): {goodput['good_requests']} requests, "
            f"{goodput['requests_per_s']:,.2f} req/s "
            f"({100 * goodput['share_of_requests']:.1f} % of requests; "
            f"{'held' if goodput['held'] else 'did not hold'} at "
            f"{100 * goodput['share_target']:g} %)"
            + (
                f"; {unjudged} {'reply' if unjudged == 1 else 'replies'} of under 2 tokens "
                "had no TPOT, the tpot bound not applied"
                if unjudged
                else ""
            ),
            highlight=False,
        )
    console.print(_steady_line(summary["steady_state"]), highlight=False)
    resume = summary["resume"]
    if resume is not None:
        reconnect = resume["reconnect_ms"]
        p50 = "-" if reconnect["p50"] is None else f"{reconnect['p50']:,.1f}"
        p99 = "-" if reconnect["p99"] is None else f"{reconnect['p99']:,.1f}"
        console.print(
            f"Drop and resume: {resume['drops']} dropped, {resume['resumed']} resumed; "
            f"resume request to first replayed event p50 {p50} ms, p99 {p99} ms; "
            f"events lost {resume['lost']}, duplicated {resume['duplicated']}",
            highlight=False,
        )
    if summary["server"] is not None:
        for line in server_lines(summary["server"]):
            console.print(line, highlight=False, markup=False)
    console.print(client_line(summary["client"]), highlight=False)


CLIENT_LIMITED = "the client, not the server, may be the limit"


def client_line(client: dict[str, Any]) -> str:
    """The load client's own cost: CPU over wall time, per event read, and the warning when
    it was near a full core."""
    share = client["cpu_share_of_one_core"]
    per_event = client["cpu_us_per_event"]
    cost = "" if per_event is None else f", {per_event:,.1f} µs of CPU per text event read"
    line = (
        f"Load client CPU: {client['cpu_s']:,.2f} s over {client['wall_s']:,.2f} s wall = "
        f"{100 * share:.1f} % of one core{cost}"
    )
    if client["client_limited"]:
        line += (
            f"\n  [bold red]{CLIENT_LIMITED}[/]: its CPU was above "
            f"{100 * client['limit_share']:g} % of one core; spread the load over more bench "
            "processes or machines before reading these figures as the server's"
        )
    return line


def _steady_line(steady: dict[str, Any]) -> str:
    if steady["steady"] is None:
        return "Steady state: not judged (fewer than 2 complete requests in a half)"
    changes = ", ".join(
        f"{key.removesuffix('_ms').upper()} p50 {c['first_half_p50']:,.1f} -> "
        f"{c['second_half_p50']:,.1f} ms ({100 * c['change']:+.0f} %)"
        for key, c in steady["change"].items()
    )
    verdict = "steady" if steady["steady"] else "[bold red]UNSTEADY[/]"
    bound = f"bound {100 * steady['bound']:g} %"
    return f"Steady state: {verdict}, second half vs first: {changes} ({bound})"


def server_lines(server: dict[str, Any]) -> list[str]:
    if "error" in server:
        return [f"Server metrics: not read ({server['error']})"]
    mean = server["mean"]
    figures = ", ".join(
        f"{name} {value:,.1f} ms"
        for name, value in (
            ("TTFT", mean["ttft_ms"]),
            ("queue", mean["queue_ms"]),
            ("E2E", mean["e2el_ms"]),
        )
        if value is not None
    )
    replies = ", ".join(f"{n:g} {outcome}" for outcome, n in server["replies"].items())
    held = ", ".join(f"{k} {v:g}" for k, v in server["held_at_end"].items() if v is not None)
    gap = server["ttft_gap_ms"]
    lines = []
    engine = server.get("engine")
    if engine:
        lines.append(
            f"  engine: {engine['preemptions']:g} preemptions for KV blocks, "
            f"{engine['recomputed_tokens']:g} tokens recomputed, "
            f"{engine['prefix_hit_tokens']:g} prompt tokens from its prefix cache"
        )
    if "during" in server:
        peaks = server["during"]["held"]
        held_during = ", ".join(
            f"{key} mean {v['mean']:,.1f} peak {v['max']:g}" for key, v in peaks.items() if v
        )
        lines.append(
            f"  during the run ({server['during']['scrapes']} scrapes every "
            f"{server['during']['interval_s']:g} s): {held_during or 'nothing reported'}"
        )
    estimated = server["client_counts_estimated"]
    # A reader's own count (events, words) is not the server's tokens: the difference then
    # measures the counting too, and says so.
    caveat = (
        f" ({estimated} readers' counts are their events or words, not the server's tokens)"
        if estimated
        else ""
    )
    return [
        f"Server ({server['url']}): means {figures or 'none'}; replies {replies or 'none'}",
        f"  tokens made {server['tokens_generated']:g}, received by readers "
        f"{server['client_tokens_received']:g}, made and never read "
        f"{server['excess_tokens']:g}{caveat}; held at the end: {held or 'nothing reported'}",
        "  client TTFT minus server TTFT (network, client and write path): "
        + ("-" if gap is None else f"{gap:,.1f} ms"),
        *lines,
    ]


def render_sweep(result: dict[str, Any], console: Console) -> None:
    """Print one row per run of a sweep and the knee."""
    sweep = result["sweep"]
    first = result["runs"][0]["summary"]["config"]
    table = Table(title=escape(f"bench sweep {first['url']} ({first['api']})"))
    for column in (
        "Profile",
        "Target req/s",
        "Done req/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "E2EL p50",
        "Good %",
        "Steady",
        "Client CPU %",
        "µs/event",
    ):
        table.add_column(column, justify="left" if column == "Profile" else "right")
    for run in result["runs"]:
        s = run["summary"]
        target = run["target_rate"]
        steady = s["steady_state"]["steady"]
        client = s["client"]
        limited = client["client_limited"]
        at_knee = run["rate"] is not None and run["rate"] == sweep["knee_rate"]
        table.add_row(
            run["profile"] + (" (knee)" if at_knee else ""),
            "-" if target is None else f"{target:,.2f}",
            f"{s['throughput']['requests_per_s']:,.2f}",
            _cell(s["ttft_ms"]["p50"], "ms"),
            _cell(s["ttft_ms"]["p99"], "ms"),
            _cell(s["itl_ms"]["p50"], "ms"),
            _cell(s["e2el_ms"]["p50"], "ms"),
            f"{100 * s['goodput']['share_of_requests']:.1f}",
            "-" if steady is None else "yes" if steady else "NO",
            f"{100 * client['cpu_share_of_one_core']:.0f}" + (" !" if limited else ""),
            _cell(client["cpu_us_per_event"], ""),
        )
    console.print(table)
    for run in result["runs"]:
        counts = run["summary"]["counts"]
        name = run["profile"] if run["target_rate"] is None else f"{run['target_rate']:,.2f} req/s"
        for kind in ("incomplete", "failed"):
            for reason, n in counts[f"{kind}_reasons"].items():
                console.print(f"  {name}: {kind}: {n} x {reason}", highlight=False, markup=False)
    limited_runs = [run for run in result["runs"] if run["summary"]["client"]["client_limited"]]
    if limited_runs:
        names = ", ".join(
            run["profile"] if run["target_rate"] is None else f"{run['target_rate']:,.2f} req/s"
            for run in limited_runs
        )
        console.print(
            f"Warning: [bold red]{CLIENT_LIMITED}[/] in the runs marked ! ({names}): the load "
            "client used nearly a full core there, so those rows (and a knee among them) may "
            "be the client's",
            highlight=False,
        )
    slos = " and ".join(f"{k} <= {v:g} ms" for k, v in sweep["slos"].items())
    # Without an SLO a request is good when it completed: say that, not "kept no SLO".
    kept = f"kept {slos} for" if slos else "completed"
    maximum = sweep["max_throughput_rate"]
    ran = sum(run["profile"] == "constant" for run in result["runs"])
    planned = len(sweep["rates"])
    found = "not measured" if maximum is None else f"{maximum:,.2f} req/s"
    # A sweep that ended early claims only the constant rates it ran.
    between = f"{ran} constant rates" if ran == planned else f"{ran} of {planned} constant rates"
    console.print(
        f"Synchronous rate {sweep['synchronous_rate']:,.2f} req/s, maximum throughput {found}, "
        f"{between} between.",
        highlight=False,
    )
    ended = sweep.get("ended_early")
    if ended is not None:
        console.print(f"The sweep ended early: {ended}.", highlight=False, markup=False)
    held = knee(result["runs"])
    if sweep["knee_rate"] is None and ended is not None and held is not None:
        # What held so far is not the knee: a higher rate the sweep never ran may hold too.
        console.print(
            f"Knee: none; {held:,.2f} req/s {kept} {100 * sweep['slo_share']:g} % of requests "
            "and stayed steady, but a knee is judged over every rate of a whole sweep.",
            highlight=False,
        )
    elif sweep["knee_rate"] is None:
        console.print(
            f"Knee: none; no rate {kept} {100 * sweep['slo_share']:g} % of requests and stayed "
            "steady.",
            highlight=False,
        )
    else:
        step = "" if sweep["step"] is None else f" (sweep step {sweep['step']:,.2f} req/s)"
        console.print(
            f"Knee: {sweep['knee_rate']:,.2f} req/s, the highest rate that {kept} "
            f"{100 * sweep['slo_share']:g} % of requests and stayed steady{step}.",
            highlight=False,
        )
