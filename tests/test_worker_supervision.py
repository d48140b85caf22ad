"""The parent of ``replystream serve --workers 2`` as an operator meets it: when it says it
listens, how it restarts a worker that keeps dying, and the metrics folder a killed parent
leaves behind.

Real processes throughout. A worker is slowed at start by its engine: a relay asks each
upstream ``GET /models`` before it serves, and the upstream here is a stand-in that holds
every request until the test releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from replystream.lab.local_server import READY_PREFIX
from tests.conftest import wait_for
from tests.processes import launch, ready_url, stop
from tests.rawhttp import RawResponse, raw_request
from tests.test_gateway_workers import Pinned, new_worker, pin_each_worker
from tests.test_workers import alive, children_of

pytestmark = pytest.mark.slow

SIMULATED = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0")


@contextlib.asynccontextmanager
async def parent(
    *args: str, env: Mapping[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``replystream serve --port 0 ARGS`` with its stdout and stderr ours to read; stopped
    on exit."""
    process = await launch(*args, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        yield process
    finally:
        await stop(process)


async def until(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` holds (it reads other processes, which send no event)."""
    await wait_for(check, timeout_s=30.0)


class HeldUpstream:
    """A stand-in upstream on loopback that holds every request until ``release``, then
    answers it with an empty model list."""

    def __init__(self) -> None:
        self.held = 0
        self.release = asyncio.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.held += 1
            await self.release.wait()
            body = b'{"object": "list", "data": []}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> HeldUpstream:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release.set()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_the_ready_line_comes_only_once_every_worker_accepts():
    async with (
        HeldUpstream() as upstream,
        parent(
            f"--engine=upstream:{upstream.url}", "--upstream-health-s", "60", "--workers", "2"
        ) as process,
    ):
        assert process.stdout is not None
        line = asyncio.ensure_future(process.stdout.readline())
        try:
            # Both workers are starting: each waits for its first probe's answer (at most
            # 2 s, the probe's limit), and serves only after it.
            await until(lambda: upstream.held == 2)
            await asyncio.sleep(1.0)
            assert not line.done(), line.result()
            upstream.release.set()
            said = (await asyncio.wait_for(line, 30)).decode()
        finally:
            line.cancel()
        assert said.startswith(READY_PREFIX), said
        url = said[len(READY_PREFIX) :].strip()
        for _ in range(4):  # whichever worker takes it answers at once: none is still starting
            started = time.monotonic()
            response = await raw_request(f"{url}/healthz")
            await response.read_body()
            assert time.monotonic() - started < 2.0


async def test_a_worker_that_dies_before_it_is_ready_stops_the_server_unannounced():
    async with (
        HeldUpstream() as upstream,
        parent(
            f"--engine=upstream:{upstream.url}", "--upstream-health-s", "60", "--workers", "2"
        ) as process,
    ):
        assert process.stdout is not None and process.stderr is not None
        await until(lambda: upstream.held == 2)
        workers = children_of(process.pid)
        os.kill(workers[0], signal.SIGKILL)
        said = await asyncio.wait_for(process.stdout.read(), 30)
        assert READY_PREFIX.encode() not in said, said
        assert await asyncio.wait_for(process.wait(), 30) == 1
        log = (await process.stderr.read()).decode()
        assert f"worker {workers[0]} was killed by SIGKILL before every worker was ready" in log
        assert not [pid for pid in workers if alive(pid)]


async def test_a_worker_killed_again_and_again_is_restarted_after_longer_and_longer_waits():
    async with parent(*SIMULATED, "--workers", "2") as process:
        assert process.stderr is not None
        url = await ready_url(process, ready_s=60.0)
        victim, spared = children_of(process.pid)
        seen = {victim, spared}
        waits = []
        for _ in range(4):
            # Each replacement is killed as soon as it exists: it never serves, so its place's
            # exits are in a row.
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            await until(lambda: bool(set(children_of(process.pid)) - seen))
            waits.append(time.monotonic() - killed_at)
            (victim,) = set(children_of(process.pid)) - seen
            seen.add(victim)
        # 0.2 s, then twice as long each time. Never sooner (the parent counts from when it
        # saw the exit); later by its polling and a busy machine, within generous bounds.
        for wait, expected in zip(waits, (0.2, 0.4, 0.8, 1.6), strict=True):
            assert expected - 0.01 <= wait <= expected + 3.0, waits
        assert alive(spared)

        async def restarts() -> float:
            response = await raw_request(f"{url}/metrics")  # the spared worker answers
            text = (await response.read_body()).decode()
            (family,) = (
                f
                for f in text_string_to_metric_families(text)
                if f.name == "replystream_worker_restarts"
            )
            return family.samples[0].value

        async with asyncio.timeout(30):
            while await restarts() != 4:  # noqa: ASYNC110 (the parent counts as it restarts)
                await asyncio.sleep(0.1)

        await stop(process)
        log = (await process.stderr.read()).decode()
        restarted = re.findall(
            r"worker \d+ was killed by SIGKILL (?:after serving [\d.]+ s|before it was ready); "
            r"starting another in ([\d.]+) s \(exit (\d+) in a row",
            log,
        )
        assert restarted == [("0.2", "1"), ("0.4", "2"), ("0.8", "3"), ("1.6", "4")], log


def listens(pid: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket (``/proc/net/tcp``'s state 0A)."""
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we looked
            held.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in held:
                return True
    return False


async def test_no_connection_waits_for_a_worker_started_in_a_dead_ones_place():
    """A worker started again takes its start (imports; a real model's load: seconds)
    before it accepts. Meanwhile the others serve every new connection: none is queued for
    the one not ready yet, to wait for it (or to be reset, if it dies before it is ready)."""
    async with parent(*SIMULATED, "--workers", "2") as process:
        url = await ready_url(process, ready_s=60.0)
        victim, spared = children_of(process.pid)
        os.kill(victim, signal.SIGKILL)
        await until(lambda: bool(set(children_of(process.pid)) - {victim, spared}))
        (starting,) = set(children_of(process.pid)) - {victim, spared}
        os.kill(starting, signal.SIGSTOP)  # held in its start for as long as we ask
        try:
            for _ in range(12):  # the kernel spreads new connections over listening sockets
                response = await asyncio.wait_for(raw_request(f"{url}/healthz"), 5.0)
                assert response.status == 200
                await response.read_body()
            assert alive(spared)
            assert not listens(starting)
        finally:
            os.kill(starting, signal.SIGCONT)
        assert process.stderr is not None
        async with asyncio.timeout(30):
            while b"is ready, in place of one that exited" not in (await process.stderr.readline()):
                pass
        assert listens(starting)  # ready, it takes its share


def metrics_folders(where: Path) -> list[Path]:
    return sorted(where.glob("replystream-metrics-*"))


async def test_a_killed_servers_metrics_folder_goes_at_the_next_start_and_a_live_ones_stays(
    tmp_path: Path,
):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the servers make their folders
    args = (*SIMULATED, "--workers", "2", "--shutdown-grace-s", "0")
    async with parent(*args, env=env) as killed:
        await ready_url(killed, ready_s=60.0)
        workers = children_of(killed.pid)
        (left,) = metrics_folders(tmp_path)
        killed.send_signal(signal.SIGKILL)  # the parent alone, which cannot clean up
        await killed.wait()
        await until(lambda: not any(alive(pid) for pid in workers))  # orphans stop themselves
    assert metrics_folders(tmp_path) == [left]

    async with parent(*args, env=env) as first:
        await ready_url(first, ready_s=60.0)
        (first_folder,) = metrics_folders(tmp_path)  # the killed server's is gone
        assert first_folder != left
        async with parent(*args, env=env) as second:
            await ready_url(second, ready_s=60.0)
            # The running server's folder is not taken for a dead one's.
            assert first_folder in metrics_folders(tmp_path)
            assert len(metrics_folders(tmp_path)) == 2
    assert metrics_folders(tmp_path) == []  # each removed its own as it stopped


async def interrupted_while_starting(*args: str, after: Callable[[int], bool]) -> tuple[int, str]:
    """``replystream serve --port 0 ARGS`` in a session of its own, sent SIGINT as a
    terminal's Ctrl-C sends it (to every process of the group) once ``after(pid)`` holds; its
    exit status and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "serve", "--port", "0", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        await until(lambda: after(process.pid))
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    finally:
        await stop(process)
    assert process.returncode is not None
    return process.returncode, stderr.decode()


def cpu_s(pid: int) -> float:
    """The CPU time process ``pid`` has used so far (user and system), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("after_cpu_s", [0.15, 0.35])
async def test_ctrl_c_while_one_process_starts_stops_it_without_a_traceback(after_cpu_s: float):
    # Counted in the server's own CPU time, not the clock's: on a loaded machine a wall-clock
    # moment can still fall in the interpreter's start-up (its ``site`` import, which prints
    # a traceback of its own on Ctrl-C), before any code of ours runs. These land early and
    # midway in the imports of the command line and the server (a whole start takes about
    # 0.7 s of CPU).
    status, stderr = await interrupted_while_starting(
        *SIMULATED, after=lambda pid: cpu_s(pid) >= after_cpu_s
    )
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    # 130 while importing; 0 once it served; or, with nothing printed, killed by the signal
    # itself: the interpreter ends that way after an interrupt it counted as unhandled even
    # though ours caught it (seen for some that land in a module's import), which a shell
    # reports as 130 too.
    assert status in (130, 0, -signal.SIGINT), (status, stderr)


def test_ctrl_c_while_the_command_line_loads_is_exit_130_without_a_traceback():
    """The window before ``main`` runs: ``python -m replystream`` importing the command
    line's modules. The Ctrl-C is made to land there by a finder that raises it on the
    import of one of them, as a signal arriving then would."""
    program = (
        "import runpy, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'replystream.cli_values':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['replystream', 'serve']\n"
        "runpy.run_module('replystream', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (130, "")


SWALLOWED = (
    "            try:\n"
    "                os.kill(os.getpid(), signal.SIGINT)\n"
    "                sum(range(1000))  # the handler raises in here\n"
    "            except KeyboardInterrupt:\n"
    "                pass\n"
)
IGNORED = (  # raised in a weakref callback (as the import machinery's locks have): dropped
    "            import weakref\n"
    "            class Held:\n"
    "                pass\n"
    "            def dropped(ref):\n"
    "                os.kill(os.getpid(), signal.SIGINT)\n"
    "                sum(range(1000))\n"
    "            held = Held()\n"
    "            ref = weakref.ref(held, dropped)\n"
    "            del held\n"
)
WRAPPED = (  # Python 3.11 raises a RuntimeError from it; later ones, the interrupt itself
    "            class Named:\n"
    "                def __set_name__(self, owner, name):\n"
    "                    os.kill(os.getpid(), signal.SIGINT)\n"
    "                    sum(range(1000))\n"
    "            type('Made', (), {'field': Named()})\n"
)


APP = "replystream.server.app"
WORKERS = "replystream.server.workers"


@pytest.mark.parametrize(
    ("landing", "module", "workers"),
    [
        (SWALLOWED, APP, []),
        (SWALLOWED, WORKERS, ["--workers", "2"]),
        (IGNORED, APP, []),
        (WRAPPED, APP, []),
    ],
    ids=["swallowed", "swallowed-workers", "ignored", "wrapped"],
)
def test_a_ctrl_c_that_some_code_swallows_while_serve_loads_still_stops_it(
    landing: str, module: str, workers: list[str]
):
    """Code that catches and drops ``KeyboardInterrupt`` (C code clearing any error, a module
    of a library) once made a server started under load serve on after a Ctrl-C; one raised
    while a class was made (a dataclass field's ``__set_name__``) ended it with a RuntimeError
    and its traceback; one raised in a callback whose errors Python drops (a weakref's, as
    the import machinery's module locks have) printed "Exception ignored" and its traceback.
    The Ctrl-C is made to land in such code here, from a finder, on the import of the app (a
    parent of workers never loads it: there, on the import of the module that starts them,
    so none is started)."""
    program = (
        "import os, runpy, signal, sys\n"
        "class Swallow:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            sys.meta_path.remove(self)\n"
        f"{landing}"
        "sys.meta_path.insert(0, Swallow())\n"
        f"sys.argv = ['replystream', 'serve', '--port', '0', *{[*SIMULATED, *workers]!r}]\n"
        "runpy.run_module('replystream', run_name='__main__', alter_sys=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (130, ""), done.stderr  # never announced
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


async def test_ctrl_c_while_the_workers_start_stops_them_all_without_a_traceback():
    workers: list[int] = []

    def started(pid: int) -> bool:  # both workers exist: each is importing now (about 1 s)
        workers[:] = children_of(pid)
        return len(workers) == 2

    status, stderr = await interrupted_while_starting(*SIMULATED, "--workers", "2", after=started)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert status == 0, stderr
    assert not any(alive(pid) for pid in workers)


def test_a_folder_without_a_hugging_face_model_is_said_once_before_any_worker_starts(
    tmp_path: Path,
):
    """Found without loading torch, so by serve itself: not by each worker in turn, each
    saying it again."""
    argv = [sys.executable, "-m", "replystream", "serve", "--engine", f"hf:{tmp_path}"]
    done = subprocess.run(
        [*argv, "--port", "0", "--workers", "3"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"replystream serve: --engine hf:PATH: {tmp_path} is not a Hugging Face model folder "
        "(no config.json)\n"
    )


async def signalled_until_gone(
    process: asyncio.subprocess.Process, pids: list[int], signum: int
) -> tuple[str, int]:
    """Send ``signum`` to each of ``pids`` every 5 ms until they are all gone or ``process``
    (the server's parent) ended, so that one lands at every moment of their stop; then the
    parent's stderr and exit status."""
    while process.returncode is None and any(alive(pid) for pid in pids):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        await asyncio.sleep(0.005)
    assert process.stderr is not None
    async with asyncio.timeout(30):
        stderr = (await process.stderr.read()).decode()
        return stderr, await process.wait()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_a_stop_signalled_to_the_whole_group_stops_the_workers_gracefully(signum: int):
    """A terminal's Ctrl-C, or systemd's SIGTERM, reaches every process of the group: each
    worker gets the stop from there and again from its parent. One that lands as a worker's
    loop closes used to kill it, and the parent then reported its replies cut, exit status 1."""
    async with parent(*SIMULATED, "--workers", "2") as process:
        await ready_url(process)
        workers = children_of(process.pid)
        assert len(workers) == 2
        os.kill(process.pid, signum)
        # The group's copy of the signal, again and again while the workers stop, so that
        # one lands whenever a worker would die of it.
        stderr, status = await signalled_until_gone(process, workers, signum)
    assert "replies were cut" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert status == 0, stderr


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("keys_file", [True, False])
async def test_a_hangup_while_the_server_stops_does_not_kill_it(
    tmp_path: Path, workers: str, keys_file: bool
):
    """A SIGHUP as the server stops (a key rotation's reload sent during a deploy's stop, a
    terminal closed after its Ctrl-C) reaches the parent and every worker. One that landed as
    a process's loop closed, or as the parent exited, killed it: the parent reported the
    worker's replies cut and exited 1, or was itself killed by SIGHUP (status -1)."""
    args = [*SIMULATED, "--workers", workers, "--shutdown-grace-s", "1"]
    if keys_file:
        keys = tmp_path / "keys"
        keys.write_text("key-a\n")
        args += ["--api-keys-file", str(keys)]
    async with parent(*args) as process:
        await ready_url(process)
        processes = [process.pid, *children_of(process.pid)]
        assert len(processes) == (1 if workers == "1" else 3)
        os.kill(process.pid, signal.SIGTERM)
        stderr, status = await signalled_until_gone(process, processes, signal.SIGHUP)
    assert "replies were cut" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert status == 0, stderr


async def test_workers_killed_again_and_again_leave_their_counts_and_few_files(tmp_path: Path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    async with parent(*SIMULATED, "--workers", "2", env=env) as process:
        url = await ready_url(process, ready_s=60.0)
        (folder,) = metrics_folders(tmp_path)

        async def scraped(name: str) -> float:
            response = await raw_request(f"{url}/metrics")
            text = (await response.read_body()).decode()
            families = text_string_to_metric_families(text)
            return sum(s.value for f in families if f.name == name for s in f.samples)

        async def counted(name: str, expected: float) -> None:
            async with asyncio.timeout(30):
                while True:
                    try:
                        if await scraped(name) == expected:
                            return
                    except ConnectionError:  # queued for the killed worker, as it went
                        pass
                    await asyncio.sleep(0.1)

        body = b'{"model": "simulated", "messages": [{"role": "user", "content": "hi"}]}'
        sent = kills = 0
        for _ in range(4):
            for _ in range(3):
                response = await raw_request(f"{url}/v1/chat/completions", "POST", body)
                assert response.status == 200
                await response.read_body()
                sent += 1
            await counted("replystream_replies", sent)  # (counted as each reply ended)
            os.kill(children_of(process.pid)[0], signal.SIGKILL)
            kills += 1
            await counted("replystream_worker_restarts", kills)  # (the dead one was reaped)
            await until(lambda: len(children_of(process.pid)) == 2)
        # Every reply of the killed workers is still counted, through either worker...
        for _ in range(4):
            assert await scraped("replystream_replies") == sent
        # ...and the folder holds files of the running processes alone, and those the
        # counts of the exited ones were added into.
        writers = {
            int(m.group(1))
            for m in map(re.compile(r"_(\d+)\.db$").search, (p.name for p in folder.iterdir()))
            if m
        }
        assert writers <= {process.pid, *children_of(process.pid)}
        # The parent's, the 3 of the workers gone, each worker's 6 (made as it starts)
        assert len(list(folder.glob("*.db"))) <= 1 + 3 + 2 * 6
        # Every file has its disk blocks: a page of a sparse one that a full filesystem cannot
        # back kills (SIGBUS) the process writing it, the parent too as it adds counts up.
        sparse = [
            p.name for p in folder.glob("*.db") if p.stat().st_blocks * 512 < p.stat().st_size
        ]
        assert sparse == []


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no room left."""
    with contextlib.suppress(OSError), path.open("wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()


async def test_a_full_filesystem_under_the_metrics_folder_leaves_the_server_serving(
    tmp_path: Path,
):
    """A full ``/tmp`` under ``--workers``: a worker wrote a new page of its sparse metric
    file and was killed by SIGBUS, then the parent adding its counts up, and so the whole
    server, with nothing said. The shortage is now an error where a file is made or grown."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1), to mount a small filesystem for this server alone")
    small = tmp_path / "small"
    small.mkdir()
    # The server in a mount namespace of its own, on a 2 MiB tmpfs as its temp directory.
    mount = f'mount -t tmpfs -o size=2m tmpfs "{small}" && exec "$@"'
    process = await asyncio.create_subprocess_exec(
        "unshare", "-m", "sh", "-c", mount, "sh",
        sys.executable, "-m", "replystream", "serve", "--port", "0", *SIMULATED,
        "--workers", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(small)},
    )  # fmt: skip
    try:
        try:
            url = await ready_url(process, ready_s=60.0)
        except AssertionError:
            assert process.stderr is not None
            said = (await process.stderr.read()).decode()
            if "mount" in said or "unshare" in said:
                pytest.skip(f"cannot mount a filesystem here: {said.strip()}")
            raise
        # Fill it, as seen from the server's namespace.
        await asyncio.to_thread(fill, Path(f"/proc/{process.pid}/root{small}/filler"))
        chat = b'{"model": "simulated", "messages": [{"role": "user", "content": "hi"}]}'
        legacy = b'{"prompt": "hi", "max_tokens": 2}'

        async def answered(path: str, body: bytes) -> int:
            async with asyncio.timeout(30):
                while True:
                    try:
                        response = await raw_request(f"{url}{path}", "POST", body)
                        await response.read_body()
                        return response.status
                    except ConnectionError:  # queued for the killed worker, as it went
                        await asyncio.sleep(0.1)

        for _ in range(4):  # new rows of every kind of metric, in both workers
            assert await answered("/v1/chat/completions", chat) == 200
            assert await answered("/v1/completions", legacy) == 200
        # A worker gone: the parent adds its counts up, and one in its place cannot make
        # its files (it says so, and is tried again); the other serves on.
        os.kill(children_of(process.pid)[0], signal.SIGKILL)
        # Its replacement says it cannot make its files when it starts (in 0.2 s, then its
        # imports: longer on a busy machine): waited for, not slept for.
        assert process.stderr is not None
        told = b""
        async with asyncio.timeout(30):
            while b"replystream serve: [Errno 28] No space left on device: " not in told:
                told += await process.stderr.readline()
        for _ in range(4):
            assert await answered("/v1/chat/completions", chat) == 200
        assert process.returncode is None and alive(process.pid)
    finally:
        await stop(process)
    assert process.stderr is not None
    said = told.decode() + (await process.stderr.read()).decode()
    assert "SIGBUS" not in said and "Traceback" not in said, said


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP), as ``/proc`` says."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


async def test_a_worker_killed_in_its_start_as_the_server_stops_had_no_replies_to_cut():
    """A restarted worker still starting when the server stops has nothing to finish: killed
    then (the OOM killer, a SIGKILL from outside), it was reported as "its replies were cut"
    and the parent exited 1, as if clients had lost replies."""
    async with parent(*SIMULATED, "--workers", "2") as process:
        await ready_url(process)
        workers = children_of(process.pid)
        os.kill(workers[0], signal.SIGKILL)
        now = await new_worker(process.pid, workers)
        (starting,) = set(now) - set(workers)
        # Held in its start (an import takes far longer than finding it): the parent's
        # forwarded SIGTERM waits on it, and SIGKILL is how it ends.
        os.kill(starting, signal.SIGSTOP)
        # Stopped only when next scheduled: a SIGTERM pending by then would end it first.
        await until(lambda: stopped(starting))
        os.kill(process.pid, signal.SIGTERM)
        await until(lambda: not alive(workers[1]))  # the stop was forwarded to every worker
        os.kill(starting, signal.SIGKILL)
        assert process.stderr is not None
        async with asyncio.timeout(30):
            stderr = (await process.stderr.read()).decode()
            status = await process.wait()
    assert "is ready, in place of one that exited" not in stderr, stderr  # it was starting
    assert "replies were cut" not in stderr, stderr
    assert (
        f"worker {starting} was killed by SIGKILL before it was ready, while the server "
        "stopped: it had no replies"
    ) in stderr, stderr
    assert status == 0, stderr


async def said(process: asyncio.subprocess.Process, words: str) -> None:
    """Read the server's stderr until a line with ``words``."""
    assert process.stderr is not None
    async with asyncio.timeout(30):
        while words not in (await process.stderr.readline()).decode():
            pass


async def health(connection: Pinned) -> tuple[int, dict[str, str], dict[str, object]]:
    """``GET /healthz`` on a kept-alive connection: its status, headers and body."""
    connection.writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    response = RawResponse(connection.reader, connection.writer)
    await response.read_head()
    body = json.loads(await response.read_body(close=False))
    return response.status, response.headers, body


async def test_a_worker_stopping_alone_does_not_take_the_server_out_of_a_balancer():
    """A balancer checks the one port all workers share, often over a kept-alive connection.
    That connection's worker sent SIGTERM alone (the others serving on) answered 503
    "shutting down": the balancer took the whole server out. It now answers for the server,
    and closes the connection, so the next check reaches a serving worker; once the whole
    server stops, every worker answers 503 as one process does."""
    args = ("--engine", "simulated", "--delay-ms", "50", "--jitter-ms", "0", "--tokens", "1000")
    async with (
        parent(*args, "--workers", "2", "--shutdown-grace-s", "60") as process,
        contextlib.AsyncExitStack() as stack,
    ):
        url = await ready_url(process)
        workers = children_of(process.pid)
        streams, checks, late_checks = [
            await stack.enter_async_context(pin_each_worker(url, workers)) for _ in range(3)
        ]
        for connection in streams.values():  # a reply in flight keeps each worker draining
            connection.writer.write(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = RawResponse(connection.reader, connection.writer)
            await head.read_head()
            assert head.status == 200
        alone = workers[0]
        os.kill(alone, signal.SIGTERM)
        await said(process, "shutting down: 1 replies in flight")

        status, headers, body = await health(checks[alone])
        assert (status, body["status"]) == (200, "ok"), body
        assert headers.get("connection") == "close"
        for _ in range(5):  # a new connection: the kernel hands it to the worker serving
            reply = await raw_request(f"{url}/healthz")
            await reply.read_body()
            assert reply.status == 200

        os.kill(process.pid, signal.SIGTERM)  # the whole server stops now
        await said(process, "shutting down: 1 replies in flight")
        for pid in workers:
            status, _, body = await health(late_checks[pid])
            assert (status, body["reason"]) == (503, "shutting down"), body
        for connection in streams.values():
            await connection.aclose()
        async with asyncio.timeout(30):
            assert await process.wait() == 0
