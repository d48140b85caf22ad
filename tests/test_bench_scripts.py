"""The benchmark scripts as their users run them: a real process each, the smallest
parameters that still go through their code, and their mistakes refused in one line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services import require_binary, require_smollm2

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(
    script: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        env=os.environ if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def refused(done: subprocess.CompletedProcess[str], words: str) -> None:
    """Refused as a command line mistake: exit 2, no traceback, ``words`` in the last line."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert words in done.stderr.strip().splitlines()[-1], done.stderr


def test_parse_cost_measures_the_attached_path_through_the_relays_connection() -> None:
    # Its stand-in transport is the relay's connection's socket: a connection the pool has no
    # room for (past its 1,024 idle ones) is closed, and asks its socket what is still unsent.
    done = run_script("relay/parse_cost.py", "--replies", "1100", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    assert "attached, all of it:" in done.stdout


def test_parse_cost_refuses_no_replies() -> None:
    refused(run_script("relay/parse_cost.py", "--replies", "0"), "--replies")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--workers", "0"], "--workers"),
        (["--timeout-s", "0"], "--timeout-s"),
        (["--rerun-if-busy", "-1"], "--rerun-if-busy"),
        (["--json", "/nonexistent/dir/delivery.json"], "--json: no directory '/nonexistent/dir'"),
        (["--servers", "starlette", "--transports", "ws"], "nothing to measure"),
    ],
)
def test_the_delivery_benchmark_refuses_a_run_it_cannot_make_before_it_starts(
    args: list[str], words: str
) -> None:
    # Before: 0 streams waited forever, a timeout of 0 ran every server to fail it, -1
    # reruns ended in an AssertionError, an unwritable --json a traceback after the whole
    # run, and transports no server has an empty table and exit 0.
    refused(run_script("delivery/run.py", "--servers", "bare", *args, timeout_s=30), words)


def test_the_delivery_benchmark_without_redis_says_so_before_it_starts(tmp_path: Path) -> None:
    done = run_script(
        "delivery/run.py",
        "--servers",
        "bare",
        "replystream-redis",
        "--concurrency",
        "2",
        env={**os.environ, "PATH": str(tmp_path)},  # no redis-server on it
        timeout_s=30,
    )
    refused(done, "--servers replystream-redis: redis-server is not installed")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--chunks", "0"], "--chunks"),
        (["--interval-ms", "0"], "--interval-ms"),
        (["--upstream-processes", "0"], "--upstream-processes"),
        (["--timeout-s", "-1"], "--timeout-s"),
        (["--json", "/nonexistent/dir/relay.json"], "--json: no directory '/nonexistent/dir'"),
        (["--relays", "litellm", "--litellm", "/nonexistent/litellm"], "not an executable"),
        # Before, --quick replaced any -C and --rounds given with its own, unsaid (and ran).
        (["--quick", "-C", "0"], "every -C must be at least 1"),
        (["--quick", "--rounds", "0"], "--rounds"),
    ],
)
def test_the_relay_benchmark_refuses_a_run_it_cannot_make_before_it_starts(
    args: list[str], words: str
) -> None:
    # Before: the upstream's own refusal came back as a RuntimeError traceback, a negative
    # timeout measured nothing and exited 0, an unwritable --json and a missing litellm
    # were tracebacks (the first after the whole run).
    done = run_script("relay/run.py", "--relays", "pipe", "-C", "1", "--rounds", "1", *args)
    refused(done, words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--replies", "0"], "--replies must be more than --slow"),
        (["--concurrency", "0"], "--concurrency"),
        (["--asks", "0"], "--asks"),
        # Every short simulated text is a prefix of the slow readers' reply: no word is left
        # to ban.
        (["--asks", "4", "--replies", "10"], "--asks 4: every word of the reference texts"),
    ],
)
def test_the_soak_refuses_a_run_it_cannot_make_before_it_starts(
    args: list[str], words: str
) -> None:
    # Before: no replies or no workers waited forever, no asks was a traceback, and so was
    # a choice of asks with no word to ban (after the references were read).
    refused(run_script("soak/run.py", "--engine", "simulated", *args, timeout_s=30), words)


@pytest.mark.slow
def test_the_soak_passes_on_a_healthy_server_at_a_small_size_with_slow_readers() -> None:
    # Before, the middle snapshot was taken once half the replies had ended: at a small size
    # the mixed replies all ended within the first slow reader's burst and the later bursts,
    # after the middle, raised RSS past the 8 MiB allowed (+13.6 MiB). And the descriptors
    # counted a snapshot's own connection at the end now and then (15 against 14).
    done = run_script(
        "soak/run.py",
        *("--replies", "60", "--concurrency", "4", "--engine", "simulated"),
        *("--asks", "8", "--slow", "3"),
        timeout_s=110,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "after a second half of 28 replies and 1 slow readers" in done.stdout


def test_stalled_clients_passes_when_every_client_is_cut_and_fails_when_not() -> None:
    # Before, a run whose clients were not all cut within its wait printed the count and
    # exited 0, as a run that passed.
    cut = run_script("stalled_clients.py", "--clients", "4", "--slow-client-bytes", "65536")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert "cut as slow clients       4 in" in cut.stdout
    held = run_script(
        "stalled_clients.py",
        *("--clients", "2", "--slow-client-bytes", "1073741824", "--slow-client-s", "3600"),
        *("--wait-s", "1"),
    )
    assert held.returncode == 1, held.stdout + held.stderr
    last = held.stderr.strip().splitlines()[-1]
    assert last == "failed: 2 of 2 stalled clients not cut within 1 s", held.stderr


@pytest.mark.parametrize(
    ("script", "args", "words"),
    [
        # Before, each of these was a traceback after some of the run, or never ended.
        ("batching_delay.py", ["--tokens", "0"], "argument --tokens"),
        ("batching_delay.py", ["--delay-ms", "0"], "argument --delay-ms"),
        ("bench_client_parse.py", ["--runs", "0"], "argument --runs"),
        ("chat_start_cost.py", ["-N", "0"], "argument -N/--requests"),
        ("chat_start_cost.py", ["--src", "nolabel"], "argument --src: want LABEL=PATH"),
        ("engine_decode.py", ["--steps", "200"], "argument --steps: at most 192"),
        ("model_decode.py", ["--batches", "1,0"], "argument --batches"),
        ("pipeline_options.py", ["--tokens", "0"], "argument --tokens"),
        ("relay_latency.py", ["--rounds", "0"], "argument --rounds"),
        ("resume.py", ["--tokens", "5"], "argument --tokens"),
        ("stalled_clients.py", ["--clients", "0"], "argument --clients"),
        ("whole_reply_stall.py", ["--src", "x"], "argument --src"),
        ("delivery/start_cost.py", ["-N", "0"], "argument -N/--requests"),
        ("delivery/memory_breakdown.py", ["-C", "0"], "argument -C/--concurrency"),
        # Before, taken and ignored: no tracer runs.
        ("delivery/memory_breakdown.py", ["--untraced", "--frames", "8"], "argument --frames"),
        ("delivery/redis_write_cost.py", ["--replies", "0"], "argument --replies"),
        ("delivery/bare_app.py", ["--port", "-1"], "argument --port"),
        ("relay/layer_cost.py", ["--seconds", "0"], "argument --seconds"),
        ("relay/embeddings_answer.py", ["--inputs", "4", "0"], "argument --inputs"),
        ("relay/byte_pipe.py", ["--upstream", "localhost:0"], "argument --upstream"),
    ],
)
def test_a_benchmark_refuses_a_count_or_duration_it_cannot_run_with(
    script: str, args: list[str], words: str
) -> None:
    refused(run_script(script, *args, timeout_s=30), words)


def descendants(pid: int) -> set[int]:
    """Every living process below ``pid`` (by parent pid, from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on."""
    with contextlib.suppress(OSError):
        links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and f"socket:[{fields[9]}]" in links:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    return set()


def alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True], ids=["kill", "terminal"])
@pytest.mark.parametrize(
    ("script", "args", "servers", "programs"),
    [
        # replystream serve, started through the lab's local server
        ("batching_delay.py", ["--repeats", "100"], 1, ()),
        # redis-server (the delivery benchmark's) and three replicas of replystream serve
        ("resume.py", ["--repeats", "1000"], 4, ("redis-server",)),
        # Redis, nginx, two replicas, then the load client in its own process
        (
            "delivery/run.py",
            ["--servers", "replystream-redis-2", "--concurrency", "20", "--timeout-s", "600"],
            4,
            ("redis-server", "nginx"),
        ),
    ],
)
def test_ctrl_c_ends_a_benchmark_in_one_line_with_the_servers_it_started(
    script: str, args: list[str], servers: int, programs: tuple[str, ...], to_group: bool
) -> None:
    # Before, Ctrl-C printed a KeyboardInterrupt traceback (two, chained, under asyncio.run)
    # and the script died by SIGINT; from a terminal, which sends it to the whole foreground
    # process group, each server it had started logged its own stop as well.
    for program in programs:
        require_binary(program)
    process = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / script), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            started = {pid: listening_ports(pid) for pid in descendants(process.pid)}
            ports = {port for found in started.values() for port in found}
            if sum(1 for found in started.values() if found) >= servers:
                break
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, f"{servers} servers not listening: {started}"
            time.sleep(0.1)
        time.sleep(1.0)  # into the measuring
        if to_group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert stderr.splitlines() == [f"{Path(script).name}: interrupted"], stderr
    assert not [pid for pid in started if alive(pid)], started
    assert not [port for port in ports if accepts(port)], ports


SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_redis_memory_benchmark_runs_as_a_script_from_anywhere(tmp_path: Path) -> None:
    # Before: ``python benchmarks/redis_memory.py`` (and ``redis_failover.py``) failed on
    # ``from tests...`` (ModuleNotFoundError) unless run with PYTHONPATH=src:. from the checkout.
    require_binary("redis-server")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "redis_memory.py"), "--replies", "5"],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "chat chunks, 120" in done.stdout


@pytest.mark.parametrize(
    ("script", "words"),
    [
        # Before: a FileNotFoundError traceback for /usr/sbin/redis-server, assumed.
        ("resume.py", "redis-server is not installed"),
        # Before: pytest's Skipped, as a traceback, once the tests' helpers looked for it (and
        # before that, the ModuleNotFoundError above).
        ("redis_memory.py", "redis-server is not installed"),
        ("redis_failover.py", "redis-server, redis-sentinel, redis-cli not installed"),
    ],
)
def test_a_redis_benchmark_without_redis_says_so_in_one_line(
    script: str, words: str, tmp_path: Path
) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(SRC)}
    refused(run_script(script, env=env, timeout_s=30), words)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--steps", "9000"], "argument --steps: at most 8128"),
        (["--ttft", "128,9000"], "argument --ttft: at most the model's context, 8192"),
    ],
)
def test_model_decode_refuses_a_length_past_the_context_before_it_loads_the_model(
    args: list[str], words: str
) -> None:
    # Before, the context was checked once the model was loaded: the weights dequantised to
    # float32 first (here 2.5 s and a peak of 776 MiB resident); the header alone now.
    require_smollm2()
    measure = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stderr.write(done.stderr)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(done.returncode)\n"
    )
    script = [sys.executable, str(BENCHMARKS / "model_decode.py"), *args, "--no-transformers"]
    done = subprocess.run(
        [sys.executable, "-c", measure, *script], capture_output=True, text=True, timeout=120
    )
    refused(done, words)
    peak_mib = int(done.stdout) / 1024
    assert peak_mib < 300, f"{peak_mib:.0f} MiB: the weights were loaded"
