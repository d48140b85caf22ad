"""Check the relay against a real model server: every dialect, through the official SDKs.

What this file decides: which behaviours of a relayed reply are checked against a real
OpenAI-compatible server (llama.cpp's, llama-cpp-python's, vLLM, TGI, Ollama, ...) that the
test suite cannot start (it needs the server, and often a GPU), and how each is judged. It
starts ``replystream serve --engine upstream:URL`` in a child process in front of the given
server, and sends greedy requests (``temperature: 0``, so the server's own answer is the
reference) with the ``openai`` and ``anthropic`` SDKs:
- the models the server lists are listed by the relay;
- a streamed chat reply is the server's own, word for word, with a finish reason and usage;
- a reply cut by ``max_tokens`` finishes ``length`` with that many tokens;
- a stop string the server's reply holds cuts it there, named as the stop that ended it on
  Anthropic's Messages API (``stop_sequence``) and as ``stop`` on OpenAI's;
- log probabilities, one per token, whose tokens spell the text (when the server has them);
- the Responses API, streamed, ends ``incomplete`` at its ``max_output_tokens``;
- JSON a schema describes (chat's ``response_format``, the Responses API's ``text.format``,
  Anthropic's ``output_config.format``),
  the server's grammar holding its text to it, read by the SDKs' parse helpers (a server
  that refuses it fails this check with its own 400);
- vLLM's sampling extras reach it: with ``ignore_eos`` a reply that ends early by itself runs
  to its ``max_tokens`` (``min_p``, ``chat_template_kwargs`` sent with it are accepted);
- a stream the client closes early leaves the server serving the next request;
- three streams at once all complete (a server that serves one request at a time and cuts the
  running one for a newer, as llama-cpp-python's does by default, needs
  ``--max-outstanding 1``).
Prints one line per check and exits 1 if any failed. Needs the ``test`` extra (the SDKs).

Run: python benchmarks/relay/real_upstream_check.py --upstream http://127.0.0.1:8080/v1
         [--model NAME] [--max-outstanding N]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel

from replystream.lab.local_server import serve_process

ASKED = "Name three colours, with a sentence on each."
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": ASKED}]
ANTHROPIC_QUESTION: list[MessageParam] = [{"role": "user", "content": ASKED}]
Check = Callable[["Clients"], Awaitable[str]]


class CheckFailed(Exception):
    """A check's expectation was not met (its message says how)."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


class Clients:
    """The SDK clients: to the relay, and to the server directly (the reference)."""

    def __init__(self, relay: str, upstream: str, model: str) -> None:
        self.relay = openai.AsyncOpenAI(base_url=f"{relay}/v1", api_key="unused", max_retries=0)
        self.direct = openai.AsyncOpenAI(base_url=upstream, api_key="unused", max_retries=0)
        self.anthropic = anthropic.AsyncAnthropic(base_url=relay, api_key="unused", max_retries=0)
        self.model = model

    async def streamed(self, client: openai.AsyncOpenAI, **ask: Any) -> tuple[str, str, Any]:
        """A streamed chat reply's text, finish reason and usage."""
        parts: list[str] = []
        finish, usage = "", None
        stream = await client.chat.completions.create(
            model=self.model, messages=QUESTION, temperature=0, stream=True, **ask
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(parts), finish, usage


async def lists_the_models(c: Clients) -> str:
    listed = [m.id async for m in c.relay.models.list()]
    expect(c.model in listed, f"{c.model!r} not in the relay's list {listed}")
    return f"lists {listed}"


async def streams_the_servers_own_reply(c: Clients) -> str:
    options = {"max_tokens": 40, "stream_options": {"include_usage": True}}
    text, finish, usage = await c.streamed(c.relay, **options)
    reference, _, _ = await c.streamed(c.direct, max_tokens=40)
    expect(text == reference, f"relayed {text!r}, the server's own {reference!r}")
    expect(finish in ("stop", "length"), f"finish reason {finish!r}")
    expect(usage is not None and usage.completion_tokens > 0, f"usage {usage}")
    return f"{len(text)} characters, {finish}, usage {usage.completion_tokens if usage else 0}"


async def cuts_at_max_tokens(c: Clients) -> str:
    reply = await c.relay.chat.completions.create(
        model=c.model, messages=QUESTION, temperature=0, max_tokens=3
    )
    choice, usage = reply.choices[0], reply.usage
    expect(choice.finish_reason == "length", f"finish reason {choice.finish_reason!r}")
    expect(usage is not None and usage.completion_tokens == 3, f"usage {usage}")
    return f"length after {choice.message.content!r}"


async def names_the_stop_string(c: Clients) -> str:
    reference, _, _ = await c.streamed(c.direct, max_tokens=40)
    stop = next((mark for mark in (",", ".", ":", " ") if mark in reference.strip()), None)
    expect(stop is not None, f"no stop string to try in {reference!r}")
    assert stop is not None
    before = reference[: reference.index(stop)]
    text, finish, _ = await c.streamed(c.relay, max_tokens=40, stop=[stop])
    expect((text, finish) == (before, "stop"), f"OpenAI: {text!r}, {finish!r}")
    message = await c.anthropic.messages.create(
        model=c.model,
        max_tokens=40,
        messages=ANTHROPIC_QUESTION,
        stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    said = "".join(block.text for block in message.content if block.type == "text")
    expect(said == before, f"Anthropic text {said!r}, expected {before!r}")
    expect(
        (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop),
        f"Anthropic: {message.stop_reason!r}, stop_sequence {message.stop_sequence!r}",
    )
    return f"cut at {stop!r} on both"


async def gives_log_probabilities(c: Clients) -> str:
    reply = await c.relay.chat.completions.create(
        model=c.model,
        messages=QUESTION,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
    )
    choice = reply.choices[0]
    content = choice.logprobs.content if choice.logprobs else None
    expect(bool(content), "no log probabilities")
    assert content is not None
    spelled = "".join(token.token for token in content)
    expect(
        spelled == choice.message.content, f"tokens {spelled!r}, text {choice.message.content!r}"
    )
    return f"{len(content)} tokens, {len(content[0].top_logprobs)} alternatives each"


async def ends_a_response_incomplete(c: Clients) -> str:
    kinds: list[str] = []
    final: Any = None
    stream = await c.relay.responses.create(
        model=c.model,
        input="Name three colours.",
        max_output_tokens=5,
        temperature=0,
        stream=True,
    )
    async for event in stream:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    expect(final is not None and final.status == "incomplete", f"ended {kinds[-1:]}")
    reason = final.incomplete_details.reason if final.incomplete_details else None
    expect(reason == "max_output_tokens", f"incomplete for {reason!r}")
    return f"{len(kinds)} events, incomplete at max_output_tokens"


class Capital(BaseModel):
    city: str
    country: str


CAPITAL: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in JSON."}
]


async def holds_the_text_to_a_schema(c: Clients) -> str:
    chat = await c.relay.chat.completions.parse(
        model=c.model, messages=CAPITAL, response_format=Capital, temperature=0, max_tokens=60
    )
    parsed = chat.choices[0].message.parsed
    expect(parsed is not None, f"chat: no parse of {chat.choices[0].message.content!r}")
    response = await c.relay.responses.parse(
        model=c.model,
        input=str(CAPITAL[0]["content"]),
        text_format=Capital,
        temperature=0,
        max_output_tokens=60,
    )
    expect(response.output_parsed is not None, f"Responses: no parse of {response.output_text!r}")
    message = await c.anthropic.messages.parse(
        model=c.model,
        max_tokens=60,
        messages=[{"role": "user", "content": str(CAPITAL[0]["content"])}],
        output_format=Capital,
        extra_body={"temperature": 0},
    )
    expect(message.parsed_output is not None, f"Anthropic: no parse of {message.content!r}")
    return f"chat {parsed}; Responses {response.output_parsed}; Anthropic {message.parsed_output}"


async def runs_past_the_end_with_ignore_eos(c: Clients) -> str:
    short: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi."}]
    ask: dict[str, Any] = {"model": c.model, "messages": short, "temperature": 0, "max_tokens": 48}
    ended = await c.relay.chat.completions.create(**ask)
    expect(ended.choices[0].finish_reason == "stop", f"ended {ended.choices[0].finish_reason!r}")
    extras = {"ignore_eos": True, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False}}
    held = await c.relay.chat.completions.create(**ask, extra_body=extras)
    made = held.usage.completion_tokens if held.usage else 0
    expect(held.choices[0].finish_reason == "length", f"ended {held.choices[0].finish_reason!r}")
    expect(made == 48, f"{made} tokens, not 48")
    return f"{ended.usage.completion_tokens if ended.usage else '?'} tokens alone, 48 with it"


async def serves_on_after_a_client_leaves(c: Clients) -> str:
    stream = await c.relay.chat.completions.create(
        model=c.model, messages=QUESTION, temperature=0, max_tokens=200, stream=True
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    _, finish, _ = await c.streamed(c.relay, max_tokens=5)
    expect(finish in ("stop", "length"), f"the next request finished {finish!r}")
    return "the next request was served"


async def serves_three_at_once(c: Clients) -> str:
    replies = await asyncio.gather(*(c.streamed(c.relay, max_tokens=10) for _ in range(3)))
    finishes = [finish for _, finish, _ in replies]
    expect(all(f in ("stop", "length") for f in finishes), f"finish reasons {finishes}")
    return f"finish reasons {finishes}"


CHECKS: list[Check] = [
    lists_the_models,
    streams_the_servers_own_reply,
    cuts_at_max_tokens,
    names_the_stop_string,
    gives_log_probabilities,
    ends_a_response_incomplete,
    holds_the_text_to_a_schema,
    runs_past_the_end_with_ignore_eos,
    serves_on_after_a_client_leaves,
    serves_three_at_once,
]


async def first_model(upstream: str) -> str:
    client = openai.AsyncOpenAI(base_url=upstream, api_key="unused", max_retries=0)
    async for listed in client.models.list():
        return listed.id
    raise SystemExit(f"{upstream} lists no models: name one with --model")


async def run(args: argparse.Namespace) -> int:
    model = args.model or await first_model(args.upstream)
    relay_args = ["--engine", f"upstream:{args.upstream}", "--log-level", "WARNING"]
    if args.max_outstanding is not None:
        relay_args += ["--upstream-max-outstanding", str(args.max_outstanding)]
    failed = 0
    async with serve_process(relay_args) as relay:
        clients = Clients(relay.url, args.upstream, model)
        for check in CHECKS:
            name = check.__name__.replace("_", " ")
            try:
                said = await check(clients)
            except (CheckFailed, openai.APIError, anthropic.APIError) as error:
                failed += 1
                print(f"FAILED  {name}: {error}")
            else:
                print(f"ok      {name}: {said}")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the server's base URL (…/v1)")
    parser.add_argument("--model", help="the model to ask for (default: the first it lists)")
    parser.add_argument(
        "--max-outstanding", type=int, help="the relay's --upstream-max-outstanding"
    )
    args = parser.parse_args()
    if args.max_outstanding is not None and args.max_outstanding < 1:
        parser.error("--max-outstanding must be at least 1")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
