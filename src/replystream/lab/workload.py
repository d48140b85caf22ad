"""What a load run sends: request shapes per API and length distributions.

This file decides the wire shape of one benchmark request for each API replystream can drive
(the lab's ``GET /stream``, the native ``POST /v1/replies``, OpenAI-compatible
``POST .../chat/completions`` or ``.../completions``, OpenAI's ``POST .../responses``, and
Anthropic's ``POST .../messages``),
with a system prompt users share, and what each request asks: lengths drawn from a
distribution or a histogram file, or a prompt from a dataset (``datasets`` reads those files;
when requests arrive is ``profiles``). No sockets and no clocks, and it must not know how
replies are read or timed.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

Api = Literal["lab", "native", "openai", "responses", "messages"]
APIS: tuple[Api, ...] = ("lab", "native", "openai", "responses", "messages")
# The APIs whose requests name a model (the one the server lists, when the user named none).
MODEL_APIS: frozenset[Api] = frozenset({"openai", "responses", "messages"})
# Anthropic's Messages API requires ``max_tokens``: what a request asks for when the run
# leaves the reply length to the server, which this API cannot.
MESSAGES_DEFAULT_MAX_TOKENS = 1024

# The most words a prompt (or the shared system prompt) may have: far beyond any model's
# context, and still a prompt this process can build (about 60 MB); more would exhaust its
# memory, or pass what a string can hold, before the first request was sent.
MOST_PROMPT_WORDS = 10_000_000
# The longest draw of a length with no maximum: a float is exact up to it.
_MOST_DRAWN = 2**53

# Prompt filler: distinct short words, so a prompt of N words is N tokens to a word tokenizer.
_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
_SYSTEM_WORDS = "you are a helpful assistant answer briefly and kindly".split()


# What each API's endpoint path ends in, as a URL's path tells the API it speaks.
API_PATHS: dict[str, Api] = {
    "/completions": "openai",  # chat's and the legacy one
    "/replies": "native",
    "/responses": "responses",
    "/messages": "messages",
    "/stream": "lab",
    "/wait": "lab",
}


def detect_api(url: str) -> Api:
    """The API a URL speaks, from its path.

    Raises:
        ValueError: the path ends in no endpoint's name (a server's address, ``.../v1``, a
            proxy's own path): every request would go to the wrong place in the wrong shape.
    """
    path = urlsplit(url).path.rstrip("/")
    for end, api in API_PATHS.items():
        if path.endswith(end):
            return api
    ends = ", ".join(API_PATHS)
    raise ValueError(
        f"{url}: its path names no endpoint (one ending in {ends}); give the endpoint's URL, "
        "or name its request shape with --api"
    )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as it goes on the wire."""

    method: str
    url: str
    json_body: dict[str, Any] | None = None


def build_request(
    api: Api,
    url: str,
    *,
    prompt: str,
    max_tokens: int | None,
    model: str,
    system: str = "",
    history: Sequence[tuple[str, str]] = (),
    ignore_eos: bool = False,
) -> RequestSpec:
    """The request that asks ``url`` for one streamed reply to ``prompt``.

    ``max_tokens=None`` leaves the reply length to the server (a Messages request, which
    must give one, asks for ``MESSAGES_DEFAULT_MAX_TOKENS``). ``system``, a system prompt
    every user shares, and ``history``, the conversation's earlier (prompt, reply) turns that
    a chat client resends, are messages to a chat, Responses or Messages endpoint (the system
    prompt is a Responses request's ``instructions``, a Messages request's ``system``) and
    paragraphs before the prompt to the others (which take one text). ``ignore_eos``: the
    reply runs to ``max_tokens`` past the model's end token (vLLM's field; replystream's
    under ``replystream`` on the Responses and Messages APIs, which have no such field; the
    lab endpoint takes none).
    """
    ours = {"replystream": {"ignore_eos": True}} if ignore_eos else {}
    if api == "responses":
        return _responses_request(url, prompt, max_tokens, model, system, history, ours)
    if api == "messages":
        return _messages_request(url, prompt, max_tokens, model, system, history, ours)
    if not (api == "openai" and _is_chat(url)):
        earlier = [text for turn in history for text in turn]
        prompt = "\n\n".join(p for p in (system, *earlier, prompt) if p)
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
        if _is_chat(url):
            messages = [{"role": "system", "content": system}] if system else []
            body["messages"] = [*messages, *_turns(history, prompt)]
        else:
            body["prompt"] = prompt
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    return RequestSpec("POST", url, body)


def _responses_request(
    url: str,
    prompt: str,
    max_tokens: int | None,
    model: str,
    system: str,
    history: Sequence[tuple[str, str]],
    ours: dict[str, Any],
) -> RequestSpec:
    body: dict[str, Any] = {"model": model, "stream": True, **ours}
    if system:
        body["instructions"] = system
    body["input"] = _turns(history, prompt) if history else prompt
    if max_tokens is not None:
        body["max_output_tokens"] = max_tokens
    return RequestSpec("POST", url, body)


def _messages_request(
    url: str,
    prompt: str,
    max_tokens: int | None,
    model: str,
    system: str,
    history: Sequence[tuple[str, str]],
    ours: dict[str, Any],
) -> RequestSpec:
    limit = MESSAGES_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    body: dict[str, Any] = {"model": model, "max_tokens": limit, "stream": True, **ours}
    if system:
        body["system"] = system
    # The Messages API refuses a message with no content (Anthropic's rule, and this
    # server's): an empty prompt (--prompt-words 0) is sent as one full stop, no word.
    body["messages"] = _turns(history, prompt or ".")
    return RequestSpec("POST", url, body)


def _turns(history: Sequence[tuple[str, str]], prompt: str) -> list[dict[str, str]]:
    """The conversation as chat messages: each earlier turn and its reply, then the prompt."""
    messages = []
    for asked, replied in history:
        messages.append({"role": "user", "content": asked})
        messages.append({"role": "assistant", "content": replied})
    return [*messages, {"role": "user", "content": prompt}]


def _is_chat(url: str) -> bool:
    return urlsplit(url).path.rstrip("/").endswith("/chat/completions")


def prompt_of(words: int) -> str:
    """A prompt of exactly ``words`` words (empty for 0)."""
    return " ".join(itertools.islice(itertools.cycle(_WORDS), words))


def system_prompt_of(words: int) -> str:
    """A system prompt of exactly ``words`` words, in words no user prompt uses, so the shared
    prefix ends where the user's text begins."""
    return " ".join(itertools.islice(itertools.cycle(_SYSTEM_WORDS), words))


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt from a dataset or trace, and the reply length it asks for (None: the
    server's, or ``--output-tokens``); ``follow_ups``: a conversation's later user turns."""

    text: str
    output_tokens: int | None = None
    follow_ups: tuple[Prompt, ...] = ()


@dataclass(frozen=True, slots=True)
class Planned:
    """What request ``index`` of a run sends."""

    prompt: str
    words: int
    max_tokens: int | None


def plan(
    number: int,
    rng: random.Random,
    *,
    prompt_words: Lengths,
    output_tokens: Lengths | None,
    prompts: tuple[Prompt, ...] = (),
    in_order: bool = False,
    turns: int = 1,
) -> tuple[Planned, ...]:
    """Conversation ``number``'s turns (at most ``turns``): lengths drawn per turn, or a
    prompt from ``prompts`` (the ``number``-th when ``in_order``, as a trace replays; else
    drawn) and its follow-ups. ``output_tokens``, when given, overrides a prompt's own
    reply length."""
    if not prompts:
        planned = []
        for _ in range(turns):
            words = prompt_words.draw(rng)
            tokens = output_tokens.draw(rng) if output_tokens else None
            planned.append(Planned(prompt_of(words), words, tokens))
        return tuple(planned)
    chosen = prompts[number % len(prompts)] if in_order else rng.choice(prompts)
    return tuple(
        Planned(
            p.text,
            len(p.text.split()),
            output_tokens.draw(rng) if output_tokens else p.output_tokens,
        )
        for p in (chosen, *chosen.follow_ups)[:turns]
    )


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length that is fixed (``64``) or drawn: ``uniform:LO:HI``, ``normal:MEAN:SD`` or
    ``hist:FILE`` (a histogram: lines of ``LENGTH WEIGHT``, ``#`` comments).

    Drawn lengths are whole numbers, never below ``minimum`` (nor above ``maximum``, when
    given: a normal distribution's tail has no end); a uniform draw makes each whole number
    between its bounds equally likely.
    """

    kind: Literal["fixed", "uniform", "normal", "histogram"]
    a: float
    b: float = 0.0
    minimum: int = 0
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    source: str = ""
    maximum: int | None = None

    @classmethod
    def parse(cls, text: str, *, minimum: int = 0, maximum: int | None = None) -> Lengths:
        """Read ``N``, ``uniform:LO:HI``, ``normal:MEAN:SD`` or ``hist:FILE``; raises
        ValueError otherwise (or when the file cannot be read, or a length passes
        ``maximum``)."""
        name, _, rest = text.partition(":")
        if name == "hist":
            values, weights = read_histogram(rest, minimum, maximum)
            return cls("histogram", 0, minimum=minimum, values=values, weights=weights, source=rest)
        most = "" if maximum is None else f" and <= {maximum:,}"
        forms = f"{text!r}: want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE (>= {minimum}{most})"
        numbers = rest.split(":")
        try:
            if not rest:
                value = int(name)
                if value < minimum:
                    raise ValueError(f"{text!r}: length must be at least {minimum}, got {value}")
                if maximum is not None and value > maximum:
                    raise ValueError(f"{text!r}: length must be at most {maximum:,}, got {value:,}")
                return cls("fixed", value, minimum=minimum)
            if name not in ("uniform", "normal") or len(numbers) != 2:
                raise ValueError(forms)
            a, b = float(numbers[0]), float(numbers[1])
        except ValueError as exc:
            # int() and float() say it in Python's words ("invalid literal for int()")
            raise ValueError(str(exc) if str(exc).startswith(repr(text)) else forms) from None
        if not (math.isfinite(a) and math.isfinite(b)):  # a draw is rounded to a whole number
            raise ValueError(f"{text!r}: want finite numbers")
        # The largest a draw is meant to reach: HI, or the mean (the tail is cut at maximum).
        meant = b if name == "uniform" else a
        if maximum is not None and meant > maximum:
            raise ValueError(f"{text!r}: lengths must be at most {maximum:,}")
        if maximum is not None and name == "normal" and b > maximum:
            # Most draws would be cut at a bound, not drawn from the distribution asked for.
            raise ValueError(f"{text!r}: the SD must be at most {maximum:,}")
        if name == "uniform" and minimum <= a <= b:
            return cls("uniform", a, b, minimum, maximum=maximum)
        if name == "normal" and a >= minimum and b >= 0:
            return cls("normal", a, b, minimum, maximum=maximum)
        raise ValueError(forms)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "histogram":
            return rng.choices(self.values, self.weights)[0]
        if self.kind == "uniform":
            # Each whole length between the bounds equally likely (a continuous draw rounded
            # would give each bound half the others' share); none between: the nearest.
            low, high = math.ceil(self.a), math.floor(self.b)
            if low <= high:
                return rng.randint(low, high)
            return round((self.a + self.b) / 2)
        value = rng.gauss(self.a, self.b)
        # Clamped before rounding: a wide normal's draw can pass what round() makes an int
        # of (inf), or be no number at all (nan).
        top = _MOST_DRAWN if self.maximum is None else self.maximum
        value = value if math.isfinite(value) else (top if value > 0 else self.minimum)
        return round(min(max(value, self.minimum), top))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        if self.kind == "histogram":
            return f"hist:{self.source}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


def read_histogram(
    path: str, minimum: int, maximum: int | None = None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A histogram file's lengths and weights; raises ValueError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise ValueError(f"hist:{path}: cannot read ({exc.strerror})") from None
    values: list[int] = []
    weights: list[float] = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields:
            continue
        try:
            length, weight = int(fields[0]), float(fields[1])
            too_long = maximum is not None and length > maximum
            if len(fields) != 2 or length < minimum or too_long or not 0 <= weight < float("inf"):
                raise ValueError
        except (ValueError, IndexError):
            most = "" if maximum is None else f" and <= {maximum:,}"
            raise ValueError(
                f"hist:{path} line {number}: want LENGTH WEIGHT (length >= {minimum}{most}, "
                f"weight >= 0), got {line.strip()!r}"
            ) from None
        values.append(length)
        weights.append(weight)
    total = sum(weights)
    if not total > 0:
        raise ValueError(f"hist:{path}: no length has a positive weight")
    if total == float("inf"):  # each weight finite, their sum not: a draw cannot be made
        raise ValueError(f"hist:{path}: the weights add up to more than a number can hold")
    return tuple(values), tuple(weights)
