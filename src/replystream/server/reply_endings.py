"""Every way a streamed reply can end, as data: what each one counts, logs and tells readers.

``ENDINGS`` maps each way to its ``EndingRule``: the metric outcome, the terminal entry of
the log (what a reader on any replica ends with), the in-band event the readers get last,
the reason kept on the reply's record, and whether this server logs it. ``Reply._conclude``
looks the rule up and runs the steps every ending shares; ``docs/ARCHITECTURE.md`` shows the
table made by ``markdown_table`` (``python scripts/reply_endings_table.py`` writes it, and a
test fails when the document is stale).

The words only one reply can give (an engine's message and code, the check that matched)
come with its ``Ending`` and fill the rule's ``{detail}`` and ``{code}``. What an ending
frees is the same for every way (``Reply._conclude``'s common steps), so it is no column.
This file knows no log, task or HTTP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from replystream.delivery.follower import EVENTS_LOST, REPLY_EVICTED
from replystream.delivery.frame_transport import Ending as ReaderEnding
from replystream.delivery.replay import StoreUnavailable
from replystream.engine.base import EngineError
from replystream.server.metrics import Outcome

# How a reader, or the server, stops a reply (``Reply.stop``).
StopReason = Literal[
    "cancelled",
    "client_gone",
    "slow_client",
    "shutdown",
    "detach_expired",
    "detach_refused",
    "taken_for_lost",
]
Way = (
    Literal["finished", "moderated", "engine_error", "store_failure", "internal_error"] | StopReason
)
# The in-band event that closes a reply's log: an end marker (``[DONE]`` or ``done``), the
# ``moderated`` event (logged when the check matched), or an ``error`` event.
InBand = Literal["end marker", "moderated", "error"]


@dataclass(frozen=True, slots=True)
class EndingRule:
    """What one way of ending does. ``{detail}`` and ``{code}`` in a field are filled from
    the reply's ``Ending``.

    Attributes:
        outcome: the metric outcome (``replystream_replies_total{outcome=...}``).
        log_end: the log's terminal entry (``ReplayStore.end``).
        in_band: the last event readers get.
        code: the ``error`` event's code (empty unless ``in_band`` is ``error``).
        message: the ``error`` event's message.
        reason: the record's reason ("" for none).
        log_level: this server logs the ending at this level (None: not at all).
        log_message: what it logs.
        detail: what fills ``{detail}`` (for the documentation).
    """

    outcome: Outcome
    log_end: str
    in_band: InBand
    code: str = ""
    message: str = ""
    reason: str = ""
    log_level: int | None = None
    log_message: str = ""
    detail: str = ""


def _stopped(way: StopReason, outcome: Outcome = "cancelled") -> EndingRule:
    return EndingRule(outcome, "cancelled", "error", "cancelled", f"reply stopped: {way}", way)


ENDINGS: dict[Way, EndingRule] = {
    "finished": EndingRule("finished", "finished", "end marker"),
    # A check matched; or the reply ended ``finished`` and its end made a match that reached
    # the end of the text so far final (``Reply._conclude`` takes this row then).
    "moderated": EndingRule(
        "moderated", "moderated", "moderated", reason="{detail}", detail="the check that matched"
    ),
    # An EngineError while streaming: its own message and code.
    "engine_error": EndingRule(
        "errored",
        "errored",
        "error",
        code="{code}",
        message="{detail}",
        reason="{code}",
        log_level=logging.WARNING,
        log_message="generation failed: {detail}",
        detail="the engine's message",
    ),
    # The store failed under the producer's appends: said as every reader elsewhere says it
    # when the store fails under them (``StoreUnavailable``).
    "store_failure": EndingRule(
        "errored",
        "errored",
        "error",
        code=StoreUnavailable.code,
        message="{detail}",
        reason=StoreUnavailable.code,
        log_level=logging.WARNING,
        log_message="generation failed: {detail}",
        detail="the store's failure, described",
    ),
    # A bug of ours: logged with its traceback; the client is told only its type.
    "internal_error": EndingRule(
        "errored",
        "errored",
        "error",
        code="internal_error",
        message="internal error: {detail}",
        log_level=logging.ERROR,
        log_message="reply producer failed",
        detail="the exception's type",
    ),
    "shutdown": EndingRule(
        "shutdown", "shutdown", "error", "shutdown", "the server is shutting down", "shutdown"
    ),
    "cancelled": _stopped("cancelled"),
    "client_gone": _stopped("client_gone"),
    "slow_client": _stopped("slow_client", "slow_client"),
    "detach_expired": _stopped("detach_expired"),
    # Its client left it as its key (or address) already had as many replies running for
    # nobody as it may have requests at once: stopped, as a reply nobody may resume is.
    "detach_refused": _stopped("detach_refused"),
    # This process stalled past its liveness (stopped, frozen, cut off from the store), and
    # a reader on another replica found the reply's producer lost and told its client so:
    # back, the producer ends the reply as they were told (the store takes no more of it).
    "taken_for_lost": EndingRule(
        "errored",
        "errored",
        "error",
        "generator_lost",
        "the replica generating this reply stalled and was taken for gone",
        "generator_lost",
        logging.WARNING,
        "stopped: this process stalled past its liveness, and readers on other replicas "
        "were told the reply is lost",
    ),
}


# A request whose reader was cut by itself ended so, as its access-log line says (the
# outcome in the metrics' words, and the code its client was told): its reply may have gone
# on, or ended elsewhere. A reader's other endings are its reply's (``ended``) or its
# client's leaving (``client_gone``): ``server.accounts`` reads those from the reply.
READER_CUTS: dict[ReaderEnding, tuple[Outcome, str]] = {
    "slow_client": ("slow_client", "slow_client"),
    "shutdown": ("shutdown", "shutdown"),
    "producer_lost": ("errored", "generator_lost"),
    "expired": ("errored", "expired"),
    "deleted": ("cancelled", "deleted"),  # as the producer's ending counts it
    "evicted": ("errored", REPLY_EVICTED),
    "store_unavailable": ("errored", StoreUnavailable.code),
    "events_lost": ("errored", EVENTS_LOST),
    "failed": ("errored", "internal_error"),
}


@dataclass(frozen=True, slots=True)
class Ending:
    """How one reply ended: its way, and what only this reply can say.

    Attributes:
        way: the row of ``ENDINGS``.
        detail: fills ``{detail}`` (see the rule's ``detail``).
        code: fills ``{code}``: an engine's error code.
        status: an engine's error's HTTP status (``EngineError.status``), what the same
            failure is before the stream and asked whole, whose error type the in-band
            error takes (None: the dialect's type by code alone).
        error: the exception, when the log should show its traceback (a bug of ours).
    """

    way: Way
    detail: str = ""
    code: str = ""
    status: int | None = None
    error: BaseException | None = None

    @classmethod
    def of_error(cls, error: Exception) -> Ending:
        """The ending an exception from the engine's stream means: an ``EngineError`` is
        the engine's to explain; anything else is a bug of ours."""
        if isinstance(error, EngineError):
            return cls("engine_error", str(error), error.code, error.status)
        return cls("internal_error", type(error).__name__, error=error)

    @property
    def rule(self) -> EndingRule:
        return ENDINGS[self.way]

    def fill(self, template: str) -> str:
        """``template`` with this reply's words in it."""
        return template.format(detail=self.detail, code=self.code) if "{" in template else template


def _shown(template: str, rule: EndingRule) -> str:
    if not template:
        return "-"
    if template == "{code}":
        return "the engine's code"
    if template == "{detail}":
        return rule.detail
    return f"`{template.replace('{detail}', '...')}`"


_LEVELS = {None: "-", logging.WARNING: "warning", logging.ERROR: "error, with traceback"}


def markdown_table() -> str:
    """``ENDINGS`` as the Markdown table ``docs/ARCHITECTURE.md`` shows."""
    rows = [
        "| Ending | Metric outcome | Log ends | Last event | Code | Message | Record reason | "
        "Logged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for way, rule in ENDINGS.items():
        cells = [
            way,
            f"`{rule.outcome}`",
            f"`{rule.log_end}`",
            rule.in_band,
            _shown(rule.code, rule),
            _shown(rule.message, rule),
            _shown(rule.reason, rule),
            _LEVELS[rule.log_level],
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


# The generated table sits between these lines in docs/ARCHITECTURE.md.
TABLE_BEGIN = (
    "<!-- generated from server/reply_endings.py by scripts/reply_endings_table.py: do not edit -->"
)
TABLE_END = "<!-- end of the generated table -->"


def with_current_table(document: str) -> str:
    """``document`` with the text between the table's markers replaced by ``markdown_table``.

    Raises:
        ValueError: the markers are missing, or out of order.
    """
    begin, end = document.find(TABLE_BEGIN), document.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the document needs the lines {TABLE_BEGIN!r} and {TABLE_END!r}")
    head = document[: begin + len(TABLE_BEGIN)]
    return f"{head}\n{markdown_table()}{document[end:]}"
