"""``serve``'s files read again on SIGHUP, in real processes.

The relay's routes: ``replystream serve --engine simulated`` upstreams, each answering its own
words under its own model name, and the relay ``replystream serve --engine upstream
--upstream-routes FILE`` (on one process, and with ``--workers 2``). A reload moves new
requests to the new routes while a reply under way at an upstream taken out goes on to its
end; a file with a mistake changes nothing, in one log line; ``/v1/models`` and ``/metrics``
follow the routes. The API keys: ``--api-keys-file`` read again, a revoked key refused from
then on, a new one let in, a file with no key changing nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import StderrLines, launch, ready_url, replica, serving_with_stderr, stop
from tests.sse_client import post_events
from tests.test_gateway_workers import Samples, pin_each_worker
from tests.test_workers import children_of

pytestmark = pytest.mark.slow


def upstream(words: str, model: str, delay_ms: str = "1") -> tuple[str, ...]:
    """An upstream whose every reply is ``words`` (one token each), serving ``model``."""
    return (
        "--engine", "simulated", "--reply-text", words, "--model-name", model,
        "--delay-ms", delay_ms, "--jitter-ms", "0",
    )  # fmt: skip


def routes(*entries: tuple[str, str], aliases: dict[str, str] | None = None) -> str:
    """A routes file of ``(url, model)`` upstreams."""
    text = "".join(
        f'[[upstreams]]\nurl = "{url}/v1"\nmodels = ["{model}"]\n\n' for url, model in entries
    )
    if aliases:
        text += "[aliases]\n" + "".join(f'"{a}" = "{m}"\n' for a, m in aliases.items())
    return text


async def ask(url: str, model: str) -> str:
    """The whole text of one streamed chat reply."""
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    got = await post_events(f"{url}/v1/chat/completions", body)
    assert got.status == 200, got.raw
    text = ""
    for event in got.events:
        if event.data != "[DONE]":
            for choice in json.loads(event.data)["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def upstreams_shown(seen: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """Which upstreams a scrape has rows of, in any family."""
    return {value for _, labels in seen for label, value in labels if label == "upstream"}


async def wait_for_outstanding(url: str, upstream: str, timeout_s: float = 20.0) -> None:
    """Until the relay at ``url`` says a request is under way at ``upstream``."""
    row = ("replystream_upstream_outstanding", (("upstream", upstream),))
    async with asyncio.timeout(timeout_s):
        while samples((await get(f"{url}/metrics"))[1]).get(row, 0.0) < 1:  # noqa: ASYNC110  (another process)
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def relay(
    routes_file: Path, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, StderrLines]]:
    async with serving_with_stderr(
        "--engine", "upstream", "--upstream-routes", str(routes_file), *args
    ) as served:  # fmt: skip
        yield served


async def test_a_reload_moves_new_requests_and_the_reply_under_way_ends_whole(tmp_path: Path):
    async with (
        replica(*upstream("alpha " * 3, "model-a")) as (_, a),
        replica(*upstream("slow " * 40, "model-s", delay_ms="100")) as (_, slow),
        replica(*upstream("beta " * 3, "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a"), (slow, "model-s")))
        async with relay(file) as (process, url, stderr):
            assert await ask(url, "model-a") == "alpha " * 3
            # A reply at an upstream about to be taken out: about four seconds long.
            under_way = asyncio.create_task(ask(url, "model-s"))
            await wait_for_outstanding(url, f"{slow}/v1")
            file.write_text(routes((b, "model-b"), aliases={"model-a": "model-b"}))
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes reloaded")
            assert f"added {b}/v1" in line and f"removed {a}/v1, {slow}/v1" in line, line
            assert "1 upstream (" in line and "1 alias" in line, line
            # The old name is now an alias of the new upstream's model; the old upstreams get
            # nothing new.
            assert await ask(url, "model-a") == "beta " * 3
            assert await ask(url, "model-b") == "beta " * 3
            status, listing = await get(f"{url}/v1/models")
            assert status == 200
            assert [m["id"] for m in json.loads(listing)["data"]] == ["model-b", "model-a"]
            assert not under_way.done()  # it was still under way when the routes changed
            assert await under_way == "slow " * 40  # whole: nothing cut at the reload

            status, text = await get(f"{url}/metrics")
            seen = samples(text)
            # In every family (the first-text histogram was scraped with a's rows before).
            assert upstreams_shown(seen) == {f"{b}/v1"}
            assert seen["replystream_reloads_total", (("file", "routes"), ("result", "ok"))] == 1


async def test_a_file_with_a_mistake_changes_nothing_and_says_why(tmp_path: Path):
    async with (
        replica(*upstream("alpha", "model-a")) as (_, a),
        replica(*upstream("beta", "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        async with relay(file) as (process, url, stderr):
            file.write_text(routes((b, "model-b")).replace('models = ["model-b"]', "weight = 0"))
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes not reloaded")
            assert f"--upstream-routes {file}: upstreams[0].weight:" in line, line
            file.write_text("[[upstreams]\n")  # not TOML
            process.send_signal(signal.SIGHUP)
            lines = await stderr.wait_for("routes not reloaded", count=2)
            assert "not valid TOML" in lines[1], lines
            assert await ask(url, "model-a") == "alpha "  # the routes served before
            _, text = await get(f"{url}/metrics")
            seen = samples(text)
            assert (
                seen["replystream_reloads_total", (("file", "routes"), ("result", "failed"))] == 2
            )
            assert seen["replystream_reloads_total", (("file", "routes"), ("result", "ok"))] == 0
            # Fixed, it is taken.
            file.write_text(routes((b, "model-b")))
            process.send_signal(signal.SIGHUP)
            await stderr.wait_for("routes reloaded")
            assert await ask(url, "model-b") == "beta "
            assert not any("Traceback" in line for line in stderr.lines), stderr.lines


NESTED = '[[upstreams]]\nurl = "http://127.0.0.1:1/v1"\nx = ' + "[" * 5000 + "]" * 5000 + "\n"


async def test_a_routes_file_nested_too_deeply_is_one_line_at_start_and_at_reload(
    tmp_path: Path,
):
    """TOML's parser recurses into each nested array: a file nested thousands deep (a
    generated one gone wrong) stopped the start with a RecursionError's traceback, and a
    reload logged one of some thousand lines."""
    deep = tmp_path / "deep.toml"
    deep.write_text(NESTED)
    started = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "replystream", "serve", "--port", "0", "--engine", "upstream",
         "--upstream-routes", str(deep)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert started.stderr.splitlines() == [
        f"replystream serve: --upstream-routes {deep}: not valid TOML (nested too deeply)"
    ]
    async with replica(*upstream("alpha", "model-a")) as (_, a):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        async with relay(file) as (process, url, stderr):
            file.write_text(NESTED)
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes not reloaded")
            assert line.endswith(f"--upstream-routes {file}: not valid TOML (nested too deeply)\n")
            assert await ask(url, "model-a") == "alpha "  # the routes served before
            assert not any("Traceback" in line for line in stderr.lines), stderr.lines[:3]


async def test_a_reload_that_leaves_the_server_unready_says_so(tmp_path: Path):
    """Routes that no longer list the model ``--upstream-model`` names make ``/healthz`` 503
    (a load balancer takes the server out): a start with them says so, a reload said only
    "routes reloaded"."""
    async with (
        replica(*upstream("alpha", "model-a")) as (_, a),
        replica(*upstream("beta", "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        async with relay(file, "--upstream-model", "model-a") as (process, url, stderr):
            assert (await get(f"{url}/healthz"))[0] == 200
            file.write_text(routes((b, "model-b")))
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes reloaded")
            assert line.endswith(
                "0 aliases; the engine is not ready: no upstream serves the model 'model-a' "
                "(--upstream-model, what a request that names no model is sent as): they "
                "serve 'model-b'; /healthz answers 503\n"
            ), line
            assert (await get(f"{url}/healthz"))[0] == 503
            file.write_text(routes((b, "model-b"), aliases={"model-a": "model-b"}))
            process.send_signal(signal.SIGHUP)
            [_, line] = await stderr.wait_for("routes reloaded", count=2)
            assert line.endswith("1 alias\n"), line  # ready again: nothing more said
            assert (await get(f"{url}/healthz"))[0] == 200


async def test_a_routes_file_dropping_the_last_limit_is_taken_and_the_idle_flag_said(
    tmp_path: Path,
):
    """``--upstream-queue-s`` with no limit of requests at once to wait under is refused at
    start; a reload (which cannot change the command line) of a sound file dropping the last
    limit was refused for it, and the old limit stayed."""
    async with replica(*upstream("alpha", "model-a")) as (_, a):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")) + "max_outstanding = 1\n")
        async with relay(file, "--upstream-queue-s", "5") as (process, url, stderr):
            assert await ask(url, "model-a") == "alpha "
            file.write_text(routes((a, "model-a")))
            process.send_signal(signal.SIGHUP)
            [said] = await stderr.wait_for("until then it does nothing")
            await stderr.wait_for("routes reloaded")
            seen = samples((await get(f"{url}/metrics"))[1])
            limit = seen["replystream_upstream_max_outstanding", (("upstream", f"{a}/v1"),)]
            assert limit == -1  # none now
            assert await ask(url, "model-a") == "alpha "
    assert f"{file}: until then it does nothing (--upstream-queue-s is how long" in said, said


async def test_every_worker_reloads_on_one_signal_to_the_parent(tmp_path: Path):
    async with (
        replica(*upstream("alpha", "model-a")) as (_, a),
        replica(*upstream("beta", "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        async with relay(file, "--workers", "2") as (process, url, stderr):
            # Both workers serve it once: rows for it are in their shared metrics files.
            assert await asyncio.gather(*(ask(url, "model-a") for _ in range(6))) == ["alpha "] * 6
            file.write_text(routes((b, "model-b")))
            process.send_signal(signal.SIGHUP)
            await stderr.wait_for("routes reloaded", count=2)
            # New connections land on either worker: every one is served by the new routes.
            replies = await asyncio.gather(*(ask(url, "model-b") for _ in range(12)))
            assert replies == ["beta "] * 12
            status, _ = await get(f"{url}/healthz")
            assert status == 200
            for _ in range(4):  # either worker's answer: the two counted as one
                seen = samples((await get(f"{url}/metrics"))[1])
                key = "replystream_reloads_total", (("file", "routes"), ("result", "ok"))
                assert seen[key] == 2
                # The upstream taken out has no row left, in any family.
                assert upstreams_shown(seen) == {f"{b}/v1"}
            # A worker started after the reload never had it; the files of the one it
            # replaces still hold its rows: none is shown either.
            workers = children_of(process.pid)
            os.kill(workers[0], signal.SIGKILL)
            await stderr.wait_for("starting another in")
            async with asyncio.timeout(20):
                while workers[0] in children_of(process.pid) or len(children_of(process.pid)) < 2:  # noqa: ASYNC110  (another process)
                    await asyncio.sleep(0.05)
            await stderr.wait_for("in place of one that exited")
            async with pin_each_worker(url, children_of(process.pid)) as pinned:
                for worker in pinned.values():  # the new one's scrape, and the other's
                    assert upstreams_shown(await worker.scrape()) == {f"{b}/v1"}


async def scraped_by_each(url: str, process: asyncio.subprocess.Process) -> list[Samples]:
    """A scrape through each worker, once each has written its readings (as it answers a
    scrape): what both count now, read by either."""
    async with pin_each_worker(url, children_of(process.pid)) as pinned:
        for worker in pinned.values():
            await worker.scrape()
        return [await worker.scrape() for worker in pinned.values()]


async def test_an_upstream_taken_out_and_put_back_keeps_its_first_text_counts_with_workers(
    tmp_path: Path,
):
    # The relay keeps the counts of an upstream taken out, and counts on from them when it
    # comes back; each worker writes its histogram into the shared files as what changed
    # since it last wrote. An upstream put back was once written again whole on top of what
    # the files held: its first texts were counted twice.
    async with (
        replica(*upstream("alpha", "model-a")) as (_, a),
        replica(*upstream("beta", "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        both = routes((a, "model-a"), (b, "model-b"))
        file.write_text(both)
        at_a = (("upstream", f"{a}/v1"),)
        first_texts = "replystream_upstream_time_to_first_token_seconds_count", at_a
        sent = "replystream_upstream_attempts", (("result", "ok"), *at_a)
        async with relay(file, "--workers", "2") as (process, url, stderr):
            assert await asyncio.gather(*(ask(url, "model-a") for _ in range(6))) == ["alpha "] * 6
            for seen in await scraped_by_each(url, process):
                assert (seen[sent], seen[first_texts]) == (6, 6)
            file.write_text(routes((b, "model-b")))
            process.send_signal(signal.SIGHUP)
            await stderr.wait_for("routes reloaded", count=2)
            for seen in await scraped_by_each(url, process):
                assert f"{a}/v1" not in upstreams_shown(seen)
            file.write_text(both)
            process.send_signal(signal.SIGHUP)
            await stderr.wait_for("routes reloaded", count=4)
            for seen in await scraped_by_each(url, process):
                assert (seen[sent], seen[first_texts]) == (6, 6)


async def status_with(url: str, key: str) -> int:
    """The status of a small chat request made with ``key``."""
    body = {"model": "simulated", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response,
    ):
        await response.read()
        return response.status


@contextlib.asynccontextmanager
async def keyed(
    keys: Path, *args: str
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, StderrLines]]:
    """A simulated server reading its API keys from ``keys`` (``args``: more flags), ready."""
    async with serving_with_stderr(
        *upstream("hello", "simulated"), "--api-keys-file", str(keys), *args
    ) as served:  # fmt: skip
        yield served


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_api_keys_file_read_again_revokes_and_grants_keys(tmp_path: Path, workers: int):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nsk-old\n")
    flags = ("--api-key", "sk-flag", "--workers", str(workers))
    async with keyed(keys, *flags) as (process, url, stderr):
        assert [await status_with(url, k) for k in ("sk-old", "sk-new")] == [200, 401]
        keys.write_text("sk-new\n")
        process.send_signal(signal.SIGHUP)
        said = await stderr.wait_for("API keys reloaded", count=workers)
        assert f"from {keys}: 2 keys" in said[0], said  # the flag's key stays
        for _ in range(4):  # new connections: whichever worker takes them
            assert [await status_with(url, k) for k in ("sk-old", "sk-new", "sk-flag")] == [
                401,
                200,
                200,
            ]
        keys.write_text("# nobody\n")  # a file with no key: what was served before stays
        process.send_signal(signal.SIGHUP)
        [line, *_] = await stderr.wait_for("api_keys not reloaded", count=workers)
        assert f"{keys}: no API keys in the file" in line, line
        assert await status_with(url, "sk-new") == 200
        _, text = await get(f"{url}/metrics")
        seen = samples(text)
        assert (
            seen["replystream_reloads_total", (("file", "api_keys"), ("result", "ok"))] == workers
        )
        assert not any("Traceback" in line for line in stderr.lines), stderr.lines


async def test_a_revoked_key_is_refused_before_new_upstreams_are_probed(tmp_path: Path):
    """The keys file is read again first: a new upstream that does not answer is probed for
    up to 2 s before the routes are taken, and a leaked key must not be let in meanwhile."""
    async with replica(*upstream("alpha", "simulated")) as (_, a):
        dark = socket.create_server(("127.0.0.1", 0), backlog=16)  # takes, never answers
        with dark:
            dark_url = f"http://127.0.0.1:{dark.getsockname()[1]}"
            file, keys = tmp_path / "routes.toml", tmp_path / "keys.txt"
            file.write_text(routes((a, "simulated")))
            keys.write_text("sk-leaked\n")
            async with relay(file, "--api-keys-file", str(keys)) as (process, url, stderr):
                assert await status_with(url, "sk-leaked") == 200
                file.write_text(routes((a, "simulated"), (dark_url, "simulated")))
                keys.write_text("sk-new\n")
                process.send_signal(signal.SIGHUP)
                await stderr.wait_for("API keys reloaded")
                assert not any("routes reloaded" in line for line in stderr.lines), stderr.lines
                assert await status_with(url, "sk-leaked") == 401
                await stderr.wait_for("routes reloaded")


BOM = "\ufeff"  # what some Windows editors write at the start of a UTF-8 file


async def test_files_saved_with_a_byte_order_mark_are_read_at_start_and_at_reload(
    tmp_path: Path,
):
    """A routes file beginning with a byte-order mark was refused as "not valid TOML (Invalid
    statement (at line 1, column 1))", where the operator sees nothing; a keys file's first key
    as having a character no header carries ('\\ufeff')."""
    async with (
        replica(*upstream("alpha", "simulated")) as (_, a),
        replica(*upstream("beta", "simulated")) as (_, b),
    ):
        file, keys = tmp_path / "routes.toml", tmp_path / "keys.txt"
        file.write_text(BOM + routes((a, "simulated")), encoding="utf-8")
        keys.write_text(BOM + "sk-one\n", encoding="utf-8")
        async with relay(file, "--api-keys-file", str(keys)) as (process, url, stderr):
            assert await status_with(url, "sk-one") == 200
            file.write_text(BOM + routes((b, "simulated")), encoding="utf-8")
            keys.write_text(BOM + "sk-two\n", encoding="utf-8")
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes reloaded")
            assert f"from {file}: 1 upstream (added {b}/v1; removed {a}/v1)" in line, line
            [line] = await stderr.wait_for("API keys reloaded")
            assert f"from {keys}: 1 key" in line, line
            assert [await status_with(url, k) for k in ("sk-one", "sk-two")] == [401, 200]


async def test_a_worker_restarted_on_a_file_its_peers_refused_waits_for_it_and_they_serve_on(
    tmp_path: Path,
):
    """The keys file is emptied and the reload refused ("what was served before stays"); then
    a worker dies: its restart reads the empty file and refuses to start. That stopped the
    whole server, cutting every stream of the worker still serving."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-one\n")
    async with keyed(keys, "--workers", "2") as (process, url, stderr):
        keys.write_text("# nobody\n")
        process.send_signal(signal.SIGHUP)
        await stderr.wait_for("api_keys not reloaded", count=2)
        workers = children_of(process.pid)
        os.kill(workers[0], signal.SIGKILL)
        [line] = await stderr.wait_for("the other workers go on serving")
        assert "refused to start" in line and "trying again in" in line, line
        assert process.returncode is None
        for _ in range(4):  # whichever connection lands: the worker left serves it
            assert await status_with(url, "sk-one") == 200
        keys.write_text("sk-one\n")  # fixed: the next try starts
        await stderr.wait_for("in place of one that exited")
        assert len(children_of(process.pid)) == 2
        assert not any("Traceback" in line for line in stderr.lines), stderr.lines


async def test_an_api_keys_file_read_again_in_vain_is_named_with_its_flag(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-one\n")
    async with keyed(keys) as (process, url, stderr):
        keys.write_bytes(b"sk-\xff\xfe\n")  # not UTF-8
        process.send_signal(signal.SIGHUP)
        [line] = await stderr.wait_for("api_keys not reloaded")
        assert f"--api-keys-file {keys}: not UTF-8 text (byte 0xff at offset 3" in line, line
        keys.unlink()
        process.send_signal(signal.SIGHUP)
        [_, line] = await stderr.wait_for("api_keys not reloaded", count=2)
        assert f"--api-keys-file {keys}: cannot be read (No such file or directory)" in line
        assert await status_with(url, "sk-one") == 200  # what was served before stays
        assert not any("Traceback" in line for line in stderr.lines), stderr.lines


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_sighup_while_serve_starts_does_not_stop_it(tmp_path: Path, workers: int):
    """``systemctl reload`` right after a start: the signals come while serve imports and
    reads its settings, before it listens."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-one\n")
    process = await launch(
        *upstream("hello", "simulated"), "--api-keys-file", str(keys),
        "--workers", str(workers), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        for pause in (0.4, 0.3):
            await asyncio.sleep(pause)
            assert process.returncode is None
            process.send_signal(signal.SIGHUP)
        url = await ready_url(process)
        assert await status_with(url, "sk-one") == 200
    finally:
        await stop(process)


async def test_a_sighup_after_serve_read_its_file_is_served_once_it_listens(tmp_path: Path):
    """The keys file is read early in a start; a key revoked in it after that, and SIGHUP sent
    (a leaked key, and a server that happened to be starting), was ignored with the signal:
    the server served the file as read before the edit, the revoked key let in. The start is
    held at a known point after the file was read: its first contact with Redis, at a
    stand-in that answers only once the test has edited the file and signalled."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-old\n")
    contacted = asyncio.Event()
    edited = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        contacted.set()
        await edited.wait()
        writer.close()  # not reached: serve says so and serves

    stand_in = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = stand_in.sockets[0].getsockname()[1]
    process = await launch(
        *upstream("hello", "simulated"), "--api-keys-file", str(keys),
        "--redis-url", f"redis://127.0.0.1:{port}/0", stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await asyncio.wait_for(contacted.wait(), 30)
        keys.write_text("sk-new\n")
        process.send_signal(signal.SIGHUP)  # delivered as it waits for Redis
        edited.set()
        url = await ready_url(process)
        stderr = StderrLines(process)
        [line] = await stderr.wait_for("API keys reloaded")
        assert f"from {keys}: 1 key" in line, line
        assert [await status_with(url, k) for k in ("sk-old", "sk-new")] == [401, 200]
    finally:
        stand_in.close()
        await stop(process)


async def test_with_no_file_to_read_again_sighup_stops_serve():
    process = await launch(*upstream("hello", "simulated"))
    try:
        await ready_url(process)
        process.send_signal(signal.SIGHUP)
        # Stopped as SIGTERM stops it: drained, exit 0 (not killed by the signal).
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        await stop(process)


async def test_a_dead_models_requests_go_on_to_its_fallback_until_a_reload_drops_it(
    tmp_path: Path,
):
    with socket.socket() as closed:  # a port nothing listens on: a dead upstream
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    async with replica(*upstream("beta " * 3, "model-b")) as (_, b):
        file = tmp_path / "routes.toml"
        both = routes((dead, "model-a"), (b, "model-b"))
        file.write_text(both + '[fallbacks]\n"model-a" = ["model-b"]\n')
        async with relay(file) as (process, url, stderr):
            assert await ask(url, "model-a") == "beta " * 3
            _, text = await get(f"{url}/metrics")
            assert samples(text)["replystream_upstream_fallbacks", ()] == 1
            file.write_text(both)
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes reloaded")
            assert line.rstrip().endswith("2 upstreams, 0 aliases"), line
            body = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}]}
            got = await post_events(f"{url}/v1/chat/completions", body)
            # Its connection refused (502), or, its circuit open by then, none to try (503).
            assert got.status in (502, 503), got.raw
            assert json.loads(got.raw)["error"]["code"] == "upstream_unavailable"


@contextlib.contextmanager
def open_files_at_most(most: int) -> Iterator[None]:
    """The processes started meanwhile may open ``most`` files (``ulimit -n``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_limit_past_the_files_workers_may_open_is_refused_and_they_serve_on(
    tmp_path: Path,
):
    """The workers hold an upstream's limit through a file per slot, each open in every
    worker: a reload raising the limit past ``ulimit -n`` took every descriptor the workers
    had, said "routes reloaded", and left them unable to accept a connection."""
    async with replica(*upstream("alpha", "model-a")) as (_, a):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        with open_files_at_most(1024):  # this process's too: its children's
            async with relay(file, "--workers", "2") as (process, url, stderr):
                file.write_text(routes((a, "model-a")) + "max_outstanding = 2000\n")
                process.send_signal(signal.SIGHUP)
                lines = await stderr.wait_for("routes not reloaded", count=2)
                assert f"{file}: upstreams[0].max_outstanding: with --workers" in lines[0], lines
                assert "the 1024 files a process may open (ulimit -n" in lines[0], lines
                replies = await asyncio.gather(*(ask(url, "model-a") for _ in range(6)))
                assert replies == ["alpha "] * 6
                assert not any("Traceback" in line for line in stderr.lines), stderr.lines


def test_a_limit_past_the_files_workers_may_open_stops_the_start_and_check_in_a_line() -> None:
    """Refused before any worker starts (a worker died of it, in a traceback), and by
    ``--check``, which said such a configuration was sound."""
    command = (
        sys.executable, "-m", "replystream", "serve", "--engine", "upstream:http://127.0.0.1:9/v1",
        "--upstream-max-outstanding", "2000", "--workers", "2", "--port", "0",
    )  # fmt: skip
    with open_files_at_most(1024):
        for check in ((), ("--check",)):
            done = subprocess.run([*command, *check], capture_output=True, text=True, timeout=30)
            assert done.returncode == 2, done
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
            assert done.stderr.startswith(
                "replystream serve: --upstream-max-outstanding: with --workers each worker keeps "
                "a file open per request an upstream may be sent at once, 2000 here, past half "
                "the 1024 files a process may open (ulimit -n;"
            ), done.stderr


async def test_a_request_waiting_for_room_at_an_upstream_taken_out_is_told_so(tmp_path: Path):
    """A request in line for an upstream at its limit, whose routes went with a reload: its
    503 said every circuit was open after repeated failures, and none was."""
    async with (
        replica(*upstream("slow " * 30, "model-s", delay_ms="100")) as (_, slow),
        replica(*upstream("beta", "model-b")) as (_, b),
    ):
        file = tmp_path / "routes.toml"
        file.write_text(routes((slow, "model-s")) + "max_outstanding = 1\n")
        async with relay(file, "--upstream-queue-s", "30") as (process, url, stderr):
            under_way = asyncio.create_task(ask(url, "model-s"))
            await wait_for_outstanding(url, f"{slow}/v1")
            body = {"model": "model-s", "messages": [{"role": "user", "content": "hi"}]}
            waiting = asyncio.create_task(post_events(f"{url}/v1/chat/completions", body))
            row = ("replystream_upstream_queued", ())
            async with asyncio.timeout(20):
                while samples((await get(f"{url}/metrics"))[1]).get(row, 0.0) < 1:  # noqa: ASYNC110  (another process)
                    await asyncio.sleep(0.05)
            file.write_text(routes((b, "model-b")))
            process.send_signal(signal.SIGHUP)
            await stderr.wait_for("routes reloaded")
            got = await waiting
            assert got.status == 503, got.raw
            error = json.loads(got.raw)["error"]
            assert error["code"] == "upstream_unavailable", error
            assert error["message"] == (
                "no upstream serving model-s is left: the routes changed while the request "
                "waited for room (or its upstreams list it no more)"
            ), error
            assert await under_way == "slow " * 30  # whole


async def test_a_file_replaced_by_a_pipe_is_refused_and_the_server_serves_on(tmp_path: Path):
    """Read in the event loop, a pipe in place of the routes file or the keys file waited
    for a writer: the whole server stopped answering, its replies stalled."""
    async with replica(*upstream("alpha", "model-a")) as (_, a):
        file = tmp_path / "routes.toml"
        file.write_text(routes((a, "model-a")))
        async with relay(file) as (process, url, stderr):
            file.unlink()
            os.mkfifo(file)
            process.send_signal(signal.SIGHUP)
            [line] = await stderr.wait_for("routes not reloaded")
            assert f"{file}: is not a regular file (a pipe, a device)" in line, line
            assert await ask(url, "model-a") == "alpha "
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-one\n")
    async with keyed(keys) as (process, url, stderr):
        keys.unlink()
        os.mkfifo(keys)
        process.send_signal(signal.SIGHUP)
        [line] = await stderr.wait_for("api_keys not reloaded")
        assert f"{keys}: is not a regular file (a pipe, a device)" in line, line
        assert await status_with(url, "sk-one") == 200


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_workers_close_the_slot_files_of_upstreams_a_reload_took_out(tmp_path: Path):
    """With ``--workers`` each limited upstream's slots are files every worker keeps open;
    those of an upstream taken out stayed open for good, so routes rewritten as upstreams
    come and go (a pod's address each) ran the workers out of descriptors."""
    async with (
        replica(*upstream("slow " * 30, "model-s", delay_ms="100")) as (_, slow),
        replica(*upstream("alpha", "model-a")) as (_, a),
    ):
        file = tmp_path / "routes.toml"
        limited = "max_outstanding = 200\n"
        file.write_text(routes((slow, "model-s")) + limited)
        async with relay(file, "--workers", "2") as (process, url, stderr):
            under_way = asyncio.create_task(ask(url, "model-s"))
            await wait_for_outstanding(url, f"{slow}/v1")
            workers = children_of(process.pid)
            before = {pid: open_files(pid) for pid in workers}
            for n in range(1, 4):  # each time another limited upstream, the last one gone
                file.write_text(routes((f"{a}/p{n}", "model-a")) + limited)
                process.send_signal(signal.SIGHUP)
                await stderr.wait_for("routes reloaded", count=2 * n)
            assert await under_way == "slow " * 30  # its slot kept to its end
            after = {pid: open_files(pid) for pid in workers}
            # One limited upstream's 200 files at most, not one set per upstream ever routed.
            assert all(after[pid] < before[pid] + 100 for pid in workers), (before, after)
