"""Drop and resume on the Responses route, beside the native one, and at scale: 500 drops
across two replicas sharing one Redis behind a real nginx, none losing or repeating an event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from replystream.client import measure_reply
from replystream.client.formats import interpret_event
from replystream.lab.benchstats import summarize
from replystream.lab.drop_resume import drop_and_resume
from replystream.lab.load import run_load
from replystream.lab.load_types import LoadConfig
from replystream.lab.local_server import local_server
from replystream.lab.profiles import Profile
from replystream.lab.served_model import served_model
from replystream.lab.server_metrics import metrics_url, scrape
from replystream.lab.workload import Lengths, build_request, detect_api
from replystream.server import running
from replystream.sse import Event
from tests.nginx import running_nginx
from tests.processes import replica
from tests.redis_server import redis_server
from tests.services import free_port
from tests.test_scale_out import upstream_config


def test_responses_requests_carry_the_conversation_as_items_and_the_system_as_instructions():
    url = "http://h/v1/responses"
    assert detect_api(url) == "responses"
    spec = build_request(
        "responses",
        url,
        prompt="and then?",
        max_tokens=7,
        model="m",
        system="be brief",
        history=[("hi", "hello")],
    )
    assert (spec.method, spec.url) == ("POST", url)
    assert spec.json_body == {
        "model": "m",
        "stream": True,
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and then?"},
        ],
        "max_output_tokens": 7,
    }


@pytest.mark.parametrize(
    ("kind", "data", "meaning"),
    [
        ("response.output_text.delta", {"delta": "Hi"}, ("text", "Hi", None)),
        ("response.completed", {"response": {"status": "completed"}}, ("done", "", None)),
        (
            "response.incomplete",
            {"response": {"incomplete_details": {"reason": "max_output_tokens"}}},
            ("done", "", None),
        ),
        (
            "response.incomplete",
            {"response": {"incomplete_details": {"reason": "content_filter"}}},
            ("error", "", "response.incomplete: content_filter"),
        ),
        (
            "response.failed",
            {"response": {"error": {"code": "generator_lost", "message": "gone"}}},
            ("error", "", "response.failed: generator_lost: gone"),
        ),
        ("response.in_progress", {"response": {}}, ("other", "", None)),
    ],
)
def test_responses_events_mean_text_an_end_or_a_failure(kind, data, meaning):
    got = interpret_event(Event(data=json.dumps({"type": kind, **data}), type=kind))
    assert (got.kind, got.text, got.error) == meaning


@pytest.mark.parametrize("cursor", ["header", "query"])
async def test_dropped_responses_readers_resume_losing_and_repeating_nothing(cursor):
    schedule = ["--delay-ms", "5", "--jitter-ms", "0", "--tokens", "30"]
    async with local_server(schedule) as url:
        target = f"{url}/v1/responses"
        config = LoadConfig(
            url=target,
            api="responses",
            profile=Profile("concurrent", 4),
            requests=8,
            prompt_words=Lengths.parse("3"),
            drop_share=0.6,
            drop_after=4,
            resume_cursor=cursor,
            model=await served_model(target),
        )
        summary = summarize(await run_load(config))
    resume = summary["resume"]
    dropped = [r for r in summary["requests"] if r["resume"] is not None]
    assert resume["drops"] == len(dropped) >= 2 and resume["resumed"] == resume["drops"]
    assert (resume["lost"], resume["duplicated"]) == (0, 0)
    assert summary["counts"]["complete"] == 8
    # Every reply read whole, the dropped ones across both connections.
    assert all(r["tokens"] == 30 for r in summary["requests"])
    assert summary["config"]["resume_cursor"] == cursor
    assert 0.0 < resume["reconnect_ms"]["p50"] < 200.0


@pytest.mark.parametrize(("api", "path"), [("responses", "responses"), ("native", "replies")])
async def test_a_resumed_reply_counts_the_tokens_its_server_reports(api, path):
    """Events of 4 tokens each: a Responses delta says nothing of its tokens, so the count is
    the reply's usage (on its last event), not one per text event."""
    schedule = ["--delay-ms", "5", "--jitter-ms", "0", "--tokens", "30", "--batch-tokens", "4"]
    async with local_server(schedule) as url:
        target = f"{url}/v1/{path}"
        config = LoadConfig(
            url=target,
            api=api,
            profile=Profile("concurrent", 4),
            requests=8,
            drop_share=0.5,
            drop_after=3,
            model=await served_model(target) if api == "responses" else "default",
        )
        summary = summarize(await run_load(config))
    requests = summary["requests"]
    dropped = [r for r in requests if r["resume"] is not None and r["resume"]["dropped"]]
    assert dropped and all(r["resume"]["resumed"] for r in dropped)
    # 30 tokens in 8 events (7 of 4, one of 2), whether or not the reader dropped on the way.
    assert [(r["tokens"], r["events"]) for r in requests] == [(30, 8)] * 8


@asynccontextmanager
async def app_under_api_prefix(tmp_path: Path) -> AsyncIterator[str]:
    """A server behind a real nginx that serves it under /api/; yields the proxy's URL."""
    schedule = ["--delay-ms", "5", "--jitter-ms", "0", "--tokens", "12"]
    port = free_port()
    async with local_server(schedule) as url:
        upstream = url.removeprefix("http://")
        config = f"""    server {{
        listen 127.0.0.1:{port};
        location /api/ {{ proxy_pass http://{upstream}/; proxy_buffering off; }}
    }}"""
        async with running_nginx(config, port, tmp_path) as proxy:
            yield proxy


@pytest.mark.parametrize("api", ["native", "responses"])
async def test_a_reply_behind_a_path_prefix_resumes_under_that_prefix(api, tmp_path):
    """A proxy serving the app under /api/: the resume goes where the reply started."""
    async with app_under_api_prefix(tmp_path) as proxy:
        route = "v1/replies" if api == "native" else "v1/responses"
        target = f"{proxy}/api/{route}"
        load = LoadConfig(
            url=target,
            api=api,
            requests=2,
            drop_share=1.0,
            drop_after=3,
            model=await served_model(target) if api == "responses" else "default",
        )
        summary = summarize(await run_load(load))
    assert summary["counts"]["complete"] == 2, summary["counts"]
    assert summary["resume"]["resumed"] == summary["resume"]["drops"] == 2


@pytest.mark.parametrize(
    ("api", "path"),
    [("native", "v1/replies"), ("messages", "v1/messages"), ("openai", "v1/chat/completions")],
)
async def test_server_metrics_behind_a_path_prefix_are_read_under_that_prefix(api, path, tmp_path):
    async with app_under_api_prefix(tmp_path) as proxy:
        target = f"{proxy}/api/{path}"
        assert metrics_url(target) == f"{proxy}/api/metrics"
        model = "default" if api == "native" else await served_model(target)
        load = LoadConfig(
            url=target,
            api=api,
            requests=2,
            model=model,
            server_metrics=metrics_url(target),
        )
        summary = summarize(await run_load(load))
    server = summary["server"]
    assert "error" not in server, server
    assert server["client_tokens_received"] == 24 and server["excess_tokens"] == 0


async def test_responses_resume_counts_an_event_lost_and_one_repeated():
    """A server numbering events only by ``sequence_number`` from 0, as OpenAI's does."""

    def event(seq: int, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": seq, **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def delta(seq: int) -> bytes:
        return event(seq, "response.output_text.delta", delta=f"t{seq} ")

    bodies: list[dict[str, Any]] = []

    async def start(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        created = event(0, "response.created", response={"id": "resp_r1", "status": "queued"})
        await response.write(created + delta(1) + delta(2))
        await asyncio.sleep(1)  # the reader drops before this ends
        return response

    async def resume(request: web.Request) -> web.StreamResponse:
        assert request.query["stream"] == "true"
        assert request.query["starting_after"] == "2"
        assert "Last-Event-ID" not in request.headers
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # 2 again (a duplicate), 3 never sent (lost), then the rest.
        done = event(5, "response.completed", response={"status": "completed"})
        await response.write(delta(2) + delta(4) + done)
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", start)
    app.router.add_get("/v1/responses/resp_r1", resume)
    async with running(app) as url:
        timing, outcome = await drop_and_resume(
            f"{url}/v1/responses",
            {"model": "m", "input": "x"},
            2,
            5.0,
            route="responses",
            cursor="query",
        )
    # Started as OpenAI resumes only: stored and in the background.
    assert bodies == [
        {"model": "m", "input": "x", "stream": True, "store": True, "background": True}
    ]
    assert timing.complete and outcome.resumed
    assert (outcome.lost, outcome.duplicated) == (1, 1)


async def test_native_resume_counts_an_announced_gap_once_and_repeats_nothing():
    """As replystream's server writes a ``gap``: without an ``id:`` of its own, so it is
    parsed with the id of the event before it, which it does not repeat."""

    def token(seq: int) -> bytes:
        data = json.dumps({"text": f"t{seq} ", "tokens": 1})
        return f"event: token\nid: {seq}\ndata: {data}\n\n".encode()

    resumed_after: list[str | None] = []

    async def start(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "X-Reply-Id": "r1"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        reply = b'event: reply\nid: 1\ndata: {"reply_id": "r1"}\n\n'
        gap = b'event: gap\ndata: {"lost_from": 3, "lost_to": 3}\n\n'
        await response.write(reply + token(2) + gap + token(4) + token(5))
        await asyncio.sleep(1)  # the reader drops before this ends
        return response

    async def resume(request: web.Request) -> web.StreamResponse:
        resumed_after.append(request.headers.get("Last-Event-ID"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        done = b'event: done\nid: 7\ndata: {"finish_reason": "stop"}\n\n'
        await response.write(token(6) + done)
        return response

    app = web.Application()
    app.router.add_post("/v1/replies", start)
    app.router.add_get("/v1/replies/r1/stream", resume)
    async with running(app) as url:
        timing, outcome = await drop_and_resume(f"{url}/v1/replies", {"prompt": "x"}, 3, 5.0)
    assert timing.complete and outcome.resumed
    assert resumed_after == ["5"]
    # Event 3 is lost (announced, and never came): once; nothing came twice.
    assert (outcome.lost, outcome.duplicated) == (1, 0)


async def test_a_dropped_reasoning_reply_is_timed_and_counted_as_an_undropped_one_is():
    """A reasoning model's thinking is output as its text is: a dropped reader's TTFT starts
    at the first thinking, its thinking events are text events for TPOT and ITL, and its
    thinking tokens count toward ``drop_after``, exactly as ``measure_reply`` takes them."""
    reply = [b'event: reply\nid: 1\ndata: {"reply_id": "r1"}\n\n']
    for seq in range(2, 8):  # three thoughts, then three tokens of the answer
        kind, word = ("thinking", "hm") if seq < 5 else ("token", "yes")
        data = json.dumps({"text": f"{word}{seq} ", "tokens": 1})
        reply.append(f"event: {kind}\nid: {seq}\ndata: {data}\n\n".encode())
    reply.append(b'event: done\nid: 8\ndata: {"finish_reason": "stop"}\n\n')
    resumed_after: list[str] = []

    async def send(request: web.Request, events: list[bytes]) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "X-Reply-Id": "r1"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0.02)
        return response

    async def start(request: web.Request) -> web.StreamResponse:
        return await send(request, reply)

    async def resume(request: web.Request) -> web.StreamResponse:
        after = request.headers["Last-Event-ID"]
        resumed_after.append(after)
        return await send(request, reply[int(after) :])

    app = web.Application()
    app.router.add_post("/v1/replies", start)
    app.router.add_get("/v1/replies/r1/stream", resume)
    async with running(app) as url:
        whole = await measure_reply(f"{url}/v1/replies", method="POST", json_body={"prompt": "x"})
        timing, outcome = await drop_and_resume(f"{url}/v1/replies", {"prompt": "x"}, 2, 5.0)
    assert whole.complete and timing.complete and outcome.resumed
    assert resumed_after == ["3"]  # after two tokens of thinking
    assert (outcome.lost, outcome.duplicated) == (0, 0)
    for read in (whole, timing):
        assert (read.tokens, len(read.text_event_ms)) == (6, 6)
        assert (read.thinking, read.text) == ("hm2 hm3 hm4 ", "yes5 yes6 yes7 ")
        assert read.first_text_ms is not None and read.first_answer_ms is not None
        # Output began with the thinking, three events before the answer's first.
        assert read.first_text_ms < read.text_event_ms[3] == read.first_answer_ms


async def drop_readers(url: str, api: str, model: str, drops: int) -> dict[str, Any]:
    config = LoadConfig(
        url=url,
        api=api,  # type: ignore[arg-type]
        profile=Profile("concurrent", 40),
        requests=drops,
        output_tokens=Lengths.parse("12"),
        prompt_words=Lengths.parse("2"),
        drop_share=1.0,
        drop_after=4,
        model=model,
        timeout_s=60.0,
    )
    return summarize(await run_load(config))


@pytest.mark.parametrize(
    ("route", "api"), [("/v1/replies", "native"), ("/v1/responses", "responses")]
)
async def test_500_drops_across_two_replicas_behind_nginx_lose_and_repeat_nothing(
    tmp_path: Path, route: str, api: str
):
    schedule = ("--engine", "simulated", "--delay-ms", "3", "--jitter-ms", "1")
    with redis_server(tmp_path / "redis") as redis:
        async with (
            replica(*schedule, "--redis-url", redis.url) as (_, a_url),
            replica(*schedule, "--redis-url", redis.url) as (_, b_url),
        ):
            port = free_port()
            config = upstream_config(port, [a_url, b_url])
            async with running_nginx(config, port, tmp_path / "nginx") as nginx:
                target = f"{nginx}{route}"
                model = await served_model(target) if api == "responses" else "default"
                summary = await drop_readers(target, api, model, 500)
            made = [
                (await scrape(metrics_url(u)))["replystream_tokens_generated_total"]
                for u in (a_url, b_url)
            ]
    resume = summary["resume"]
    counts = summary["counts"]
    assert counts["complete"] == 500, counts
    assert resume["drops"] == resume["resumed"] == 500
    assert (resume["lost"], resume["duplicated"]) == (0, 0)
    assert all(r["tokens"] == 12 for r in summary["requests"])
    # The replies were made on both replicas, and each resume went to whichever replica
    # nginx's round-robin picked next, through Redis when it was not the producer.
    assert all(n >= 1000 for n in made), made
