"""Speculative decoding by prompt lookup: draft tokens from the context, kept if the model agrees.

This file decides two things, as pure functions:
1. ``propose``: the draft. The sequence's last ``n`` tokens (``n`` from ``max_ngram`` down to
   1) are looked up earlier in the sequence (prompt and reply alike), most recent match first;
   the tokens that followed that match are the draft. Repetitive text (code, quotes, lists,
   names) drafts well; text that repeats nothing drafts nothing and costs nothing.
2. ``accept``: the verification. The model ran once over the last token and the draft, so it
   has next-token logits after each of them. A token is picked from each row in order, exactly
   as ordinary decoding would pick it (greedy, or one seeded draw per token); a drafted token is
   kept while it equals the pick, and the first pick that differs (or the pick after a fully
   accepted draft) is the model's own token. The reply is therefore the one ordinary decoding
   makes, with the same random draws; only the number of steps changes.
It must not know about caches, schedulers or threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Row = TypeVar("Row")


def propose(tokens: Sequence[int], max_ngram: int, max_draft: int) -> tuple[int, ...]:
    """Up to ``max_draft`` tokens that followed the latest earlier match of the sequence's tail."""
    length = len(tokens)
    if max_draft < 1 or length < 2:
        return ()
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = list(tokens[length - n :])
        first = tail[0]
        # A match must be followed by at least one token, so it ends before the tail starts.
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and list(tokens[start : start + n]) == tail:
                follow = tokens[start + n : start + n + max_draft]
                return tuple(follow)
    return ()


def accept(rows: Sequence[Row], draft: Sequence[int], pick: Callable[[Row], int]) -> list[int]:
    """The tokens a verification step makes: drafted tokens the model agrees with, then its own.

    ``rows[j]`` are the logits after the chunk's ``j``-th token (the last real token, then each
    drafted one), so ``len(rows) == len(draft) + 1``. The result has 1 to ``len(draft) + 1``
    tokens.
    """
    made: list[int] = []
    for j, row in enumerate(rows[: len(draft) + 1]):
        token = pick(row)
        made.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return made
