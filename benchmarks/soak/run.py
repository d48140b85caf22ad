"""Soak: many replies against one server, every way a reply can end; then nothing is left over.

Starts ``replystream serve`` (the tiny engine by default, whose KV blocks must all come back)
and runs ``--replies`` replies at a steady ``--concurrency``, mixed: read to the end, buffered,
left mid-reply, cancelled with ``POST /v1/replies/{id}/cancel``, resumable and cut one to three
times (read through ``ResumingReader``), dropped at a random point (mid-request, before the
headers, after some bytes, with a reset), and ``--slow`` WebSocket readers that stop reading
until the server's slow-client limits cut them. A banned phrase that about a third of the
replies contain makes those end moderated.

What the engine makes is known beforehand: every distinct request (a prompt, a seed, seeded
sampling) is read once, one at a time, from a separate quiet server without the banned phrase.
A reply read to its end must equal that text exactly (or, if it contains the phrase, end
moderated with a prefix that stops before it); a reply cut short must be a prefix of it.

The run is two halves with the middle snapshot between them (the first with more of the slow
readers). Prints server memory (RSS) at the start, middle and end, and around each slow reader;
open tasks, file descriptors, readers, replies in flight, engine requests, KV blocks and reply
logs at the end against the baseline; the end's RSS against the peak before the middle; and
the count of replies whose text differs from the engine's. Exits 1 if any check fails.

Run: python benchmarks/soak/run.py [--replies 20000] [--concurrency 64]
         [--engine tiny|simulated] [--slow 5] [--asks 256] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from replystream.client.transport import http_request
from replystream.lab.local_server import LocalServer, serve_process

if __package__ in (None, ""):  # run as a script: make the ``soak`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soak.clients import (
    SLOW_WAIT_S,
    Ask,
    Kind,
    Result,
    buffered,
    disconnect,
    resume,
    slow,
    stream,
)
from soak.server import (
    Snapshot,
    holds_connection,
    metrics_text,
    outcomes,
    rss_kib,
    snapshot,
)
from tool_main import tool_main

# Share of each kind among the replies (the slow readers are counted apart, --slow).
MIX: dict[Kind, int] = {
    "complete": 40,
    "buffered": 8,
    "leave": 12,
    "cancel": 10,
    "resume": 15,
    "disconnect": 15,
}
OPENERS = (
    "The",
    "And the",
    "Behold, the",
    "Then the",
    "Now the",
    "In the days of the",
    "And he said unto the",
    "Once upon a time the",
    "She looked at the",
    "It was the",
    "They went to the",
    "Hear the",
    "For the",
    "When the",
    "All the",
    "Upon the",
)
SUBJECTS = (
    "king",
    "city",
    "river",
    "people",
    "house",
    "night",
    "mountain",
    "children",
    "field",
    "gate",
    "prophet",
    "sea",
    "garden",
    "stone",
    "word",
    "fire",
)
MAX_TOKENS = (8, 16)  # each distinct request asks for a length in this range
TARGET_MODERATED = 0.3  # share of references the banned phrase is chosen to appear in
LIMITS = {  # low, so that cuts and expiries happen within the run
    "--slow-client-bytes": "8192",
    "--slow-client-s": "1",
    "--detach-grace-s": "2",
    "--reply-ttl-s": "3",
    "--holdback-tokens": "4",
    "--ws-max-replies": "10000",
}
REPLY_TTL_S = 3.0
LAST_WORDS_S = 5.0  # a cut connection that cannot take its last event is aborted after this
RSS_SLACK_KIB = 8 * 1024
# Of the most one slow reader's burst took: how much higher a later burst may peak. Bursts of
# the same replies peak unevenly (on the simulated engine, 8,000 replies, from 137 to 155 MiB
# over 58 at the start: a fifth of one burst); a leak of a burst's replies keeps nearly all.
BURST_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class Plan:
    engine_args: list[str]
    asks: list[Ask]
    slow_ask: Ask
    slow_replies: int  # replies each slow WebSocket starts


def plan(engine: str, n_asks: int) -> Plan:
    """The distinct requests and engine options of a run."""
    low, high = MAX_TOKENS
    if engine == "tiny":
        # Greedy: seeded sampling at a temperature can flip a token when the batch around a
        # request changes the logits in their last bits (see docs/reliability.md).
        prompts = [f"{o} {w}" for o in OPENERS for w in SUBJECTS]
        asks = [
            Ask(prompts[i % len(prompts)], i, low + i % (high - low + 1), 0.0)
            for i in range(n_asks)
        ]
        # The context holds 256 tokens; a WebSocket message is about 100 bytes per token.
        return Plan(["--engine", "tiny"], asks, Ask("Once upon a time", 1, 240, 0.0), 250)
    # The simulated engine makes one text, so every reply is a prefix of every longer one:
    # the slow readers' replies stop short of the banned phrase, and are many (bytes fill).
    asks = [Ask("x", i, low + i % (high - low + 1), 1.0) for i in range(n_asks)]
    args = ["--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "2"]
    return Plan(args, asks, Ask("x", 1, 12, 1.0), 8000)


async def references(server: LocalServer, asks: list[Ask]) -> list[str]:
    """Each distinct request's text, read once, one at a time, from a quiet server."""
    texts = []
    for i, ask in enumerate(asks):
        result = await stream(server.url, i, ask, "complete")
        if result.ending != "done" or result.text is None:
            raise RuntimeError(f"reference {i} ended {result.ending}")
        texts.append(result.text)
    return texts


def choose_phrase(texts: list[str], avoid: str) -> tuple[str, float] | None:
    """A word (3+ letters) whose share of texts containing it is nearest TARGET_MODERATED,
    and that ``avoid`` (the slow readers' reply, which must run long) does not contain; None
    if every word is in ``avoid`` (a few short simulated texts: each is a prefix of it)."""
    lowered = [t.lower() for t in texts]
    words = {w for t in lowered for w in re.findall(r"[a-z]{3,}", t) if w not in avoid.lower()}
    if not words:
        return None
    shares = {w: sum(w in t for t in lowered) / len(texts) for w in sorted(words)}
    word = min(shares, key=lambda w: abs(shares[w] - TARGET_MODERATED))
    return word, shares[word]


@dataclass(slots=True)
class Progress:
    total: int
    done: int = 0
    snapshots: dict[int, Snapshot] = field(default_factory=dict)  # percent -> state
    samples_taken: set[int] = field(default_factory=set)
    middle: Snapshot | None = None  # between the run's two halves
    after_middle: tuple[int, int] = (0, 0)  # (mixed replies, slow readers) of the second half
    # Per slow reader: RSS when it started, after its cut, and the peak so far then (KiB).
    bursts: list[tuple[int, int, int]] = field(default_factory=list)
    slow_before_middle: int = 0


def slow_in_second_half(slow: int) -> int:
    """How many of the slow readers run after the middle: fewer than before it, and never the
    second. A slow reader's burst (thousands of replies at once) takes far more memory than
    the mixed replies, and where it peaks varies from one to the next: the first half's peak
    is the highest of at least two. One after the middle is what shows a leak of a slow
    reader's replies (about 78 MiB each, when there was one)."""
    return max(0, (slow - 1) // 2)


async def run_one(url: str, i: int, kind: Kind, plan_: Plan, seed: int) -> Result:
    rng = random.Random(seed * 1_000_003 + i)
    ask_index = rng.randrange(len(plan_.asks))
    ask = plan_.asks[ask_index]
    some = rng.randint(1, ask.max_tokens - 1)
    if kind == "complete":
        return await stream(url, ask_index, ask, kind)
    if kind == "buffered":
        return await buffered(url, ask_index, ask)
    if kind == "leave":
        return await stream(url, ask_index, ask, kind, leave_after=some)
    if kind == "cancel":
        return await stream(url, ask_index, ask, kind, cancel_after=some)
    if kind == "resume":
        cuts = rng.sample(range(1, ask.max_tokens), rng.randint(1, 3))
        return await resume(url, ask_index, ask, cuts, seed=i)
    return await disconnect(url, ask_index, ask, rng)


def kinds_of(n: int, seed: int) -> list[Kind]:
    rng = random.Random(seed)
    names = list(MIX)
    return rng.choices(names, weights=[MIX[k] for k in names], k=n)


async def soak(
    server: LocalServer, plan_: Plan, kinds: list[Kind], args: argparse.Namespace
) -> tuple[list[Result], Progress]:
    """Run every reply at a steady concurrency, the slow readers one at a time beside them, in
    two halves with the middle snapshot between them. The memory check holds the end to the
    peak the first half reached: the second half runs the same work again, which a healthy
    server does in the memory it already took, whatever the run's size. (A middle counted
    by replies ended came, in a small run, before most slow readers' bursts: their growth
    read as a leak.)"""
    results: list[Result] = []
    progress = Progress(len(kinds) + args.slow)

    async def sample() -> None:
        percent = progress.done * 100 // progress.total
        step = percent - percent % 10
        if step not in progress.samples_taken:
            progress.samples_taken.add(step)
            progress.snapshots[step] = await snapshot(server)

    def server_holds(port: int) -> bool:
        return holds_connection(server.pid, port)

    async def half(numbered: list[tuple[int, Kind]], slow_readers: int) -> None:
        queue = collections.deque(numbered)
        first, size = progress.done, len(numbered) + slow_readers

        async def worker() -> None:
            while queue:
                i, kind = queue.popleft()
                results.append(await run_one(server.url, i, kind, plan_, args.seed))
                progress.done += 1
                await sample()

        async def slow_lane() -> None:
            for k in range(slow_readers):
                # Spread over the half, the first at its start: the k-th starts once k / n of
                # the half is done.
                start_at = first + size * k // slow_readers
                while progress.done < start_at and queue:  # noqa: ASYNC110  (others' progress)
                    await asyncio.sleep(0.2)
                found = rss_kib(server.pid)
                results.append(
                    await slow(server.url, -1, plan_.slow_ask, plan_.slow_replies, server_holds)
                )
                progress.done += 1
                after, peak = rss_kib(server.pid), rss_kib(server.pid, "VmHWM")
                progress.bursts.append((found, after, peak))

        async with asyncio.TaskGroup() as group:
            for _ in range(args.concurrency):
                group.create_task(worker())
            group.create_task(slow_lane())

    numbered = list(enumerate(kinds))
    split, later_slow = (len(numbered) + 1) // 2, slow_in_second_half(args.slow)
    progress.slow_before_middle = args.slow - later_slow
    await half(numbered[:split], progress.slow_before_middle)
    progress.middle = await snapshot(server)
    progress.after_middle = (len(numbered) - split, later_slow)
    await half(numbered[split:], later_slow)
    return results, progress


def problem(result: Result, reference: str | None, phrase: str) -> tuple[str, str] | None:
    """("text" | "ending" | "held", why) if this reply is not what its kind allows."""
    kind, ending, text = result.kind, result.ending, result.text
    if kind == "disconnect":
        return None if ending == "gone" else ("ending", f"{kind}: {ending}")
    if kind == "slow":
        if ending.endswith(":held"):
            return ("held", f"{kind}: cut, but the connection was still open {SLOW_WAIT_S:g} s on")
        return None if ending in ("cut", "cut:aborted") else ("ending", f"{kind}: {ending}")
    assert reference is not None
    if text is None:
        return ("ending", f"{kind}: {ending}")
    contains = phrase in reference.lower()
    if ending == "done":
        if contains:
            return ("ending", f"{kind}: finished although it contains the banned phrase")
        return None if text == reference else ("text", f"{kind}: final text differs")
    partial = (
        ending == "moderated"
        or (kind == "leave" and ending == "left")
        or (kind == "cancel" and ending == "error:cancelled")
    )
    if not partial:
        return ("ending", f"{kind}: {ending}")
    if ending == "moderated" and not contains:
        return ("ending", f"{kind}: moderated without the banned phrase")
    if not reference.startswith(text):
        return ("text", f"{kind} ({ending}): not a prefix of the engine's text")
    if phrase in text.lower():
        return ("text", f"{kind} ({ending}): the banned phrase was delivered")
    return None


async def settle(server: LocalServer, resumable_ids: list[str]) -> int:
    """Wait until nothing is in flight, let cut sockets be aborted and resumable logs expire;
    then ask for every resumable reply (each must be gone). Returns how many were not."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        g = (await snapshot(server)).gauges
        busy = g["in_flight"] + g["readers"] + g["engine_requests"] + g.get("kv_blocks", 0)
        if not busy:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(max(LAST_WORDS_S, REPLY_TTL_S) + 1)
    still_there = 0
    for reply_id in resumable_ids:
        async with http_request(f"{server.url}/v1/replies/{reply_id}/stream") as response:
            async for _chunk in response:
                pass
            still_there += response.status != 404
    return still_there


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replies", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--engine", choices=("tiny", "simulated"), default="tiny")
    parser.add_argument("--slow", type=int, default=5, help="slow WebSocket readers")
    parser.add_argument("--asks", type=int, default=256, help="distinct requests")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.concurrency < 1 or args.asks < 1 or args.slow < 0:
        parser.error("--concurrency and --asks must be at least 1, --slow not negative")
    if args.replies <= args.slow:
        parser.error(
            f"--replies must be more than --slow ({args.slow}): the slow readers are of them"
        )
    plan_ = plan(args.engine, args.asks)
    limits = [item for pair in LIMITS.items() for item in pair]
    started = time.monotonic()
    async with serve_process(plan_.engine_args) as quiet:
        refs = await references(quiet, plan_.asks)
        slow_text = (await references(quiet, [plan_.slow_ask]))[0]
    chosen = choose_phrase(refs, slow_text)
    if chosen is None:
        parser.error(
            f"--asks {args.asks}: every word of the reference texts is in the slow readers' "
            "reply, so none can be the banned phrase; ask for more distinct requests"
        )
    phrase, share = chosen
    print(
        f"soak: {args.replies} replies at concurrency {args.concurrency}, engine {args.engine}, "
        f"{len(refs)} distinct requests (max_tokens {MAX_TOKENS[0]}-{MAX_TOKENS[1]}), "
        f"references read in {time.monotonic() - started:.1f} s"
    )
    print(f"banned phrase {phrase!r}: in {share:.0%} of the reference texts")
    kinds = kinds_of(args.replies - args.slow, args.seed)
    server_args = [*plan_.engine_args, *limits, "--ban", phrase]
    async with serve_process(server_args) as server:
        for i in range(2 * args.concurrency):  # warm-up: imports, pools, first allocations
            await stream(
                server.url, i % len(plan_.asks), plan_.asks[i % len(plan_.asks)], "complete"
            )
        baseline = await snapshot(server, quiet=True)
        before = outcomes(await metrics_text(server.url))
        t0 = time.monotonic()
        results, progress = await soak(server, plan_, kinds, args)
        wall = time.monotonic() - t0
        resumable_ids = [r.reply_id for r in results if r.kind == "resume" and r.reply_id]
        not_expired = await settle(server, resumable_ids)
        end = await snapshot(server, quiet=True)
        after = outcomes(await metrics_text(server.url))
    middle = progress.middle or end
    replies_after, slow_after = progress.after_middle
    # A burst after the middle may peak higher than those before it did, by a share of one.
    first_half = progress.bursts[: progress.slow_before_middle]
    burst = max((peak - at_start for at_start, _, peak in first_half), default=0)
    allowed = RSS_SLACK_KIB + (round(BURST_SHARE * burst) if slow_after else 0)
    bursts_allowed = f", {BURST_SHARE:.0%} of a burst's {mib(burst)} included" if slow_after else ""

    by_kind = collections.Counter(r.kind for r in results)
    endings = collections.Counter(f"{r.kind} {r.ending.split(':')[0]}" for r in results)
    problems: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    for r in results:
        found = problem(r, refs[r.ask] if r.ask >= 0 else None, phrase)
        if found is not None:
            problems[found[0]] += 1
            seen = "" if r.text is None else f", read {r.text!r}"
            expected = "" if r.ask < 0 else f", engine made {refs[r.ask]!r}"
            examples.setdefault(found[1], f"ask {r.ask}, ending {r.ending}{seen}{expected}")
    served = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(
        f"ran {len(results)} replies in {wall:.1f} s ({len(results) / wall:.0f}/s); "
        f"resumed connections: {sum(r.reconnects for r in results if r.kind == 'resume')}"
    )
    print("by kind: " + ", ".join(f"{k} {by_kind[k]}" for k in (*MIX, "slow")))
    print("client endings: " + ", ".join(f"{k} {v}" for k, v in sorted(endings.items())))
    print("server outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(served.items()) if v))
    print("server state (RSS and fds from /proc, the rest from /metrics):")
    for label, snap in (("baseline", baseline), ("middle", middle), ("end", end)):
        print(f"  {label:8s} {snap.line()}")
    for percent in sorted(progress.snapshots):
        print(f"  {percent:3d} %    RSS {mib(progress.snapshots[percent].rss_kib)}")
    for k, (at_start, after_cut, peak) in enumerate(progress.bursts, 1):
        print(
            f"  slow reader {k}: RSS {mib(at_start)} at its start, {mib(after_cut)} after its "
            f"cut (peak so far {mib(peak)})"
        )
    print(
        f"server RSS: start {mib(baseline.rss_kib)}, middle {mib(middle.rss_kib)} "
        f"(peak so far {mib(middle.peak_rss_kib)}), "
        f"end {mib(end.rss_kib)}"
    )

    g0, g = baseline.gauges, end.gauges
    checks = [
        ("replies whose text differs from the engine's: 0", problems["text"] == 0),
        ("replies that ended in a way their kind does not allow: 0", problems["ending"] == 0),
        (
            f"slow readers whose connection the server let go within {SLOW_WAIT_S:g} s: "
            f"{by_kind['slow'] - problems['held']}/{by_kind['slow']}",
            problems["held"] == 0,
        ),
        (
            f"open tasks back to baseline ({g['tasks']:.0f} <= {g0['tasks']:.0f})",
            g["tasks"] <= g0["tasks"],
        ),
        (
            f"file descriptors back to baseline ({end.fds} <= {baseline.fds})",
            end.fds <= baseline.fds,
        ),
        (f"KV blocks in use: {g.get('kv_blocks', 0):.0f}", g.get("kv_blocks", 0) == 0),
        (
            f"replies in flight {g['in_flight']:.0f}, readers {g['readers']:.0f}, engine "
            f"requests {g['engine_requests']:.0f}",
            g["in_flight"] + g["readers"] + g["engine_requests"] == 0,
        ),
        (
            f"reply logs kept: {g['local_logs']:.0f} + {g.get('resumable_logs', 0):.0f} resumable",
            g["local_logs"] + g.get("resumable_logs", 0) == 0,
        ),
        (
            f"expired resumable replies answer 404: {len(resumable_ids) - not_expired}/"
            f"{len(resumable_ids)}",
            not_expired == 0,
        ),
        (
            f"RSS at the end over the peak before the middle, after a second half of "
            f"{replies_after} replies and {slow_after} slow readers: "
            f"{(end.rss_kib - middle.peak_rss_kib) / 1024:+.1f} MiB "
            f"(allowed: +{mib(allowed)}{bursts_allowed})",
            end.rss_kib - middle.peak_rss_kib <= allowed,
        ),
    ]
    failed = 0
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")
        failed += not ok
    for why, where in list(examples.items())[:10]:
        print(f"    e.g. {why} ({where})")
    return 1 if failed else 0


if __name__ == "__main__":
    tool_main(lambda: asyncio.run(main()))
