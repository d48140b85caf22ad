"""Each bad input that was a 500 with a traceback in the log, now a 4xx in the API's error
shape naming the field, with nothing at ERROR in the log. Over a real server process."""

from __future__ import annotations

import gzip
import json
import socket
import zlib
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from tests.bad_input import Answer, LoggedServer, logged_server

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    with logged_server(tmp_path_factory.mktemp("regressions")) as running:
        yield running


@pytest.fixture(autouse=True)
def log_stays_clean(server: LoggedServer) -> Iterator[None]:
    server.new_log_problems()
    yield
    assert server.new_log_problems() == []


def refused(answer: Answer, status: int, code: str, param: str | None) -> str:
    assert answer.status == status, answer.body[:300]
    error = answer.error()
    assert (error["code"], error["param"]) == (code, param), error
    return str(error["message"])


@pytest.mark.parametrize(
    ("route", "field", "body"),
    [
        ("/v1/replies", "temperature", {"prompt": "x"}),
        ("/v1/replies", "batch_ms", {"prompt": "x"}),
        ("/v1/replies", "keepalive_s", {"prompt": "x"}),
        ("/v1/chat/completions", "top_p", {"messages": USER}),
        ("/v1/chat/completions", "presence_penalty", {"messages": USER}),
        ("/v1/completions", "frequency_penalty", {"prompt": "x"}),
    ],
)
def test_an_integer_too_large_for_a_float_is_a_400_naming_the_field(
    server: LoggedServer, route: str, field: str, body: dict[str, object]
) -> None:
    text = json.dumps(body)[:-1] + f', "{field}": 1{"0" * 400}}}'
    message = refused(server.post_json_text(route, text), 400, "invalid_value", field)
    assert len(message) < 200  # the 401-digit number is not echoed whole


@pytest.mark.parametrize("route", ["/v1/replies", "/v1/chat/completions", "/v1/completions"])
# Short ids: a test's id is in PYTEST_CURRENT_TEST, which a server started for it inherits,
# and an environment value past 128 KiB stops any process from starting (E2BIG).
@pytest.mark.parametrize(
    "shape", ["[" * 100_000, '{"prompt": ' * 50_000], ids=["arrays", "objects"]
)
def test_json_nested_past_the_parser_limit_is_invalid_json(
    server: LoggedServer, route: str, shape: str
) -> None:
    refused(server.post_json_text(route, shape), 400, "invalid_json", None)


@pytest.mark.parametrize("route", ["/v1/replies", "/v1/chat/completions"])
@pytest.mark.parametrize("role", [["user"], {"r": 1}, 5, None])
def test_a_message_role_of_the_wrong_type_is_a_400_naming_it(
    server: LoggedServer, route: str, role: object
) -> None:
    body = json.dumps({"messages": [{"role": role, "content": "x"}]})
    refused(server.post_json_text(route, body), 400, "invalid_value", "messages[0].role")


@pytest.mark.parametrize("text", [5, None, ["a"], {"t": "a"}])
def test_non_string_text_in_a_content_part_is_a_400_naming_it(
    server: LoggedServer, text: object
) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})
    param = "messages[0].content[0].text"
    refused(server.post_json_text("/v1/replies", body), 400, "invalid_value", param)
    refused(server.post_json_text("/v1/chat/completions", body), 400, "invalid_value", param)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_is_not_its_declared_content_encoding_is_a_400(
    server: LoggedServer, encoding: str
) -> None:
    plain = b'{"prompt": "x", "stream": false}'
    answer = server.post_json_text("/v1/replies", plain, **{"Content-Encoding": encoding})
    refused(answer, 400, "invalid_content_encoding", None)
    # A body cut short after a good start, and a large one that fails part way.
    good = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    cut = good[: len(good) // 2] + b"\x00" * 64
    answer = server.post_json_text("/v1/replies", cut, **{"Content-Encoding": encoding})
    assert answer.status == 400 and answer.error()["code"] in ("invalid_content_encoding",)
    # 16 KiB: it has all arrived before the answer, so the close cannot reset it.
    large = good[:10] + bytes(range(256)) * 64
    answer = server.post_json_text("/v1/replies", large, **{"Content-Encoding": encoding})
    refused(answer, 400, "invalid_content_encoding", None)
    # The encoding itself is honoured.
    answer = server.post_json_text("/v1/replies", good, **{"Content-Encoding": encoding})
    assert answer.status == 200 and json.loads(answer.body)["finish_reason"]


@pytest.mark.parametrize("encoding", ["compress", "x-unknown", "gzip, gzip", "identity;q=1"])
def test_a_content_encoding_the_server_does_not_decode_is_a_415(
    server: LoggedServer, encoding: str
) -> None:
    body = b'{"prompt": "x", "stream": false}'
    answer = server.post_json_text("/v1/replies", body, **{"Content-Encoding": encoding})
    refused(answer, 415, "unsupported_content_encoding", None)


@pytest.mark.parametrize("value", ["²", "³", "٣", "\uff11", "1_0", "-1", "+1", "9" * 20, "1.0"])
@pytest.mark.parametrize("where", ["header", "query"])
def test_a_last_event_id_that_is_not_ascii_digits_is_a_400(
    server: LoggedServer, value: str, where: str
) -> None:
    started = server.post_json_text("/v1/replies", '{"prompt": "x", "resumable": true}')
    reply_id = started.body.split(b'"reply_id": "')[1].split(b'"')[0].decode()
    path = f"/v1/replies/{reply_id}/stream"
    if where == "header":
        answer = server.request("GET", path, headers={"Last-Event-ID": value.encode()})
    else:
        answer = server.request("GET", f"{path}?last_event_id={quote(value, safe='')}")
    refused(answer, 400, "invalid_value", "last_event_id")


def started_reply(server: LoggedServer) -> str:
    """The id of a resumable reply run to its end: reply, three tokens, usage, done (1-6)."""
    started = server.post_json_text("/v1/replies", '{"prompt": "x", "resumable": true}')
    return started.body.split(b'"reply_id": "')[1].split(b'"')[0].decode()


def event_ids(body: bytes) -> list[int]:
    return [int(line[4:]) for line in body.decode().splitlines() if line.startswith("id: ")]


Headers = list[tuple[str, str | bytes]]


@pytest.mark.parametrize(
    ("query", "headers", "param"),
    [
        ("last_event_id=3&last_event_id=2", [], "last_event_id"),
        ("last_event_id=3&last_event_id=3", [], "last_event_id"),
        ("", [("Last-Event-ID", "3"), ("Last-Event-ID", "2")], "last_event_id"),
        ("last_event_id=4", [("Last-Event-ID", "2")], "last_event_id"),
    ],
)
def test_an_ambiguous_resume_point_is_a_400_naming_it(
    server: LoggedServer, query: str, headers: Headers, param: str
) -> None:
    path = f"/v1/replies/{started_reply(server)}/stream?{query}"
    refused(server.request("GET", path, headers=headers), 400, "invalid_value", param)


@pytest.mark.parametrize(
    ("query", "headers", "param"),
    [
        ("starting_after=3&starting_after=2", [], "starting_after"),
        # A sequence number is one below its event's id: 3 and 3 are two places.
        ("starting_after=3&last_event_id=3", [], "last_event_id"),
        ("starting_after=2", [("Last-Event-ID", "2")], "starting_after"),
        ("", [("Last-Event-ID", "3"), ("Last-Event-ID", "2")], "last_event_id"),
        ("stream=true", [], "stream"),
    ],
)
def test_an_ambiguous_responses_cursor_is_a_400_naming_it(
    server: LoggedServer, query: str, headers: Headers, param: str
) -> None:
    created = server.post_json_text("/v1/responses", '{"input": "x"}')
    path = f"/v1/responses/{json.loads(created.body)['id']}?stream=true&{query}"
    refused(server.request("GET", path, headers=headers), 400, "invalid_value", param)


def test_a_header_before_a_sequence_number_quotes_both_as_event_ids(server: LoggedServer) -> None:
    created = server.post_json_text("/v1/responses", '{"input": "x"}')
    path = f"/v1/responses/{json.loads(created.body)['id']}?stream=true&starting_after=2"
    answer = server.request("GET", path, headers={"Last-Event-ID": "2"})
    message = refused(answer, 400, "invalid_value", "starting_after")
    assert message == (
        "Last-Event-ID 2 is before starting_after 2 (event id 3): two places to resume from; "
        "give one"
    )


def test_a_sequence_number_and_its_event_id_are_one_responses_cursor(
    server: LoggedServer,
) -> None:
    created = server.post_json_text("/v1/responses", '{"input": "x"}')
    path = f"/v1/responses/{json.loads(created.body)['id']}?stream=true"
    both = server.request("GET", f"{path}&starting_after=2&last_event_id=3")
    header = server.request("GET", f"{path}&starting_after=2", headers={"Last-Event-ID": "3"})
    alone = server.request("GET", f"{path}&starting_after=2")
    assert both.status == header.status == alone.status == 200
    assert event_ids(both.body)[0] == 4 and both.body == header.body == alone.body
    assert b'"sequence_number":3,' in alone.body.split(b"\n\n")[0]


def test_a_header_after_the_query_cursor_is_where_an_event_source_resumes(
    server: LoggedServer,
) -> None:
    # An EventSource opened at ?last_event_id=2 reconnects to the same URL with the last id
    # it got since in the header: that is where it resumes.
    path = f"/v1/replies/{started_reply(server)}/stream?last_event_id=2"
    answer = server.request("GET", path, headers={"Last-Event-ID": "4"})
    assert answer.status == 200 and event_ids(answer.body) == [5, 6]
    assert event_ids(server.request("GET", path).body) == [3, 4, 5, 6]
    # A blank header says nothing: it does not hide the query's cursor.
    blank = server.request("GET", path, headers={"Last-Event-ID": ""})
    assert event_ids(blank.body) == [3, 4, 5, 6]


def test_a_lab_query_parameter_given_twice_is_a_400_naming_it(server: LoggedServer) -> None:
    refused(server.request("GET", "/stream?seed=1&seed=2"), 400, "invalid_value", "seed")
    assert server.request("GET", "/wait?max_tokens=2&other=1&other=2").status == 200


@pytest.mark.parametrize("query", ["seed=%C2%B2", "max_tokens=1_0", "seed=" + "9" * 30, "ids=2"])
def test_a_lab_query_number_that_is_not_ascii_digits_in_range_is_a_400(
    server: LoggedServer, query: str
) -> None:
    answer = server.request("GET", f"/stream?{query}")
    refused(answer, 400, "invalid_value", query.split("=")[0])


def test_an_image_content_part_is_refused_naming_its_type(server: LoggedServer) -> None:
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    answer = server.post_json_text("/v1/chat/completions", json.dumps(body))
    message = refused(answer, 400, "invalid_value", "messages[0].content[1].type")
    assert "image_url" in message


def test_stream_options_without_a_stream_is_refused(server: LoggedServer) -> None:
    for stream in ("false", "null"):
        text = f'{{"messages": {json.dumps(USER)}, "stream": {stream}, '
        text += '"stream_options": {"include_usage": true}}'
        answer = server.post_json_text("/v1/chat/completions", text)
        refused(answer, 400, "invalid_value", "stream_options")
    answer = server.post_json_text("/v1/completions", '{"prompt": "x", "stream_options": {}}')
    refused(answer, 400, "invalid_value", "stream_options")


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", False), ("echo", 0), ("n", True), ("best_of", 1.0), ("max_tokens", True)],
)
def test_a_bool_is_not_a_number_and_a_number_is_not_a_bool(
    server: LoggedServer, field: str, value: object
) -> None:
    body = json.dumps({"prompt": "x", field: value})
    refused(server.post_json_text("/v1/completions", body), 400, "invalid_value", field)


@pytest.mark.parametrize(
    ("text", "half"),
    [
        ("\\ud83d", "\\ud83d"),  # an emoji cut after its first half
        ("x \\ud83d y", "\\ud83d"),
        ("\\ude00 y", "\\ude00"),  # ... or before its second
        ("\\ud83d\\u0041", "\\ud83d"),
    ],
)
def test_a_lone_surrogate_in_a_string_is_invalid_json_said_as_half_a_character(
    server: LoggedServer, text: str, half: str
) -> None:
    # JSON's grammar takes the escape (a JavaScript client writes one for text cut in the
    # middle of an emoji); the parser's own words ("unexpected end of hex escape") did not
    # say what is wrong with it.
    answer = server.post_json_text("/v1/replies", f'{{"prompt": "{text}", "stream": false}}')
    message = refused(answer, 400, "invalid_json", None)
    assert f"{half} is half of a character" in message, message
    chat = f'{{"model": "m", "messages": [{{"role": "user", "content": "{text}"}}]}}'
    message = refused(
        server.post_json_text("/v1/chat/completions", chat), 400, "invalid_json", None
    )
    assert "half of a character" in message, message
    whole = '{"prompt": "\\ud83d\\ude00", "stream": false, "max_tokens": 2}'
    assert server.post_json_text("/v1/replies", whole).status == 200  # a pair is a character


def test_a_websocket_message_nested_past_the_parser_limit_is_an_error_for_that_message(
    server: LoggedServer,
) -> None:
    deep = "[" * 100_000
    tagged_deep = '{"type": "reply", "id": "t1", "prompt": ' + "[" * 100_000
    good = json.dumps({"type": "reply", "id": "ok", "prompt": "x"})
    received = server.websocket([deep, tagged_deep, good])
    errors = [m for m in received if m["type"] == "error"]
    assert errors[0]["id"] is None and errors[0]["data"]["error"]["code"] == "invalid_json"
    assert errors[1]["id"] is None and errors[1]["data"]["error"]["code"] == "invalid_json"
    assert [m["type"] for m in received if m["id"] == "ok"][-1] == "done"


def test_a_websocket_reply_with_a_bad_nested_field_is_an_error_for_its_tag(
    server: LoggedServer,
) -> None:
    bad_role = json.dumps({"type": "reply", "id": "a", "messages": [{"role": [], "content": ""}]})
    bad_text = json.dumps(
        {"type": "reply", "id": "b", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    )
    huge = '{"type": "reply", "id": "c", "prompt": "x", "temperature": 1' + "0" * 400 + "}"
    received = server.websocket([bad_role, bad_text, huge])
    params = {m["id"]: m["data"]["error"]["param"] for m in received if m["type"] == "error"}
    assert params["a"] == "messages[0].role"
    assert params["b"] == "messages[0].content[0].text"
    assert params["c"] == "temperature"


def test_a_setting_the_route_cannot_honour_is_refused_not_ignored(server: LoggedServer) -> None:
    body = '{"prompt": "x", "stream": false, "disconnect": "detach"}'
    refused(server.post_json_text("/v1/replies", body), 400, "invalid_value", "disconnect")
    refused(server.request("GET", "/wait?resumable=1"), 400, "invalid_value", "resumable")
    refused(server.request("GET", "/stream?ids=0&resumable=1"), 400, "invalid_value", "resumable")
    assert server.request("GET", "/stream?ids=0&resumable=0&max_tokens=2").status == 200
    assert server.request("GET", "/wait?resumable=0&max_tokens=2").status == 200


def test_a_detached_reply_nobody_may_resume_is_refused_naming_disconnect(
    server: LoggedServer,
) -> None:
    ask = {"prompt": "x", "resumable": False, "disconnect": "detach"}
    answer = server.post_json_text("/v1/replies", json.dumps(ask))
    assert "resumable" in refused(answer, 400, "invalid_value", "disconnect")
    received = server.websocket([json.dumps({"type": "reply", "id": "d", **ask})])
    (error,) = [m for m in received if m["id"] == "d"]
    assert error["type"] == "error"
    assert (error["data"]["error"]["code"], error["data"]["error"]["param"]) == (
        "invalid_value",
        "disconnect",
    )
    # The OpenAI routes have no disconnect policy of their own: the field is refused there.
    for route, body in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        openai_ask = {**body, "stream": True, "resumable": True, "disconnect": "detach"}
        answer = server.post_json_text(route, json.dumps(openai_ask))
        refused(answer, 400, "unknown_parameter", "disconnect")


@pytest.mark.parametrize(
    ("route", "text", "param"),
    [
        ("/v1/replies", '{"prompt": "x", "stream": false, "prompt": "y"}', "prompt"),
        (
            "/v1/replies",
            '{"messages": [{"role": "user", "content": "a", "content": "b"}], "stream": false}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "temperature": 0}',
            "temperature",
        ),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "max_tokens": 3}', "max_tokens"),
        (
            "/v1/responses",
            '{"input": "x", "text": {"verbosity": "low", "verbosity": "high"}}',
            "text.verbosity",
        ),
        (
            "/v1/messages",
            '{"model": "simulated", "max_tokens": 3, "max_tokens": 4, "messages": '
            '[{"role": "user", "content": "hi"}]}',
            "max_tokens",
        ),
    ],
)
def test_a_field_named_twice_is_a_400_naming_it(
    server: LoggedServer, route: str, text: str, param: str
) -> None:
    message = refused(server.post_json_text(route, text), 400, "invalid_value", param)
    assert param in message


def test_a_websocket_reply_naming_a_field_twice_is_an_error_for_its_tag(
    server: LoggedServer,
) -> None:
    twice = '{"type": "reply", "id": "t", "prompt": "x", "max_tokens": 2, "max_tokens": 3}'
    received = server.websocket([twice])
    (error,) = [m for m in received if m["id"] == "t"]
    assert error["type"] == "error"
    assert error["data"]["error"]["param"] == "max_tokens"


def test_two_different_token_limits_on_chat_are_a_400_naming_max_tokens(
    server: LoggedServer,
) -> None:
    body = {"messages": USER, "max_tokens": 1, "max_completion_tokens": 3, "stream": False}
    answer = server.post_json_text("/v1/chat/completions", json.dumps(body))
    assert "max_completion_tokens" in refused(answer, 400, "invalid_value", "max_tokens")
    agreeing = {**body, "max_tokens": 3}  # the same limit twice says one thing
    answer = server.post_json_text("/v1/chat/completions", json.dumps(agreeing))
    assert answer.status == 200 and json.loads(answer.body)["usage"]["completion_tokens"] == 3


def calls(*ids: str) -> dict[str, object]:
    """An assistant message making a call of ``f`` with each id."""
    made = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": made}


def result(call_id: str) -> dict[str, str]:
    return {"role": "tool", "tool_call_id": call_id, "content": "r"}


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([*USER, calls("c1", "c1"), result("c1")], "messages[1]", "two tool calls"),
        ([*USER, calls("c1"), result("c1"), result("c1")], "messages[3]", "answered twice"),
    ],
)
def test_a_tool_call_made_or_answered_twice_is_a_400_naming_its_message(
    server: LoggedServer, messages: list[object], param: str, says: str
) -> None:
    body = json.dumps({"messages": messages})
    assert says in refused(
        server.post_json_text("/v1/chat/completions", body), 400, "invalid_value", param
    )


def test_a_tool_result_given_twice_on_messages_is_a_400(server: LoggedServer) -> None:
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    answer = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
    turns = [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [answer]}]
    body = {"model": "simulated", "max_tokens": 3, "messages": turns}
    assert server.post_json_text("/v1/messages", json.dumps(body)).status == 200
    turns[-1] = {"role": "user", "content": [answer, answer]}
    refusal = server.post_json_text("/v1/messages", json.dumps(body))
    assert refusal.status == 400 and "answered twice" in refusal.error()["message"]


def test_a_call_id_made_again_in_a_later_turn_is_that_turns_call(server: LoggedServer) -> None:
    # Engines that number a reply's calls make the same id every turn.
    turns = [*USER, calls("call_1"), result("call_1"), calls("call_1"), result("call_1")]
    answer = server.post_json_text("/v1/chat/completions", json.dumps({"messages": turns}))
    assert answer.status == 200, answer.body


MESSAGES_ASK = {"model": "simulated", "max_tokens": 3, "messages": USER}


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/replies", {"prompt": "x", "foo": 1}, "foo"),
        ("/v1/replies", {"messages": [{**USER[0], "foo": 1}]}, "messages[0].foo"),
        ("/v1/messages", {**MESSAGES_ASK, "foo": 1}, "foo"),
        ("/v1/messages", {**MESSAGES_ASK, "messages": [{**USER[0], "foo": 1}]}, "messages[0].foo"),
        ("/v1/chat/completions", {"messages": USER, "foo": 1}, "foo"),
        ("/v1/completions", {"prompt": "x", "foo": 1}, "foo"),
        ("/v1/responses", {"input": "x", "foo": 1}, "foo"),
    ],
)
def test_an_unknown_field_is_unknown_parameter_on_every_route(
    server: LoggedServer, route: str, body: dict[str, object], param: str
) -> None:
    refused(server.post_json_text(route, json.dumps(body)), 400, "unknown_parameter", param)


def test_an_unknown_field_of_a_websocket_reply_is_unknown_parameter(server: LoggedServer) -> None:
    received = server.websocket([json.dumps({"type": "reply", "id": "a", "prompt": "x", "foo": 1})])
    error = next(m["data"]["error"] for m in received if m["type"] == "error")
    assert (error["code"], error["param"]) == ("unknown_parameter", "foo")


@pytest.mark.parametrize(
    ("route", "body", "code", "param"),
    [
        (
            "/v1/messages",
            {"model": "simulated", "messages": USER},
            "missing_required_parameter",
            "max_tokens",
        ),
        (
            "/v1/messages",
            {"model": "simulated", "max_tokens": 3},
            "missing_required_parameter",
            "messages",
        ),
        # A nested object's field is not a request parameter: its value is what is wrong.
        (
            "/v1/messages",
            {**MESSAGES_ASK, "messages": [{"role": "user"}]},
            "invalid_value",
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"model": "simulated"}, "missing_required_parameter", "messages"),
    ],
)
def test_a_missing_field_is_missing_required_parameter_on_every_route(
    server: LoggedServer, route: str, body: dict[str, object], code: str, param: str
) -> None:
    refused(server.post_json_text(route, json.dumps(body)), 400, code, param)


@pytest.mark.parametrize(
    ("choice", "param", "says"),
    [
        ("sometimes", "tool_choice", "'none', 'auto' or 'required'"),
        ({"type": "function"}, "tool_choice.name", "is required"),
        ({"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice.type", "function"),
        (3, "tool_choice", "an object naming a function"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions"])
def test_a_bad_tool_choice_names_what_is_wrong_with_it(
    server: LoggedServer, route: str, choice: object, param: str, says: str
) -> None:
    """A mode's name and an object naming a tool are told apart first, so the error is the
    branch's own (not the other branch's field, nor a path through the union)."""
    body: dict[str, object] = {"input": "x", "tool_choice": choice}
    if route == "/v1/chat/completions":
        body = {"messages": USER, "tool_choice": choice}
        param = param.replace("tool_choice.name", "tool_choice.function")
    message = refused(server.post_json_text(route, json.dumps(body)), 400, "invalid_value", param)
    assert says in message


@pytest.mark.parametrize(
    ("metadata", "param", "says"),
    [
        ({"k" * 65: "v"}, "metadata", "a key of metadata must have at most 64 character"),
        ({"k": "v" * 513}, "metadata.k", "metadata.k must have at most 512 character"),
        ({str(i): "v" for i in range(17)}, "metadata", "at most 16 item"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions"])
def test_metadata_past_openais_limits_is_a_400(
    server: LoggedServer, route: str, metadata: dict[str, str], param: str, says: str
) -> None:
    body: dict[str, object] = {"input": "x", "metadata": metadata}
    if route == "/v1/chat/completions":
        body = {"messages": USER, "metadata": metadata}
    message = refused(server.post_json_text(route, json.dumps(body)), 400, "invalid_value", param)
    assert says in message
    within = {"k" * 64: "v" * 512}
    assert server.post_json_text(route, json.dumps({**body, "metadata": within})).status == 200


@pytest.mark.parametrize(
    ("method", "route", "status"),
    [
        ("GET", "/v1/models", 200),
        ("HEAD", "/healthz", 200),
        ("POST", "/v1/no-such-route", 404),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/v1/messages/no-such-route", 404),
    ],
)
def test_a_body_not_in_its_encoding_on_a_route_that_reads_no_body_logs_no_traceback(
    server: LoggedServer, method: str, route: str, status: int
) -> None:
    # The route answers without reading the body; the undecodable body must not then be
    # logged as an unhandled exception (the autouse fixture checks the log), whether it
    # came with the head or after it.
    headers: dict[str, str | bytes] = {"Content-Encoding": "gzip"}
    answer = server.request(method, route, b'{"not": "compressed"}', headers)
    assert answer.status == status
    host, port = server.host_port
    with socket.create_connection((host, port), timeout=10) as sock:
        head = f"{method} {route} HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        sock.sendall(f"{head}Content-Length: 21\r\n\r\n".encode())
        first = sock.recv(65536)
        sock.sendall(b'{"not": "compressed"}')
        rest = b"".join(iter(lambda: sock.recv(65536), b""))  # the connection then ends
    assert first.startswith(f"HTTP/1.1 {status} ".encode()), first[:100]
    assert rest == b""


@pytest.mark.parametrize(
    "body",
    [
        b'{"not": "compressed"}',  # read as raw deflate, it never ends
        zlib.compress(b'{"prompt": "x", "stream": false}')[:-4],  # cut before its checksum
        zlib.compress(b'{"prompt": "x", "stream": false}')[:12],
    ],
)
def test_a_deflate_body_that_ends_before_its_stream_is_a_400_not_an_unknown_coding(
    server: LoggedServer, body: bytes
) -> None:
    # deflate is a coding the server decodes: the fault is the body, not the coding.
    answer = server.post_json_text("/v1/replies", body, **{"Content-Encoding": "deflate"})
    message = refused(answer, 400, "invalid_content_encoding", None)
    assert "not one this server decodes" not in message


def test_x_gzip_is_decoded_as_gzip(server: LoggedServer) -> None:
    # x-gzip is gzip's old name (RFC 9110, 8.4.1.3): accepted, so decoded, not read as JSON.
    plain = b'{"prompt": "x", "stream": false, "max_tokens": 1}'
    headers = {"Content-Encoding": "x-gzip"}
    answer = server.post_json_text("/v1/replies", gzip.compress(plain), **headers)
    assert answer.status == 200, answer.body[:300]
    two_members = gzip.compress(plain[:10]) + gzip.compress(plain[10:])
    assert server.post_json_text("/v1/replies", two_members, **headers).status == 200
    cut = gzip.compress(plain)[:-6]
    refused(
        server.post_json_text("/v1/replies", cut, **headers), 400, "invalid_content_encoding", None
    )
    bomb = gzip.compress(b'{"prompt": "' + b"x" * 3_000_000 + b'"}')
    answer = server.post_json_text("/v1/replies", bomb, **headers)
    assert answer.status == 413 and answer.error()["code"] == "body_too_large"


@pytest.mark.parametrize(
    "fields", [["gzip", "gzip"], ["gzip", "identity"], ["identity", "gzip"], ["x-gzip", "gzip"]]
)
def test_content_encoding_in_several_fields_is_read_as_one_list(
    server: LoggedServer, fields: list[str]
) -> None:
    # Two fields are the list "a, b" (RFC 9110, 5.3): refused as that line would be, not
    # decoded by one of them and read as JSON, or decoded once where twice was said.
    body = gzip.compress(b'{"prompt": "x", "stream": false, "max_tokens": 1}')
    headers: list[tuple[str, str | bytes]] = [("Content-Type", "application/json")]
    headers += [("Content-Encoding", field) for field in fields]
    answer = server.request("POST", "/v1/replies", body, headers)
    refused(answer, 415, "unsupported_content_encoding", None)
