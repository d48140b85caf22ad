"""A ``transformers`` tokenizer's side of a reply: chat prompts in, token ids to text and bytes out.

This file decides how the ``hf`` engine turns chat messages into prompt ids (the tokenizer's
own chat template, rendered as the other built-in engines render theirs: ``HFChatPrompt``),
how made ids become text as soon as it is whole (``HFDetokenizer``), and which bytes each id
stands for in log probabilities (``HFTokenBytes``). It must not know about torch, models or
serving.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from replystream.engine.base import RequestRejected
from replystream.engine.chat_template import (
    RENDER_FAILURES,
    ChatTemplate,
    knows_developer,
    template_message,
)
from replystream.engine.control_tokens import ControlTokenGuard, Messages
from replystream.engine.tokenizer import bytes_to_unicode

log = logging.getLogger("replystream.engine")


class HFDetokenizer:
    """Token ids to text as soon as it is whole: the new suffix of a growing decode.

    The ids since the last emitted boundary are decoded twice (without and with the newest
    token); the difference is the new text. A decode that ends in U+FFFD (a character whose
    bytes are split across tokens) is held back until a later token completes it.

    ``context``: the prompt's last ids, decoded before the reply's first token as the ones
    before any later token are. A SentencePiece decoder drops the space its input opens with
    (``Strip``), so without them a reply's first token ``▁Paris`` would come out ``Paris``:
    a completion glued to its prompt, and text its tokens' bytes do not spell.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context)
        self._prefix = 0  # ids before this are emitted and never decoded again
        self._read = len(self._ids)  # ids before this are emitted (or the prompt's)

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def push(self, token: int) -> str:
        self._ids.append(token)
        prefix = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """What is still held at the end of a reply (an incomplete character stays U+FFFD)."""
        prefix = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(prefix) :]


def tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
    """A fast tokenizer's whole ``tokenizer.json``; empty for a slow (Python) tokenizer.
    Read once per engine and shared (``HFChatPrompt``, ``HFTokenBytes``): a large
    vocabulary's takes a tenth of a second or more to write out and read back."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec: dict[str, Any] = json.loads(backend.to_str()) if backend is not None else {}
    return spec


def _parts(component: Any) -> list[dict[str, Any]]:
    """A pipeline component (decoder, pre-tokenizer) and the ones a ``Sequence`` holds, flat."""
    if not isinstance(component, dict):
        return []
    inner = component.get("decoders") or component.get("pretokenizers")
    if component.get("type") == "Sequence" and isinstance(inner, list):
        return [part for item in inner for part in _parts(item)]
    return [component]


def _text_after_control(spec: dict[str, Any]) -> Tokenizer | None:
    """A copy of the tokenizer for text that follows a control token in the prompt, when the
    tokenizer marks only the start of its input (SentencePiece's ``▁`` with
    ``prepend_scheme="first"``); None when text encodes the same wherever it stands.

    Encoded in one call, such text gets no ``▁``: the mark goes where the input starts, not
    after each control token. Encoded apart, it would get one that the template never wrote.
    """
    pre_tokenizer = copy.deepcopy(spec.get("pre_tokenizer"))  # ``spec`` is shared: not changed
    marks_start = [
        part
        for part in _parts(pre_tokenizer)
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") == "first"
    ]
    if not marks_start:
        return None
    for part in marks_start:
        part["prepend_scheme"] = "never"
    later = Tokenizer.from_str(json.dumps({**spec, "pre_tokenizer": pre_tokenizer}))
    later.encode_special_tokens = True  # a message's text: control spellings are characters
    return later


class HFChatPrompt:
    """Chat messages through a ``transformers`` tokenizer's chat template, where only the
    template's markup makes control tokens (its added tokens marked special).

    The template gets each message as ``template_message`` makes it (its role and its text,
    tool calls and their results written as text), as the GGUF engines' templates do: the
    ``hf`` engine makes no tool calls, and a conversation may hold calls made elsewhere, in any
    dialect's shape. ``apply_chat_template(tokenize=True)`` would encode the rendered string
    with every control spelling matched, a message's text included; here the template renders
    with those spellings hidden (``ControlTokenGuard``) and a message's text is encoded with
    ``split_special_tokens``. A conversation that spells none is encoded as that call did.
    """

    def __init__(self, tokenizer: Any, spec: dict[str, Any]) -> None:
        """``spec``: the tokenizer's ``tokenizer_spec``."""
        self._tokenizer = tokenizer
        control_ids = {
            str(token.content): int(token_id)
            for token_id, token in tokenizer.added_tokens_decoder.items()
            if token.special
        }
        source = chat_template_source(tokenizer)
        # Compiled now, as a GGUF's is: a template that is not Jinja is the folder's fault,
        # told at start-up, not every chat request's 400.
        ChatTemplate(source)
        self._guard = ControlTokenGuard(control_ids, self, source)
        self._developer = knows_developer(source)
        self._later = _text_after_control(spec)
        self._own_arguments = rendering_arguments(tokenizer)

    def prompt_ids(
        self,
        messages: Messages,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's ids: the template's generation prompt at the end unless
        ``add_generation_prompt`` is false or the final message is continued (left open);
        ``variables``: more for the template to read (``chat_template_kwargs``).

        Raises:
            RequestRejected: the template refuses or fails on these messages, or cannot show
                the final message to continue it.
        """
        generation = not continue_final_message
        if add_generation_prompt is not None:
            generation = add_generation_prompt
        taken = sorted(self._own_arguments.intersection(variables or {}))
        if taken:
            # They reach ``apply_chat_template`` as keyword arguments: one it takes itself is
            # its own (``padding``), never the template's, or clashes with one given it here.
            raise RequestRejected(
                f"chat_template_kwargs may not give {taken[0]!r}: this model's chat template "
                "is rendered by transformers, which takes that name as its own argument",
                param="chat_template_kwargs",
            )

        def render(hidden: Messages, kept: Mapping[str, Any]) -> str:
            try:
                rendered = self._tokenizer.apply_chat_template(
                    [template_message(m, self._developer) for m in hidden],
                    add_generation_prompt=generation,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **kept,
                )
            except ValueError as exc:  # transformers' words for a message it cannot continue
                if not continue_final_message:
                    raise _refused(exc) from None
                log.debug("the chat template cannot continue the final message: %s", exc)
                raise RequestRejected(
                    "the model's chat template does not show the final message's text, so it "
                    "cannot be continued",
                    param="continue_final_message",
                ) from None
            except RENDER_FAILURES as exc:
                # ``raise_exception`` (roles that do not alternate, say), or a template that
                # fails on this conversation: the request's fault, as for the GGUF engines.
                raise _refused(exc) from None
            return str(rendered)

        return self._guard.prompt_ids(messages, render, variables)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=False)]

    def encode_text(self, text: str, at_start: bool = True) -> list[int]:
        if not at_start and self._later is not None:
            return list(self._later.encode(text, add_special_tokens=False).ids)
        ids = self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        return [int(i) for i in ids]


def rendering_arguments(tokenizer: Any) -> frozenset[str]:
    """The names ``apply_chat_template`` takes as its own arguments (``tokenize``,
    ``padding``, ...): not the template's variables, which it takes as more keywords."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in named)


def chat_template_source(tokenizer: Any) -> str:
    """The chat template ``apply_chat_template`` renders a chat with ("" if none): the
    tokenizer's one, or of its named ones, ``default`` (the one for a chat offering no tools,
    as this engine's chats offer none).

    Raises:
        ValueError: the templates are named and none is ``default``, so every chat would fail.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        if "default" not in template:
            names = ", ".join(sorted(map(str, template)))
            raise ValueError(
                f"its chat templates are named {names}, and none is 'default', the one a chat "
                "is rendered with"
            )
        template = template["default"]
    return str(template or "")


def _refused(exc: Exception) -> RequestRejected:
    return RequestRejected(
        f"the model's chat template refuses these messages: {exc}", param="messages"
    )


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoders whose work on one token is a character-for-character rewrite of its piece.
_PIECE_DECODERS = {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}


class HFTokenBytes:
    """Each token id's own bytes, for log probabilities' ``bytes``: a token that holds part
    of a character gives those bytes, not U+FFFD's, so a reply's tokens' bytes joined are its
    text's UTF-8 (what OpenAI's ``bytes`` promises).

    Read from the token's piece in the vocabulary, by the tokenizer's decoder: byte-level BPE
    spells each byte as a printable character (GPT-2's table); SentencePiece spells a space
    ``▁`` and an unknown character's bytes ``<0xNN>``. A control token (``hidden`` from the
    reply's text) has those of its spelling (``<|im_end|>``), as vLLM and llama.cpp's server
    name it. A tokenizer with another decoder (WordPiece, say) has no byte
    spelling, and its tokens' bytes are their decoded text's.
    """

    def __init__(self, tokenizer: Any, spec: dict[str, Any]) -> None:
        """``spec``: the tokenizer's ``tokenizer_spec``."""
        self._tokenizer = tokenizer
        decoders = _parts(spec.get("decoder"))
        kinds = {str(part.get("type")) for part in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._by_piece = bool(kinds) and kinds <= _PIECE_DECODERS
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = [
            (str(part["pattern"]["String"]), str(part["content"]))
            for part in decoders
            if part.get("type") == "Replace" and "String" in (part.get("pattern") or {})
        ]
        self._replacements += [
            (str(part.get("replacement", "▁")), " ")
            for part in decoders
            if part.get("type") == "Metaspace"
        ]
        self._to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        self.hidden = {
            int(token_id)
            for token_id, token in tokenizer.added_tokens_decoder.items()
            if token.special
        } | {int(i) for i in tokenizer.all_special_ids}
        self._known: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        known = self._known.get(token)
        if known is None:
            known = self._known[token] = self._bytes_of(token)
        return known

    def _bytes_of(self, token: int) -> bytes:
        spelt = self._tokenizer.convert_ids_to_tokens(token)
        if spelt is None:
            # A row of the model's padded vocabulary (its config's ``vocab_size`` past the
            # tokenizer's): no token, no text, as the reply's text has none for it.
            return b""
        if token in self.hidden:
            return str(spelt).encode()
        piece = str(spelt)
        if self._byte_level and set(piece) <= self._to_byte.keys():
            return bytes(self._to_byte[char] for char in piece)
        if self._by_piece:
            byte = _BYTE_PIECE.fullmatch(piece) if self._byte_fallback else None
            if byte is not None:
                return bytes([int(byte[1], 16)])
            for spelled, meant in self._replacements:
                piece = piece.replace(spelled, meant)
            return piece.encode()
        # An added token spelt outside the byte alphabet, or a decoder with no byte spelling.
        return str(self._tokenizer.decode([token])).encode()
