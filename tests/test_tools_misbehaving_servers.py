"""The measuring tools against servers that misbehave: a run that fails says why in one line.

Each case runs the real command as a subprocess (as a user or a CI script would) against a
real HTTP server on a loopback socket that answers wrongly, slowly or not at all, and reads
its exit status and output: never a traceback, always the reason.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from replystream.client import measure_reply
from replystream.lab.benchstats import summarize
from replystream.lab.load import run_load
from replystream.lab.load_types import LoadConfig
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, serve_engine

CLI = [sys.executable, "-m", "replystream"]


async def cli(*args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run ``replystream ARGS``; its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(timeout_s):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def false_gzip_app() -> web.Application:
    """Every route answers 200 with a body that says it is gzip and is not."""

    async def false_gzip(request: web.Request) -> web.Response:
        return web.Response(
            body=b"this is not gzip",
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", false_gzip)
    return app


async def test_a_models_list_in_a_false_gzip_is_one_line_not_a_traceback():
    async with running(false_gzip_app()) as url:
        for command in ("bench", "doctor"):
            code, _, err = await cli(command, f"{url}/v1/chat/completions", "--timeout", "5")
            assert code == 1
            line = one_line(err)
            assert line.startswith(f"replystream {command}: cannot list models at {url}/v1/models")
            assert "not the gzip it claims" in line


async def test_metrics_in_a_false_gzip_are_reported_not_a_traceback():
    async with running(false_gzip_app()) as url:
        code, out, err = await cli(
            "bench", f"{url}/stream", "--requests", "1", "--server-metrics", "--quiet"
        )
    assert "Traceback" not in err, err
    assert code == 1  # the reply itself is not a reply either
    assert f"Server metrics: not read ({url}/metrics: the body is not the gzip it claims" in out


@asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """A server that accepts connections and never answers; yields its base URL."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_models_list_that_never_comes_says_it_timed_out_after_timeout():
    async with silent_server() as url:
        for command in ("doctor", "bench"):
            code, _, err = await cli(command, f"{url}/v1/chat/completions", "--timeout", "0.5")
            assert code == 1
            assert one_line(err) == (
                f"replystream {command}: cannot list models at {url}/v1/models "
                "(no answer within 0.5 s)"
            )


async def test_a_models_list_behind_a_key_says_to_send_the_key():
    app = create_app(fast_engine(), ServerConfig(api_keys=("sk-right",)))
    async with running(app) as url:
        listing = f"{url}/v1/models"
        for command in ("bench", "doctor"):
            code, _, err = await cli(command, f"{url}/v1/chat/completions")
            assert code == 1
            assert one_line(err) == (
                f"replystream {command}: {listing} answered HTTP 401; it wants a key: send it "
                "with --header 'Authorization: Bearer KEY'"
            )
        wrong = ("--header", "Authorization: Bearer sk-wrong")
        code, _, err = await cli("bench", f"{url}/v1/chat/completions", *wrong)
        assert (code, one_line(err)) == (
            1,
            f"replystream bench: {listing} answered HTTP 401; the key sent was refused",
        )


async def test_doctor_json_gives_a_failed_verdict_when_the_model_cannot_be_looked_up():
    async with silent_server() as url:
        target = f"{url}/v1/chat/completions"
        code, out, err = await cli("doctor", target, "--timeout", "0.5", "--json")
    assert code == 1 and err == ""
    verdict = json.loads(out)  # the one JSON object, as for a reply that failed
    assert verdict["url"] == target and verdict["verdict"] == "failed"
    assert verdict["reason"] == f"cannot list models at {url}/v1/models (no answer within 0.5 s)"
    assert verdict["events"] == 0 and verdict["status"] is None


async def test_metrics_that_never_come_are_reported_as_timed_out():
    async with silent_server() as url:
        summary = summarize(
            await run_load(
                LoadConfig(
                    url=f"{url}/stream",
                    api="lab",
                    requests=1,
                    timeout_s=0.5,
                    server_metrics=f"{url}/metrics",
                    warmup=False,
                )
            )
        )
    assert summary["server"]["error"] == f"{url}/metrics: no answer within 5 s"


def false_counts_app() -> web.Application:
    """Native streams of 5 one-word events whose token counts no reply could have."""

    async def stream(request: web.Request) -> web.StreamResponse:
        per_event, usage = request.query["per_event"], request.query["usage"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("one ", "two ", "three ", "four ", "five "):
            data = f'{{"text": "{word}", "tokens": {per_event}}}'
            await response.write(f"event: token\ndata: {data}\n\n".encode())
            await asyncio.sleep(0.005)
        if usage:
            await response.write(
                f'event: usage\ndata: {{"completion_tokens": {usage}}}\n\n'.encode()
            )
        await response.write(b"event: done\ndata: {}\n\n")
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    return app


HUGE = "1" + "0" * 400


async def test_token_counts_no_reply_could_have_are_not_believed(tmp_path):
    async with running(false_counts_app()) as url:
        for per_event, usage in ((HUGE, ""), ("-5", ""), ("1", HUGE), ("1", "-3")):
            query = f"per_event={per_event}&usage={usage}"
            code, out, err = await cli("doctor", f"{url}/stream?{query}", "--json")
            assert "Traceback" not in err, err
            assert code == 0, err
            assert json.loads(out)["tokens"] == 5  # one per event, as when none is stated
            result = tmp_path / "bench.json"
            code, _, err = await cli(
                "bench",
                f"{url}/stream?{query}",
                "--requests",
                "1",
                "--quiet",
                "--json",
                str(result),
            )
            assert "Traceback" not in err, err
            assert code == 0, err
            measured = json.loads(await asyncio.to_thread(result.read_text))["requests"][0]
            assert (measured["tokens"], measured["tokens_per_event"]) == (5, 1.0)


def garbled_resume_app(first: bytes) -> web.Application:
    """Resumable-looking streams that open with ``first``, a garbled event."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Reply-Id": "r1"}
        )
        await response.prepare(request)
        await response.write(first)
        for number in range(1, 6):
            data = f'{{"text": "w{number} ", "tokens": 1}}'
            await response.write(f"id: {number}\nevent: token\ndata: {data}\n\n".encode())
            await asyncio.sleep(0.005)
        await response.write(b"event: done\ndata: {}\n\n")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stream)
    return app


async def test_a_garbled_gap_or_created_event_in_a_resumed_reply_is_a_reason():
    cases = [
        ("v1/replies", b"event: gap\ndata: [1, 2]\n\n", "a gap event names no range"),
        ("v1/replies", b'event: gap\ndata: {"lost_from": 4, "lost_to": 2}\n\n', "no range"),
        ("v1/responses", b'event: response.created\ndata: {"response": "x"}\n\n', "cannot"),
        ("v1/responses", b"event: response.created\ndata: [1]\n\n", "cannot be resumed"),
    ]
    for path, first, says in cases:
        async with running(garbled_resume_app(first)) as url:
            model = ["--model", "m"] if path == "v1/responses" else []
            code, out, err = await cli(
                *("bench", f"{url}/{path}", *model, "--requests", "1", "--no-warmup"),
                *("--drop-share", "1", "--drop-after", "2", "--quiet"),
            )
        assert "Traceback" not in err, err
        assert code == 1
        said = ("  incomplete: 1 x ", "  failed: 1 x ")
        reason = next(line for line in out.splitlines() if line.startswith(said))
        assert says in reason, out


async def test_a_dropped_reply_with_no_numbered_event_says_it_cannot_be_resumed():
    async def unnumbered(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Reply-Id": "r1"}
        )
        await response.prepare(request)
        for number in range(1, 6):
            data = f'{{"text": "w{number} ", "tokens": 1}}'
            await response.write(f"event: token\ndata: {data}\n\n".encode())
            await asyncio.sleep(0.005)
        await response.write(b"event: done\ndata: {}\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/replies", unnumbered)
    async with running(app) as url:
        code, out, err = await cli(
            *("bench", f"{url}/v1/replies", "--requests", "1", "--no-warmup", "--quiet"),
            *("--drop-share", "1", "--drop-after", "2"),
        )
    assert "Traceback" not in err, err
    assert code == 1
    assert (
        "  incomplete: 1 x no event carried a number (an id: or a sequence_number), so the "
        "reply cannot be resumed"
    ) in out.splitlines(), out


async def test_an_event_stream_in_an_encoding_not_decoded_is_named_not_garbage():
    """A hop that compresses with brotli although the client asked for gzip or deflate."""

    async def brotli(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Content-Encoding": "br"}
        )
        await response.prepare(request)
        for number in range(10):
            await response.write(bytes([0x8B, 0x02, 0x80, number]))  # not SSE as it stands
            await asyncio.sleep(0.005)
        return response

    app = web.Application()
    app.router.add_get("/stream", brotli)
    unread = "the body is in the br encoding, which this client does not decode"
    async with running(app) as url:
        code, out, err = await cli("doctor", f"{url}/stream", "--json")
        assert "Traceback" not in err, err
        assert code == 1
        result = json.loads(out)
        assert result["verdict"] == "compressed"
        assert unread in result["reason"]
        assert result["fix"].startswith("do not compress text/event-stream")
        code, out, err = await cli("bench", f"{url}/stream", "--requests", "1", "--quiet")
    assert code == 1
    assert f"  failed: 1 x read failed: {unread} (it asks for gzip or deflate)" in out, out


async def test_urls_and_paths_that_look_like_markup_are_printed_as_they_are(tmp_path):
    """Rich reads '[/b]' as a closing tag: in a URL or a file name it ended the report."""
    folder = tmp_path / "runs[/b]"
    async with serve_engine(fast_engine(delay_ms=1, jitter_ms=0)) as url:
        target = f"{url}/stream?max_tokens=3&tag=[/b]"
        single = ["--requests", "1", "--quiet", "--json", str(folder / "a[/b].json")]
        code, out, err = await cli("bench", target, *single)
        assert "Traceback" not in err, err
        assert code == 0, err
        assert f"bench {target} (lab," in out and f"Wrote {folder}/a[/b].json." in out
        code, out, err = await cli("bench", target, "--profile", "sweep", "--requests", "2")
        assert "Traceback" not in err, err
        assert f"bench sweep {target} (lab)" in out
        code, out, err = await cli(
            *("bench", "--compare", str(folder / "a[/b].json"), str(folder / "a[/b].json"))
        )
        assert "Traceback" not in err, err
        # The title wraps to the table's width wherever the folder's length puts the break.
        assert code == 0 and "a[/b].json" in "".join(out.split()), out
        code, out, err = await cli(
            *("lab", "--url", url, "--calls", "1", "--tokens", "2", "--out", str(folder))
        )
    assert "Traceback" not in err, err
    assert code == 0 and f"Wrote {folder}/timeline.json and {folder}/timeline.png." in out


async def test_an_event_stream_in_x_gzip_is_read_as_gzip():
    events = "".join(f'data: "w{n} "\n\n' for n in range(6)) + "data: [DONE]\n\n"

    async def old_name(request: web.Request) -> web.Response:
        return web.Response(
            body=gzip.compress(events.encode()),
            headers={"Content-Type": "text/event-stream", "Content-Encoding": "x-gzip"},
        )

    app = web.Application()
    app.router.add_get("/stream", old_name)
    async with running(app) as url:
        timing = await measure_reply(f"{url}/stream")
    assert timing.complete, timing.error
    assert timing.text == "w0 w1 w2 w3 w4 w5 "


async def test_a_redirect_is_reported_with_where_it_points():
    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("https://example.test/stream")

    app = web.Application()
    app.router.add_get("/stream", moved)
    async with running(app) as url:
        code, out, err = await cli("doctor", f"{url}/stream", "--json")
    assert code == 1, err
    assert json.loads(out)["reason"] == (
        "no complete reply: HTTP 301: redirected to https://example.test/stream (not followed)"
    )


@asynccontextmanager
async def closing_at_once() -> AsyncIterator[str]:
    """A server that reads each request and closes the connection without an answer."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


async def test_a_server_that_closes_without_answering_is_said_so_in_our_words():
    async with closing_at_once() as url:
        code, out, _ = await cli("bench", f"{url}/stream", "--requests", "2", "--quiet")
        doctor_code, report, _ = await cli("doctor", f"{url}/stream")
    assert code != 0
    said = "read failed: the server closed the connection before answering"
    assert f"failed: 2 x {said}" in out
    assert doctor_code != 0
    assert said in report and "role=" not in report + out
    assert "  status:             -" in report  # no Python None in a report


def deep_json_app() -> web.Application:
    """A stream whose one event, and a models list, nest past the recursion limit."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + b"[" * 100_000 + b"\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.Response(text="[" * 100_000, content_type="application/json")

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/v1/models", models)
    return app


async def test_json_nested_past_the_recursion_limit_is_a_failed_request_not_a_traceback():
    async with running(deep_json_app()) as url:
        code, out, err = await cli("bench", f"{url}/stream", "--requests", "2", "--quiet")
        listing_code, _, listing_err = await cli("bench", f"{url}/v1/chat/completions")
    assert "Traceback" not in err, err
    assert code == 1 and "2 failed" in out and "event data is not JSON" in out
    assert listing_code == 1
    assert one_line(listing_err).endswith("name the model with --model")
