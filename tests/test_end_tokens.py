"""The set of end-of-generation ids: the ones a model's files declare and the known end
tokens found in its vocabulary by their spelling (as llama.cpp builds ``special_eog_ids``)."""

from __future__ import annotations

from replystream.engine.end_tokens import END_OF_GENERATION_TEXTS, end_of_generation_ids


def test_declared_ids_and_known_end_spellings_in_the_vocabulary_end_a_generation() -> None:
    vocabulary = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hello": 3}
    assert end_of_generation_ids([2], vocabulary) == {0, 2}
    assert end_of_generation_ids([None, 3], vocabulary) == {0, 2, 3}  # a declared id counts
    llama3 = {"<|begin_of_text|>": 10, "<|end_of_text|>": 11, "<|eom_id|>": 12, "<|eot_id|>": 13}
    assert end_of_generation_ids([11], llama3) == {11, 12, 13}
    assert end_of_generation_ids([], {"<end_of_turn>": 7, "<start_of_turn>": 6}) == {7}
    assert end_of_generation_ids([None], {"plain": 0}) == frozenset()


def test_start_and_other_control_spellings_are_not_end_tokens() -> None:
    for text in ("<|im_start|>", "<|begin_of_text|>", "<s>", "<start_of_turn>", "<|user|>"):
        assert text not in END_OF_GENERATION_TEXTS
