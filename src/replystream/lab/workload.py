"""What a load run sends: request shapes per API and length distributions.

This file decides the wire shape of one benchmark request for each API replystream can drive
(the lab's ``GET /stream``, the native ``POST /v1/replies`` and OpenAI-compatible
``POST .../chat/completions`` or ``.../completions``), and how prompt and output lengths are drawn
(when requests arrive is ``profiles``). It is pure: no sockets and no clocks, and it must not
know how replies are read or timed.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

Api = Literal["lab", "native", "openai"]
APIS: tuple[Api, ...] = ("lab", "native", "openai")

# Prompt filler: distinct short words, so a prompt of N words is N tokens to a word tokenizer.
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def detect_api(url: str) -> Api:
    """The API a URL most likely speaks, from its path."""
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/completions"):
        return "openai"
    if path.endswith("/replies"):
        return "native"
    return "lab"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as it goes on the wire."""

    method: str
    url: str
    json_body: dict[str, Any] | None = None


def build_request(
    api: Api, url: str, *, prompt: str, max_tokens: int | None, model: str
) -> RequestSpec:
    """The request that asks ``url`` for one streamed reply to ``prompt``.

    ``max_tokens=None`` leaves the reply length to the server.
    """
    if api == "lab":
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        if prompt:
            query["prompt"] = prompt
        if max_tokens is not None:
            query["max_tokens"] = str(max_tokens)
        return RequestSpec("GET", urlunsplit(parts._replace(query=urlencode(query))))
    body: dict[str, Any]
    if api == "native":
        body = {"prompt": prompt}
    else:
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
        if urlsplit(url).path.rstrip("/").endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return RequestSpec("POST", url, body)


def prompt_of(words: int) -> str:
    """A prompt of exactly ``words`` words (empty for 0)."""
    return " ".join(itertools.islice(itertools.cycle(_WORDS), words))


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length that is fixed (``64``) or drawn: ``uniform:LO:HI`` or ``normal:MEAN:SD``.

    Drawn lengths are rounded and never below ``minimum``.
    """

    kind: Literal["fixed", "uniform", "normal"]
    a: float
    b: float = 0.0
    minimum: int = 0

    @classmethod
    def parse(cls, text: str, *, minimum: int = 0) -> Lengths:
        """Read ``N``, ``uniform:LO:HI`` or ``normal:MEAN:SD``; raises ValueError otherwise."""
        name, _, rest = text.partition(":")
        try:
            if not rest:
                value = int(name)
                if value < minimum:
                    raise ValueError(f"length must be at least {minimum}, got {value}")
                return cls("fixed", value, minimum=minimum)
            a, b = (float(x) for x in rest.split(":"))
        except ValueError as exc:
            raise ValueError(f"{text!r}: {exc}") from None
        if name == "uniform" and minimum <= a <= b:
            return cls("uniform", a, b, minimum)
        if name == "normal" and a >= minimum and b >= 0:
            return cls("normal", a, b, minimum)
        raise ValueError(f"{text!r}: want N, uniform:LO:HI or normal:MEAN:SD (>= {minimum})")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        value = rng.uniform(self.a, self.b) if self.kind == "uniform" else rng.gauss(self.a, self.b)
        return max(self.minimum, round(value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"
