"""A seeded stand-in for a model: a fixed reply, one word per token, on a timed schedule.

This file decides the timing of a simulated reply: an optional time before the first token
(queueing plus a prefill that grows with the prompt) and then one token every ``d ± j`` ms.
Delays come from a random source seeded per request, so the same seed gives the same schedule.
Each token is due at a fixed deadline measured from the start (not "sleep d after the last
token"), so a timer that fires late does not push every later token back.
It must not know about HTTP or about who reads the tokens.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from replystream.engine.base import (
    Delta,
    DeltaStream,
    EngineError,
    EngineStats,
    GenerationRequest,
    RequestRejected,
)

# 120 words: the lab's default reply, one word per token as in the reference experiment.
DEFAULT_REPLY = (
    "A language model does not write its answer at once. It reads the prompt, "
    "then makes the reply one token at a time, and each new token depends on every token before "
    "it. The first piece exists after a single step, while the last piece exists only after "
    "the final step. A server can wait for the end and send everything together, or send "
    "each piece the moment it is made. Waiting shows a blank screen for the whole generation. "
    "Streaming shows the first words after about one step and keeps the text growing while "
    "the rest is made. Both finish at nearly the same time, because the model does the same "
    "work in the same order. Only timing differs."
)

ARTICLE_REPLY = "A model does not write the whole answer at once. It makes it one piece at a time."


def split_words(text: str) -> list[str]:
    """Split a reply into word tokens, each keeping the space that follows it."""
    return [word + " " for word in text.split()]


def reply_of_length(text: str, tokens: int) -> str:
    """``text`` cut or repeated word by word to exactly ``tokens`` words."""
    words = text.split()
    if tokens < 1 or not words:
        raise ValueError("need at least one token and one word")
    return " ".join(words[i % len(words)] for i in range(tokens))


@dataclass(frozen=True, slots=True)
class SimulatedConfig:
    """Timing and content of simulated replies (the reference lab's defaults)."""

    reply_text: str = DEFAULT_REPLY
    delay_ms: float = 33.0
    jitter_ms: float = 8.0
    seed: int = 42
    first_token_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    fail_after: int | None = None

    def __post_init__(self) -> None:
        if not split_words(self.reply_text):
            raise ValueError("reply_text must contain at least one word")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError("need delay_ms >= jitter_ms >= 0")
        if self.first_token_ms < 0 or self.prefill_ms_per_token < 0:
            raise ValueError("first_token_ms and prefill_ms_per_token must be >= 0")
        if self.fail_after is not None and self.fail_after < 0:
            raise ValueError("fail_after must be >= 0")


class SimulatedEngine:
    """Makes the configured reply on a seeded schedule; counts every step it actually runs.

    ``fail_after=N`` injects a failure for testing clients: ``N == 0`` fails before the first
    token (at admission), ``N > 0`` fails after N tokens were made.
    """

    name = "simulated"

    def __init__(self, config: SimulatedConfig | None = None) -> None:
        self.config = config or SimulatedConfig()
        self._words = split_words(self.config.reply_text)
        self._started = 0
        self._finished = 0
        self._cancelled = 0
        self._failed = 0
        self._active = 0
        self._steps = 0

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def schedule(self, request: GenerationRequest) -> list[float]:
        """Seconds from the start at which each token of this request is due."""
        cfg = self.config
        seed = cfg.seed if request.sampling.seed is None else request.sampling.seed
        rng = random.Random(seed)
        first = cfg.first_token_ms + cfg.prefill_ms_per_token * self.count_tokens(request.prompt)
        due: list[float] = []
        elapsed_ms = first
        for _ in range(self._reply_length(request)):
            elapsed_ms += rng.uniform(cfg.delay_ms - cfg.jitter_ms, cfg.delay_ms + cfg.jitter_ms)
            due.append(elapsed_ms / 1000.0)
        return due

    def _reply_length(self, request: GenerationRequest) -> int:
        limit = request.sampling.max_tokens
        return len(self._words) if limit is None else min(limit, len(self._words))

    async def start(self, request: GenerationRequest) -> DeltaStream:
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1", param="max_tokens")
        if self.config.fail_after == 0:
            self._failed += 1
            raise EngineError("simulated failure before the first token")
        self._started += 1
        return self._run(request, self.schedule(request))

    async def _run(self, request: GenerationRequest, due: list[float]) -> AsyncGenerator[Delta]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        count = len(due)
        truncated = count < len(self._words)
        self._active += 1
        outcome = "cancelled"
        try:
            for index, at in enumerate(due):
                if self.config.fail_after is not None and index == self.config.fail_after:
                    outcome = "failed"
                    raise EngineError(f"simulated failure after {index} tokens")
                # Overdue tokens still yield to the loop, so a fast schedule cannot starve it.
                await asyncio.sleep(max(0.0, start + at - loop.time()))
                self._steps += 1
                last = index == count - 1
                finish = ("length" if truncated else "stop") if last else None
                yield Delta(self._words[index], 1, time.monotonic(), finish)
            outcome = "finished"
        finally:
            # Runs on normal end, on aclose() and on cancellation of the reading task alike.
            self._active -= 1
            if outcome == "finished":
                self._finished += 1
            elif outcome == "failed":
                self._failed += 1
            else:
                self._cancelled += 1

    def stats(self) -> EngineStats:
        return EngineStats(
            started=self._started,
            finished=self._finished,
            cancelled=self._cancelled,
            failed=self._failed,
            active=self._active,
            steps=self._steps,
        )

    async def aclose(self) -> None:
        """Nothing to release: every generation lives in its reader's task."""
