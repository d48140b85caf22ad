"""Judge how one reply was delivered: streaming, buffered, bursty, compressed or failed.

This file decides the verdict from the parsed text events of one reply (as the reference
article advises: time to first byte says nothing, the text events say everything), which hop
is the likely culprit, and the fix. It is pure: it reads a finished ``ReplyTiming`` and must
not know how the reply was requested.

The rules, in order:
1. failed: no complete reply (error status, in-band error, no end marker, timeout), or too few
   text events to judge;
2. compressed: the event stream carries a ``Content-Encoding`` and its events did not arrive
   one by one (rule 4), or could not be read: a compressor that waits for enough bytes holds
   small events. When they arrived held (rule 5), the reason and the fix say that too, since
   a hop that buffers as well as compresses still holds the stream once compression is off.
   A compressor that flushes after every event (nginx's gzip with proxy buffering off,
   Apache's mod_deflate, HAProxy's compression) holds nothing: that stream is judged by its
   events like any other, and a streaming verdict names the encoding;
3. not an event stream at all: buffered (one JSON body);
4. events are grouped into bursts, split wherever a gap exceeds ``burst_gap_ms``; when the
   median gap is above ``burst_gap_ms`` most events arrived on their own: streaming;
5. otherwise most text arrived together: buffered when one burst holds ``buffered_share`` of the
   events (all at the end), else bursty (long silences, then buffer-sized bursts).

The hop of a held stream, from its evidence: bursts of one proxy buffer (4 or 8 KiB) are a
buffering proxy (nginx when its ``Server`` header says so); small bursts on a steady beat of
about 200 ms are a hop that corks its writes (Linux sends a corked socket's partial segment
after 200 ms), as HAProxy does unless ``option http-no-delay``; a ``Via`` header naming
Varnish (which leaves the app's ``Server`` alone) is Varnish; anything else, a buffering hop.

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
from dataclasses import asdict, dataclass, field, replace
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
    "via",  # a hop that leaves the app's Server header names itself here (Varnish does)
    # Not about holding: a refusal's (429, 503) wait, which a failed verdict leaves the
    # user to act on (the reason quotes the body, which seldom says when to ask again).
    "retry-after",
)

_PAGE_SIZES = (4096, 8192)

# Linux holds a partial segment written with MSG_MORE or under TCP_CORK for at most 200 ms:
# a hop that corks every write releases what it holds on that beat (seen 205-220 ms, the
# timer's tick and the next event's arrival added).
_CORK_BEAT_MS = (180.0, 260.0)


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
        first_chunk_ms=timing.first_chunk_ms,
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
    answered = timing.status is not None and 200 <= timing.status < 300
    compressed = answered and timing.streamed and encoding not in ("", "identity")
    # A compressed event stream is the verdict even when its encoding (br) could not be read;
    # one whose events came one by one was flushed after each, and streams.
    if compressed and not (timing.complete and _one_by_one(timing, limits, median_gap)):
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
        flushed = (
            f"; compressed ({encoding}) and flushed after every event, so nothing held it"
            if compressed
            else ""
        )
        return "streaming", (
            f"text spread over {events} events, median gap {median_gap:.1f} ms"
            f" ({timing.tokens / events:.2f} tokens per event){flushed}"
        )
    return _held(timing, limits, median_gap, bursts)


def _came_together(timing: ReplyTiming, limits: Thresholds, median_gap: float) -> bool:
    """Enough text events to judge, and most of them closer than ``burst_gap_ms``."""
    enough = len(timing.text_event_ms) >= limits.min_events
    return enough and median_gap <= limits.burst_gap_ms


def _one_by_one(timing: ReplyTiming, limits: Thresholds, median_gap: float | None) -> bool:
    """Enough text events to judge, and most of them further apart than ``burst_gap_ms``."""
    enough = len(timing.text_event_ms) >= limits.min_events
    return enough and median_gap is not None and median_gap > limits.burst_gap_ms


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
    varnish = "varnish" in headers.get("via", "").lower()
    if verdict == "compressed":
        if varnish:  # its gzip compresses the whole object, then sends it
            return "Varnish's gzip (beresp.do_gzip), which holds the reply until it ends", (
                "do not set beresp.do_gzip for text/event-stream in vcl_backend_response"
            )
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
    beat = None if page else _cork_beat(bursts)
    if beat is not None:
        return (
            f"a hop that corks its writes (small bursts every {beat:.0f} ms, the most Linux "
            "holds a corked socket's data): HAProxy without option http-no-delay"
        ), (
            "option http-no-delay in HAProxy's frontend or backend for the streaming routes "
            "(another proxy: send each write at once, TCP_NODELAY without TCP_CORK or MSG_MORE)"
        )
    if varnish and not page:
        return "Varnish: beresp.do_stream = false (or its gzip) holds the reply", (
            "in vcl_backend_response keep beresp.do_stream = true (its default) and "
            "beresp.do_gzip unset for text/event-stream, or return (pipe) for the streaming "
            "routes in vcl_recv"
        )
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


def _cork_beat(bursts: list[Burst]) -> float | None:
    """The median time between bursts when it is Linux's cork timer, else None.

    The last burst is left out: the end of the reply releases it, not the timer.
    """
    starts = [b.at_ms for b in bursts[:-1]]
    beats = [after - before for before, after in itertools.pairwise(starts)]
    if len(beats) < 3:
        return None
    beat = percentile(beats, 50)
    low, high = _CORK_BEAT_MS
    return beat if low <= beat <= high else None


# The verdicts of a stream that arrived held (not one by one), whoever held it.
_HELD: frozenset[Verdict] = frozenset({"compressed", "buffered", "bursty"})


def _app_fix(direct: Diagnosis) -> str:
    """What the app must change when its own URL already holds the stream."""
    if direct.verdict == "compressed":
        change = (
            "stop compressing text/event-stream in the app (its gzip middleware), or flush "
            "the compressor after every event"
        )
    elif "text/event-stream" not in direct.headers.get("content-type", "").lower():
        change = "answer with the streaming endpoint (SSE), not one body"
    else:
        change = (
            "write and flush each event as it is made (no buffering in the app or its framework)"
        )
    return f"{change}; then run doctor again, to judge the proxy once the app streams"


def together(direct: Diagnosis, proxied: Diagnosis) -> tuple[Diagnosis, Diagnosis]:
    """Both paths' diagnoses with their hop and fix as both measurements tell them.

    Judged alone, each path names the hop its headers suggest: the proxy's ``Server`` (nginx)
    for the proxied path, "a hop between the app and this client" for the direct one. When
    the app's own URL already holds the stream and the proxied path holds it too, the app is
    the hop on both (what a proxy adds cannot be seen until the app streams), so neither
    names the proxy or a hop in between. Other pairs are left as judged (``compare`` says
    which side to look at).
    """
    if direct.verdict not in _HELD or proxied.verdict not in _HELD:
        return direct, proxied
    hop = f"the app (or its framework): its own URL is already {direct.verdict}"
    fix = _app_fix(direct)
    return replace(direct, hop=hop, fix=fix), replace(proxied, hop=hop, fix=fix)


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
