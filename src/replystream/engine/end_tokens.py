"""Which token ids end a generation: the ids a model's files declare, and known end tokens.

This file decides, for every model the built-in engines load (a GGUF, a Hugging Face folder),
the set of end-of-generation ids: a sampled token in it ends the reply with
``finish_reason="stop"`` and is never shown. A model's files often declare fewer than the model
uses: SmolLM2's GGUF names only ``<|im_end|>`` as its EOS, yet the model was also trained to end
a document with ``<|endoftext|>``; a Llama 3 file names ``<|end_of_text|>`` while its chat turns
end with ``<|eot_id|>``. A reply that ran on past such a token would make text the model never
meant to write. So, as llama.cpp does (``llama-vocab.cpp``, where it builds ``special_eog_ids``):
1. every id the files declare ends a generation (GGUF's ``eos``, ``eot`` and ``eom`` token
   ids; a Hugging Face ``generation_config``'s ``eos_token_id``, one id or a list);
2. so does every token whose text is one of ``END_OF_GENERATION_TEXTS``, found in the
   vocabulary by its spelling, whatever the files declare.
The set is the same for one model whichever engine loads it. It must not know about files,
tokenizers' algorithms or serving: it takes ids and a vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# The spellings llama.cpp treats as end of generation wherever they are in a vocabulary.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",  # GPT-2's end of text; SmolLM, Qwen, Phi
        "<|im_end|>",  # ChatML's end of turn
        "<|end_of_text|>",  # Llama 3's end of text
        "<|eot_id|>",  # Llama 3's end of turn
        "<|eom_id|>",  # Llama 3.1's end of a message that waits for a tool's answer
        "<|end|>",  # Phi-3's end of turn
        "<end_of_turn>",  # Gemma's end of turn
        "<end_of_utterance>",  # SmolDocling's
        "<EOT>",  # CodeLlama's end of infilling
        "_<EOT>",
        "<|return|>",  # gpt-oss's end of a final answer
        "<|call|>",  # gpt-oss's end of a tool call
    }
)


def end_of_generation_ids(
    declared: Iterable[int | None], vocabulary: Mapping[str, int]
) -> frozenset[int]:
    """The ids that end a generation: ``declared`` (``None`` ignored) and the ids of the
    known end spellings ``vocabulary`` (spelling -> id) holds."""
    ids = {int(i) for i in declared if i is not None}
    ids.update(vocabulary[text] for text in END_OF_GENERATION_TEXTS if text in vocabulary)
    return frozenset(ids)
