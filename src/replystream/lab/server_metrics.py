"""The server's own account of a load run, from its Prometheus ``/metrics`` before and after.

This file decides which of replystream's metrics a bench reads and what their change over a
run means: tokens the engine made, replies by how they ended, the server's mean TTFT, queue
time and end-to-end time (the change of a histogram's sum over the change of its count), what
it held when the run ended (active streams, engine requests, KV blocks, requests waiting
outside the engine's batch), what making room in the engine's KV pool cost (preemptions,
recomputed tokens) and what its prefix cache saved (prompt tokens not computed). Reading one
scrape is pure; ``scrape`` is the one function that does I/O. It must not know how the load
was sent.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from replystream.client.transport import Headers, TransportError, http_request

Scrape = dict[str, float]

_MEANS = {
    "ttft_ms": "replystream_time_to_first_token_seconds",
    "queue_ms": "replystream_queue_seconds",
    "e2el_ms": "replystream_end_to_end_seconds",
}
_HELD = {
    "active_streams": "replystream_active_streams",
    "engine_requests": "replystream_engine_requests",
    "kv_blocks_used": "replystream_kv_blocks_used",
    "engine_waiting": "replystream_engine_requests_waiting",
}
# What making room in the engine's KV pool cost over the run, and what its prefix cache saved
# (engines that report them).
_ENGINE_COUNTS = {
    "preemptions": "replystream_engine_preemptions",
    "recomputed_tokens": "replystream_engine_recomputed_tokens",
    "prefix_hit_tokens": "replystream_engine_prefix_hit_tokens",
}
_ACTIVE = "replystream_active_streams"


class ScrapeError(Exception):
    """``/metrics`` could not be read or parsed."""


# The endpoints a bench measures, whose prefix (a proxy's /api) the metrics URL keeps.
_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/replies",
    "/stream",
    "/wait",
)


def metrics_url(url: str) -> str:
    """The ``/metrics`` beside an endpoint: same scheme, host and port, and the path prefix
    the endpoint is served under (``/api/v1/replies`` -> ``/api/metrics``)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    prefix = next((path[: -len(e)] for e in _ENDPOINTS if path.endswith(e)), "")
    return urlunsplit((parts.scheme, parts.netloc, f"{prefix}/metrics", "", ""))


def parse(text: str) -> Scrape:
    """Each sample summed over its labels, except ``outcome`` (kept as ``name{outcome}``)."""
    totals: dict[str, float] = defaultdict(float)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                outcome = sample.labels.get("outcome")
                key = sample.name if outcome is None else f"{sample.name}{{{outcome}}}"
                totals[key] += sample.value
    except ValueError as exc:
        raise ScrapeError(f"not Prometheus text: {exc}") from None
    return dict(totals)


async def scrape(
    url: str,
    headers: Headers | None = None,
    timeout_s: float = 5.0,
    tls: ssl.SSLContext | None = None,
) -> Scrape:
    """GET ``url`` (with ``headers``; ``tls`` for https) and parse it; raises ScrapeError."""
    try:
        async with (
            asyncio.timeout(timeout_s),
            http_request(url, headers=headers, tls=tls) as response,
        ):
            body = b"".join([chunk.data async for chunk in response])
            if response.status != 200:
                raise ScrapeError(f"{url} answered HTTP {response.status}")
    except TimeoutError:
        raise ScrapeError(f"{url}: no answer within {timeout_s:g} s") from None
    except TransportError as exc:
        raise ScrapeError(f"{url}: {exc}") from None
    return parse(body.decode("utf-8", "replace"))


async def scrape_when_idle(
    url: str,
    headers: Headers | None = None,
    settle_s: float = 2.0,
    tls: ssl.SSLContext | None = None,
) -> Scrape:
    """Scrape once the server holds no active stream (it may notice a reader's hang-up a
    moment after the reader left), or after ``settle_s`` whatever it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    while True:
        current = await scrape(url, headers, tls=tls)
        if current.get(_ACTIVE, 0.0) == 0 or loop.time() >= deadline:
            return current
        await asyncio.sleep(0.05)


def change(before: Scrape, after: Scrape) -> dict[str, Any]:
    """What the server did between two scrapes, and what it held at the second."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    means: dict[str, float | None] = {}
    for key, name in _MEANS.items():
        count = delta(f"{name}_count")
        means[key] = 1000.0 * delta(f"{name}_sum") / count if count > 0 else None
    replies = {
        key.partition("{")[2].rstrip("}"): delta(key)
        for key in after
        if key.startswith("replystream_replies_total{")
    }
    return {
        "tokens_generated": delta("replystream_tokens_generated_total"),
        "replies": {outcome: n for outcome, n in replies.items() if n},
        "mean": means,
        "held_at_end": {key: after.get(name) for key, name in _HELD.items()},
        "engine": {key: delta(name) for key, name in _ENGINE_COUNTS.items() if name in after},
    }


def during(samples: tuple[tuple[float, Scrape], ...]) -> dict[str, Any]:
    """What the server held while the run went on: each held gauge's mean and peak over the
    scrapes, and every scrape's readings."""
    series: list[dict[str, float | None]] = [
        {"at_s": at, **{key: scrape.get(name) for key, name in _HELD.items()}}
        for at, scrape in samples
    ]
    peaks: dict[str, dict[str, float] | None] = {}
    for key in _HELD:
        values = [v for s in series if (v := s[key]) is not None]
        peaks[key] = {"mean": sum(values) / len(values), "max": max(values)} if values else None
    return {"scrapes": len(series), "held": peaks, "series": series}
