"""A response deleted while it is read: every reader (its creator's stream, a ``GET`` of its
events, a resume through the native route, on the producing replica or another) is told
``deleted``, not that it expired; and each dialect spells that notice its own way.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from replystream.delivery import anthropic_format, openai_formats, responses_log
from replystream.server import create_app, running
from replystream.sse import EventParser
from tests.conftest import fast_engine
from tests.test_responses_replicas import two_slow_replicas

DELETED = {"code": "deleted", "message": "the reply was deleted while being read"}


async def events_until_deleted(
    http: aiohttp.ClientSession, read: str, delete: str, response_id: str, after_events: int = 8
) -> list[tuple[str, dict[str, Any]]]:
    """Read ``read`` (a stream of the response's events) until it ends, deleting the response
    through ``delete`` (a replica's URL) once ``after_events`` events came."""
    parser = EventParser()
    seen: list[tuple[str, dict[str, Any]]] = []
    async with asyncio.timeout(20), http.get(read) as stream:
        assert stream.status == 200, await stream.text()
        async for chunk in stream.content.iter_any():
            before = len(seen)
            seen += [(e.type, json.loads(e.data)) for e in parser.feed(chunk)]
            if before < after_events <= len(seen):
                async with http.delete(f"{delete}/v1/responses/{response_id}") as deleted:
                    assert deleted.status == 200, await deleted.text()
    return seen


def assert_told_deleted(seen: list[tuple[str, dict[str, Any]]]) -> None:
    kinds = [kind for kind, _ in seen]
    assert kinds.count("response.output_text.delta") >= 2, kinds
    # The error alone: the response did not fail, and there is no object left to tell.
    kind, error = seen[-1]
    assert kind == "error" and error["type"] == "error", seen[-3:]
    assert {"code": error["code"], "message": error["message"]} == DELETED
    assert error["param"] is None
    assert error["sequence_number"] == seen[-2][1]["sequence_number"]
    assert "response.failed" not in kinds


async def background(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/v1/responses", json={"input": "x", "background": True}) as made:
        assert made.status == 200, await made.text()
        return str((await made.json())["id"])


async def test_every_reader_of_a_response_deleted_while_read_is_told_deleted_not_expired():
    engine = fast_engine(delay_ms=30.0, jitter_ms=0.0)
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        for route in ("/v1/responses/{id}?stream=true", "/v1/replies/{reply}/stream"):
            response_id = await background(http, url)
            read = url + route.format(id=response_id, reply=response_id.removeprefix("resp_"))
            assert_told_deleted(await events_until_deleted(http, read, url, response_id))
            async with http.get(f"{url}/v1/responses/{response_id}") as gone:
                assert gone.status == 404
        # The creator's own stream.
        parser = EventParser()
        seen: list[tuple[str, dict[str, Any]]] = []
        body = {"input": "x", "stream": True}
        async with asyncio.timeout(20), http.post(f"{url}/v1/responses", json=body) as stream:
            async for chunk in stream.content.iter_any():
                before = len(seen)
                seen += [(e.type, json.loads(e.data)) for e in parser.feed(chunk)]
                if before < 7 <= len(seen):
                    response_id = seen[0][1]["response"]["id"]
                    async with http.delete(f"{url}/v1/responses/{response_id}") as deleted:
                        assert deleted.status == 200
        assert_told_deleted(seen)


async def test_a_response_deleted_on_either_replica_is_told_deleted_to_readers_on_both(
    tmp_path: Path,
):
    async with two_slow_replicas(tmp_path) as (a_url, b_url, _, http):
        # Made on A; read on A (its own copy) or on B (from Redis); deleted on either.
        cases = [(read, delete) for read in (a_url, b_url) for delete in (a_url, b_url)]
        ids = [await background(http, a_url) for _ in cases]
        told = await asyncio.gather(
            *(
                events_until_deleted(
                    http, f"{read}/v1/responses/{response_id}?stream=true", delete, response_id
                )
                for (read, delete), response_id in zip(cases, ids, strict=True)
            )
        )
    for seen in told:
        assert_told_deleted(seen)


def test_each_dialect_spells_a_reply_deleted_while_read_as_its_own_error():
    notice = json.dumps({"error": DELETED})
    # Chat and completions: the error object the OpenAI SDKs raise APIError on.
    [(kind, data)] = openai_formats.ReaderNotices()("error", notice, 4)
    assert kind == "error"
    assert json.loads(data) == {"error": DELETED | {"type": "server_error", "param": None}}
    # Anthropic's Messages: its error event.
    [(kind, data)] = anthropic_format.ReaderNotices()("error", notice, 4)
    assert kind == "error"
    assert json.loads(data) == {"type": "error", "error": DELETED | {"type": "api_error"}}
    # Responses: OpenAI's error event alone (no response.failed: the response did not fail).
    opened = {"id": "resp_r", "object": "response", "status": "in_progress"}
    [(kind, data)] = responses_log.ReaderNotices("r", opened)("error", notice, 4)
    assert kind == "error"
    assert json.loads(data) == {
        "type": "error",
        "sequence_number": 3,
        "param": None,
        **DELETED,
    }
