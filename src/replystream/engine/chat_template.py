"""A model's own chat template (Jinja, as stored in its GGUF), rendered the way its authors do.

This file decides how chat messages become the prompt text a chat model was trained on. The
template comes from the model file (``tokenizer.chat_template``) and is untrusted code, so it
runs in Jinja's ``ImmutableSandboxedEnvironment`` with the environment ``transformers`` gives
templates (``trim_blocks``, ``lstrip_blocks``, loop controls, the ``generation`` tag, a
``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``). A template that
refuses a conversation (``raise_exception``: roles that do not alternate, say) is the
request's fault: a ``RequestRejected`` naming ``messages``. It must not know about tokens or models.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from replystream.engine.base import RequestRejected


class _TemplateRaised(Exception):
    """The template called ``raise_exception``."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``, the tag ``transformers`` gives templates to
    mark an assistant's text (for training masks): its body, rendered as if unmarked, as
    ``transformers`` renders it when it is not asked where that text lies."""

    tags = {"generation"}  # noqa: RUF012  (as Jinja declares it)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def message_text(content: Any) -> str:
    """A message's content as text: a string as is, content parts' texts joined."""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content or ())


def knows_developer(source: str) -> bool:
    """Whether a chat template names OpenAI's ``developer`` role (a template written for it
    renders it its own way; one that is not would show it as a turn of an unknown speaker)."""
    return "developer" in source


def template_message(message: Mapping[str, Any], developer: bool = False) -> dict[str, str]:
    """A chat message (OpenAI chat's form) as the template gets it: its role and its text.

    A ``developer`` message is OpenAI's system message by another name: it goes to the
    template as ``system`` unless ``developer`` says the template knows that role
    (``knows_developer``), so the same instructions make the same prompt whichever name the
    client gave them (and a template that adds a default system prompt when the first message
    is not one adds none).

    The models served here make no tool calls and their templates need not know tools, but a
    conversation may hold calls made elsewhere (an assistant's ``tool_calls``) and their
    results (``tool`` messages): they are written into the text, one ``[call ID] NAME
    ARGUMENTS`` line per call and a result as ``[ID] text``, as the plain-text prompt of the
    other built-in engines writes them, rather than dropped."""
    content = message.get("content")
    # An assistant's refusal to answer (OpenAI's ``refusal``, content null) reads as its words.
    text = message_text(message.get("refusal") if content is None else content)
    calls = message.get("tool_calls") or ()
    lines = [text] if text or not calls else []
    lines += (
        f"[call {call['id']}] {call['function']['name']} {call['function']['arguments']}"
        for call in calls
    )
    content = "\n".join(lines)
    role = message["role"]
    if role == "tool":
        content = f"[{message.get('tool_call_id')}] {content}"
    elif role == "developer" and not developer:
        role = "system"
    return {"role": role, "content": content}


def _continue_tag(source: str, messages: Sequence[Mapping[str, str]]) -> str:
    """A mark put after the final message's text to find where it ends once rendered: a
    Unicode noncharacter that neither the template nor any message holds, then a space (which
    a template that trims messages takes off, as it would the message's own)."""
    taken = source + "".join(m["content"] for m in messages)
    mark = next((chr(c) for c in range(0xFDD0, 0xFDF0) if chr(c) not in taken), None)
    if mark is None:
        raise RequestRejected(
            "the messages hold every Unicode noncharacter", param="continue_final_message"
        )
    return f"{mark} "


# What a template's render may raise: its own refusal, Jinja's errors, and whatever a Python
# operation inside it raises on the values it is given (a string indexed as a list, a division
# by zero, ``str.index`` finding nothing, a range past the sandbox's limit, a macro calling
# itself). The template is the model file's code, not ours: any of these is it failing on
# this conversation.
RENDER_FAILURES = (Exception,)


class ChatTemplate:
    """One compiled template, and the special tokens it may name."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        """
        Raises:
            ValueError: the template is not valid Jinja, or fails on the simplest
                conversation (one user message), as every request would find it.
        """
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTag],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template is not valid Jinja: {exc}") from None
        self.source = source
        self._developer = knows_developer(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        # A template written for other helpers than ours (a function it calls is undefined
        # here) compiles, and would then fail every chat request as a 400 blamed on the
        # client: the model's fault, told at start-up.
        trial = {"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": True}
        try:
            self._template.render({**trial, "bos_token": bos_token, "eos_token": eos_token})
        except RENDER_FAILURES as exc:
            raise ValueError(f"the chat template fails on one user message: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (role and text content each, tool calls and
        results written as text: ``template_message``); ``variables``: more for the template
        to read (a request's ``chat_template_kwargs``), which never replace those given here.

        With ``continue_final_message`` the text ends where the final message's text ends: its
        turn is left open for the model to go on writing (``transformers``'
        ``apply_chat_template`` does the same: a tag after the final text, cut off after
        rendering; whitespace the template trims off the end of a message stays trimmed).

        Raises:
            RequestRejected: the template refuses this conversation, or fails on it, or does
                not show the final message that is to be continued.
        """
        plain = [template_message(message, self._developer) for message in messages]
        tag = ""
        if continue_final_message and plain:
            tag = _continue_tag(self.source, plain)
            plain[-1] = {**plain[-1], "content": plain[-1]["content"] + tag}
        try:
            rendered = self._template.render(
                {
                    **(variables or {}),
                    "messages": plain,
                    "add_generation_prompt": add_generation_prompt and not tag,
                    "bos_token": self.bos_token,
                    "eos_token": self.eos_token,
                }
            )
        except RENDER_FAILURES as exc:
            raise RequestRejected(
                f"the model's chat template refuses these messages: {exc}", param="messages"
            ) from None
        if not tag:
            return rendered
        at = rendered.rfind(tag.rstrip())
        if at < 0:
            raise RequestRejected(
                "the model's chat template does not show the final message's text, so it "
                "cannot be continued",
                param="continue_final_message",
            )
        # The tag's space kept: the template keeps the message's own trailing whitespace too.
        return rendered[:at] if rendered.startswith(tag, at) else rendered[:at].rstrip()
