"""Turn the bytes of an event stream into events, exactly as the WHATWG HTML standard says.

This file decides how bytes become `Event`s: line splitting, decoding, field rules, when an
event is dispatched, and how large a pending event may grow. It is sans-IO: it must not know
where the bytes come from, what time it is, or what the caller does with the events.

Reference: https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
"""

from __future__ import annotations

import codecs
from typing import NoReturn

from replystream.sse.events import Event, EventTooLarge, SSEError

__all__ = ["EventParser"]

# The standard decodes the whole stream with "UTF-8 decode", which strips one leading BOM and
# replaces invalid sequences with U+FFFD; the utf-8-sig incremental decoder does exactly that,
# and holds back a character (or BOM) split across chunks until it is complete.
_new_decoder = codecs.getincrementaldecoder("utf-8-sig")


class EventParser:
    """Incremental event-stream parser: `feed` bytes in any chunking, get dispatched events.

    A parsed event's ``id`` is the last event ID in force when it was dispatched (``""`` if
    none) and its ``retry`` is always ``None``: a ``retry`` field sets the stream's reconnection
    time, read it from `retry`.

    ``max_event_size`` bounds memory against hostile streams. It counts decoded characters
    (equal to bytes for ASCII) of the pending event: the data buffer (each value and the LF
    the standard appends after it: ``data: ab`` then ``data: c`` hold 5) plus the line being
    read. Any line, terminated or not, that would take that past the limit raises
    `EventTooLarge`, whatever the chunking.

    ``error_field`` reads a line of the field ``error``, which the standard ignores, as an
    ``event: error`` with its value as a ``data`` line: llama.cpp's server (its builds before
    October 2025) wrote an error mid-stream so, as ``error: {...}``, then ``data: [DONE]``.
    A reader of a stream that is not one's own may take it (the relay does); off by default.
    """

    __slots__ = (
        "_bytes_fed",
        "_closed",
        "_data",
        "_data_size",
        "_decoder",
        "_discarded_incomplete",
        "_dispatched_id",
        "_error_field",
        "_events",
        "_last_id",
        "_max_size",
        "_pending",
        "_retry",
        "_skip_lf",
        "_tail",
        "_tail_size",
        "_type",
        "_whole_chars",
    )

    def __init__(self, max_event_size: int = 1 << 20, *, error_field: bool = False) -> None:
        if max_event_size < 1:
            raise ValueError(f"max_event_size must be positive, got {max_event_size}")
        self._max_size = max_event_size
        self._error_field = error_field
        self._decoder = _new_decoder("replace")
        self._whole_chars = False  # the decoder holds no bytes and has settled the BOM
        self._tail: list[str] = []  # pieces of the line read so far, not yet terminated
        self._tail_size = 0
        self._skip_lf = False  # the last text ended in CR: a leading LF is its CRLF partner
        self._data: list[str] = []
        self._data_size = 0  # len of the data buffer: each value and the LF after it
        self._type = ""
        self._last_id = ""  # the last event ID buffer
        self._dispatched_id = ""  # the last event ID string: the buffer at the last blank line
        self._retry: int | None = None
        self._pending = False  # a field line was read since the last blank line
        self._closed = False
        self._discarded_incomplete = False
        self._events = 0
        self._bytes_fed = 0

    @property
    def last_event_id(self) -> str:
        """The last event ID string: the ``id`` in force at the last blank line (an event's
        end, dispatched or empty). What a reconnecting client sends as ``Last-Event-ID``: an
        ``id`` of an event cut off before its blank line does not count, as that event was
        never received."""
        return self._dispatched_id

    @property
    def last_event_id_buffer(self) -> str:
        """The last event ID buffer: set by every ``id`` field without NUL, its event ended
        or not (what the next dispatched event will carry)."""
        return self._last_id

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) from the last valid ``retry`` field, if any."""
        return self._retry

    @property
    def at_boundary(self) -> bool:
        """True if the bytes fed so far end exactly after an event (or comment) block.

        False while a line is unterminated (including a character or BOM split across
        chunks) or while field lines wait for their blank line; `close` at that point
        discards an incomplete event.
        """
        return not (self._tail or self._pending or self._decoder.getstate()[0])

    @property
    def at_rest(self) -> bool:
        """Whether the bytes fed so far ended after a whole event and whole characters: what
        ``at_boundary`` says, in fewer steps (a caller that takes a whole event's bytes
        itself asks it once per read)."""
        return self._whole_chars and not (self._tail or self._pending or self._skip_lf)

    @property
    def discarded_incomplete(self) -> bool:
        """True if `close` found an incomplete event (or partial line) and discarded it."""
        return self._discarded_incomplete

    @property
    def closed(self) -> bool:
        """True after `close`, or after `feed` raised."""
        return self._closed

    @property
    def events(self) -> int:
        """How many events have been dispatched."""
        return self._events

    @property
    def bytes_fed(self) -> int:
        """How many bytes `feed` has accepted."""
        return self._bytes_fed

    def close(self) -> None:
        """End of stream: discard any incomplete event, as the standard requires."""
        if self._closed:
            return
        self._discarded_incomplete = not self.at_boundary
        self._closed = True
        self._tail = []
        self._tail_size = 0
        self._data = []

    def feed(self, data: bytes) -> list[Event]:
        """Parse the next chunk of the stream and return the events it completes.

        Raises `EventTooLarge` (see the class docstring) and closes the parser. The events of
        the failing chunk are lost, so the last event ID, `retry` and `events` are restored
        to what they were after the last successful feed: a reconnecting client resumes after
        the last event it actually received.
        """
        if self._closed:
            raise SSEError("feed() on a closed EventParser")
        self._bytes_fed += len(data)
        if self._whole_chars and data[-1:] < b"\x80":
            # The decoder holds nothing (the BOM is settled, no character is split): bytes
            # that end in ASCII decode the same in one call, without the decoder's frames.
            text = data.decode("utf-8", "replace")
        else:
            text = self._decoder.decode(data)
            self._whole_chars = self._decoder.getstate() == (b"", 0)
        if (
            text[-2:] == "\n\n"
            and not (self._tail or self._pending or self._skip_lf)
            and text.startswith("data: ")
            and text.find("\n") == len(text) - 2
            and "\r" not in text
            and len(text) - 2 <= self._max_size
        ):
            # The common case of a relayed stream: one whole ``data: ...`` event, nothing
            # before it. What the general path below makes of it, without its line split.
            self._events += 1
            return [Event(text[6:-2], "message", self._last_id)]
        saved = self._last_id, self._dispatched_id, self._retry, self._events
        try:
            return self._feed(text)
        except SSEError:
            self._closed = True
            self._last_id, self._dispatched_id, self._retry, self._events = saved
            raise

    def _feed(self, text: str) -> list[Event]:
        if self._skip_lf and text:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
        if "\r" in text:
            # A CR ends its line at once (no waiting for the next chunk); a following LF is
            # then dropped as the second half of CRLF.
            self._skip_lf = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        tail = self._tail
        if "\n" not in text:
            if text:
                # Pieces are joined only when the line ends: appending to one string would
                # make a long line fed in small chunks cost quadratic time.
                tail.append(text)
                self._tail_size += len(text)
                if self._data_size + self._tail_size > self._max_size:
                    self._too_large()
            return []
        if tail:
            tail.append(text)
            text = "".join(tail)
        lines = text.split("\n")
        last = lines.pop()
        self._tail = [last] if last else []
        self._tail_size = len(last)
        events: list[Event] = []
        self._process(lines, events)
        if self._data_size + self._tail_size > self._max_size:
            self._too_large()
        return events

    def _process(self, lines: list[str], events: list[Event]) -> None:
        # The per-event path: state lives in locals and is written back once per chunk.
        data = self._data
        data_size = self._data_size
        type_ = self._type
        last_id = self._last_id
        dispatched_id = self._dispatched_id
        pending = self._pending
        max_size = self._max_size
        dispatched = 0
        for line in lines:
            if not line:
                if data:
                    events.append(Event("\n".join(data), type_ or "message", last_id))
                    dispatched += 1
                    data = []
                    data_size = 0
                dispatched_id = last_id
                type_ = ""
                pending = False
                continue
            if data_size + len(line) > max_size:
                self._data_size = data_size
                self._too_large()
            name, colon, value = line.partition(":")
            if colon:
                if not name:
                    continue  # a comment
                if value[:1] == " ":
                    value = value[1:]
            pending = True
            if name == "data":
                data.append(value)
                data_size += len(value) + 1
            elif name == "id":
                if "\0" not in value:
                    last_id = value
            elif name == "event":
                type_ = value
            elif name == "retry":
                self._set_retry(value)
            elif name == "error" and self._error_field:
                type_ = "error"
                data.append(value)
                data_size += len(value) + 1
        self._data = data
        self._data_size = data_size
        self._type = type_
        self._last_id = last_id
        self._dispatched_id = dispatched_id
        self._pending = pending
        self._events += dispatched

    def _set_retry(self, value: str) -> None:
        # str.isdigit alone would accept non-ASCII digits such as "²" or "٣".
        if value.isascii() and value.isdigit():
            try:
                self._retry = int(value)
            except ValueError:
                pass  # longer than Python's int-conversion limit: no sane delay, ignore it

    def _too_large(self) -> NoReturn:
        raise EventTooLarge(
            f"pending event exceeds max_event_size={self._max_size} characters "
            f"(data buffer {self._data_size} plus the line being read)"
        )
