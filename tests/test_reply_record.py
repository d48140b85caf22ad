"""A reply's record, as the metrics read it: time per output token and time between tokens
are one choice's, however many choices a reply has (their tokens are made side by side)."""

from __future__ import annotations

import pytest

from replystream.server.metrics import KeyedHistogram, ReplyRecord

STEP_S = 0.03  # each choice makes a token every 30 ms


def record_of(choices: int, tokens: int) -> tuple[ReplyRecord, KeyedHistogram]:
    """A reply of ``choices`` choices, each making ``tokens`` tokens ``STEP_S`` apart, their
    deltas interleaved as a batch makes them (choice 0, 1, ... at each step)."""
    gaps = KeyedHistogram("gaps", "test", "endpoint", (0.001, 0.01, 0.1, 1.0))
    record = ReplyRecord("/v1/chat/completions", True, arrived_at=0.0, gaps=gaps)
    for step in range(tokens):
        for choice in reversed(range(choices)):  # a later choice first: no order is assumed
            record.on_delta(1.0 + step * STEP_S + choice * 0.001, 1, choice)
    return record, gaps


@pytest.mark.parametrize("choices", [1, 4])
def test_time_per_output_token_and_the_gaps_are_one_choices(choices: int):
    record, gaps = record_of(choices, tokens=10)
    assert record.tokens == 10 * choices and record.choices == choices
    assert record.first_token_at == 1.0  # the earliest, whichever choice made it
    tpot = record.time_per_output_token
    assert tpot is not None and tpot == pytest.approx(STEP_S, rel=0.15)
    observed = gaps.counts["/v1/chat/completions"]
    assert sum(observed) == 9 * choices  # each choice's 9 gaps, none between two choices
    assert gaps.sums["/v1/chat/completions"] == pytest.approx(9 * choices * STEP_S)


def test_a_reply_of_one_token_per_choice_has_no_time_per_output_token():
    record, _ = record_of(3, tokens=1)
    assert record.time_per_output_token is None
