"""Delivery's pure parts (hold-back moderation, batching, event bytes): no clock, no sockets."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replystream.delivery.batching import Batcher
from replystream.delivery.formats import NativeFormat, Usage
from replystream.delivery.moderation import (
    BannedPhrases,
    Check,
    HoldBack,
    RegexCheck,
    phrases_pattern,
    secret_check,
)
from replystream.engine.base import TokenLogprob, TopLogprob


def run_holdback(tokens: list[str], window: int, phrases: list[str]) -> tuple[str, HoldBack]:
    holdback = HoldBack(window, [BannedPhrases(phrases)])
    out = []
    for token in tokens:
        out.append(holdback.push(token, 1)[0])
        if holdback.violation:
            break
    else:
        out.append(holdback.finish()[0])
    return "".join(out), holdback


def test_clean_text_is_released_window_tokens_late_and_whole_at_the_end():
    holdback = HoldBack(2, [BannedPhrases(["nope"])])
    assert holdback.push("a ", 1) == ("", 0)
    assert holdback.push("b ", 1) == ("", 0)
    assert holdback.push("c ", 1) == ("a ", 1)
    assert holdback.finish() == ("b c ", 2)
    assert (holdback.released_chars, holdback.released_tokens) == (6, 3)


@pytest.mark.parametrize("window", [0, 1, 2, 5])
def test_phrase_split_across_tokens_is_never_released(window: int):
    tokens = ["we ", "launch ", "the ", "rock", "et now ", "please "]
    released, holdback = run_holdback(tokens, window, ["ROCKET NOW"])
    assert "rocket now" not in released.lower()
    assert holdback.violation is not None
    assert holdback.violation.released_chars == len(released)
    # With a window, nothing of the match goes out; with none, its start ("rock") already left
    # before the token that completes the phrase arrived, and that token never does.
    assert released == ("we launch the rock" if window == 0 else "we launch the ")


def test_a_match_inside_a_token_releases_up_to_the_match_only():
    released, holdback = run_holdback(["safe ", "xxBADyy ", "more "], 3, ["bad"])
    assert released == "safe xx"
    assert holdback.violation is not None
    assert (holdback.violation.released_chars, holdback.violation.released_tokens) == (7, 1)


def test_checks_see_released_text_as_context_across_the_window_edge():
    # With window 0, "rock" is already out when "et" arrives; the phrase is still caught and
    # the token that completes it is never sent.
    released, holdback = run_holdback(["rock", "et ", "ship "], 0, ["rocket"])
    assert released == "rock"
    assert holdback.violation is not None


def test_secret_patterns_and_named_regexes():
    key = "sk-" + "A1b2C3d4" * 4
    holdback = HoldBack(4, [secret_check()])
    out = "".join(holdback.push(t, 1)[0] for t in ["my ", "key ", "is ", key[:10], key[10:], " x"])
    assert holdback.violation is not None and holdback.violation.reason == "openai_key"
    assert key[:3] not in out
    check = RegexCheck({"card": r"\b\d{4}-\d{4}-\d{4}-\d{4}\b"})
    assert check.find("pay 1234-5678-9012-3456 now") is not None
    assert check.find("pay 1234-5678 now") is None


@pytest.mark.parametrize(
    ("secret", "shape"),
    [
        ("sk-proj-" + "A1b2C3d4" * 3, "openai_key"),
        ("AKIA" + "ABCDEFGH23456789", "aws_access_key_id"),
        ("ghp_" + "a1B2c3D4e5" * 4, "github_token"),
        ("xoxb-" + "1234567890-abcdef", "slack_token"),
        ("-----BEGIN RSA PRIVATE KEY-----", "private_key"),
    ],
)
def test_every_shape_of_secret_stops_the_reply_before_it(secret: str, shape: str):
    # Not only the first shape the check knows: each is looked for in every text.
    holdback = HoldBack(2, [secret_check()])
    out = pushed(holdback, ["Use ", "this: ", secret, "\n", "ok"]) + holdback.finish()[0]
    assert holdback.violation is not None and holdback.violation.reason == shape
    assert out == "Use this: "


class CountingCheck:
    """A check that finds nothing and counts the characters it was asked to read."""

    name = "counting"
    revision = 0

    def __init__(self, context_chars: int) -> None:
        self.context_chars = context_chars
        self.reads: list[int] = []

    def find(self, text: str, start: int = 0) -> None:
        self.reads.append(len(text) - start)


@pytest.mark.parametrize("window", [8, 1 << 30])
def test_each_push_reads_the_new_text_and_a_checks_context_not_all_it_holds(window: int):
    # A reply not streamed holds every token (window 1 << 30): read again whole at each
    # token, 8,000 tokens of text cost seconds of CPU. A check reads its context before the
    # new text, whatever is held; what lies further back it read when it came.
    check = CountingCheck(context_chars=16)
    holdback = HoldBack(window, [check])
    for _ in range(2000):
        holdback.push("abcd", 1)
    assert holdback.finish() == ("abcd" * min(window, 2000), min(window, 2000))
    assert max(check.reads) == 16 + 4


@pytest.mark.parametrize("window", [0, 2, 1 << 30])
def test_a_phrase_held_long_before_its_end_is_still_found_as_its_end_comes(window: int):
    tokens = ["x "] * 500 + ["the ", "rock", "et ", "now "] + ["y "] * 10
    released, holdback = run_holdback(tokens, window, ["rocket now"])
    assert holdback.violation is not None
    # With no window the phrase's start has left before its end comes; with one, it has not.
    assert released == "x " * 500 + ("the rocket " if window == 0 else "the ")


@pytest.mark.parametrize("window", [0, 3, 50])
def test_the_earliest_match_of_any_check_stops_the_text_whatever_the_checks_order(window: int):
    # A key, then a banned phrase, completing in one push (a relayed chunk of several tokens):
    # the phrase's check came first in the list and matched, and the text before it went
    # out, the key in it.
    key = "sk-" + "abcdefghijABCDEFGHIJ0123"
    card = RegexCheck({"card": r"\b\d{4}-\d{4}\b"}, name="regex")
    orders: list[list[Check]] = [
        [BannedPhrases(["forbidden phrase"]), card, secret_check()],
        [secret_check(), card, BannedPhrases(["forbidden phrase"])],
    ]
    for checks in orders:
        holdback = HoldBack(window, checks)
        out = "".join(
            holdback.push(text, 1)[0]
            for text in ["Intro ", "key ", f"{key} 1234-5678 forbidden phrase"]
        )
        out += holdback.finish()[0]
        assert holdback.violation is not None and holdback.violation.reason == "openai_key"
        assert out == "Intro key " and key[:3] not in out


@pytest.mark.parametrize(
    "written",
    [
        "".join(chr(ord(c) + 0xFEE0) if c != " " else c for c in "forbidden phrase"),
        "for\u200bbid\u200dden phr\u00adase",  # zero-width space and joiner, soft hyphen
        "FORBIDDEN\u2060 PHRASE",  # a word joiner
    ],
)
def test_a_banned_phrase_is_found_however_its_letters_are_written(written: str):
    # Each got past the check: a model told to spell a phrase past a filter writes so.
    tokens = ["Well ", *(written[i : i + 3] for i in range(0, len(written), 3)), " end"]
    holdback = HoldBack(10, [BannedPhrases(["forbidden phrase"])])  # the phrase, in tokens
    out = "".join(holdback.push(token, 1)[0] for token in tokens) + holdback.finish()[0]
    assert holdback.violation is not None and out == "Well "
    assert BannedPhrases(["Straße"]).find("no STRASSE here") is not None  # Unicode's folding


def test_a_letter_and_the_marks_after_it_are_matched_as_nfkc_composes_them():
    phrases = BannedPhrases(["café", "fire"])
    found = phrases.find("a cafe\u0301\u200b!")  # decomposed, an invisible character after it
    assert found is not None and (found.start, found.end) == (2, 8)
    # A marked letter inside a phrase: the letters after it are read once, in order.
    found = BannedPhrases(["café noir"]).find("un cafe\u0301 noir")
    assert found is not None and (found.start, found.end) == (3, 13)
    assert phrases.find("cafe\u0301\u0327") is None  # a cedilla too: another letter
    # Characters folded to several (ß as ss, a ligature) and marked keep later places right.
    found = phrases.find("\u00df\u0301 \ufb01\u0301re fire")
    assert found is not None and found.start == 8
    # A run of marks far past what one character takes: folded alone past the first 30, so
    # the text is read in time linear in its length (joined, each would fold all before it).
    found = phrases.find("a" + "\u0301" * 100_000 + " cafe\u0301")
    assert found is not None and found.start == 100_002


def pushed(holdback: HoldBack, tokens: list[str]) -> str:
    return "".join(holdback.push(token, 1)[0] for token in tokens)


@pytest.mark.parametrize("window", [0, 1, 3])
def test_a_match_at_the_end_of_the_text_so_far_is_decided_by_the_text_after_it(window: int):
    def read(tokens: list[str]) -> tuple[str, HoldBack]:
        holdback = HoldBack(window, [RegexCheck({"word": r"\bass\b"})])
        before = pushed(holdback, tokens[:2])
        # "ass" may be the word: nothing from its start leaves, and nothing is stopped yet.
        assert before == ("I am your " if window < 2 else "")
        assert holdback.violation is None and not holdback.ended
        out = before + pushed(holdback, tokens[2:])
        return out + holdback.finish()[0], holdback

    # Undone: "istant" came, and "ass" was the start of "assistant".
    said = ["I am your ", "ass", "istant", ", happy ", "to help."]
    out, holdback = read(said)
    assert out == "".join(said) and holdback.violation is None
    assert holdback.released_tokens == len(said)
    # Made final by the text after it, or by the text's end: stopped before the word.
    for tokens in (["I am your ", "ass", " you", " are"], ["I am your ", "ass"]):
        out, holdback = read(tokens)
        assert out == "I am your " and holdback.violation is not None
        violation = holdback.violation
        assert (violation.reason, violation.released_chars, violation.released_tokens) == (
            "word",
            10,
            1,
        )
        assert holdback.finish() == ("", 0)


def test_a_tentative_match_longer_than_its_checks_context_is_still_held():
    # The key grows past the 8 characters its check reads again each time: what it reads
    # reaches back to the key's start, so none of it leaves while it may still be one.
    holdback = HoldBack(0, [RegexCheck({"key": r"\bkey-\w+"}, context_chars=8)])
    out = pushed(holdback, ["my ", "key-a", *["bcde"] * 10])
    assert out == "my " and holdback.violation is None
    out += pushed(holdback, [" done", " more"])
    assert out == "my " and holdback.violation is not None


def test_a_tentative_match_after_a_final_one_leaves_the_final_ones_text_held():
    # In one push (a relayed chunk of several tokens), a phrase found whole and, after it, a
    # word that only the text to come decides: the text stops where the phrase begins.
    checks: list[Check] = [BannedPhrases(["bad"]), RegexCheck({"word": r"\bxyz\b"})]
    for window in (0, 2):
        holdback = HoldBack(window, checks)
        out = pushed(holdback, ["fine ", "so bad xyz"]) + holdback.finish()[0]
        assert holdback.violation is not None and holdback.violation.check == "banned_phrase"
        assert out == "fine so "


@pytest.mark.parametrize("window", [0, 2])
def test_a_key_that_ends_a_long_reply_stops_it_where_the_key_begins(window: int):
    # The key is tentative until the text ends (it may go on), then final: the text before
    # it goes out, counted from the reply's start, however much was released before.
    key = "sk-" + "A1b2C3d4" * 3
    holdback = HoldBack(window, [secret_check()])
    out = pushed(holdback, ["word "] * 100 + ["see ", key]) + holdback.finish()[0]
    assert holdback.violation is not None and holdback.violation.reason == "openai_key"
    assert out == "word " * 100 + "see "


def test_a_final_match_behind_a_tentative_one_stops_the_text_at_the_tentative_start():
    checks: list[Check] = [RegexCheck({"key": r"\bkey-\w+"}), BannedPhrases(["bad"])]
    holdback = HoldBack(0, checks)
    out = pushed(holdback, ["my ", "key-12bad34"])
    assert out == "my " and holdback.violation is not None
    assert holdback.violation.check == "banned_phrase"


@pytest.mark.parametrize("window", [0, 2, 1 << 30])
def test_no_check_reads_the_text_from_a_stop_string_on(window: int):
    # The reply ends at "END": "bad" after it is never shown, so it stops nothing (a whole
    # reply, window 1 << 30, holds all its pieces when the stop string completes).
    holdback = HoldBack(window, [BannedPhrases(["bad"])], stops=["END"])
    out = pushed(holdback, ["aaaa ", "bbbb ", "cccc ", "ENDbad", "x"])
    assert (out, holdback.stop_sequence, holdback.violation) == ("aaaa bbbb cccc ", "END", None)


def test_a_stop_strings_first_token_is_never_counted_released():
    # A whole reply lists the log probabilities of the tokens released: not "ST", whose
    # text, withheld as the start of a stop string, turned out to be one.
    holdback = HoldBack(0, [], stops=["STOP"])
    assert [holdback.push(t, 1) for t in ["a ", "ST", "OP"]] == [("a ", 1), ("", 0), ("", 0)]
    assert (holdback.released_tokens, holdback.stop_sequence) == (1, "STOP")


@pytest.mark.parametrize("window", [4, 5])
def test_a_window_as_long_as_a_phrases_tokens_holds_it_whole_in_multi_token_characters(
    window: int,
):
    # Byte-level tokens: each character takes two, the first ending inside it (no text).
    # The window counts tokens, so a phrase of four never has its start out before its end.
    holdback = HoldBack(window, [BannedPhrases(["\u30e5\u30fc"])])
    out = ""
    for text in ["", "\u30a2", "", "\u30cb", "", "\u30e5", "", "\u30fc"]:
        out += holdback.push(text, 1)[0]
    assert out == "\u30a2\u30cb" and holdback.violation is not None
    assert holdback.violation.released_tokens == 4


def test_a_stop_string_after_a_tentative_match_makes_it_final():
    holdback = HoldBack(3, [RegexCheck({"word": r"\bass\b"})], stops=["!"])
    out = pushed(holdback, ["I am your ", "ass", "!", " more"]) + holdback.finish()[0]
    assert out == "I am your " and holdback.violation is not None
    assert holdback.stop_sequence is None


def test_a_finding_says_whether_more_text_could_undo_it():
    word = RegexCheck({"word": r"\bass\b"})
    found = word.find("your ass")
    assert found is not None and found.tentative
    found = word.find("your ass.")
    assert found is not None and not found.tentative
    # A phrase found is found whatever comes next, even where it ends the text.
    phrase = BannedPhrases(["ass"]).find("your ass")
    assert phrase is not None and not phrase.tentative
    # Written in other letters too: the reply stops at once, not at its end.
    holdback = HoldBack(0, [BannedPhrases(["caf\u00e9"])])
    assert holdback.push("un caf\u00e9", 1) == ("un ", 0) and holdback.ended


def test_banned_phrases_case_sensitivity_and_blank_lists():
    assert BannedPhrases(["Foo"]).find("a foo b") is not None
    assert BannedPhrases(["Foo"], case_sensitive=True).find("a foo b") is None
    with pytest.raises(ValueError):
        BannedPhrases(["  "])


def test_phrases_replaced_stop_a_reply_under_way_at_its_next_token():
    phrases = BannedPhrases(["nope"])
    holdback = HoldBack(2, [phrases])
    for token in ("the ", "code ", "name "):
        holdback.push(token, 1)
    phrases.replace(["nope", "falcon"])  # banned while the reply runs
    assert holdback.push("is ", 1) == ("code ", 1)
    assert holdback.push("fal", 1) == ("name ", 1)
    assert holdback.push("con", 1) == ("is ", 1)
    assert holdback.ended and holdback.violation is not None
    assert holdback.violation.released_chars == len("the code name is ")


@pytest.mark.parametrize("window", [4, 1 << 30])
def test_phrases_replaced_are_found_in_text_held_past_their_context(window: int):
    # The phrase was made before the list changed, further back than its check reads at a
    # token (a whole reply holds all of its text): read by the old list only, it left.
    phrases = BannedPhrases(["zz"])
    holdback = HoldBack(window, [phrases])
    released = holdback.push("one falcon ", 1)[0]
    for _ in range(3):
        released += holdback.push("and some more words ", 1)[0]
    phrases.replace(["falcon"])
    assert phrases.context_chars < len("and some more words " * 3)
    released += holdback.push("end.", 1)[0]
    released += holdback.finish()[0]
    assert released == "one " and holdback.violation is not None


def test_phrases_replaced_after_the_last_token_are_read_before_the_text_ends():
    phrases = BannedPhrases(["zz"])
    holdback = HoldBack(1 << 30, [phrases])
    holdback.push("a falcon flies", 1)
    phrases.replace(["falcon"])
    assert holdback.finish() == ("a ", 0) and holdback.violation is not None


def test_phrases_replaced_by_none_change_nothing():
    phrases = BannedPhrases(["nope"])
    with pytest.raises(ValueError):
        phrases.replace(["", "  "])
    assert (phrases.revision, phrases.find("a nope") is not None) == (0, True)


def test_an_alternative_allowed_before_the_phrases_changed_is_read_again():
    phrases = BannedPhrases(["zz"])
    holdback = HoldBack(0, [phrases])
    made = [TokenLogprob(" a", -0.1, b" a", (TopLogprob(" falcon", -2.0, b" falcon"),))]
    assert holdback.shown_alternatives(made) == tuple(made)
    phrases.replace(["falcon"])
    holdback.push(" b", 1)
    assert holdback.shown_alternatives(made)[0].top == ()


def test_batcher_flushes_every_k_tokens_and_keeps_the_rest():
    batcher = Batcher(3)
    got = [batcher.add(f"{i} ", 1, now=float(i)) for i in range(7)]
    assert [g for g in got if g] == [("0 1 2 ", 3), ("3 4 5 ", 3)]
    assert batcher.flush() == ("6 ", 1)
    assert batcher.flush() is None


def test_batcher_window_starts_at_the_first_token_of_a_batch():
    batcher = Batcher(100, window_s=0.05)
    assert batcher.add("a", 1, now=1.0) is None
    assert batcher.due_at == pytest.approx(1.05)
    assert not batcher.expired(1.04)
    assert batcher.add("b", 1, now=1.06) == ("ab", 2)  # the window ran out
    assert batcher.due_at is None


def test_batcher_refuses_nonsense():
    with pytest.raises(ValueError):
        Batcher(0)
    with pytest.raises(ValueError):
        Batcher(1, window_s=-1)


@pytest.mark.parametrize("reason", ["stop", "length", 'odd "reason" \u00e9'])
def test_native_events_spelt_out_are_byte_for_byte_what_json_dumps_writes(reason: str):
    native = NativeFormat()
    usage = Usage(prompt_tokens=7, completion_tokens=120)
    assert usage.as_json() == json.dumps(usage.as_dict())
    assert native.started("a1b2")[0][1] == json.dumps({"reply_id": "a1b2"})
    (_, usage_data), (_, done_data) = native.finished(reason, usage)
    assert usage_data == json.dumps(usage.as_dict())
    assert done_data == json.dumps({"finish_reason": reason})
    assert native.text('say "hi"\n', 2)[0][1] == json.dumps({"text": 'say "hi"\n', "tokens": 2})


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(alphabet="abc ", min_size=1, max_size=6), min_size=1, max_size=12),
    st.text(alphabet="abcd ", max_size=40),
)
def test_the_phrases_trie_finds_what_a_list_of_them_finds(phrases: list[str], text: str):
    # Written as a trie, thousands of phrases cost about what a few do: the same places found.
    listed = re.compile("|".join(re.escape(p) for p in sorted(phrases, key=len, reverse=True)))
    trie = re.compile(phrases_pattern(phrases))
    expected = [m.start() for m in re.finditer(f"(?=(?:{listed.pattern}))", text)]
    assert [m.start() for m in re.finditer(f"(?=(?:{trie.pattern}))", text)] == expected
    first, found = listed.search(text), trie.search(text)
    assert (first and first.start()) == (found and found.start())


def test_phrases_each_a_prefix_of_the_next_are_still_one_pattern():
    # Nested past what re compiles (or Python recurses), the trie is written as a list.
    check = BannedPhrases(["a" * n for n in range(1, 1500)])
    found = check.find("xy aay")
    assert found is not None and (found.start, found.end) == (3, 5)
