"""Tool calls piece by piece: the pipeline's order, the script's checks, the conversions
between dialects, and the relay's request body (pure code, no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replystream.delivery.formats import NativeFormat
from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import LogEntry
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_log import response_from_log
from replystream.delivery.responses_objects import ResponseSettings
from replystream.engine.base import Delta, GenerationRequest, ToolCallDelta
from replystream.engine.reply_script import ScriptError, parse_reply_script
from replystream.engine.upstream_request import request_body
from replystream.server.anthropic_schemas import MessagesBody
from replystream.server.tool_requests import anthropic_messages, anthropic_tools, prompt_of

SERVE = [sys.executable, "-m", "replystream", "serve"]
HEAD = ToolCallDelta(0, "call_1", "get_weather", "")
PIECES = [HEAD, ToolCallDelta(0, None, None, '{"city":'), ToolCallDelta(0, None, None, ' "Oslo"}')]


def run(pipeline: ReplyPipeline, words: list[str]) -> list[LogEntry]:
    entries = pipeline.start("r1")
    for word in words:
        entries += pipeline.push(Delta(word), 0.0)
    for piece in PIECES:
        entries += pipeline.push(Delta("", 1, 0.0, tool_call=piece), 0.0)
    return entries + pipeline.finish()


@pytest.mark.parametrize(
    "policy",
    [
        DeliveryPolicy(),
        DeliveryPolicy(holdback_tokens=3, checks=[BannedPhrases(["forbidden"])]),
        DeliveryPolicy(batch_tokens=4),
        DeliveryPolicy(batch_tokens=2, holdback_tokens=5),
    ],
    ids=["direct", "holdback", "batched", "both"],
)
def test_tool_call_pieces_follow_all_text_before_them_in_order(policy: DeliveryPolicy):
    words = ["one ", "two ", "three ", "four ", "five "]
    entries = run(ReplyPipeline(NativeFormat(), policy), words)
    kinds = [entry.event for entry in entries]
    first_call = kinds.index("tool_call")
    text = "".join(json.loads(e.data)["text"] for e in entries if e.event == "token")
    assert text == "".join(words)  # nothing withheld past the call, nothing lost
    assert "token" not in kinds[first_call:]
    pieces = [json.loads(e.data) for e in entries if e.event == "tool_call"]
    assert [(p["index"], p["id"], p["name"], p["arguments"]) for p in pieces] == [
        tuple(piece) for piece in PIECES
    ]
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    assert json.loads(entries[-1].data) == {"finish_reason": "tool_calls"}  # it made a call


@pytest.mark.parametrize(
    "policy", [DeliveryPolicy(), DeliveryPolicy(holdback_tokens=2, batch_tokens=3)]
)
@pytest.mark.parametrize("begun", ["ST", "S"])
def test_a_tail_held_for_a_stop_string_goes_before_a_call_and_no_stop_spans_one(
    policy: DeliveryPolicy, begun: str
):
    pipeline = ReplyPipeline(NativeFormat(), policy, stops=("STOP",), prompt_estimate=1)
    entries = pipeline.start("r1")
    entries += pipeline.push(Delta("a " + begun), 0.0)
    tail_held = "".join(json.loads(e.data)["text"] for e in entries if e.event == "token")
    assert tail_held in ("", "a ")  # "ST" could begin the stop string: withheld
    for piece in PIECES:
        entries += pipeline.push(Delta("", 1, 0.0, tool_call=piece), 0.0)
    rest = "STOP"[len(begun) :]
    for word in [rest + " ", "then STOP here"]:
        entries += pipeline.push(Delta(word), 0.0)
    assert pipeline.halted  # the stop string after the call still ends the reply
    entries += pipeline.finish()
    kinds = [entry.event for entry in entries]
    first_call = kinds.index("tool_call")
    before = "".join(json.loads(e.data)["text"] for e in entries[:first_call] if e.event == "token")
    after = "".join(json.loads(e.data)["text"] for e in entries[first_call:] if e.event == "token")
    # "ST" + call + "OP" is no stop string, nor is "S" + call + "TOP".
    assert (before, after) == ("a " + begun, rest + " then ")
    # It made a call: it ends as one that did, whatever cut the text after it.
    assert json.loads(entries[-1].data) == {"finish_reason": "tool_calls"}


def test_a_banned_phrase_in_text_before_a_call_still_stops_the_reply():
    policy = DeliveryPolicy(holdback_tokens=2, checks=[BannedPhrases(["bad word"])])
    pipeline = ReplyPipeline(NativeFormat(), policy)
    entries = pipeline.start("r1")
    for word in ["fine ", "bad ", "word "]:
        entries += pipeline.push(Delta(word), 0.0)
    assert pipeline.ended and entries[-1].event == "moderated"
    assert "".join(json.loads(e.data)["text"] for e in entries if e.event == "token") == "fine "


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ([], "non-empty JSON list"),
        ([{"text": "a", "tool_call": {"name": "f"}}], "step 1 must have exactly one"),
        ([{"text": ""}], "step 1: text must be a non-empty string"),
        ([{"text": "a"}, {"tool_call": {"name": ""}}], "step 2: tool_call.name"),
        ([{"tool_call": {"name": "f", "arguments": [1]}}], "tool_call.arguments"),
        ([{"tool_call": {"name": "f", "id": 7}}], "tool_call.id"),
        ([{"tool_call": {"name": "f", "argument": "{}"}}], "unknown field 'argument'"),
        ([{"text": "a", "delay_ms": -1}], "delay_ms must be a number from 0 to below"),
        ([{"text": "a", "delay": 1}], "unknown field 'delay'"),
    ],
)
def test_a_bad_script_is_refused_naming_the_step_and_field(steps: Any, says: str):
    with pytest.raises(ScriptError, match=says):
        parse_reply_script(steps)


def test_a_script_keeps_its_fragments_exactly_and_derives_stable_ids():
    steps = [{"tool_call": {"name": "f", "arguments": ["{", '"a": 1', "}"]}, "delay_ms": 0}]
    script = parse_reply_script(steps)
    pieces = [step.tool_call for step in script.deltas]
    again = [step.tool_call for step in parse_reply_script(steps).deltas]
    assert [p.arguments for p in pieces if p is not None] == ["", "{", '"a": 1', "}"]
    assert pieces == again  # the derived id is the same in every reply
    assert pieces[0] is not None and pieces[0].id is not None and pieces[0].id.startswith("call_")
    assert script.finish_reason == "tool_calls"
    assert parse_reply_script([{"text": "hi"}]).finish_reason == "stop"


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ('[{"tool_call": {"name": "f", "arguments": [""]}}]', "step 1"),
        ("[" * 100_000, "is not JSON: nested too deeply"),  # json.loads raised RecursionError
    ],
)
def test_a_bad_script_file_is_one_line_naming_the_flag(script: str, says: str, tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(script)
    done = subprocess.run(
        [*SERVE, "--engine", "simulated", "--reply-script", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--reply-script" in lines[0] and says in lines[0], lines


ANTHROPIC_BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 5,
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any"},
    "messages": [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3 C"}],
        },
    ],
}


def test_anthropic_tools_and_blocks_become_chat_form_for_the_relay():
    body = MessagesBody.model_validate(ANTHROPIC_BODY)
    messages, _ = anthropic_messages(body.messages)
    assert messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "3 C"},
    ]
    tools, choice = anthropic_tools(body.tools, body.tool_choice)
    upstream = request_body(
        GenerationRequest("p", messages=tuple(messages), tools=tools, tool_choice=choice), "m"
    )
    assert upstream["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert upstream["tool_choice"] == "required"
    assert upstream["messages"] == messages
    assert prompt_of(messages).splitlines() == [
        "user: weather?",
        "assistant: Checking.",
        'assistant: [call t1] get_weather {"city": "Oslo"}',
        "tool [t1]: 3 C",
    ]


def test_no_tools_sends_no_tool_fields_upstream():
    assert "tools" not in request_body(GenerationRequest("p"), None)
    assert "tool_choice" not in request_body(GenerationRequest("p", tool_choice="none"), None)


def test_a_response_read_mid_call_lists_the_call_so_far():
    fmt = ResponsesStreamFormat(ResponseSettings(model="m", created_at=0))
    specs = [*fmt.started("r1"), *fmt.text("hi", 1)]
    specs += [*fmt.tool_call(PIECES[0]), *fmt.tool_call(PIECES[1])]
    entries = [LogEntry(n, event, data) for n, (event, data) in enumerate(specs, 1)]
    response = response_from_log(entries, producer_lost=False)
    assert response is not None
    call = response["output"][1]
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call",
        "call_1",
        "get_weather",
        '{"city":',
    )
    assert response["output"][0]["content"][0]["text"] == "hi"


def test_a_call_cut_by_a_lost_producer_reads_incomplete():
    # GET of a response whose producer is gone: the open item was cut, a call as a message.
    fmt = ResponsesStreamFormat(ResponseSettings(model="m", created_at=0))
    specs = [*fmt.started("r1"), *fmt.text("hi", 1), *fmt.tool_call(PIECES[0])]
    entries = [LogEntry(n, event, data) for n, (event, data) in enumerate(specs, 1)]
    for lost, status, last in (
        (False, "in_progress", "in_progress"),
        (True, "failed", "incomplete"),
    ):
        response = response_from_log(entries, producer_lost=lost)
        assert response is not None and response["status"] == status
        statuses = [(item["type"], item["status"]) for item in response["output"]]
        assert statuses == [("message", "completed"), ("function_call", last)]
