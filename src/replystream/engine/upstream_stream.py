"""One relayed reply: an upstream's OpenAI chat-completion stream read as ``Delta`` values.

This file decides how one upstream response's body becomes a reply's deltas, with nothing
buffered, and how its connection ends: the stream is a ``ChunkReader`` (``upstream_chunks``:
what each chunk means, and which misbehaviour of the upstream ends the reply), fed the body
bytes its connection reads. A failure of the connection itself ends the reply as an
``UpstreamStreamError`` too:
- ``upstream_disconnected``: the upstream closed the connection mid-body (killed, restarted);
- ``upstream_broken``: the connection broke otherwise.
A body cut after the finish reason is no failure: the reply was whole.
Closing the stream early (``aclose``/``close``, or cancelling its reader) closes the upstream
connection, which vLLM, TGI and llama.cpp treat as an abort; so does ending it where the relay
decided the reply is whole (``end_whole``); a finished one goes back to its pool. It is
told its upstream's name (its base URL) for its words; it must not know how the request was
built, why that upstream was picked, or anything about our own HTTP server.

A stream is read one of two ways, with the same parse and the same failures: iterated (each
read awaits the body, as any ``DeltaStream``), or attached to a sink (``PushDeltaStream``).
Either way the stream is its response's ``BodyReceiver`` (``upstream_http``): the
connection, as it takes body bytes off the socket in ``data_received``, hands them here, and
they are parsed at once. Attached, the deltas go to the sink in that same call (no task, no
extra turn of the loop); iterated, they wait for the reader, and past ``PENDING_HIGH`` of them
the connection stops reading until the reader catches up. Time is not this file's to bound:
how long an upstream may take to its first text, and between texts, is the relayed reply's
watchdog's (``upstream_relay``), which knows the limits of the upstream it sent the request
to and counts text and thinking as progress (bytes such as keep-alive comments are not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from replystream.engine.base import Delta, DeltaSink
from replystream.engine.upstream_chunks import ChunkReader, UpstreamStreamError
from replystream.engine.upstream_errors import broken_stream
from replystream.engine.upstream_http_connection import Response

log = logging.getLogger("replystream.upstream")


# How long a finished reply's connection may wait for the end of its body (to be reused).
BODY_END_WAIT_S = 1.0

# Deltas an iterating reader may leave unread before the connection stops reading (and how
# few are left when it reads again).
PENDING_HIGH = 256
PENDING_LOW = 64


class UpstreamStream(ChunkReader):
    """A ``PushDeltaStream`` over one upstream response; owns (and closes) its connection."""

    def __init__(
        self,
        response: Response,
        *,
        name: str,
        max_event_size: int,
        withheld: tuple[str, ...] = (),
        on_end: Callable[[str, int], None] | None = None,
        logprobs: bool = False,
        reasoning: bool = False,
    ) -> None:
        super().__init__(
            name=name,
            max_event_size=max_event_size,
            withheld=withheld,
            logprobs=logprobs,
            reasoning=reasoning,
        )
        self._name = name  # the upstream's base URL, as its failures name it
        self._response = response
        self._deltas = 0  # deltas handed out
        self._on_end = on_end
        self._waiter: asyncio.Future[None] | None = None  # an iterating reader's wait
        self._paused = False  # the connection's reading, paused for an iterating reader
        self._sink: DeltaSink | None = None  # attached (push) reading's
        self._let_go_done = False
        # The relay decided the reply is whole (a stop string completed in the text, the
        # request's token limit reached), though its upstream still writes (``end_whole``).
        self._ended_whole = False
        response.set_receiver(self)  # what came with the head is parsed now

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            while not self._pending:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise StopAsyncIteration
                await self._body()
        except BaseException:
            # An error, an exhausted stream or a cancelled reader: the connection goes now.
            self._close()
            raise
        delta = self._pending.popleft()
        self._deltas += 1
        if self._ended and not self._pending:
            self._close()
        elif self._paused and len(self._pending) <= PENDING_LOW:
            self._paused = False
            self._response.resume_reading()
        return delta

    async def _body(self) -> None:
        """Wait (iterated) for the connection to hand over body bytes, its end or a failure."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def aclose(self) -> None:
        """Stop relaying: close the upstream connection unless the reply already ended."""
        self.close()

    def close(self) -> None:
        """Stop now (iterated or attached): the sink is called no more."""
        self._ended = True
        self._pending.clear()
        self._sink = None
        self._close()

    def attach(self, sink: DeltaSink) -> None:
        """Deliver every delta to ``sink`` from the connection's own reads (no task)."""
        self._sink = sink
        if self._paused:
            self._paused = False
            self._response.resume_reading()
        if self._pending or self._ended or self._error is not None:
            # What arrived with the response head, or since (most often the first text),
            # goes to the sink now: a turn of the loop later, it would leave after the
            # response head rather than with it.
            self._flush()

    # -- BodyReceiver: called by the connection as it reads --------------------------------

    def body_data(self, data: bytes) -> None:
        """Body bytes off the socket: parsed now; attached, delivered now."""
        if self._ended:
            return
        now = time.monotonic()
        try:
            self._take(data, now)
        except UpstreamStreamError as error:
            self._error = error
        self._readable()

    def body_end(self, failure: Exception | None) -> None:
        """The body ended, in full (None) or not. Cut after a finish reason, the reply was
        whole (only the usage and ``[DONE]`` were still to come): it ends as if the body had."""
        if self._ended:
            return
        try:
            if failure is not None and self._finish is None:
                # Nothing of the reply yet (a head, keep-alive comments): said as such.
                replied = self._tokens > 0 or self.thought_at > 0.0
                broken = broken_stream(failure, self._name, replied=replied)
                raise self._fail(broken.message, broken.code)
            self._end_of_body()
        except UpstreamStreamError as error:
            self._error = error
        self._readable()

    @property
    def finish_seen(self) -> bool:
        """The upstream sent its finish reason; only its usage and ``[DONE]`` are to come."""
        return self._finish is not None and not self._ended

    def end_at_finish(self) -> None:
        """End the reply now, as finished: the upstream sent its finish reason and then
        nothing (no usage, no ``[DONE]``) for as long as a reply may stall. The reply is
        whole, as one cut after its finish reason is; the count is this side's."""
        if not self.finish_seen:
            return
        self._finish_reply(time.monotonic())
        self._readable()

    def end_whole(self) -> None:
        """End the reply now, as finished: a stop string completed in the text relayed (the
        reply pipeline ends the reply there), or the upstream wrote past the request's token
        limit. The upstream, still writing, is stopped as at any cancel (its connection
        closed, not reused); no usage comes, so the count is this side's. The sink is called
        no more."""
        self._ended_whole = True
        self.close()

    def _readable(self) -> None:
        if self._sink is not None:
            self._flush()
            return
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        elif not self._paused and len(self._pending) > PENDING_HIGH and not self._ended:
            self._paused = True  # nobody reads: stop reading the socket until they do
            self._response.pause_reading()

    def _flush(self) -> None:
        sink = self._sink
        if sink is not None:
            try:
                self._deliver(sink)
            except Exception:  # a failing sink ends its own stream, and nothing else
                log.exception("delivering a relayed reply's deltas failed")
                self._abandon()

    def _abandon(self) -> None:
        """Delivering failed (a bug of ours): stop, and tell the sink once that it ended."""
        sink = self._sink
        self._failed = True
        self.close()
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.on_end(
                    UpstreamStreamError("relaying the reply failed", code="upstream_broken")
                )

    def _close(self) -> None:
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            whole = self._clean or self._ended_whole
            outcome = "finished" if whole else "failed" if self._failed else "cancelled"
            on_end(outcome, self._deltas)
        self._let_go()

    def _let_go(self) -> None:
        if self._let_go_done:
            return
        self._let_go_done = True
        if self._clean:
            # Finished: the connection goes back to the pool once the body's last bytes
            # (the chunked terminator, often a write of its own) are in; if they do not
            # come within BODY_END_WAIT_S, it is closed.
            self._response.release(BODY_END_WAIT_S)
        else:
            self._response.close()  # closing the socket is how an upstream learns to abort

    def _deliver(self, sink: DeltaSink) -> None:
        """Hand what was parsed to the sink; end the stream, or wait for more bytes."""
        if self._pending:
            deltas, self._pending = self._pending, deque()
            self._deltas += len(deltas)
            sink.on_deltas(deltas)
            if self._sink is None:  # the sink closed the stream while taking them
                return
        if self._error is not None or self._ended:
            error, self._error = self._error, None
            self._sink = None
            self._close()
            sink.on_end(error)
