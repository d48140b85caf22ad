"""A client's W3C trace context (``traceparent``, ``tracestate``), read for a relay to pass on.

This file decides which of those headers are passed on: a ``traceparent`` of the W3C Trace
Context format (version 00's four fields, lower-case hex, and neither id all zeros; a later
version's first four fields the same, passed on as version 00 with what follows them left
out, as the standard has a system that speaks version 00 read a later one: a client's tail
of any length or character never reaches an upstream, and of its flags only ``sampled``,
the one version 00 knows, is kept), and
``tracestate`` only beside such a ``traceparent``, when it is the standard's list: up to 32
members ``key=value`` with keys and values of its grammar and no key twice, spaces and tabs
around members and empty members allowed (and left out when passed on). Several
``tracestate`` fields are one list, joined with commas, as HTTP joins the fields of a list.
A list longer than 512 characters (what the standard asks every hop to keep) is cut by whole
members as the standard says: those over 128 characters first, then from its end. A request
with two ``traceparent`` fields has no trace context (which would be its parent cannot be
told). Anything else is dropped, not repaired: the upstream then starts a trace of its own,
or, for a ``tracestate`` that is not one, goes on with the ``traceparent`` alone. It must
not know how a relay sends them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
TRACESTATE_LIMIT = 512
TRACESTATE_MEMBERS = 32
LONG_MEMBER = 128  # members longer than this are the first cut from a list over the limit
# A key: one of up to 256 characters, or a tenant's (up to 241) "@" a system's (up to 14).
_KEY_CHARS = r"[a-z0-9_\-*/]"
_KEY = re.compile(
    rf"[a-z0-9]{_KEY_CHARS}{{0,255}}|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}}"
)
# A value: up to 256 printable ASCII characters but "," and "=", not ending in a space.
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
SAMPLED = 0x01  # the one flag of version 00


def _traceparent(value: str) -> str | None:
    """The ``traceparent`` to pass on for ``value`` (version 00's four fields), if it is one."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    if version != "00":
        # Of a later version's flags only ``sampled`` is known; version 00 has every other
        # flag zero (the standard: "Vendors MUST set those to zero").
        flags = "01" if int(flags, 16) & SAMPLED else "00"
    return f"00-{trace_id}-{parent_id}-{flags}"


def trace_context(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The trace-context headers of a request worth passing on (none, or ``traceparent``
    with, when given and sane, ``tracestate``). ``headers``: a request's (a multidict: every
    field of a name counts), or a plain mapping of one field per name."""
    parents = fields(headers, "traceparent")
    parent = _traceparent(parents[0].strip()) if len(parents) == 1 else None
    if parent is None:
        return ()
    state = _tracestate(fields(headers, "tracestate"))
    if state:
        return (("traceparent", parent), ("tracestate", state))
    return (("traceparent", parent),)


def _tracestate(values: list[str]) -> str | None:
    """The ``tracestate`` to pass on for a request's fields ``values``: their members, if they
    are one list of the standard's, cut to ``TRACESTATE_LIMIT`` characters; None if not."""
    members: list[str] = []
    keys: set[str] = set()
    for value in values:
        for member in value.split(","):
            member = member.strip(" \t")  # the optional whitespace around members
            if not member:
                continue  # empty members are allowed, and mean nothing
            key, equals, state = member.partition("=")
            if not equals or key in keys or not (_KEY.fullmatch(key) and _VALUE.fullmatch(state)):
                return None
            keys.add(key)
            members.append(member)
    if len(members) > TRACESTATE_MEMBERS:
        return None
    while len(",".join(members)) > TRACESTATE_LIMIT:
        long = [at for at, member in enumerate(members) if len(member) > LONG_MEMBER]
        del members[long[-1] if long else -1]
    return ",".join(members) or None


def fields(headers: Mapping[str, str], name: str) -> list[str]:
    """Every field named ``name`` (a multidict holds each one a request sent)."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    value = headers.get(name)
    return [] if value is None else [value]
