"""A stored response, found and told from its log: the caller's response by id (a 404 for
another key's, an unknown one, or a reply of another dialect), the conversation it keeps,
its entries up to a point, and its object as the log tells it now (a 410 when events it
needs were evicted: never a text with holes; a running one whose log no longer holds its
first events is told with no output). The Responses routes (``responses_api``,
``responses_input_items``) read stored responses only through here. It must not know how a
response's events are made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from aiohttp import web

from replystream.delivery.replay import (
    LogEntry,
    ReadResult,
    ReplayStore,
    ReplyInfo,
    StoreUnavailable,
)
from replystream.delivery.responses_log import (
    DIALECT,
    GENERATOR_LOST,
    TERMINAL,
    Said,
    items_in_events,
    opened_object,
    response_from_log,
    response_json_from_log,
    said_in_events,
    said_in_object,
    without_logprobs_json,
)
from replystream.delivery.responses_objects import (
    compact_json,
    reply_id_of,
    response_error,
    response_id,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.replies import Reply
from replystream.server.responses_schemas import Conversation
from replystream.server.resume_points import find_reply
from replystream.server.validation import parse_json

LIVENESS_WAIT_S = 0.05  # how long reading a live response's object may wait on its store
FIRST_EVENT_WAIT_S = 2.0  # how long a reply known to the store may take to log its first event
NO_SUCH_RESPONSE = "no such response (unknown, expired, deleted, or not yours)"


async def find_response(
    request: web.Request, reply_id: str, param: str
) -> tuple[ReplayStore, Reply | None, ReplyInfo]:
    """The store of the caller's response ``reply_id``, its producer when it runs here, and
    what the store keeps of it; else a 404: a reply of another dialect is not a response,
    and is neither streamed as one nor deleted here."""
    _, store, local, info = await find_reply(
        request, reply_id, param=param, missing=NO_SUCH_RESPONSE
    )
    # A response made with ``store: false`` keeps no conversation: it is a plain reply, its
    # log its one reader's (what was sent is dropped), and no route of stored responses
    # reads, cancels or deletes it, whatever its log holds at the moment.
    if not info.context:
        raise HTTPAPIError(404, NO_SUCH_RESPONSE, code="reply_not_found", param=param)
    try:
        # A reply made on another replica may be known before its first event is: its
        # producer logs its events to the store a moment after it sends them.
        head = await store.read(reply_id, 0, FIRST_EVENT_WAIT_S)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    # Every event of a response's log is named response.* (the first one, if it was trimmed).
    # A log that holds none (Redis evicted its stream behind its end, whose metadata kept
    # the ending) is told by the dialect its route stored: the response is there, and
    # whoever asks is told what of it is left (a 410 for its object), not that it never was.
    first = head.entries[0] if head is not None and head.entries else None
    if first is None:
        is_response = head is not None and info.dialect == DIALECT
    else:
        is_response = (first.event or "").startswith("response.")
    if not is_response:
        raise HTTPAPIError(404, NO_SUCH_RESPONSE, code="reply_not_found", param=param)
    return store, local, info


def response_reply_id(response_id: str, param: str) -> str:
    """The reply id inside ``response_id``, or a 404 naming ``param``."""
    reply_id = reply_id_of(response_id)
    if not reply_id:
        raise HTTPAPIError(
            404, f"no such response: {response_id!r}", code="reply_not_found", param=param
        )
    return reply_id


async def read_log(store: ReplayStore, reply_id: str) -> ReadResult | None:
    """Every entry of a reply's log as it stands now. A store may answer a read in batches
    (Redis's: 1,000 entries), so this reads on until a read brings nothing new or the end;
    the first range of lost events is kept, for the caller to refuse a text with holes."""
    result = await store.read(reply_id, 0, 0.0)
    if result is None:
        return None
    entries, lost = list(result.entries), result.lost
    while result.ending is None and result.entries:
        following = await store.read(reply_id, entries[-1].seq, 0.0)
        if following is None:  # expired or deleted meanwhile: what was read stands
            break
        result = following
        entries += result.entries
        lost = lost or result.lost
    return ReadResult(entries, lost, result.ending, result.producer_lost)


async def entries_until(store: ReplayStore, reply_id: str, after: int) -> list[LogEntry]:
    """The log's entries up to event ``after``: what a client resuming after it was told."""
    entries: list[LogEntry] = []
    try:
        while not entries or entries[-1].seq < after:
            result = await store.read(reply_id, entries[-1].seq if entries else 0, 0.0)
            if result is None or not result.entries:
                break
            entries += result.entries
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    return [entry for entry in entries if entry.seq <= after]


async def response_body(
    store: ReplayStore, reply_id: str, *, logprobs: bool = True
) -> web.Response:
    """The response object as its log tells it now, as a JSON answer: an ended response's as
    its terminal event wrote it, not parsed and written again (``response_json_from_log``).
    ``logprobs``: its text's log probabilities are shown (as its request made them; else
    each ``output_text`` part's are ``[]``, as a retrieve that does not include them says).
    One still running whose log no longer holds its first events (past its newest 10,000, or
    evicted) is told as it was created, in progress, with no output: its text so far cannot
    be told whole, and a client waiting for it to end (OpenAI's way: a retrieve until it is
    neither queued nor in progress) must not be refused meanwhile."""
    told = await _read_told(store, reply_id, "response_id", cut_short_ok=True)
    text: str | None
    if told.cut_short:
        opened = await _opened_past_its_log(store, reply_id, told.gone, told.producer_lost)
        text = compact_json(opened)
    else:
        text = response_json_from_log(told.entries, producer_lost=told.producer_lost)
    if text is None:
        raise _no_such_response()
    if not logprobs:
        text = without_logprobs_json(text)
    return web.Response(text=text, content_type="application/json")


async def response_items(store: ReplayStore, reply_id: str, param: str) -> list[dict[str, Any]]:
    """A response's output items as its log tells them now, for a request that names them
    by id (in ``param``, which a 410 names): an ended one's from its small events
    (``items_in_events``, a slice at a time, no statuses); one still running, or whose early
    events are gone, from its object."""
    told = await _read_told(store, reply_id, param)
    if told.whole and told.ended:
        return await items_in_events(told.entries)
    response = response_from_log(told.entries, producer_lost=told.producer_lost)
    if response is None:
        raise _no_such_response()
    output: list[dict[str, Any]] = response["output"]
    return output


async def response_said(store: ReplayStore, reply_id: str, param: str) -> Said | None:
    """What a response said, for the next turn's history (named by ``param``, which a 410
    names); None while it has not finished (queued, or in progress). An ended one's whole
    log is read from its small events (``said_in_events``, a slice at a time); one whose
    early events are gone, or whose producer was lost, from its object (a 410 for one
    with both: what it said is gone, and it will never finish)."""
    told = await _read_told(store, reply_id, param, cut_short_ok=True)
    if told.cut_short:
        if told.producer_lost:
            # It will never finish, and what it said is no longer kept.
            raise _cut_short(told.gone, param)
        # A log too long to still hold a running response's first events has no object
        # to tell until its terminal event: the response has not finished.
        return None
    if told.whole and told.ended:
        return await said_in_events(told.entries)
    response = response_from_log(told.entries, producer_lost=told.producer_lost)
    if response is None:
        raise _no_such_response()
    if response["status"] in ("queued", "in_progress"):
        return None
    return said_in_object(response)


class Standing(NamedTuple):
    """What a cancel must know of a response."""

    background: bool  # created with ``background: true`` (only such a one is cancelled)
    running: bool  # queued or in progress: a cancel can still stop it


async def response_standing(store: ReplayStore, reply_id: str) -> Standing:
    """Whether a response is a background one, and whether it still runs. An ended one's is
    read from its first event (``response.created``, small) and the kind of its last, not
    from its object, which may be megabytes; one whose first event is gone, or that has not
    ended, from its object; one still running whose first events a long log no longer
    holds, from what its conversation keeps."""
    try:
        told = await _read_told(store, reply_id, "response_id")
    except HTTPAPIError as exc:
        if exc.status != 410 or await _ended(store, reply_id):
            # Ended, and its terminal event gone (Redis evicted its stream after its end):
            # there is nothing left to cancel, nor an object to answer with.
            raise
        # Too long for its log to hold its opening: it still runs, and its conversation
        # says how it was made.
        kept = await stored_conversation(store, reply_id)
        if kept is None or kept.background is None:
            raise
        return Standing(kept.background, running=True)
    entries = told.entries
    if told.ended:
        opened = opened_object(entries[0])
        if opened is not None:
            return Standing(bool(opened["background"]), running=False)
    response = response_from_log(entries, producer_lost=told.producer_lost)
    if response is None:
        raise _no_such_response()
    return Standing(bool(response["background"]), response["status"] in ("queued", "in_progress"))


async def _ended(store: ReplayStore, reply_id: str) -> bool:
    """Whether a response has ended, as its log's tail says (one gone counts as ended: no
    more of it will come)."""
    try:
        tail = await store.tail(reply_id)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from None
    return tail is None or tail.ended


def _no_such_response() -> HTTPAPIError:
    return HTTPAPIError(404, NO_SUCH_RESPONSE, code="reply_not_found", param="response_id")


class _Told(NamedTuple):
    entries: Sequence[LogEntry]  # none: no such log
    producer_lost: bool  # not ended, and its producer is gone
    whole: bool  # no event of it was lost
    ended: bool  # its terminal event is among them
    cut_short: bool = False  # not ended, and events of it are gone
    gone: tuple[int, int] | None = None  # those events, when its log says which


async def _read_told(
    store: ReplayStore, reply_id: str, param: str, *, cut_short_ok: bool = False
) -> _Told:
    """A response's log as it is now. A 410 naming ``param`` (where the request named the
    response) when events it needs were evicted or trimmed, unless ``cut_short_ok``: then
    it is said to be ``cut_short``."""
    try:
        result = await read_log(store, reply_id)
        lost = False
        if result is not None and result.ending is None:
            # Not ended: is its producer still there? (A store says so when a read finds
            # nothing new; a short wait lets one remote read ask.)
            last = result.entries[-1].seq if result.entries else 0
            after = await store.read(reply_id, last, LIVENESS_WAIT_S)
            if after is None:  # gone meanwhile (expired while its dead producer was confirmed)
                return _Told((), False, whole=True, ended=False)
            lost = after.producer_lost
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    if result is None:
        return _Told((), lost, whole=True, ended=False)
    ended = any(entry.event in TERMINAL for entry in reversed(result.entries))
    # A response logs its opening as it begins, and was found by it (``find_response``): a
    # log with no event and no ending has lost every one it had (Redis evicted its stream,
    # and its producer, gone since, or not written to since, has not written it again).
    emptied = not result.entries and result.ending is None
    if (result.lost is not None or emptied) and not ended:
        # Events before these are gone (evicted, or trimmed): only a terminal event,
        # which carries the whole response, can be trusted; never a text with holes.
        if not cut_short_ok or result.ending is not None:  # (ended: its terminal event lost)
            raise _cut_short(result.lost, param)
        return _Told(result.entries, lost, False, False, cut_short=True, gone=result.lost)
    return _Told(result.entries, lost, whole=result.lost is None, ended=ended)


def _cut_short(lost: tuple[int, int] | None, param: str) -> HTTPAPIError:
    which = "the events" if lost is None else f"events {lost[0]}-{lost[1]}"
    return HTTPAPIError(
        410,
        f"{which} of this response are no longer kept (evicted by Redis under memory "
        "pressure, or trimmed): it cannot be told whole",
        code="reply_evicted",
        param=param,
    )


async def _opened_past_its_log(
    store: ReplayStore, reply_id: str, lost: tuple[int, int] | None, producer_lost: bool
) -> dict[str, Any]:
    """A running response whose log no longer holds its first events (``lost``, when its
    log says which; all of them, else): the object
    it was created as, in progress (failed, when its producer is gone), with no output. The
    410 of ``_read_told`` for one kept by a server before its conversation kept that object."""
    kept = await stored_conversation(store, reply_id)
    if kept is None:  # expired or deleted since it was read
        raise _no_such_response()
    if kept.opened is None:
        raise _cut_short(lost, "response_id")
    response = {"id": response_id(reply_id), **kept.opened, "status": "in_progress"}
    if producer_lost:
        response["error"] = response_error("generator_lost", GENERATOR_LOST)
        response["status"] = "failed"
    return response


async def opened_as_kept(store: ReplayStore, reply_id: str) -> dict[str, Any] | None:
    """The object a response was created as, from what its conversation keeps, for one whose
    log no longer holds its ``response.created``; None if it keeps none (kept by a server
    before conversations kept it) or is gone."""
    kept = await stored_conversation(store, reply_id)
    if kept is None or kept.opened is None:
        return None
    return {"id": response_id(reply_id), **kept.opened}


async def stored_conversation(store: ReplayStore, reply_id: str) -> Conversation | None:
    """The conversation a stored response keeps (its history, and its request's input as
    given); None once the response is gone (expired or deleted since it was found)."""
    try:
        info = await store.info(reply_id)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    if info is None or not info.context:
        return None
    return parse_json(info.context, Conversation, what="stored conversation")
