"""What the lifecycle driver expects of a reply's text and finish, from its request alone.

The simulated engine's text is fixed for a length, so a request's options decide how its
reply ends: at its token limit (``length``), at the first stop string to complete
(``stop``: the text before it, no part of it ever sent), or at the server's banned phrase
(``moderated``: a whole reply holds the text before the match; a stream may have sent the
phrase's first tokens when its hold-back window is shorter than the phrase, never all of it).
A reply that fails, is cancelled or stops for want of a reader sends what it held as at an
end, where no stop string can complete: the start of one then goes out too.
And what each dialect's events say of text, finish and log probabilities, read the same way
for every reader.

The servers make ``REPLY_TEXT``: the simulated engine's own, but for two words thousands of
characters long, so that a reply of more than a few tokens is more than a narrow client's
buffers hold (``tests/narrow_link``), and one that stops reading holds up the server's writes
and falls a long word behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replystream.engine.simulated import DEFAULT_REPLY, reply_of_length

# The server's banned phrase (``--ban``): the engine's words 35 to 37, so a reply of 37 tokens
# or more is moderated there, a shorter one never.
BANNED = "first piece exists"
BANNED_TOKENS = 3
MAX_TOKENS = 48
# Words made long, by index (both before the banned phrase, so a moderated reply has them):
# a reader that stops reading before the first holds up the server's writes by the time it
# is sent, and is more than the servers' --slow-client-bytes behind once the second is made.
LONG_WORDS = {17: 9000, 29: 6000}
SLOW_CLIENT_BYTES = 4096


def long_word(word: str, size: int) -> str:
    return (word + "".join(f"-{n:04d}" for n in range(size // 5)))[:size]


def reply_text() -> str:
    words = DEFAULT_REPLY.split()
    for index, size in LONG_WORDS.items():
        words[index] = long_word(words[index], size)
    return " ".join(words)


REPLY_TEXT = reply_text()


def reference(max_tokens: int) -> str:
    return reply_of_length(REPLY_TEXT, max_tokens) + " "


@dataclass(frozen=True)
class Expected:
    whole: str  # a whole reply's text (and a stream's told its end, at least)
    most_told: str  # the most text a stream told its end may show
    most: str  # the most text any stream of it may show, ended or not
    finish: str  # length, stop or moderated
    stop: str | None = None  # the stop string it ends at


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first stop string to complete starts, and which (of two completing at the
    same character, the longer)."""
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        return None
    end, _, stop = min(found)
    return end - len(stop), stop


def overlaps_ban(max_tokens: int, stops: tuple[str, ...]) -> bool:
    """Whether the first stop string shares text with the banned phrase (which one decides
    is then a matter of the buffer's rules, left to the focused tests)."""
    text = reference(max_tokens)
    ban = text.casefold().find(BANNED)
    stop = first_stop(text, stops)
    if ban < 0 or stop is None:
        return False
    start, string = stop
    return start < ban + len(BANNED) and ban < start + len(string)


def expected(max_tokens: int, stops: tuple[str, ...], window: int) -> Expected:
    text = reference(max_tokens)
    ban = text.casefold().find(BANNED)
    stop = first_stop(text, stops)
    if ban >= 0 and (stop is None or ban + len(BANNED) <= stop[0]):
        # A window as long as the phrase sends none of it; a shorter one may send its start.
        most = text[: ban + len(BANNED) - 1]
        told = text[:ban] if window >= BANNED_TOKENS else most
        return Expected(text[:ban], told, most, "moderated")
    if stop is not None:
        start, string = stop
        cut = text[:start]
        return Expected(cut, cut, text[: start + len(string) - 1], "stop", string)
    return Expected(text, text, text, "length")


def pieces(dialect: str, event_type: str, data: Any) -> tuple[tuple[int, str], ...]:
    """The reply text one event carries in its dialect, as (choice, text) pairs."""
    if not isinstance(data, dict):
        return ()
    if dialect == "native":
        return ((0, str(data.get("text", ""))),) if event_type == "token" else ()
    if dialect == "chat":
        return tuple(
            (int(c["index"]), str(c["delta"].get("content") or ""))
            for c in data.get("choices") or []
            if c["delta"].get("content")
        )
    if dialect == "responses":
        if event_type == "response.output_text.delta":
            return ((0, str(data.get("delta", ""))),)
        return ()
    if event_type == "content_block_delta" and data["delta"].get("type") == "text_delta":
        return ((0, str(data["delta"]["text"])),)
    return ()


CHAT_FINISH = {"length": "length", "stop": "stop", "content_filter": "moderated"}
MESSAGES_FINISH = {"max_tokens": "length", "stop_sequence": "stop", "refusal": "moderated"}
RESPONSES_FINISH = {"max_output_tokens": "length", "content_filter": "moderated"}


def finishes(dialect: str, event_type: str, data: Any) -> list[tuple[int, str, str | None]]:
    """The finishes an event tells, as (choice, length|stop|moderated|other, stop string)."""
    if not isinstance(data, dict):
        return []
    if dialect == "native":
        if event_type == "done":
            return [(0, str(data.get("finish_reason")), data.get("stop_sequence"))]
        return [(0, "moderated", None)] if event_type == "moderated" else []
    if dialect == "chat":
        return [
            (int(c["index"]), CHAT_FINISH.get(c["finish_reason"], c["finish_reason"]), None)
            for c in data.get("choices") or []
            if c.get("finish_reason")
        ]
    if dialect == "responses":
        return response_finish(data.get("response"))
    if event_type == "message_delta":
        reason = str(data["delta"].get("stop_reason"))
        return [(0, MESSAGES_FINISH.get(reason, str(reason)), data["delta"].get("stop_sequence"))]
    return []


def response_finish(response: Any) -> list[tuple[int, str, str | None]]:
    if not isinstance(response, dict):
        return []
    if response.get("status") == "completed":
        return [(0, "stop", None)]
    if response.get("status") == "incomplete":
        reason = str((response.get("incomplete_details") or {}).get("reason"))
        return [(0, RESPONSES_FINISH.get(reason, reason), None)]
    return []


def logprob_entries(dialect: str, event_type: str, data: Any) -> list[tuple[str, Any]]:
    """(text, entries) for each piece of text an event carries with its log probabilities."""
    if not isinstance(data, dict):
        return []
    if dialect == "chat":
        return [
            (str(c["delta"].get("content") or ""), (c.get("logprobs") or {}).get("content"))
            for c in data.get("choices") or []
            if c["delta"].get("content")
        ]
    if dialect == "responses" and event_type == "response.output_text.delta":
        return [(str(data.get("delta", "")), data.get("logprobs"))]
    return []


def logprob_problem(text: str, entries: Any, top: int) -> str | None:
    """What is wrong with the entries of one piece of text. A token's entry goes with the
    piece its text begins in (a stop string may hold a token's last characters back for the
    next piece, or cut it short), so a piece is the end of an earlier token, its own tokens
    whole, then the start of its last; each entry has ``top`` alternatives."""
    if not isinstance(entries, list):
        return f"text {text!r} without log probabilities: {entries!r}"
    tokens = [str(e.get("token")) for e in entries]
    # Where a word (a token of the simulated engine) surely begins inside the piece.
    begins = sum(1 for i in range(1, len(text)) if text[i - 1] == " " and text[i] != " ")
    if len(tokens) not in (begins, begins + 1) or (not tokens and " " in text.strip(" ")):
        return f"text {text!r} with entries of {tokens!r}"
    if tokens:
        whole, last = "".join(tokens[:-1]), tokens[-1]
        if not any(
            text[at:].startswith(whole)
            and len(text) > at + len(whole)
            and last.startswith(text[at + len(whole) :])
            for at in range(len(text))
        ):
            return f"text {text!r} with entries of {tokens!r}"
    counts = {len(e.get("top_logprobs") or []) for e in entries}
    if counts - {top}:
        return f"text {text!r}: {sorted(counts)} alternatives, asked {top}"
    return None
