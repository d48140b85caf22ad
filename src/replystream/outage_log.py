"""How a call repeated while a failure lasts (every second, or at every poll of a line)
tells of it: once as the failure begins, once as it ends, not at every attempt in between.
It must not know what failed: the log, the words and how an error is told are given."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class OutageLog:
    """Tells of a call repeated while a failure lasts: once when it begins to fail, once when
    it succeeds again (with how long it failed), not at every attempt in between."""

    __slots__ = ("_attempts", "_describe", "_level", "_log", "_since", "what")

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        describe: Callable[[BaseException], str] = str,
        level: int = logging.WARNING,
    ) -> None:
        self._log = log
        self.what = what  # what failed, as the log says it ("liveness refresh")
        self._describe = describe  # an error as the log tells it
        self._level = level
        self._since: float | None = None  # when it began to fail (None: it succeeds)
        self._attempts = 0  # failed attempts since

    def failed(self, exc: BaseException) -> None:
        if self._since is None:
            self._since = time.monotonic()
            self._attempts = 0
            self._log.log(
                self._level,
                "%s failed: %s (told again once it succeeds)",
                self.what,
                self._describe(exc),
            )
        self._attempts += 1

    def succeeded(self) -> None:
        self._end("succeeds again")

    def idle(self) -> None:
        """Nothing is left to send (the replies it refreshed ended): an outage under way is
        told to end here, unknown, so that the next one is told as it begins."""
        self._end("has nothing left to send")

    def _end(self, how: str) -> None:
        if self._since is not None:
            self._log.log(
                self._level,
                "%s %s, after failing for %.1f s (%d attempts)",
                self.what,
                how,
                time.monotonic() - self._since,
                self._attempts,
            )
            self._since = None
