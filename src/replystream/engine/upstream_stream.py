"""One relayed reply: an upstream's OpenAI chat-completion stream read as ``Delta`` values.

This file decides what an upstream's event stream means, chunk by chunk, with nothing
buffered: each body chunk the socket delivers is fed to ``replystream.sse.EventParser`` at
once, and each content delta in it becomes a ``Delta`` (one token each; the last delta carries
the difference to the upstream's ``usage.completion_tokens`` when it sent one). It also
decides which upstream misbehaviour ends a reply, always as an ``UpstreamStreamError`` with
its own code, within bounded time and memory:
- ``upstream_error``: an error object in the stream (``{"error": ...}``, vLLM and TGI style);
- ``upstream_bad_chunk``: a ``data:`` payload that is not a JSON chunk object;
- ``upstream_event_too_large``: one event grew past ``max_event_size`` characters;
- ``upstream_malformed``: more than ``max_event_size`` bytes arrived without a single event;
- ``upstream_stalled``: no byte for ``stall_s`` seconds;
- ``upstream_incomplete``: the body ended before ``[DONE]`` or a finish reason;
- ``upstream_disconnected``: the upstream closed the connection mid-body (killed, restarted);
- ``upstream_broken``: the connection broke otherwise.
Messages are ours (``upstream_errors``); an upstream's own words appear only quoted.
Closing the stream early (``aclose``, or cancelling its reader) closes the upstream
connection, which vLLM, TGI and llama.cpp treat as an abort. It must not know how the request
was built, which upstream was picked, or anything about our own HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable

import aiohttp

from replystream.engine.base import Delta, EngineError, ToolCallDelta
from replystream.engine.upstream_errors import broken_stream, quoted
from replystream.engine.upstream_logprobs import relayed_logprobs
from replystream.sse import Event, EventParser, EventTooLarge, SSEError

# Finish reasons upstreams use, mapped to ours ("stop", "length" or "tool_calls"; a filter
# passes through).
FINISH_REASONS = {
    "stop": "stop",
    "eos": "stop",
    "eos_token": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "max_tokens": "length",
    "content_filter": "content_filter",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",  # OpenAI's deprecated single-function form
}


class UpstreamStreamError(EngineError):
    """The upstream misbehaved after its stream started (an in-band error downstream)."""

    status = 502


def _message_of(error: object) -> str:
    """The upstream's own message in an error it sent mid-stream, quoted (or a placeholder)."""
    message = error.get("message") or error.get("error") if isinstance(error, dict) else error
    if isinstance(message, str) and message.strip():
        return quoted(message)
    return "no message given"


class UpstreamStream:
    """A ``DeltaStream`` over one upstream response; owns (and closes) its connection."""

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        *,
        stall_s: float,
        max_event_size: int,
        on_end: Callable[[str, int], None] | None = None,
        logprobs: bool = False,
    ) -> None:
        self._response = response
        self._logprobs = logprobs  # asked for: text without them is the upstream's failure
        self._stall_s = stall_s
        self._max_event_size = max_event_size
        self._parser = EventParser(max_event_size=max_event_size)
        self._pending: deque[Delta] = deque()
        self._bytes_at_last_event = 0
        self._tokens = 0
        self._usage_tokens: int | None = None
        self._finish: str | None = None
        self._ended = False  # the last delta was queued (or an error raised)
        self._clean = False  # the upstream finished its reply: the connection may be reused
        self._failed = False
        self._error: UpstreamStreamError | None = None  # raised once the text before it is out
        self._deltas = 0  # deltas handed out
        self._on_end = on_end

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            while not self._pending:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise StopAsyncIteration
                await self._read_chunk()
        except BaseException:
            # An error, an exhausted stream or a cancelled reader: the connection goes now.
            self._close()
            raise
        delta = self._pending.popleft()
        self._deltas += 1
        if self._ended and not self._pending:
            self._close()
        return delta

    async def aclose(self) -> None:
        """Stop relaying: close the upstream connection unless the reply already ended."""
        self._ended = True
        self._pending.clear()
        self._close()

    def _close(self) -> None:
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            outcome = "finished" if self._clean else "failed" if self._failed else "cancelled"
            on_end(outcome, self._deltas)
        if self._clean:
            self._response.release()  # finished: the connection goes back to the pool
        else:
            self._response.close()  # closing the socket is how an upstream learns to abort

    def _fail(self, message: str, code: str) -> UpstreamStreamError:
        self._ended = self._failed = True
        return UpstreamStreamError(message, code=code)

    async def _read_chunk(self) -> None:
        try:
            async with asyncio.timeout(self._stall_s):
                data = await self._response.content.readany()
        except TimeoutError:
            raise self._fail(
                f"the upstream sent nothing for {self._stall_s:g} s", "upstream_stalled"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            failure = broken_stream(exc)
            raise self._fail(failure.message, failure.code) from None
        if not data:
            self._end_of_body()
            return
        try:
            events = self._parser.feed(data)
        except EventTooLarge:
            raise self._fail(
                f"an upstream event grew past {self._max_event_size} characters",
                "upstream_event_too_large",
            ) from None
        except SSEError as exc:
            raise self._fail(
                f"the upstream's event stream is malformed: {exc}", "upstream_malformed"
            ) from None
        if events:
            self._bytes_at_last_event = self._parser.bytes_fed
        elif self._parser.bytes_fed - self._bytes_at_last_event > self._max_event_size:
            raise self._fail(
                f"the upstream sent {self._max_event_size} bytes without one event",
                "upstream_malformed",
            )
        now = time.monotonic()
        try:
            for event in events:
                self._on_event(event, now)
                if self._ended:
                    return
        except UpstreamStreamError as error:  # the deltas before it still go out first
            self._error = error

    def _end_of_body(self) -> None:
        self._parser.close()
        if self._finish is None:
            raise self._fail(
                "the upstream ended its stream before the reply finished", "upstream_incomplete"
            )
        self._finish_reply(time.monotonic())  # a finish reason and no [DONE] (older servers)

    def _on_event(self, event: Event, now: float) -> None:
        if event.type == "error":  # replystream's own in-band errors, and some proxies'
            try:
                error = json.loads(event.data).get("error", event.data)
            except (ValueError, AttributeError):
                error = event.data[:500]
            raise self._fail(
                f"the upstream reported an error mid-reply: {_message_of(error)}",
                "upstream_error",
            )
        if event.data.strip() == "[DONE]":
            if self._finish is None:
                raise self._fail(
                    "the upstream sent [DONE] with no finish reason", "upstream_bad_chunk"
                )
            self._finish_reply(now)
            return
        try:
            chunk = json.loads(event.data)
        except ValueError:
            raise self._fail(
                f"the upstream sent an event that is not JSON ({len(event.data)} characters)",
                "upstream_bad_chunk",
            ) from None
        if not isinstance(chunk, dict):
            raise self._fail(
                "the upstream sent a chunk that is not an object", "upstream_bad_chunk"
            )
        if "error" in chunk or chunk.get("object") == "error":
            raise self._fail(
                "the upstream reported an error mid-reply: "
                f"{_message_of(chunk.get('error', chunk))}",
                "upstream_error",
            )
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._usage_tokens = usage["completion_tokens"]
        choices = chunk.get("choices", [])
        if not isinstance(choices, list):
            raise self._fail("the upstream chunk's choices is not a list", "upstream_bad_chunk")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str) and text:
                logprobs = choice.get("logprobs")  # only sent when the request asked
                if logprobs:
                    made = relayed_logprobs(logprobs)
                    count = len(made) if made else 1
                    self._tokens += count
                    self._pending.append(Delta(text, count, now, None, made))
                elif self._logprobs:
                    raise self._fail(
                        "the upstream sent text without the logprobs asked for "
                        "(it does not support them)",
                        "upstream_no_logprobs",
                    )
                else:
                    self._tokens += 1
                    self._pending.append(Delta(text, 1, now))
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if calls:
                self._tool_calls(calls, now)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self._finish = FINISH_REASONS.get(reason, "stop")

    def _tool_calls(self, calls: object, now: float) -> None:
        """Each ``tool_calls`` entry of a delta, as it came: one ``Delta`` (one token) each."""
        if not isinstance(calls, list):
            raise self._fail("the upstream's tool_calls is not a list", "upstream_bad_chunk")
        for call in calls:
            function = call.get("function", {}) if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise self._fail("the upstream sent a malformed tool call", "upstream_bad_chunk")
            index, call_id = call.get("index", 0), call.get("id")
            name, arguments = function.get("name"), function.get("arguments") or ""
            if (
                not isinstance(index, int)
                or isinstance(index, bool)
                or index < 0
                or not isinstance(call_id, str | None)
                or not isinstance(name, str | None)
                or not isinstance(arguments, str)
            ):
                raise self._fail("the upstream sent a malformed tool call", "upstream_bad_chunk")
            self._tokens += 1
            self._pending.append(
                Delta("", 1, now, tool_call=ToolCallDelta(index, call_id, name, arguments))
            )

    def _finish_reply(self, now: float) -> None:
        extra = max(0, (self._usage_tokens or 0) - self._tokens)
        self._pending.append(Delta("", extra, now, self._finish or "stop"))
        self._ended = self._clean = True
