"""Read the workload files a user gives ``replystream bench``: a dataset of prompts, a trace.

This file decides which layouts are understood and refuses anything else with the file and
line at fault. A dataset is JSONL (or one JSON array) of records, each one of:
- ``{"prompt": "...", "output_tokens": 64}`` (``output_tokens`` optional);
- ShareGPT's ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}``;
- ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``.
A conversation gives its user turns as prompts (the first, then its follow-ups), each with
the word count of the reply that follows it as the reply length. A trace is JSONL of
``{"timestamp": S, "prompt_words": N, "output_tokens": M}`` in time order (seconds, any
origin). It must not know how requests are sent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from replystream.lab.workload import MOST_PROMPT_WORDS, Prompt, prompt_of

_USER = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


def _records(path: Path) -> list[tuple[int, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None
    records = []
    if text.lstrip().startswith("["):
        try:
            records = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:  # json.loads recurses; a file may nest past the limit
            raise ValueError(f"{path}: not JSON (nested too deeply)") from None
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
                except RecursionError:
                    raise ValueError(
                        f"{path} line {number}: not JSON (nested too deeply)"
                    ) from None
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _turns(record: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(speaker, text) of a ShareGPT or messages record; None when it is neither (or a turn
    is not an object)."""
    for key, speaker, text in (("conversations", "from", "value"), ("messages", "role", "content")):
        turns = record.get(key)
        if isinstance(turns, list):
            if not all(isinstance(t, dict) for t in turns):
                return None
            return [(str(t.get(speaker, "")), str(t.get(text, ""))) for t in turns]
    return None


def _prompt(record: Any) -> Prompt | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        tokens = record.get("output_tokens")
        if tokens is None or (type(tokens) is int and tokens >= 1):  # true is no length
            return Prompt(record["prompt"], tokens)
        return None
    turns = _turns(record)
    if turns is None:
        return None
    asked = []
    for i, (speaker, text) in enumerate(turns):
        if speaker in _USER and text.strip():
            reply = next((t for s, t in turns[i + 1 :] if s in _ASSISTANT), "")
            asked.append(Prompt(text, len(reply.split()) or None))
    if not asked:
        return None
    return Prompt(asked[0].text, asked[0].output_tokens, tuple(asked[1:]))


def read_dataset(path: Path) -> tuple[Prompt, ...]:
    """Every prompt of a dataset file; raises ValueError naming the file and line at fault."""
    prompts = []
    for number, record in _records(path):
        prompt = _prompt(record)
        if prompt is None:
            raise ValueError(
                f"{path} record {number}: want {{'prompt', 'output_tokens'?}}, ShareGPT "
                "'conversations' or 'messages' with a non-empty user turn"
            )
        prompts.append(prompt)
    return tuple(prompts)


def _whole(value: Any, least: int, most: int | None) -> int:
    """``value`` as a whole number from ``least`` to ``most``; raises ValueError otherwise (a
    fraction, infinity, or a prompt too long to build)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError
    if isinstance(value, float) and not value.is_integer():  # also NaN and infinity
        raise ValueError
    number = int(value)
    if number < least or (most is not None and number > most):
        raise ValueError
    return number


def read_trace(path: Path) -> tuple[tuple[float, ...], tuple[Prompt, ...]]:
    """A trace's arrival times (seconds from its first request) and its requests; raises
    ValueError naming the file and line at fault."""
    times: list[float] = []
    prompts: list[Prompt] = []
    for number, record in _records(path):
        try:
            at = float(record["timestamp"])
            # NaN is in no order and an infinite time never comes: neither is a time.
            if not math.isfinite(at) or (times and at < times[-1]):
                raise ValueError
            words = _whole(record.get("prompt_words", 0), 0, MOST_PROMPT_WORDS)
            tokens = record.get("output_tokens")
            if tokens is not None:
                tokens = _whole(tokens, 1, None)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(
                f"{path} record {number}: want {{'timestamp': S, 'prompt_words': N, "
                "'output_tokens': M}, finite timestamps in order, "
                f"0 <= N <= {MOST_PROMPT_WORDS:,}, M >= 1"
            ) from None
        times.append(at)
        prompts.append(Prompt(prompt_of(words), tokens))
    start = times[0]
    return tuple(t - start for t in times), tuple(prompts)
