"""``add_generation_prompt`` and ``continue_final_message`` do what they say on every engine
that builds a prompt: a chat template leaves out its generation prompt, or leaves the final
message open to be continued; an engine with no template refuses a generation prompt it
cannot add; the relay passes both fields on to its upstream as the client gave them."""

from __future__ import annotations

import json
from typing import Any

from replystream.engine.base import GenerationRequest
from replystream.engine.chat_template import ChatTemplate
from replystream.engine.gguf_engine import prompt_format
from replystream.engine.gguf_file import open_gguf
from replystream.engine.gguf_tokenizer import build_tokenizer
from replystream.engine.tiny import load_default_engine
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig, UpstreamTarget
from replystream.server import create_app, running
from tests.services import require_smollm2
from tests.sse_client import post_events
from tests.test_upstream_faults import fake_upstream

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRIMMING = CHATML.replace("message['content']", "message['content'] | trim")
QUESTION = {"role": "user", "content": "What is the capital of France?"}
STARTED = {"role": "assistant", "content": "The capital of France is "}


def chat(*messages: dict[str, Any], **fields: Any) -> GenerationRequest:
    return GenerationRequest("", messages=messages, **fields)


def test_a_template_continues_the_final_message_where_its_text_ends() -> None:
    template = ChatTemplate(CHATML)
    asked = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert template.render([QUESTION], add_generation_prompt=False) == asked
    continued = template.render([QUESTION, STARTED], continue_final_message=True)
    assert continued == asked + "<|im_start|>assistant\nThe capital of France is "
    empty = {"role": "assistant", "content": ""}
    assert template.render([QUESTION, empty], continue_final_message=True) == (
        asked + "<|im_start|>assistant\n"
    )
    # A template that trims messages trims the continued one too, as transformers does.
    trimmed = ChatTemplate(TRIMMING).render([QUESTION, STARTED], continue_final_message=True)
    assert trimmed == asked + "<|im_start|>assistant\nThe capital of France is"


def test_smollm2s_prompt_honours_both_fields() -> None:
    gguf = open_gguf(require_smollm2())  # the header only: no weights are dequantised
    tokenizer = build_tokenizer(gguf.vocabulary)
    prompts = prompt_format(gguf, tokenizer)
    template = ChatTemplate(gguf.vocabulary.chat_template or "")
    opening = tokenizer.encode("<|im_start|>assistant\n")
    usual = prompts.prompt_ids(chat(QUESTION))
    assert usual[-len(opening) :] == opening
    without = prompts.prompt_ids(chat(QUESTION, add_generation_prompt=False))
    assert without == usual[: -len(opening)]
    assert tokenizer.decode(without).endswith("France?\n")  # control tokens decode to nothing
    continued = prompts.prompt_ids(
        chat(QUESTION, STARTED, prefix=STARTED["content"], continue_final_message=True)
    )
    rendered = template.render([QUESTION, STARTED], add_generation_prompt=False)
    assert continued == tokenizer.encode(rendered.removesuffix("<|im_end|>\n"))


async def test_an_engine_without_a_template_refuses_a_generation_prompt_it_cannot_add() -> None:
    engine = load_default_engine()
    try:
        async with running(create_app(engine)) as url:
            base = {"messages": [QUESTION], "max_tokens": 2, "stream": False}
            refused = await post_events(
                f"{url}/v1/chat/completions", {**base, "add_generation_prompt": True}
            )
            served = await post_events(
                f"{url}/v1/chat/completions", {**base, "add_generation_prompt": False}
            )
    finally:
        await engine.aclose()
    assert refused.status == 400
    assert json.loads(refused.raw)["error"]["param"] == "add_generation_prompt"
    assert served.status == 200


async def test_the_relay_passes_both_fields_on_as_the_client_gave_them() -> None:
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            bodies = (
                {"messages": [QUESTION], "add_generation_prompt": False},
                {"messages": [QUESTION]},
                {
                    "messages": [QUESTION, {"role": "assistant", "content": ""}],
                    "continue_final_message": True,
                },
            )
            for body in bodies:
                got = await post_events(f"{relay}/v1/chat/completions", body)
                assert got.status == 200
    sent = [(b.get("add_generation_prompt"), b.get("continue_final_message")) for b in fake.bodies]
    # Not given: not sent (the upstream's default); an empty final message is continued too.
    assert sent == [(False, None), (None, None), (False, True)]


async def test_the_relay_continues_an_anthropic_prefill_upstream() -> None:
    async with fake_upstream() as (fake, upstream):
        engine = UpstreamEngine(UpstreamConfig((UpstreamTarget(f"{upstream}/ok/v1"),), model="m"))
        async with running(create_app(engine)) as relay:
            body = {
                "model": "m",  # the model the relay sends a request for none as
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"},
                ],
            }
            got = await post_events(f"{relay}/v1/messages", body)
            assert got.status == 200, got.raw
    sent = fake.bodies[0]
    assert sent["messages"][-1] == {"role": "assistant", "content": "The capital of France is"}
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
