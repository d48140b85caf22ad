"""How a reply resumed through the native route (``GET /v1/replies/{id}/stream``) is told
what its reader decides, in the dialect it was made in.

The route resumes a reply from any route. Its log holds that route's events: chat chunks,
Anthropic's message events, Responses events or our own. What the reader itself decides
(events no longer kept, a lost producer, a slow client) must be said in the same dialect:
a chat stream's client cannot be handed a native ``gap`` and then ``[DONE]``, as if its text
were whole. This file decides the dialect from the log's first kept event (or, when the log
keeps none, from the dialect the route stored with the reply: ``ReplyInfo.dialect``), and
the notices and keep-alive that dialect's own route uses; and how often it is kept alive:
at the interval the resume asks, else the one its reply's request asked (kept with the reply,
in Redis too: ``ReplyInfo.keepalive_s``), else the server's. It must not know how the events
are written.
"""

from __future__ import annotations

from aiohttp import web

from replystream.delivery import anthropic_format, openai_formats, responses_log
from replystream.delivery.anthropic_format import PING
from replystream.delivery.follower import BY_EVENT_ID, ResumePlace
from replystream.delivery.formats import KEEPALIVE, Notices
from replystream.delivery.replay import (
    LogEntry,
    ReadResult,
    ReplayStore,
    ReplyInfo,
    StoreUnavailable,
)
from replystream.server.context import CONFIG_KEY, follow_reply
from replystream.server.errors import HTTPAPIError
from replystream.server.openai_api import SDK_KEEPALIVE
from replystream.server.replies import Reply
from replystream.server.responses_stored import FIRST_EVENT_WAIT_S, entries_until, opened_as_kept
from replystream.server.sse_transport import EventStream

# The events of an Anthropic message stream (its log holds no other).
ANTHROPIC_EVENTS = frozenset(
    {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
)  # not ``error``, which the native stream has too: a Messages reply stores its dialect
# How a chat or completion chunk begins (``completion_id``, written compactly).
OPENAI_CHUNKS = ('{"id":"chatcmpl-', '{"id":"cmpl-')


async def follow_resumed(
    request: web.Request,
    info: ReplyInfo,
    store: ReplayStore,
    reply: Reply | None,
    after: int,
    place: ResumePlace = BY_EVENT_ID,
    *,
    keepalive_s: float | None = None,
    gone: HTTPAPIError | None = None,
) -> EventStream:
    """The response that streams reply ``info`` from after event ``after`` (named by the
    client as ``place`` says), in the dialect it was made in (both resume routes: ours, and
    the Responses API's), kept alive at ``keepalive_s`` (the resume's own ask), else at the
    interval the reply's request asked for, else at the server's. ``gone``: the route's
    answer for a reply that expired or was deleted since it was found (its dialect can no
    longer be told, so no stream is begun)."""
    reply_id = info.reply_id
    head = await _head(reply_id, store)
    if head is None:
        raise gone or HTTPAPIError(404, "no such reply", code="reply_not_found")
    notices, keepalive = await _notices_from(head, reply_id, store, after, gone)
    policy = request.app[CONFIG_KEY].policy
    asked = info.keepalive_s if keepalive_s is None else keepalive_s
    if asked is not None:
        policy = policy.with_overrides(keepalive_s=asked)
    return follow_reply(
        request,
        reply_id=reply_id,
        store=store,
        policy=policy,
        reply=reply,
        after=after,
        keepalive=keepalive,
        notices=notices,
        place=place,
    )


async def _head(reply_id: str, store: ReplayStore) -> ReadResult | None:
    """The first read of a reply's log (None: there is no such log, or no longer)."""
    try:
        head = await store.read(reply_id, 0, 0.0)
        if head is not None and not head.entries and not await _dialect_stored(reply_id, store):
            # Its dialect is told by its first event, which a reply made on another replica
            # may not have logged yet.
            head = await store.read(reply_id, 0, FIRST_EVENT_WAIT_S)
        return head
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc


async def _dialect_stored(reply_id: str, store: ReplayStore) -> bool:
    """Whether the reply's route stored its dialect with it (every route but ours): then no
    event need be waited for to know it."""
    return bool(await _stored_dialect(reply_id, store))


async def _stored_dialect(reply_id: str, store: ReplayStore) -> str | None:
    """The dialect the reply's route stored with it ("": ours); None: the reply is gone."""
    info = await store.info(reply_id)
    return None if info is None else info.dialect


async def _notices_from(
    head: ReadResult | None,
    reply_id: str,
    store: ReplayStore,
    after: int,
    gone: HTTPAPIError | None = None,
) -> tuple[Notices | None, bytes]:
    first = head.entries[0] if head is not None and head.entries else None
    if first is not None:
        by_first = await notices_of(first, reply_id, store, after)
        if by_first[0] is not None:
            return by_first
    # Nothing kept that tells it: nothing logged yet (a Messages reply before its first
    # token), or a reply nobody may resume whose reader has sent all there is so far (its
    # log drops what was sent), or all but a chat reply's ``[DONE]``, which is no chunk.
    # The dialect its route stored with it.
    try:
        dialect = await _stored_dialect(reply_id, store)
        if dialect is None:
            # Deleted (or expired) since its log was first read: its dialect can no longer be
            # told, and a stream begun in ours would say so in words its client cannot read.
            raise gone or HTTPAPIError(404, "no such reply", code="reply_not_found")
        if dialect == anthropic_format.DIALECT:
            return anthropic_format.ReaderNotices(), PING
        if dialect == openai_formats.DIALECT:
            return openai_formats.ReaderNotices(), SDK_KEEPALIVE
        if dialect == responses_log.DIALECT:
            told = await entries_until(store, reply_id, after) if after > 0 else []
            opened = await opened_as_kept(store, reply_id)
            return responses_log.ReaderNotices(reply_id, opened, told), SDK_KEEPALIVE
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    return None, KEEPALIVE


async def notices_of(
    first: LogEntry, reply_id: str, store: ReplayStore, after: int
) -> tuple[Notices | None, bytes]:
    """The notices and keep-alive of the dialect whose events a log holds, told by its first
    kept entry; a reader resuming after ``after`` has been told the entries up to it."""
    event = first.event or ""
    if event.startswith("response."):
        told = await entries_until(store, reply_id, after) if after > 0 else []
        opened = responses_log.opened_object(first)
        if opened is None:  # a long response's log no longer holds its opening
            opened = await opened_as_kept(store, reply_id)
        return responses_log.ReaderNotices(reply_id, opened, told), SDK_KEEPALIVE
    if event in ANTHROPIC_EVENTS:
        return anthropic_format.ReaderNotices(), PING
    if first.event is None and first.data.startswith(OPENAI_CHUNKS):
        return openai_formats.ReaderNotices(), SDK_KEEPALIVE
    return None, KEEPALIVE
