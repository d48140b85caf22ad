"""A path no route serves is nobody's route: an Anthropic client (a request with
``anthropic-version``, which its SDKs always send) is answered in Anthropic's error shape, held
to Anthropic's own schema (``tests/schemas/anthropic_error_response.json``), as on the routes
both APIs have; a client without the header keeps OpenAI's. Over a real server on loopback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from jsonschema import Draft202012Validator

from replystream.server import create_app, running
from tests.conftest import fast_engine

SCHEMA = json.loads((Path(__file__).parent / "schemas/anthropic_error_response.json").read_text())
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def schema_errors(body: Any) -> list[str]:
    validator = Draft202012Validator(SCHEMA)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("POST", "/v1/complete", 404, "not_found_error"),  # Anthropic's legacy completions
        ("GET", "/v1/files", 404, "not_found_error"),  # its Files API (beta)
        ("DELETE", "/v1/chat/completions", 405, "invalid_request_error"),  # not this method
    ],
)
async def test_a_path_no_route_serves_answers_an_anthropic_client_in_anthropics_shape(
    method: str, path: str, status: int, kind: str
):
    async with running(create_app(fast_engine())) as url, aiohttp.ClientSession() as session:
        async with session.request(method, url + path, headers=ANTHROPIC) as response:
            body = await response.json()
            assert response.status == status, body
            assert schema_errors(body) == [], body
            assert body["error"]["type"] == kind
            assert body["request_id"] == response.headers["request-id"]
            assert "anthropic-version" in response.headers.getall("Vary", [])
        async with session.request(method, url + path) as response:  # an OpenAI client's
            body = await response.json()
            assert response.status == status
            assert set(body) == {"error"}
            assert body["error"]["type"] == "invalid_request_error"
            assert "anthropic-version" in response.headers.getall("Vary", [])


async def test_the_anthropic_sdk_reads_a_missing_endpoint_as_its_own_not_found_error():
    async with running(create_app(fast_engine())) as url:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(anthropic.NotFoundError) as raised:
                await client.beta.files.list()
        assert isinstance(raised.value.body, dict)
        assert raised.value.body["type"] == "error"
        assert raised.value.body["error"]["type"] == "not_found_error"
        assert raised.value.request_id is not None
