"""Where a reply is resumed from, and whether it may be: the caller's reply found in its store
(``find_reply``: a 404 for another key's, a 410 for one whose owner Redis evicted), the
resume point read from the query's cursors and the ``Last-Event-ID`` header
(``resume_after``: places that disagree are refused, never one of them taken), and a point
that could only give an empty stream refused (``check_resume_point``). Every route that
resumes a reply (``app``'s native stream, ``responses_api``'s retrieve) asks here. It must
not know any route's wire dialect.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from aiohttp import web

from replystream.delivery.replay import ReplayStore, ReplyInfo, StoreUnavailable
from replystream.server.access_log import REPLY_ID
from replystream.server.context import (
    LOCAL_STORE_KEY,
    MANAGER_KEY,
    METRICS_KEY,
    STORE_KEY,
    owner_of,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.query_schemas import ResumeCursor
from replystream.server.replies import Reply
from replystream.server.validation import parse_mapping, repeated


def resume_after(
    request: web.Request,
    cursors: Mapping[str, int | None],
    below: Mapping[str, int] | None = None,
) -> tuple[int, str]:
    """Where a resume starts (the event id it starts after) and the parameter that says so,
    from the route's query cursors (``cursors``: each one's value, None when not given) and
    the ``Last-Event-ID`` header; none given: 0, from the start. ``below``: how far a
    cursor's numbers sit below the log's ids (a Responses ``starting_after``, a sequence
    number, counts from 0: 1), so that every cursor is compared, and the start returned, as
    an id; a message quotes each in its own numbers.

    Places that disagree are refused (400), never one of them taken silently: query cursors
    at different places, a header given twice, or a header before the query's cursor. A
    header after it is where to resume: a browser's ``EventSource`` opened at a query cursor
    reconnects to the same URL, with the last id it got since in the header."""
    shift = below or {}
    given = [(name, value) for name, value in cursors.items() if value is not None]
    query_param, query_value = given[0] if given else ("last_event_id", None)
    query_after = None if query_value is None else query_value + shift.get(query_param, 0)
    for name, value in given[1:]:
        if value + shift.get(name, 0) != query_after:
            raise HTTPAPIError(
                400,
                f"{query_param} {query_value} and {name} {value} are two places to resume "
                "from: give one",
                code="invalid_value",
                param=name,
            )
    headers = request.headers.getall("Last-Event-ID", [])
    if len(headers) > 1:
        raise repeated("Last-Event-ID", len(headers), param="last_event_id")
    header = None
    if headers:
        header = parse_mapping({"last_event_id": headers[0]}, ResumeCursor).last_event_id
    if header is None:
        return query_after or 0, query_param
    if query_after is not None and header < query_after:
        # The header is an event id: a cursor counted otherwise is quoted as one too.
        as_id = "" if query_after == query_value else f" (event id {query_after})"
        raise HTTPAPIError(
            400,
            f"Last-Event-ID {header} is before {query_param} {query_value}{as_id}: two "
            "places to resume from; give one",
            code="invalid_value",
            param=query_param,
        )
    return header, "last_event_id"


NO_SUCH_REPLY = "no such reply (unknown, expired, or not yours)"
# Said after it by a worker of ``--workers`` whose replies are in its own memory: the reply
# may be another worker's, which a client asking again may reach, and ``--redis-url`` fixes.
ANOTHER_WORKERS = (
    "; or made by another of this server's workers, which keep their replies apart "
    "without --redis-url"
)


def not_found_here(app: web.Application, missing: str) -> str:
    """``missing`` (a 404's message), and on a worker of ``--workers`` whose replies no other
    worker can read (the memory store: they share their metrics' folder, not their replies)
    the likelier reason: made by another worker."""
    shared_metrics = app[METRICS_KEY].multiprocess_dir is not None
    if shared_metrics and not app[STORE_KEY].shared:
        return missing + ANOTHER_WORKERS
    return missing


async def find_reply(
    request: web.Request,
    reply_id: str,
    *,
    param: str = "reply_id",
    missing: str = NO_SUCH_REPLY,
) -> tuple[str, ReplayStore, Reply | None, ReplyInfo]:
    """The reply ``reply_id``, if it exists, has not expired and is the caller's: its id, its
    store, its producer when it runs in this process (the request's access-log line names it
    from here), and what its store keeps of it. Else a 404 naming ``param``, its message
    ``missing`` (the route's word for what it looked for)."""
    app = request.app
    local = app[MANAGER_KEY].get(reply_id)
    store = local.store if local is not None else app[STORE_KEY]
    try:
        info = await store.info(reply_id)
        if info is None and local is None and store is not app[LOCAL_STORE_KEY]:
            gone = await store.gone(reply_id)
            if gone is not None and gone.reason == "evicted":
                # It existed, but who it belongs to was evicted with its metadata: nobody
                # can be let read it; say why rather than that it never was. (A deleted
                # one is as gone as one that never was, whoever asks.)
                raise HTTPAPIError(410, gone.detail, code="reply_evicted", param=param)
            store = app[LOCAL_STORE_KEY]
            info = await store.info(reply_id)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    # Another key's reply looks exactly like one that does not exist.
    if info is None or not secrets.compare_digest(info.owner, owner_of(request)):
        raise HTTPAPIError(404, not_found_here(app, missing), code="reply_not_found", param=param)
    request[REPLY_ID] = reply_id  # its access-log line names it (a cancel's, a read's too)
    return reply_id, store, local, info


async def check_resume_point(
    reply_id: str,
    store: ReplayStore,
    after: int,
    *,
    made_here: bool,
    param: str = "last_event_id",
    below: int = 0,
    known_as: str | None = None,
) -> None:
    """Refuse a resume that could only send an empty stream: after an ended reply's last event
    (409 ``reply_ended``: the client has it all) or past the last event (400: not an id of
    this reply). A live reply made on another replica is followed from any id (this one may
    not have read yet what its producer has sent); one made here (``made_here``) is known to
    its last event. ``after`` is an id; ``below``: how far ``param``'s numbers sit below the
    ids (``resume_after``'s), in which the messages quote them. ``known_as``: how the message
    names the reply (the id the client used; default ``reply <reply_id>``)."""
    try:
        tail = await store.tail(reply_id)
    except StoreUnavailable as exc:
        raise HTTPAPIError(
            503, f"the reply store is unavailable: {exc}", code="replay_store_unavailable"
        ) from exc
    if tail is None or after < tail.last_seq or not (tail.ended or made_here):
        return
    given, last = after - below, tail.last_seq - below
    if after > tail.last_seq:
        raise HTTPAPIError(
            400,
            f"{param} {given} is past this reply's last event ({last})",
            code="invalid_value",
            param=param,
        )
    if not tail.ended:
        return  # at the live reply's last event: what comes next is followed
    raise HTTPAPIError(
        409,
        f"{known_as or f'reply {reply_id}'} has ended and {given} is its last event: "
        "there is nothing after it",
        code="reply_ended",
        param=param,
    )
