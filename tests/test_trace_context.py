"""Which W3C trace-context headers a relay passes on (``server/trace_context.py``)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from replystream.server.trace_context import TRACESTATE_LIMIT, trace_context

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"


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
