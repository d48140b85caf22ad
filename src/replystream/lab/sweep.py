"""``--profile sweep``: from one request at a time to saturation, and the knee between.

This file decides the order of a sweep's runs and what the knee is. It measures the
synchronous rate (one request at a time) and the maximum throughput (every request at once),
then runs ``steps`` constant rates evenly spaced above the synchronous rate up to the maximum
(the last one is the maximum itself). The knee is the highest of these rates, the synchronous
one included, whose goodput held (at least the stated share of requests met every SLO) and
whose run was not marked unsteady. A sweep ends early, with no knee (one is judged over
every rate), when its burst completed no request (it found no maximum to pace the constant
rates by: the sweep failed) or when a run after the first could not be made or was stopped
(``RunNotMade``: the server went away, Ctrl-C); what it measured until then is its result,
with the reason. Sending
is ``load``, each run's figures are ``benchstats``; this file must not compute a metric
itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from replystream.lab.benchstats import SLO, summarize
from replystream.lab.load_types import LoadConfig, LoadRun
from replystream.lab.profiles import Profile

Runner = Callable[[LoadConfig], Awaitable[LoadRun]]


class RunNotMade(Exception):
    """A runner could not make a run (its first request found no server), or was stopped
    in it (Ctrl-C): the sweep ends before that run with the runs before it; raised on when
    it was the first (nothing was measured). ``what``: what befell the run, as a report
    says it after the run's name ("could not start: ...")."""

    def __init__(self, reason: str, what: str | None = None) -> None:
        super().__init__(reason)
        self.what = f"could not start: {reason}" if what is None else what


@dataclasses.dataclass(frozen=True, slots=True)
class SweepConfig:
    """How a sweep runs: constant-rate ``steps``, and how each run is judged."""

    steps: int = 5
    slos: tuple[SLO, ...] = ()
    slo_share: float = 1.0
    warmup_s: float = 0.0
    steady_bound: float = 0.5

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("a sweep needs at least 1 step")


def constant_rates(synchronous: float, maximum: float, steps: int) -> list[float]:
    """``steps`` rates evenly spaced above ``synchronous``, the last one ``maximum``; none
    when the maximum is not above the synchronous rate (nothing lies between)."""
    if not maximum > synchronous:
        return []
    step = (maximum - synchronous) / steps
    return [synchronous + step * i for i in range(1, steps + 1)]


def knee(runs: list[dict[str, Any]]) -> float | None:
    """The highest rate whose goodput held and whose run was not marked unsteady."""
    held = [
        run["rate"]
        for run in runs
        if run["rate"] is not None
        and run["summary"]["goodput"]["held"]
        and run["summary"]["steady_state"]["steady"] is not False
    ]
    return max(held, default=None)


async def run_sweep(base: LoadConfig, sweep: SweepConfig, runner: Runner) -> dict[str, Any]:
    """Run the whole sweep with ``runner`` (``load.run_load`` with a progress bar, say) and
    return its JSON object: every run's summary in order, the rates and the knee (None, and
    ``ended_early`` saying why, for a sweep that could not run to its end).

    Raises:
        RunNotMade: the first run could not be made, so nothing was measured.
    """
    runs: list[dict[str, Any]] = []

    async def one(profile: Profile, warmup_s: float) -> dict[str, Any]:
        config = dataclasses.replace(base, profile=profile)
        summary = summarize(
            await runner(config),
            sweep.slos,
            warmup_s=warmup_s,
            slo_share=sweep.slo_share,
            steady_bound=sweep.steady_bound,
        )
        achieved: float = summary["throughput"]["requests_per_s"]
        run = {"profile": profile.kind, "target_rate": profile.rate, "summary": summary}
        # A burst has no sustained rate to judge: it only finds the maximum.
        run["rate"] = None if profile.kind == "throughput" else achieved
        if profile.kind == "constant":
            run["rate"] = profile.rate
        runs.append(run)
        return run

    synchronous = await one(Profile.synchronous(), sweep.warmup_s)
    synchronous_rate: float = synchronous["summary"]["throughput"]["requests_per_s"]
    maximum: float | None = None
    rates: list[float] = []
    ended: str | None = None
    try:
        # Every request of the burst is sent at once, so a warm-up window would hold them all.
        burst = await one(Profile("throughput"), 0.0)
        maximum = burst["summary"]["throughput"]["requests_per_s"]
        if not burst["summary"]["counts"]["complete"]:
            # Its rate of 0 is no maximum the server reached: rates paced by it, and a knee
            # among them (the synchronous rate), would claim what nothing measured.
            ended = (
                "the throughput burst completed no request, so it found no maximum to pace "
                "the constant rates by: the sweep failed"
            )
        else:
            rates = constant_rates(synchronous_rate, maximum, sweep.steps)
            for rate in rates:
                await one(Profile("constant", rate=rate), sweep.warmup_s)
    except RunNotMade as exc:
        made = sum(run["profile"] == "constant" for run in runs)
        name = "throughput burst" if maximum is None else f"run at {rates[made]:,.2f} req/s"
        ended = f"the {name} {exc.what}"
    step = (maximum - synchronous_rate) / sweep.steps if maximum is not None and rates else None
    return {
        "sweep": {
            "synchronous_rate": synchronous_rate,
            "max_throughput_rate": maximum,
            "steps": sweep.steps,
            "step": step,
            "rates": rates,
            "slos": {slo.metric: slo.limit_ms for slo in sweep.slos},
            "slo_share": sweep.slo_share,
            "steady_bound": sweep.steady_bound,
            "warmup_s": sweep.warmup_s,
            # A knee is the highest rate that held among every rate: a sweep cut short has none.
            "knee_rate": knee(runs) if ended is None else None,
            "ended_early": ended,
        },
        "runs": runs,
    }
