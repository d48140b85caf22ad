"""The resuming reader at the edges: each dialect's end, a silent connection, a ``retry``
sent alone, a server that is gone, ids that are no numbers, and proxy prefixes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from email.utils import formatdate

import pytest

from replystream.client import ResumeFailed, ResumingReader, measure_reply
from replystream.client.resume import Backoff, resume_url
from replystream.server import create_app, running
from replystream.server.guard_config import GuardConfig
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.services import free_port

FAST = Backoff(base_s=0.001, cap_s=0.002, max_attempts=2)
HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Reply-Id: R1\r\n"
    b"Connection: close\r\n\r\n"
)
ENDED = b"HTTP/1.1 409 Conflict\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

# The n-th connection's answer: bytes to write, and whether to keep the connection open
# (and silent) after them rather than close it.
Answer = Callable[[int], tuple[bytes, bool]]


@asynccontextmanager
async def raw_server(
    answer: Answer, heads: list[bytes] | None = None
) -> AsyncIterator[tuple[str, list[int]]]:
    """A server that reads a request head (kept in ``heads``, if given) and answers its n-th
    connection with ``answer(n)``."""
    served: list[int] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        served.append(len(served))
        head = await reader.readuntil(b"\r\n\r\n")
        if heads is not None:
            heads.append(head)
        data, stay_open = answer(served[-1])
        writer.write(data)
        await writer.drain()
        if stay_open:
            await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", served
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


def closing(first: bytes, later: bytes = ENDED) -> Answer:
    """``first`` on the first connection, ``later`` on every other; each then closed."""
    return lambda n: (first if n == 0 else later, False)


async def read_all(reader: ResumingReader) -> list[str]:
    async with asyncio.timeout(30):
        return [event.type async for event in reader.events()]


async def test_a_responses_stream_read_to_its_end_needs_no_reconnect():
    body = {"input": "x", "max_output_tokens": 50, "stream": True, "background": True}
    async with running(create_app(fast_engine(delay_ms=1, reply_text="one two three"))) as url:
        reader = ResumingReader(f"{url}/v1/responses", json_body=body, backoff=FAST)
        types = await read_all(reader)
    assert types[-1] == "response.completed"
    assert reader.finished and reader.reconnects == 0


@pytest.mark.parametrize(
    "last", [b"event: message_stop\ndata: {}\n\n", b"event: response.failed\ndata: {}\n\n"]
)
async def test_a_dialects_last_event_ends_the_read_even_when_the_server_is_gone_after(last):
    async with raw_server(closing(HEAD + b"id: 1\ndata: {}\n\n" + last, b"")) as (url, served):
        reader = ResumingReader(url, backoff=FAST)
        await read_all(reader)
    assert reader.finished and served == [0]


async def test_a_connection_that_goes_silent_counts_as_dropped_and_is_resumed():
    # The first connection sends an event, then nothing, and stays open.
    def answer(n: int) -> tuple[bytes, bool]:
        return (HEAD + b"id: 1\ndata: {}\n\n", True) if n == 0 else (ENDED, False)

    async with raw_server(answer) as (url, served):
        reader = ResumingReader(url, backoff=FAST, idle_timeout_s=0.3)
        started = time.monotonic()
        await read_all(reader)
    assert reader.finished and reader.reconnects == 1 and reader.last_event_id == "1"
    assert time.monotonic() - started >= 0.3 and served == [0, 1]


async def test_a_server_that_never_answers_gives_up_naming_the_silence():
    def answer(n: int) -> tuple[bytes, bool]:
        return (HEAD, False) if n == 0 else (b"", True)  # then: no head at all

    async with raw_server(answer) as (url, _):
        reader = ResumingReader(url, backoff=FAST, idle_timeout_s=0.2)
        with pytest.raises(ResumeFailed, match=r"the last: no response head within 0\.2 s"):
            await read_all(reader)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 100\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n7\r\n",
    ],
)
async def test_a_refusal_whose_body_stops_fails_within_the_idle_timeout(head: bytes):
    # The answer to the resume: a refusal (or no event stream) whose body starts, then stops
    # and stays open. Its status decides; its body is only quoted, as far as it came.
    def answer(n: int) -> tuple[bytes, bool]:
        return (HEAD + b"id: 1\ndata: {}\n\n", False) if n == 0 else (head + b"partial", True)

    async with raw_server(answer) as (url, served):
        reader = ResumingReader(url, backoff=FAST, idle_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(ResumeFailed, match=r"^HTTP (500|200): partial$"):
            await read_all(reader)
    assert time.monotonic() - started < 5 and served == [0, 1]


@pytest.mark.parametrize("status", [b"201 Created", b"206 Partial Content", b"302 Found"])
async def test_an_event_stream_answered_with_another_status_than_200_is_no_stream(status):
    head = HEAD.replace(b"200 OK", status)
    async with raw_server(closing(head + b"id: 1\ndata: {}\n\n")) as (url, served):
        reader = ResumingReader(url, backoff=FAST)
        with pytest.raises(ResumeFailed, match=rf"^HTTP {status[:3].decode()}: "):
            await read_all(reader)
    assert served == [0]


async def test_a_retry_sent_without_an_event_sets_the_wait_before_the_resume():
    async with raw_server(closing(HEAD + b"retry: 400\n\n")) as (url, _):
        reader = ResumingReader(url, backoff=FAST)
        started = time.monotonic()
        await read_all(reader)
    assert reader.finished and reader.reconnects == 1
    assert time.monotonic() - started >= 0.4


BUSY = b"HTTP/1.1 503 Busy\r\nRetry-After: %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize(
    "answers",
    [
        [HEAD + b"retry: 99999999999999\n\n"],  # about three thousand years
        [HEAD + b"id: 1\ndata: {}\n\n", BUSY % (b"9" * 400)],  # a number no float holds
        [HEAD + b"id: 1\ndata: {}\n\n", BUSY % b"86400"],  # a day
    ],
    ids=["retry field", "Retry-After past a float", "Retry-After of a day"],
)
async def test_a_wait_the_server_asks_for_is_bounded(answers: list[bytes]):
    script = [*answers, ENDED]
    async with raw_server(lambda n: (script[min(n, len(script) - 1)], False)) as (url, served):
        reader = ResumingReader(url, backoff=Backoff(0.001, 0.002, 5, server_wait_cap_s=0.3))
        started = time.monotonic()
        await read_all(reader)
    assert reader.finished and len(served) == len(script)
    assert 0.3 <= time.monotonic() - started < 10  # one wait, at the bound


async def test_giving_up_says_why():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ResumeFailed, match=r"never arrived, so it cannot be resumed: cannot"):
        await read_all(ResumingReader(url, backoff=FAST))
    async with raw_server(closing(HEAD + b"id: 1\ndata: {}\n\n", b"")) as (url, _):
        with pytest.raises(ResumeFailed, match=r"gave up after 2 attempts; the last: "):
            await read_all(ResumingReader(url, backoff=FAST))


async def test_a_reader_told_to_try_a_thousand_times_and_more_gives_up_in_its_words():
    # The reply's server is gone for good (nothing listens): every resume fails at once.
    reader = ResumingReader(
        f"http://127.0.0.1:{free_port()}/v1/replies",
        backoff=Backoff(base_s=1e-6, cap_s=1e-6, max_attempts=1030),
    )
    reader.reply_id, reader.last_event_id = "R1", "3"
    with pytest.raises(ResumeFailed, match=r"gave up after 1030 attempts; the last: cannot"):
        await read_all(reader)
    assert reader.reconnects == 1030


async def test_ids_that_are_no_numbers_and_a_malformed_reply_event_do_not_break_the_read():
    stream = b"id: \xc2\xb9\ndata: {}\n\nevent: reply\ndata: nope\n\nevent: done\ndata: {}\n\n"
    async with raw_server(closing(HEAD + stream)) as (url, _):
        reader = ResumingReader(url, backoff=FAST)
        types = await read_all(reader)
    assert types == ["message", "reply", "done"] and reader.finished


def last_event_id(head: bytes) -> bytes | None:
    """The ``Last-Event-ID`` a request head sent (its bytes), or None."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"last-event-id":
            return value.strip()
    return None


async def test_an_event_numbered_0_is_read_and_resumed_after():
    # The SSE standard's ids are any string: ``0`` is one (a server counting from 0 sends it).
    script = [
        HEAD + b"id: 0\ndata: zero\n\n",
        HEAD + b"id: 1\ndata: one\n\nevent: done\ndata: {}\n\n",
    ]
    heads: list[bytes] = []
    async with raw_server(lambda n: (script[n], False), heads) as (url, served):
        reader = ResumingReader(url, backoff=FAST)
        async with asyncio.timeout(30):
            events = [(event.id, event.data) async for event in reader.events()]
    assert events == [("0", "zero"), ("1", "one"), ("1", "{}")]
    assert [last_event_id(head) for head in heads] == [None, b"0"] and served == [0, 1]


async def test_ids_that_are_no_numbers_are_sent_back_and_the_event_resumed_after_not_repeated():
    # The resume sends the last id as it came (UTF-8, as an EventSource does); the server
    # starts again with the event it resumes after (as some do), which is not yielded twice.
    first = "id: a7f3\ndata: one\n\nid: é-2\ndata: two\n\n".encode()
    again = "id: é-2\ndata: two\n\nid: z\ndata: three\n\nevent: done\ndata: {}\n\n".encode()
    script = [HEAD + first, HEAD + again]
    heads: list[bytes] = []
    async with raw_server(lambda n: (script[n], False), heads) as (url, _):
        reader = ResumingReader(url, backoff=FAST)
        async with asyncio.timeout(30):
            events = [(event.id, event.data) async for event in reader.events()]
    assert events == [("a7f3", "one"), ("é-2", "two"), ("z", "three"), ("z", "{}")]
    assert last_event_id(heads[1]) == "é-2".encode() and reader.last_event_id == "z"


async def test_a_server_that_ignores_the_last_event_id_is_given_up_on():
    # Each answer starts the reply again, its events' ids no numbers: the event resumed after
    # comes back each time, which is no progress, so attempts run out.
    answer = HEAD + b"id: x1\ndata: one\n\n"
    async with raw_server(lambda n: (answer, False)) as (url, served):
        reader = ResumingReader(url, backoff=FAST)
        got: list[str] = []
        with pytest.raises(ResumeFailed, match=r"gave up after 2 attempts"):
            async with asyncio.timeout(10):
                async for event in reader.events():
                    got.append(event.data)
    assert got == ["one"] and len(served) == 3


async def test_an_id_of_thousands_of_digits_is_an_id_like_any():
    # ``int`` refuses a string of more than 4,300 digits; the ids are compared without it.
    big = b"9" * 5000
    bigger = b"1" + b"0" * 5000
    script = [
        HEAD + b"id: " + big + b"\ndata: one\n\n",
        HEAD + b"id: " + big + b"\ndata: one\n\nid: " + bigger + b"\ndata: two\n\n"
        b"event: done\ndata: {}\n\n",
    ]
    heads: list[bytes] = []
    async with raw_server(lambda n: (script[n], False), heads) as (url, _):
        reader = ResumingReader(url, backoff=FAST)
        async with asyncio.timeout(30):
            events = [event.data async for event in reader.events()]
    assert events == ["one", "two", "{}"] and last_event_id(heads[1]) == big


async def test_headers_given_in_any_spelling_replace_the_readers_own_and_are_sent_once():
    # ``content-type`` beside the reader's ``Content-Type`` went twice, and the server refused
    # the request (400 malformed_request); a resume's Last-Event-ID is the reader's own.
    given = {
        "content-type": "application/json; charset=utf-8",
        "accept": "text/event-stream",
        "last-event-id": "99",
    }
    body = {"prompt": "hi", "max_tokens": 3}
    async with running(create_app(fast_engine(delay_ms=1))) as url:
        reader = ResumingReader(f"{url}/v1/replies", json_body=body, headers=given, backoff=FAST)
        assert (await read_all(reader))[-1] == "done"
    script = [HEAD + b"id: 1\ndata: {}\n\n", HEAD + b"event: done\ndata: {}\n\n"]
    heads: list[bytes] = []
    async with raw_server(lambda n: (script[n], False), heads) as (url, _):
        await read_all(ResumingReader(url, json_body=body, headers=given, backoff=FAST))
    for head in heads:
        names = [line.partition(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line]
        assert len(names) == len(set(names)), head
    assert b"content-type: application/json; charset=utf-8\r\n" in heads[0]
    assert last_event_id(heads[1]) == b"1"


ROUTES = ["/v1/replies", "/stream", "/v1/chat/completions", "/v1/completions", "/v1/responses"]


@pytest.mark.parametrize("route", [*ROUTES, "/v1/messages"])
def test_a_resume_url_keeps_a_proxys_prefix_for_every_route(route: str):
    assert resume_url(f"https://h/api{route}", "R 1") == "https://h/api/v1/replies/R%201/stream"


async def test_a_responses_reply_past_a_mebibyte_is_read_whole_and_a_bound_is_not_retried():
    # 600 words of 2,000 characters: the closing events repeat the whole 1.2 MB reply, each
    # one event. Read to its end by default; past a bound the reader sets, it fails at once
    # (each resume would send the same event again).
    engine = fast_engine(reply_text=("r" * 2000 + " ") * 600, delay_ms=0, jitter_ms=0)
    body = {"input": "x", "max_output_tokens": 600, "stream": True, "background": True}
    async with running(create_app(engine)) as url:
        reader = ResumingReader(f"{url}/v1/responses", json_body=body, backoff=FAST)
        events = [event async for event in reader.events()]
        timing = await measure_reply(f"{url}/v1/responses", method="POST", json_body=body)
        bounded = ResumingReader(
            f"{url}/v1/responses", json_body=body, backoff=FAST, max_event_size=1 << 20
        )
        with pytest.raises(
            ResumeFailed, match=r"larger than this reader takes \(.*max_event_size=1048576"
        ):
            await read_all(bounded)
    assert events[-1].type == "response.completed" and reader.reconnects == 0
    text = "".join(json.loads(e.data)["delta"] for e in events if e.type.endswith("text.delta"))
    assert len(text) == 600 * 2001 and timing.complete and timing.text == text
    assert bounded.reconnects == 0


async def test_a_refused_first_request_tells_its_status_and_wait_for_the_program_to_act_on():
    config = ServerConfig(guard=GuardConfig(per_minute=1))
    async with running(create_app(fast_engine(delay_ms=1), config)) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        first = ResumingReader(f"{url}/v1/chat/completions", json_body=body, backoff=FAST)
        await read_all(first)
        second = ResumingReader(f"{url}/v1/chat/completions", json_body=body, backoff=FAST)
        with pytest.raises(ResumeFailed) as refused:
            await read_all(second)
    assert refused.value.status == 429
    assert refused.value.retry_after_s is not None and 0 < refused.value.retry_after_s <= 60


async def test_giving_up_on_refused_resumes_tells_the_last_refusal():
    busy = BUSY % b"0"
    async with raw_server(closing(HEAD + b"id: 1\ndata: {}\n\n", busy)) as (url, served):
        with pytest.raises(ResumeFailed, match=r"HTTP 503") as refused:
            await read_all(ResumingReader(url, backoff=FAST))
    assert (refused.value.status, refused.value.retry_after_s) == (503, 0.0)
    assert len(served) == 3
    async with raw_server(closing(HEAD + b"id: 1\ndata: {}\n\n", b"")) as (url, _):
        with pytest.raises(ResumeFailed) as dropped:
            await read_all(ResumingReader(url, backoff=FAST))
    assert (dropped.value.status, dropped.value.retry_after_s) == (None, None)
    async with raw_server(
        closing(
            HEAD + b"id: 1\ndata: {}\n\n",
            b"HTTP/1.1 404 Gone\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
    ) as (url, _):
        with pytest.raises(ResumeFailed, match="is gone") as gone:
            await read_all(ResumingReader(url, backoff=FAST))
    assert gone.value.status == 404


def http_date_in(seconds: float) -> bytes:
    """An IMF-fixdate ``seconds`` from now, as a proxy writes a ``Retry-After``."""
    return formatdate(time.time() + seconds, usegmt=True).encode()


async def test_a_retry_after_given_as_a_date_is_told_as_the_seconds_until_it():
    refusal = BUSY.replace(b"503 Busy", b"429 Too Many Requests") % http_date_in(30)
    async with raw_server(closing(refusal)) as (url, _):
        with pytest.raises(ResumeFailed) as refused:
            await read_all(ResumingReader(url, backoff=FAST))
    assert refused.value.status == 429
    # A date is whole seconds: 29 to 30 from when it was written.
    assert refused.value.retry_after_s is not None and 28 <= refused.value.retry_after_s <= 30


async def test_a_resume_refused_with_a_date_waits_until_it():
    answers = [HEAD + b"id: 1\ndata: {}\n\n", BUSY % http_date_in(2), ENDED]
    async with raw_server(lambda n: (answers[min(n, 2)], False)) as (url, served):
        reader = ResumingReader(url, backoff=Backoff(0.001, 0.002, 5))
        started = time.monotonic()
        await read_all(reader)
    assert reader.finished and len(served) == 3
    # The date is whole seconds, so the wait is 1 to 2 s: at least 1, not the backoff's
    # milliseconds that a date taken as absent leaves.
    assert time.monotonic() - started >= 0.9


async def test_an_id_in_a_block_without_data_is_the_one_resumed_after():
    # The standard sets the last event ID string at every blank line, before it looks for
    # data: an EventSource resumes after ``7`` here, though no event carried it.
    heads: list[bytes] = []
    first = HEAD + b"id: 5\ndata: x\n\nid: 7\n\n"
    async with raw_server(closing(first), heads) as (url, _):
        reader = ResumingReader(url, backoff=FAST)
        assert await read_all(reader) == ["message"]
    assert reader.finished and reader.last_event_id == "7"
    assert [last_event_id(head) for head in heads] == [None, b"7"]
