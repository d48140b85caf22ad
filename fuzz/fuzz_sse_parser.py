"""Fuzz `replystream.sse.EventParser` against a literal reading of the WHATWG standard.

What one input means: byte 0 picks ``max_event_size`` (below 128: the default 1 MiB; else
4 to 512 characters), byte 1 seeds where the stream is cut into chunks, the rest is the
stream. For every input the parser must:
- raise nothing but `EventTooLarge`, and raise it in every chunking or in none;
- give the same events, last event ID, retry and "discarded an incomplete event" whether the
  stream is fed whole, in random chunks or (up to 512 bytes) one byte at a time;
- give exactly what `tests.whatwg_reference.interpret` gives, when it does not raise;
- raise only if the pending event really passed the limit, and always if a complete line did.

Run with atheris (coverage-guided; libFuzzer flags pass through):

    python fuzz/fuzz_sse_parser.py fuzz/corpus/sse_parser -max_total_time=60

Without atheris, the same checks run in a random-mutation loop over the seed corpus (no
coverage guidance, so it explores far less):

    python fuzz/fuzz_sse_parser.py --mutate --seconds 60 [--seed N]

Either way, naming files (not directories) replays just those inputs.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).resolve().parent / "corpus" / "sse_parser"
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

try:
    import atheris  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # the fallback loop below needs nothing but the standard library
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["replystream.sse"]):
        from replystream.sse import Event, EventParser, EventTooLarge
else:
    from replystream.sse import Event, EventParser, EventTooLarge

from tests.whatwg_reference import interpret, pending_peaks  # noqa: E402

MAX_LEN = 4096
# What the mutation loop splices in: the pieces that matter to the format.
PIECES = [
    b"data",
    b"event",
    b"id",
    b"retry",
    b":",
    b" ",
    b"\r",
    b"\n",
    b"\r\n",
    b"\0",
    b"\xef\xbb\xbf",
    b"\xff",
    b"\xc3",
    b"\xe2\x82\xac",
    b"\xf0\x9f\x98\x80",
    b"\xed\xa0\x80",
    b"0123456789",
]

Events = list[tuple[str, str, str | None]]
Outcome = tuple[Events, tuple[str, str], int | None, bool] | None


def decode_input(data: bytes) -> tuple[int, list[int], bytes]:
    """(max_event_size, cut points, stream) for one fuzz input."""
    if len(data) < 2:
        return 1 << 20, [], data
    max_event_size = 1 << 20 if data[0] < 128 else (data[0] - 127) * 4
    stream = data[2:]
    chooser = random.Random(data[1])
    cuts = sorted(chooser.randrange(len(stream) + 1) for _ in range(chooser.randrange(17)))
    return max_event_size, cuts, stream


def parse(pieces: list[bytes], max_event_size: int) -> Outcome:
    """Events, last event ID string and buffer, retry and discarded-incomplete; None if
    `EventTooLarge`."""
    parser = EventParser(max_event_size=max_event_size)
    events: list[Event] = []
    try:
        for piece in pieces:
            events += parser.feed(piece)
    except EventTooLarge:
        if not parser.closed:
            raise AssertionError("EventTooLarge left the parser open") from None
        return None
    parser.close()
    found: Events = [(event.type, event.data, event.id) for event in events]
    ids = parser.last_event_id, parser.last_event_id_buffer
    return found, ids, parser.retry, parser.discarded_incomplete


def reference(stream: bytes) -> Outcome:
    result = interpret(stream)
    events: Events = [(e.type, e.data, e.last_event_id) for e in result.events]
    ids = result.last_event_id_string, result.last_event_id_buffer
    return events, ids, result.reconnection_time, result.discarded_incomplete


def check(data: bytes) -> None:
    """Every rule in the module docstring, for one input; raises AssertionError on a finding."""
    max_event_size, cuts, stream = decode_input(data)
    whole = parse([stream], max_event_size)
    edges = [0, *cuts, len(stream)]
    chunked = parse([stream[a:b] for a, b in itertools.pairwise(edges)], max_event_size)
    if chunked != whole:
        raise AssertionError(f"chunking {cuts} changed the result: {chunked!r} != {whole!r}")
    if len(stream) <= 512:
        bytewise = parse([stream[i : i + 1] for i in range(len(stream))], max_event_size)
        if bytewise != whole:
            raise AssertionError(f"bytewise feeding changed the result: {bytewise!r}")
    complete_peak, peak_with_partial = pending_peaks(stream)
    if whole is None:
        if peak_with_partial <= max_event_size:
            raise AssertionError(f"EventTooLarge under the limit ({peak_with_partial})")
        return
    if complete_peak > max_event_size:
        raise AssertionError(f"no EventTooLarge at {complete_peak} > {max_event_size}")
    expected = reference(stream)
    if whole != expected:
        raise AssertionError(f"differs from the standard: {whole!r} != {expected!r}")


def test_one_input(data: bytes) -> None:
    check(data)


def mutate(data: bytes, corpus: list[bytes], rng: random.Random) -> bytes:
    """A few random edits: flip, insert, delete, duplicate, splice, or insert an SSE piece."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        where = rng.randint(0, len(out))
        choice = rng.randrange(6)
        if choice == 0 and out:
            out[min(where, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif choice == 1:
            out[where:where] = bytes([rng.randrange(256)])
        elif choice == 2:
            del out[where : where + rng.randint(1, 8)]
        elif choice == 3:
            out[where:where] = out[where : where + rng.randint(1, 32)]
        elif choice == 4:
            other = rng.choice(corpus)
            start = rng.randint(0, len(other))
            out[where:where] = other[start : start + rng.randint(1, 64)]
        else:
            out[where:where] = rng.choice(PIECES)
    return bytes(out[:MAX_LEN])


def mutation_loop(seconds: float, runs: int | None, seed: int) -> int:
    """Random mutation of the seed corpus until time or runs are up; saves any crash input."""
    corpus = [path.read_bytes() for path in sorted(CORPUS.iterdir())] or [b""]
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    done = 0
    while time.monotonic() < deadline and (runs is None or done < runs):
        data = mutate(rng.choice(corpus), corpus, rng)
        try:
            check(data)
        except Exception:
            crash = Path(f"crash-sse-parser-{seed}-{done}")
            crash.write_bytes(data)
            print(f"finding after {done} inputs, saved to {crash}", file=sys.stderr)
            raise
        if rng.random() < 0.01:
            corpus.append(data)  # no coverage signal: keep a few inputs to build on
        done += 1
    print(f"{done} inputs, no finding (seed {seed})")
    return done


def main(argv: list[str]) -> None:
    replay = [Path(arg) for arg in argv[1:] if not arg.startswith("-") and Path(arg).is_file()]
    if atheris is not None and "--mutate" not in argv:
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return
    if replay:
        for path in replay:
            check(path.read_bytes())
            print(f"{path}: ok")
        return
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--mutate", action="store_true", help="use the random-mutation loop")
    options.add_argument("--seconds", type=float, default=60.0)
    options.add_argument("--runs", type=int, default=None)
    options.add_argument("--seed", type=int, default=int(time.time()))
    args = options.parse_args(argv[1:])
    mutation_loop(args.seconds, args.runs, args.seed)


if __name__ == "__main__":
    main(sys.argv)
