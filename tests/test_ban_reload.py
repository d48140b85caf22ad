"""``--ban-file`` read again on SIGHUP, in real processes, as the keys and routes files are.

``replystream serve --engine simulated`` answers every request with the same words; its ban
list is edited and the server signalled: a new reply with a phrase added is stopped as
moderated, on every worker of ``--workers 2``; a reply under way when the list changes is
stopped too, before the phrase leaves; a file that cannot be taken keeps the list served
before, said in one line and counted failed; and a worker started again in a dead one's
place after an edit nobody signalled enforces the same list as the one beside it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from replystream.sse import EventParser
from tests.processes import StderrLines, serving_with_stderr
from tests.test_gateway_workers import pin_each_worker
from tests.test_reload import get, samples
from tests.test_workers import children_of

pytestmark = pytest.mark.slow

WORDS = "the falcon flies at dawn"
PHRASE = "falcon flies"
ASK = {"prompt": "x", "stream": False}


@contextlib.asynccontextmanager
async def banning(
    bans: Path, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, StderrLines]]:
    """A simulated server whose every reply is ``WORDS`` (a word a token), its banned phrases
    in ``bans``, ready."""
    async with serving_with_stderr(
        "--engine", "simulated", "--reply-text", WORDS, "--delay-ms", "1", "--jitter-ms", "0",
        "--ban-file", str(bans), "--holdback-tokens", "4", *args,
    ) as served:  # fmt: skip
        yield served


async def endings_by_worker(url: str, pids: list[int]) -> dict[int, tuple[str, str]]:
    """The finish reason and text of one whole reply made by each of ``pids``."""
    endings = {}
    async with pin_each_worker(url, pids) as pinned:
        for pid, worker in pinned.items():
            status, body = await worker.request("POST", "/v1/replies", ASK)
            assert status == 200, body
            answer = json.loads(body)
            endings[pid] = answer["finish_reason"], answer["text"]
    return endings


def ban_reloads(text: str, result: str) -> float:
    return samples(text)["replystream_reloads_total", (("file", "ban"), ("result", result))]


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_phrase_added_to_the_ban_file_stops_new_replies_after_sighup(
    tmp_path: Path, workers: int
):
    bans = tmp_path / "bans.txt"
    bans.write_text("nothing said here\n")
    async with banning(bans, "--workers", str(workers)) as (process, url, stderr):
        pids = children_of(process.pid) if workers > 1 else [process.pid]
        assert set((await endings_by_worker(url, pids)).values()) == {("stop", WORDS + " ")}
        bans.write_text(f"nothing said here\n{PHRASE.upper()}\n")
        process.send_signal(signal.SIGHUP)
        said = await stderr.wait_for("banned phrases reloaded", count=workers)
        assert f"from {bans}: 2 phrases" in said[0], said
        # Every worker, whichever a connection lands on, stops the reply before the phrase.
        assert set((await endings_by_worker(url, pids)).values()) == {("moderated", "the ")}
        _, text = await get(f"{url}/metrics")
        assert (ban_reloads(text, "ok"), ban_reloads(text, "failed")) == (workers, 0)

        # A file that cannot be taken changes nothing, and says why.
        bans.write_bytes(b"dawn\n\xff\n")
        process.send_signal(signal.SIGHUP)
        [line, *_] = await stderr.wait_for("ban not reloaded", count=workers)
        assert "what was served before stays" in line, line
        assert f"--ban-file {bans}: not UTF-8 text (byte 0xff at offset 5" in line, line
        bans.write_text("\n \n")  # no phrase: moderation would be off
        process.send_signal(signal.SIGHUP)
        [*_, line] = await stderr.wait_for("ban not reloaded", count=2 * workers)
        assert f"--ban-file {bans}: no phrase in it (every line is blank)" in line, line
        assert set((await endings_by_worker(url, pids)).values()) == {("moderated", "the ")}
        _, text = await get(f"{url}/metrics")
        assert (ban_reloads(text, "ok"), ban_reloads(text, "failed")) == (workers, 2 * workers)
        assert process.returncode is None
        assert not any("Traceback" in line for line in stderr.lines), stderr.lines


async def test_a_reply_under_way_takes_the_new_list_before_the_phrase_leaves(tmp_path: Path):
    """A phrase banned because it leaked must stop leaking at once: a reply that began
    before the reload is read by the new list from then on."""
    script = tmp_path / "reply.json"
    steps: list[dict[str, object]] = [
        {"text": f"{w} "} for w in "one two three four five six".split()
    ]
    # The phrase comes after a pause, long after the reload the test sends.
    steps += [{"text": "the ", "delay_ms": 4000}, {"text": "falcon "}, {"text": "flies "}]
    steps += [{"text": "at "}, {"text": "dawn"}]
    script.write_text(json.dumps(steps))
    bans = tmp_path / "bans.txt"
    bans.write_text("nothing said here\n")
    async with serving_with_stderr(
        "--engine", "simulated", "--reply-script", str(script), "--delay-ms", "1",
        "--jitter-ms", "0", "--ban-file", str(bans), "--holdback-tokens", "2",
    ) as (process, url, stderr):  # fmt: skip
        parser = EventParser()
        text, types, reloaded = "", [], False
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/replies", json={"prompt": "x"}) as response,
        ):
            async for chunk in response.content.iter_any():
                for event in parser.feed(chunk):
                    types.append(event.type)
                    if event.type == "token":
                        text += json.loads(event.data)["text"]
                if "four" in text and not reloaded:  # the phrase is seconds away
                    bans.write_text(f"{PHRASE}\n")
                    process.send_signal(signal.SIGHUP)
                    await stderr.wait_for("banned phrases reloaded")
                    reloaded = True
        assert types[-1] == "moderated" and "done" not in types, types
        assert text == "one two three four five six the ", text


async def test_a_worker_started_again_after_an_unsignalled_edit_enforces_its_siblings_list(
    tmp_path: Path,
):
    """The file is edited and nobody signals; then a worker dies. The one started in its
    place read the file as it is now: the one beside it enforced the list read at start,
    and each request was moderated or not as its connection landed."""
    bans = tmp_path / "bans.txt"
    bans.write_text("nothing said here\n")
    async with banning(bans, "--workers", "2") as (process, url, stderr):
        bans.write_text(f"nothing said here\n{PHRASE}\n")
        first = children_of(process.pid)
        os.kill(first[0], signal.SIGKILL)
        await stderr.wait_for("in place of one that exited")
        with contextlib.suppress(TimeoutError):  # (else what each enforces says how they differ)
            await stderr.wait_for("banned phrases reloaded", count=2)
        now = children_of(process.pid)
        assert first[0] not in now and first[1] in now
        endings = await endings_by_worker(url, now)
        assert set(endings.values()) == {("moderated", "the ")}, endings
        assert not any("Traceback" in line for line in stderr.lines), stderr.lines
