"""What a relayed reply continued at another upstream sends it: the request again, with the
text already relayed as the assistant's prefix (``continue_final_message``), or, for a legacy
completion, at the end of its prompt, and what is left of the token budget.

Pure: a request and the text so far in, the request out. When a reply may be continued, and
what it sends first to the client, is ``upstream_relay``'s. It must not know how a request
is sent.
"""

from __future__ import annotations

from dataclasses import replace

from replystream.engine.base import GenerationRequest


def continued_request(request: GenerationRequest, relayed: str, tokens: int) -> GenerationRequest:
    """``request`` continued after ``relayed`` (the text the client has, ``tokens`` tokens of
    it): a final assistant message holding it (the client's own prefix, extended, when the
    request already continued one), or a raw prompt extended by it, and ``max_tokens`` and
    ``min_tokens`` less what was sent (the tokens sent count toward the least the client asked
    for, and vLLM and SGLang refuse a ``min_tokens`` above ``max_tokens``)."""
    sampling = request.sampling
    if sampling.max_tokens is not None:
        sampling = replace(sampling, max_tokens=max(1, sampling.max_tokens - tokens))
    if sampling.min_tokens:
        sampling = replace(sampling, min_tokens=max(0, sampling.min_tokens - tokens))
    if request.raw_prompt:  # a legacy completion: its prompt goes on with the text so far
        return replace(request, prompt=request.prompt + relayed, sampling=sampling)
    prefix = relayed
    messages = request.messages or ({"role": "user", "content": request.prompt},)
    if request.continue_final_message:  # the client's own prefix, continued: extend it
        *before, last = messages
        messages = (*before, {**last, "content": request.prefix + prefix})
        prefix = request.prefix + prefix
    else:
        messages = (*messages, {"role": "assistant", "content": prefix})
    return replace(
        request,
        messages=tuple(messages),
        prefix=prefix,
        continue_final_message=True,
        add_generation_prompt=None,
        sampling=sampling,
    )
