"""Our SmolLM2 against an independent implementation: ``transformers`` on the same GGUF file.

``transformers`` dequantises the GGUF itself, undoes llama.cpp's Q/K permutation itself, builds
its own tokenizer from the file's vocabulary and renders the file's chat template with its own
Jinja environment; our engine shares none of that code. Loading it takes seconds even with
the file's parse shared (below), so one model is shared by the module.

Tolerance: next-token logits agree within 5e-4 (absolute, on logits of magnitude about 40;
float32 with different summation orders; measured about 1e-4).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
import pytest

from replystream.engine.gguf_engine import load_gguf_model, prompt_format
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk
from tests.services import require_smollm2

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf_py = pytest.importorskip("gguf")

LOGIT_ATOL = 5e-4
HARD_TEXTS = [
    "Hello world! 123456 and 3.14159, or 1,000,000.",
    "emoji 👋🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and 🤖",
    "中文字符测试，日本語のテキスト、한국어 텍스트",  # noqa: RUF001  (CJK punctuation is the point)
    "  many   spaces\n\n\n\ttabs \t \r\n trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x ** 2  # café naïve Ωmega",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? 🌱"},
    ],
]


@pytest.fixture(scope="module")
def both() -> tuple[Any, Any, Any]:
    path = require_smollm2()
    gguf, model, tokenizer = load_gguf_model(path)
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        # transformers parses the file three times (the config, the weights, the tokenizer)
        # and builds gguf's tensor-name table once per tensor: most of this fixture's 33 s in
        # the suite. Both are pure reads of the same file and tables, so one of each is
        # shared (14 s); what transformers computes from them is untouched.
        patch.setattr(gguf_py, "GGUFReader", functools.cache(gguf_py.GGUFReader))
        patch.setattr(gguf_py, "get_tensor_name_map", functools.cache(gguf_py.get_tensor_name_map))
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    return (gguf, model, tokenizer), hf_model, hf_tokenizer


def test_the_tokenizer_splits_hard_text_as_transformers_does(both):
    (_, _, tokenizer), _, hf_tokenizer = both
    for text in HARD_TEXTS:
        ours = tokenizer.encode(text)
        assert ours == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ours) == hf_tokenizer.decode(ours, skip_special_tokens=True)


def test_the_chat_template_renders_as_transformers_renders_it(both):
    (gguf, _, tokenizer), _, hf_tokenizer = both
    template = prompt_format(gguf, tokenizer)._template  # type: ignore[attr-defined]
    for messages in CONVERSATIONS:
        for generation in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
            assert template.render(messages, add_generation_prompt=generation) == expected


def test_next_token_logits_equal_transformers_over_several_prompts(both):
    (_, model, tokenizer), hf_model, hf_tokenizer = both
    prompts = [
        hf_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in CONVERSATIONS
    ]
    prompts += HARD_TEXTS[:3]
    c = model.config
    for number, text in enumerate(prompts):
        ids = tokenizer.encode(text)
        with torch.inference_mode():
            expected = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
        cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, 16, 16)
        cache.allocator.reserve(number, len(ids))
        ours = model.prefill(number, ids, cache)
        np.testing.assert_allclose(ours, expected, atol=LOGIT_ATOL, err_msg=text)
        assert int(np.argmax(ours)) == int(np.argmax(expected))


def hf_greedy(hf_model, ids: list[int], steps: int) -> list[int]:
    """Greedy tokens from ``transformers``' model with its own KV cache, one forward per token.

    Not ``generate()``: in transformers 5.24 on this GGUF, ``generate()``'s logits drift from
    the same model's own forward (0.3 at the 10th token of the story below, enough to flip a
    near tie), while the forward with its cache agrees with a full recompute to 1e-4.
    """
    # transformers 5 renamed ``past_key_values`` to ``cache`` (as engine/hf.py handles).
    forward = inspect.signature(hf_model.forward).parameters
    name = "cache" if "cache" in forward else "past_key_values"
    made: list[int] = []
    with torch.inference_mode():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        while True:
            made.append(int(out.logits[0, -1].argmax()))
            if len(made) == steps:
                return made
            past = {name: getattr(out, name)}
            out = hf_model(torch.tensor([[made[-1]]]), use_cache=True, **past)


def test_greedy_replies_are_token_for_token_those_of_transformers(both):
    (_, model, tokenizer), hf_model, hf_tokenizer = both
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text)
    steps = 64
    expected = hf_greedy(hf_model, ids, steps)
    c = model.config
    cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, 16, 16)
    cache.allocator.reserve(0, len(ids) + steps)
    made = [int(np.argmax(model.prefill(0, ids, cache)))]
    while len(made) < steps:
        logits = model.decode([Chunk(0, (made[-1],), len(ids) + len(made) - 1)], cache)[0]
        made.append(int(np.argmax(logits)))
    assert made == expected
    assert 2 not in made  # 64 tokens of story, no end of reply on the way
    assert len(tokenizer.decode(made).split()) > 20  # English words, not a loop of one token
