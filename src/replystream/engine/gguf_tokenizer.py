"""A GGUF's byte-level BPE as a Hugging Face ``tokenizers`` tokenizer.

This file decides how ``tokenizer.ggml.*`` becomes a tokenizer that splits text as the model's
authors did: the vocabulary and merges go into a ``tokenizers`` BPE model, and the
pre-tokenizer is chosen by ``tokenizer.ggml.pre``, the name llama.cpp gives each known
pre-tokenizer (``smollm``: every digit on its own, then GPT-2's split; ``llama-bpe``: LLaMA 3's
split, and a word the vocabulary holds whole is one token, before any merge). Control tokens
(type 3) are matched whole in the text and decode to nothing; user-defined ones (type 4) are
matched whole and decode to their text. A pre-tokenizer this file does not know is refused
rather than guessed, since a wrong split gives the model token sequences it never saw. It must
not know about models or serving.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from replystream.engine.gguf_file import Vocabulary
from replystream.engine.tokenizer import ByteTokenizer

CONTROL, USER_DEFINED = 3, 4

# LLaMA 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM's own tokenizer.json: digits one by one, then GPT-2's byte-level split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _llama3() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _smollm,
    "llama-bpe": _llama3,
    "llama3": _llama3,
    "llama-v3": _llama3,
}


def build_tokenizer(vocabulary: Vocabulary) -> ByteTokenizer:
    """The GGUF's tokenizer.

    Raises:
        ValueError: not a byte-level BPE, a pre-tokenizer this file does not know, or merges
            of tokens the vocabulary lacks.
    """
    v = vocabulary
    if v.model != "gpt2":
        raise ValueError(f"tokenizer {v.model!r}: this engine reads byte-level BPE ('gpt2')")
    make_pre = PRE_TOKENIZERS.get(v.pre)
    if make_pre is None:
        raise ValueError(f"pre-tokenizer {v.pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")
    vocab = {token: index for index, token in enumerate(v.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in v.merges]
    for number, pair in enumerate(merges):
        # A merge joins two tokens into a third, all three in the vocabulary (as ``tokenizers``
        # requires, with a message that names neither the file nor the merge's number).
        if len(pair) != 2 or any(t not in vocab for t in (*pair, "".join(pair))):
            raise ValueError(
                f"merge {number} ({v.merges[number]!r}) joins tokens the vocabulary lacks"
            )
    try:
        bpe = models.BPE(
            vocab,
            merges,  # type: ignore[arg-type]
            fuse_unk=False,
            # LLaMA 3 takes a pre-tokenized word its vocabulary holds as one token, before any
            # merge (its tokenizer.json's ``ignore_merges``; llama.cpp's for these names too).
            ignore_merges=make_pre is _llama3,
        )
    except Exception as exc:  # ``tokenizers`` raises a bare Exception for a vocabulary it refuses
        raise ValueError(f"the vocabulary and merges make no tokenizer ({exc})") from None
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    types = v.token_types if v.token_types.size else np.ones(len(v.tokens), np.int32)
    control = np.flatnonzero(types == CONTROL).tolist()
    tokenizer.add_special_tokens(
        [AddedToken(v.tokens[i], normalized=False, special=True) for i in control]
    )
    tokenizer.add_tokens(
        [
            AddedToken(v.tokens[i], normalized=False, special=False)
            for i in np.flatnonzero(types == USER_DEFINED).tolist()
        ]
    )
    return ByteTokenizer.from_pieces(tokenizer, v.tokens, hidden=control)
