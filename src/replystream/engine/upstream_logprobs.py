"""Log probabilities an OpenAI-compatible upstream sends in a chunk, read into ours.

A chat chunk's ``choices[i].logprobs.content`` is a list of ``{token, logprob, bytes,
top_logprobs}``, one per token of the chunk's text; a legacy completion's
``choices[i].logprobs`` holds lists of ``tokens``, ``token_logprobs`` and ``top_logprobs``
(maps of token to log probability). Entries that are not of that shape are
skipped (an upstream's odd entry must not end a reply), and so is one whose log probability
is no finite number: a Python server writes NaN and infinities as ``json.dumps`` does, the
relay's JSON parser reads them, and JSON cannot carry them on to a client. It must not know
about HTTP.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from replystream.engine.base import TokenLogprob, TopLogprob, token_name, unescaped_bytes


def _finite(value: object) -> float | None:
    """A JSON number as a finite float; None for anything else (a bool, which Python counts
    as a number, NaN, an infinity, an integer past a float's range)."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if type(value) is int:
        return float(value) if abs(value) <= sys.float_info.max else None
    return None


def _candidate(entry: Any) -> TopLogprob | None:
    if not isinstance(entry, dict):
        return None
    token, logprob, raw = entry.get("token"), _finite(entry.get("logprob")), entry.get("bytes")
    if not isinstance(token, str) or logprob is None:
        return None
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        data = bytes(raw)
    else:
        data = token.encode()
    return TopLogprob(token, logprob, data)


def _legacy_token(name: str) -> tuple[str, bytes]:
    """A legacy token's name and bytes: one named ``bytes:`` and its bytes escaped (part of
    a character, as OpenAI's legacy completions and this server name it) is those bytes,
    not the 14 characters of its name; any other is its own UTF-8."""
    if name.startswith("bytes:"):
        raw = unescaped_bytes(name.removeprefix("bytes:"))
        if raw is not None:
            return token_name(raw), raw
    return name, name.encode()


def _legacy(logprobs: dict[str, Any]) -> tuple[TokenLogprob, ...] | None:
    """Ours, from a legacy completion's ``logprobs``: parallel lists of ``tokens``,
    ``token_logprobs`` and ``top_logprobs`` (each a map of token to log probability, or
    null), with no bytes (each token's own UTF-8, or the bytes a ``bytes:`` name spells)."""
    tokens, values, tops = (logprobs.get(k) for k in ("tokens", "token_logprobs", "top_logprobs"))
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    made: list[TokenLogprob] = []
    for index, (token, value) in enumerate(zip(tokens, values, strict=False)):
        logprob = _finite(value)
        if not isinstance(token, str) or logprob is None:
            continue
        candidates = tops[index] if isinstance(tops, list) and index < len(tops) else None
        top = []
        if isinstance(candidates, dict):
            for candidate, number in candidates.items():
                finite = _finite(number)
                if isinstance(candidate, str) and finite is not None:
                    name, data = _legacy_token(candidate)
                    top.append(TopLogprob(name, finite, data))
        name, data = _legacy_token(token)
        made.append(TokenLogprob(name, logprob, data, tuple(top)))
    return tuple(made)


def relayed_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """Ours, from a chunk choice's ``logprobs`` object: a chat chunk's ``content`` list, or a
    legacy completion's lists (None: neither)."""
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if not isinstance(content, list):
        return _legacy(logprobs) if "tokens" in logprobs else None
    made: list[TokenLogprob] = []
    for entry in content:
        token = _candidate(entry)
        if token is None:
            continue
        tops = entry.get("top_logprobs")
        top = [_candidate(t) for t in tops] if isinstance(tops, list) else []
        made.append(TokenLogprob(*token, tuple(t for t in top if t is not None)))
    return tuple(made)
