"""What stop strings, log probabilities and several choices cost per token in the pipeline.

Each setting pushes the same reply (word tokens) through the reply pipeline in the OpenAI chat
dialect and encodes every chunk, as a producer does; the figure is microseconds per token,
the median of several rounds, next to the plain reply measured in the same run (the ratio is
what to read: the machine's noise is shared). Pure CPU, no sockets.

Run: python benchmarks/pipeline_options.py [--tokens 2000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from replystream.delivery.choices import ChoicesPipeline
from replystream.delivery.openai_formats import OpenAIStreamFormat
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta, TokenLogprob, TopLogprob

WORDS = "the quick brown fox jumps over the lazy dog and keeps running ".split()


def plain(
    tokens: int, *, stops: tuple[str, ...] = (), logprobs: bool = False
) -> Callable[[], None]:
    deltas = [
        Delta(
            WORDS[i % len(WORDS)] + " ",
            1,
            0.0,
            logprobs=(TokenLogprob("w", -0.5, b"w", (TopLogprob("w", -0.5, b"w"),)),)
            if logprobs
            else None,
        )
        for i in range(tokens)
    ]

    def run() -> None:
        pipeline = ReplyPipeline(
            OpenAIStreamFormat("chat", "m", 0), DeliveryPolicy(), stops=stops, logprobs=logprobs
        )
        pipeline.start("r")
        for delta in deltas:
            pipeline.push(delta, 0.0)
        pipeline.finish()

    return run


def choices(tokens: int, n: int) -> Callable[[], None]:
    deltas = [Delta(WORDS[i % len(WORDS)] + " ", 1, 0.0, choice=i % n) for i in range(tokens)]

    def run() -> None:
        formats = [OpenAIStreamFormat("chat", "m", 0, False, i, one_of_many=True) for i in range(n)]
        pipeline = ChoicesPipeline(formats, formats[0].reply_end, DeliveryPolicy())
        pipeline.start("r")
        for delta in deltas:
            pipeline.push(delta, 0.0)
        pipeline.finish()

    return run


def per_token_us(run: Callable[[], None], tokens: int) -> float:
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    settings = {
        "plain": plain(args.tokens),
        "stop strings (2, never met)": plain(args.tokens, stops=("\n\nUser:", "###")),
        "logprobs (top 1)": plain(args.tokens, logprobs=True),
        "n = 3 (per token, all choices)": choices(args.tokens, 3),
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):  # interleaved, so every setting sees the same noise
        for name, run in settings.items():
            times[name].append(per_token_us(run, args.tokens))
    base = statistics.median(times["plain"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:32s} {median:7.2f} us/token  x{median / base:.2f}")


if __name__ == "__main__":
    main()
