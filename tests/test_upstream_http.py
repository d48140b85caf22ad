"""The relay's own HTTP/1.1 client (``engine/upstream_http.py``) over real loopback servers.

Raw asyncio servers here write exactly the bytes each test needs (and count the connections
they accept), so the tests pin what a relay's upstream connection must do beyond what an
aiohttp upstream shows: one connection serving replies in turn, a connection the upstream
closed while idle not used (and a request on one closed as it went sent once more), one
idle past its keep-alive time closed rather than reused, a body
that ends with its connection, responses split at every byte (inside a chunk-size line,
between CR and LF), interim (1xx) responses skipped, TLS verified against a CA made here
with the host name sent as SNI, and a reader that falls behind pausing the connection's
reading until it catches up.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from replystream.engine.base import GenerationRequest
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_chunks import UpstreamStreamError
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.engine.upstream_http import HttpOrigin
from replystream.engine.upstream_http_failures import PeerClosed
from replystream.engine.upstream_refusals import UpstreamUnavailable
from replystream.engine.upstream_stream import UpstreamStream
from tests.conftest import wait_for
from tests.test_bench_tls import make_certificates
from tests.test_upstream_faults import chunk

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
WORDS = ["one ", "two ", "three "]
SSE = b"".join(chunk(word) for word in WORDS) + chunk(None, "stop") + b"data: [DONE]\n\n"


def chunked(*pieces: bytes) -> bytes:
    """``pieces`` in HTTP chunked framing, with the terminator."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head and Content-Length body) off ``reader``; None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@asynccontextmanager
async def raw_server(
    handle: Handler, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[list[int], str]]:
    """A loopback server running ``handle(reader, writer, connection number)`` per connection;
    yields the list of accepted connection numbers and its base URL."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            await handle(reader, writer, accepted[-1])
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield accepted, f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1"


def engine_for(url: str, **config: float) -> UpstreamEngine:
    return UpstreamEngine(UpstreamConfig((UpstreamTarget(url),), model="m", **config))  # type: ignore[arg-type]


async def reply_of(engine: UpstreamEngine) -> tuple[str, str | None]:
    """One relayed attempt read to its end: its text and finish reason."""
    backend = engine.pool.plan(None)[0]
    stream = await engine.open_attempt(backend, GenerationRequest("hi"))
    deltas = [delta async for delta in stream]
    return "".join(d.text for d in deltas), deltas[-1].finish_reason


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    """Answers every request on the connection with the reply, chunked, keeping it open."""
    while await read_request(reader) is not None:
        writer.write(HEAD + chunked(SSE))
        await writer.drain()


async def test_one_connection_serves_replies_in_turn():
    async with raw_server(keep_alive) as (accepted, url):
        engine = engine_for(url)
        for _ in range(3):
            assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()
    assert accepted == [0]


async def test_connections_opened_and_idle_are_counted_per_upstream():
    """What /metrics shows of an upstream's connections: opened since start, idle now. One
    kept alive serves every reply; one that closes after each makes a connection a reply."""

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(HEAD + chunked(SSE))
        await writer.drain()

    for handler, opened, idle in [(keep_alive, 1, 1), (closing, 3, 0)]:
        async with raw_server(handler) as (accepted, url):
            engine = engine_for(url)
            for _ in range(3):
                assert await reply_of(engine) == ("one two three ", "stop")
            await asyncio.sleep(0.1)  # a closing upstream's close arrives
            backend = engine.stats().backends[0]
            await engine.aclose()
        assert (backend.connections, backend.idle_connections) == (opened, idle)
        assert len(accepted) == opened


async def test_an_idle_connection_the_upstream_closed_is_not_used():
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(HEAD + chunked(SSE))
        await writer.drain()  # and closes: keep-alive not honoured, without saying so

    async with raw_server(once) as (accepted, url):
        engine = engine_for(url)
        assert await reply_of(engine) == ("one two three ", "stop")
        await asyncio.sleep(0.1)  # the close arrives while the connection is idle
        assert engine._origins[url].idle == 0
        assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()
    assert accepted == [0, 1]


async def test_a_connection_idle_past_its_keep_alive_is_not_sent_a_request():
    """A NAT or load balancer that dropped an idle connection without a word leaves it open
    here: a request sent on it would never be answered. Past ``keepalive_s`` it is closed
    and a new one made; within it, it is reused."""

    async def dropped_when_idle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        idle_from = 0.0
        while await read_request(reader) is not None:
            if idle_from and time.monotonic() - idle_from > 0.3:
                await asyncio.sleep(3600)  # what went on it after a while goes nowhere
            writer.write(HEAD + chunked(SSE))
            await writer.drain()
            idle_from = time.monotonic()

    async with raw_server(dropped_when_idle) as (accepted, url):
        engine = engine_for(url, keepalive_s=0.2, headers_timeout_s=3.0)
        for _ in range(2):  # back to back: one connection
            assert await reply_of(engine) == ("one two three ", "stop")
        await asyncio.sleep(0.5)
        began = time.monotonic()
        assert await reply_of(engine) == ("one two three ", "stop")
        assert time.monotonic() - began < 2.0  # not the head's timeout of 3 s
        assert engine._origins[url].idle == 1  # the new connection, kept
        # Left alone, the pool closes it when it expires all the same: a socket less.
        await wait_for(lambda: engine._origins[url].idle == 0, timeout_s=2.0)
        await engine.aclose()
    assert accepted == [0, 1]


async def test_a_reused_connection_that_dies_before_answering_is_retried_on_a_new_one():
    async def first_only(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(HEAD + chunked(SSE))
        await writer.drain()
        await read_request(reader)  # the next request on it: closed without an answer

    async with raw_server(first_only) as (accepted, url):
        engine = engine_for(url)
        assert await reply_of(engine) == ("one two three ", "stop")
        assert engine._origins[url].idle == 1  # kept: the upstream did not say it closes
        assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()
    assert accepted == [0, 1]


async def test_a_fresh_connection_that_dies_before_answering_is_not_retried():
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)

    async with raw_server(mute) as (accepted, url):
        origin = HttpOrigin(url)
        with pytest.raises(PeerClosed):
            await origin.post("/chat/completions", b"{}", {})
        origin.close()
    assert accepted == [0]


async def test_a_close_delimited_body_ends_with_its_connection():
    async def close_delimited(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for piece in (chunk(w) for w in WORDS):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(chunk(None, "stop"))  # no [DONE]: the close ends it (older servers)

    async with raw_server(close_delimited) as (accepted, url):
        engine = engine_for(url)
        assert await reply_of(engine) == ("one two three ", "stop")
        assert await reply_of(engine) == ("one two three ", "stop")
        assert engine._origins[url].idle == 0
        await engine.aclose()
    assert accepted == [0, 1]  # a close-delimited body's connection is not reused


async def failure_of(answer: Handler) -> UpstreamStreamError:
    """How a reply from an upstream answering with ``answer`` fails."""
    async with raw_server(answer) as (_, url):
        engine = engine_for(url)
        with pytest.raises(UpstreamStreamError) as failure:
            await reply_of(engine)
        await engine.aclose()
    return failure.value


async def test_a_close_delimited_body_cut_short_is_incomplete():
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + chunk("a "))

    assert (await failure_of(cut)).code == "upstream_incomplete"


async def test_a_response_split_at_every_byte_is_read_whole():
    """Request number k is answered in two writes split at byte k: every boundary of the
    head, of a chunk-size line, and between each CR and its LF is a read's end once."""
    whole = HEAD + chunked(SSE[:40], SSE[40:])

    async def split(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        at = 1
        while await read_request(reader) is not None:
            writer.write(whole[:at])
            await writer.drain()
            await asyncio.sleep(0.002)  # a read of its own
            writer.write(whole[at:])
            await writer.drain()
            at += 1

    async with raw_server(split) as (accepted, url):
        engine = engine_for(url)
        for _ in range(1, len(whole)):
            assert await reply_of(engine) == ("one two three ", "stop")
            # The body's end may come in the second write, after [DONE]: back in the pool then.
            await wait_for(lambda: engine._origins[url].idle == 1)
        await engine.aclose()
    assert accepted == [0]  # and each reply's connection went back to the pool whole


async def test_interim_responses_before_the_answer_are_skipped():
    """``100 Continue`` and ``103 Early Hints`` (with headers of their own, one of them a
    Content-Length that must not frame the real body) come before the answer, in one write
    or in reads of their own; the reply is read whole and its connection reused."""
    interim = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n"
        b"Content-Type: text/html\r\nContent-Length: 5\r\n\r\n"
    )

    async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        apart = False
        while await read_request(reader) is not None:
            writer.write(interim)
            if apart:
                await writer.drain()
                await asyncio.sleep(0.01)  # a read of its own
            writer.write(HEAD + chunked(SSE))
            await writer.drain()
            apart = not apart

    async with raw_server(hints) as (accepted, url):
        engine = engine_for(url)
        for _ in range(2):
            assert await reply_of(engine) == ("one two three ", "stop")
            await wait_for(lambda: engine._origins[url].idle == 1)
        await engine.aclose()
    assert accepted == [0]


CL_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n"


@pytest.mark.parametrize("framing", ["length", "chunked"])
@pytest.mark.parametrize(
    "after",
    [
        HEAD + chunked(chunk("INJECTED ")),  # another response nobody asked for
        CL_HEAD % len(chunk("INJECTED ")) + chunk("INJECTED "),
        b"GARBAGE\r\n\r\n",  # or anything
    ],
    ids=["chunked-response", "length-response", "garbage"],
)
async def test_bytes_after_a_whole_response_leave_it_whole_and_close_its_connection(
    framing: str, after: bytes
):
    """A whole response, then more bytes in the same write (so most often the same read):
    the reply is delivered as it was, and its connection is not used again (what else it
    holds is nobody's answer); the next request goes on a new connection."""
    whole = HEAD + chunked(SSE) if framing == "chunked" else CL_HEAD % len(SSE) + SSE

    async def extra(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader) is not None:
            writer.write(whole + after)
            await writer.drain()

    async with raw_server(extra) as (accepted, url):
        engine = engine_for(url)
        for _ in range(2):
            async with asyncio.timeout(5):
                assert await reply_of(engine) == ("one two three ", "stop")
            await wait_for(lambda: not engine._origins[url].in_use)
        await engine.aclose()
    assert accepted == [0, 1]


async def test_an_upstream_switching_protocols_is_a_bad_status_and_no_error_in_the_log(
    caplog: pytest.LogCaptureFixture,
):
    """A ``101 Switching Protocols`` (then bytes of some other protocol): the attempt fails
    as an answer that is not 200, its connection is closed, and nothing escapes into the
    event loop (whose handler would log a traceback)."""

    async def upgrade(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\n\r\ndata: junk\n\n"
        )
        await writer.drain()
        await read_request(reader)  # until the relay closes the connection

    async with raw_server(upgrade) as (_, url):
        engine = engine_for(url)
        with pytest.raises(UpstreamUnavailable) as caught:
            await reply_of(engine)
        await wait_for(lambda: not engine._origins[url].in_use)
        await engine.aclose()
    assert caught.value.code == "upstream_error_status"
    assert str(caught.value) == f"the upstream at {url} answered 101"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_broken_chunk_framing_mid_body_is_named():
    async def bad(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(HEAD + b"%x\r\n%s\r\n" % (len(chunk("a ")), chunk("a ")) + b"zz\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    failure = await failure_of(bad)
    assert failure.code == "upstream_broken"
    assert "framing" in str(failure)


async def test_tls_to_an_upstream_verified_against_its_ca_with_the_host_as_sni(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    ca, cert, key = make_certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # what ssl.create_default_context trusts
    names: list[str | None] = []
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)
    async with raw_server(keep_alive, tls=context) as (accepted, url):
        named = url.replace("127.0.0.1", "localhost")
        engine = engine_for(named)
        for _ in range(2):
            assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()
        # The certificate names localhost, not 127.0.0.1: by address, it is refused.
        other = engine_for(url)
        backend = other.pool.plan(None)[0]
        with pytest.raises(UpstreamUnavailable) as refused:
            await other.open_attempt(backend, GenerationRequest("hi"))
        await other.aclose()
    assert accepted[0] == 0 and names[0] == "localhost"
    assert refused.value.code == "upstream_tls"
    assert "not trusted" in str(refused.value)


async def test_a_reader_that_falls_behind_pauses_the_connection_until_it_reads():
    words = [f"w{i} " for i in range(2000)]

    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(HEAD)
        for word in words:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk(word)), chunk(word)))
        last = chunk(None, "stop") + b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last))
        await writer.drain()
        await read_request(reader)

    async with raw_server(burst) as (_, url):
        engine = engine_for(url)
        backend = engine.pool.plan(None)[0]
        stream = await engine.open_attempt(backend, GenerationRequest("hi"))
        assert isinstance(stream, UpstreamStream)
        response = stream._response
        for _ in range(200):  # nobody reads: the connection stops reading
            if not response.reading:
                break
            await asyncio.sleep(0.01)
        assert not response.reading
        got = [delta async for delta in stream]  # reading resumes as the reader catches up
        await engine.aclose()
    assert [d.text for d in got[:-1]] == words and got[-1].finish_reason == "stop"


async def test_the_request_goes_in_one_piece_with_the_headers_the_relay_sends():
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        request = await read_request(reader)
        assert request is not None
        seen.append(request)
        writer.write(HEAD + chunked(SSE))
        await writer.drain()

    async with raw_server(record) as (_, url):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(url),), model="m", api_key="k1"))
        assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    port = url.split(":")[2].split("/")[0]
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers == {
        "Host": f"127.0.0.1:{port}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Accept": "text/event-stream",
        "Accept-Encoding": "identity",
        "Authorization": "Bearer k1",
    }
    assert json.loads(body)["messages"] == [{"role": "user", "content": "hi"}]


async def test_a_response_head_that_never_ends_is_refused_at_its_size_bound():
    """An upstream writing one header line forever: refused once the head passes its bound
    (its bytes are neither kept nor parsed on), long before the head timeout, and the
    connection is closed."""
    written = 0
    closed = asyncio.Event()

    async def endless_head(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Big: ")
        try:
            while written < 1 << 30:
                writer.write(b"a" * 65536)
                written += 65536
                await writer.drain()
        except ConnectionError:
            closed.set()

    async with raw_server(endless_head) as (_, url):
        engine = engine_for(url, headers_timeout_s=20.0)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamUnavailable) as caught:
            await reply_of(engine)
        took = asyncio.get_running_loop().time() - started
        await wait_for(closed.is_set)
        await engine.aclose()
    assert caught.value.code == "upstream_bad_response"
    assert str(caught.value) == f"the upstream at {url} sent a response head larger than 64 KiB"
    assert took < 2.0 and written < 8 << 20


@pytest.mark.parametrize("pad", [60_000, 70_000])
async def test_a_response_head_in_one_read_is_held_to_the_same_size_bound(pad: int):
    """A whole head (interim ones before it included) and its reply in one write: over the
    bound, the attempt is refused as a bad response and its connection closed; under it,
    the reply is read."""
    interim = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
    padded = HEAD.replace(b"\r\n\r\n", b"\r\nX-Pad: %s\r\n\r\n" % (b"p" * pad))

    async def big_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(interim + padded + chunked(SSE))
        await writer.drain()
        await read_request(reader)  # until the relay closes the connection

    async with raw_server(big_head) as (_, url):
        engine = engine_for(url)
        if pad > 64 * 1024:
            with pytest.raises(UpstreamUnavailable) as caught:
                await reply_of(engine)
            assert caught.value.code == "upstream_bad_response"
            assert "a response head larger than 64 KiB" in str(caught.value)
            await wait_for(lambda: not engine._origins[url].in_use)
        else:
            assert await reply_of(engine) == ("one two three ", "stop")
        await engine.aclose()


async def test_a_wait_cancelled_as_the_response_head_arrives_closes_the_connection():
    """The head is read, and in the same turn of the loop (before the waiting task runs
    again) the wait is cancelled, as when the client leaves just then: the response nobody
    will read is closed, not left open with the upstream generating into it."""
    asked, closed = threading.Event(), threading.Event()
    send_head = threading.Event()

    def upstream(listener: socket.socket) -> None:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(10)
            while b"\r\n\r\n" not in connection.recv(65536):
                pass
            asked.set()
            send_head.wait(10)
            connection.sendall(HEAD)
            try:
                while connection.recv(65536):
                    pass  # the relay reads on, or closes (then recv says so)
                closed.set()
            except OSError:
                closed.set()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        thread = threading.Thread(target=upstream, args=(listener,), daemon=True)
        thread.start()
        engine = engine_for(f"http://127.0.0.1:{port}/v1")
        backend = engine.pool.plan(None)[0]
        opening = asyncio.ensure_future(engine.open_attempt(backend, GenerationRequest("hi")))
        await wait_for(asked.is_set)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, opening.cancel)  # due while the loop is held below
        send_head.set()
        time.sleep(0.3)  # noqa: ASYNC251  (the head arrives and the cancel falls due in one turn)
        await asyncio.gather(opening, return_exceptions=True)
        assert opening.cancelled()
        was_closed = await asyncio.to_thread(closed.wait, 5)
        await engine.aclose()  # closes whatever is still open
        thread.join(5)
    assert was_closed


# Answers no relay can read as events, each named for what it is: a body compressed as a
# transfer coding (not read as events and taken for llama-cpp-python's over-long prompt),
# and an HTTP/2-only server's SETTINGS and GOAWAY frames (not "not valid HTTP").
UNREADABLE_ANSWERS = {
    "gzip transfer coding": (
        HEAD.replace(b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked")
        + chunked(gzip.compress(SSE)),
        "answered a gzip-compressed stream, though asked for none",
    ),
    "http2 alone": (
        b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # SETTINGS
        + b"\x00\x00\x08\x07\x00\x00\x00\x00\x00"
        + bytes(7)
        + b"\x01",  # GOAWAY
        "answered in HTTP/2 alone; this relay speaks HTTP/1.1",
    ),
}


@pytest.mark.parametrize("kind", list(UNREADABLE_ANSWERS))
async def test_an_answer_the_relay_cannot_read_is_named_for_what_it_is(kind: str):
    answer, named = UNREADABLE_ANSWERS[kind]

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with raw_server(answering) as (_, url):
        engine = engine_for(url)
        with pytest.raises(UpstreamUnavailable) as failure:
            await reply_of(engine)
        await engine.aclose()
    assert failure.value.code == "upstream_bad_response"
    assert named in str(failure.value)
