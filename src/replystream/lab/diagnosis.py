"""Judge how one reply was delivered: streaming, buffered, bursty, compressed or failed.

This file decides the verdict from the parsed text events of one reply (as the reference
article advises: time to first byte says nothing, the text events say everything), which hop
is the likely culprit, and the fix. It is pure: it reads a finished ``ReplyTiming`` and must
not know how the reply was requested.

The rules, in order:
1. failed: no complete reply (error status, in-band error, no end marker, timeout), or too few
   text events to judge;
2. compressed: the event stream carries a ``Content-Encoding`` (a compressor holds small events);
   when its events also arrived held (rule 5), the reason and the fix say so too, since a hop
   that buffers as well as compresses still holds the stream once compression is off;
3. not an event stream at all: buffered (one JSON body);
4. events are grouped into bursts, split wherever a gap exceeds ``burst_gap_ms``; when the
   median gap is above ``burst_gap_ms`` most events arrived on their own: streaming;
5. otherwise most text arrived together: buffered when one burst holds ``buffered_share`` of the
   events (all at the end), else bursty (long silences, then buffer-sized bursts).

Why the verdict does not depend on how fast the source makes tokens: a hop that holds text
releases what it held in one write, and the client reads it at once, so the events of one
release share a socket read (gaps of zero) or, split over a few reads, arrive microseconds
apart. ``burst_gap_ms`` (0.1 ms) is that "together", not a token time: any source slower than
10,000 tokens a second, a 1 ms-a-token engine as much as a 30 ms one, shows gaps above it when
nothing holds its events. A noisy machine can merge a few tokens into one read, which leaves
the median gap near the token time, so one stall does not turn a stream into a burst.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from replystream.client import ReplyTiming
from replystream.stats import distribution, percentile

Verdict = Literal["streaming", "buffered", "bursty", "compressed", "failed"]

# The response headers that decide whether a hop may hold the body.
HEADERS = (
    "content-type",
    "content-encoding",
    "cache-control",
    "x-accel-buffering",
    "transfer-encoding",
    "server",
)

_PAGE_SIZES = (4096, 8192)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """``burst_gap_ms``: events closer than this arrived together (one read, or one held
    buffer split over reads); it must sit below the source's time per token."""

    burst_gap_ms: float = 0.1
    buffered_share: float = 0.9
    min_events: int = 4


@dataclass(frozen=True, slots=True)
class Burst:
    """Text events that arrived within ``burst_gap_ms`` of each other."""

    at_ms: float
    events: int
    # The body bytes of the reads that carried its events, from the first one's to the last
    # one's: what arrived together, to set against a proxy's buffer size. Whole reads, so an
    # event cut across two counts in the second, and events that are not text count where
    # they arrived (a Responses stream's closing ones, which repeat the whole reply, in the
    # last burst at most). A timing that recorded no reads: events x mean body bytes per event.
    approx_bytes: int


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """The verdict on one reply, with the evidence behind it."""

    url: str
    verdict: Verdict
    reason: str
    hop: str | None
    fix: str | None
    status: int | None
    first_byte_ms: float | None
    first_chunk_ms: float | None
    first_text_ms: float | None
    last_text_ms: float | None
    events: int
    tokens: int
    body_bytes: int
    median_gap_ms: float | None
    gaps_ms: dict[str, float | int | None]
    bursts: list[Burst] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def streams(self) -> bool:
        return self.verdict == "streaming"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["burst_sizes"] = [b.events for b in self.bursts]
        return out


def bursts_of(timing: ReplyTiming, burst_gap_ms: float) -> list[Burst]:
    """Group the text events into bursts separated by gaps above ``burst_gap_ms``."""
    times = timing.text_event_ms
    if not times:
        return []
    firsts = [0]  # the index of each burst's first event
    for index, (before, after) in enumerate(itertools.pairwise(times), 1):
        if after - before > burst_gap_ms:
            firsts.append(index)
    ends = [*firsts[1:], len(times)]
    reads = timing.text_event_reads
    per_event = timing.body_bytes / len(times)

    def size(first: int, end: int) -> int:
        if len(reads) == len(times):
            return reads[end - 1][1] - reads[first][0]
        return round((end - first) * per_event)

    return [
        Burst(times[first], end - first, size(first, end))
        for first, end in zip(firsts, ends, strict=True)
    ]


def diagnose(timing: ReplyTiming, thresholds: Thresholds | None = None) -> Diagnosis:
    """The verdict on one measured reply."""
    limits = thresholds or Thresholds()
    gaps = timing.gaps_ms
    median_gap = percentile(gaps, 50) if gaps else None
    bursts = bursts_of(timing, limits.burst_gap_ms)
    verdict, reason = _verdict(timing, limits, median_gap, bursts)
    headers = {name: timing.headers[name] for name in HEADERS if name in timing.headers}
    hop, fix = _hop_and_fix(verdict, headers, bursts)
    if (
        verdict == "compressed"
        and median_gap is not None
        and _came_together(timing, limits, median_gap)
    ):
        # Compression is not all: the events came held too, and turning compression off
        # alone would leave them so.
        kind, why = _held(timing, limits, median_gap, bursts)
        hop_held, fix_held = _hop_and_fix(kind, headers, bursts)
        reason = f"{reason}; and {kind}: {why}"
        hop = f"{hop}, and {hop_held}"
        fix = f"{fix}; and {fix_held}"
    return Diagnosis(
        url=timing.url,
        verdict=verdict,
        reason=reason,
        hop=hop,
        fix=fix,
        status=timing.status,
        first_byte_ms=timing.headers_ms,
        first_chunk_ms=timing.first_byte_ms,
        first_text_ms=timing.first_text_ms,
        last_text_ms=timing.last_text_ms,
        events=len(timing.text_event_ms),
        tokens=timing.tokens,
        body_bytes=timing.body_bytes,
        median_gap_ms=median_gap,
        gaps_ms=distribution(gaps),
        bursts=bursts,
        headers=headers,
    )


def never_asked(url: str, reason: str) -> Diagnosis:
    """The verdict on a reply that was never asked for: what had to come first (the lookup of
    the model's name) failed for ``reason``."""
    return Diagnosis(
        url=url,
        verdict="failed",
        reason=reason,
        hop=None,
        fix=None,
        status=None,
        first_byte_ms=None,
        first_chunk_ms=None,
        first_text_ms=None,
        last_text_ms=None,
        events=0,
        tokens=0,
        body_bytes=0,
        median_gap_ms=None,
        gaps_ms=distribution([]),
    )


def _verdict(
    timing: ReplyTiming, limits: Thresholds, median_gap: float | None, bursts: list[Burst]
) -> tuple[Verdict, str]:
    encoding = timing.headers.get("content-encoding", "identity").strip().lower()
    # A compressed event stream is the verdict even when its encoding (br) could not be read.
    answered = timing.status is not None and 200 <= timing.status < 300
    if answered and timing.streamed and encoding not in ("", "identity"):
        unread = "" if timing.complete else f" ({timing.error})"
        return "compressed", (f"the event stream arrived with Content-Encoding: {encoding}{unread}")
    if not timing.complete:
        return "failed", f"no complete reply: {timing.error}"
    if not timing.streamed:
        kind = timing.headers.get("content-type", "no content type")
        return "buffered", f"not an event stream ({kind}): the whole reply came as one body"
    events = len(timing.text_event_ms)
    if events < limits.min_events or median_gap is None:
        return "failed", (
            f"only {events} text events: too few to judge, ask for a longer reply (max_tokens)"
        )
    if median_gap > limits.burst_gap_ms:
        return "streaming", (
            f"text spread over {events} events, median gap {median_gap:.1f} ms"
            f" ({timing.tokens / events:.2f} tokens per event)"
        )
    return _held(timing, limits, median_gap, bursts)


def _came_together(timing: ReplyTiming, limits: Thresholds, median_gap: float) -> bool:
    """Enough text events to judge, and most of them closer than ``burst_gap_ms``."""
    enough = len(timing.text_event_ms) >= limits.min_events
    return enough and median_gap <= limits.burst_gap_ms


def _held(
    timing: ReplyTiming, limits: Thresholds, median_gap: float, bursts: list[Burst]
) -> tuple[Verdict, str]:
    """Buffered or bursty, with why, for text events that came together (rule 5)."""
    events = len(timing.text_event_ms)
    largest = max(b.events for b in bursts)
    if largest >= limits.buffered_share * events:
        return "buffered", (
            f"{largest} of {events} text events arrived together at"
            f" {max(bursts, key=lambda b: b.events).at_ms:,.1f} ms"
        )
    sizes = ", ".join(str(b.events) for b in bursts[:12]) + (" ..." if len(bursts) > 12 else "")
    return "bursty", (
        f"median gap {median_gap:.1f} ms: {events} events came in {len(bursts)} bursts"
        f" after long silences (events per burst: {sizes})"
    )


def _hop_and_fix(
    verdict: Verdict, headers: dict[str, str], bursts: list[Burst]
) -> tuple[str | None, str | None]:
    server = headers.get("server", "").lower()
    nginx = "nginx" in server
    if verdict == "compressed":
        hop = "nginx gzip" if nginx else "a compressing hop (proxy, CDN or app middleware)"
        return hop, (
            "do not compress text/event-stream: drop it from gzip_types (nginx) or the "
            "compressor's type list, or flush the compressor after every event"
        )
    if verdict not in ("buffered", "bursty"):
        return None, None
    if "text/event-stream" not in headers.get("content-type", "").lower():  # any case
        return "the server: it answers with one body", "use the streaming endpoint (SSE)"
    page = _page_sized(bursts)
    sized = f"; bursts of about {page // 1024} KiB match one proxy buffer" if page else ""
    if nginx:
        return f"nginx proxy buffering{sized}", (
            "proxy_buffering off; in the streaming location (or send X-Accel-Buffering: no "
            "from the app and do not list it in proxy_ignore_headers)"
        )
    return f"a buffering hop between the app and this client{sized}", (
        "turn off response buffering on that hop (reverse proxy, CDN, load balancer or the "
        "app framework); compare with --direct to find which"
    )


def _page_sized(bursts: list[Burst]) -> int | None:
    # All bursts but the last (the remainder) near one buffer size suggest a buffering proxy.
    full = [b.approx_bytes for b in bursts[:-1]]
    if not full:
        return None
    typical = percentile(full, 50)
    for size in _PAGE_SIZES:
        if 0.8 * size <= typical <= 1.1 * size:
            return size
    return None


def compare(direct: Diagnosis, proxied: Diagnosis) -> str:
    """Which side of the proxy the trouble is on, from what was measured on each path.

    A hop can hold a stream but never spread out what reached it held: when the proxied path
    streams, so does the app, whatever the direct measurement shows.
    """
    if direct.streams and proxied.streams:
        return "both paths stream: no buffering hop found"
    if proxied.streams:
        if direct.verdict == "failed":
            return (
                f"the proxied path streams; the direct path failed ({direct.reason}): "
                "check the --direct URL, nothing on the proxied path needs fixing"
            )
        return (
            f"the proxied path streams, so the app does too (no hop can undo buffering); the "
            f"direct path came out {direct.verdict}: a hop only on the direct path, or a "
            "noisy measurement (run it again); nothing on the proxied path needs fixing"
        )
    if direct.streams:
        if proxied.verdict == "failed":
            return (
                f"the app streams but the proxied path failed ({proxied.reason}): the hop "
                "between them breaks the reply"
            )
        return (
            f"the app streams but the proxied path is {proxied.verdict}: the hop between "
            f"them ({proxied.hop or 'the proxy'}) holds the stream"
        )
    if direct.verdict == "failed":
        return f"the direct path failed ({direct.reason}); fix the app first"
    return (
        f"the app itself is already {direct.verdict} before any proxy: fix the app "
        "(or its framework) first"
    )
