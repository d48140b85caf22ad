"""Sampling: stable probabilities, greedy, top-k, top-p, seeds; stop sequences."""

from __future__ import annotations

import numpy as np
import pytest

from replystream.engine.base import RequestRejected, SamplingParams
from replystream.engine.sampling import (
    StopMatcher,
    check_sampling,
    ends_held,
    filtered_probabilities,
    probabilities,
    sample_token,
    token_logprob,
    without_ends,
)


def test_probabilities_survive_huge_logits() -> None:
    p = probabilities(np.array([1000.0, 999.0, -1000.0], np.float32))
    assert np.all(np.isfinite(p))
    assert p.sum() == pytest.approx(1.0)
    assert p[0] / p[1] == pytest.approx(np.e, rel=1e-6)


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 5e-324])
def test_a_temperature_too_small_to_divide_by_is_greedy_not_nan(temperature: float) -> None:
    # Any logit over such a temperature overflows: the best stays 0, the rest go to -inf.
    p = probabilities(np.array([0.5, 3.0, 3.0, -2.0], np.float32), temperature)
    assert np.all(np.isfinite(p))
    assert p.tolist() == [0.0, 0.5, 0.5, 0.0]  # the tied best share it
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=temperature)
    logits = np.array([0.1, 3.0, 2.9], np.float32)
    assert {sample_token(logits, params, rng) for _ in range(20)} == {1}


def test_temperature_zero_is_greedy() -> None:
    logits = np.array([0.1, 3.0, 2.9], np.float32)
    rng = np.random.default_rng(0)
    picks = {sample_token(logits, SamplingParams(temperature=0), rng) for _ in range(20)}
    assert picks == {1}


def test_top_k_keeps_only_the_k_best() -> None:
    logits = np.array([1.0, 4.0, 3.0, 2.0], np.float32)
    p = filtered_probabilities(logits, SamplingParams(top_k=2))
    assert set(np.flatnonzero(p)) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    p = filtered_probabilities(logits, SamplingParams(top_p=0.8))
    assert set(np.flatnonzero(p)) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    p = filtered_probabilities(logits, SamplingParams(top_p=0.81))
    assert set(np.flatnonzero(p)) == {0, 1, 2}
    assert p.sum() == pytest.approx(1.0)
    p = filtered_probabilities(logits, SamplingParams(top_p=0.0))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # the likeliest alone: greedy


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_likeliest() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    p = filtered_probabilities(logits, SamplingParams(min_p=0.25))
    assert set(np.flatnonzero(p)) == {0, 1, 2}  # 0.15 >= 0.25 * 0.5; 0.05 is not
    np.testing.assert_allclose(p[:3], np.array([0.5, 0.3, 0.15]) / 0.95, rtol=1e-6)
    p = filtered_probabilities(logits, SamplingParams(min_p=1.0))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]  # only the likeliest reaches its own share
    # After the temperature: at 2 the distribution flattens, and more tokens pass.
    hot = filtered_probabilities(logits, SamplingParams(min_p=0.25, temperature=2.0))
    assert set(np.flatnonzero(hot)) == {0, 1, 2, 3}
    # Before top-p, which then reads the renormalised distribution.
    both = filtered_probabilities(logits, SamplingParams(min_p=0.25, top_p=0.8))
    assert set(np.flatnonzero(both)) == {0, 1}


def test_same_seed_same_draws() -> None:
    logits = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    params = SamplingParams(temperature=1.0)

    def draws(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [sample_token(logits, params, rng) for _ in range(30)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)


def test_draws_follow_the_distribution() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1], np.float32))
    rng = np.random.default_rng(3)
    counts = np.bincount(
        [sample_token(logits, SamplingParams(), rng) for _ in range(4000)], minlength=3
    )
    np.testing.assert_allclose(counts / 4000, [0.7, 0.2, 0.1], atol=0.03)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.5), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=-0.1), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=float("nan")), "min_p"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(stop=("a", "b", "c", "d", "e")), "stop"),
    ],
)
def test_bad_sampling_values_are_rejected_by_name(params: SamplingParams, field: str) -> None:
    with pytest.raises(RequestRejected) as caught:
        check_sampling(params)
    assert caught.value.param == field


def test_a_stop_sequence_split_across_pieces_ends_the_text_where_it_completes() -> None:
    # The engine only learns when to stop; the reply pipeline withholds and cuts the string.
    m = StopMatcher(("\n\nThe",))
    shown = [m.feed(p) for p in ["and so", " it was.\n", "\nTh", "e end", "more"]]
    assert shown == ["and so", " it was.\n", "\nTh", "e", ""]
    assert m.stopped


def test_text_that_only_looks_like_a_stop_passes_through_at_once() -> None:
    m = StopMatcher(("END",))
    assert [m.feed(p) for p in ["the EN", "tire", " E"]] == ["the EN", "tire", " E"]
    assert m.flush() == "" and not m.stopped
    assert StopMatcher(()).feed("END") == "END"


def test_token_logprob_is_the_log_softmax_of_the_raw_logits_with_the_likeliest_first() -> None:
    logits = np.array([2.0, 0.5, 3.0, -1.0], dtype=np.float32)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    made = token_logprob(logits, 1, 2, lambda i: f"t{i}".encode())
    assert made.token == "t1" and made.bytes == b"t1"
    assert made.logprob == pytest.approx(expected[1])  # not the tempered or narrowed one
    assert [t.token for t in made.top] == ["t2", "t0"]
    assert [t.logprob for t in made.top] == pytest.approx([expected[2], expected[0]])
    # Tokens that hold part of a character (the likeliest, 2, after a space).
    partial = token_logprob(logits, 3, 1, lambda i: b" \xf0" if i == 2 else b"\xe2\x82")
    assert (partial.token, partial.bytes) == ("\\xe2\\x82", b"\xe2\x82")  # as OpenAI names it
    assert [(t.token, t.bytes) for t in partial.top] == [(" \\xf0", b" \xf0")]


class _TopDraw:
    """A generator whose every uniform draw is the largest float below 1."""

    def random(self) -> float:
        return 1.0 - 2.0**-53


def test_a_draw_at_the_top_of_the_range_never_picks_a_token_top_k_cut() -> None:
    """``cumsum(p)`` can end a few ulps below ``p.sum()`` (they add in different orders); a
    draw scaled by the sum then fell past the cumsum's end onto the vocabulary's last token,
    whose probability top-k had made 0."""
    logits = np.random.default_rng(0).normal(size=4096).astype(np.float32) * 3
    params = SamplingParams(temperature=1.0, top_k=50)
    p = filtered_probabilities(logits, params)
    assert np.cumsum(p)[-1] < p.sum()  # the case: this vector's two sums differ
    token = sample_token(logits, params, _TopDraw())  # type: ignore[arg-type]
    assert p[token] > 0
    assert token == int(np.flatnonzero(p)[-1])  # the top of the range: the last kept token


def test_the_end_tokens_are_held_back_until_min_tokens_or_throughout_with_ignore_eos() -> None:
    assert ends_held(SamplingParams(min_tokens=3), 2)
    assert not ends_held(SamplingParams(min_tokens=3), 3)
    assert ends_held(SamplingParams(ignore_eos=True), 500)
    assert not ends_held(SamplingParams(), 0)
    logits = np.array([5.0, 1.0, 0.5, 0.2], np.float32)
    banned = without_ends(logits, {0, 9})  # an id past the vocabulary is no token of it
    assert banned[0] == -np.inf and banned[1:].tolist() == logits[1:].tolist()
    assert logits[0] == 5.0  # a copy
    rng = np.random.default_rng(0)
    assert sample_token(banned, SamplingParams(temperature=0), rng) == 1
    assert 0 not in {sample_token(banned, SamplingParams(), rng) for _ in range(200)}
