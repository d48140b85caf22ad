"""How a request becomes prompt token ids: plain text to continue, or a chat model's template.

This file decides what the built-in engines feed their model. ``PlainPrompt`` encodes the
request's text as it is (the tiny model continues prose; an empty prompt becomes a stand-in
text). ``ChatPrompt`` renders the request's chat messages through the model's own template;
the template's markup is encoded with its control tokens, the messages' text as plain text
(``control_tokens``), so a message cannot spell a turn of its own. A request with no messages
(a legacy completion) is continued as plain text, its control spellings matched whole: its
client wrote the whole prompt, there is no one else's markup in it to forge. A chat request's
plain-text form (a model without a template) is all the messages' text, and is encoded as
such. A request's ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs`` reach the template (``template_renderer``); without one, a plain-text
form has no generation prompt to add and no template to give variables to, and
``add_generation_prompt: true`` and ``chat_template_kwargs`` are refused rather than ignored.
It must not know about models or serving.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from replystream.engine.base import GenerationRequest, RequestRejected
from replystream.engine.chat_template import ChatTemplate
from replystream.engine.control_tokens import ControlTokenGuard, Messages
from replystream.engine.tokenizer import ByteTokenizer

Render = Callable[[Messages, Mapping[str, Any]], str]


class PromptFormat(Protocol):
    """Turns a request into the token ids the model starts from."""

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's ids (never empty).

        Raises:
            RequestRejected: the request cannot be put in this model's format.
        """
        ...


class PlainPrompt:
    """The request's plain text, encoded; ``empty`` stands in for an empty prompt."""

    def __init__(self, tokenizer: ByteTokenizer, empty: str) -> None:
        self._tokenizer = tokenizer
        self._empty = empty

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        refuse_template_controls(request)
        if not request.prompt:
            return self._tokenizer.encode(self._empty)  # ours: it may be a control token (BOS)
        if request.messages is not None:
            return self._tokenizer.encode_text(request.prompt)
        return self._tokenizer.encode(request.prompt)


class ChatPrompt:
    """Chat messages through the model's template; plain text when there are none."""

    def __init__(self, tokenizer: ByteTokenizer, template: ChatTemplate, start_id: int) -> None:
        self._tokenizer = tokenizer
        self._template = template
        self._start_id = start_id  # an empty plain prompt starts from this token (BOS)
        self._guard = ControlTokenGuard(tokenizer.control_ids, tokenizer, template.source)

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages:
            return self._guard.prompt_ids(
                request.messages,
                template_renderer(self._template, request),
                request.chat_template_kwargs,
            )
        return self._tokenizer.encode(request.prompt) or [self._start_id]


class BosFirst:
    """Another format's ids, begun with BOS: a model whose file says every prompt begins with
    it (llama.cpp's ``add_bos_token``, LLaMA 3's by default) was trained on nothing else.
    Ids that begin with it already (a chat template that writes it) are left as they are,
    so a prompt never begins with two, as llama.cpp's server makes it."""

    def __init__(self, inner: PromptFormat, bos_id: int) -> None:
        self._inner = inner
        self._bos_id = bos_id

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        ids = self._inner.prompt_ids(request)
        return ids if ids[:1] == [self._bos_id] else [self._bos_id, *ids]


def template_renderer(template: ChatTemplate, request: GenerationRequest) -> Render:
    """``template``'s rendering as ``request`` asks for it: its generation prompt added unless
    the request says not to or continues the final message, which stays open."""
    generation = request.add_generation_prompt
    if generation is None:
        generation = not request.continue_final_message

    def render(messages: Messages, variables: Mapping[str, Any]) -> str:
        return template.render(messages, generation, request.continue_final_message, variables)

    return render


def refuse_template_controls(request: GenerationRequest) -> None:
    """Refuse what only a chat template can honour where there is none: a chat's plain-text
    form ends with the last message's text, and there is no generation prompt to add
    (``add_generation_prompt: false`` is what it does anyway; a final message is continued as
    its text ends), nor a template to read ``chat_template_kwargs``.

    Raises:
        RequestRejected: naming ``add_generation_prompt`` or ``chat_template_kwargs``.
    """
    if request.messages is not None and request.add_generation_prompt:
        raise RequestRejected(
            "this model has no chat template: a chat is read as its messages' plain text, "
            "with no generation prompt to add (send false, or leave it out)",
            param="add_generation_prompt",
        )
    if request.chat_template_kwargs:
        raise RequestRejected(
            "this model has no chat template to give chat_template_kwargs to: a chat is read "
            "as its messages' plain text",
            code="unsupported_parameter",
            param="chat_template_kwargs",
        )
