"""A client's W3C trace context (``traceparent``, ``tracestate``), read for a relay to pass on.

This file decides which of those headers are passed on: a ``traceparent`` of the W3C Trace
Context format (version 00's four fields, lower-case hex, and neither id all zeros; a later
version's first four fields the same, what follows them ignored as the standard says), and
``tracestate`` only beside such a ``traceparent``, up to 512 characters (what the standard
asks every hop to keep) of visible ASCII. Anything else is dropped, not repaired: the
upstream then starts a trace of its own. It must not know how a relay sends them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
TRACESTATE_LIMIT = 512


def _valid_traceparent(value: str) -> bool:
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def trace_context(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The trace-context headers of a request worth passing on (none, or ``traceparent``
    with, when given and sane, ``tracestate``)."""
    parent = headers.get("traceparent", "").strip()
    if not parent or not _valid_traceparent(parent):
        return ()
    state = headers.get("tracestate", "").strip()
    if state and len(state) <= TRACESTATE_LIMIT and state.isascii() and state.isprintable():
        return (("traceparent", parent), ("tracestate", state))
    return (("traceparent", parent),)
