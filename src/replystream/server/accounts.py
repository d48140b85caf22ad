"""How one request that started or read a reply ended, as its access-log line says it.

A request's line says its ``outcome``, in the words ``replystream_replies_total`` counts
replies by (``metrics.RequestOutcome``), and its ``reason`` (the record's reason: an error's
code, the check that matched, why a reply was stopped). A request answered whole, or refused
as its reply started, ends with its reply: the reply's record says it (``ReplyRecord`` is its
own account). A request that streams a reply, or waits for a stored response, is this
module's ``ReplyAccount``, read once, as the line is written:
- its reader cut by itself (too slow, the server shutting down, the reply lost or gone):
  ``reply_endings.READER_CUTS``, whatever the reply did then;
- its reader sent the reply's end: the reply's outcome (from the log's terminal entry for a
  reply made elsewhere, whose reason is not known here);
- its client left, or it never read (a background response): the reply's outcome if its
  ending is decided by then (stopped as its client left, or ended before), else ``detached``.

A request answered with a stored response's object (``GET /v1/responses/{id}``, a poll)
read the reply without following it to its end: its ``ObjectRead`` counts the object it
was sent, and says no outcome.

A WebSocket's ``reply`` message is not its request's (the socket's line is the upgrade's):
each has a line of its own once it has ended (``access_log.log_socket_reply``), from its
``SocketReply``, which reads its reply as a ``ReplyAccount`` does.

Nothing here runs per event. It must not know how the log is kept or how bytes are framed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from replystream.delivery.follower import Follower, SendRecord
from replystream.server.metrics import Outcome, ReplyRecord, RequestOutcome
from replystream.server.replies import Reply
from replystream.server.reply_endings import READER_CUTS


@dataclass(slots=True)
class ReplyAccount:
    """A request reading a reply: its own (streamed, or a stored response answered whole or
    in the background), or one it resumes.

    Attributes:
        sends: where what it sends counts (the reply's record; a route's counters for a
            reply made elsewhere).
        reply: the reply's producer, when it runs in this process.
        follower: the request's reader of the reply's log, for a stream.
    """

    sends: SendRecord
    reply: Reply | None = None
    follower: Follower | None = None

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self.sends.on_send(nbytes, events)

    def how_ended(self) -> tuple[RequestOutcome, str | None]:
        follower, reply = self.follower, self.reply
        ending = None if follower is None else follower.ending
        if ending is not None and ending != "ended" and ending != "client_gone":
            return READER_CUTS[ending]
        if reply is not None:
            decided = reply.how_ended()
            if decided is not None:
                return decided
        elif follower is not None and follower.log_end is not None:
            # The terminal entries are outcomes' words (``EndingRule.log_end``).
            return cast(Outcome, follower.log_end), None
        return "detached", None


@dataclass(slots=True)
class ObjectRead:
    """A request answered with a reply's object as its log tells it now (a stored
    response's): the body counts where a reader of the reply on its route counts (``sends``),
    and the request has no outcome of its own; the reply's requests tell how it ended."""

    sends: SendRecord

    def on_send(self, nbytes: int, events: int = 1) -> None:
        self.sends.on_send(nbytes, events)

    def how_ended(self) -> tuple[None, None]:
        return None, None


@dataclass(slots=True)
class SocketReply:
    """One ``reply`` message of a WebSocket, as its access-log line tells it.

    Attributes:
        tag: the client's tag for it (None: a message refused before its tag was read).
        asked_at: when its message came (``time.monotonic``).
        status: as the same request over HTTP would have it: its refusal's or failure's, or
            200 once its reply began; None while it has none (its socket went first).
        record: its reply's record, once its admission began.
        reply: its reply, once begun.
        follower: the socket's reader of it.
    """

    tag: str | None
    asked_at: float
    status: int | None = None
    record: ReplyRecord | None = None
    reply: Reply | None = None
    follower: Follower | None = None

    def keep(self, record: ReplyRecord) -> None:
        self.record = record

    def on_send(self, nbytes: int, events: int = 1) -> None:
        """A message sent for it outside its log (its refusal as it started), counted as a
        refusal's body is over HTTP."""
        if self.record is not None:
            self.record.on_send(nbytes, events)

    @property
    def line_status(self) -> int | str:
        """Its line's status: ``"client_gone"``, as over HTTP, when its socket went under it
        (closed by its client, or cut for another reply on it)."""
        follower, status = self.follower, self.status
        if status is None or (follower is not None and follower.ending == "client_gone"):
            return "client_gone"
        return status

    @property
    def reply_id(self) -> str | None:
        return None if self.reply is None else self.reply.reply_id

    @property
    def sent(self) -> tuple[int, int] | None:
        """The events and bytes its reply's readers sent (the socket's; and any resume's of
        it over HTTP); None for a message refused before its reply's record was made."""
        record = self.record
        return None if record is None else (record.events, record.bytes_sent)

    def how_ended(self) -> tuple[RequestOutcome, str | None] | None:
        """Its reply's outcome and reason, as a request reading it says them (refused as it
        started: its record's); None: it made no reply."""
        record, reply = self.record, self.reply
        if record is None:
            return None
        if reply is None:
            return record.how_ended()
        return ReplyAccount(record, reply, self.follower).how_ended()
