"""A request's own delivery options hold for a resume of its reply, on any replica.

Keep-alive is the reader's: a client asks a short ``keepalive_s`` because something between
it and the server drops an idle connection sooner than the server's default, and its resume,
which exists for that client after such a drop, crosses the same way. The interval is kept
with the reply (in Redis too), so a resume on the replica that makes the reply and one on
another keep it; a resume may ask its own (``?keepalive_s=``). Batching and hold-back are the
producer's: the log holds the events they made, which every reader replays.

Real servers on loopback: one in-process app on the memory store, or two sharing a real
redis-server (A makes the replies, B only reads them). The server's ``--keepalive-s`` is
its default, 15 s: none of it falls in these tests' windows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from replystream.delivery.moderation import BannedPhrases
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine
from tests.rawhttp import RawResponse, raw_request
from tests.redis_server import redis_server

JSON = {"Content-Type": "application/json"}
ASKED_S = 0.3  # the interval the requests ask for
WINDOW_S = 1.5  # how long a reader is watched while the engine has not answered yet
FIRST_TOKEN_MS = 4000.0  # longer than the window, by far: the window is all keep-alives


@asynccontextmanager
async def replicas(tmp_path: Path, config: ServerConfig | None = None, **engine: Any):
    """(A, B): two replicas on one real Redis; A makes the replies (``engine``'s settings)."""
    config = config or ServerConfig()
    with redis_server(tmp_path) as redis:
        a = create_app(fast_engine(**engine), config, RedisReplayStore(redis.url))
        b = create_app(fast_engine(), config, RedisReplayStore(redis.url))
        async with running(a) as url_a, running(b) as url_b:
            yield url_a, url_b


@asynccontextmanager
async def one_server(config: ServerConfig | None = None, **engine: Any):
    """One replica on the memory store, as (A, A)."""
    async with running(create_app(fast_engine(**engine), config or ServerConfig())) as url:
        yield url, url


@asynccontextmanager
async def servers(where: str, tmp_path: Path, **engine: Any) -> AsyncIterator[tuple[str, str]]:
    """(the replica that makes replies, the one that resumes them), as ``where`` says."""
    if where == "memory":
        async with one_server(**engine) as urls:
            yield urls
    else:
        async with replicas(tmp_path, **engine) as (url_a, url_b):
            yield (url_a, url_a if where == "producer" else url_b)


async def read_for(response: RawResponse, seconds: float) -> bytes:
    """What ``response``'s body brings within ``seconds`` (its chunk framing left in)."""
    got = b""
    try:
        async with asyncio.timeout(seconds):
            while chunk := await response.reader.read(4096):
                got += chunk
    except TimeoutError:
        pass
    return got


def keepalives(body: bytes) -> int:
    """Keep-alives in a body: a comment, or Anthropic's ``ping`` event."""
    return body.count(b": keep-alive") + body.count(b"event: ping")


async def started(url: str, path: str, body: dict[str, Any]) -> RawResponse:
    response = await raw_request(f"{url}{path}", "POST", json.dumps(body).encode(), JSON)
    assert response.status == 200, await response.read_body()
    return response


@pytest.mark.parametrize("where", ["memory", "producer", "other"])
async def test_a_resume_after_a_drop_is_kept_alive_at_the_interval_its_reply_asked_for(
    where: str, tmp_path: Path
):
    """The case as seen: a reply asked with ``keepalive_s: 0.3`` got 4 keep-alives in
    1.5 s; its resume (``Last-Event-ID: 1``) got none, the server's 15 s applying."""
    async with servers(where, tmp_path, first_token_ms=FIRST_TOKEN_MS) as (maker, reader):
        ask = {"prompt": "x", "max_tokens": 3, "resumable": True, "keepalive_s": ASKED_S}
        first = await started(maker, "/v1/replies", ask)
        reply_id = first.headers["x-reply-id"]
        await first.reader.readuntil(b"\n\n")  # the ``reply`` event, id 1
        own = await read_for(first, WINDOW_S)
        await first.aclose()  # the drop: the reply goes on for its resume
        resume = await raw_request(
            f"{reader}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
        )
        assert resume.status == 200
        resumed = await read_for(resume, WINDOW_S)
        await resume.aclose()
    assert b"event: token" not in own + resumed  # all of it in the engine's wait
    # About 5 in each (a keep-alive may leave up to a quarter period late); the server's
    # 15 s would give none.
    assert keepalives(own) >= 2, own
    assert keepalives(resumed) >= 2, resumed


# Each route's way of asking, and of being resumed (its own route, or ours).
ROUTES = {
    "native": ("/v1/replies", {"prompt": "x", "resumable": True, "keepalive_s": ASKED_S}, None),
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "resumable": True,
            "keepalive_s": ASKED_S,
        },
        None,
    ),
    "completions": (
        "/v1/completions",
        {"prompt": "x", "stream": True, "resumable": True, "keepalive_s": ASKED_S},
        None,
    ),
    "messages": (
        "/v1/messages",
        {
            "model": "simulated",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "replystream": {"resumable": True, "keepalive_s": ASKED_S},
        },
        None,
    ),
    "responses": (
        "/v1/responses",
        {"input": "x", "stream": True, "replystream": {"keepalive_s": ASKED_S}},
        "/v1/responses/resp_{id}?stream=true",
    ),
    "background response": (
        "/v1/responses",
        {"input": "x", "background": True, "replystream": {"keepalive_s": ASKED_S}},
        "/v1/responses/resp_{id}?stream=true",
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
async def test_every_routes_keepalive_is_kept_by_a_reader_on_another_replica(
    route: str, tmp_path: Path
):
    path, ask, resume_path = ROUTES[route]
    async with replicas(tmp_path, first_token_ms=FIRST_TOKEN_MS) as (maker, other):
        first = await started(maker, path, ask)
        reply_id = first.headers.get("x-reply-id")
        if reply_id is None:  # a background response's answer: the object, queued
            reply_id = json.loads(await first.read_body())["id"].removeprefix("resp_")
        target = (resume_path or "/v1/replies/{id}/stream").format(id=reply_id)
        resume = await raw_request(f"{other}{target}")
        assert resume.status == 200, await resume.read_body()
        resumed = await read_for(resume, WINDOW_S)
        await resume.aclose()
        await first.aclose()
    assert keepalives(resumed) >= 2, resumed


async def test_a_response_made_for_its_one_reader_is_joined_at_its_keepalive(tmp_path: Path):
    """``store: false``: a reply nobody may resume, joined on its own replica while its
    first reader reads it (after the two opening events it was sent: its log drops them)."""
    ask = {"input": "x", "stream": True, "store": False, "replystream": {"keepalive_s": ASKED_S}}
    async with one_server(first_token_ms=FIRST_TOKEN_MS) as (url, _):
        first = await started(url, "/v1/responses", ask)
        joined = await raw_request(
            f"{url}/v1/replies/{first.headers['x-reply-id']}/stream",
            headers={"Last-Event-ID": "2"},
        )
        assert joined.status == 200
        got = await read_for(joined, WINDOW_S)
        await joined.aclose()
        await first.aclose()
    assert keepalives(got) >= 2, got


@pytest.mark.parametrize("where", ["memory", "other"])
async def test_a_resume_may_ask_its_own_keepalive(where: str, tmp_path: Path):
    async with servers(where, tmp_path, first_token_ms=FIRST_TOKEN_MS) as (maker, reader):
        # The reply asks none (the server's 15 s), or one too long for the resume's way.
        for ask in ({}, {"keepalive_s": 60}):
            body = {"prompt": "x", "max_tokens": 3, "resumable": True, **ask}
            first = await started(maker, "/v1/replies", body)
            reply_id = first.headers["x-reply-id"]
            await first.aclose()
            resume = await raw_request(
                f"{reader}/v1/replies/{reply_id}/stream?keepalive_s={ASKED_S}",
                headers={"Last-Event-ID": "1"},
            )
            assert resume.status == 200
            resumed = await read_for(resume, WINDOW_S)
            await resume.aclose()
            assert keepalives(resumed) >= 2, (ask, resumed)


async def test_a_resumes_keepalive_is_refused_as_a_requests_is():
    async with one_server(first_token_ms=FIRST_TOKEN_MS) as (url, _):
        ask = {"prompt": "x", "max_tokens": 3, "resumable": True}
        first = await started(url, "/v1/replies", ask)
        reply_id = first.headers["x-reply-id"]
        stream = f"{url}/v1/replies/{reply_id}/stream"
        response = f"{url}/v1/responses/resp_{reply_id}"
        refused: dict[str, str] = {
            f"{stream}?keepalive_s=0.05": "keepalive_s must be at least 0.1, got",
            f"{stream}?keepalive_s=3601": "keepalive_s must be at most 3600.0, got",
            f"{stream}?keepalive_s=1e3": "keepalive_s must be a number of seconds",
            f"{stream}?keepalive_s=inf": "keepalive_s must be a number of seconds",
            f"{stream}?keepalive_s=": "keepalive_s must be a number of seconds",
            f"{stream}?keepalive_s=1&keepalive_s=2": "keepalive_s is given 2 times",
            # The object, sent whole, has nothing to keep alive (checked before the reply
            # is looked for: this one is no response).
            f"{response}?keepalive_s=1": "keepalive_s keeps a stream of events alive",
        }
        answers = {}
        for target in refused:
            answer = await raw_request(target)
            answers[target] = (answer.status, json.loads(await answer.read_body())["error"])
        await first.aclose()
    for target, words in refused.items():
        status, error = answers[target]
        assert status == 400, (target, status, error)
        assert error["param"] == "keepalive_s" and error["code"] == "invalid_value", error
        assert error["message"].startswith(words), (target, error)


@pytest.mark.parametrize("where", ["memory", "producer", "other"])
async def test_a_resume_replays_the_batches_and_hold_back_its_reply_asked_for(
    where: str, tmp_path: Path
):
    """The producer's options: a resume, live or after the end, reads the events they made
    (here three tokens each, and never a word of the banned phrase the window held back)."""
    text = "one two three four five six seven eight nine ten"
    config = ServerConfig(policy=DeliveryPolicy(checks=(BannedPhrases(["seven eight"]),)))
    engine = {"reply_text": text, "delay_ms": 20.0, "jitter_ms": 0.0}
    if where == "memory":
        context = one_server(config, **engine)
    else:
        context = replicas(tmp_path, config, **engine)
    async with context as (maker, other):
        reader = maker if where == "producer" else other
        ask = {"prompt": "x", "resumable": True, "batch_tokens": 3, "holdback_tokens": 2}
        first = await started(maker, "/v1/replies", ask)
        reply_id = first.headers["x-reply-id"]
        await first.reader.readuntil(b"event: token")  # dropped after its first batch
        await first.aclose()
        live = await raw_request(
            f"{reader}/v1/replies/{reply_id}/stream", headers={"Last-Event-ID": "1"}
        )
        resumed = await live.read_body()
        again = await raw_request(f"{reader}/v1/replies/{reply_id}/stream")
        replayed = await again.read_body()
    for body in (resumed, replayed):
        data = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]
        batches = [event["tokens"] for event in data if "text" in event]
        sent = "".join(event["text"] for event in data if "text" in event)
        # Three tokens an event; the last, flushed as the check stopped the reply, fewer.
        assert len(batches) >= 2 and set(batches[:-1]) == {3} and batches[-1] <= 3, batches
        assert "seven" not in sent, sent  # held back, then stopped
        assert b"event: moderated" in body and b"event: done" not in body, body
    assert replayed.endswith(resumed[resumed.index(b"event: token") :])
