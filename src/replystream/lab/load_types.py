"""The terms of a load run: what it is asked (``LoadConfig``), what one request measured
(``RequestRecord``) and what the whole run measured (``LoadRun``).

This file only names things and refuses a config that cannot run; sending is ``load``'s, what
the timings mean is ``benchstats``'s. It must not send a request.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from replystream.client import ReplyTiming
from replystream.lab.drop_resume import Cursor, ResumeOutcome
from replystream.lab.profiles import Profile
from replystream.lab.server_metrics import Scrape
from replystream.lab.workload import Api, Lengths, Prompt


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One load run, paced by ``profile``, bounded by ``requests``, ``duration_s`` or both
    (a throughput run, which issues everything at once, needs ``requests``);
    ``output_tokens=None`` lets the server pick reply length."""

    url: str
    api: Api
    profile: Profile = field(default_factory=Profile.synchronous)
    requests: int | None = 10
    duration_s: float | None = None
    prompt_words: Lengths = field(default_factory=lambda: Lengths("fixed", 0))
    output_tokens: Lengths | None = None
    # Prompts from a dataset or a trace (then prompt_words is not used); a trace's are sent
    # in order, request i the trace's i-th.
    prompts: tuple[Prompt, ...] = ()
    prompts_in_order: bool = False
    system_words: int = 0  # a system prompt of this many words that every request shares
    # Turns per conversation: each turn after the first resends the conversation so far (its
    # prompts and the replies received), as a chat client does. requests counts conversations.
    turns: int = 1
    # Each reply asked to run to its max_tokens, past the model's end token.
    ignore_eos: bool = False
    # A share of conversations whose first reader hangs up after cancel_after tokens.
    cancel_share: float = 0.0
    cancel_after: int = 1
    # A share of conversations (native or Responses API) whose first reader drops after
    # drop_after tokens and resumes, saying where with resume_cursor (the Last-Event-ID
    # header or the route's query parameter); drawn apart from the cancelling share.
    drop_share: float = 0.0
    drop_after: int = 1
    resume_cursor: Cursor = "header"
    # Scrape this Prometheus /metrics after the warm-up and when the run ended, if set.
    server_metrics: str | None = None
    metrics_interval_s: float | None = None  # ... and during the run at this interval
    # Sent with every request, resume and scrape (an Authorization a deployment wants).
    headers: tuple[tuple[str, str], ...] = ()
    # The TLS context for an https URL (None: verify against the system's CAs).
    tls: ssl.SSLContext | None = None
    model: str = "default"
    seed: int = 0
    timeout_s: float = 300.0
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give requests, duration_s or both")
        if self.requests is None and self.profile.kind == "throughput":
            raise ValueError("the throughput profile issues every request at once: give requests")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")
        if self.system_words < 0:
            raise ValueError("system_words must be >= 0")
        if self.turns < 1:
            raise ValueError("turns must be at least 1")
        if not 0.0 <= self.cancel_share <= 1.0 or self.cancel_after < 1:
            raise ValueError("cancel_share must be within 0..1 and cancel_after >= 1")
        if not 0.0 <= self.drop_share <= 1.0 - self.cancel_share or self.drop_after < 1:
            raise ValueError("drop_share must be within 0..1 - cancel_share, drop_after >= 1")
        if self.metrics_interval_s is not None and (
            self.server_metrics is None or not self.metrics_interval_s > 0
        ):
            raise ValueError("metrics_interval_s must be positive and needs server_metrics")
        if self.drop_share and self.api not in ("native", "responses"):
            raise ValueError(
                "drop and resume speaks the native API (POST .../v1/replies) or the Responses "
                "API (POST .../v1/responses)"
            )
        if self.prompts_in_order and not self.prompts:
            raise ValueError("prompts_in_order needs prompts")

    @property
    def mode(self) -> str:
        return self.profile.describe()


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request and its reply. ``start_s`` is when it was sent, from the run's start;
    ``prompt_words`` counts the whole prompt sent (a later turn's history included).
    ``scheduled_s``: when an open loop meant to send it (None for a closed loop's requests
    and a conversation's later turns, which follow a reply, not a schedule)."""

    index: int
    start_s: float
    prompt_words: int
    max_tokens: int | None
    timing: ReplyTiming
    turn: int = 0
    resume: ResumeOutcome | None = None  # what a dropped and resumed read found
    scheduled_s: float | None = None


@dataclass(frozen=True, slots=True)
class LoadRun:
    """Everything one run measured, requests in index order."""

    config: LoadConfig
    records: tuple[RequestRecord, ...]
    wall_s: float  # first request sent to last reply ended
    client_cpu_s: float  # this process's CPU time over the same span
    server_before: Scrape | None = None  # the server's /metrics as the run started
    server_after: Scrape | None = None  # ... and once it ended and the server went idle
    server_error: str | None = None  # why they could not be read
    # Scrapes during the run: (seconds from its start, scrape), every metrics_interval_s.
    server_samples: tuple[tuple[float, Scrape], ...] = ()
    # Why the run stopped before it began to measure: its first request could not connect.
    unreachable: str | None = None
    # Stopped by ``interrupt``: the records are the requests that ended before it.
    interrupted: bool = False
    # When each request the interrupt cancelled in flight was sent (seconds from the start):
    # sent, so counted as sent, but with no reply to record.
    cancelled_in_flight_s: tuple[float, ...] = ()

    @property
    def client_cpu_share(self) -> float:
        """Process CPU time / wall time: 1.0 is one core fully busy."""
        return self.client_cpu_s / self.wall_s if self.wall_s > 0 else 0.0
