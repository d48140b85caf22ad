"""What a load run's timings mean: per-request metrics, their distributions, throughput, goodput.

This file decides the definitions (they are also written in ``docs/metrics.md``, because tools
disagree on the names) and the ``--json`` contract of ``replystream bench``. It is pure: it
reads finished records and must not know how requests were sent or how results are shown.

Every time is client side, in ms from the moment the request was sent:
- TTFT: to the first parsed event (or body) holding non-empty reply text;
- TPOT: per request, (last text - first text) / (tokens - 1); needs at least 2 tokens;
- ITL: every gap between consecutive text events, pooled over all requests;
- E2EL: to the end of the reply (terminal marker read, connection closed);
- first byte: when the response head (status line and headers) arrived;
- first chunk: when the first body chunk arrived (raw bytes, not yet parsed);
- tokens per event: tokens / text events, per request.
Percentiles are linear interpolation between closest ranks (``replystream.stats.percentile``).
Only complete replies (explicit end marker) contribute timings; the rest are counted with reasons.
Requests sent inside the warm-up window (the run's first ``warmup_s``) are kept in the JSON,
marked, and left out of every figure. The steady-state check compares the medians of TTFT and
TPOT (neither grows with reply length) of the measured window's second half with its first.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from replystream.lab.load_types import LoadRun, RequestRecord
from replystream.lab.server_metrics import change, during
from replystream.stats import distribution, percentile

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "first_byte_ms", "first_chunk_ms")
# The per-request value each goodput bound limits; itl limits a request's largest gap.
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "max_itl_ms", "e2el": "e2el_ms"}
# Per-request figures that do not grow with reply length, so a mixed workload is judged fairly.
STEADY_METRICS = ("ttft_ms", "tpot_ms")
# The load client's CPU time over the run's wall time above which the client, not the server,
# may be what limits the figures: an asyncio client is one thread, and near a full core its
# timestamps wait on its own parsing (and its arrivals fall behind their schedule).
CLIENT_LIMIT_SHARE = 0.8
# The shortest run whose client CPU share is judged against CLIENT_LIMIT_SHARE.
CLIENT_LIMIT_MIN_WALL_S = 0.5

DEFINITIONS = {
    "ttft_ms": "request sent -> first parsed non-empty text (or a reasoning model's thinking)",
    "tpot_ms": "per request: (last text - first text) / (tokens - 1)",
    "itl_ms": "gaps between consecutive text events, all requests pooled",
    "e2el_ms": "request sent -> end of reply (end marker read, connection closed)",
    "first_byte_ms": "request sent -> response head (status and headers) arrived",
    "first_chunk_ms": "request sent -> first raw body chunk arrived (before parsing)",
    "tokens_per_event": "per request: tokens / text events",
    "send_lag_ms": "open loop, per request: sent - when its arrival was scheduled",
}


@dataclass(frozen=True, slots=True)
class SLO:
    """A per-request bound for goodput: ``metric`` (ttft, tpot, itl or e2el) at most
    ``limit_ms``; for itl, every gap between the request's text events."""

    metric: str
    limit_ms: float

    @classmethod
    def parse(cls, text: str) -> SLO:
        """Read ``ttft=200`` or ``ttft:200`` (milliseconds); raises ValueError otherwise."""
        sep = "=" if "=" in text else ":"
        name, _, value = text.partition(sep)
        if name not in SLO_METRICS:
            raise ValueError(f"SLO {text!r}: metric must be one of {', '.join(SLO_METRICS)}")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(f"SLO {text!r}: want METRIC=MILLISECONDS") from None
        if not 0 < limit < float("inf"):
            raise ValueError(f"SLO {text!r}: the limit must be a positive number of ms")
        return cls(name, limit)

    @classmethod
    def parse_list(cls, text: str) -> tuple[SLO, ...]:
        """Read ``ttft=200,itl=50,e2el=2000``; a metric named twice is refused."""
        slos = tuple(cls.parse(item) for item in text.split(",") if item.strip())
        names = [slo.metric for slo in slos]
        if not slos or len(set(names)) != len(names):
            raise ValueError(f"SLO {text!r}: want METRIC=MS[,METRIC=MS...], each metric once")
        return slos

    def met(self, metrics: dict[str, Any]) -> bool:
        """Whether a request's metrics keep to this bound. A complete reply of fewer than 2
        tokens has no time per output token: a ``tpot`` bound does not apply to it (as
        vLLM's benchmark counts it 0 for goodput), neither failing nor judging it."""
        value = metrics[SLO_METRICS[self.metric]]
        if value is None and self.metric == "tpot" and no_tpot(metrics):
            return True
        return value is not None and value <= self.limit_ms


def no_tpot(metrics: dict[str, Any]) -> bool:
    """Whether a request completed with too few tokens (0 or 1) to have a time per output
    token: there is no gap between tokens to divide."""
    return bool(metrics["complete"]) and metrics["tokens"] < 2


def request_metrics(record: RequestRecord, warmup_s: float = 0.0) -> dict[str, Any]:
    """One request's metrics and raw timings (an entry of the JSON ``requests`` list)."""
    t = record.timing
    events = len(t.text_event_ms)
    gaps = t.gaps_ms
    tpot = None
    if t.complete and t.tokens >= 2 and t.first_text_ms is not None and t.last_text_ms is not None:
        tpot = (t.last_text_ms - t.first_text_ms) / (t.tokens - 1)
    return {
        "index": record.index,
        "start_s": record.start_s,
        "scheduled_s": record.scheduled_s,
        # How late an open loop sent it: every time above runs from the actual send, so
        # this lag (a client busy or starved) is in none of them.
        "send_lag_ms": (
            None if record.scheduled_s is None else (record.start_s - record.scheduled_s) * 1e3
        ),
        "warmup": record.start_s < warmup_s,
        "turn": record.turn,
        "prompt_words": record.prompt_words,
        "max_tokens": record.max_tokens,
        "status": t.status,
        "complete": t.complete,
        "error": t.error,
        "ttft_ms": t.first_text_ms,  # the first text or thinking
        "first_answer_ms": t.first_answer_ms,
        "tpot_ms": tpot,
        # A complete reply in one text event has no gap: none is over any bound.
        "max_itl_ms": (max(gaps) if gaps else 0.0) if t.complete else None,
        "e2el_ms": t.closed_ms,
        "first_byte_ms": t.headers_ms,
        "first_chunk_ms": t.first_chunk_ms,
        "last_text_ms": t.last_text_ms,
        "tokens": t.tokens,
        "events": events,
        "tokens_per_event": t.tokens / events if events else None,
        "body_bytes": t.body_bytes,
        "content_encoding": t.headers.get("content-encoding"),
        "text_event_ms": list(t.text_event_ms),
        "resume": record.resume.as_dict() if record.resume else None,
    }


def _outcome(record: RequestRecord) -> str:
    t = record.timing
    if t.complete:
        return "complete"
    if t.cancelled:  # the reader hung up on purpose: a scenario, not a failure
        return "cancelled"
    # Started streaming text but never reached its end marker: a partial reply.
    return "incomplete" if t.status is not None and t.text_event_ms else "failed"


def resume_figures(per_request: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The drops of a run (None when no reader was to drop): how many readers dropped and
    resumed, the time from the resume request to the first replayed event, and events lost
    and duplicated (both must be 0). A reply that ended before its reader was to drop is
    no drop."""
    planned = [m["resume"] for m in per_request if m["resume"] is not None]
    if not planned:
        return None
    drops = [d for d in planned if d["dropped"]]
    return {
        "drops": len(drops),
        "resumed": sum(d["resumed"] for d in drops),
        "reconnect_ms": distribution(
            [d["reconnect_ms"] for d in drops if d["reconnect_ms"] is not None]
        ),
        # Over every planned read: one that was not dropped must lose nothing either.
        "lost": sum(d["lost"] for d in planned),
        "duplicated": sum(d["duplicated"] for d in planned),
    }


def server_side(run: LoadRun) -> dict[str, Any] | None:
    """The server's account of the run beside the client's (None when not scraped): every
    request of the run counts, the warm-up window's and cancelled ones too, as the server's
    counters do. ``excess_tokens``: tokens the server made that no reader received (near 0
    when it stops generating for a reader that hung up), exact only when every reader's count
    is the server's (``client_counts_estimated``: the readers whose count is theirs, one per
    event or the words); ``ttft_gap_ms``: client mean TTFT minus the server's (network,
    client parsing and the server's own write path)."""
    if run.config.server_metrics is None:
        return None
    if run.server_before is None or run.server_after is None:
        return {"error": run.server_error}
    result = change(run.server_before, run.server_after)
    received = sum(r.timing.tokens for r in run.records)
    firsts = [r.timing.first_text_ms for r in run.records if r.timing.first_text_ms is not None]
    client_ttft = sum(firsts) / len(firsts) if firsts else None
    server_ttft = result["mean"]["ttft_ms"]
    result["client_tokens_received"] = received
    result["client_counts_estimated"] = sum(not r.timing.tokens_counted for r in run.records)
    result["excess_tokens"] = result["tokens_generated"] - received
    result["client_ttft_mean_ms"] = client_ttft
    result["ttft_gap_ms"] = (
        client_ttft - server_ttft if client_ttft is not None and server_ttft is not None else None
    )
    result["url"] = run.config.server_metrics
    if run.config.metrics_interval_s is not None:
        result["during"] = {
            "interval_s": run.config.metrics_interval_s,
            **during(run.server_samples),
        }
    return result


def steady_state(done: list[dict[str, Any]], window_start_s: float, bound: float) -> dict[str, Any]:
    """Whether the measured window's second half kept to its first: the medians of TTFT and
    TPOT may change by at most ``bound`` (a share of the first half's). ``steady`` is None
    when either half has fewer than 2 complete requests."""
    result: dict[str, Any] = {"bound": bound, "steady": None, "change": {}}
    if not done:
        return result
    middle = (window_start_s + max(m["start_s"] for m in done)) / 2
    halves = (
        [m for m in done if m["start_s"] < middle],
        [m for m in done if m["start_s"] >= middle],
    )
    if min(len(h) for h in halves) < 2:
        return result
    steady = True
    for name in STEADY_METRICS:
        values = [[m[name] for m in h if m[name] is not None] for h in halves]
        if not all(values):
            continue
        first, second = (percentile(v, 50) for v in values)
        change = (second - first) / first if first > 0 else 0.0
        result["change"][name] = {"first_half_p50": first, "second_half_p50": second}
        result["change"][name]["change"] = change
        steady = steady and abs(change) <= bound
    result["steady"] = steady
    return result


def summarize(
    run: LoadRun,
    slos: tuple[SLO, ...] = (),
    *,
    warmup_s: float = 0.0,
    slo_share: float = 1.0,
    steady_bound: float = 0.5,
) -> dict[str, Any]:
    """The whole ``--json`` object: aggregates, counts, throughput and per-request timings.

    Requests sent before ``warmup_s`` are listed but left out of every figure; goodput
    ``held`` when at least ``slo_share`` of the measured requests met every SLO.
    """
    all_requests = [request_metrics(r, warmup_s) for r in run.records]
    pairs = [(r, m) for r, m in zip(run.records, all_requests, strict=True) if not m["warmup"]]
    records = [r for r, _ in pairs]
    per_request = [m for _, m in pairs]
    outcomes = [_outcome(r) for r in records]
    done = [m for m, o in zip(per_request, outcomes, strict=True) if o == "complete"]
    result: dict[str, Any] = {}
    for name in METRICS:
        if name == "itl_ms":
            gaps = [b - a for m in done for a, b in itertools.pairwise(m["text_event_ms"])]
            result[name] = distribution(gaps)
        else:
            result[name] = distribution([m[name] for m in done if m[name] is not None])
    result["tokens_per_event"] = distribution(
        [m["tokens_per_event"] for m in done if m["tokens_per_event"] is not None]
    )
    # Over every measured request an open loop scheduled, whatever its outcome: the lag is
    # the sender's, not the reply's.
    result["send_lag_ms"] = distribution(
        [m["send_lag_ms"] for m in per_request if m["send_lag_ms"] is not None]
    )
    wall = max(run.wall_s - warmup_s, 0.0)
    tokens = sum(m["tokens"] for m in done)
    events = sum(m["events"] for m in done)
    good = [m for m in done if all(slo.met(m) for slo in slos)]
    reasons: dict[str, Counter[str]] = {"incomplete": Counter(), "failed": Counter()}
    for record, outcome in zip(records, outcomes, strict=True):
        if outcome in reasons:
            reasons[outcome][record.timing.error or "unknown"] += 1
    cut = run.cancelled_in_flight_s
    cut_measured = sum(start_s >= warmup_s for start_s in cut)
    result["counts"] = {
        # Ctrl-C stopped the run: requests still in flight then were cancelled; they were
        # sent (``sent``, ``in_flight_cancelled``) but are in no other count or figure.
        "interrupted": run.interrupted,
        "sent": len(per_request) + cut_measured,
        "in_flight_cancelled": cut_measured,
        "requests": len(per_request),
        "warmup_requests": len(all_requests) - len(per_request) + len(cut) - cut_measured,
        "complete": len(done),
        "cancelled": outcomes.count("cancelled"),
        "incomplete": sum(reasons["incomplete"].values()),
        "failed": sum(reasons["failed"].values()),
        "incomplete_reasons": dict(reasons["incomplete"]),
        "failed_reasons": dict(reasons["failed"]),
    }
    result["throughput"] = {
        "wall_s": wall,
        "requests_per_s": len(done) / wall if wall else 0.0,
        "output_tokens_per_s": tokens / wall if wall else 0.0,
        "events_per_s": events / wall if wall else 0.0,
        "output_tokens": tokens,
        "events": events,
    }
    # Replies cut on purpose are neither good nor bad: goodput is over the rest.
    judged = len(per_request) - outcomes.count("cancelled")
    share = len(good) / judged if judged else 0.0
    result["goodput"] = {
        "slos": {slo.metric: slo.limit_ms for slo in slos},
        "good_requests": len(good),
        # Complete replies of fewer than 2 tokens: no TPOT, so a tpot bound did not judge them.
        "no_tpot": sum(no_tpot(m) for m in done),
        "requests_per_s": len(good) / wall if wall else 0.0,
        "share_of_requests": share,
        "share_target": slo_share,
        "held": judged > 0 and share >= slo_share,
    }
    result["steady_state"] = steady_state(done, warmup_s, steady_bound)
    result["server"] = server_side(run)
    result["resume"] = resume_figures(per_request)
    # The client's CPU covers every request it read, warm-up window and cut ones too.
    events_read = sum(len(r.timing.text_event_ms) for r in run.records)
    result["client"] = {
        "cpu_s": run.client_cpu_s,
        # The whole run's, as cpu_s is: the throughput's wall leaves the warm-up window out.
        "wall_s": run.wall_s,
        "cpu_share_of_one_core": run.client_cpu_share,
        "events_read": events_read,
        "cpu_us_per_event": 1e6 * run.client_cpu_s / events_read if events_read else None,
        "limit_share": CLIENT_LIMIT_SHARE,
        # A run that read nothing (every request refused at once) has no figure the client
        # could have held back, and one over in an instant (every stream cut at once) shows
        # the client's start and end, not a load it kept up: neither is judged.
        "client_limited": events_read > 0
        and run.wall_s >= CLIENT_LIMIT_MIN_WALL_S
        and run.client_cpu_share > CLIENT_LIMIT_SHARE,
    }
    config = run.config
    result["config"] = {
        "url": config.url,
        "api": config.api,
        "mode": config.mode,
        "profile": config.profile.kind,
        "concurrency": config.profile.in_flight,
        "rate": config.profile.rate,
        "burstiness": config.profile.burstiness,
        "warmup_s": warmup_s,
        "requests": config.requests,
        "duration_s": config.duration_s,
        "prompt_words": config.prompt_words.describe(),
        "output_tokens": config.output_tokens.describe() if config.output_tokens else None,
        "dataset_prompts": len(config.prompts),
        "system_prompt_words": config.system_words,
        "turns": config.turns,
        "ignore_eos": config.ignore_eos,
        "cancel_share": config.cancel_share,
        "cancel_after": config.cancel_after,
        "drop_share": config.drop_share,
        "drop_after": config.drop_after,
        "resume_cursor": config.resume_cursor if config.drop_share else None,
        "seed": config.seed,
    }
    result["percentile_method"] = "linear interpolation between closest ranks (NumPy 'linear')"
    result["definitions"] = DEFINITIONS
    result["requests"] = all_requests
    return result
