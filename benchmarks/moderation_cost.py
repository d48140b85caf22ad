"""What hold-back moderation costs per token: banned phrases and the secret patterns checked
over a reply's held text as each token comes, for replies in English (ASCII alone), French
(accented letters) and Japanese.

Each reply is 2,000 tokens of about four characters, pushed through ``HoldBack`` with a
window of 8 tokens, ten banned phrases (none of which the text holds, so every token is
checked to the end) and ``--block-secrets``' patterns; the figure is the median over the
rounds of the CPU time per token. Run it against two trees to compare them:

    PYTHONPATH=/path/to/tree/src python benchmarks/moderation_cost.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from replystream.delivery.moderation import BannedPhrases, HoldBack, secret_check

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
TOKENS = 2000


def tokens_of(text: str) -> list[str]:
    """``TOKENS`` pieces of about four characters, cycling through ``text``."""
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    return [pieces[n % len(pieces)] for n in range(TOKENS)]


def cost_per_token_us(tokens: list[str]) -> float:
    holdback = HoldBack(8, [BannedPhrases(PHRASES), secret_check()])
    began = time.process_time()
    for token in tokens:
        holdback.push(token, 1)
    holdback.finish()
    assert holdback.violation is None
    return (time.process_time() - began) / len(tokens) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("argument --rounds: want a whole number >= 1")
    print(f"hold-back moderation, window 8, {len(PHRASES)} phrases and the secret patterns")
    print(f"{'reply':<20} {'µs per token (median of ' + str(args.rounds) + ')':>28}")
    for label, text in TEXTS.items():
        tokens = tokens_of(text)
        cost_per_token_us(tokens)  # warm: the first reply's characters' forms are found
        rounds = [cost_per_token_us(tokens) for _ in range(args.rounds)]
        print(f"{label:<20} {statistics.median(rounds):>28.1f}")


if __name__ == "__main__":
    main()
