"""Deliver one admitted generation over HTTP, streamed or buffered, under a delivery policy.

This file owns the per-reply tasks and every way a reply can end. For each reply:
- a pump task moves the engine's deltas into a bounded ``DeltaChannel``;
- the handler task takes them out, holds text back for moderation, batches it, writes
  events (waiting for the socket to drain), sends keep-alives while idle, and watches the
  slow-client limits;
- whatever ends the reply, the pump is cancelled and the engine's stream closed in
  ``finally``, and the reply's record goes to the metrics once.
Endings (see docs/ARCHITECTURE.md): finished, cancelled (client gone), errored (generator
failed), moderated, slow_client, shutdown. It must not know how tokens are made or which
route asked for the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from replystream.delivery.batching import Batcher
from replystream.delivery.channel import TIMEOUT, DeltaChannel, End, pump
from replystream.delivery.moderation import HoldBack
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, DeltaStream
from replystream.server.errors import error_response
from replystream.server.formats import KEEPALIVE, StreamFormat, Usage
from replystream.server.metrics import Metrics, ReplyRecord

log = logging.getLogger("replystream.delivery")

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Asks nginx (and proxies that honour it) not to hold this response in a buffer.
    "X-Accel-Buffering": "no",
}


LAST_WORDS_S = 5.0  # how long a cut stream's final event may take to leave


class SlowClient(Exception):
    """The reader fell behind the slow-client limits."""


class _Interrupted(Exception):
    """A write blocked on the socket was interrupted by a shutdown."""


class ActiveReplies:
    """Every reply in flight, so the server can end them on shutdown."""

    def __init__(self) -> None:
        self._channels: set[DeltaChannel] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self._channels)

    def add(self, channel: DeltaChannel) -> None:
        self._channels.add(channel)
        self.idle.clear()

    def discard(self, channel: DeltaChannel) -> None:
        self._channels.discard(channel)
        if not self._channels:
            self.idle.set()

    def shut_down(self) -> None:
        """Tell every reply to end now with a shutdown error."""
        for channel in list(self._channels):
            channel.close(End("shutdown"))


@dataclass(slots=True)
class ReplyContext:
    """What a delivery needs besides the generation itself."""

    policy: DeliveryPolicy
    metrics: Metrics
    active: ActiveReplies
    record: ReplyRecord
    prompt_tokens: int = 0


class _Writer:
    """Writes frames to one response, bounded by the slow-client stall limit."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        channel: DeltaChannel,
        ctx: ReplyContext,
    ) -> None:
        self.request = request
        self.response = response
        self.channel = channel
        self.record = ctx.record
        self.stall_s = ctx.policy.slow_client_s
        self.last_write = time.monotonic()

    async def send(self, frame: bytes, events: int = 1) -> None:
        if self.channel.overflowed:
            raise SlowClient(f"more than {self.channel.limit_bytes} bytes queued")
        try:
            async with asyncio.timeout(self.stall_s) as deadline:
                # An overflow or a shutdown while we wait on the socket ends the wait now.
                loop = asyncio.get_running_loop()
                self.channel.on_interrupt = lambda: deadline.reschedule(loop.time())
                await self.response.write(frame)
        except TimeoutError:
            if self.channel.overflowed:
                raise SlowClient(f"more than {self.channel.limit_bytes} bytes queued") from None
            if self.channel.ended:
                raise _Interrupted from None
            raise SlowClient(f"socket did not drain for {self.stall_s:g} s") from None
        finally:
            self.channel.on_interrupt = None
        self.record.on_send(len(frame), events)
        self.last_write = time.monotonic()

    def send_last_words(self, frame: bytes) -> None:
        """Queue a final event without waiting, then close; abort if it cannot leave soon.

        Used when the socket is not draining, so the response's own (awaiting) writer cannot
        be used: the frame goes to the transport directly, framed as the last HTTP chunk.
        """
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return
        if self.response.headers.get("Transfer-Encoding") == "chunked":
            frame = b"%x\r\n%s\r\n0\r\n\r\n" % (len(frame), frame)
        transport.write(frame)
        self.record.on_send(len(frame))
        transport.close()
        # A reader that never reads would keep the socket (and its buffer) forever.
        asyncio.get_running_loop().call_later(LAST_WORDS_S, transport.abort)


async def close_quietly(deltas: DeltaStream) -> None:
    """Close an engine stream, bounded and shielded, from any exit path."""
    with contextlib.suppress(Exception, asyncio.CancelledError):
        async with asyncio.timeout(1.0):
            await asyncio.shield(deltas.aclose())


async def stream_reply(
    request: web.Request,
    deltas: DeltaStream,
    fmt: StreamFormat,
    ctx: ReplyContext,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Stream an admitted generation as server-sent events."""
    channel = DeltaChannel(ctx.policy.slow_client_bytes)
    response = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
    record = ctx.record
    ctx.active.add(channel)
    ctx.metrics.active.inc()
    try:
        async with asyncio.TaskGroup() as group:
            pump_task = group.create_task(pump(deltas, channel))
            try:
                # Headers leave now, before the first token exists.
                await response.prepare(request)
                await _write_events(_Writer(request, response, channel, ctx), channel, fmt, ctx)
            finally:
                pump_task.cancel()
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    except ConnectionError:
        record.outcome, record.reason = "cancelled", "client_gone"
    except asyncio.CancelledError:
        record.outcome, record.reason = "cancelled", "client_gone"
        raise
    finally:
        await close_quietly(deltas)
        ctx.active.discard(channel)
        ctx.metrics.active.dec()
        ctx.metrics.observe(record)
    return response


async def _write_events(
    writer: _Writer, channel: DeltaChannel, fmt: StreamFormat, ctx: ReplyContext
) -> None:
    policy, record = ctx.policy, ctx.record
    holdback = HoldBack(policy.holdback_tokens, policy.checks)
    batcher = Batcher(
        policy.batch_tokens, None if policy.batch_ms is None else policy.batch_ms / 1e3
    )
    keepalive = policy.keepalive_s
    finish_reason = "stop"
    try:
        while True:
            now = time.monotonic()
            deadline = batcher.due_at
            if keepalive is not None:
                ping_at = writer.last_write + keepalive
                deadline = ping_at if deadline is None else min(deadline, ping_at)
            item = await channel.get(None if deadline is None else deadline - now)
            now = time.monotonic()
            if item is TIMEOUT:
                batch = batcher.flush() if batcher.expired(now) else None
                if batch is not None:
                    await writer.send(fmt.text(*batch))
                elif keepalive is not None and now - writer.last_write >= keepalive:
                    await writer.send(KEEPALIVE, events=0)
                continue
            if isinstance(item, Delta):
                record.on_delta(item.made_at, item.tokens)
                if item.finish_reason is not None:
                    finish_reason = item.finish_reason
                text, tokens = holdback.push(item.text, item.tokens)
                batch = batcher.add(text, tokens, now)
                if batch is not None:
                    await writer.send(fmt.text(*batch))
                if holdback.violation is not None:
                    await _flush(writer, batcher, fmt)
                    await writer.send(fmt.moderated(holdback.violation))
                    record.outcome, record.reason = "moderated", holdback.violation.check
                    return
                continue
            assert isinstance(item, End)
            if item.how == "finished":
                text, tokens = holdback.finish()
                batch = batcher.add(text, tokens, now)
                if batch is not None:
                    await writer.send(fmt.text(*batch))
                await _flush(writer, batcher, fmt)
                usage = Usage(ctx.prompt_tokens, record.tokens)
                await writer.send(fmt.finished(finish_reason, usage))
                record.outcome = "finished"
            elif item.how == "failed":
                assert item.error is not None
                log.warning("generation failed mid-stream: %s", item.error)
                await _flush(writer, batcher, fmt)
                await writer.send(fmt.error(str(item.error), item.error.code))
                record.outcome, record.reason = "errored", item.error.code
            else:
                await _flush(writer, batcher, fmt)
                await writer.send(fmt.error("the server is shutting down", "shutdown"))
                record.outcome, record.reason = "shutdown", "shutdown"
            return
    except _Interrupted:
        record.outcome, record.reason = "shutdown", "shutdown"
        writer.send_last_words(fmt.error("the server is shutting down", "shutdown"))
    except SlowClient as exc:
        record.outcome, record.reason = "slow_client", str(exc)
        log.info("cut a slow client: %s", exc)
        writer.send_last_words(fmt.error(f"slow client: {exc}", "slow_client"))


async def _flush(writer: _Writer, batcher: Batcher, fmt: StreamFormat) -> None:
    batch = batcher.flush()
    if batch is not None:
        await writer.send(fmt.text(*batch))


async def buffered_reply(
    deltas: DeltaStream,
    ctx: ReplyContext,
    body: Callable[[str, str, Usage], dict[str, Any]],
    moderated_body: Callable[[str, Any], dict[str, Any]],
) -> web.Response:
    """Collect an admitted generation whole and answer once, as JSON.

    ``body(text, finish_reason, usage)`` shapes a finished reply; ``moderated_body(released
    text, violation)`` a reply a check stopped. A failure is a 500, a shutdown a 503.
    """
    channel = DeltaChannel(ctx.policy.slow_client_bytes)
    holdback = HoldBack(0, ctx.policy.checks)
    record = ctx.record
    parts: list[str] = []
    finish_reason = "stop"
    ctx.active.add(channel)
    try:
        async with asyncio.TaskGroup() as group:
            pump_task = group.create_task(pump(deltas, channel))
            try:
                while True:
                    item = await channel.get(None)
                    if isinstance(item, Delta):
                        record.on_delta(item.made_at, item.tokens)
                        finish_reason = item.finish_reason or finish_reason
                        parts.append(holdback.push(item.text, item.tokens)[0])
                        if holdback.violation is not None:
                            break
                    elif isinstance(item, End):
                        break
            finally:
                pump_task.cancel()
        if holdback.violation is not None:
            record.outcome, record.reason = "moderated", holdback.violation.check
            payload = moderated_body("".join(parts), holdback.violation)
        elif isinstance(item, End) and item.how == "failed":
            assert item.error is not None
            log.warning("generation failed: %s", item.error)
            record.outcome, record.reason = "errored", item.error.code
            return error_response(500, str(item.error), code=item.error.code)
        elif isinstance(item, End) and item.how == "shutdown":
            record.outcome, record.reason = "shutdown", "shutdown"
            return error_response(503, "the server is shutting down", code="shutdown")
        else:
            parts.append(holdback.finish()[0])
            record.outcome = "finished"
            payload = body("".join(parts), finish_reason, Usage(ctx.prompt_tokens, record.tokens))
        response = json_response(payload)
        record.on_send(len(response.body) if isinstance(response.body, bytes) else 0)
        return response
    except asyncio.CancelledError:
        record.outcome, record.reason = "cancelled", "client_gone"
        raise
    finally:
        await close_quietly(deltas)
        ctx.active.discard(channel)
        ctx.metrics.observe(record)


def json_response(payload: dict[str, Any]) -> web.Response:
    """A compact JSON body (no spaces after separators, as the lab's byte counts assume)."""
    return web.Response(
        text=json.dumps(payload, separators=(",", ":")), content_type="application/json"
    )
