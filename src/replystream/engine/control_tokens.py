"""Encoding a rendered chat prompt so that only the template's own markup makes control tokens.

This file decides which control tokens (``<|im_start|>``, ``<|im_end|>``: the tokens a chat
model reads as the turns' structure) a chat prompt gets. A template renders the request's
messages into one string; encoding that string with control tokens matched whole would let a
message's text spell one and forge a turn (a system message, the end of its own turn). So
before rendering, every control token's spelling in a string from the request (content, tool
call ids, names and arguments, whatever a message holds, and the values of the template's
variables a request gives: ``chat_template_kwargs``) is swapped for a placeholder; after
rendering, the string is cut at the control spellings left, which only the template can have
written, each becomes its control token, and the text between them, placeholders put back, is
encoded with control spellings as the plain characters they are.

What this changes, and what it does not:

- A conversation whose strings hold no control spelling is encoded as before, in one call of
  the tokenizer, with the same ids (the tests pin it).
- A spelling put back is encoded with the text around it, in one piece up to the template's
  next control token, as a tokenizer splits at control tokens anyway: BPE merges across it
  exactly as across any other text, so nothing is cut where the template's markup meets a
  message's text.
- Only a spelling wholly inside one request string is hidden. A control token that the template
  builds from request text and its own (``'<|' + message['role'] + '|>'``) stays a control
  token, as the template means; which roles a request may send is the server's to check.
- The template sees a placeholder where a message spelt a control token (a template that asks
  ``'<|im_end|>' in content`` gets false); every other string operation sees the text as sent.

It must not know about templates' syntax, models or serving: it takes the messages and a
function that renders them, and an encoder for the rendered text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

# Unicode's noncharacters: never assigned, so no template writes one and no control token is
# spelt with one. A message's text may still hold them; those are hidden like a control
# spelling, so the marker in the rendered text is only ever a placeholder's.
_NONCHARACTERS = [chr(code) for code in range(0xFDD0, 0xFDF0)]

Messages = Sequence[Mapping[str, Any]]


class TextEncoder(Protocol):
    """A tokenizer's two ways to encode text."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, control tokens' spellings matched whole."""
        ...

    def encode_text(self, text: str, at_start: bool = True) -> list[int]:
        """Ids of ``text``, control tokens' spellings as the plain characters they are.

        ``at_start``: whether the text begins the prompt or follows a control token. A
        tokenizer that marks only the start of its input (SentencePiece's ``▁`` with
        ``prepend_scheme="first"``) marks it only there, as one call on the whole prompt would.
        """
        ...


class ControlTokenGuard:
    """Encodes chat prompts so that a message's text never makes a control token."""

    def __init__(
        self, control_ids: Mapping[str, int], encoder: TextEncoder, template_source: str = ""
    ) -> None:
        """
        Args:
            control_ids: each control token's spelling and its id.
            encoder: the tokenizer the template's output is encoded with.
            template_source: the template's text; the marker is chosen not to occur in it.
        """
        self._control_ids = {spelling: i for spelling, i in control_ids.items() if spelling}
        self._encoder = encoder
        taken = template_source + "".join(self._control_ids)
        marker = next((c for c in _NONCHARACTERS if c not in taken), None)
        if marker is None:
            raise ValueError("the chat template spells every Unicode noncharacter")
        self._marker = marker
        # Longest first: a spelling that contains another is matched whole, as tokenizers do.
        spellings = sorted(self._control_ids, key=len, reverse=True)
        self._hidden_re = re.compile("|".join(map(re.escape, [*spellings, marker])))
        # A capturing group: re.split gives [text, control, text, ..., text]; (?!) never matches.
        alternatives = "|".join(map(re.escape, spellings)) or "(?!)"
        self._control_re = re.compile(f"({alternatives})")
        self._placeholder_re = re.compile(f"{marker}(\\d+){marker}|{marker}")

    def prompt_ids(
        self,
        messages: Messages,
        render: Callable[[Messages, Mapping[str, Any]], str],
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The ids of ``render(messages, variables)`` (``variables``: more for the template,
        a request's ``chat_template_kwargs``), where only the template's markup makes control
        tokens.

        Raises:
            whatever ``render`` raises.
        """
        hidden: list[str] = []
        shown = [self._hide_in(message, hidden) for message in messages]
        rendered = render(shown, self._hide_in(variables or {}, hidden))
        if not hidden:
            return self._encoder.encode(rendered)  # nothing to tell apart: as it always was
        ids: list[int] = []
        for index, piece in enumerate(self._control_re.split(rendered)):
            if index % 2:
                ids.append(self._control_ids[piece])
            elif piece:
                text = self._put_back(piece, hidden)
                ids += self._encoder.encode_text(text, at_start=index == 0)
        return ids

    def _hide_in(self, value: Any, hidden: list[str]) -> Any:
        """``value`` with each control spelling in its strings (keys aside) a placeholder."""
        if isinstance(value, str):
            return self._hidden_re.sub(lambda found: self._placeholder(found[0], hidden), value)
        if isinstance(value, Mapping):
            return {key: self._hide_in(item, hidden) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self._hide_in(item, hidden) for item in value]
        return value

    def _placeholder(self, spelling: str, hidden: list[str]) -> str:
        hidden.append(spelling)
        return f"{self._marker}{len(hidden) - 1}{self._marker}"

    def _put_back(self, piece: str, hidden: list[str]) -> str:
        # A lone marker is what is left of a placeholder that the template cut (a slice of a
        # message's text): it goes, as the cut-off part of the placeholder went.
        def text(found: re.Match[str]) -> str:
            number = found[1]
            return hidden[int(number)] if number is not None and int(number) < len(hidden) else ""

        return self._placeholder_re.sub(text, piece)
