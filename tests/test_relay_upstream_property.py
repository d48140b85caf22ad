"""Whatever an upstream sends, the relay's client gets JSON and its dialect's errors: never a
500, never a traceback, never a value JSON cannot carry, never more tokens than it asked for.

A relay (``replystream serve --engine upstream:URL``, a real process whose log is read)
stands in front of a raw upstream on a loopback socket that answers each request with the
event stream of one example: mostly well-made chunks of text, among them chunks whose every
field may hold any JSON value, log probabilities of NaN and infinities as Python servers
write them, numbers past a float's range, ``[DONE]`` early or never, error events, comments.
The client asks for log probabilities, so they are relayed, and on chat for fewer tokens than
most examples send, which the upstream ignores. Then whole answers: any status (and some no
status is), odd headers, a length the body does not have, chunked or closed framing, an error
object of any shape or bytes for a body. Any value may be a document nested past the
interpreter's recursion limit.
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replystream.sse import EventParser
from tests.bad_input import LoggedServer, logged_server

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": MESSAGES, "stream": True, "logprobs": True, "top_logprobs": 2}
# The chat route's token limit: below what most examples' upstreams send, so the relay cuts
# them there, whatever comes around the cut.
MOST = 3
# Each route the relay serves: its path, a streamed request asking for log probabilities where
# it has them, and the events a stream ends with (a last ``data: [DONE]`` is "[DONE]").
ROUTES = {
    "chat": (
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": True}, "max_tokens": MOST},
        {"[DONE]", "error"},
    ),
    "completions": (
        "/v1/completions",
        {"model": "m", "prompt": "hi", "stream": True, "logprobs": 2},
        {"[DONE]", "error"},
    ),
    "responses": (
        "/v1/responses",
        {"model": "m", "input": "hi", "stream": True, "top_logprobs": 2}
        | {"include": ["message.output_text.logprobs"]},
        {"response.completed", "response.incomplete", "response.failed", "error"},
    ),
    "messages": (
        "/v1/messages",
        {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 64},
        {"message_stop", "error"},
    ),
    "native": ("/v1/replies", {"messages": MESSAGES}, {"done", "error"}),
}


class Upstream(socketserver.ThreadingTCPServer):
    """Answers a chat request with ``answer`` as it is (a whole response, when set) or with
    ``body`` as its event stream, and a probe with a model."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.body = b""
        self.answer: bytes | None = None


class _Answer(socketserver.StreamRequestHandler):
    server: Upstream

    def handle(self) -> None:
        request_line = self.rfile.readline()
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        self.rfile.read(length)
        chat = b"/chat/completions" in request_line
        if chat and self.server.answer is not None:
            self.wfile.write(self.server.answer)
            return
        body, kind = (
            (self.server.body, "text/event-stream") if chat else (MODELS, "application/json")
        )
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        self.wfile.write(head.encode() + body)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def relay(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoggedServer]:
    """The relay in front of ``upstream``; a failing upstream never opens its circuit here."""
    port = upstream.server_address[1]
    engine = ["--engine", f"upstream:http://127.0.0.1:{port}/v1", "--log-level", "WARNING"]
    with logged_server(
        tmp_path_factory.mktemp("relay"), "--upstream-failures", "1000000", engine=engine
    ) as server:
        yield server


# Numbers JSON has no float for (json.dumps writes the first three), and what Python alone
# takes for a number.
ODD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400, "-0", "true"]
# Documents nested past the interpreter's recursion limit, closed and not.
DEEP = ["[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000, "[" * 5000]
value = st.one_of(
    st.sampled_from(ODD_NUMBERS),
    st.sampled_from(DEEP),
    st.sampled_from(["null", "false", "[]", "{}", '""', '"stop"', '"length"', '"abort"']),
    st.integers(min_value=-3, max_value=3).map(str),
    st.floats().map(lambda number: json.dumps(number)),
    st.text(max_size=6).map(json.dumps),
)
absent = st.none()


def mostly(
    usual: st.SearchStrategy[str | None], odd: st.SearchStrategy[str | None]
) -> st.SearchStrategy[str | None]:
    """``usual`` four times in five (and as examples shrink): a stream wholly odd would end
    at its first chunk, and nothing after it would be read."""
    return st.sampled_from(range(5)).flatmap(lambda n: odd if n == 4 else usual)


def obj(**fields: str | None) -> str:
    """A JSON object's text from fields' texts; a field whose text is None is left out."""
    return "{" + ",".join(f'"{k}":{v}' for k, v in fields.items() if v is not None) + "}"


def array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


word = st.sampled_from(["a", "b c", " d", "é"]).map(json.dumps)
candidate = st.builds(
    obj,
    token=mostly(word, value),
    logprob=st.sampled_from(["-0.5", "-2"]) | value,
    bytes=mostly(absent, st.sampled_from(["[97]", "[300]", "[]"]) | value),
)
entry = st.builds(
    obj,
    token=mostly(word, value),
    logprob=st.just("-0.25") | value,
    bytes=mostly(absent, value),
    top_logprobs=mostly(st.lists(candidate, max_size=3).map(array), absent | value),
)
logprobs = mostly(
    st.builds(obj, content=mostly(st.lists(entry, max_size=3).map(array), value)), absent | value
)
tool_call = st.builds(
    obj,
    index=mostly(st.just("0"), absent | value),
    id=mostly(st.just('"c1"'), absent | value),
    function=mostly(
        st.builds(obj, name=mostly(word, absent | value), arguments=mostly(word, value)),
        absent | value,
    ),
)
delta = st.builds(
    obj,
    role=absent | st.just('"assistant"'),
    content=mostly(word, absent | value),
    reasoning_content=mostly(absent, word | value),
    tool_calls=mostly(absent, st.lists(tool_call, max_size=2).map(array) | value),
)
choice = st.builds(
    obj,
    index=mostly(st.just("0"), absent | value),
    delta=mostly(delta, value),
    logprobs=logprobs,
    finish_reason=mostly(absent | st.just("null"), value),
)
usage = st.builds(
    obj,
    completion_tokens=mostly(st.just("3"), value),
    prompt_tokens=mostly(st.just("4"), absent | value),
    prompt_tokens_details=mostly(absent, st.builds(obj, cached_tokens=value)),
)
# A chunk as an upstream should send it, one token of text with its log probability, but for
# that number now and then (NaN, an infinity, past a float, a bool: what Python servers write).
well_made = st.builds(
    lambda text, logprob: obj(
        choices=array(
            [
                obj(
                    index="0",
                    delta=obj(content=text),
                    logprobs=obj(content=array([obj(token=text, logprob=logprob)])),
                )
            ]
        )
    ),
    word,
    mostly(st.just("-0.5"), st.sampled_from(ODD_NUMBERS)),
)
odd_chunk = st.builds(
    obj,
    choices=mostly(st.lists(choice, min_size=1, max_size=2).map(array), value),
    usage=mostly(absent, usage | value),
    error=mostly(absent, value),
)
# Mostly well made, so a stream goes on past an odd chunk as often as it ends at one.
chunk = mostly(well_made, odd_chunk)
chunks = st.lists(chunk.map(lambda text: f"data: {text}\n\n"), min_size=1, max_size=8)
# Now and then one of these at a random place among the chunks.
extra = st.sampled_from(["data: [DONE]\n\n", ": keep-alive\n\n"]) | value.map(
    lambda text: f"event: error\ndata: {text}\n\n"
)
# Most examples end as a reply should, so what comes after an odd chunk is exercised too.
ending = st.sampled_from(
    ['data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n', ""]
)


@st.composite
def bodies(draw: st.DrawFn) -> str:
    events = draw(chunks)
    if draw(st.integers(0, 3)) == 0:
        events.insert(draw(st.integers(0, len(events))), draw(extra))
    return "".join(events) + draw(ending)


def strict(data: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a relayed event: {data[:200]}")

    return json.loads(data, parse_constant=refuse)


@pytest.mark.parametrize("route", ROUTES)
@SETTINGS
@given(body=bodies())
def test_any_upstream_stream_reaches_the_client_as_json_ending_as_its_dialect_ends(
    upstream: Upstream, relay: LoggedServer, route: str, body: str
) -> None:
    path, ask, endings = ROUTES[route]
    upstream.body, upstream.answer = body.encode(), None
    answer = relay.post_json_text(path, json.dumps(ask))
    if answer.status != 200:  # failed before the first text: the upstream's failure, named
        error = answer.error()
        assert 500 < answer.status < 600, (answer.status, error)
        assert error["code"].startswith("upstream"), error
    else:
        events = EventParser().feed(answer.body)
        payloads = [strict(e.data) for e in events if e.data != "[DONE]"]
        assert payloads and b"internal_error" not in answer.body, answer.body[-300:]
        last = events[-1]
        assert (last.data if last.data == "[DONE]" else last.type) in endings, events[-3:]
        errors = [e for e in events if e.type == "error"]
        assert errors in ([], [last]), errors  # one at most, and nothing after it
        if route == "chat":  # each chunk of text or a call is a token at least
            made = [c for p in payloads if isinstance(p, dict) for c in p.get("choices", [])]
            delta = [c["delta"] for c in made]
            assert sum(bool(d.get("content") or d.get("tool_calls")) for d in delta) <= MOST
    assert relay.new_log_problems() == []


STATUSES = [200, 201, 204, 304, 400, 401, 404, 413, 422, 429, 500, 502, 503, 504, 599, 99, 1000]
# No Retry-After (its reading has tests of its own): an upstream that asks for a wait is left
# alone that long, and every later example would see only that.
HEADERS = [
    "Content-Encoding: gzip",
    "Content-Encoding: identity",
    "Content-Type: application/json",
    "Content-Type: text/html",
    "Content-Type: text/event-stream; charset=latin-1",
    "Content-Type: TEXT/EVENT-STREAM",
    "X-Odd: \x01",
]
# What a refusal's body may be: an error object of any shape, any value, or bytes.
refusals = st.one_of(
    st.builds(obj, error=mostly(st.builds(obj, message=value, code=value, type=value), value)),
    st.builds(obj, object=st.just('"error"'), message=value, code=value),
    value,
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
)


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """A whole HTTP response: a status, headers and framing any server may send."""
    status = draw(st.just(200) | st.sampled_from(STATUSES))  # a stream half the time
    text = draw(bodies() if status == 200 else refusals | bodies())
    body = text.encode("utf-8", "surrogatepass")
    headers = ["Content-Type: text/event-stream" if status == 200 else ""]
    headers += draw(st.lists(st.sampled_from(HEADERS), max_size=2))
    framing = draw(st.sampled_from(["length", "chunked", "close", "short", "long"]))
    if framing == "chunked":
        headers.append("Transfer-Encoding: chunked")
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    elif framing != "close":  # "short" and "long": a length the body does not have
        length = len(body) + {"length": 0, "short": -1, "long": 7}[framing]
        headers.append(f"Content-Length: {max(0, length)}")
    head = f"HTTP/1.1 {status} Reason\r\n" + "".join(f"{h}\r\n" for h in headers if h)
    return (head + "Connection: close\r\n\r\n").encode("latin-1") + body


@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
@SETTINGS
@given(answer=answers())
def test_any_upstream_answer_is_told_in_the_clients_dialect(
    upstream: Upstream, relay: LoggedServer, route: str, answer: bytes
) -> None:
    path, ask, endings = ROUTES[route]
    upstream.answer = answer
    got = relay.post_json_text(path, json.dumps(ask))
    if got.status != 200:
        error = got.error()  # our error shape, in the dialect's envelope
        assert 400 <= got.status < 600 and got.status != 500, (got.status, error)
        assert error["code"] != "internal_error", error
    else:
        events = EventParser().feed(got.body)
        assert all(strict(e.data) is not None for e in events if e.data != "[DONE]")
        last = events[-1]
        assert (last.data if last.data == "[DONE]" else last.type) in endings, events[-3:]
        assert b"internal_error" not in got.body, got.body[-300:]
    assert relay.new_log_problems() == []


def test_a_well_made_stream_through_the_stand_in_is_relayed_whole(
    upstream: Upstream, relay: LoggedServer
) -> None:
    """The property's ground: a stream as an upstream should send it reaches the client."""
    top = '{"token":"a","logprob":-0.5,"top_logprobs":[{"token":"a","logprob":-0.5}]}'
    text = f'{{"index":0,"delta":{{"content":"a"}},"logprobs":{{"content":[{top}]}}}}'
    finish = '{"index":0,"delta":{},"finish_reason":"stop"}'
    usage = '{"completion_tokens":1,"prompt_tokens":4}'
    upstream.body = (
        f'data: {{"choices":[{text}]}}\n\ndata: {{"choices":[{finish}]}}\n\n'
        f'data: {{"choices":[],"usage":{usage}}}\n\ndata: [DONE]\n\n'
    ).encode()
    upstream.answer = None
    path, ask, _ = ROUTES["chat"]
    answer = relay.post_json_text(path, json.dumps(ask))
    assert answer.status == 200, answer.body
    payloads = [strict(e.data) for e in EventParser().feed(answer.body) if e.data != "[DONE]"]
    choices = [c for p in payloads if isinstance(p, dict) for c in p["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "a"
    assert [c["logprobs"]["content"][0]["logprob"] for c in choices if c.get("logprobs")] == [-0.5]
    assert isinstance(payloads[-1], dict) and payloads[-1]["usage"]["completion_tokens"] == 1
    assert relay.new_log_problems() == []
