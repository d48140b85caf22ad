"""The OpenAI Responses API: create, read, resume, cancel and delete responses.

- ``POST /v1/responses``: a response streamed as typed events, or one object. A stored
  response (``store``, the API's default) is a resumable reply: its log is kept in the
  reply store (on Redis, shared by every replica) for ``--reply-ttl-s`` after its end.
  ``background`` runs it whoever reads (the ``keep`` disconnect policy) and answers at once.
  A stored response not streamed is produced into its log like a streamed one and answered
  with the terminal event's object, so it can be read again and continued from.
- ``GET /v1/responses/{id}``: the object as its log tells it now; with ``stream=true``, its
  events after ``starting_after`` (a ``sequence_number``, from 0) or ``Last-Event-ID`` (an
  event's SSE ``id:``, its number in the log: the sequence number plus one), then the live
  tail.
- ``POST /v1/responses/{id}/cancel`` (idempotent) and ``DELETE /v1/responses/{id}``.
- ``GET /v1/responses/{id}/input_items`` is ``server.responses_input_items``'s. Every route
  that reads a stored response finds it and tells its object through
  ``server.responses_stored``.
- ``previous_response_id`` continues a conversation: each stored response keeps its input
  (as chat messages, in ``ReplyInfo.context``, beside the request's ``input`` as given) so
  the next one sends the history, the previous output and its own input. That prompt is
  ``server.responses_prompt``'s, which ``POST /v1/responses/input_tokens`` counts.
Every response is a reply like any other (batching, hold-back, keep-alive, the slow-client
limits, owner checks); this file turns requests into replies through ``server.context`` and
must not know how tokens are made or how events are framed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from replystream.delivery.follower import ResumePlace
from replystream.delivery.formats import moderated_payload
from replystream.delivery.moderation import Violation
from replystream.delivery.openai_formats import logprob_entries
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import StoreUnavailable
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_log import (
    DIALECT,
    ReaderNotices,
)
from replystream.delivery.responses_objects import (
    INCOMPLETE_REASONS,
    MessageLogprobs,
    ResponseSettings,
    response_error,
    response_object,
    split_by_message,
)
from replystream.delivery.sliced_json import Sliced
from replystream.engine.base import GenerationRequest
from replystream.server import ids
from replystream.server.access_log import ACCOUNT, REPLY_ID
from replystream.server.accounts import ObjectRead
from replystream.server.buffered import WHOLE_REPLY, Whole
from replystream.server.cancels import CANCEL_WAIT_S, until_ended
from replystream.server.context import (
    CONFIG_KEY,
    buffered,
    follow_started,
    reader_sends,
    start_reply,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.guard import hold_background
from replystream.server.native import (
    delivery_overrides,
    sampling_params,
)
from replystream.server.openai_api import SDK_KEEPALIVE, served_model
from replystream.server.openai_requests import ACCOUNT_FIELDS, relayed_fields
from replystream.server.query_schemas import RETRIEVE_INCLUDE, RetrieveQuery
from replystream.server.refusal_names import refusals_naming
from replystream.server.replies import Reply
from replystream.server.responses_prompt import RESPONSES_FIELDS, response_prompt
from replystream.server.responses_schemas import (
    FunctionTool,
    ResponsesBody,
    ResponsesReasoning,
    kept_conversation,
)
from replystream.server.responses_stored import (
    NO_SUCH_RESPONSE,
    find_response,
    response_body,
    response_reply_id,
    response_standing,
)
from replystream.server.resume_dialects import follow_resumed
from replystream.server.resume_points import check_resume_point, resume_after
from replystream.server.schema_fields import SamplingFields
from replystream.server.validation import parse_mapping, read_model

# ``starting_after`` is a sequence number, from 0; the log's ids (``Last-Event-ID``) from 1.
SEQUENCE_BELOW_ID = {"starting_after": 1}


def _sampling(body: ResponsesBody) -> SamplingFields:
    """The sampling and delivery fields, the API's own and replystream's extensions."""
    extensions = body.replystream
    # Validated already (``ResponsesBody``): put together, not checked again.
    return SamplingFields.model_construct(
        temperature=body.temperature,
        top_p=body.top_p,
        **({} if extensions is None else extensions.model_dump(exclude_none=True)),
    )


def _echoed_choice(body: ResponsesBody) -> str | dict[str, Any]:
    """The ``tool_choice`` a response object repeats (the API's default: ``auto``)."""
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _echoed_tool(tool: FunctionTool) -> dict[str, Any]:
    """A function tool as the response object repeats it: as given, with ``parameters`` and
    ``strict`` always there (null when not given), as OpenAI's object has them."""
    given = tool.model_dump(exclude_none=True)
    return {**given, "parameters": given.get("parameters"), "strict": given.get("strict")}


def _echoed_format(body: ResponsesBody) -> dict[str, Any]:
    """The ``text.format`` a response object repeats: as given (the API's default: text)."""
    given = None if body.text is None else body.text.format
    if given is None:
        return {"type": "text"}
    return given.model_dump(by_alias=True, exclude_none=True)


async def handle_create(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``."""
    app = request.app
    config = app[CONFIG_KEY]
    body = await read_model(request, ResponsesBody)
    made = await response_prompt(request, body)
    policy = delivery_overrides(_sampling(body), config.policy, under="replystream.")
    sampling = sampling_params(
        _sampling(body), body.max_output_tokens, logprobs=body.shown_logprobs
    )
    generation = replace(
        made.generation,
        sampling=sampling,
        continuation=_sampling(body).upstream_continue,
        reasoning=policy.shows_thinking,
        prompt_cache_key=body.prompt_cache_key,
        # (Not ``store`` nor ``metadata``: a response is stored here, and they say so.)
        relayed=relayed_fields(body, ACCOUNT_FIELDS, made.generation.relayed),
        # Answered before it begins: it may wait for room after the engine's start (a relay).
        background=body.background,
    )
    model = made.generation.model or served_model(app)
    settings = ResponseSettings(
        model=model,
        created_at=int(time.time()),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        metadata=body.metadata,
        previous_response_id=body.previous_response_id,
        store=body.store,
        background=body.background,
        tools=tuple(_echoed_tool(tool) for tool in body.tools or ()),
        tool_choice=_echoed_choice(body),
        parallel_tool_calls=body.parallel_tool_calls is not False,  # the API's default: true
        reasoning=(body.reasoning or ResponsesReasoning()).model_dump(),
        verbosity=None if body.text is None else body.text.verbosity,
        text_format=_echoed_format(body),
        top_logprobs=body.top_logprobs or 0,
        user=body.user,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        max_tool_calls=body.max_tool_calls,
    )
    with refusals_naming(RESPONSES_FIELDS):  # an engine's refusal, in this API's words
        if not body.store:  # nothing to keep: a plain reply, or one body collected whole
            if not body.stream:
                return await _whole(request, generation, settings, policy)
            reply = await start_reply(
                request,
                generation,
                endpoint="/v1/responses",
                fmt=ResponsesStreamFormat(settings),
                policy=policy,
                resumable=False,
                # Its log drops what its reader sent: a resume finding nothing kept to tell
                # the dialect by still speaks it.
                dialect=DIALECT,
                keepalive_s=_sampling(body).keepalive_s,  # its resumes keep it too
            )
            return _follow(request, reply, policy, settings)
        answered_whole = not body.stream and not body.background
        if answered_whole and policy.checks:
            # One body, as an unstored one is: the whole text checked before any of it is kept
            # (a window would keep the start of a blocked phrase in the stored response).
            policy = policy.with_overrides(holdback_tokens=WHOLE_REPLY)
        resumes_by_default = request.app[CONFIG_KEY].resumable_by_default
        # A background response runs on after its request: room for it among its client's
        # requests at once is held until it ends.
        release = hold_background(request) if body.background else None
        try:
            reply = await start_reply(
                request,
                generation,
                endpoint="/v1/responses",
                fmt=ResponsesStreamFormat(settings),
                policy=policy,
                resumable=True,
                dialect=DIALECT,
                # Its resumes, and a background response's readers, keep it too.
                keepalive_s=_sampling(body).keepalive_s,
                # Not in the background, it stops when its client leaves, as a reply on another
                # route does, unless the server makes replies resumable by default: then it goes
                # on for the detach grace, as theirs do.
                disconnect="keep" if body.background else None if resumes_by_default else "cancel",
                context=kept_conversation(
                    made.conversation,
                    made.given,
                    background=body.background,
                    opened=response_object(settings, "", "in_progress"),
                ),
            )
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            reply.when_ended(release)
    if body.stream:
        return _follow(request, reply, policy, settings)
    request[REPLY_ID] = reply.reply_id  # its access-log line names it, as a stream's does
    if body.background:
        queued = response_object(settings, reply.reply_id, "queued")
        return web.json_response(queued, headers={"X-Reply-Id": reply.reply_id})
    answer = await _await_end(reply)
    answer.headers["X-Reply-Id"] = reply.reply_id
    return answer  # its one body counted as it goes out (``front_door.count_whole_body``)


def _follow(
    request: web.Request, reply: Reply, policy: DeliveryPolicy, settings: ResponseSettings
) -> web.StreamResponse:
    opened = response_object(settings, reply.reply_id, "in_progress")
    notices = ReaderNotices(reply.reply_id, opened)
    return follow_started(request, reply, policy, keepalive=SDK_KEEPALIVE, notices=notices)


async def _await_end(reply: Reply) -> web.Response:
    """A stored response answered whole: wait for its log's ending, then read the object.
    The waiting request is its reader: if the client leaves, the response stops."""
    reply.reader_joined()
    try:
        await until_ended(reply.store, reply.reply_id)
    finally:
        reply.reader_left("client_gone")  # after the end, this only lets go of the log
    return await response_body(reply.store, reply.reply_id)


async def _whole(
    request: web.Request,
    generation: GenerationRequest,
    settings: ResponseSettings,
    policy: DeliveryPolicy,
) -> web.StreamResponse:
    """A response nobody will read again, collected whole (no log)."""
    reply_id = ids.reply_id()

    def message_logprobs(made: Whole) -> MessageLogprobs:
        if made.logprobs is None:  # not included
            return ()
        at = dict(made.logprobs_at)
        split = split_by_message(made.text, made.tool_calls, made.thoughts, made.logprobs, at)
        return [Sliced(tokens, logprob_entries) for tokens in split]  # a body's largest part

    def body(whole: Whole) -> dict[str, Any]:
        incomplete = INCOMPLETE_REASONS.get(whole.finish_reason)
        return response_object(
            settings,
            reply_id,
            "completed" if incomplete is None else "incomplete",
            text=whole.text,
            usage=whole.usage,
            incomplete_reason=incomplete,
            tool_calls=whole.tool_calls,
            thoughts=whole.thoughts,
            logprobs=message_logprobs(whole),
            refusal=whole.refused,
        )

    def moderated(whole: Whole, violation: Violation) -> dict[str, Any]:
        response = response_object(
            settings,
            reply_id,
            "incomplete",
            text=whole.text,
            usage=whole.usage,
            incomplete_reason="content_filter",
            tool_calls=whole.tool_calls,
            thoughts=whole.thoughts,
            logprobs=message_logprobs(whole),
            refusal=whole.refused,
        )
        response["replystream_moderation"] = moderated_payload(violation)
        return response

    def failed(made: Whole, code: str, message: str) -> dict[str, Any]:
        # As a stored response that failed is answered (``_await_end``), and as OpenAI
        # answers a response that failed once accepted: 200, ``status: failed`` and its
        # ``error``, the output made before it (the last item cut: incomplete), no usage.
        return response_object(
            settings,
            reply_id,
            "failed",
            text=made.text,
            error=response_error(code, message),
            tool_calls=made.tool_calls,
            thoughts=made.thoughts,
            logprobs=message_logprobs(made),
            refusal=made.refused,
        )

    return await buffered(
        request,
        generation,
        endpoint="/v1/responses",
        policy=policy,
        body=body,
        moderated_body=moderated,
        reply_id=reply_id,
        failed_body=failed,
    )


async def handle_retrieve(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: the object, or (``stream=true``) its events after
    ``starting_after``, then the live tail (kept alive at ``keepalive_s``, else as the
    response's request asked)."""
    query = parse_mapping(request.query, RetrieveQuery)
    if not query.stream:
        # A cursor says where a stream of events starts: the object has none to start from.
        for name in ("starting_after", "last_event_id"):
            if getattr(query, name) is not None:
                message = f"{name} says where a stream of events starts: send stream=true with it"
                raise HTTPAPIError(400, message, code="invalid_value", param=name)
        if query.keepalive_s is not None:  # nor is the object, sent whole, kept alive
            message = "keepalive_s keeps a stream of events alive: send stream=true with it"
            raise HTTPAPIError(400, message, code="invalid_value", param="keepalive_s")
    elif query.include:
        # A stream replays the events as they were made, with the log probabilities their
        # request included: what to include applies to the object alone.
        raise HTTPAPIError(
            400,
            "include applies to the object a GET answers; the events a stream replays "
            "(stream=true) are the ones the response was made with: send one or the other",
            code="unsupported_parameter",
            param="include",
        )
    given_id = request.match_info["response_id"]
    reply_id = response_reply_id(given_id, "response_id")
    store, local, info = await find_response(request, reply_id, "response_id")
    if not query.stream:
        answer = await response_body(store, reply_id, logprobs=RETRIEVE_INCLUDE in query.include)
        # The reply's text, sent: counted as its events streamed to this reader would be, one
        # event, as it goes out (``front_door.count_whole_body``).
        request[ACCOUNT] = ObjectRead(reader_sends(request))
        return answer
    # An EventSource resumes with its events' ids, in the query or its header.
    cursors = {"starting_after": query.starting_after, "last_event_id": query.last_event_id}
    after, param = resume_after(request, cursors, SEQUENCE_BELOW_ID)
    place = ResumePlace(param, SEQUENCE_BELOW_ID.get(param, 0))
    if after > 0:
        await check_resume_point(
            reply_id,
            store,
            after,
            made_here=local is not None,
            param=param,
            below=place.below,
            known_as=f"response {given_id}",  # the id the client has, not the log's
        )
    gone = HTTPAPIError(404, NO_SUCH_RESPONSE, code="reply_not_found", param="response_id")
    return await follow_resumed(
        request, info, store, local, after, place, keepalive_s=query.keepalive_s, gone=gone
    )


async def handle_cancel(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses/{id}/cancel``: end it with status ``cancelled`` (a response that
    has ended already is answered as it is). Only a background response can be cancelled,
    as in OpenAI's API: a streamed one stops when its client closes the stream."""
    given_id = request.match_info["response_id"]
    reply_id = response_reply_id(given_id, "response_id")
    store, _, _ = await find_response(request, reply_id, "response_id")
    standing = await response_standing(store, reply_id)
    if not standing.background:
        raise HTTPAPIError(
            400,
            f"response {given_id} was not created with background: true, and only a "
            "background response can be cancelled",
            code="invalid_value",
            param="response_id",
        )
    if not standing.running:
        return await response_body(store, reply_id)
    try:
        await store.request_cancel(reply_id)  # reaches the producer, on whichever replica
        # Answer with the ending once the producer has written it; one whose producer died
        # is answered as soon as that is known (``failed``, ``generator_lost``), as a GET is.
        await until_ended(store, reply_id, CANCEL_WAIT_S)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    return await response_body(store, reply_id)


async def handle_delete(request: web.Request) -> web.StreamResponse:
    """``DELETE /v1/responses/{id}``: stop it if it runs, and forget it everywhere."""
    response_id = request.match_info["response_id"]
    reply_id = response_reply_id(response_id, "response_id")
    store, _, _ = await find_response(request, reply_id, "response_id")
    try:
        await store.delete(reply_id)  # stopped first, if it runs (on whichever replica)
    except StoreUnavailable as exc:
        raise HTTPAPIError(503, exc.describe(), code=exc.code) from exc
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


# A response's own path: any id but ``input_tokens``, which is the count's path (its other
# methods are a 405 there, not a search for a response of that name).
RESPONSE_PATH = "/v1/responses/{response_id:(?!input_tokens$)[^{}/]+}"


def add_responses_routes(app: web.Application) -> None:
    """Register the Responses API on ``app``."""
    app.router.add_post("/v1/responses", handle_create, expect_handler=expect_later)
    # A GET of the events streams them: no HEAD (docs/api.md).
    app.router.add_get(
        RESPONSE_PATH, handle_retrieve, allow_head=False, expect_handler=expect_later
    )
    app.router.add_post(
        "/v1/responses/{response_id}/cancel", handle_cancel, expect_handler=expect_later
    )
    app.router.add_delete(RESPONSE_PATH, handle_delete, expect_handler=expect_later)
