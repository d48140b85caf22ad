"""The measuring client against deliberately broken servers: incomplete is never a result."""

import asyncio
import gc
import json
import logging
import socket
import struct

import aiohttp
import h11
import pytest
from aiohttp import web

from replystream.client import measure_reply
from replystream.engine.tiny import load_default_engine
from replystream.lab.diagnosis import diagnose
from replystream.server import create_app, running
from tests.conftest import fast_engine, serve_engine, wait_for
from tests.test_resume_reader_edges import raw_server


def broken_app() -> web.Application:
    async def cut_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("one ", "two ", "three "):
            await response.write(f"data: {json.dumps(word)}\n\n".encode())
        await response.write_eof()  # a clean end of file, but no [DONE]
        return response

    async def half_event(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: "one "\n\ndata: [DO')
        await response.write_eof()
        return response

    async def truncated_json(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"text":"half a rep')
        await response.write_eof()
        return response

    async def reset(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: "one "\n\n')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # RST-like: the connection dies mid-reply
        return response

    async def done_then_gone(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b': keep-alive\n\ndata: "hi "\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    async def html_error_page(request: web.Request) -> web.Response:
        # A proxy's answer for an upstream it could not reach, as nginx words it.
        page = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n" + " " * 200
        return web.Response(status=502, text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/cut", cut_stream)
    app.router.add_get("/half", half_event)
    app.router.add_get("/truncated", truncated_json)
    app.router.add_get("/reset", reset)
    app.router.add_get("/ok", done_then_gone)
    app.router.add_get("/html", html_error_page)
    return app


async def test_broken_replies_are_reported_incomplete_with_a_reason():
    async with running(broken_app()) as url:
        cut = await measure_reply(f"{url}/cut")
        half = await measure_reply(f"{url}/half")
        truncated = await measure_reply(f"{url}/truncated")
        reset = await measure_reply(f"{url}/reset")
        ok = await measure_reply(f"{url}/ok")
        html = await measure_reply(f"{url}/html")
    assert not cut.complete and cut.error == "stream ended without an end marker"
    assert cut.text == "one two three " and cut.tokens == 3
    assert not half.complete and half.text == "one "
    assert not truncated.complete and truncated.error and "not complete JSON" in truncated.error
    assert truncated.first_text_ms is None
    assert not reset.complete and reset.error is not None
    assert ok.complete and ok.error is None and ok.text == "hi "
    # Not JSON at all: said so, with its beginning, which names what answered.
    assert html.error == (
        "HTTP 502: body is not JSON (261 bytes, beginning"
        " '<html> <head><title>502 Bad Gateway</title></head> <body>'...)"
    )


# Nested past any parser's patience: json.loads recursed on it and raised RecursionError.
DEEP = "[" * 100_000


def deep_app() -> web.Application:
    """Each route answers with a document nested ``DEEP``, where its format keeps JSON."""

    async def stream(request: web.Request) -> web.StreamResponse:
        kind = request.match_info["kind"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        named = "" if kind == "message" else f"event: {kind}\n"
        await response.write(f"{named}data: {DEEP}\n\n".encode())
        await response.write_eof()
        return response

    async def body(request: web.Request) -> web.Response:
        return web.Response(text=DEEP, content_type="application/json")

    app = web.Application()
    app.router.add_get("/stream/{kind}", stream)
    app.router.add_get("/body", body)
    return app


@pytest.mark.parametrize(
    "route",
    [
        *(f"stream/{kind}" for kind in ("message", "token", "error", "usage")),
        *("stream/response.output_text.delta", "stream/content_block_delta", "body"),
    ],
)
async def test_json_nested_without_end_is_a_failed_reply_not_a_crash(route: str):
    async with running(deep_app()) as url:
        timing = await measure_reply(f"{url}/{route}")
    assert not timing.complete and timing.error is not None
    assert len(timing.error) < 300  # the reason, not the document


async def test_timings_are_ordered_and_count_every_event():
    async with serve_engine(fast_engine(first_token_ms=100)) as url:
        stream = await measure_reply(f"{url}/stream")
        wait = await measure_reply(f"{url}/wait")
    assert stream.complete and wait.complete
    assert stream.headers_ms is not None and stream.first_text_ms is not None
    assert stream.headers_ms < stream.first_text_ms
    assert stream.first_text_ms >= 100
    assert stream.last_text_ms is not None and stream.last_text_ms <= stream.closed_ms
    assert len(stream.text_event_ms) == 120 == stream.tokens
    assert len(stream.gaps_ms) == 119 and min(stream.gaps_ms) >= 0
    # Buffered: the first text is the last text, and it arrives with the body.
    assert wait.first_text_ms == wait.last_text_ms
    assert wait.headers_ms is not None and wait.first_text_ms is not None
    assert wait.first_text_ms >= 100 + 120 * 4
    assert wait.text == stream.text


async def test_a_timing_names_its_figures_as_doctor_and_bench_do():
    # ``first_chunk_ms`` is the first body bytes in the library as in ``doctor`` and
    # ``bench``; their ``first_byte_ms`` (the response head) is ``headers_ms``, and no field
    # named ``first_byte_ms`` is left to mean the body's bytes.
    async with serve_engine(fast_engine(first_token_ms=50)) as url:
        timing = await measure_reply(f"{url}/stream")
    assert timing.complete and timing.headers_ms is not None
    assert timing.first_chunk_ms is not None and timing.first_text_ms is not None
    assert timing.headers_ms <= timing.first_chunk_ms <= timing.first_text_ms
    assert not hasattr(timing, "first_byte_ms") and "first_byte_ms" not in timing.as_dict()
    assert timing.as_dict()["first_chunk_ms"] == timing.first_chunk_ms
    seen = diagnose(timing)
    assert (seen.first_byte_ms, seen.first_chunk_ms) == (timing.headers_ms, timing.first_chunk_ms)


async def test_a_stream_that_never_ends_times_out_as_incomplete():
    async with serve_engine(fast_engine(delay_ms=200, jitter_ms=0)) as url:
        timing = await measure_reply(f"{url}/stream", timeout_s=0.5)
    assert not timing.complete
    assert timing.error == "timed out after 0.5 s"
    assert timing.text  # what arrived before the timeout is kept, but is not a result


def test_the_servers_usage_count_is_read_from_native_and_openai_streams():
    from replystream.client.formats import interpret_event
    from replystream.sse import Event

    native = interpret_event(Event('{"prompt_tokens": 3, "completion_tokens": 9}', type="usage"))
    chunk = interpret_event(Event('{"choices": [], "usage": {"completion_tokens": 12}}'))
    assert (native.kind, native.tokens) == ("usage", 9)
    assert (chunk.kind, chunk.tokens) == ("usage", 12)


@pytest.mark.parametrize("usage_with", ["finish", "last text"])
async def test_usage_in_the_chunk_of_the_finish_or_the_last_text_is_the_count(usage_with: str):
    # llama.cpp's server once sent its usage so, with no usage chunk of its own: the count
    # was then the text events (6), not the 30 tokens they carried.
    usage = {"prompt_tokens": 3, "completion_tokens": 30}

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(6):
            choice = {"index": 0, "delta": {"content": f"w{n} " * 5}, "finish_reason": None}
            chunk: dict[str, object] = {"choices": [choice]}
            if n == 5 and usage_with == "last text":
                chunk["usage"] = usage
            await response.write(b"data: %s\n\n" % json.dumps(chunk).encode())
        finish: dict[str, object] = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]
        }
        if usage_with == "finish":
            finish["usage"] = usage
        await response.write(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(finish).encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with running(app) as url:
        timing = await measure_reply(
            f"{url}/v1/chat/completions", method="POST", json_body={"messages": []}
        )
    assert timing.complete and timing.tokens == 30
    assert len(timing.text_event_ms) == 6


async def test_tokens_come_from_usage_when_events_carry_several_each():
    async with serve_engine(fast_engine(delay_ms=1, jitter_ms=0)) as url:
        timing = await measure_reply(
            f"{url}/v1/replies",
            method="POST",
            json_body={"prompt": "x", "max_tokens": 10, "batch_tokens": 4},
        )
    assert timing.complete and timing.tokens == 10
    assert len(timing.text_event_ms) == 3


async def test_a_responses_stream_is_counted_by_the_usage_its_last_event_gives():
    async with serve_engine(fast_engine(delay_ms=1, jitter_ms=0)) as url:
        timing = await measure_reply(
            f"{url}/v1/responses",
            method="POST",
            json_body={
                "input": "x",
                "max_output_tokens": 10,
                "stream": True,
                "replystream": {"batch_tokens": 4},
            },
        )
    assert timing.complete and timing.tokens == 10  # in three events
    assert len(timing.text_event_ms) == 3


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_of_several_choices_is_read_as_its_first_choice_alone(route: str):
    # With n=2 every chunk carries one choice, index 0 or 1: the text read is choice 0's, as
    # a whole body's is, not the two interleaved.
    asked: dict[str, object] = (
        {"messages": [{"role": "user", "content": "x"}]} if "chat" in route else {"prompt": "x"}
    )
    body = {**asked, "max_tokens": 6, "n": 2}
    async with serve_engine(fast_engine(delay_ms=1, jitter_ms=0)) as url:
        streamed = await measure_reply(
            f"{url}{route}", method="POST", json_body={**body, "stream": True}
        )
        whole = await measure_reply(f"{url}{route}", method="POST", json_body=body)
    assert streamed.complete and whole.complete
    assert streamed.text == whole.text == "A language model does not write "
    assert len(streamed.text_event_ms) == 6


async def test_a_buffered_body_is_counted_by_its_usage_not_its_words():
    # The tiny model's tokens are pieces of words: a word count is no token count.
    body = {"prompt": "Once upon a time", "max_tokens": 20, "seed": 3, "stream": False}
    async with running(create_app(load_default_engine())) as url:
        timing = await measure_reply(f"{url}/v1/replies", method="POST", json_body=body)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/replies", json=body) as response:
                usage = (await response.json())["usage"]
    assert timing.complete
    assert timing.tokens == usage["completion_tokens"] != len(timing.text.split())


@pytest.mark.parametrize("stream", [True, False])
async def test_an_anthropic_message_is_read_streamed_or_whole_and_counted_by_its_usage(stream):
    body = {
        "model": "simulated",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "x"}],
        "stream": stream,
    }
    async with serve_engine(fast_engine(delay_ms=1, jitter_ms=0)) as url:
        timing = await measure_reply(f"{url}/v1/messages", method="POST", json_body=body)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/messages", json={**body, "stream": False}) as got:
                whole = await got.json()
    assert timing.complete, timing.error
    assert timing.tokens == whole["usage"]["output_tokens"] == 10
    assert timing.text == whole["content"][0]["text"]  # the simulated engine's fixed reply


async def test_credentials_in_a_url_are_refused_not_sent_in_the_host_header():
    with pytest.raises(ValueError, match="credentials in the URL are not sent"):
        await measure_reply("http://user:secret@127.0.0.1:9/stream")


async def test_a_head_that_arrives_after_its_wait_was_cancelled_is_dropped_quietly():
    # Ctrl-C or a timeout cancels the wait for the head, and with it the head's future; a
    # read already queued in that turn still hands the head over before the socket closes.
    from replystream.client.transport import _ResponseProtocol

    protocol = _ResponseProtocol(asyncio.get_running_loop())
    protocol.conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    protocol.response_head().cancel()
    protocol.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert protocol.ended and protocol.error is None


async def test_connections_closed_unused_leave_no_failure_nobody_reads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The lab opens its connections before any request; when one of them cannot be opened,
    # the others close unused, or the server resets them (out of sockets itself). Neither
    # may leave asyncio a failed future to report on stderr as never retrieved.
    from replystream.client.transport import connect

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        linger = struct.pack("ii", 1, 0)  # closed at once: a reset, not an orderly close
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        writer.transport.abort()

    server = await asyncio.start_server(reset, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        connections = [await connect(url) for _ in range(4)]
        connections[0].close()
        for _ in range(50):  # the server's resets reach the others
            if all(c.protocol.error is not None for c in connections):
                break
            await asyncio.sleep(0.01)
        assert all(c.protocol.error is not None for c in connections)
        for connection in connections:
            connection.close()
        del connections
        gc.collect()
    server.close()
    await server.wait_closed()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"", "the server closed the connection before answering"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Ty",
            "the server closed the connection within its answer's head, begun "
            "b'HTTP/1.1 200 OK\\r\\nContent-Ty'",
        ),
        (  # a TLS alert, as a server that speaks https answers a request in plain text
            b"\x15\x03\x01\x00\x02\x02\x46",
            "the answer is not an HTTP/1.1 response: it begins b'\\x15\\x03\\x01\\x00\\x02\\x02F' "
            "(a TLS record: the server speaks https)",
        ),
        (
            b"SSH-2.0-OpenSSH_9.2\r\n",
            "the answer is not an HTTP/1.1 response: it begins b'SSH-2.0-OpenSSH_9.2\\r\\n'",
        ),
    ],
    ids=["nothing", "half a head", "TLS", "another protocol"],
)
async def test_an_answer_with_no_http_head_is_said_for_what_it_is(answer: bytes, said: str):
    async with raw_server(lambda n: (answer, False)) as (url, _):
        timing = await measure_reply(url, timeout_s=30)
    assert timing.error == f"read failed: {said}" and timing.status is None


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (70_000, None),  # a long Content-Security-Policy, many cookies: a browser takes it
        (300_000, "the answer's head is longer than 262144 bytes, the most read"),
    ],
)
async def test_a_long_response_head_is_read_up_to_a_browsers_bound(header: int, said: str | None):
    # Its head coming in reads of 4 KiB, a head past h11's own 16 KiB was "not an HTTP/1.1
    # response"; up to 256 KiB is read, and a longer one is said to be that.
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Long: %s\r\n" % (b"a" * header)
    answer = head + b'Content-Length: 13\r\n\r\n{"text":"hi"}'

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            for start in range(0, len(answer), 4096):
                writer.write(answer[start : start + 4096])
                await writer.drain()
                await asyncio.sleep(0)  # a read of its own for each piece
        except ConnectionError:
            pass  # the client hung up on a head too long
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    timing = await measure_reply(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/")
    server.close()
    await server.wait_closed()
    assert timing.error == (None if said is None else f"read failed: {said}")
    assert timing.complete == (said is None)


async def test_a_connection_given_for_a_second_request_is_refused_in_our_words():
    # A Connection carries one request (it asks the server to close after the answer): a
    # second is a ValueError naming the misuse, not h11's "can't handle event type Request".
    from replystream.client.transport import connect

    async with serve_engine(fast_engine(delay_ms=1)) as url:
        connection = await connect(url)
        first = await measure_reply(f"{url}/stream?max_tokens=3", connection=connection)
        with pytest.raises(ValueError, match=r"already carried a request .* connect\(\)"):
            await measure_reply(f"{url}/stream?max_tokens=3", connection=connection)
    assert first.complete


@pytest.mark.parametrize("reset", [False, True])
async def test_a_connection_the_server_let_go_before_its_request_is_a_failed_reply(reset: bool):
    # Opened ahead of its request (as the lab opens them), the connection was closed by the
    # server meanwhile, orderly or by a reset: the reply failed, saying so (it was h11's
    # LocalProtocolError raised out of measure_reply, which never raises for a failed reply).
    from replystream.client.transport import connect

    async def let_go(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if reset:
            linger = struct.pack("ii", 1, 0)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        writer.close()

    server = await asyncio.start_server(let_go, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/stream"
    connection = await connect(url)
    await wait_for(connection.transport.is_closing)
    timing = await measure_reply(url, connection=connection)
    server.close()
    await server.wait_closed()
    assert not timing.complete and timing.status is None
    assert timing.error == "read failed: the connection was closed before the request was sent"


async def test_a_stream_held_open_after_its_end_marker_is_a_whole_reply():
    # The end marker came, then nothing, the connection kept open (a server that leaves the
    # reader to hang up, as an EventSource or the OpenAI SDK does at [DONE]): the reply is
    # whole, ended there, and not a time-out.
    events = b'data: "hi"\n\ndata: [DONE]\n\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    answer = head + b"\r\n%x\r\n%s\r\n" % (len(events), events)
    async with raw_server(lambda n: (answer, True)) as (url, _):
        timing = await measure_reply(url, timeout_s=5)
    assert timing.complete and timing.error is None and timing.text == "hi"
    assert timing.closed_ms < 4000


async def test_a_url_written_with_spaces_and_letters_past_ascii_is_sent_percent_encoded():
    # Such a URL raised h11's "Illegal target characters" (or UnicodeEncodeError) out of
    # measure_reply; it goes percent-encoded, as browsers send it, and an encoded one as is.
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    answer = head + b'{"text":"hi"}'
    heads: list[bytes] = []
    async with raw_server(lambda n: (answer, False), heads) as (url, _):
        timing = await measure_reply(f"{url}/a b/ü?q=ä ö&x=%41")
    assert timing.complete, timing.error
    assert heads[0].startswith(b"GET /a%20b/%C3%BC?q=%C3%A4%20%C3%B6&x=%41 HTTP/1.1\r\n")


async def test_a_host_header_given_replaces_the_clients_own():
    # A name served at another address (a virtual host behind a load balancer): it was sent
    # beside the client's own Host, two Host headers, which servers refuse.
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    heads: list[bytes] = []
    async with raw_server(lambda n: (head + b'{"text":"hi"}', False), heads) as (url, _):
        timing = await measure_reply(url, headers={"host": "replies.example"})
    assert timing.complete
    hosts = [line for line in heads[0].split(b"\r\n") if line.lower().startswith(b"host:")]
    assert hosts == [b"host: replies.example"]
