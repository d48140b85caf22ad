"""``item_reference`` input items: each replaced by the stored item it names, before anything
reads a Responses request's input.

A client that keeps the conversation itself may send an item the server already holds by its
id alone (OpenAI's ``item_reference``): Vercel's AI SDK sends every earlier assistant message
of a conversation so while ``store`` is on, its default. An item a response made (its
output: ``msg_``, ``fc_``, ``rs_``) or was made from (its input, as ``GET
/v1/responses/{id}/input_items`` lists it) has its response's reply id right after its kind's
prefix (``server.ids``: a fixed length), so the response is found from the id alone, as the
caller's (another key's is not found), on this replica or, with Redis, any other; nothing is
indexed. An item id a client made up (an input item it gave its own id) names no response,
and is not found: OpenAI's answer to an item it does not keep, a 404.

The item is put in the reference's place as the client would have sent it, so every later
check (tool calls and results, the prompt limit) and the input a stored response keeps see
the item, never the reference. This file must not know how a response's events are made.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from replystream.server import ids
from replystream.server.context import CONFIG_KEY
from replystream.server.errors import HTTPAPIError
from replystream.server.native import bad
from replystream.server.responses_input_items import ID_PREFIXES, input_items
from replystream.server.responses_schemas import (
    InputItem,
    ItemReference,
    RequestInput,
    ResponseInput,
)
from replystream.server.responses_stored import (
    find_response,
    response_items,
    stored_conversation,
)
from replystream.server.resume_points import not_found_here

_ITEM = TypeAdapter[InputItem](InputItem)
_PREFIXES = frozenset(ID_PREFIXES.values())
Items = dict[str, dict[str, Any]]  # a response's items by id


async def resolved_input(request: web.Request, given: RequestInput | None) -> ResponseInput | None:
    """``given`` with each ``item_reference`` replaced by the item it names (a 404 naming
    the reference for one not found, a 400 for an item still being made)."""
    if given is None or isinstance(given, str):
        return given
    found: dict[str, Items] = {}  # each response read once, however many items it gives
    untold: dict[str, HTTPAPIError] = {}  # why a running response's output cannot be told
    resolved: list[InputItem] = []
    # The prompt's characters the references bring: a reference of 60 bytes can stand for
    # a message of any length, and the same one may come thousands of times. Counted as the
    # items are taken, a request is refused as the prompt limit would refuse it, before
    # those copies are made (a body of 1 MB made a prompt of 750 million characters first).
    limit = request.app[CONFIG_KEY].max_prompt_chars
    referred = 0
    for number, item in enumerate(given):
        if not isinstance(item, ItemReference):
            resolved.append(item)
            continue
        param = f"input[{number}]"
        reply_id = _reply_id_in(item.id)
        if reply_id is not None and reply_id not in found:
            found[reply_id] = await _items_of(request, reply_id, param, untold)
        shown = found.get(reply_id or "", {}).get(item.id)
        if shown is None and reply_id in untold:
            raise untold[reply_id]
        if shown is None:
            raise HTTPAPIError(
                404,
                not_found_here(
                    request.app,
                    f"no item {item.id!r} was found ({param}): it never existed here, was "
                    "made with store: false (not kept), was deleted, or has expired",
                ),
                code="item_not_found",
                param=param,
            )
        if shown.get("status") == "in_progress":
            raise HTTPAPIError(
                400,
                f"item {item.id} ({param}) is still being made",
                code="invalid_value",
                param=param,
            )
        referred += _prompt_chars(shown)
        if referred > limit:
            message = (
                f"the input is more than {limit} characters (its referenced items alone); "
                f"this server's limit is {limit}"
            )
            raise bad("input", message, "context_length_exceeded")
        resolved.append(_as_input(shown, param))
    return resolved


def _prompt_chars(shown: dict[str, Any]) -> int:
    """Characters of a stored item that its prompt line holds whole: a message's text, a
    call's arguments, a tool result given as a string (at least: its line has more). A
    reasoning item has no line (its thinking is left out of the prompt): none, however
    long the thinking it keeps, or a request the prompt limit takes would be refused."""
    if shown.get("type") == "reasoning":
        return 0
    texts = [part.get("text") for part in shown.get("content") or ()]
    texts += [shown.get("arguments"), shown.get("output")]
    return sum(len(text) for text in texts if isinstance(text, str))


def _reply_id_in(item_id: str) -> str | None:
    """The reply id an item id of ours holds (``<prefix>_<reply id>``, then nothing, or an
    ``_`` and the item's place), or None for an id of another form."""
    prefix, _, rest = item_id.partition("_")
    reply_id, tail = rest[: ids.REPLY_ID_CHARS], rest[ids.REPLY_ID_CHARS :]
    if prefix not in _PREFIXES or len(reply_id) < ids.REPLY_ID_CHARS:
        return None
    return reply_id if not tail or tail.startswith("_") else None


async def _items_of(
    request: web.Request, reply_id: str, param: str, untold: dict[str, HTTPAPIError]
) -> Items:
    """The items of the caller's response ``reply_id`` by id: its output and its input; none
    for a response not found (not stored, another key's, gone). Of a running one whose log
    no longer holds its first events, its input alone (its conversation keeps it whole):
    ``untold`` gets why its output is not told, for a reference to one of its items."""
    try:
        store, _, _ = await find_response(request, reply_id, param)
        kept = await stored_conversation(store, reply_id)
        try:
            shown = await response_items(store, reply_id, param)
        except HTTPAPIError as exc:
            if exc.status != 410 or kept is None or kept.input is None:
                raise
            untold[reply_id] = exc
            shown = []
    except HTTPAPIError as exc:
        if exc.status != 404:
            raise
        return {}
    if kept is not None and kept.input is not None:
        shown += input_items(reply_id, kept.input)
    return {item["id"]: item for item in shown}


def _as_input(shown: dict[str, Any], param: str) -> InputItem:
    """A stored item, as the client would have sent it back, without the log probabilities
    of its text (no part of a prompt, and megabytes in the input the new response keeps)."""
    for part in shown.get("content") or ():
        part.pop("logprobs", None)
    try:
        return _ITEM.validate_python(shown)
    except ValidationError:  # an item of a kind the input does not take
        message = f"item {shown['id']} ({param}) cannot be sent as input"
        raise HTTPAPIError(400, message, code="invalid_value", param=param) from None
