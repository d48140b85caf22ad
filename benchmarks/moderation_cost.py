"""What hold-back moderation costs per token: banned phrases and the secret patterns checked
over a reply's held text as each token comes, for replies in English (ASCII alone), French
(accented letters) and Japanese.

Each reply is 2,000 tokens (``--tokens``) of about four characters, pushed through
``HoldBack`` with a window of 8 tokens (``--window``; ``whole``: every token held, as a reply
not streamed is), ten banned phrases (``--phrases``: more, made-up words of 4 to 12 letters
added to them; none of which the text holds, so every token is checked to the end) and
``--block-secrets``' patterns; the figure is the median over the
rounds of the CPU time per token. Run it against two trees to compare them:

    PYTHONPATH=/path/to/tree/src python benchmarks/moderation_cost.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

from replystream.delivery.moderation import BannedPhrases, HoldBack, secret_check
from tool_main import tool_main

PHRASES = [
    "forbidden phrase",
    "another banned thing",
    "secret project name",
    "do not say this",
    "internal codename",
    "confidential figure",
    "private matter",
    "restricted words",
    "not for release",
    "hidden agenda",
]
TEXTS = {
    "English (ASCII)": "The quick brown fox jumps over the lazy dog and runs far away. ",
    "French (accents)": "Voilà une réponse détaillée, écrite en français très élégant. ",
    "Japanese": "これは日本語で書かれた長い返事です。モデルが一つずつ言葉を作ります。",
}
WHOLE_REPLY = 1 << 30  # as server/buffered.py holds a reply not streamed (not imported: server)


def tokens_of(text: str, count: int) -> list[str]:
    """``count`` pieces of about four characters, cycling through ``text``."""
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    return [pieces[n % len(pieces)] for n in range(count)]


def phrases(count: int) -> list[str]:
    """``PHRASES``, and made-up words (seeded) up to ``count`` phrases in all."""
    draw = random.Random(7)
    made = [
        "".join(draw.choices(string.ascii_lowercase, k=draw.randint(4, 12)))
        for _ in range(max(0, count - len(PHRASES)))
    ]
    return PHRASES[:count] + made


def cost_per_token_us(tokens: list[str], window: int, banned: list[str]) -> float:
    holdback = HoldBack(window, [BannedPhrases(banned), secret_check()])
    began = time.process_time()
    for token in tokens:
        holdback.push(token, 1)
    holdback.finish()
    assert holdback.violation is None
    return (time.process_time() - began) / len(tokens) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per reply")
    parser.add_argument("--phrases", type=int, default=len(PHRASES), help="banned phrases")
    parser.add_argument(
        "--window", default="8", help="tokens held: a number, or whole (a reply not streamed)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("argument --rounds: want a whole number >= 1")
    if args.tokens < 1:
        parser.error("argument --tokens: want a whole number >= 1")
    if args.phrases < 1:
        parser.error("argument --phrases: want a whole number >= 1")
    banned = phrases(args.phrases)
    if args.window != "whole" and not (args.window.isdigit() and args.window.isascii()):
        parser.error(f"argument --window: want a whole number or whole, got {args.window!r}")
    window = WHOLE_REPLY if args.window == "whole" else int(args.window)
    print(
        f"hold-back moderation, window {args.window}, {args.tokens} tokens, "
        f"{len(banned)} phrases and the secret patterns"
    )
    print(f"{'reply':<20} {'µs per token (median of ' + str(args.rounds) + ')':>28}")
    for label, text in TEXTS.items():
        tokens = tokens_of(text, args.tokens)
        cost_per_token_us(tokens, window, banned)  # warm: the characters' forms are found
        rounds = [cost_per_token_us(tokens, window, banned) for _ in range(args.rounds)]
        print(f"{label:<20} {statistics.median(rounds):>28.1f}")


if __name__ == "__main__":
    tool_main(main)
