"""bench and doctor against replystream's own OpenAI and Anthropic routes, with no --model.

Each test runs the real command as a subprocess against a real server process (or, for the
models-list cases, a real HTTP server on loopback that lists what the case needs).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
from aiohttp import web

from replystream.server import running
from tests.processes import replica


async def run_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "replystream",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_bench_and_doctor_find_the_model_our_server_lists():
    # Without --model both used to send "default" and get 404 model_not_found. Anthropic's
    # Messages route takes its model from the same list, its API from the path. The tools ask
    # the server's model list whatever its engine: the simulated one keeps the run short.
    async with replica("--engine", "simulated", "--delay-ms", "10", "--jitter-ms", "0") as (_, url):
        for route in ("/v1/chat/completions", "/v1/messages"):
            code, out, err = await run_cli("doctor", url + route, "--max-tokens", "60", "--json")
            assert code == 0, (route, out, err)
            result = json.loads(out)
            assert result["verdict"] == "streaming" and result["status"] == 200, result["reason"]
            code, out, err = await run_cli(
                "bench", url + route, "--requests", "3", "--output-tokens", "20", "--quiet"
            )
            assert code == 0, (route, out, err)
            assert "Requests: 3 sent, 3 complete" in out, route
        code, out, err = await run_cli(
            "bench", f"{url}/v1/completions", "--requests", "2", "--output-tokens", "10", "--quiet"
        )
        assert code == 0, (out, err)


def models_app(names: list[str]) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        data: list[dict[str, Any]] = [{"id": name, "object": "model"} for name in names]
        return web.json_response({"object": "list", "data": data})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    return app


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (["alpha", "beta"], "lists 2 models (alpha, beta); choose one with --model"),
        ([], "lists no model; name one with --model"),
    ],
)
@pytest.mark.parametrize("tool", ["bench", "doctor"])
async def test_no_single_listed_model_is_one_line_asking_for_model(tool, names, says):
    async with running(models_app(names)) as url:
        code, _, err = await run_cli(tool, f"{url}/v1/chat/completions")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == f"replystream {tool}: {url}/v1/models {says}"


@pytest.mark.parametrize("tool", ["bench", "doctor"])
async def test_model_for_an_api_without_one_is_refused(tool):
    code, _, err = await run_cli(tool, "http://127.0.0.1:9/stream", "--model", "m")
    assert code == 2
    assert err.strip().splitlines() == [
        f"replystream {tool}: --model names the model of an OpenAI request; the lab API has none"
    ]
