"""What stop strings, log probabilities and several choices cost per token in the pipeline.

Each setting pushes the same reply (word tokens) through the reply pipeline in the OpenAI chat
dialect (or the Responses one, where named) and encodes every chunk, as a producer does; the
figure is microseconds per token, the median of several rounds, next to the plain reply
measured in the same run (the ratio is what to read: the machine's noise is shared), and the
time of the reply's last step alone (its last events, made in one turn of the loop: where a
Responses reply repeats every log probability). Pure CPU, no sockets.

Run: python benchmarks/pipeline_options.py [--tokens 2000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from replystream.cli_values import positive_int
from replystream.delivery.choices import ChoicesPipeline
from replystream.delivery.openai_formats import OpenAIStreamFormat
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.responses_format import ResponsesStreamFormat
from replystream.delivery.responses_objects import ResponseSettings
from replystream.engine.base import Delta, TokenLogprob, TopLogprob
from tool_main import tool_main

WORDS = "the quick brown fox jumps over the lazy dog and keeps running ".split()


Run = Callable[[], float]  # a reply pushed through; the seconds its last step took


def _logprob(word: str, top: int) -> TokenLogprob:
    alternatives = tuple(TopLogprob(f"{word}{i}", -0.5 - i, word.encode()) for i in range(top))
    return TokenLogprob(word, -0.5, word.encode(), alternatives)


def plain(
    tokens: int,
    *,
    stops: tuple[str, ...] = (),
    top: int | None = None,
    responses: bool = False,
) -> Run:
    """A reply of word tokens (``top``: with log probabilities, that many alternatives)."""
    words = [WORDS[i % len(WORDS)] + " " for i in range(tokens)]
    deltas = [
        Delta(word, 1, 0.0, logprobs=None if top is None else (_logprob(word, top),))
        for word in words
    ]

    def run() -> float:
        fmt = (
            ResponsesStreamFormat(ResponseSettings("m", 0))
            if responses
            else OpenAIStreamFormat("chat", "m", 0)
        )
        pipeline = ReplyPipeline(fmt, DeliveryPolicy(), stops=stops, logprobs=top is not None)
        pipeline.start("r")
        for delta in deltas:
            pipeline.push(delta, 0.0)
        last = time.perf_counter()
        pipeline.finish()
        return time.perf_counter() - last

    return run


def choices(tokens: int, n: int) -> Run:
    deltas = [Delta(WORDS[i % len(WORDS)] + " ", 1, 0.0, choice=i % n) for i in range(tokens)]

    def run() -> float:
        formats = [OpenAIStreamFormat("chat", "m", 0, False, i, one_of_many=True) for i in range(n)]
        pipeline = ChoicesPipeline(formats, formats[0].reply_end, DeliveryPolicy())
        pipeline.start("r")
        for delta in deltas:
            pipeline.push(delta, 0.0)
        last = time.perf_counter()
        pipeline.finish()
        return time.perf_counter() - last

    return run


def timed(run: Run, tokens: int) -> tuple[float, float]:
    """Microseconds per token in all, and milliseconds of the last step."""
    started = time.perf_counter()
    last = run()
    return (time.perf_counter() - started) / tokens * 1e6, last * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=2000)
    parser.add_argument("--rounds", type=positive_int, default=15)
    args = parser.parse_args()
    settings = {
        "plain": plain(args.tokens),
        "stop strings (2, never met)": plain(args.tokens, stops=("\n\nUser:", "###")),
        "logprobs (top 1)": plain(args.tokens, top=1),
        "logprobs (top 20)": plain(args.tokens, top=20),
        "n = 3 (per token, all choices)": choices(args.tokens, 3),
        "Responses": plain(args.tokens, responses=True),
        "Responses, logprobs (top 20)": plain(args.tokens, top=20, responses=True),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for _ in range(args.rounds):  # interleaved, so every setting sees the same noise
        for name, run in settings.items():
            times[name].append(timed(run, args.tokens))
    base = statistics.median(per_token for per_token, _ in times["plain"])
    for name, values in times.items():
        median = statistics.median(per_token for per_token, _ in values)
        last = statistics.median(last for _, last in values)
        print(f"{name:32s} {median:7.2f} us/token  x{median / base:.2f}  last step {last:7.2f} ms")


if __name__ == "__main__":
    tool_main(main)
