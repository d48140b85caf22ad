"""Stop strings: where the first one completes in text that arrives in pieces, and how much
of the newest text could still be the start of one.

The reply ends at the first stop string to *complete* (the earliest end; of two ending at the
same character, the longer), cut before its first character. Any other rule would depend on
how the text happened to be split into tokens: with stops ``"abc"`` and ``"b"``, a stream that
has seen ``"ab"`` must already decide, so the text ``"abc"`` ends at ``"a"`` whole or in
pieces. ``StopScan`` is pure and reads only what is new, each character a bounded number of
times per stop string, so a long reply or a long stop string costs the same per piece as a
short one. It must not
know about tokens, events or time. ``delivery.moderation.HoldBack`` uses it to decide what it
withholds and where a reply ends; an engine uses it to stop making tokens early
(``engine.sampling.StopMatcher``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopHit(NamedTuple):
    """A stop string that completed: where it starts in all text seen, and which one."""

    start: int
    stop: str


class StopScan:
    """Watches text piece by piece for the first stop string to complete.

    Each stop string is matched as Knuth, Morris and Pratt match a pattern: how much of it
    the text seen so far ends with (its state) goes on from piece to piece, and a character
    that breaks a partial match falls back to the longest start of the string that the
    matched part ends with (its prefix function). So each character of the reply is looked
    at a bounded number of times per stop string, however long the string: finding a long
    stop string again in a window as long as itself cost every token the string's length
    (four of 40,000 characters: 100 µs a token, ten times a token's whole delivery), and text
    that kept matching its start, the square of that when it broke off. Between partial
    matches a piece is skipped at the speed of ``str.find`` for the string's first character.
    The prefix function is made only as far as the text has matched, so a stop string the
    reply never comes near costs nothing to set up.
    """

    __slots__ = ("_fallbacks", "_states", "_stops", "keep", "seen")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("StopScan needs at least one stop string, none empty")
        self._stops = tuple(dict.fromkeys(stops))
        # Each stop string's prefix function, as far as made: entry i is the length of the
        # longest start of the string that is also an end of its first i + 1 characters.
        self._fallbacks: tuple[list[int], ...] = tuple([] for _ in self._stops)
        self._states = [0] * len(self._stops)  # how much of each the text seen ends with
        self.seen = 0  # characters seen so far
        self.keep = 0  # how many of the newest characters could begin a stop string

    def break_text(self) -> None:
        """The text seen so far ended (a tool call came between): no stop string begun in
        it can complete in what comes next."""
        self._states = [0] * len(self._stops)
        self.keep = 0

    def feed(self, text: str) -> StopHit | None:
        """Scan a new piece; the first stop string it completes, if any. Otherwise ``keep``
        says how much of the text seen so far must be withheld (the shortest tail holding
        every place a stop string could still begin)."""
        before = self.seen
        self.seen += len(text)
        best: tuple[int, int, str] | None = None  # (end in ``text``, -length, stop)
        states = self._states
        for index, stop in enumerate(self._stops):
            # One that completes after the best so far cannot come first: read no further.
            limit = len(text) if best is None else best[0]
            state, end = _advance(stop, self._fallbacks[index], states[index], text, limit)
            states[index] = state
            if end >= 0 and (best is None or (end, -len(stop)) < best[:2]):
                best = (end, -len(stop), stop)
        if best is not None:
            end, negative_length, stop = best
            return StopHit(before + end + negative_length, stop)
        self.keep = max(states)
        return None


def _advance(stop: str, fallbacks: list[int], state: int, text: str, limit: int) -> tuple[int, int]:
    """Match ``stop`` on through ``text[:limit]``, from ``state`` (how much of it the text
    before ends with): how much of it the text read then ends with, and where in ``text``
    it first completes (-1: nowhere, then the state is that after ``text[:limit]``)."""
    first, size = stop[0], len(stop)
    at = 0
    while at < limit:
        if not state:  # no partial match: skip to the next place the string could begin
            at = text.find(first, at, limit)
            if at < 0:
                return 0, -1
        char = text[at]
        while state and stop[state] != char:
            state = fallbacks[state - 1]
        if stop[state] == char:
            state += 1
            if state == size:
                return state, at + 1
            if len(fallbacks) < state:  # a mismatch at ``state`` will need its entry
                _extend(fallbacks, stop)
        at += 1
    return state, -1


def _extend(fallbacks: list[int], stop: str) -> None:
    """Add the next entry of ``stop``'s prefix function (made in order, so each entry costs
    a bounded number of steps on average, as when it is made whole)."""
    i = len(fallbacks)
    if not i:
        fallbacks.append(0)
        return
    k = fallbacks[i - 1]
    while k and stop[i] != stop[k]:
        k = fallbacks[k - 1]
    fallbacks.append(k + 1 if stop[i] == stop[k] else 0)
