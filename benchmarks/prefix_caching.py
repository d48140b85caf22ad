"""What prefix caching saves a multi-turn chat: each turn's time to first token, with and without.

Usage: python benchmarks/prefix_caching.py [--engine smollm2|tiny|gguf:PATH] [--turns 4]
       [--rounds 3] [--system-words 150] [--tokens 16]

A conversation with a long system prompt, turn after turn, each resending the whole history
(the chat template's rendering of it, as ``serve`` feeds the model), greedy so both engines
make the same replies. The engine is built fresh for each conversation, with
``prefix_caching`` off and on in alternate rounds on the one loaded model, so the machine's
noise falls on both alike. Printed per turn: the median time to first token of each, their
ratio, the prompt tokens and how many the cache held; and whether the two made the same text.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from replystream.cli_values import non_negative_int, positive_int
from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.lab.lab_engines import LabEngine, load_lab_engine
from replystream.server.tool_requests import prompt_of
from tool_main import tool_main

WORDS = (
    "the scribe keeps every word of the law and answers each question plainly and briefly "
    "citing the book where it speaks and saying so where it is silent"
).split()
QUESTIONS = (
    "Who spake unto Moses in the wilderness?",
    "And what did he command the children of Israel?",
    "Where did they camp after that?",
    "How long did they stay there?",
    "Who led them afterwards?",
    "What became of the tabernacle?",
)


async def conversation(
    lab: LabEngine, caching: bool, system: str, turns: int, tokens: int
) -> list[tuple[float, int, int, str]]:
    """Per turn: seconds to the first token, prompt tokens, cached tokens used, the reply."""
    engine = lab.engine(prefix_caching=caching)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    rows = []
    try:
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            request = GenerationRequest(
                prompt_of(messages),  # the plain text a model without a chat template reads
                SamplingParams(max_tokens=tokens, temperature=0.0),
                messages=tuple(messages),
            )
            hits_before = engine.scheduler_stats().prefix_hit_tokens
            began = time.perf_counter()
            stream = await engine.start(request)
            first: float | None = None
            text = ""
            prompt_tokens = 0
            async for delta in stream:
                if first is None:
                    first = time.perf_counter() - began
                    prompt_tokens = delta.prompt_tokens or 0
                text += delta.text
            hits = engine.scheduler_stats().prefix_hit_tokens - hits_before
            rows.append((first or 0.0, prompt_tokens, hits, text))
            messages.append({"role": "assistant", "content": text})
    finally:
        await engine.aclose()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="smollm2")
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--system-words", type=non_negative_int, default=150)
    parser.add_argument("--tokens", type=positive_int, default=16)
    args = parser.parse_args()
    lab = load_lab_engine(args.engine, time.perf_counter)
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words)).capitalize() + "."
    runs: dict[bool, list[list[tuple[float, int, int, str]]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)  # alternate who goes first
        for caching in order:
            runs[caching].append(
                asyncio.run(conversation(lab, caching, system, args.turns, args.tokens))
            )
    print(
        f"{lab.name}: {args.turns} turns, a {args.system_words}-word system prompt, "
        f"{args.tokens} greedy tokens a turn, {args.rounds} rounds (medians)"
    )
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off':>10} {'TTFT on':>10} {'on/off':>7}")
    for turn in range(args.turns):
        off = statistics.median(run[turn][0] for run in runs[False])
        on = statistics.median(run[turn][0] for run in runs[True])
        prompt = runs[True][0][turn][1]
        cached = runs[True][0][turn][2]
        print(
            f"{turn + 1:>4} {prompt:>7} {cached:>7} {off * 1000:>8.0f} ms {on * 1000:>7.0f} ms "
            f"{on / off:>7.2f}"
        )
    same = all(
        [row[3] for row in a] == [row[3] for row in b]
        for a, b in zip(runs[False], runs[True], strict=True)
    )
    print(f"the same replies with and without: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    tool_main(main)
