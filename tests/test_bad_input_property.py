"""Random JSON of every type and depth in every field of every route and WebSocket message:
never a 5xx, never an ERROR or a traceback in the server's log, always the API's error shape
(or a success, for a value that happens to be valid). Over a real server process, and over a
relay in front of one."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bad_input import Answer, LoggedServer, logged_server

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HOLE = "\x00hole\x00"  # where the random value goes in a body
HOLE_JSON = json.dumps(HOLE)

# JSON the standard encoder cannot make, and shapes that broke parsers before.
SPECIAL_JSON = [
    "1e400",
    "-1e400",
    "1" + "0" * 400,
    "-" + "9" * 5000,
    "NaN",
    "Infinity",
    "[" * 5000 + "]" * 5000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    '"\\ud800"',
    '"\\u0000"',
    "-0",
    "1.0",
    "0.5",
    "2",
    "true",
    "[]",
    "{}",
    '""',
    '"text"',
    '[{"type": "image_url", "image_url": {"url": "http://x"}}]',
    '[{"type": "text", "text": 5}]',
    '["user"]',
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.integers(min_value=-5, max_value=5000)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
json_text = json_values.map(json.dumps) | st.sampled_from(SPECIAL_JSON)

MESSAGE = {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"}
MESSAGE_PATHS = [
    "messages",
    "messages[0]",
    "messages[0].role",
    "messages[0].content",
    "messages[0].content[0]",
    "messages[0].content[0].type",
    "messages[0].content[0].text",
    "messages[0].name",
    "messages[0].refusal",
    "messages[0].unknown",
]
SAMPLING = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "batch_tokens",
    "batch_ms",
    "holdback_tokens",
    "keepalive_s",
    "resumable",
    "unknown_field",
]
NATIVE_FIELDS = ["", "prompt", *SAMPLING, "disconnect", *MESSAGE_PATHS]
OPENAI_FIELDS = [
    *SAMPLING,
    "model",
    "stream_options",
    "stream_options.include_usage",
    "stream_options.unknown",
    "n",
    "logprobs",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logit_bias.42",
    "metadata",
    "metadata.k",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
    "reasoning_effort",
    "verbosity",
]
CHAT_FIELDS = [
    "",
    *OPENAI_FIELDS,
    *MESSAGE_PATHS,
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "response_format.type",
    "tool_choice",
    "tools",
]
COMPLETION_FIELDS = ["", *OPENAI_FIELDS, "prompt", "prompt[0]", "echo", "best_of", "suffix"]
RESPONSES_FIELDS = [
    "",
    "model",
    "input",
    "input[0]",
    "input[0].role",
    "input[0].content",
    "input[0].content[0]",
    "input[0].content[0].type",
    "input[0].content[0].text",
    "input[0].type",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "background",
    "metadata",
    "metadata.k",
    "previous_response_id",
    "tools",
    "tool_choice",
    "user",
    "top_logprobs",
    "include",
    "replystream",
    "replystream.seed",
    "replystream.top_k",
    "replystream.stop",
    "replystream.batch_tokens",
    "replystream.batch_ms",
    "replystream.holdback_tokens",
    "replystream.keepalive_s",
    "replystream.unknown",
    "unknown_field",
]
MESSAGES_FIELDS = [
    "",
    "model",
    "max_tokens",
    "messages",
    "messages[0]",
    "messages[0].role",
    "messages[0].content",
    "messages[0].content[0]",
    "messages[0].content[0].type",
    "messages[0].content[0].text",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "metadata.user_id",
    "tools",
    "tool_choice",
    "replystream",
    "replystream.batch_tokens",
    "unknown_field",
]
COUNT_TOKENS_FIELDS = [
    "",
    "model",
    "messages",
    "messages[0]",
    "messages[0].role",
    "messages[0].content",
    "messages[0].content[0]",
    "messages[0].content[0].type",
    "messages[0].content[0].text",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "thinking.budget_tokens",
    "max_tokens",
    "unknown_field",
]
INPUT_TOKENS_FIELDS = [
    "",
    "model",
    "input",
    "input[0]",
    "input[0].role",
    "input[0].content",
    "input[0].content[0]",
    "input[0].content[0].type",
    "input[0].content[0].text",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "text",
    "text.format",
    "truncation",
    "conversation",
    "personality",
    "max_output_tokens",
    "unknown_field",
]
SOCKET_FIELDS = ["", "type", "id", *NATIVE_FIELDS[1:]]
CANCEL_FIELDS = ["", "type", "id", "unknown"]


def base_body(route: str, path: str) -> dict[str, Any]:
    """A valid body for ``route`` that has the field at ``path``, to put a random value in."""
    uses_messages = path.startswith("messages")
    if route == "/v1/replies":
        body: dict[str, Any] = {"max_tokens": 2, "stream": False}
        if uses_messages:
            body["messages"] = [copy.deepcopy(MESSAGE)]
        else:
            body["prompt"] = "hi"
        return body
    if route == "/v1/chat/completions":
        return {"messages": [copy.deepcopy(MESSAGE)], "max_tokens": 2, "stream": True}
    if route == "/v1/completions":
        return {"prompt": ["hi"], "max_tokens": 2, "stream": True}
    if route == "/v1/messages":
        message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        return {"model": "simulated", "max_tokens": 2, "messages": [message], "stream": True}
    if route == "/v1/messages/count_tokens":
        message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
        return {"model": "simulated", "messages": [message]}
    if route == "/v1/responses":
        message = {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        return {"input": [message], "max_output_tokens": 2, "stream": True}
    if route == "/v1/responses/input_tokens":
        message = {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        return {"input": [message]}
    if route == "reply":
        return {"type": "reply", "id": "t", "prompt": "hi", "max_tokens": 2} | (
            {"messages": [copy.deepcopy(MESSAGE)], "prompt": None} if uses_messages else {}
        )
    return {"type": "cancel", "id": "t"}


def with_hole(body: dict[str, Any], path: str) -> str:
    """``body`` as JSON text with ``HOLE`` at ``path`` (``a.b[0].c``; "" is the whole body)."""
    if not path:
        return HOLE_JSON
    body = copy.deepcopy(body)
    steps: list[str | int] = [
        int(part) if part.isdigit() else part for part in re.findall(r"[^.\[\]]+", path)
    ]
    target: Any = body
    for step in steps[:-1]:
        target = target.setdefault(step, {}) if isinstance(step, str) else target[step]
    if steps[-1] == "prompt" and isinstance(target, dict) and "messages" in target:
        target.pop("prompt", None)
    target[steps[-1]] = HOLE
    if body.get("prompt", "") is None:
        del body["prompt"]
    return json.dumps(body)


def assert_no_server_error(server: LoggedServer, answer: Answer, sent: object) -> None:
    assert answer.status < 500, (answer.status, answer.body[:300], sent)
    if answer.status >= 400:
        error = answer.error()
        assert error["type"] == "invalid_request_error" or answer.status in (404, 429), error
    assert server.new_log_problems() == [], sent


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    with logged_server(tmp_path_factory.mktemp("bad-input")) as running:
        yield running
        assert running.new_log_problems() == []


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    """A relay (``--engine upstream:``) in front of a fast simulated replystream: what it
    forwards is its own request, built from the client's, which the upstream checks again
    (a refusal there must reach the client as the client's own mistake, never a 5xx)."""
    with (
        logged_server(tmp_path_factory.mktemp("upstream")) as upstream,
        logged_server(
            tmp_path_factory.mktemp("relay"),
            engine=["--engine", f"upstream:{upstream.url}/v1", "--log-level", "WARNING"],
        ) as running,
    ):
        yield running
        assert running.new_log_problems() == []


def body_cases(route: str, fields: list[str]) -> st.SearchStrategy[tuple[str, str]]:
    return st.tuples(st.sampled_from(fields), json_text).map(
        lambda case: (
            case[0],
            with_hole(base_body(route, case[0]), case[0]).replace(HOLE_JSON, case[1]),
        )
    )


BODY_ROUTES = [
    ("/v1/replies", NATIVE_FIELDS),
    ("/v1/chat/completions", CHAT_FIELDS),
    ("/v1/completions", COMPLETION_FIELDS),
    ("/v1/responses", RESPONSES_FIELDS),
    ("/v1/messages", MESSAGES_FIELDS),
    ("/v1/messages/count_tokens", COUNT_TOKENS_FIELDS),
    ("/v1/responses/input_tokens", INPUT_TOKENS_FIELDS),
]


@pytest.mark.parametrize(("route", "fields"), BODY_ROUTES)
@pytest.mark.parametrize("target", ["server", "relay"])
def test_random_json_in_any_body_field_is_a_4xx_in_our_format_or_a_reply(
    request: pytest.FixtureRequest, target: str, route: str, fields: list[str]
) -> None:
    """On a server, and on a relay in front of one (``relay``)."""
    server: LoggedServer = request.getfixturevalue(target)

    @SETTINGS
    @given(body_cases(route, fields))
    def check(case: tuple[str, str]) -> None:
        _, text = case
        assert_no_server_error(server, server.post_json_text(route, text), text[:300])

    check()


raw_bytes = st.binary(max_size=64) | st.sampled_from(
    [b"\xff\xfe", b'{"prompt": "\xff"}', b'{"prompt": "x"', b"", b"\x00", b'{"prompt": "x"} x']
)


@pytest.mark.parametrize(
    "route",
    [
        "/v1/replies",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses/input_tokens",
    ],
)
def test_random_bytes_as_a_body_are_a_400_in_our_format(server: LoggedServer, route: str) -> None:
    @settings(SETTINGS, max_examples=40)
    @given(raw_bytes)
    def check(body: bytes) -> None:
        assert_no_server_error(server, server.post_json_text(route, body), body)

    check()


query_text = (
    st.text(max_size=24)
    | json_values.map(json.dumps)
    | st.sampled_from(["²", "\uff11\uff12", "1_000", " 7", "-1", "+3", "0x10", "1e3", "9" * 40, ""])
)
LAB_PARAMS = ["prompt", "seed", "max_tokens", "ids", "resumable", "unknown"]


def test_random_lab_query_values_are_a_4xx_in_our_format_or_a_reply(server: LoggedServer) -> None:
    @SETTINGS
    @given(st.sampled_from(["/wait", "/stream"]), st.sampled_from(LAB_PARAMS), query_text)
    def check(path: str, name: str, value: str) -> None:
        target = f"{path}?max_tokens=2&{name}={quote(value, safe='')}"
        assert_no_server_error(server, server.request("GET", target), target)

    check()


header_text = st.text(
    alphabet=st.characters(blacklist_categories=["Cc", "Cs"], max_codepoint=0x2FFFF), max_size=24
) | st.sampled_from(["²", "³", "٣", "1_0", "-1", "+1", "99999999999999999999999", "0", "1"])


@pytest.fixture(scope="module")
def finished_reply(server: LoggedServer) -> str:
    answer = server.post_json_text("/v1/replies", '{"prompt": "x", "resumable": true}')
    assert answer.status == 200
    found = re.search(rb'"reply_id": "([^"]+)"', answer.body)
    assert found
    return found.group(1).decode()


def test_random_last_event_ids_are_a_4xx_in_our_format_or_a_replay(
    server: LoggedServer, finished_reply: str
) -> None:
    @SETTINGS
    @given(st.booleans(), header_text, st.sampled_from([finished_reply, "no-such-reply"]))
    def check(in_header: bool, value: str, reply_id: str) -> None:
        path = f"/v1/replies/{quote(reply_id)}/stream"
        if in_header:
            answer = server.request("GET", path, headers={"Last-Event-ID": value.encode()})
        else:
            answer = server.request("GET", f"{path}?last_event_id={quote(value, safe='')}")
        assert_no_server_error(server, answer, (in_header, value))

    check()


@pytest.fixture(scope="module")
def stored_response(server: LoggedServer) -> str:
    answer = server.post_json_text("/v1/responses", '{"input": [{"role": "user", "content": "x"}]}')
    assert answer.status == 200
    found = re.search(rb'"id": ?"(resp_[^"]+)"', answer.body)
    assert found
    return found.group(1).decode()


INPUT_ITEMS_PARAMS = ["after", "before", "limit", "order", "include", "include[]", "unknown"]


def test_random_input_items_query_values_are_a_4xx_in_our_format_or_a_list(
    server: LoggedServer, stored_response: str
) -> None:
    @SETTINGS
    @given(st.lists(st.tuples(st.sampled_from(INPUT_ITEMS_PARAMS), query_text), max_size=3))
    def check(pairs: list[tuple[str, str]]) -> None:
        query = "&".join(f"{quote(name)}={quote(value, safe='')}" for name, value in pairs)
        target = f"/v1/responses/{stored_response}/input_items?{query}"
        assert_no_server_error(server, server.request("GET", target), target)

    check()


def socket_message(kind: str, fields: list[str]) -> st.SearchStrategy[str]:
    return st.tuples(st.sampled_from(fields), json_text).map(
        lambda case: with_hole(base_body(kind, case[0]), case[0]).replace(HOLE_JSON, case[1])
    )


def test_random_json_in_any_websocket_message_field_is_an_error_message_for_its_tag(
    server: LoggedServer,
) -> None:
    messages = st.lists(
        socket_message("reply", SOCKET_FIELDS) | socket_message("cancel", CANCEL_FIELDS),
        min_size=1,
        max_size=8,
    )

    @settings(SETTINGS, max_examples=25)
    @given(messages)
    def check(sent: list[str]) -> None:
        for received in server.websocket(sent):
            if received["type"] == "error":
                error = received["data"]["error"]
                assert error["code"] != "internal_error", received
                if received.get("reply_id") is None:  # about a message, not a running reply
                    assert set(error) == {"message", "type", "param", "code"}, received
                    # A cancel of a tag not running is HTTP's 404, typed as OpenAI types it.
                    assert error["type"] == "invalid_request_error", received
        assert server.new_log_problems() == [], sent

    check()
