"""What a relayed request is sent as: the body of its upstream chat (or legacy) completion.

This file decides how a ``GenerationRequest`` becomes the JSON body of a streaming ``POST
{base}/chat/completions`` (the client's chat messages unchanged, or the prompt as one user
message; a prefix to continue as ``continue_final_message``), or, for a legacy completion
(``raw_prompt``), of ``POST {base}/completions`` (the prompt as written): the sampling fields
an upstream takes, only as the client gave them, ``stream_options.include_usage`` so that
usage is the upstream's own, and the stop strings an upstream is sent (``stops_sent``). Where
it is sent, and with which headers, is ``upstream``'s. It must not know about HTTP.
"""

from __future__ import annotations

from typing import Any

from replystream.engine.base import GenerationRequest


def stops_sent(request: GenerationRequest) -> tuple[str, ...]:
    """The request's stop strings as its upstream is sent them: none when the client is told
    which one ended the reply. An upstream cuts the text before a stop string and finishes
    ``stop``, and only vLLM and SGLang say which string it was (llama.cpp, Ollama and TGI do
    not), so the text comes whole instead: the reply pipeline cuts and names the stop string,
    and the relay stops the upstream there (``upstream_relay``)."""
    return () if request.names_stop_sequence else request.sampling.stop


def request_body(
    request: GenerationRequest,
    model: str | None,
    *,
    ask_usage: bool = True,
    limit_field: str = "max_tokens",
    null_content: bool = True,
) -> dict[str, Any]:
    """The upstream chat-completion body for ``request``; ``ask_usage``: with
    ``stream_options.include_usage``; ``limit_field``: the token limit's name;
    ``null_content``: a message's null content as null, else as an empty string (each as the
    upstream takes them: ``Backend.takes_stream_options``, ``completion_limit_models``,
    ``takes_null_content``)."""
    s = request.sampling
    body: dict[str, Any]
    if request.raw_prompt:  # a legacy completion: the prompt as written, for /completions
        body = {"prompt": request.prompt, "stream": True}
    else:
        messages = (
            [dict(m) for m in request.messages]
            if request.messages
            else [{"role": "user", "content": request.prompt}]
        )
        if not null_content:  # the same turn to OpenAI's API, which reads both alike
            for message in messages:
                if "content" in message and message["content"] is None:
                    message["content"] = ""
        body = {"messages": messages, "stream": True}
    if ask_usage:
        body["stream_options"] = {"include_usage": True}
    # Only as the client gave them: an upstream applies a model's own defaults (vLLM's
    # generation config, Ollama's Modelfile) to a request that leaves them out.
    if s.top_p == 0:
        # Keeping only the likeliest token (OpenAI's range takes 0) is greedy decoding. vLLM
        # and TGI refuse top_p 0 (their ranges start above it); temperature 0 is greedy
        # everywhere (vLLM, TGI's chat route, llama.cpp, Ollama), whatever the client's was.
        body["temperature"] = 0.0
    else:
        if s.temperature is not None:
            body["temperature"] = s.temperature
        if s.top_p is not None:
            body["top_p"] = s.top_p
    if model is not None:
        body["model"] = model
    if request.continue_final_message:  # the last message is the assistant's start: continue
        # it (vLLM's fields; llama.cpp and Ollama continue a final assistant message by themselves)
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif request.add_generation_prompt is not None:  # the client's, as it gave it
        body["add_generation_prompt"] = request.add_generation_prompt
    if request.chat_template_kwargs:  # vLLM's, SGLang's and llama.cpp's server's
        body["chat_template_kwargs"] = dict(request.chat_template_kwargs)
    if s.max_tokens is not None:
        body[limit_field] = s.max_tokens
    if s.top_k > 0:
        body["top_k"] = s.top_k  # vLLM, TGI, llama.cpp and Ollama take it; OpenAI does not
    if s.min_p > 0:
        body["min_p"] = s.min_p  # vLLM, SGLang, llama.cpp and Ollama take it
    if s.min_tokens > 0:
        body["min_tokens"] = s.min_tokens  # vLLM's and SGLang's
    if s.ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang and llama.cpp take it
    if s.seed is not None:
        body["seed"] = s.seed
    for name, none in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),  # vLLM's, llama.cpp's and TGI's; OpenAI has none
    ):
        if getattr(s, name) != none:
            body[name] = getattr(s, name)
    if s.logit_bias:  # token ids are the upstream model's: it checks them
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    stops = stops_sent(request)
    if stops:
        body["stop"] = list(stops)
    if s.logprobs is not None and request.raw_prompt:
        body["logprobs"] = s.logprobs  # the legacy field: how many candidates per token
    elif s.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = s.logprobs
    if request.tools:  # already in chat's form, whatever dialect the client spoke
        body["tools"] = [dict(tool) for tool in request.tools]
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.relayed:
        body.update(request.relayed)
    if request.prompt_cache_key is not None:  # OpenAI's prompt caching reads it too
        body["prompt_cache_key"] = request.prompt_cache_key
    if request.response_format is not None:
        body["response_format"] = request.response_format
    return body
