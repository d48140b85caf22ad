"""An engine that says exactly what a test tells it to: one delta per scripted piece of text.

A test sets the script (`ScriptedEngine.say`, or `say_bytes` for the raw bytes of a
byte-level tokenizer) before each request; every reply started after that replays it. It
implements the `Engine` protocol and nothing more: no timing, no sampling, no prompt.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncGenerator, Iterable

from replystream.engine.base import (
    Delta,
    DeltaSink,
    DeltaStream,
    EngineStats,
    GenerationRequest,
    InProcessEngine,
)
from replystream.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer


class _PieceTokenizer(ByteTokenizer):
    """A byte-level vocabulary whose token ``i`` is ``pieces[i]`` (no trained BPE needed)."""

    def __init__(self, pieces: list[bytes]) -> None:  # no super(): there is no tokenizer.json
        self._bytes = pieces


def detokenize(pieces: Iterable[bytes]) -> list[str]:
    """The texts the built-in engine's detokenizer makes of byte-level tokens, one per token.

    It runs the real `IncrementalDetokenizer`: a token ending inside a multi-byte character
    gives ``""`` until the character completes; invalid UTF-8 becomes U+FFFD (Python's
    ``errors="replace"``: one U+FFFD per maximal invalid subsequence); and, as the runner
    does, the last token's text also carries the flush of whatever is still held.
    """
    vocab = list(pieces)
    detokenizer = IncrementalDetokenizer(_PieceTokenizer(vocab))
    texts = [detokenizer.push(token_id) for token_id in range(len(vocab))]
    if texts:
        texts[-1] += detokenizer.flush()
    return texts


def decoded(pieces: Iterable[bytes]) -> str:
    """What the client must read for byte-level tokens: all their bytes, decoded at once."""
    return codecs.decode(b"".join(pieces), "utf-8", errors="replace")


class ScriptedEngine(InProcessEngine):
    """Replays the current script: one `Delta` per piece, the last with ``finish_reason``."""

    name = "scripted"
    pushes = False
    queues = False
    makes_tool_calls = False

    def __init__(self, texts: Iterable[str] = ()) -> None:
        self._script: tuple[str, ...] = tuple(texts)
        self._counts = dict.fromkeys(("started", "finished", "cancelled", "failed"), 0)
        self._active = 0
        self._steps = 0

    def say(self, texts: Iterable[str]) -> None:
        """Every reply started from now on makes exactly these deltas' texts."""
        self._script = tuple(texts)

    def say_bytes(self, pieces: Iterable[bytes]) -> None:
        """Like `say`, for byte-level tokens detokenized as the built-in engine does."""
        self.say(detokenize(pieces))

    async def start(self, request: GenerationRequest) -> DeltaStream:
        self._counts["started"] += 1
        return self._generate(self._script)

    async def _generate(self, script: tuple[str, ...]) -> AsyncGenerator[Delta, None]:
        self._active += 1
        finished = False
        try:
            for index, text in enumerate(script):
                # Yield to the loop between tokens, as a real engine does, so events are
                # written (and may be split by TCP) while the reply is still being made.
                await asyncio.sleep(0)
                self._steps += 1
                last = index == len(script) - 1
                yield Delta(text, 1, time.monotonic(), "stop" if last else None)
            finished = True
        finally:
            self._active -= 1
            self._counts["finished" if finished else "cancelled"] += 1

    def seed_for(self, request: GenerationRequest) -> int | None:
        return request.sampling.seed  # the script is the reply, whatever the seed

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def count_prompt(self, request: GenerationRequest) -> int:
        return self.count_tokens(request.prompt)

    def stats(self) -> EngineStats:
        c = self._counts
        return EngineStats(
            c["started"], c["finished"], c["cancelled"], c["failed"], self._active, self._steps
        )

    async def aclose(self) -> None:
        return None


class GroupedPushEngine(ScriptedEngine):
    """Pushes its script to the reply's sink ``group`` deltas at a time, ``pause_s`` apart:
    what a push-capable engine that fell behind its schedule delivers."""

    name = "grouped"
    pushes = True
    queues = False

    def __init__(self, texts: Iterable[str], group: int, pause_s: float = 0.005) -> None:
        super().__init__(texts)
        self.group = group
        self.pause_s = pause_s

    async def start(self, request: GenerationRequest) -> DeltaStream:
        self._counts["started"] += 1
        return _GroupedStream(self, self._script)


class _GroupedStream:
    def __init__(self, engine: GroupedPushEngine, script: tuple[str, ...]) -> None:
        self._engine = engine
        self._script = script
        self._task: asyncio.Task[None] | None = None

    def __aiter__(self) -> _GroupedStream:
        return self

    async def __anext__(self) -> Delta:
        raise RuntimeError("a grouped stream only pushes: attach a sink")

    def attach(self, sink: DeltaSink) -> None:
        self._task = asyncio.get_running_loop().create_task(self._push(sink))

    async def _push(self, sink: DeltaSink) -> None:
        engine, script = self._engine, self._script
        deltas = [
            Delta(text, 1, time.monotonic(), "stop" if i == len(script) - 1 else None)
            for i, text in enumerate(script)
        ]
        for start in range(0, len(deltas), engine.group):
            await asyncio.sleep(engine.pause_s)
            engine._steps += len(deltas[start : start + engine.group])
            sink.on_deltas(deltas[start : start + engine.group])
        engine._counts["finished"] += 1
        sink.on_end(None)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            self._engine._counts["cancelled"] += 1
