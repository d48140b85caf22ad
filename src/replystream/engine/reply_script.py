"""A scripted reply for the simulated engine: text and tool calls, step by step, with timing.

The file (``serve --engine simulated --reply-script FILE``) is a JSON list of steps::

    [
      {"text": "Let me look that up. ", "delay_ms": 40},
      {"tool_call": {"name": "get_weather", "id": "call_1",
                     "arguments": ["{\\"city\\":", " \\"Paris\\"}"]}, "delay_ms": 25}
    ]

- A ``text`` step is one delta of that text (one token).
- A ``tool_call`` step is a call: one delta naming it (``id`` and ``name``, arguments
  empty), then one delta per fragment of ``arguments`` (a list of strings, kept exactly as
  given; one string is one fragment), each one token. ``id`` is optional: without it the
  call's id is derived from the script (``call_`` and 24 hex digits), the same in every reply.
  The fragments are not required to join into valid JSON: a client may want to see what it
  does with a model's broken arguments.
- ``delay_ms`` (optional, >= 0) is the time before each delta of the step; without it the
  engine's own seeded delay (``--delay-ms`` ± ``--jitter-ms``) applies.
The reply's finish reason is ``tool_calls`` when the script makes a call, else ``stop``
(``length`` when ``max_tokens`` cuts it). A request's ``tool_choice`` may leave calls out
(``ReplyScript.keeping_calls_to``): none of them, or all but those to the one function it
names. This file reads and checks a script, with one
message per mistake naming the step and the field. It must not know about HTTP or timing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replystream.engine.base import ToolCallDelta

STEP_KEYS = frozenset({"text", "tool_call", "delay_ms"})
CALL_KEYS = frozenset({"name", "id", "arguments"})


class ScriptError(ValueError):
    """The script cannot be used: the message names the step and the field at fault."""


@dataclass(frozen=True, slots=True)
class ScriptedDelta:
    """One delta of the script: text or a piece of a tool call, and its delay (None: the
    engine's own)."""

    text: str
    tool_call: ToolCallDelta | None
    delay_ms: float | None


@dataclass(frozen=True, slots=True)
class ReplyScript:
    """A checked script, as the deltas it makes (in order)."""

    deltas: tuple[ScriptedDelta, ...]
    calls: int  # how many tool calls it makes

    @property
    def finish_reason(self) -> str:
        """How the whole script ends: ``tool_calls`` if it makes any, else ``stop``."""
        return "tool_calls" if self.calls else "stop"

    @property
    def call_names(self) -> tuple[str, ...]:
        """The functions the script calls, each once, in the order of their first call."""
        names = (delta.tool_call.name for delta in self.deltas if delta.tool_call is not None)
        return tuple(dict.fromkeys(name for name in names if name is not None))

    def keeping_calls_to(self, name: str | None) -> ReplyScript:
        """The script with only its calls to ``name`` (None: no calls at all), renumbered
        from 0 in script order; its text and every delay as written."""
        kept: list[ScriptedDelta] = []
        numbers: dict[int, int] = {}  # a kept call's index in the script -> in this reply
        for delta in self.deltas:
            call = delta.tool_call
            if call is None:
                kept.append(delta)
                continue
            if call.name is not None and call.name == name:  # a call's first delta names it
                numbers[call.index] = len(numbers)
            if call.index in numbers:
                renumbered = call._replace(index=numbers[call.index])
                kept.append(ScriptedDelta(delta.text, renumbered, delta.delay_ms))
        return ReplyScript(tuple(kept), len(numbers))


def load_reply_script(path: str | Path) -> ReplyScript:
    """Read and check a script file.

    Raises:
        ScriptError: the file cannot be read, is not JSON, or a step is wrong.
    """
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError(f"cannot read {str(path)!r}: {exc}") from None
    try:
        steps = json.loads(raw)
    except ValueError as exc:
        raise ScriptError(f"{str(path)!r} is not JSON: {exc}") from None
    except RecursionError:  # json.loads recurses; a file may nest past the limit
        raise ScriptError(f"{str(path)!r} is not JSON: nested too deeply") from None
    return parse_reply_script(steps)


def parse_reply_script(steps: Any) -> ReplyScript:
    """Check a script already parsed from JSON.

    Raises:
        ScriptError: a step is wrong (the message names it, counted from 1).
    """
    if not isinstance(steps, list) or not steps:
        raise ScriptError("a reply script is a non-empty JSON list of steps")
    deltas: list[ScriptedDelta] = []
    calls = 0
    for number, step in enumerate(steps, 1):
        where = f"step {number}"
        if not isinstance(step, dict):
            raise ScriptError(f"{where} must be an object")
        unknown = sorted(set(step) - STEP_KEYS)
        if unknown:
            raise ScriptError(f"{where} has an unknown field {unknown[0]!r}")
        if ("text" in step) == ("tool_call" in step):
            raise ScriptError(f"{where} must have exactly one of text and tool_call")
        delay = _delay(step, where)
        if "text" in step:
            text = step["text"]
            if not isinstance(text, str) or not text:
                raise ScriptError(f"{where}: text must be a non-empty string")
            deltas.append(ScriptedDelta(text, None, delay))
            continue
        deltas.extend(_call(step["tool_call"], calls, delay, f"{where}: tool_call"))
        calls += 1
    return ReplyScript(tuple(deltas), calls)


def _delay(step: dict[str, Any], where: str) -> float | None:
    delay = step.get("delay_ms")
    if delay is None:
        return None
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 1e9:
        raise ScriptError(
            f"{where}: delay_ms must be a number from 0 to below 1000000000 (about 11.6 days)"
        )
    return float(delay)


def _call(call: Any, index: int, delay: float | None, where: str) -> list[ScriptedDelta]:
    if not isinstance(call, dict):
        raise ScriptError(f"{where} must be an object")
    unknown = sorted(set(call) - CALL_KEYS)
    if unknown:
        raise ScriptError(f"{where} has an unknown field {unknown[0]!r}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ScriptError(f"{where}.name must be a non-empty string")
    arguments = call.get("arguments", [])
    if isinstance(arguments, str):
        arguments = [arguments]
    if not isinstance(arguments, list) or not all(
        isinstance(part, str) and part for part in arguments
    ):
        raise ScriptError(
            f"{where}.arguments must be a string or a list of non-empty strings (its fragments)"
        )
    call_id = call.get("id")
    if call_id is None:
        seed = json.dumps([index, name, arguments]).encode()
        call_id = "call_" + hashlib.blake2b(seed, digest_size=12).hexdigest()
    elif not isinstance(call_id, str) or not call_id:
        raise ScriptError(f"{where}.id must be a non-empty string")
    head = ScriptedDelta("", ToolCallDelta(index, call_id, name, ""), delay)
    return [head] + [
        ScriptedDelta("", ToolCallDelta(index, None, None, part), delay) for part in arguments
    ]
