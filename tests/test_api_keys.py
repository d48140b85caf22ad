"""Bearer API keys on /v1/*: 401 without a valid key; a reply belongs to the key that started it."""

import argparse
import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import openai
import pytest

from replystream.server import create_app, running
from replystream.server.api_keys import collect_keys, read_keys_file
from replystream.server.auth import KeyRing, key_owner
from replystream.server.command import add_arguments, build_config
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-beta-9876543210"
CONFIG = ServerConfig(api_keys=(KEY_A, KEY_B))
USER = [{"role": "user", "content": "hi"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def assert_401(response: aiohttp.ClientResponse) -> None:
    assert response.status == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = (await response.json())["error"]
    # OpenAI types a wrong key a request error, its code telling which
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/replies"),
        ("GET", "/v1/models"),
        ("GET", "/v1/replies/abc/stream"),
        ("POST", "/v1/replies/abc/cancel"),
        ("GET", "/v1/nothing-here"),
    ],
)
async def test_missing_or_wrong_key_is_401_on_every_v1_route(method, path, caplog):
    caplog.set_level(logging.DEBUG)
    engine = fast_engine()
    async with running(create_app(engine, CONFIG)) as url, aiohttp.ClientSession() as http:
        for headers in ({}, bearer("sk-wrong"), bearer(KEY_A + "x"), {"Authorization": KEY_A}):
            async with http.request(method, f"{url}{path}", json={}, headers=headers) as response:
                await assert_401(response)
    assert engine.stats().started == 0
    assert KEY_A not in caplog.text and "sk-wrong" not in caplog.text


async def test_the_lab_routes_generate_only_for_a_key():
    # /wait and /stream make replies as /v1/replies does (a relay's with its upstream key):
    # with keys on, no key may not make one there either.
    engine = fast_engine()
    async with running(create_app(engine, CONFIG)) as url, aiohttp.ClientSession() as http:
        for path in ("/wait?max_tokens=2", "/stream?max_tokens=2", "/stream?resumable=1"):
            for headers in ({}, bearer("sk-wrong")):
                async with http.get(f"{url}{path}", headers=headers) as response:
                    await assert_401(response)
        assert engine.stats().started == 0
        async with http.get(f"{url}/stream?resumable=1&max_tokens=2", headers=bearer(KEY_A)) as r:
            assert r.status == 200
            reply_id = r.headers["X-Reply-Id"]
            await r.read()
        async with http.get(f"{url}/wait?max_tokens=2", headers={"x-api-key": KEY_B}) as r:
            assert r.status == 200
        # the lab's resumable reply is its key's, as any other
        resume = f"{url}/v1/replies/{reply_id}/stream"
        async with http.get(resume, headers=bearer(KEY_B)) as r:
            assert r.status == 404
        async with http.get(resume, headers=bearer(KEY_A)) as r:
            assert r.status == 200


async def test_health_metrics_and_pages_need_no_key():
    async with running(create_app(fast_engine(), CONFIG)) as url, aiohttp.ClientSession() as http:
        for path in ("/healthz", "/metrics", "/"):
            async with http.get(f"{url}{path}") as response:
                assert response.status == 200, path


async def test_right_key_works_with_the_sdk():
    async with running(create_app(fast_engine(), CONFIG)) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0) as sdk:
            reply = await sdk.chat.completions.create(
                model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.choices[0].message.content == "A language model "
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0) as sdk:
            with pytest.raises(openai.AuthenticationError):
                await sdk.models.list()


async def test_only_the_key_that_started_a_reply_may_resume_or_cancel_it():
    engine = fast_engine(delay_ms=20, jitter_ms=0)
    body = {"messages": USER, "stream": True, "resumable": True, "max_tokens": 5}
    async with running(create_app(engine, CONFIG)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=bearer(KEY_A)) as r:
            reply_id = r.headers["X-Reply-Id"]
            original = await r.text()
        resume = f"{url}/v1/replies/{reply_id}/stream"
        cancel = f"{url}/v1/replies/{reply_id}/cancel"
        async with http.get(resume, headers=bearer(KEY_B)) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "reply_not_found"
        async with http.post(cancel, headers=bearer(KEY_B)) as response:
            assert response.status == 404
        async with http.get(resume, headers=bearer(KEY_A)) as response:
            assert response.status == 200
            assert await response.text() == original  # the whole log, replayed
        # EventSource cannot send headers: the key may ride in the query of a resume only.
        async with http.get(resume, params={"api_key": KEY_A}) as response:
            assert response.status == 200
        async with http.get(resume, params={"api_key": KEY_B}) as response:
            assert response.status == 404
        async with http.post(cancel, params={"api_key": KEY_A}) as response:
            await assert_401(response)
        async with http.post(cancel, headers=bearer(KEY_A)) as response:
            assert response.status == 200


async def test_a_request_offering_two_different_keys_is_401():
    # Which key would be meant is a guess, and whose reply it is with it: both are refused.
    async with running(create_app(fast_engine(), CONFIG)) as url, aiohttp.ClientSession() as http:
        started = await http.post(
            f"{url}/v1/replies", json={"prompt": "x", "resumable": True}, headers=bearer(KEY_A)
        )
        reply_id = started.headers["X-Reply-Id"]
        await started.read()
        resume = f"{url}/v1/replies/{reply_id}/stream"
        two: list[tuple[dict[str, str], list[tuple[str, str]]]] = [
            ({**bearer(KEY_A), "x-api-key": KEY_B}, []),
            (bearer(KEY_A), [("api_key", KEY_B)]),
            ({}, [("api_key", KEY_A), ("api_key", KEY_B)]),
        ]
        for headers, params in two:
            async with http.get(resume, headers=headers, params=params) as response:
                await assert_401(response)
        same = {**bearer(KEY_A), "x-api-key": KEY_A}  # one key, said twice
        async with http.get(resume, headers=same, params={"api_key": KEY_A}) as response:
            assert response.status == 200
            await response.read()


@pytest.mark.parametrize(
    ("path", "header"),
    [
        ("/v1/models", b"x-api-key: \xff"),  # not UTF-8
        ("/v1/chat/completions", b"Authorization: Bearer sk-\xed\xa0\x80"),  # a surrogate
        ("/v1/messages", b"x-api-key: \xc3"),  # cut inside a character
    ],
)
async def test_a_key_that_is_not_utf8_is_401_not_an_error(path, header, caplog):
    # aiohttp hands such header bytes over as surrogate escapes, which no key can equal.
    caplog.set_level(logging.DEBUG)
    async with running(create_app(fast_engine(), CONFIG)) as url:
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\n%s\r\nContent-Length: 2\r\n"
            b"Connection: close\r\n\r\n{}" % (path.encode(), header)
        )
        answer = await reader.read()
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), answer
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key"
    assert "Traceback" not in caplog.text and "unhandled" not in caplog.text


def test_key_ring_matches_exactly_and_never_shows_keys():
    ring = KeyRing([KEY_A, KEY_B])
    assert ring.accepts(KEY_A) and ring.accepts(KEY_B)
    assert not ring.accepts("") and not ring.accepts(KEY_A[:-1]) and not ring.accepts("é")
    assert not ring.accepts(KEY_A + "\udcff") and not ring.accepts("\ud800")
    assert KEY_A not in repr(ring)
    assert key_owner(KEY_A) != key_owner(KEY_B) and KEY_A not in key_owner(KEY_A)
    with pytest.raises(ValueError):
        KeyRing([""])


def test_keys_come_from_flags_and_a_file_with_comments(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-one\n\n  sk-two  \n  # old: sk-three\n")
    assert read_keys_file(path) == ["sk-one", "sk-two"]
    assert collect_keys(["sk-flag"], path) == ["sk-flag", "sk-one", "sk-two"]
    assert collect_keys([], None) == []
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API keys"):
        read_keys_file(empty)
    with pytest.raises(ValueError):
        collect_keys([" "], None)


def test_a_keys_file_that_cannot_be_read_is_a_value_error_naming_flag_and_file(tmp_path: Path):
    # Read again on SIGHUP, the file is checked by nothing else: its reload line names it.
    path = tmp_path / "keys"
    path.write_bytes(b"sk-one\nsk-\xff\n")
    with pytest.raises(ValueError) as raised:
        collect_keys([], path)
    assert str(raised.value) == (
        f"--api-keys-file {path}: not UTF-8 text (byte 0xff at offset 10: invalid start byte)"
    )
    with pytest.raises(ValueError, match=f"^--api-keys-file {tmp_path}: cannot be read"):
        collect_keys([], tmp_path)


def test_serve_flags_reach_the_server_config(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("sk-file\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--api-key", "sk-flag", "--api-keys-file", str(path)]
    args = parser.parse_args([*flags, "--model-name", "m1", "--ws-max-replies", "3"])
    config = build_config(args)
    assert config.api_keys == ("sk-flag", "sk-file")
    assert (config.model_name, config.ws_max_replies) == ("m1", 3)
    assert "sk-flag" not in repr(config)
    assert build_config(parser.parse_args([])).api_keys == ()
