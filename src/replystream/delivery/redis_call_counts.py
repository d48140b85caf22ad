"""This store's count of its own write calls, as Redis keeps it, and what each count tells.

Every flush and repair ends with an ``INCR`` of a key only this store writes (one per slot
group: ``ReplyKeys.counter_key``), which lives the reply TTL from each call. Replication is
ordered, so a count short of the last one seen plus one means Redis lost calls it had
acknowledged (a failover), and with them whatever they wrote; a count started again at 1
means the key itself is gone (a ``maxmemory`` Redis evicted it); a count whose key may have
expired since the previous call (they were the TTL apart) tells nothing. A flush's call
checks the count before it writes (``expected``): one found other than the last seen writes
nothing (``unexpected``): short, Redis lost calls; past it, two primaries answer at once (a
demoted one still takes writes while the client reaches both), and this one lacks the calls
the other took. So nothing new lands past a hole before its producer has filled it. Pure
state: counts and times in, a verdict out, the clock passed in. This file must not know how
Redis is reached or what the writer does about a verdict.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Verdict(NamedTuple):
    """What one count tells: ``as_expected`` (or nothing can be told), ``lost`` (``calls``
    acknowledged calls are gone), ``evicted`` (the count itself is gone), or ``elsewhere``
    (a count past the one this store saw last: another primary took its last calls)."""

    kind: Literal["as_expected", "lost", "evicted", "elsewhere"]
    calls: int = 0


class CallCounts:
    """The last count of its calls this store saw per slot group, and when it sent that call."""

    __slots__ = ("_seen", "_sent", "ttl_s")

    def __init__(self, ttl_s: int) -> None:
        self.ttl_s = ttl_s  # the count's key lives this long from each call
        self._seen: dict[int, int] = {}
        self._sent: dict[int, float] = {}

    def after(self, group: int, count: int, sent: float, now: float) -> Verdict:
        """Redis's count of this store's calls to ``group`` after one more, sent at ``sent``
        and answered by ``now``."""
        seen = self._seen.get(group)
        expected = None if seen is None else seen + 1
        previous = self._sent.get(group)
        # The count's TTL runs from the previous call's EXPIRE, which ran after ``previous``
        # (when that call was sent); this call's INCR ran before now. Once they may be the
        # TTL apart, the count may have expired, as it does: it is not taken for lost.
        if previous is not None and now - previous >= self.ttl_s:
            expected = None
        self._seen[group] = count
        self._sent[group] = sent
        if expected is not None and count == 1 < expected:
            # The count itself is gone, not short (a failover loses the whole key only if all
            # of it was in its window: a store's first writes).
            return Verdict("evicted")
        if expected is not None and count < expected:
            return Verdict("lost", expected - count)
        return Verdict("as_expected")

    def expected(self, group: int, now: float, within_s: float) -> int:
        """The count Redis must hold for ``group`` before a call sent at ``now`` (answered
        within ``within_s``, or not at all) runs: the last one seen, or 0 when nothing can be
        told (none seen since the last failure, or the key may have expired before it runs)."""
        seen = self._seen.get(group)
        previous = self._sent.get(group)
        if seen is None or previous is None or now + within_s - previous >= self.ttl_s:
            return 0
        return seen

    def unexpected(self, group: int, count: int, sent: float) -> Verdict:
        """A call sent at ``sent`` found Redis's count of ``group`` at ``count``, not the one
        it expected, and wrote nothing: what lost calls wrote is gone (``lost``), or the count
        itself is (0: ``evicted``, or Redis restarted without its data), or another primary
        took the last calls (``elsewhere``). The count is taken as it is: the next call
        counts on from it."""
        seen = self._seen.get(group, 0)
        self._seen[group] = count
        self._sent[group] = sent
        if count == 0:
            return Verdict("evicted")
        if count > seen:
            return Verdict("elsewhere")
        return Verdict("lost", seen - count)

    def forget(self) -> None:
        """A call failed, and with it what its count was: the next count tells nothing."""
        self._seen.clear()
