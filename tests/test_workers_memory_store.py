"""``serve --workers 2`` without ``--redis-url``: each worker keeps its own replies, and a
request for one another worker made is told so, not only that the reply is unknown."""

import json
from collections.abc import Awaitable, Callable

from tests.processes import start_server, stop
from tests.rawhttp import RawResponse, raw_request
from tests.test_workers import children_of


async def answered_by_the_other(
    ask: Callable[[], Awaitable[RawResponse]],
) -> tuple[int, dict[str, object]]:
    """``ask`` on new connections, which the kernel spreads over the workers (each listens on
    a socket of its own), until one that did not make the reply answers: its answer, as
    JSON. Twenty tries all on the one worker would be one chance in a million."""
    answers = []
    for _ in range(20):
        response = await ask()
        body = await response.read_body()
        answers.append(response.status)
        if response.status != 200:
            return response.status, json.loads(body)["error"]
    raise AssertionError(f"every answer found it: {answers}")


async def test_a_reply_or_response_another_worker_made_is_a_404_that_says_so():
    process, url = await start_server("--engine", "simulated", "--tokens", "3", "--workers", "2")
    try:
        workers = children_of(process.pid)
        assert len(workers) == 2
        start = await raw_request(
            f"{url}/v1/replies", "POST", b'{"prompt": "x", "resumable": true}'
        )
        reply_id = start.headers["x-reply-id"]
        await start.read_body()

        def resume() -> Awaitable[RawResponse]:
            return raw_request(f"{url}/v1/replies/{reply_id}/stream")

        status, error = await answered_by_the_other(resume)
        assert (status, error["code"]) == (404, "reply_not_found")
        assert "another of this server's workers" in str(error["message"])
        assert "--redis-url" in str(error["message"])

        made = await raw_request(
            f"{url}/v1/responses", "POST", b'{"model": "simulated", "input": "x"}'
        )
        response_id = json.loads(await made.read_body())["id"]
        body = json.dumps(
            {"model": "simulated", "input": "more", "previous_response_id": response_id}
        ).encode()

        def go_on() -> Awaitable[RawResponse]:
            return raw_request(f"{url}/v1/responses", "POST", body)

        status, error = await answered_by_the_other(go_on)
        assert (status, error["code"]) == (400, "previous_response_not_found")
        assert "another of this server's workers" in str(error["message"])
    finally:
        await stop(process)
