"""Batching: send every k tokens or every W ms, whichever comes first (a window alone: every W ms).

Pure state with the clock passed in. A batch's window starts when its first token arrives, so
the first token of a full batch waits about (k - 1) x d and the average token (k - 1) x d / 2
at d ms per token; the window W caps that wait when tokens come slowly. This file must not
know about sockets or event formats.
"""

from __future__ import annotations


class Batcher:
    """Collects released text into batches of at most ``max_tokens`` or ``window_s`` seconds
    (``max_tokens`` None: as many as the window gathers; with no window, one token a batch)."""

    def __init__(self, max_tokens: int | None = 1, window_s: float | None = None) -> None:
        if max_tokens is None:
            max_tokens = 1 if window_s is None else 0
        elif max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if window_s is not None and window_s < 0:
            raise ValueError("window_s must be >= 0")
        self.max_tokens = max_tokens
        self.window_s = window_s
        self._parts: list[str] = []
        self._tokens = 0
        self._opened_at: float | None = None

    @property
    def due_at(self) -> float | None:
        """When the open batch must be flushed by its window (None: no open batch or window)."""
        if self._opened_at is None or self.window_s is None:
            return None
        return self._opened_at + self.window_s

    def add(self, text: str, tokens: int, now: float) -> tuple[str, int] | None:
        """Add released text; return a batch (text, tokens) when one is complete."""
        if not text and not tokens:
            return None
        if self._opened_at is None:
            self._opened_at = now
        self._parts.append(text)
        self._tokens += tokens
        # Unbatched (one token a batch), released text with no token of its own (the first
        # part of a token whose rest could begin a stop string) goes out at once too. A
        # limit of 0 batches by the window alone.
        limit = self.max_tokens
        if (limit and (self._tokens >= limit or limit == 1)) or self.expired(now):
            return self.flush()
        return None

    def expired(self, now: float) -> bool:
        due = self.due_at
        return due is not None and now >= due

    def flush(self) -> tuple[str, int] | None:
        """The open batch, however small (None if empty)."""
        if self._opened_at is None:
            return None
        batch = ("".join(self._parts), self._tokens)
        self._parts.clear()
        self._tokens = 0
        self._opened_at = None
        return batch
