"""Train the tiny engine's byte-level BPE tokenizer on the KJV corpus and save tokenizer.json.

Usage: python scripts/train_tokenizer.py [--vocab-size 4096] [--corpus build/kjv.txt]
Needs the ``tokenizers`` package and Debian's ``bible-kjv`` (installed when missing, as root).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kjv_corpus import write_corpus
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "src/replystream/engine/tiny_assets"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--corpus", type=Path, default=Path("build/kjv.txt"))
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer.json")
    args = parser.parse_args()

    corpus = write_corpus(args.corpus)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    ids = tokenizer.encode(corpus.read_text(encoding="utf-8")).ids
    print(f"vocab {tokenizer.get_vocab_size()}, corpus {len(ids):,} tokens, saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
