"""Stop strings across token boundaries, in the pure pipeline: random texts, tokenisations and
stop strings; the streamed text, the buffered text and the text cut before the first stop
string are the same, whatever the chunking, and no part of a stop string is ever shown."""

from __future__ import annotations

import itertools
import json
import time
from operator import not_

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.formats import NativeFormat
from replystream.delivery.moderation import BannedPhrases, HoldBack
from replystream.delivery.pipeline import ReplyPipeline
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.base import Delta
from replystream.engine.stops import StopScan
from replystream.server.buffered import WHOLE_REPLY

# A small alphabet, so stop strings and their prefixes turn up often in random text.
ALPHABET = "ab \n\u00e9"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4)


def cut_before_first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The oracle, written independently of the code: read the text one character at a time;
    the first position where some stop string has just ended ends the reply, before that
    string (the longest, if several end there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def could_begin_a_stop(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` are a proper prefix of some stop string."""
    return max(
        (n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
        default=0,
    )


@st.composite
def tokenised(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """A random text split at random places into tokens (some empty), and stop strings."""
    text = draw(texts)
    stops = draw(stop_lists)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2)))
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)], stops


def stream(
    tokens: list[str], stops: list[str], policy: DeliveryPolicy
) -> tuple[str, list[dict[str, object]], ReplyPipeline]:
    """Run tokens through a reply pipeline in the native dialect; the text its events carry,
    every event's data, and the pipeline."""
    pipeline = ReplyPipeline(NativeFormat(), policy, stops=tuple(stops), prompt_estimate=3)
    entries = pipeline.start("r1")
    for index, token in enumerate(tokens):
        entries += pipeline.push(Delta(token, 1), float(index))
        if pipeline.halted:
            break
    entries += pipeline.finish()
    data = [{"event": e.event, **json.loads(e.data)} for e in entries]
    text = "".join(str(d["text"]) for d in data if d["event"] == "token")
    return text, data, pipeline


def buffered(tokens: list[str], stops: list[str]) -> str:
    """What a whole (non-streamed) reply collects, as ``server.buffered`` does."""
    holdback = HoldBack(WHOLE_REPLY, [], stops)
    parts = []
    for token in tokens:
        parts.append(holdback.push(token, 1)[0])
        if holdback.ended:
            break
    parts.append(holdback.finish()[0])
    return "".join(parts)


@settings(max_examples=400, deadline=None)
@given(
    tokenised(),
    st.integers(0, 3),
    st.integers(1, 3),
)
def test_streamed_equals_buffered_equals_text_cut_before_the_first_stop(
    case: tuple[list[str], list[str]], window: int, batch: int
) -> None:
    tokens, stops = case
    expected, stop = cut_before_first_stop("".join(tokens), stops)
    policy = DeliveryPolicy(holdback_tokens=window, batch_tokens=batch)
    streamed, data, pipeline = stream(tokens, stops, policy)
    assert streamed == buffered(tokens, stops) == expected
    done = data[-1]
    assert done["event"] == "done"
    assert done.get("stop_sequence") == stop
    if stop is not None:
        assert done["finish_reason"] == "stop"
    # Usage counts the tokens made up to the one that completed the stop string, no more.
    made = "".join(tokens)
    used = next(d for d in data if d["event"] == "usage")["completion_tokens"]
    if stop is None:
        assert used == len(tokens)
    else:
        cut_at = len(expected) + len(stop)
        assert sum(len(t) for t in tokens[: int(str(used)) - 1]) < cut_at
        assert sum(len(t) for t in tokens[: int(str(used))]) >= cut_at
        assert made.startswith(expected + stop)
    assert pipeline.halted == (stop is not None)


@settings(max_examples=400, deadline=None)
@given(tokenised())
def test_unbatched_text_is_withheld_only_while_it_could_begin_a_stop(
    case: tuple[list[str], list[str]],
) -> None:
    """After every token, exactly the text so far minus the shortest tail that could still
    begin a stop string has been sent: nothing of a stop string leaves, nothing else waits."""
    tokens, stops = case
    pipeline = ReplyPipeline(NativeFormat(), DeliveryPolicy(), stops=tuple(stops))
    sent = ""
    so_far = ""
    for token in tokens:
        so_far += token
        for entry in pipeline.push(Delta(token, 1), 0.0):
            sent += json.loads(entry.data)["text"]
        cut, stop = cut_before_first_stop(so_far, stops)
        if stop is not None:
            assert sent == cut and pipeline.halted
            return
        assert sent == so_far[: len(so_far) - could_begin_a_stop(so_far, stops)]


@settings(max_examples=200, deadline=None)
@given(tokenised(), st.integers(0, 3))
def test_token_counts_of_the_events_add_up_and_never_exceed_what_was_made(
    case: tuple[list[str], list[str]], window: int
) -> None:
    tokens, stops = case
    _, data, pipeline = stream(tokens, stops, DeliveryPolicy(holdback_tokens=window))
    shown = sum(int(str(d["tokens"])) for d in data if d["event"] == "token")
    assert shown <= pipeline.tokens
    if not pipeline.halted:
        # Text-less tokens go with the next text; those at the end (an end token) may have
        # none (held text released at the end takes them).
        trailing = len(tokens) - len(list(itertools.dropwhile(not_, reversed(tokens))))
        assert pipeline.tokens - trailing <= shown and pipeline.tokens == len(tokens)


def test_a_stop_string_split_over_three_tokens_is_never_shown_in_part():
    pipeline = ReplyPipeline(NativeFormat(), DeliveryPolicy(), stops=("\n\nThe",))
    shown = []
    for token in ["and so", " it was.\n", "\nTh", "e end", " more"]:
        shown.append(
            "".join(json.loads(e.data).get("text", "") for e in pipeline.push(Delta(token), 0))
        )
        if pipeline.halted:
            break
    assert shown == ["and so", " it was.", "", ""]  # "e end" completes it; " more" never read
    assert pipeline.stop_sequence == "\n\nThe" and pipeline.finish_reason == "stop"


def test_held_text_that_turns_out_not_to_be_a_stop_is_released_with_the_next_token():
    pipeline = ReplyPipeline(NativeFormat(), DeliveryPolicy(), stops=("END",))
    texts = [
        [json.loads(e.data)["text"] for e in pipeline.push(Delta(token), 0)]
        for token in ["the EN", "tire", " E"]
    ]
    assert texts == [["the "], ["ENtire"], [" "]]
    finish = [(e.event, json.loads(e.data)) for e in pipeline.finish()]
    assert finish[0] == ("token", {"text": "E", "tokens": 0})
    assert finish[-1] == ("done", {"finish_reason": "stop"})


def test_the_first_stop_to_complete_wins_even_if_another_started_earlier():
    # "b" completes at the second character; "abc" would only at the third.
    pipeline = ReplyPipeline(NativeFormat(), DeliveryPolicy(), stops=("abc", "b"))
    for token in ["a", "bc"]:
        pipeline.push(Delta(token), 0)
    assert pipeline.stop_sequence == "b"
    assert buffered(["abc"], ["abc", "b"]) == "a"


def test_a_check_and_a_stop_together_the_earlier_one_decides():
    checks = [BannedPhrases(["bad"])]
    # The stop comes first: the banned phrase after it is never shown, so nothing is moderated.
    policy = DeliveryPolicy(holdback_tokens=1, checks=checks)
    pipeline = ReplyPipeline(NativeFormat(), policy, stops=("STOP",))
    for token in ["fine ", "STOP ", "bad"]:
        pipeline.push(Delta(token), 0)
        if pipeline.halted:
            break
    assert pipeline.violation is None and pipeline.stop_sequence == "STOP"
    # The phrase comes first: the reply is moderated.
    pipeline = ReplyPipeline(NativeFormat(), policy, stops=("STOP",))
    for token in ["fine ", "bad ", "STOP"]:
        pipeline.push(Delta(token), 0)
        if pipeline.halted:
            break
    assert pipeline.violation is not None and pipeline.stop_sequence is None


def test_no_stop_strings_and_no_policy_keeps_the_direct_path():
    pipeline = ReplyPipeline(NativeFormat(), DeliveryPolicy())
    assert pipeline.holdback is None and pipeline.batcher is None
    assert ReplyPipeline(NativeFormat(), DeliveryPolicy(), stops=("x",)).holdback is not None


@pytest.mark.parametrize("stops", [[], ["never"]])  # the direct path, and the staged one
def test_a_token_with_no_text_of_its_own_is_counted_with_the_next_text(stops: list[str]) -> None:
    """The first bytes of a character (its token has no text yet) and an end token: no
    text-less event; the first is counted in the event of the text that completes it."""
    _, data, pipeline = stream(["caf", "", "\u00e9 au", " lait", ""], stops, DeliveryPolicy())
    tokens = [(d["text"], d["tokens"]) for d in data if d["event"] == "token"]
    assert tokens == [("caf", 1), ("\u00e9 au", 2), (" lait", 1)]
    assert pipeline.tokens == 5


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(alphabet="ab", max_size=6), max_size=12),
    st.lists(st.text(alphabet="ab", min_size=1, max_size=12), min_size=1, max_size=4),
)
def test_a_scan_finds_the_first_stop_and_withholds_the_shortest_tail(
    pieces: list[str], stops: list[str]
) -> None:
    # Two letters and stop strings longer than the pieces: partial matches that break off
    # and fall back to a shorter start of the string, across piece edges, all the time.
    scan = StopScan(stops)
    so_far = ""
    for piece in pieces:
        hit = scan.feed(piece)
        so_far += piece
        before, stop = cut_before_first_stop(so_far, stops)
        if stop is not None:
            assert hit == (len(before), stop)
            return
        assert hit is None and scan.keep == could_begin_a_stop(so_far, stops)


def scan_seconds(stops: list[str], pieces: list[str]) -> float:
    """CPU seconds a scan takes over ``pieces``, none of which completes a stop string."""
    scan = StopScan(stops)
    began = time.process_time()
    for piece in pieces:
        assert scan.feed(piece) is None
    return time.process_time() - began


def test_a_long_stop_string_costs_a_piece_what_a_short_one_does():
    # Found again in a window as long as itself, a stop string of 40,000 characters cost
    # each token 40,000 characters of search; text that kept matching its start, then
    # broke off, cost the square of that (each shorter start tried, each copied).
    words = ["word "] * 20_000
    assert scan_seconds(["zq" * 20_000], words) < 3 * scan_seconds(["zqzq"], words) + 0.05
    starts = (["ab"] * 20_000 + ["?"]) * 2
    long_start = scan_seconds(["ab" * 20_000 + "!"], starts)
    assert long_start < 3 * scan_seconds(["ab!"], starts) + 0.05
