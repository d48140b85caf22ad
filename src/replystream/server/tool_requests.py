"""Tools and tool messages of every dialect, turned into one form: OpenAI chat's.

The engines read one shape whatever the route: tools as ``{"type": "function", "function":
{"name", "description", "parameters"}}``, ``tool_choice`` as ``"none"``, ``"auto"``,
``"required"`` or ``{"type": "function", "function": {"name"}}``, an assistant's calls as a
message's ``tool_calls`` and each result as a ``tool`` message with its ``tool_call_id``
(what a chat upstream takes). This file makes that form from the chat, Responses and
Anthropic requests (already validated by their ``server.*_schemas``), checks what spans
fields (a ``tool_choice`` naming a tool that is not offered, a result answering no call, a
call no result answers, a tool offered twice), and writes the plain-text prompt of such
messages. Every mistake is a 400 (``HTTPAPIError``) before anything starts. It must not know
about HTTP handlers or engines.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from replystream.server.anthropic_schemas import (
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
)
from replystream.server.errors import HTTPAPIError
from replystream.server.openai_schemas import ChatTool, ChatToolChoice
from replystream.server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputMessage,
    ReasoningItem,
    ResponsesToolChoice,
)

ChatMessage = dict[str, Any]


class Origin(NamedTuple):
    """Where a chat message came from in the client's own request (a ``param`` path), and
    each of its tool calls when they came from places of their own (an Anthropic
    ``tool_use`` block, a Responses ``function_call`` item): an error names what the client
    wrote, not the place of the converted message, which a system message or a stored
    history shifts."""

    path: str
    calls: tuple[str, ...] = ()

    def of_call(self, index: int) -> str:
        return self.calls[index] if index < len(self.calls) else self.path


class Origins(Protocol):
    """Where each message of a request came from, by its place among them (a list, or
    ``OriginsIn``)."""

    def __getitem__(self, index: int, /) -> Origin: ...


class OriginsIn:
    """The origins of messages that are the request's own ``param`` list, one for one, each
    made when a mistake names it (most requests have none)."""

    __slots__ = ("param",)

    def __init__(self, param: str) -> None:
        self.param = param

    def __getitem__(self, index: int, /) -> Origin:
        return Origin(f"{self.param}[{index}]")


Tools = tuple[Mapping[str, Any], ...]
Choice = str | Mapping[str, Any]


def _bad(param: str, message: str) -> HTTPAPIError:
    return HTTPAPIError(400, message, code="invalid_value", param=param)


def _offered(names: Sequence[str], param: str) -> None:
    seen: set[str] = set()
    for index, name in enumerate(names):
        if name in seen:
            raise _bad(f"{param}[{index}]", f"the tool {name!r} is offered twice")
        seen.add(name)


def _choose(names: Sequence[str], mode: str, named: str | None, param: str) -> Choice:
    """The chat form of a choice (``named``: the one tool it forces), checked against the
    tools offered: forcing a tool needs one, and a named tool must be one of them."""
    if named is not None:
        if named not in names:
            offered = ", ".join(repr(n) for n in names) or "none"
            message = f"tool_choice names {named!r}, which is not offered (tools: {offered})"
            raise _bad(param, message)
        return {"type": "function", "function": {"name": named}}
    if mode == "required" and not names:
        raise _bad(param, "tool_choice requires a tool call, and no tools are offered")
    return mode


def chat_tools(
    tools: Sequence[ChatTool] | None, choice: ChatToolChoice | None
) -> tuple[Tools | None, Choice | None]:
    """``tools`` and ``tool_choice`` of a chat request, checked together."""
    offered = [tool.function.model_dump(exclude_none=True) for tool in tools or ()]
    names = [function["name"] for function in offered]
    _offered(names, "tools")
    if choice is None:
        return _relayed(offered), None
    if isinstance(choice, str):
        return _relayed(offered), _choose(names, choice, None, "tool_choice")
    return _relayed(offered), _choose(names, "", choice.function.name, "tool_choice")


def responses_tools(
    tools: Sequence[FunctionTool] | None, choice: ResponsesToolChoice | None
) -> tuple[Tools | None, Choice | None]:
    """``tools`` and ``tool_choice`` of a Responses request, in chat's form."""
    offered = [tool.model_dump(exclude_none=True, exclude={"type"}) for tool in tools or ()]
    names = [function["name"] for function in offered]
    _offered(names, "tools")
    if choice is None:
        return _relayed(offered), None
    if isinstance(choice, str):
        return _relayed(offered), _choose(names, choice, None, "tool_choice")
    return _relayed(offered), _choose(names, "", choice.name, "tool_choice")


ANTHROPIC_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def anthropic_tools(
    tools: Sequence[AnthropicTool] | None, choice: AnthropicToolChoice | None
) -> tuple[Tools | None, Choice | None]:
    """``tools`` and ``tool_choice`` of an Anthropic request, in chat's form (``any`` is
    ``required``; ``tool`` names the function; a tool's ``strict`` is chat's)."""
    offered: list[dict[str, Any]] = [
        {
            "name": tool.name,
            **({} if tool.description is None else {"description": tool.description}),
            "parameters": tool.input_schema,
            **({} if tool.strict is None else {"strict": tool.strict}),
        }
        for tool in tools or ()
    ]
    names = [function["name"] for function in offered]
    _offered(names, "tools")
    if choice is None:
        return _relayed(offered), None
    if choice.type == "tool":
        return _relayed(offered), _choose(names, "", choice.name, "tool_choice")
    return _relayed(offered), _choose(names, ANTHROPIC_CHOICES[choice.type], None, "tool_choice")


def _relayed(functions: list[dict[str, Any]]) -> Tools | None:
    if not functions:
        return None
    return tuple({"type": "function", "function": function} for function in functions)


def check_tool_answers(messages: Sequence[Mapping[str, Any]], origins: Origins) -> None:
    """Every ``tool`` message answers a call an earlier assistant message made, once: two
    calls of one message with one id, or a call answered twice, would leave which result
    belongs to which call a guess. (An id may come back in a later turn: engines that number
    a reply's calls from one make the same ids again, and each turn's answers are its own.)
    ``origins``: where each message came from, which a mistake names."""
    calls: set[str] = set()  # every call id made so far
    answered: set[str] = set()  # ids answered since they were last made
    for index, message in enumerate(messages):
        made_calls = message.get("tool_calls")
        if made_calls:
            made = [call["id"] for call in made_calls]
            for second, call_id in enumerate(made):
                if call_id in made[:second]:
                    message_text = f"two tool calls of one message have the id {call_id!r}"
                    raise _bad(origins[index].of_call(second), message_text)
            calls.update(made)
            answered.difference_update(made)
        if message["role"] != "tool":
            continue
        call_id = message.get("tool_call_id")
        if call_id not in calls:
            raise _bad(
                origins[index].path,
                f"a tool result answers the call {call_id!r}, "
                "which no earlier assistant message made",
            )
        if call_id in answered:
            raise _bad(origins[index].path, f"the call {call_id!r} is answered twice")
        answered.add(call_id)


def check_calls_answered_next(messages: Sequence[Mapping[str, Any]], origins: Origins) -> None:
    """OpenAI chat's rule (run after ``check_tool_answers``): the ``tool`` messages right after
    an assistant message with ``tool_calls`` answer each of its calls. Its documentation does
    not spell the rule out; this is what its API does: it refuses a result that comes after
    another message (its 400 names that message) and calls still unanswered where the
    conversation ends (its 400 names ``messages``). So a call is answered at once or never, and
    a conversation may not end with calls unanswered (Anthropic's may:
    ``check_anthropic_turns``). The mistake names the message that made the calls, as
    Anthropic's does, and says what came where a result was due."""
    for index, message in enumerate(messages):
        made = message.get("tool_calls")
        if not made:
            continue
        after = index + 1
        answered: set[str] = set()
        while after < len(messages) and messages[after]["role"] == "tool":
            answered.add(messages[after]["tool_call_id"])
            after += 1
        unanswered = [call["id"] for call in made if call["id"] not in answered]
        if unanswered:
            ids = ", ".join(repr(call_id) for call_id in unanswered)
            instead = (
                f"{origins[after].path} has the role {messages[after]['role']!r}"
                if after < len(messages)
                else "no message follows"
            )
            raise _bad(
                origins[index].path,
                f"tool calls not answered: {ids}. The tool messages right after an assistant "
                f"message must answer each of its calls ({instead})",
            )


def check_calls_answered(messages: Sequence[Mapping[str, Any]], origins: Origins) -> None:
    """OpenAI Responses' rule (run after ``check_tool_answers``): every function call has a
    ``function_call_output`` of its ``call_id`` somewhere after it, a call the response named
    by ``previous_response_id`` made too. Unlike chat's, the output may come after other items,
    as the Responses API pairs them by ``call_id`` wherever they are. The mistake names the
    first call left unanswered: its ``function_call`` item, or ``previous_response_id`` for a
    call the stored response made."""
    later: set[str] = set()  # the ids a tool message after this point answers
    # The earliest call found unanswered, walking back: (message, call, id).
    unanswered: tuple[int, int, str] | None = None
    for index in reversed(range(len(messages))):
        message = messages[index]
        if message["role"] == "tool":
            later.add(message["tool_call_id"])
            continue
        calls = message.get("tool_calls")
        if not calls:
            continue
        missing = [number for number, call in enumerate(calls) if call["id"] not in later]
        if missing:
            unanswered = index, missing[0], calls[missing[0]]["id"]
    if unanswered is not None:
        index, number, call_id = unanswered
        message_text = f"the function call {call_id!r} has no function_call_output after it"
        raise _bad(origins[index].of_call(number), message_text)


def answers_after_calls(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with each ``tool`` message moved to right after the assistant message
    that made its call (after that message's earlier answers), the others in their order:
    chat's shape (``check_calls_answered_next``), which a Responses input need not have (its
    outputs may come anywhere after their calls) and a chat engine or upstream is sent. Run
    after ``check_tool_answers``: every result answers an earlier call."""
    runs: list[list[ChatMessage]] = []
    made_by: dict[str, list[ChatMessage]] = {}  # a call's id: the run of its latest maker
    for message in messages:
        if message["role"] == "tool":
            made_by[message["tool_call_id"]].append(message)
            continue
        run = [message]
        runs.append(run)
        for call in message.get("tool_calls") or ():
            made_by[call["id"]] = run
    return [message for run in runs for message in run]


def check_anthropic_turns(messages: Sequence[AnthropicMessage]) -> None:
    """Anthropic's own rule for answering calls (run after ``check_tool_answers``, which
    refuses a result answering no call, or a call answered twice): the user turn right after
    an assistant turn's ``tool_use`` blocks begins with a ``tool_result`` for each of them (its
    text may follow), so a call is answered in the next turn or never. Consecutive messages of
    one role are one turn, as Anthropic's API joins them. A conversation may end with calls no
    turn answers yet. The message says it as Anthropic's does (``messages.N: ...``, N the
    message that made the calls)."""
    unanswered: list[str] = []  # the calls of the assistant turn before this user turn
    making: list[str] = []  # the calls of the assistant turn going on
    asked = asking = 0  # where each of those was made (its last message with calls)
    leading = False  # still in the user turn's first blocks, its results
    role = None
    for number, message in enumerate(messages):
        if message.role != role and message.role == "assistant":
            _answered_all(unanswered, asked)
            making = []
        elif message.role != role:
            unanswered, asked, leading, making = making, asking, True, []
        role = message.role
        if isinstance(message.content, str):
            leading = False
            continue
        for block in message.content:
            if block.type == "tool_use":
                making.append(block.id)
                asking = number
            elif block.type != "tool_result":
                leading = False
            elif leading and block.tool_use_id in unanswered:
                unanswered.remove(block.tool_use_id)
    if role == "user":
        _answered_all(unanswered, asked)


def _answered_all(unanswered: Sequence[str], asked: int) -> None:
    if unanswered:
        raise _bad(
            f"messages[{asked}]",
            f"messages.{asked}: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {', '.join(unanswered)}. Each `tool_use` block must have a "
            "corresponding `tool_result` block in the next message.",
        )


TOOL_FAILED = "Error: "  # what a tool result the client marked ``is_error`` begins with


def anthropic_messages(
    messages: Sequence[AnthropicMessage],
) -> tuple[list[ChatMessage], list[Origin]]:
    """Anthropic's messages in chat's form: ``tool_use`` blocks become the assistant's
    ``tool_calls``, ``tool_result`` blocks ``tool`` messages (before the user's own text,
    which ``check_anthropic_turns`` has them lead; one marked ``is_error`` says so first);
    with where each came from (``messages[i]``, a block ``messages[i].content[j]``)."""
    out: list[ChatMessage] = []
    origins: list[Origin] = []
    for number, message in enumerate(messages):
        path = f"messages[{number}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            origins.append(Origin(path))
            continue
        text = message.text
        blocks = list(enumerate(message.content))
        uses = [(place, block) for place, block in blocks if block.type == "tool_use"]
        calls = [
            {
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": json.dumps(block.input)},
            }
            for _, block in uses
        ]
        for place, block in blocks:
            if block.type == "tool_result":
                # Chat's tool message has no place for is_error: the model reads it in the text.
                said = f"{TOOL_FAILED}{block.text}" if block.is_error else block.text
                answer = {"role": "tool", "tool_call_id": block.tool_use_id, "content": said}
                out.append(answer)
                origins.append(Origin(f"{path}.content[{place}]"))
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            origins.append(Origin(path, tuple(f"{path}.content[{place}]" for place, _ in uses)))
        elif text or not any(block.type == "tool_result" for _, block in blocks):
            out.append({"role": message.role, "content": text})
            origins.append(Origin(path))
    return out, origins


def one_message_a_turn(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """``messages`` (from ``anthropic_messages``, checked) with each run of consecutive
    ``user`` or ``assistant`` messages joined into one, as Anthropic's API combines
    consecutive messages of one role into a single turn: their text joined as one message's
    blocks are, an assistant's calls in order. The model reads the turns the client meant
    (a chat template that wants the roles to alternate takes them), and a prefill split over
    several assistant messages is continued from all its text. ``tool`` messages, each a
    result of its own, are never joined."""
    out: list[ChatMessage] = []
    for message in messages:
        last = out[-1] if out else None
        role = message["role"]
        if last is None or role != last["role"] or role not in ("user", "assistant"):
            out.append(dict(message))
            continue
        text = (last["content"] or "") + (message["content"] or "")
        calls = [*(last.get("tool_calls") or ()), *(message.get("tool_calls") or ())]
        # An assistant's message with calls and no text has ``None`` for content, as chat's.
        last["content"] = text or (None if calls else "")
        if calls:
            last["tool_calls"] = calls
    return out


ResponseItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def responses_messages(items: Sequence[ResponseItem]) -> tuple[list[ChatMessage], list[Origin]]:
    """A Responses ``input`` list in chat's form: consecutive ``function_call`` items join
    one assistant message's ``tool_calls``; a ``function_call_output`` is a ``tool`` message;
    a ``reasoning`` item (an earlier turn's thinking) is left out, as chat has no place for it.
    With where each came from (``input[i]``; a joined message's calls, each its own item)."""
    out: list[ChatMessage] = []
    origins: list[Origin] = []
    for number, item in enumerate(items):
        path = f"input[{number}]"
        if item.type == "reasoning":
            continue
        if item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
                joined = origins[-1]
                origins[-1] = joined._replace(calls=(*joined.calls, path))
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(Origin(path, (path,)))
        elif item.type == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            origins.append(Origin(path))
        else:
            out.append({"role": item.role, "content": item.text})
            origins.append(Origin(path))
    return out, origins


def prompt_line(message: Mapping[str, Any]) -> str:
    """A message as plain text: ``role: content`` (as always for text), then one line per
    tool call (``role: [call ID] NAME ARGUMENTS``); a tool result is ``tool [ID]: content``."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content)
    if content is None:  # an assistant's refusal to answer: its words
        content = message.get("refusal")
    role = message["role"]
    if role == "tool":
        return f"tool [{message.get('tool_call_id')}]: {content or ''}"
    calls = message.get("tool_calls") or ()
    lines = [f"{role}: {content}"] if content or not calls else []
    lines += (
        f"{role}: [call {call['id']}] {call['function']['name']} {call['function']['arguments']}"
        for call in calls
    )
    return "\n".join(lines)


def prompt_of(messages: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text prompt of chat messages (what engines that read text see)."""
    return "\n".join(prompt_line(message) for message in messages)
