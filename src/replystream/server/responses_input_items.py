"""``GET /v1/responses/{id}/input_items``: the input items a stored response was made from.

A stored response keeps its request's own ``input`` as the request gave it (``Conversation``
in ``ReplyInfo.context``); this route lists it as OpenAI's API does, each item in the shape
the API gives an item it returns, and a page of that list. Only the request's own input is
listed: what a ``previous_response_id`` carried on is that response's, and the
``instructions`` are no item.

Ids. The API gives every item an id, also when the client sent none, and pages by them
(``after``, ``before``), so an item's id must be the same on every call and every replica,
with nothing stored but the input: the id the client gave the item, or, when it gave none
(or an earlier item of the same input has that id), ``<prefix>_<reply id>_in_<position>``,
its place in the input after the kind's prefix (``msg``, ``fc``, ``fco``, ``rs``). The
reply id is random and made after the request was sent, so no id a client gives can be one
of these.

This file decides the items' shapes and ids and the page; finding the response (its owner,
whether it is stored) is ``server.responses_stored``'s, and it must not know how a response's
events are logged.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from aiohttp import web

from replystream.server.errors import HTTPAPIError
from replystream.server.front_door import expect_later
from replystream.server.query_schemas import InputItemsQuery
from replystream.server.responses_schemas import (
    LOGPROBS_INCLUDED,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    InputText,
    MessagePart,
    ReasoningItem,
    RefusalPart,
)
from replystream.server.responses_stored import (
    NO_SUCH_RESPONSE,
    find_response,
    response_reply_id,
    stored_conversation,
)
from replystream.server.validation import parse_mapping

Item = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

ITEM_STATUSES = ("in_progress", "completed", "incomplete")  # an item's, in OpenAI's API
ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def input_items(
    reply_id: str, given: str | Sequence[Item], include: Collection[str] = ()
) -> list[dict[str, Any]]:
    """The items of a request's ``input`` (``given``), in its order, as the API lists them.
    ``include``: what the request for the list asked to add (``reasoning.encrypted_content``:
    a reasoning item's ``encrypted_content``, left out otherwise; ``message.output_text.logprobs``:
    the ``logprobs`` a model's text was sent back with, ``[]`` otherwise)."""
    if isinstance(given, str):  # a string is one user message
        given = [InputMessage(role="user", content=given)]
    items: list[dict[str, Any]] = []
    taken: set[str] = set()
    for position, item in enumerate(given):
        kind = item.type or "message"
        own = item.id if item.id and item.id not in taken else None
        item_id = own or f"{ID_PREFIXES[kind]}_{reply_id}_in_{position}"
        taken.add(item_id)
        items.append({"id": item_id, **_shape(item, include)})
    return items


def _shape(item: Item, include: Collection[str]) -> dict[str, Any]:
    """An item's fields but its id, as the API returns such an item. Its status is the one
    the client gave it, if it is an item's status; else ``completed``, as for every item the
    API took in whole."""
    status = item.status if item.status in ITEM_STATUSES else "completed"
    if isinstance(item, FunctionCallItem):
        return {
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": status,
        }
    if isinstance(item, FunctionCallOutputItem):
        return {
            "type": "function_call_output",
            "call_id": item.call_id,
            # As given: a string, or its text parts (``input_text``).
            "output": item.output
            if isinstance(item.output, str)
            else [{"type": "input_text", "text": part.text} for part in item.output],
            "status": status,
        }
    if isinstance(item, ReasoningItem):
        shown: dict[str, Any] = {
            "type": "reasoning",
            "summary": [part.model_dump() for part in item.summary or ()],
        }
        if item.content is not None:
            shown["content"] = [part.model_dump() for part in item.content]
        if "reasoning.encrypted_content" in include:
            shown["encrypted_content"] = item.encrypted_content
        return {**shown, "status": status}
    content = _parts(item, LOGPROBS_INCLUDED in include)
    message = {"type": "message", "role": item.role, "content": content, "status": status}
    return message if item.phase is None else {**message, "phase": item.phase}


def _parts(message: InputMessage, with_logprobs: bool) -> list[dict[str, Any]]:
    """A message's content as the parts of its role's item: ``input_text`` for the client's
    roles, ``output_text`` (with its annotations and, when asked, the log probabilities it
    was sent back with; a refusal as its ``refusal`` part) for an assistant's message sent
    back. An ``output_text`` part always has ``logprobs``, as OpenAI's specification
    requires and a response's own parts have it: ``[]`` when not asked for, as in a
    response made without them."""
    content = message.content
    given: Sequence[MessagePart] = (
        [InputText(type="input_text", text=content)] if isinstance(content, str) else content
    )
    if message.role != "assistant":
        return [{"type": "input_text", "text": part.text} for part in given]
    parts: list[dict[str, Any]] = []
    for part in given:
        if isinstance(part, RefusalPart):
            parts.append({"type": "refusal", "refusal": part.refusal})
            continue
        logprobs = (part.logprobs or []) if with_logprobs else []
        annotations = part.annotations or []
        parts.append(
            {
                "type": "output_text",
                "text": part.text,
                "annotations": annotations,
                "logprobs": logprobs,
            }
        )
    return parts


def page(items: Sequence[dict[str, Any]], query: InputItemsQuery) -> dict[str, Any]:
    """The list object of a page of ``items`` (in the input's order): in the query's order,
    those between its ``after`` and ``before`` items, the first ``limit`` of them (with
    ``before`` alone, the last: the page just before that item); ``has_more`` when that left
    some out.

    Raises:
        HTTPAPIError: ``after`` or ``before`` is no item's id (a 400 naming it).
    """
    ordered = list(items) if query.order == "asc" else list(reversed(items))
    ids = [item["id"] for item in ordered]
    start = 0 if query.after is None else _place(ids, query.after, "after") + 1
    end = len(ids) if query.before is None else _place(ids, query.before, "before")
    window = ordered[start:end]
    backwards = query.before is not None and query.after is None
    data = window[-query.limit :] if backwards else window[: query.limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(window) > len(data),
    }


def _place(ids: list[str], cursor: str, param: str) -> int:
    try:
        return ids.index(cursor)
    except ValueError:
        shown = cursor if len(cursor) <= 80 else cursor[:77] + "..."
        message = f"{param} must be the id of one of this response's input items, got {shown!r}"
        raise HTTPAPIError(400, message, code="invalid_value", param=param) from None


async def handle_list_input_items(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}/input_items``."""
    query = parse_mapping(request.query, InputItemsQuery)
    given_id = request.match_info["response_id"]
    reply_id = response_reply_id(given_id, "response_id")
    store, _, _ = await find_response(request, reply_id, "response_id")
    kept = await stored_conversation(store, reply_id)
    if kept is None:  # expired or deleted since it was found
        raise HTTPAPIError(404, NO_SUCH_RESPONSE, code="reply_not_found", param="response_id")
    if kept.input is None:
        raise HTTPAPIError(
            410,
            f"response {given_id} was stored by an earlier version of this server, which kept "
            "its input only as chat messages: its input items cannot be listed",
            code="input_items_not_kept",
            param="response_id",
        )
    items = input_items(reply_id, kept.input, query.include)
    return web.json_response(page(items, query))


def add_input_items_route(app: web.Application) -> None:
    """Register ``GET /v1/responses/{response_id}/input_items`` on ``app``."""
    app.router.add_get(
        "/v1/responses/{response_id}/input_items",
        handle_list_input_items,
        allow_head=False,
        expect_handler=expect_later,
    )
