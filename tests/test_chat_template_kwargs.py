"""vLLM's ``chat_template_kwargs``: more variables for a model's chat template (Qwen3's
``enable_thinking``, say). A built-in engine with a template gives them to it, one without a
template refuses them, a relay passes them on as given, and no variable may stand for what the
template is given anyway (``messages``, the special tokens) or calls, nor be a ``chat_template``.

Real servers on loopback sockets: the tiny model with a template that reads a variable, and a
relay in front of a small aiohttp upstream."""

from __future__ import annotations

import json

import aiohttp
import pytest

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.prompts import ChatPrompt
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.sse_client import post_events
from tests.test_upstream_routing import Upstream, relay

# As Qwen3's template does with its ``enable_thinking``: a variable the client may set.
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}{{ '/no_think\\n' }}{% endif %}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
ASK = [{"role": "user", "content": "Who spake?"}]


def tiny_reading_a_variable() -> TinyEngine:
    default = load_default_engine()
    newline = default.tokenizer.encode("\n")[0]
    prompts = ChatPrompt(default.tokenizer, ChatTemplate(TEMPLATE), newline)
    return TinyEngine(default.model, default.tokenizer, prompts=prompts)


def test_the_variables_reach_the_template_and_never_replace_its_own():
    template = ChatTemplate(TEMPLATE)
    plain = template.render(ASK)
    assert template.render(ASK, variables={"enable_thinking": False}) == "/no_think\n" + plain
    assert template.render(ASK, variables={"enable_thinking": True}) == plain
    # Given anyway, here: a variable of that name cannot stand for it.
    assert template.render(ASK, variables={"messages": [], "add_generation_prompt": False}) == plain


async def test_a_templated_engine_reads_them_and_one_without_a_template_refuses_them():
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    async with running(create_app(tiny_reading_a_variable())) as url:
        plain = await post_events(f"{url}/v1/chat/completions", body)
        thinking_off = await post_events(f"{url}/v1/chat/completions", off)
    counted = [json.loads(got.raw)["usage"]["prompt_tokens"] for got in (plain, thinking_off)]
    assert counted[1] > counted[0]  # the template wrote its /no_think line
    async with running(create_app(load_default_engine(), ServerConfig())) as url:
        refused = await post_events(f"{url}/v1/chat/completions", off)
    assert refused.status == 400
    error = json.loads(refused.raw)["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", "chat_template_kwargs")
    assert "no chat template" in error["message"]


async def test_a_relay_passes_them_on_as_given():
    up = Upstream(["m"])
    kwargs = {"enable_thinking": False, "custom": {"depth": [1, 2]}}
    async with relay([up]) as url:
        await post_events(
            f"{url}/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": kwargs}
        )
        await post_events(f"{url}/v1/chat/completions", {"messages": ASK})
    assert up.bodies[0]["chat_template_kwargs"] == kwargs
    assert "chat_template_kwargs" not in up.bodies[1]


@pytest.mark.parametrize(
    "name", ["messages", "bos_token", "add_generation_prompt", "chat_template", "raise_exception"]
)
async def test_a_variable_the_template_has_already_is_a_400_naming_the_field(name: str):
    async with relay([Upstream(["m"])]) as url:
        got = await post_events(
            f"{url}/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {name: 1}}
        )
    assert got.status == 400
    error = json.loads(got.raw)["error"]
    assert error["param"] == "chat_template_kwargs" and repr(name) in error["message"]


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN"])
async def test_a_number_json_has_not_is_a_400_not_written_on_as_infinity(number: str):
    # The JSON parser reads 1e999 as infinity and takes NaN, which is no JSON: passed on as
    # given, they would reach the upstream as Infinity and NaN, which strict parsers refuse.
    up = Upstream(["m"])
    raw = '{"messages": [{"role": "user", "content": "hi"}], '
    raw += f'"chat_template_kwargs": {{"custom": {{"depth": [1, {number}]}}}}}}'
    headers = {"Content-Type": "application/json"}
    async with relay([up]) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", data=raw, headers=headers) as got:
            status, error = got.status, (await got.json())["error"]
    assert status == 400, error
    assert error["param"] == "chat_template_kwargs"
    assert "custom/depth/1" in error["message"] and "infinity or NaN" in error["message"]
    assert up.bodies == []
