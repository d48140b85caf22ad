"""replystream's clients as a library: a program written against what the docs name, checked
by ``mypy --strict`` against the package (which ships ``py.typed``) as its user's would be."""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

import replystream

SOURCE = Path(replystream.__file__).parent

# The docs' reader (docs/api.md), left early and closed at once with ``aclosing`` (rather
# than when the collector comes by), a timed reply, and the parser fed by hand.
PROGRAM = """
from __future__ import annotations

import contextlib

from replystream.client import (
    Backoff, ReplyTiming, ResumeFailed, ResumingReader, measure_reply,
)
from replystream.sse import Event, EventParser, EventTooLarge, SSEError, encode


async def first_events(url: str, n: int) -> list[Event]:
    reader = ResumingReader(
        f"{url}/v1/replies",
        json_body={"prompt": "Hi", "resumable": True},
        headers={"Authorization": "Bearer sk-one"},
        backoff=Backoff(server_wait_cap_s=10.0),
    )
    got: list[Event] = []
    try:
        async with contextlib.aclosing(reader.events()) as events:
            async for event in events:
                got.append(event)
                if len(got) == n:
                    break
    except ResumeFailed:
        return []
    return got


async def timed(url: str) -> ReplyTiming:
    return await measure_reply(f"{url}/v1/replies", method="POST", json_body={"prompt": "Hi"})


def waits(timing: ReplyTiming) -> tuple[float | None, float | None, float | None]:
    return timing.headers_ms, timing.first_chunk_ms, timing.first_text_ms


def parsed(raw: bytes) -> list[Event]:
    parser = EventParser()
    try:
        return parser.feed(raw) + parser.feed(encode(Event("x")))
    except (EventTooLarge, SSEError):
        return []
"""


def test_a_program_using_the_documented_client_names_type_checks_strictly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (SOURCE / "py.typed").is_file()
    program = tmp_path / "user.py"
    program.write_text(PROGRAM)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n")
    # This checkout's package, found before any installed copy.
    monkeypatch.setenv("MYPYPATH", str(SOURCE.parent))
    report, errors, status = api.run(
        ["--strict", "--config-file", str(config), "--cache-dir", str(tmp_path), str(program)]
    )
    assert status == 0, report + errors
