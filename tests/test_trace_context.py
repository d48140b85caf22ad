"""Which W3C trace-context headers a relay passes on (``server/trace_context.py``)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from replystream.server.trace_context import TRACESTATE_LIMIT, trace_context

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"
TRACESTATE_MEMBERS = 32  # the standard's most members of a list


def test_a_traceparent_of_this_version_is_passed_on_as_it_is():
    assert trace_context({"traceparent": GOOD}) == (("traceparent", GOOD),)


@pytest.mark.parametrize(
    ("value", "passed"),
    [
        (f"01-{TRACE}-{PARENT}-00", f"00-{TRACE}-{PARENT}-00"),
        # Of a later version's flags only ``sampled`` is known: version 00 has the others 0.
        (f"cc-{TRACE}-{PARENT}-09-what-a-later-version-adds", f"00-{TRACE}-{PARENT}-01"),
        (f"cc-{TRACE}-{PARENT}-fe-what-a-later-version-adds", f"00-{TRACE}-{PARENT}-00"),
        (f"01-{TRACE}-{PARENT}-ff", GOOD),
        # What follows never reaches an upstream: of any length, in any character.
        (f"01-{TRACE}-{PARENT}-01-" + "A" * 7000, GOOD),
        (f"01-{TRACE}-{PARENT}-01-\u4e2d", GOOD),
    ],
    ids=[
        "version 01",
        "a later version's fields",
        "a later version's flags but sampled",
        "a later version's flags all set",
        "a long tail",
        "a tail beyond Latin-1",
    ],
)
def test_a_later_versions_four_fields_are_passed_on_as_version_00(value: str, passed: str):
    assert trace_context({"traceparent": value}) == (("traceparent", passed),)


@pytest.mark.parametrize(
    "value",
    [
        f"00-{TRACE}-{PARENT}-01-extra",  # version 00 has four fields, no more
        f"ff-{TRACE}-{PARENT}-01",  # the one forbidden version
        f"00-{'0' * 32}-{PARENT}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{PARENT}-01",
        f"00-{TRACE[:-1]}-{PARENT}-01",
        "",
    ],
)
def test_a_traceparent_that_is_not_one_is_dropped_with_its_state(value: str):
    assert trace_context({"traceparent": value, "tracestate": "a=1"}) == ()


def test_tracestate_goes_only_beside_a_traceparent_and_only_when_sane():
    assert trace_context({"tracestate": "a=1"}) == ()
    assert trace_context({"traceparent": GOOD, "tracestate": "a=1,b=2"}) == (
        ("traceparent", GOOD),
        ("tracestate", "a=1,b=2"),
    )
    for state in ("a" * (TRACESTATE_LIMIT + 1), "a=\u00e9"):
        assert trace_context({"traceparent": GOOD, "tracestate": state}) == (("traceparent", GOOD),)


def test_two_traceparent_fields_are_none_and_tracestate_fields_are_one_list():
    two = CIMultiDict([("traceparent", GOOD), ("Traceparent", GOOD), ("tracestate", "a=1")])
    assert trace_context(two) == ()
    states = CIMultiDict([("traceparent", GOOD), ("tracestate", "a=1"), ("tracestate", " b=2")])
    assert trace_context(states) == (("traceparent", GOOD), ("tracestate", "a=1,b=2"))


def state_of(*values: str) -> str | None:
    """The ``tracestate`` passed on beside a good ``traceparent`` for these fields."""
    headers = CIMultiDict([("traceparent", GOOD), *(("tracestate", v) for v in values)])
    return dict(trace_context(headers)).get("tracestate")


def test_tracestate_members_may_have_spaces_and_tabs_around_them():
    # The standard's optional whitespace is spaces and tabs; it is left out when passed on.
    assert state_of("foo=1 \t , \t bar=2, \t baz=3") == "foo=1,bar=2,baz=3"
    assert state_of("\t foo=1 \t", "", " , bar=2") == "foo=1,bar=2"
    assert state_of("a= 1") == "a= 1"  # a value's leading spaces are its own


@pytest.mark.parametrize(
    "values",
    [
        ("foo=1,foo=2",),
        ("foo=1", "foo=1"),  # a key twice, in two fields
        ("FOO=1",),
        ("foo =1",),
        ("foo.bar=1",),
        ("foo@=1,bar=2",),
        ("@foo=1,bar=2",),
        ("foo@@bar=1,bar=2",),
        ("foo@bar@baz=1,bar=2",),
        ("foo=1", "z" * 257 + "=1"),
        ("foo=1", "t" * 242 + "@v=1"),
        ("foo=1", "t@" + "v" * 15 + "=1"),
        ("foo=bar=baz",),
        ("foo=,bar=3",),
        ("foo=" + "v" * 257,),
        (",".join(f"k{i}=v" for i in range(TRACESTATE_MEMBERS + 1)),),
    ],
)
def test_a_tracestate_not_of_the_standards_grammar_is_dropped(values: tuple[str, ...]):
    assert state_of(*values) is None


def test_a_tracestate_of_the_standards_grammar_goes_on():
    key = "abcdefghijklmnopqrstuvwxyz0123456789_-*/"
    value = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) not in ",=")
    for member in (f"{key}={value}", f"{key}@a-z0-9_-*/={value}", "z" * 256 + "=1"):
        assert state_of("foo=1", member) == f"foo=1,{member}"
    assert state_of("t" * 241 + "@" + "v" * 14 + "=1") == "t" * 241 + "@" + "v" * 14 + "=1"
    members = [f"k{i:02}=v" for i in range(TRACESTATE_MEMBERS)]
    assert state_of(",".join(members[:10]), ",".join(members[10:])) == ",".join(members)


def test_a_tracestate_over_the_limit_is_cut_by_whole_members_long_ones_first():
    """The standard: cut whole members, those over 128 characters first, then from the end."""
    big = "big=" + "x" * 200
    small = [f"k{i:02}=" + "v" * 56 for i in range(8)]  # 60 characters each
    state = ",".join(["a=1", big, *small])
    assert len(state) > TRACESTATE_LIMIT
    assert state_of(state) == ",".join(["a=1", *small])  # 3 + 8 * 61 = 491 characters
    nine = [*small, "k08=" + "v" * 56]
    assert state_of(",".join(["a=1", *nine])) == ",".join(["a=1", *small])
