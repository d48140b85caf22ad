"""Prometheus metrics for replies, kept off the per-event path.

Each reply keeps plain counters and timestamps in a ``ReplyRecord`` while it streams; when it
ends, ``Metrics.observe`` moves them into the registry in one go. The one per-token metric,
time between tokens, goes into a ``KeyedHistogram``: a bisect and an add, no lock, no
per-reply list, exported through a collector.

With ``--workers N`` every worker process counts its own replies; a scrape reaches one of
them. Aggregation is prometheus-client's multiprocess mode: the parent sets
``PROMETHEUS_MULTIPROC_DIR`` for its workers, each metric's value then lives in a per-process
memory-mapped file there, and a scrape merges every worker's files (``render``). Two things
cannot ride along by themselves and are published by hand in that mode only: the gap
histogram (its counts move into the files once per reply end, not per token) and what is
read on scrape, gauges and histograms whose owners keep the counts (a scrape runs in one
worker and cannot call another's functions, so each worker writes its readings into its
files every ``STATE_REFRESH_S`` and before it renders).
A single process keeps the plain in-memory registry, at the same cost as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from replystream.server.metric_files import back_metric_files, make_metric_files
from replystream.stats import LATENCY_BOUNDS

# Set (by ``run_workers``) to a directory shared by the worker processes: prometheus-client
# then keeps values in per-process files there, and a scrape merges them. Read by
# prometheus-client when it is imported, so it must be set before the process starts.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How often a worker writes its scrape-time gauges into its files (multiprocess mode only).
STATE_REFRESH_S = 1.0
# Counted by the parent of ``--workers`` (``metrics_dir.RestartCount``), in its own file of the
# workers' folder; every worker declares it too, at 0, so one process shows it as well.
WORKER_RESTARTS_NAME = "replystream_worker_restarts"
WORKER_RESTARTS_HELP = "Workers the parent of --workers started again after one exited."
# In the folder: the lock a scrape holds shared while it reads the files, and the parent
# exclusively while it moves the counts of a worker that exited into the files of the
# workers gone (``metrics_dir.absorb``), so that no scrape counts them twice, or not at all.
_FILES_LOCK = "files.lock"


@contextlib.contextmanager
def files_held(folder: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the lock on the metric files of ``folder`` (see ``_FILES_LOCK``)."""
    fd = os.open(os.path.join(folder, _FILES_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # (releases the lock)


# How a gauge read on scrape adds up across workers (prometheus-client's multiprocess modes):
# ``livesum`` what the workers alive now hold, summed; ``sum`` a count since start, summed
# over every worker that ever ran (a dead worker's last reading stays, as counters' do);
# ``livemax`` and ``livemin`` a state each worker keeps for itself, the highest or lowest.
AcrossWorkers = Literal["livesum", "sum", "livemax", "livemin"]

Outcome = Literal[
    "finished", "cancelled", "errored", "moderated", "slow_client", "shutdown", "rejected"
]
OUTCOMES: tuple[Outcome, ...] = (
    "finished",
    "cancelled",
    "errored",
    "moderated",
    "slow_client",
    "shutdown",
    "rejected",
)
# How one request ended, as its access-log line says (``outcome``): the outcome of its reply,
# in the words above, when the reply ended with it; or ``detached``: the request ended and
# its reply went on without it (a resumable reply its client left, within its detach grace; a
# background response; a reply other readers still read), or was not this process's to stop
# (made on another replica, or read once it had ended).
RequestOutcome = Outcome | Literal["detached"]

_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


# A label whose rows are shown only for the values its reader gives now (``only_current``).
CurrentValues = tuple[str, Callable[[], Collection[str]]]


class _OnlyCurrent:
    """A collector's families without the rows of label values no longer current."""

    def __init__(self, collector: MultiProcessCollector, current: list[CurrentValues]) -> None:
        self._collector = collector
        self._current = current

    def collect(self) -> Iterator[Metric]:
        current = [(label, read()) for label, read in self._current]
        for family in self._collector.collect():  # type: ignore[no-untyped-call]
            if current:
                family.samples = [
                    sample
                    for sample in family.samples
                    if all(
                        label not in sample.labels or sample.labels[label] in values
                        for label, values in current
                    )
                ]
            yield family


def _le(bound: float) -> str:
    """A bucket's upper bound as its ``le`` label."""
    return "+Inf" if bound == math.inf else repr(bound)


_GAPS_NAME = "replystream_time_between_tokens_seconds"
_GAPS_HELP = "Server time between consecutive tokens of a reply."

# Cumulative counts per label value, read from their owner when the histogram is exported:
# (label value, count per bucket with the last one past every bound, sum); a value that goes
# and comes back counts on from where it was.
HistogramTotals = Callable[[], Iterable[tuple[str, Sequence[int], float]]]


class KeyedHistogram:
    """A histogram with one label, fed at the cost of one bisect and one add (no lock, no
    per-reply storage) or read from counts its owner keeps, and exported by ``Metrics``'
    collector, or by ``publish`` into the multiprocess files.

    Args:
        name, documentation, label: the family's name, help text and only label.
        bounds: the buckets' upper bounds (``le``), ascending, without +Inf.
        totals: where the counts are kept, when not here (``observe`` is then unused).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        bounds: tuple[float, ...],
        totals: HistogramTotals | None = None,
    ) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}
        self._totals = totals
        # Multiprocess mode: what has been written to the files so far, and where.
        self._published: dict[str, tuple[list[int], list[float]]] = {}
        self._files: dict[str, tuple[list[_FileValue], _FileValue]] = {}

    def observe(self, key: str, value: float) -> None:
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = [0] * (len(self.bounds) + 1)
            self.sums[key] = 0.0
        counts[bisect_left(self.bounds, value)] += 1
        self.sums[key] += value

    def _read_totals(self) -> None:
        """The counts as their owner holds them now: a key it no longer has (an upstream
        taken out of the routes) goes, and comes back with its owner's counts. What was
        published of a key that went stays: its owner counts on from where it was (the
        relay keeps an upstream's counts), so only what it adds is published again."""
        if self._totals is None:
            return
        self.counts, self.sums = {}, {}
        for key, counts, total in self._totals():
            self.counts[key], self.sums[key] = list(counts), total

    def publish(self) -> None:
        """Write what was observed since the last call into this process's multiprocess
        files, as a histogram prometheus-client's merge reads (per-bucket counts, a sum)."""
        self._read_totals()
        for key, counts in self.counts.items():
            files = self._files.get(key) or self._open_files(key)
            done_counts, done_sum = self._published[key]
            buckets, total = files
            for i, count in enumerate(counts):
                if count != done_counts[i]:
                    buckets[i].inc(count - done_counts[i])
                    done_counts[i] = count
            if self.sums[key] != done_sum[0]:
                total.inc(self.sums[key] - done_sum[0])
                done_sum[0] = self.sums[key]

    def _open_files(self, key: str) -> tuple[list[_FileValue], _FileValue]:
        # The same keys prometheus-client's own Histogram writes, so its merge adds them up.
        value, name, help_text = prometheus_values.ValueClass, self.name, self.documentation
        buckets = [
            value(
                "histogram",
                name,
                name + "_bucket",
                (self.label, "le"),
                (key, _le(bound)),
                help_text,
            )
            for bound in (*self.bounds, math.inf)
        ]
        total = value("histogram", name, name + "_sum", (self.label,), (key,), help_text)
        self._files[key] = buckets, total
        self._published[key] = [0] * len(buckets), [0.0]
        return buckets, total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        self._read_totals()
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for key, counts in self.counts.items():
            cumulative, total = [], 0
            for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
                total += count
                cumulative.append((_le(bound), total))
            family.add_metric([key], cumulative, self.sums[key])
        yield family


@dataclass(slots=True)
class ReplyRecord:
    """What one reply did, in ``time.monotonic()`` seconds; owned by its producer alone."""

    endpoint: str
    streamed: bool
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    # False for an answer the engine makes whole in one call (embeddings): it is taken up
    # and answered at once, so no moment in it ends a time in a queue.
    queues: bool = True
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: KeyedHistogram | None = None  # where time between tokens goes, as it happens
    tokens: int = 0
    events: int = 0
    bytes_sent: int = 0
    outcome: Outcome = "cancelled"  # until proven otherwise: an exit we did not see is a cancel
    reason: str = ""
    key: str = ""  # who asked: a short prefix of the API key's digest ("" when auth is off)
    prompt_tokens: int = 0  # the engine's own count when it gave one, else the estimate
    cached_prompt_tokens: int = 0  # of the engine's own count, those its prefix cache held
    # With several choices (``n``): the last token of each choice but the first, so each
    # gap is one choice's time between its tokens, not between two choices' tokens.
    others_at: dict[int, float] | None = None
    # Once the reply is accounted for (``Metrics.observe``), its endpoint's events and bytes
    # counters: its readers send its last events (and any backlog) after it ended.
    sent_after: tuple[Counter, Counter] | None = None

    def admitted(self) -> None:
        """The engine took the request up: its time in the queue ends here."""
        self.admitted_at = time.monotonic()

    def on_delta(self, made_at: float, tokens: int, choice: int = 0) -> None:
        if tokens <= 0:  # a finish, a relay's marker: no token came, so no gap between two
            return
        if choice:
            self._on_other_choice(made_at, tokens, choice)
            return
        if self.last_token_at is None:
            if self.first_token_at is None or made_at < self.first_token_at:
                self.first_token_at = made_at  # (another choice's token may have come first)
        elif self.gaps is not None:
            self.gaps.observe(self.endpoint, made_at - self.last_token_at)
        self.last_token_at = made_at
        self.tokens += tokens

    def _on_other_choice(self, made_at: float, tokens: int, choice: int) -> None:
        others = self.others_at if self.others_at is not None else {}
        self.others_at = others
        last = others.get(choice)
        if last is not None and self.gaps is not None:
            self.gaps.observe(self.endpoint, made_at - last)
        others[choice] = made_at
        if self.first_token_at is None or made_at < self.first_token_at:
            self.first_token_at = made_at
        self.tokens += tokens

    @property
    def choices(self) -> int:
        """How many choices made tokens (1 for a reply of one)."""
        return 1 + (len(self.others_at) if self.others_at else 0)

    @property
    def time_per_output_token(self) -> float | None:
        """From the first token to the last, per token after the first, of one choice (the
        tokens of several choices are made side by side, not one after another)."""
        first, last = self.first_token_at, self.last_token_at
        if self.others_at:
            last = max([*self.others_at.values(), *([] if last is None else [last])])
        per_choice = self.tokens / self.choices
        if first is None or last is None or per_choice <= 1:
            return None
        return (last - first) / (per_choice - 1)

    def how_ended(self) -> tuple[Outcome, str | None]:
        """The outcome and reason (None: none) of a reply collected whole, or refused as it
        started, as its request's access-log line says them."""
        return self.outcome, self.reason or None

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self.bytes_sent += nbytes
        self.events += events
        late = self.sent_after
        if late is not None:
            late[0].inc(events)
            late[1].inc(nbytes)


class ReaderSends:
    """Where a reader of a reply produced elsewhere (another replica, or here before this
    reader came: a resume) counts what it sends: the events and bytes counters of the route
    it reads on, since the reply's own record is not here to take them."""

    __slots__ = ("_bytes", "_events", "reason")

    def __init__(self, events: Counter, bytes_sent: Counter) -> None:
        self._events = events
        self._bytes = bytes_sent
        self.reason = ""  # why a reader was cut: the producer's record keeps the reply's

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self._events.inc(events)
        self._bytes.inc(nbytes)


class _KeyCounters(NamedTuple):
    """One API key's token counters (``replystream_key_tokens``), one per kind."""

    prompt: Counter
    completion: Counter
    cached_prompt: Counter


_KEY_KINDS = _KeyCounters._fields


class _Children(NamedTuple):
    """The labelled series of one endpoint (replies also by outcome, filled as seen)."""

    replies: dict[str, Counter]
    e2e: Histogram
    queue: Histogram
    ttft: Histogram
    tpot: Histogram
    events: Counter
    bytes: Counter
    tokens: Counter


class _FileValue(Protocol):
    """One value prometheus-client keeps (in a multiprocess file, in that mode)."""

    def inc(self, amount: float) -> None: ...


class Metrics:
    """The server's metric families, in a registry of its own (one per application).

    Args:
        multiprocess_dir: the directory worker processes share their values through
            (default: ``$PROMETHEUS_MULTIPROC_DIR``, set by ``run_workers``); None for one
            process.
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROCESS_DIR_ENV) or None
        if self.multiprocess_dir is not None:
            back_metric_files()
            across = (f"gauge_{mode}" for mode in get_args(AcrossWorkers))
            make_metric_files(self.multiprocess_dir, ("counter", "histogram", *across))
        self._readings: list[tuple[Gauge, Callable[[], float]]] = []
        # With workers: labels whose rows are scraped only for their current values (an
        # upstream taken out of the routes), since the files the workers share keep every row.
        self._current: list[CurrentValues] = []
        self._read_histograms: list[KeyedHistogram] = []
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "replystream_time_to_first_token_seconds",
            "Server time from request arrival to the first token made.",
            ["endpoint"],
            buckets=LATENCY_BOUNDS,
            registry=r,
        )
        self.gaps = KeyedHistogram(_GAPS_NAME, _GAPS_HELP, "endpoint", _TOKEN_BUCKETS)
        r.register(self.gaps)
        self.tpot = Histogram(
            "replystream_time_per_output_token_seconds",
            "Per reply: (last token - first token) / (tokens - 1).",
            ["endpoint"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "replystream_queue_seconds",
            "Server time from request arrival until the engine admitted it.",
            ["endpoint"],
            buckets=LATENCY_BOUNDS,
            registry=r,
        )
        self.e2e = Histogram(
            "replystream_end_to_end_seconds",
            "Server time from request arrival until the reply ended, however it ended.",
            ["endpoint"],
            buckets=LATENCY_BOUNDS,
            registry=r,
        )
        self.active = Gauge(
            "replystream_active_streams",
            "Streamed replies open right now.",
            registry=r,
            multiprocess_mode="livesum",  # summed over the workers alive now
        )
        self.replies = Counter(
            "replystream_replies",
            "Replies by how they ended.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.events = Counter(
            "replystream_events_sent", "Events written to clients.", ["endpoint"], registry=r
        )
        self.bytes = Counter(
            "replystream_bytes_sent", "Body bytes written to clients.", ["endpoint"], registry=r
        )
        self.tokens = Counter(
            "replystream_tokens_generated", "Tokens the engine made.", ["endpoint"], registry=r
        )
        self.key_tokens = Counter(
            "replystream_key_tokens",
            "Tokens by API key (a digest prefix; 'anonymous' without auth) and kind "
            "(prompt, completion; cached_prompt: of the prompt's, those an engine's or "
            "upstream's prefix cache held), for every reply however it ended.",
            ["key", "kind"],
            registry=r,
        )
        self.worker_restarts = Counter(WORKER_RESTARTS_NAME, WORKER_RESTARTS_HELP, registry=r)
        self._states: dict[str, Gauge] = {}
        self._children: dict[str, _Children] = {}
        self._reader_sends: dict[str, ReaderSends] = {}
        self._key_children: dict[str, _KeyCounters] = {}

    def state(
        self,
        name: str,
        documentation: str,
        read: Callable[[], float],
        *,
        across: AcrossWorkers = "livesum",
        **labels: str,
    ) -> None:
        """A gauge read from ``read`` when scraped: what the process holds right now (tasks,
        files, KV blocks, reply logs), never updated per event; with workers, ``across``
        says how their readings add up (the first call for ``name`` decides)."""
        gauge = self._states.get(name)
        if gauge is None:
            gauge = self._states[name] = Gauge(
                name,
                documentation,
                sorted(labels),
                registry=self.registry,
                multiprocess_mode=across,
            )
        self.read_on_scrape(gauge.labels(**labels) if labels else gauge, read)

    def read_on_scrape(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Give ``gauge`` the value of ``read()`` whenever metrics are scraped: called by the
        scrape in one process; with workers, written by each every ``STATE_REFRESH_S`` (and
        before it renders) by ``refresh_readings``."""
        if self.multiprocess_dir is None:
            gauge.set_function(read)
        else:
            self._readings.append((gauge, read))

    def forget(self, name: str, **labels: str) -> None:
        """Stop reading the ``state`` row ``name`` with ``labels``, and drop it from the
        output (with workers, see ``only_current``: prometheus-client cannot remove a row its
        processes share through files)."""
        gauge = self._states[name]
        child = gauge.labels(**labels)
        self._readings = [(g, read) for g, read in self._readings if g is not child]
        if self.multiprocess_dir is None:
            gauge.remove(*(labels[label] for label in sorted(labels)))

    def only_current(self, label: str, values: Callable[[], Collection[str]]) -> None:
        """With workers, scrape the rows with ``label`` only for the ``values()`` of now, in
        every family: the files of every worker that ever ran keep every row (a worker
        started after a reload never had an upstream it took out). Each worker reads the
        same routes, so whichever one answers a scrape shows the same rows; an upstream put
        back shows its counts again."""
        self._current.append((label, values))

    def histogram_on_scrape(
        self,
        name: str,
        documentation: str,
        label: str,
        bounds: tuple[float, ...],
        totals: HistogramTotals,
    ) -> None:
        """A histogram whose counts its owner keeps (``totals``), read when scraped."""
        histogram = KeyedHistogram(name, documentation, label, bounds, totals)
        if self.multiprocess_dir is None:
            self.registry.register(histogram)
        else:
            self._read_histograms.append(histogram)

    @property
    def has_readings(self) -> bool:
        """Whether ``refresh_readings`` has work (only with workers sharing their values)."""
        return bool(self._readings or self._read_histograms)

    def refresh_readings(self) -> None:
        """Write everything read on scrape, as it is now, into this process's files."""
        for gauge, read in self._readings:
            gauge.set(read())
        for histogram in self._read_histograms:
            histogram.publish()

    def record(self, endpoint: str, *, streamed: bool) -> ReplyRecord:
        """A new reply's record, wired to the per-token histogram."""
        return ReplyRecord(endpoint, streamed, gaps=self.gaps)

    def reader_sends(self, route: str) -> ReaderSends:
        """The counters a reader of a reply not produced here counts into (``route``: the
        route it reads on, as the router names it: ``/v1/replies/{reply_id}/stream``)."""
        sends = self._reader_sends.get(route)
        if sends is None:
            sends = self._reader_sends[route] = ReaderSends(
                self.events.labels(route), self.bytes.labels(route)
            )
        return sends

    def observe(self, record: ReplyRecord) -> None:
        """Account for one reply that has ended."""
        endpoint = record.endpoint
        ended = time.monotonic()
        children = self._children.get(endpoint) or self._label(endpoint)
        outcome = children.replies.get(record.outcome)
        if outcome is None:
            outcome = children.replies[record.outcome] = self.replies.labels(
                endpoint, record.outcome
            )
        outcome.inc()
        children.e2e.observe(ended - record.arrived_at)
        if record.admitted_at is not None and record.queues:
            children.queue.observe(record.admitted_at - record.arrived_at)
        if record.first_token_at is not None:
            children.ttft.observe(record.first_token_at - record.arrived_at)
            tpot = record.time_per_output_token
            if tpot is not None:
                children.tpot.observe(tpot)
        if record.events:
            children.events.inc(record.events)
        if record.bytes_sent:
            children.bytes.inc(record.bytes_sent)
        record.sent_after = children.events, children.bytes
        if record.tokens:
            children.tokens.inc(record.tokens)
        # A request the engine never took up (refused, or its client left while it waited)
        # read none of its prompt.
        prompt_tokens = record.prompt_tokens if record.admitted_at is not None else 0
        if prompt_tokens or record.tokens:
            counters = self._key_children.get(record.key) or self._label_key(record.key)
            counters.prompt.inc(prompt_tokens)
            counters.completion.inc(record.tokens)
            if record.cached_prompt_tokens:
                counters.cached_prompt.inc(record.cached_prompt_tokens)
        if self.multiprocess_dir is not None:
            self.gaps.publish()

    def _label(self, endpoint: str) -> _Children:
        """One endpoint's labelled series, looked up once (``labels()`` costs per call)."""
        children = self._children[endpoint] = _Children(
            replies={},
            e2e=self.e2e.labels(endpoint),
            queue=self.queue.labels(endpoint),
            ttft=self.ttft.labels(endpoint),
            tpot=self.tpot.labels(endpoint),
            events=self.events.labels(endpoint),
            bytes=self.bytes.labels(endpoint),
            tokens=self.tokens.labels(endpoint),
        )
        return children

    def _label_key(self, key: str) -> _KeyCounters:
        label = key or "anonymous"
        counters = _KeyCounters(*(self.key_tokens.labels(label, kind) for kind in _KEY_KINDS))
        self._key_children[key] = counters
        return counters

    def render(self) -> bytes:
        """The Prometheus text for a scrape: this process's registry, or with workers every
        worker's values merged (counters and histograms summed, gauges of live workers
        summed)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.refresh_readings()
        merged = CollectorRegistry()
        workers = MultiProcessCollector(None, self.multiprocess_dir)  # type: ignore[no-untyped-call]
        merged.register(_OnlyCurrent(workers, self._current))
        with files_held(self.multiprocess_dir, exclusive=False):
            return generate_latest(merged)
