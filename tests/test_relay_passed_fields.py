"""What a relay sends its upstream as the client gave it, for an upstream that keeps accounts
(OpenAI's own, with the relay as a gateway in front): ``user``, ``safety_identifier``,
``service_tier``, and on chat ``metadata`` and ``store`` (a stored completion),
``reasoning_effort`` and ``verbosity`` (a response's ``text.verbosity``);
``prompt_cache_key`` everywhere (OpenAI's prompt caching reads it).
The Responses API stores its responses here, so its ``store`` and ``metadata`` stay here;
Anthropic's ``metadata.user_id`` goes up as ``user``. Nothing the client did not give is sent.

A relay in front of a small aiohttp upstream, both real servers on loopback ports."""

from __future__ import annotations

from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

ASK = [{"role": "user", "content": "hi"}]
ACCOUNT = {"user": "u-17", "safety_identifier": "s-9", "service_tier": "flex"}
CACHED = {"prompt_cache_key": "k"}


async def test_the_clients_account_fields_go_upstream_as_given_on_each_route():
    up = Upstream(["m"])
    stored = {
        "metadata": {"run": "a"},
        "store": True,
        "reasoning_effort": "low",
        "verbosity": "high",
    }
    async with relay([up]) as url:
        for path, body in (
            (
                "/v1/chat/completions",
                {"messages": ASK, "prompt_cache_key": "k", **ACCOUNT, **stored},
            ),
            ("/v1/completions", {"prompt": "hi", "prompt_cache_key": "k", **ACCOUNT}),
            (
                "/v1/responses",
                {
                    "input": "hi",
                    "prompt_cache_key": "k",
                    "metadata": {"run": "a"},
                    "text": {"verbosity": "low"},
                    **ACCOUNT,
                },
            ),
            (
                "/v1/messages",
                {"model": "m", "max_tokens": 5, "messages": ASK, "metadata": {"user_id": "u-17"}},
            ),
        ):
            got = await post_events(f"{url}{path}", body)
            assert got.status == 200, (path, got.raw)
    chat, text, response, message = (up.bodies[i] for i in range(4))
    assert {k: chat[k] for k in (*ACCOUNT, *stored, "prompt_cache_key")} == {
        **ACCOUNT,
        **stored,
        "prompt_cache_key": "k",
    }
    assert {k: text.get(k) for k in (*ACCOUNT, "prompt_cache_key")} == {
        **ACCOUNT,
        "prompt_cache_key": "k",
    }
    assert "reasoning_effort" not in text and "verbosity" not in text  # not legacy's fields
    assert {k: response.get(k) for k in ACCOUNT} == ACCOUNT and response["prompt_cache_key"] == "k"
    assert "store" not in response and "metadata" not in response  # a response is stored here
    assert response["verbosity"] == "low"  # text.verbosity, as chat names it
    assert message["user"] == "u-17"


async def test_nothing_the_client_left_out_is_sent():
    up = Upstream(["m"])
    async with relay([up]) as url:
        await post_events(f"{url}/v1/chat/completions", {"messages": ASK})
    sent = up.bodies[0]
    for name in (
        *ACCOUNT,
        "metadata",
        "store",
        "reasoning_effort",
        "verbosity",
        "prompt_cache_key",
    ):
        assert name not in sent
