"""``replystream lab`` end to end: a real server process, real HTTP, the JSON contract."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.typedefs import Handler

from replystream.client import ReplyTiming
from replystream.lab.experiment import LabConfig, LabRun
from replystream.lab.local_server import READY, announced_process, local_server
from replystream.server import create_app, running
from replystream.server.server_config import ServerConfig
from tests.conftest import fast_engine, serve_engine, wait_for

LAB = [sys.executable, "-m", "replystream", "lab"]
SMALL = ["--calls", "4", "--tokens", "12", "--delay-ms", "20", "--jitter-ms", "4"]


async def lab_at(url: str, *args: str) -> tuple[int, bytes, bytes]:
    """``replystream lab --url URL ARGS``, as a terminal-less run sees it (no ``COLUMNS``):
    its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *LAB,
        "--url",
        url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return process.returncode, stdout, stderr


def test_lab_json_contract_and_shape_of_the_result():
    done = subprocess.run([*LAB, *SMALL, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # --json prints only the JSON object
    for mode in ("wait", "stream"):
        assert result[mode]["calls"] == result[mode]["complete"] == 4
        for metric in ("first_text_ms", "total_ms"):
            assert set(result[mode][metric]) >= {"median", "p95"}
    wait, stream = result["wait"], result["stream"]
    # Buffered: the first text is the whole reply. Streamed: it comes about one token in.
    assert wait["first_text_ms"] == wait["total_ms"]
    assert stream["first_text_ms"]["median"] < wait["first_text_ms"]["median"] / 3
    # The same schedules end at about the same time in both modes (generous: noisy machine).
    assert abs(result["total_median_diff_pct"]) < 15
    assert result["config"]["tokens"] == 12 and result["config"]["calls"] == 4


def test_lab_json_with_out_writes_the_timeline_as_well(tmp_path: Path):
    quick = ["--calls", "2", "--tokens", "4", "--delay-ms", "2", "--jitter-ms", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [*LAB, *quick, "--json", "--out", "out"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stream"]["complete"] == 2  # stdout is still the JSON alone
    timeline = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert len(timeline["stream"]["arrivals"]) == 4
    assert (tmp_path / "out" / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing in the working dir


def test_lab_writes_timeline_plot_and_result_line(tmp_path: Path):
    done = subprocess.run(
        [*LAB, *SMALL, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    assert json.loads(last.removeprefix("RESULT "))["stream"]["complete"] == 4
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert len(timeline["stream"]["arrivals"]) == 12
    assert len(timeline["wait"]["arrivals"]) == 1
    times = [a["t_ms"] for a in timeline["stream"]["arrivals"]]
    assert times == sorted(times)
    assert (
        "".join(a["text"] for a in timeline["stream"]["arrivals"])
        == (timeline["wait"]["arrivals"][0]["text"])
    )
    assert (tmp_path / "timeline.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("bad", "wants"),
    [
        (["--calls", "0"], "a whole number >= 1"),
        (["--tokens", "0"], "a whole number from 1 to 1048576"),
    ],
)
def test_lab_refuses_nonsense_options(bad: list[str], wants: str):
    done = subprocess.run([*LAB, *bad, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"replystream lab: argument {bad[0]}: want {wants}, got 0"
    ]


@pytest.mark.parametrize("engine", ["simulated", "tiny"])
async def test_stream_and_wait_count_the_same_tokens_of_a_batching_server(engine: str):
    """The lab stream's events carry text and no count: with 5 tokens to an event (and the
    tiny model's tokens, parts of words), its tokens are counted as the /wait body's are."""
    server = ["--engine", engine, "--batch-tokens", "5", "--seed", "3"]
    if engine == "simulated":
        server += ["--delay-ms", "1", "--jitter-ms", "0"]
    async with local_server(server) as url:
        code, stdout, _ = await lab_at(url, "--calls", "2", "--tokens", "40", "--json")
    assert code == 0
    result = json.loads(stdout)
    assert result["stream"]["tokens"] == result["wait"]["tokens"]
    if engine == "simulated":  # a word a token
        assert result["stream"]["tokens"]["median"] == 40


async def test_lab_against_a_failing_server_reports_incomplete_and_exits_nonzero():
    # Every reply fails after 3 tokens (the warm-up asks for 1): nothing may count as a result.
    engine = fast_engine(fail_after=3)
    async with serve_engine(engine) as url:
        code, stdout, _ = await lab_at(url, "--calls", "2", "--json")
    assert code == 1
    result = json.loads(stdout)
    assert result["stream"]["complete"] == result["wait"]["complete"] == 0
    assert result["stream"]["first_text_ms"]["median"] is None
    assert result["first_text_sooner_ms"] is None
    assert any("simulated failure" in e for e in result["stream"]["errors"])


async def test_lab_says_why_calls_did_not_complete_under_its_table(tmp_path: Path):
    engine = fast_engine(fail_after=3)
    async with serve_engine(engine) as url:
        code, stdout, _ = await lab_at(url, "--calls", "2", "--out", str(tmp_path))
    assert code == 1
    lines = stdout.decode().splitlines()
    stream = next(line for line in lines if line.startswith("Stream (SSE): "))
    assert stream.startswith("Stream (SSE): 2 of 2 calls did not complete: ")
    assert "simulated failure" in stream


async def test_a_reason_that_looks_like_markup_is_printed_as_it_came(tmp_path: Path):
    @web.middleware
    async def refuse(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.query.get("max_tokens") == "1":  # the warm-up: a failed one stops the run
            return await handler(request)
        return web.json_response({"error": {"message": "no [/bold] here"}}, status=503)

    app = create_app(fast_engine())
    app.middlewares.insert(0, refuse)
    async with running(app) as url:
        code, stdout, stderr = await lab_at(url, "--calls", "1", "--out", str(tmp_path))
    assert b"Traceback" not in stderr, stderr.decode()
    assert code == 1
    assert "Stream (SSE): 1 of 1 calls did not complete: HTTP 503: no [/bold] here" in (
        stdout.decode().splitlines()
    )


async def test_a_local_server_that_never_gets_ready_is_a_runtime_error_naming_the_wait():
    # lab turns a RuntimeError into one line; a bare TimeoutError was a traceback.
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match=r"^the server was not ready within 0.5 s$"):
        async with announced_process(silent, READY, name="the server", ready_timeout_s=0.5):
            pass


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.mark.parametrize("flag", ["--delay-ms", "--jitter-ms", "--first-token-ms"])
async def test_lab_url_refuses_a_schedule_it_could_not_apply(flag: str):
    async with serve_engine(fast_engine()) as url:
        done = await asyncio.to_thread(
            subprocess.run,
            [*LAB, "--url", url, flag, "5", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    line = one_line_error(done)
    assert line.startswith(f"replystream lab: {flag} ") and f"drop {flag}" in line
    assert done.stdout == ""  # nothing was measured, so nothing is reported


async def test_lab_url_sends_tokens_as_max_tokens_and_reports_only_what_applied():
    # The server's own reply is longer than 7 tokens; --tokens must reach it per request.
    async with serve_engine(fast_engine()) as url:
        code, stdout, _ = await lab_at(url, "--calls", "2", "--tokens", "7", "--json")
    assert code == 0
    result = json.loads(stdout)
    assert result["stream"]["tokens"]["median"] == result["wait"]["tokens"]["median"] == 7
    config = result["config"]
    assert config["tokens"] == 7
    # The server at --url kept its own schedule: the result does not claim the lab's.
    assert config["delay_ms"] is config["jitter_ms"] is config["first_token_ms"] is None


async def test_lab_url_sends_its_headers_to_a_keyed_server_and_keeps_no_key():
    config = ServerConfig(api_keys=("sk-lab-key-1234",))
    async with running(create_app(fast_engine(), config)) as url:
        asked = ("--calls", "2", "--tokens", "5", "--json")
        code, _, refused = await lab_at(url, *asked)
        ok, out, _ = await lab_at(url, *asked, "--header", "Authorization: Bearer sk-lab-key-1234")
    assert code == 1 and "HTTP 401" in refused.decode()  # the warm-up call, without the key
    assert ok == 0
    result = json.loads(out)
    assert result["stream"]["complete"] == result["wait"]["complete"] == 2
    assert result["config"]["headers"] == ["Authorization"]
    assert b"sk-lab-key-1234" not in out


@pytest.mark.parametrize(
    ("url", "code", "says"),
    [
        ("http://127.0.0.1:1", 1, "cannot connect"),
        ("https://127.0.0.1:8443", 2, "https is not spoken"),
        ("127.0.0.1:8000", 2, "want http://HOST"),
        ("http://127.0.0.1:99999", 2, "port from 1 to 65535"),
        ("http://127.0.0.1:8000/stream", 2, "the lab adds /wait and /stream itself"),
        ("http://127.0.0.1:8000/api/wait/", 2, "the lab adds /wait and /stream itself"),
    ],
)
def test_lab_url_mistakes_get_one_line(url: str, code: int, says: str):
    done = subprocess.run(
        [*LAB, "--url", url, "--json"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == code
    line = one_line_error(done)
    assert "--url" in line and says in line


async def test_a_warm_up_call_that_fails_stops_the_run_in_one_line():
    # Not a lab server's address (its routes are one level up): every call would be a 404.
    async with serve_engine(fast_engine()) as url:
        done = await asyncio.to_thread(
            subprocess.run,
            [*LAB, "--url", f"{url}/v1", "--calls", "2", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and done.stdout == ""  # nothing measured, nothing reported
    line = one_line_error(done)
    assert line.startswith(f"replystream lab: the warm-up call GET {url}/v1/wait?max_tokens=1")
    assert "HTTP 404" in line


async def test_a_server_that_never_answers_stops_the_lab_after_its_timeout():
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # reads the request, answers nothing, until the lab hangs up
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        done = await asyncio.to_thread(
            subprocess.run,
            [*LAB, "--url", f"http://127.0.0.1:{port}", "--timeout", "0.5", "--json"],
            capture_output=True,
            text=True,
            timeout=60,  # the default call timeout is 300 s: this run must not wait for it
        )
    assert done.returncode == 1
    assert "timed out after 0.5 s" in one_line_error(done)


async def test_a_server_that_never_completes_the_handshake_stops_the_lab_after_its_timeout():
    # A listener whose accept queue is full drops each new SYN, as a host behind a firewall
    # that drops packets does: a connect waits for the kernel's retries (about two minutes).
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        queued = [socket.socket() for _ in range(3)]
        for sock in queued:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        try:
            done = await asyncio.to_thread(
                subprocess.run,
                [*LAB, "--url", f"http://127.0.0.1:{port}", "--timeout", "0.5", "--json"],
                capture_output=True,
                text=True,
                timeout=30,  # far less than the kernel's retries: this run must not wait them
            )
        finally:
            for sock in queued:
                sock.close()
    assert done.returncode == 1 and done.stdout == ""
    line = one_line_error(done)
    assert line.startswith(f"replystream lab: --url http://127.0.0.1:{port}: cannot connect")
    assert "no connection within 0.5 s" in line


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started that are still its children (Linux's /proc)."""
    found = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in found.read_text().split()] if found.exists() else []


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie no one has reaped yet)."""
    try:
        return "(zombie)" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)


@LINUX_ONLY
@pytest.mark.parametrize("sent", ["SIGTERM", "SIGKILL"])
async def test_the_labs_server_ends_with_the_lab_however_the_lab_is_stopped(sent: str):
    slow = ["--calls", "1", "--tokens", "400", "--delay-ms", "50", "--jitter-ms", "0"]
    lab = await asyncio.create_subprocess_exec(
        *LAB, *slow, "--json", stdout=asyncio.subprocess.DEVNULL
    )
    await wait_for(lambda: bool(children_of(lab.pid)), timeout_s=60)  # its server started
    [server] = children_of(lab.pid)
    await asyncio.sleep(1)  # the calls are under way
    os.kill(lab.pid, getattr(signal, sent))
    await lab.wait()
    await wait_for(lambda: ended(server), timeout_s=30)  # its shutdown: no stream left to end


def _timing(first_ms: float | None, total_ms: float | None, *, streamed: bool) -> ReplyTiming:
    return ReplyTiming(
        url="http://h/stream" if streamed else "http://h/wait",
        streamed=streamed,
        complete=first_ms is not None,
        error=None if first_ms is not None else "cut",
        status=200,
        headers_ms=1.0,
        first_chunk_ms=first_ms,
        first_text_ms=first_ms,
        last_text_ms=total_ms,
        closed_ms=total_ms or 50.0,
        body_bytes=10,
        text="a b",
        tokens=2,
    )


def test_the_modes_are_compared_over_the_calls_complete_in_both():
    # Call i of both modes asks for the same reply: the comparison pairs them. Only call 0 of
    # the stream completed: compared against the wait's call 0 alone, not the median of all
    # five waits (which would credit streaming with 2 s it never saved).
    waits = [_timing(t, t, streamed=False) for t in (1000.0, 2000.0, 3000.0, 4000.0, 5000.0)]
    streams = [_timing(10.0, 1001.0, streamed=True)] + [
        _timing(None, None, streamed=True) for _ in range(4)
    ]
    result = LabRun(LabConfig(calls=5), {"wait": waits, "stream": streams}).summary()
    assert result["compared_calls"] == 1
    assert result["first_text_sooner_ms"] == 990.0
    assert result["total_median_diff_ms"] == 1.0
    assert result["wait"]["first_text_ms"]["median"] == 3000.0  # each mode's own row: all


def _stalling_app(
    stall: Callable[[web.Request], bool],
) -> tuple[web.Application, list[str], list[str]]:
    """A lab server whose requests ``stall`` picks never answer; the rest are served. The
    queries of the requests that came, and of those that ended, are listed."""
    came: list[str] = []
    ended: list[str] = []

    @web.middleware
    async def hold(request: web.Request, handler: Handler) -> web.StreamResponse:
        came.append(request.query_string)
        if stall(request):
            await asyncio.Event().wait()  # until the lab hangs up
        response = await handler(request)
        ended.append(request.query_string)
        return response

    app = create_app(fast_engine())
    app.middlewares.insert(0, hold)
    return app, came, ended


async def _lab_interrupted_once(
    url: str, ready: Callable[[], bool], *args: str
) -> tuple[int | None, str, str]:
    """``replystream lab --url URL ARGS``, sent one Ctrl-C once ``ready`` holds: its exit
    status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *LAB, "--url", url, "--timeout", "120", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await wait_for(ready, timeout_s=60)
    # What ``ready`` sees is the server's side; the lab, another process, is given time to
    # read the last bytes of what ended (on a busy machine it lagged the server, and a call
    # whose end was sent was cut as it was read).
    await asyncio.sleep(2.0)
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


async def test_ctrl_c_reports_the_calls_that_ended_and_says_the_run_was_cut():
    # Call 1 of each mode (seed 43) never ends; the others do. Ctrl-C, the only way out
    # before --timeout, threw away the calls that had ended and said nothing at all.
    app, _, ended = _stalling_app(lambda request: request.query.get("seed") == "43")
    async with running(app) as url:
        measured = lambda: sum("seed=" in query for query in ended) == 4  # noqa: E731
        code, out, err = await _lab_interrupted_once(url, measured, "--calls", "3", "--json")
    assert code == 130, err
    assert "Traceback" not in err
    result = json.loads(out)
    assert result["interrupted"] is True
    for mode in ("wait", "stream"):
        assert (result[mode]["calls"], result[mode]["complete"]) == (3, 2)
        assert result[mode]["errors"] == ["interrupted (Ctrl-C) before it ended"]
        assert result[mode]["total_ms"]["median"] is not None
    assert result["compared_calls"] == 2
    assert result["first_text_sooner_ms"] is not None


async def test_ctrl_c_before_the_calls_were_sent_says_nothing_was_measured():
    # The warm-up call never ends: Ctrl-C there ended the lab without a word.
    app, came, _ = _stalling_app(lambda request: request.query.get("max_tokens") == "1")
    async with running(app) as url:
        code, out, err = await _lab_interrupted_once(url, lambda: bool(came), "--json")
    assert code == 130, err
    assert out == ""
    assert err.strip().splitlines() == [
        "replystream lab: interrupted (Ctrl-C) before the calls were sent: nothing was measured"
    ]


def _hears_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a terminal's foreground job does


@LINUX_ONLY
async def test_ctrl_c_tells_nothing_of_the_labs_own_server_stopping():
    # The lab stops the server it started: that server's log of its own stop (the replies it
    # was still making, its grace) reached the terminal under the report, a line of a process
    # the operator never started, naming a 10 s grace the lab does not wait.
    lab = await asyncio.create_subprocess_exec(
        *LAB, "--calls", "3", "--tokens", "500", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=_hears_ctrl_c,
    )  # fmt: skip
    await wait_for(lambda: bool(children_of(lab.pid)), timeout_s=60)  # its server started
    await asyncio.sleep(2.0)  # warmed up, and the calls under way (500 tokens: 16 s)
    lab.send_signal(signal.SIGINT)
    async with asyncio.timeout(30):
        out, err = await lab.communicate()
    assert lab.returncode == 130, err
    assert json.loads(out)["interrupted"] is True
    assert err.decode() == ""


def test_the_timeline_shows_a_pair_complete_in_both_modes_and_marks_an_incomplete_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Call 0 of the stream failed: its text so far drawn as "stream" read as a whole, shorter
    # reply. The first pair complete in both is shown instead, and it says which call it is.
    waits = [_timing(t, t, streamed=False) for t in (1000.0, 2000.0)]
    streams = [_timing(None, None, streamed=True), _timing(10.0, 2001.0, streamed=True)]
    run = LabRun(LabConfig(calls=2), {"wait": waits, "stream": streams})
    timeline = run.timeline()
    assert {mode: (data["call"], data["seed"]) for mode, data in timeline.items()} == {
        "wait": (1, 43),
        "stream": (1, 43),
    }
    assert timeline["wait"]["total_ms"] == 2000.0 and timeline["stream"]["complete"] is True
    # No pair complete in both: call 0 is shown, and the legend says it did not complete.
    alone = LabRun(LabConfig(calls=1), {"wait": waits[:1], "stream": streams[:1]}).timeline()
    assert alone["stream"]["call"] == 0 and alone["stream"]["error"] == "cut"
    import matplotlib.pyplot as plt

    from replystream.lab import plots

    drawn: list[object] = []
    monkeypatch.setattr(plt, "close", drawn.append)
    plots.plot_timeline(alone, tmp_path / "timeline.png")
    (figure,) = drawn
    legend = figure.axes[0].get_legend()  # type: ignore[attr-defined]
    assert [text.get_text() for text in legend.get_texts()] == [
        "wait",
        "stream: incomplete (cut)",
    ]
