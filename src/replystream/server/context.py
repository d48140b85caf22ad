"""What every route shares: the server's settings, the app's keys, and the glue that turns a
validated request into a reply (streamed: ``start_reply`` then ``follow_reply``; buffered:
``buffered``).

The route modules (``app``, ``openai_api``, ``websocket``) and the state gauges import this
one; it imports none of them, so the server package has no import cycle. It must not know
any route's request schema or wire dialect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from aiohttp import web

from replystream.delivery.choices import ChoicesPipeline
from replystream.delivery.follower import BY_EVENT_ID, Follower, ResumePlace
from replystream.delivery.formats import (
    KEEPALIVE,
    LabFormat,
    NativeFormat,
    Notices,
    Spec,
    StreamFormat,
    Usage,
)
from replystream.delivery.frame_transport import FrameTransport
from replystream.delivery.keepalive_clock import KeepaliveClock
from replystream.delivery.moderation import Violation
from replystream.delivery.pipeline import Pipeline, ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import (
    MemoryReplayStore,
    ReplayStore,
    ReplyInfo,
    StoreUnavailable,
)
from replystream.engine.base import (
    Caller,
    DeltaStream,
    Engine,
    EngineError,
    GenerationRequest,
    QueuedDeltaStream,
    RequestRejected,
    check_lengths,
)
from replystream.engine.choices import ChoicesStream, start_choices
from replystream.server import ids
from replystream.server.access_log import ACCOUNT, REPLY_ID, REQUEST_ID, UPGRADED, Account
from replystream.server.accounts import ReplyAccount
from replystream.server.auth import OWNER, client_key
from replystream.server.buffered import Several, Whole, buffered_reply
from replystream.server.errors import HTTPAPIError, in_route_shape
from replystream.server.guard import GATE_KEY, identity_of
from replystream.server.metrics import Metrics, ReaderSends, ReplyRecord
from replystream.server.refusal_names import refused
from replystream.server.replies import Disconnect, Reply, ReplyManager, close_quietly
from replystream.server.server_config import ServerConfig
from replystream.server.sse_transport import SSE_HEADERS, EventStream, SSETransport
from replystream.server.trace_context import trace_context

log = logging.getLogger("replystream.server")
T = TypeVar("T")

# A buffered reply's JSON body: from the reply collected whole (its text, finish, usage, stop
# string, log probabilities and tool calls); or, for a moderated reply, from what was released
# of it (``Whole``: its usage counts the tokens made up to the match) and the check's violation.
BodyOf = Callable[[Whole], dict[str, Any]]
ModeratedBodyOf = Callable[[Whole, Violation], dict[str, Any]]
# A reply that failed after it was admitted, for a dialect that answers it with an object of
# its own: from what was made before, the error's code and its message.
FailedBodyOf = Callable[[Whole, str, str], dict[str, Any]]


ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", ServerConfig)
METRICS_KEY = web.AppKey("metrics", Metrics)
MANAGER_KEY = web.AppKey("manager", ReplyManager)
KEEPALIVE_CLOCK_KEY = web.AppKey("keepalive_clock", KeepaliveClock)
STORE_KEY = web.AppKey("store", ReplayStore)  # where resumable replies are logged
LOCAL_STORE_KEY = web.AppKey("local_store", MemoryReplayStore)  # the rest
# In a worker of ``--workers``: whether the whole server stops (its parent said so, or is
# gone) rather than this worker alone, the others serving the port on. Absent in one
# process, whose stop is the server's.
SERVER_STOPS_KEY: web.AppKey[Callable[[], bool]] = web.AppKey("server_stops")

# Per-key metrics name a key by this much of its SHA-256 digest: enough to tell keys apart,
# and an operator finds theirs with ``sha256sum``; the key itself is never written anywhere.
KEY_LABEL_CHARS = 12
# The status of an engine that cannot take a request now (a full queue, every upstream busy):
# a refusal, as a 4xx is, not a failure.
NO_ROOM_NOW = 503
LAB_FORMAT = LabFormat()
NATIVE_FORMAT = NativeFormat()


def owner_of(request: web.Request) -> str:
    """Who may read and cancel the replies this request starts ("" when auth is off)."""
    owner = request.get(OWNER, "")
    return owner if isinstance(owner, str) else ""


@dataclass(frozen=True, slots=True)
class Choices:
    """A reply with several choices (``n > 1``): each choice's format, and the reply's
    ending once every choice is done (from the usage summed over them)."""

    formats: Sequence[StreamFormat]
    ending: Callable[[Usage], list[Spec]]


async def start_generation(
    request: web.Request, generation: GenerationRequest, record: ReplyRecord
) -> DeltaStream:
    """Admit a request, turning engine refusals into API errors sent before any byte."""
    refuse_when_stopping(request, record)
    return await admitted(request, record, _start_one(request.app[ENGINE_KEY], generation))


async def start_several(
    request: web.Request, generation: GenerationRequest, record: ReplyRecord, n: int
) -> ChoicesStream:
    """``start_generation`` for ``n`` generations of the request, one choice each, merged."""
    refuse_when_stopping(request, record)
    engine = request.app[ENGINE_KEY]
    return await admitted(request, record, _start_several(engine, generation, n))


def count_prompt(request: web.Request, generation: GenerationRequest) -> int:
    """The tokens ``generation``'s prompt is, as the reply it would start counts them
    (``Engine.count_prompt``), without starting it: no engine admission, no reply, no reply
    metrics. Refused as ``start_generation`` would refuse it before the engine runs.

    Raises:
        HTTPAPIError: the engine refuses the request, or cannot count a prompt before
            answering it (a relay: a 400 ``count_unavailable``).
    """
    engine = request.app[ENGINE_KEY]
    try:
        _refuse_unhonourable(engine, generation)
        counted = engine.count_prompt(generation)
    except RequestRejected as exc:
        raise refused(exc) from exc
    if counted is None:
        raise HTTPAPIError(
            400,
            f"the {engine.name} engine cannot count a prompt before it is answered (a relay's "
            "upstream counts it only as it answers), and an estimate would not be the count: "
            "a reply's usage reports its upstream's count",
            code="count_unavailable",
        )
    return counted


def _refuse_unhonourable(engine: Engine, generation: GenerationRequest) -> None:
    """A forced tool call from an engine that makes none, or JSON asked of one that samples
    freely, would be answered with text the client did not ask for: refused instead, naming
    ``tool_choice`` or ``response_format``; so is a request whose lengths contradict."""
    if generation.forces_tool_call and not engine.makes_tool_calls:
        raise RequestRejected(
            f"the {engine.name} engine cannot make tool calls, so it cannot honour this "
            'tool_choice (a required or named tool); "auto" or "none" can be served',
            code="unsupported_parameter",
            param="tool_choice",
        )
    check_lengths(generation.sampling)
    if generation.response_format is not None and not engine.follows_response_format:
        kind = generation.response_format.get("type")
        raise RequestRejected(
            f"the {engine.name} engine samples its text freely and cannot hold it to a JSON "
            f"form ({kind}); plain text can be served, and a relay passes the format on to a "
            "server that constrains its output",
            code="unsupported_parameter",
            param="response_format",
        )


async def _start_one(engine: Engine, generation: GenerationRequest) -> DeltaStream:
    _refuse_unhonourable(engine, generation)
    return await engine.start(generation)


async def _start_several(engine: Engine, generation: GenerationRequest, n: int) -> ChoicesStream:
    _refuse_unhonourable(engine, generation)
    return await start_choices(engine, generation, n)


def refuse_when_stopping(request: web.Request, record: ReplyRecord) -> None:
    """A 503 ``shutdown`` (counted in ``record``) once shutdown has begun."""
    app = request.app
    if not app[MANAGER_KEY].accepting:
        record.outcome, record.reason = "rejected", "shutdown"
        app[METRICS_KEY].observe(record)
        raise shutting_down()


def shutting_down() -> HTTPAPIError:
    """The ``503`` of a request that came once shutdown had begun, on a connection kept
    alive from before: that connection ends with it, so that the client's next attempt
    makes a new one (to a replica still serving) rather than asking this one again."""
    return HTTPAPIError(503, "the server is shutting down", code="shutdown", close_connection=True)


def caller_of(request: web.Request) -> Caller:
    """Who asked, as the engine gets it with the request: the access log's name for the
    request (for an engine's own lines and a relay's upstream), the caller's key (for a relay
    configured to pass it on) and its trace context (for a relay to pass on)."""
    key, trace = client_key(request), trace_context(request.headers)
    return Caller(request.get(REQUEST_ID, ""), key, trace)


async def admitted(request: web.Request, record: ReplyRecord, starting: Awaitable[T]) -> T:
    """What ``starting`` (an engine's start, or its whole answer) gives, its refusals and
    failures turned into API errors and counted in ``record``, as is a client that left
    while it waited."""
    app = request.app
    try:
        started = await starting
    except (RequestRejected, EngineError) as exc:
        # A refusal (a 4xx: the request's fault, a key refused upstream, too many requests;
        # or a 503: no room now, every upstream busy) is ``rejected``; an engine or upstream
        # that failed (500, 502, 504) is ``errored``, as a failure after the first token is,
        # which an alert on errors must see.
        failed = exc.status >= 500 and exc.status != NO_ROOM_NOW
        record.outcome, record.reason = "errored" if failed else "rejected", exc.code
        app[METRICS_KEY].observe(record)
        wait = exc.retry_after_s  # the engine knows when it may take a request: say so
        if isinstance(exc, RequestRejected):  # a 400, or the 401/403/429 of a key passed on
            raise refused(exc) from exc
        # Named by the request's id, as its access-log line and a relay's attempt lines are.
        log.warning(
            "request %s: the engine failed before its answer began: %s",
            request.get(REQUEST_ID, "-"),
            exc,
        )
        raise HTTPAPIError(
            exc.status, str(exc), code=exc.code, retry_after_s=wait, lasting=exc.lasting
        ) from exc
    except asyncio.CancelledError:  # the client left while the request waited (a queue)
        _gone_before_reply(app, record)
        raise
    record.admitted()  # (a queueing engine's reply: again when the engine tells, below)
    return started


def keep_account(request: web.Request, account: Account) -> None:
    """Make ``account`` the request's (``access_log.ACCOUNT``), unless the request is a
    WebSocket's: its socket carries replies of its own, none of them the request's."""
    if not request.get(UPGRADED):
        request[ACCOUNT] = account


def _gone_before_reply(app: web.Application, record: ReplyRecord) -> None:
    """A request whose client left before its reply existed: counted as cancelled, as a
    reply its client leaves is (no reply's ending will count it)."""
    record.outcome, record.reason = "cancelled", "client_gone"
    app[METRICS_KEY].observe(record)


async def start_reply(
    request: web.Request,
    generation: GenerationRequest,
    *,
    endpoint: str,
    fmt: StreamFormat | Choices,
    policy: DeliveryPolicy,
    resumable: bool | None,
    disconnect: Disconnect | None = None,
    numbered: bool = True,
    context: str = "",
    dialect: str = "",
    on_record: Callable[[ReplyRecord], None] | None = None,
    keepalive_s: float | None = None,
) -> Reply:
    """Admit a generation and start producing it into a new reply log. ``resumable``: None
    takes the server's default; a stream without event ids (``numbered=False``) never is.
    ``context``: what the route keeps with the reply in its store (``ReplyInfo.context``);
    ``dialect``: the dialect a reader of it speaks before its first event is logged
    (``ReplyInfo.dialect``); ``keepalive_s``: the keep-alive interval the request asked for
    (None: none), which its resumes keep too (``ReplyInfo.keepalive_s``).
    ``fmt`` as ``Choices``: several generations, one choice each, in one reply.
    ``on_record``: told the reply's record as soon as it is made, before any refusal (a
    WebSocket's reply, which is not its request's, keeps its own account with it)."""
    app = request.app
    if resumable is None:
        resumable = app[CONFIG_KEY].resumable_by_default
    resumable = resumable and numbered
    owner = owner_of(request)
    record = app[METRICS_KEY].record(endpoint, streamed=True)
    record.key = owner[:KEY_LABEL_CHARS]
    keep_account(request, record)  # refused as it starts: the record says so
    if on_record is not None:
        on_record(record)
    store: ReplayStore = app[STORE_KEY] if resumable else app[LOCAL_STORE_KEY]
    reply_id = ids.reply_id()
    stops, logprobs = generation.sampling.stop, generation.sampling.logprobs is not None
    pipeline: Pipeline
    deltas: DeltaStream
    if isinstance(fmt, Choices):
        several = await start_several(request, generation, record, len(fmt.formats))
        deltas = several
        prompt_tokens = app[ENGINE_KEY].count_tokens(generation.prompt)  # the server's estimate
        pipeline = ChoicesPipeline(
            fmt.formats,
            fmt.ending,
            policy,
            stops=stops,
            logprobs=logprobs,
            on_choice_done=several.close_choice,
            prompt_estimate=prompt_tokens,
        )
    else:
        deltas = await start_generation(request, generation, record)
        prompt_tokens = app[ENGINE_KEY].count_tokens(generation.prompt)
        pipeline = ReplyPipeline(
            fmt,
            policy,
            numbered=numbered,
            stops=stops,
            logprobs=logprobs,
            prompt_estimate=prompt_tokens,
        )
    try:
        info = ReplyInfo(
            reply_id, owner=owner, context=context, dialect=dialect, keepalive_s=keepalive_s
        )
        await store.create(info)
    except StoreUnavailable as exc:
        await close_quietly(deltas)
        record.outcome, record.reason = "rejected", exc.code
        app[METRICS_KEY].observe(record)
        raise HTTPAPIError(
            503, f"resumable replies are unavailable right now: {exc}", code=exc.code
        ) from exc
    except BaseException as exc:
        # The client left (or anything else) while a remote store made the log: no reply
        # owns the generation yet, so nothing else would ever stop it.
        await close_quietly(deltas)
        if isinstance(exc, asyncio.CancelledError):
            _gone_before_reply(app, record)
        raise
    reply = Reply(
        reply_id=reply_id,
        deltas=deltas,
        pipeline=pipeline,
        store=store,
        record=record,
        prompt_tokens=prompt_tokens,
        disconnect=disconnect or ("detach" if resumable else "cancel"),
        detach_grace_s=app[CONFIG_KEY].detach_grace_s,
        manager=app[MANAGER_KEY],
        resumable=resumable,
        # Several choices are merged by the reply's task: only one engine stream is pushed.
        pushes=not isinstance(fmt, Choices) and app[ENGINE_KEY].pushes,
        # Several choices are taken up as one: at once (no dialect with them tells a queue).
        queues=not isinstance(fmt, Choices) and app[ENGINE_KEY].queues,
    )
    keep_account(request, ReplyAccount(record, reply))
    gate = app[GATE_KEY]
    if reply.disconnect == "detach" and gate.max_concurrent:
        # Left by its client, it generates for nobody: room for it among that client's
        # limits, or it stops (``Reply.take_room``).
        reply.take_room = partial(gate.hold_detached, identity_of(request))
    app[MANAGER_KEY].start(reply)
    return reply


def follow_reply(
    request: web.Request,
    *,
    reply_id: str,
    store: ReplayStore,
    policy: DeliveryPolicy,
    reply: Reply | None,
    after: int = 0,
    keepalive: bytes = KEEPALIVE,
    numbered: bool = True,
    notices: Notices | None = None,
    place: ResumePlace = BY_EVENT_ID,
) -> EventStream:
    """The response that streams a reply's log to this connection as SSE, from after event
    ``after`` (which the reader named as ``place`` says); the handler returns it, and aiohttp
    sends it after the handler has returned."""
    request[REPLY_ID] = reply_id
    response = EventStream({**SSE_HEADERS, "X-Reply-Id": reply_id})
    response.follower = follower = follower_of(
        request,
        reply_id=reply_id,
        store=store,
        policy=policy,
        reply=reply,
        after=after,
        transport=SSETransport(
            request, response, numbered=numbered, keepalive=keepalive, notices=notices
        ),
        place=place,
    )
    request[ACCOUNT] = ReplyAccount(follower.record, reply, follower)
    return response


def follow_started(
    request: web.Request,
    reply: Reply,
    policy: DeliveryPolicy,
    *,
    keepalive: bytes = KEEPALIVE,
    numbered: bool = True,
    notices: Notices | None = None,
) -> EventStream:
    """``follow_reply`` for the reply this request has just started, from its first event."""
    return follow_reply(
        request,
        reply_id=reply.reply_id,
        store=reply.store,
        policy=policy,
        reply=reply,
        keepalive=keepalive,
        numbered=numbered,
        notices=notices,
    )


def follower_of(
    request: web.Request,
    *,
    reply_id: str,
    store: ReplayStore,
    policy: DeliveryPolicy,
    reply: Reply | None,
    transport: FrameTransport,
    after: int = 0,
    place: ResumePlace = BY_EVENT_ID,
) -> Follower:
    """A follower of a reply's log through ``transport``, from after event ``after`` (named
    by the reader as ``place`` says)."""
    return Follower(
        reply_id=reply_id,
        cursor=store.cursor(reply_id, after),
        transport=transport,
        policy=policy,
        readers=request.app[MANAGER_KEY],
        clock=request.app[KEEPALIVE_CLOCK_KEY],
        reply=reply,
        record=reader_sends(request) if reply is None else reply.record,
        place=place,
    )


def reader_sends(request: web.Request) -> ReaderSends:
    """Where a reader of a reply produced elsewhere counts what it sends: under the route it
    reads on (a bounded label: the router's name for it, not the path with its id)."""
    route = request.match_info.route.resource
    name = route.canonical if route is not None else request.path
    return request.app[METRICS_KEY].reader_sends(name)


async def buffered(
    request: web.Request,
    generation: GenerationRequest,
    *,
    endpoint: str,
    policy: DeliveryPolicy,
    body: BodyOf,
    moderated_body: ModeratedBodyOf,
    reply_id: str | None = None,
    choices: tuple[int, Callable[[list[Whole]], dict[str, Any]]] | None = None,
    failed_body: FailedBodyOf | None = None,
) -> web.Response:
    """Admit a generation and collect it whole into one JSON response (``body``), counted
    in the metrics like a streamed reply (time between tokens included). ``reply_id``: the
    id the body names, also sent as ``X-Reply-Id``. ``choices``: ``(n, body of all)`` for
    ``n`` generations, one choice each. ``failed_body``: the body of a reply that failed
    after it was admitted, answered with a 200 (None: an error status in the route's shape)."""
    app = request.app
    record = app[METRICS_KEY].record(endpoint, streamed=False)
    record.key = owner_of(request)[:KEY_LABEL_CHARS]
    request[ACCOUNT] = record
    several: Several | None = None
    deltas: DeltaStream
    if choices is None:
        deltas = await start_generation(request, generation, record)
        if app[ENGINE_KEY].queues:  # its time in the queue ends when the engine tells
            record.admitted_at = None
            cast(QueuedDeltaStream, deltas).when_admitted(record.admitted)
    else:
        n, several_body = choices
        merged = await start_several(request, generation, record, n)
        several, deltas = Several(n, several_body, merged.close_choice), merged
    if reply_id is not None:  # started: its access-log line names it, even if its client left
        request[REPLY_ID] = reply_id
    response = await buffered_reply(
        deltas,
        manager=app[MANAGER_KEY],
        record=record,
        checks=policy.checks,
        stops=generation.sampling.stop,
        logprobs=generation.sampling.logprobs is not None,
        prompt_tokens=app[ENGINE_KEY].count_tokens(generation.prompt),
        body=body,
        moderated_body=moderated_body,
        shape_error=partial(
            in_route_shape,
            request.path,
            headers=request.headers,
            request_id=request.get(REQUEST_ID),
        ),
        several=several,
        failed_body=failed_body,
        # The access log (INFO) names the request; at WARNING this name is all there is.
        named=f"request {request.get(REQUEST_ID)}" if reply_id is None else f"reply {reply_id}",
    )
    if reply_id is not None:
        response.headers["X-Reply-Id"] = reply_id
    return response
