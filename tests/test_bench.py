"""``replystream bench`` against real servers: it recovers a known schedule and keeps every timing.

The schedule tests run the server in its own process (as in production, so the load client and
the server do not share an event loop) with a simulated engine whose timing is known: 200 ms
before the first token, then one token every 20 ms, no jitter. The simulated engine makes its
first token one token-delay after the first-token time, so TTFT is expected near 220 ms and
TPOT near 20 ms. Bounds are generous (timers fire late, never early); order and completeness
are what is checked.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import random
import resource
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console

from replystream.cli import main
from replystream.client import ReplyTiming
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine import SimulatedConfig, SimulatedEngine
from replystream.engine.tiny import TinyEngine, load_default_engine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.lab import bench_plots
from replystream.lab.bench_csv import write_csv
from replystream.lab.bench_report import render, server_lines
from replystream.lab.benchstats import SLO, summarize
from replystream.lab.datasets import read_dataset, read_trace
from replystream.lab.drop_resume import drop_and_resume
from replystream.lab.load import run_load
from replystream.lab.load_types import LoadConfig, LoadRun, RequestRecord
from replystream.lab.local_server import local_server
from replystream.lab.profiles import Profile, arrival_offsets
from replystream.lab.served_model import served_model
from replystream.lab.server_metrics import metrics_url
from replystream.lab.sweep import constant_rates
from replystream.lab.workload import Api, Lengths, Prompt, build_request, detect_api
from replystream.server import create_app, running
from replystream.server.serve import RunningServer, serving
from replystream.server.server_config import ServerConfig
from replystream.server.state import add_state_gauges
from tests.conftest import serve_engine
from tests.processes import replica
from tests.services import free_port

WORKLOADS = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads"
SCHEDULE = ["--first-token-ms", "200", "--delay-ms", "20", "--jitter-ms", "0", "--tokens", "30"]


@pytest.fixture
async def scheduled_server() -> AsyncIterator[str]:
    async with local_server(SCHEDULE) as url:
        yield url


async def test_closed_loop_recovers_the_simulated_schedule(scheduled_server):
    config = LoadConfig(
        url=f"{scheduled_server}/stream", api="lab", profile=Profile("concurrent", 2), requests=6
    )
    summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 6
    assert 219.0 <= summary["ttft_ms"]["p50"] <= 270.0  # configured: 200 + 20
    assert 18.0 <= summary["tpot_ms"]["p50"] <= 24.0  # configured: 20
    assert 15.0 <= summary["itl_ms"]["p50"] <= 25.0
    for request in summary["requests"]:
        assert request["tokens"] == 30 and len(request["text_event_ms"]) == 30
        assert request["first_byte_ms"] < request["ttft_ms"] <= request["e2el_ms"]
        assert request["tokens_per_event"] == 1.0
    assert summary["throughput"]["output_tokens"] == 180
    assert 0.0 <= summary["client"]["cpu_share_of_one_core"] < 1.0
    assert summary["client"]["events_read"] == 180
    assert 0.0 < summary["client"]["cpu_us_per_event"] < 50_000.0


async def test_a_batching_servers_lab_stream_counts_every_token_of_each_event():
    async with local_server(["--batch-tokens", "5", "--delay-ms", "1", "--jitter-ms", "0"]) as url:
        config = LoadConfig(
            url=f"{url}/stream", api="lab", requests=2, output_tokens=Lengths.parse("50")
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2
    for request in summary["requests"]:
        assert request["tokens"] == 50 and request["events"] == 10
        assert request["tokens_per_event"] == 5.0


async def run_bench(*args: str) -> tuple[int | None, bytes, bytes]:
    """``replystream bench ARGS`` as a process: its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await process.communicate()
    return process.returncode, stdout, stderr


async def bench_until_ctrl_c(ready: asyncio.Event, *args: str) -> tuple[int | None, bytes, bytes]:
    """``replystream bench ARGS`` as a process, sent Ctrl-C (SIGINT) once ``ready`` is set:
    its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        await ready.wait()
        process.send_signal(signal.SIGINT)
        stdout, stderr = await process.communicate()
    return process.returncode, stdout, stderr


async def test_cli_writes_the_json_contract_and_three_plots(scheduled_server, tmp_path):
    out = tmp_path / "bench.json"
    returncode, stdout, _ = await run_bench(
        f"{scheduled_server}/stream",
        *("--concurrency", "3", "--requests", "6", "--slo", "ttft:100000", "--slo", "tpot:1"),
        *("--json", str(out), "--plot", str(tmp_path / "plots")),
        *("--csv", str(tmp_path / "bench.csv")),
    )
    assert returncode == 0
    text = stdout.decode()
    for shown in ("TTFT", "TPOT", "ITL", "E2EL", "linear interpolation", "% of one core"):
        assert shown in text
    result = await asyncio.to_thread(lambda: json.loads(out.read_text()))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        for key in ("mean", "p50", "p90", "p95", "p99"):
            assert isinstance(result[metric][key], float)
    assert len(result["requests"]) == 6
    assert result["goodput"]["good_requests"] == 0  # nobody meets tpot <= 1 ms
    text = await asyncio.to_thread((tmp_path / "bench.csv").read_text, encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    assert [int(row["index"]) for row in rows] == list(range(6))
    assert [float(row["ttft_ms"]) for row in rows] == [r["ttft_ms"] for r in result["requests"]]
    for name in ("ttft_cdf.png", "gap_histogram.png", "timeline.png"):
        png = await asyncio.to_thread((tmp_path / "plots" / name).read_bytes)
        assert png.startswith(b"\x89PNG")


async def test_a_soft_open_file_limit_below_the_run_is_raised_to_what_it_needs(
    scheduled_server, tmp_path
):
    """``ulimit -n`` is often 1,024 while the hard limit allows far more: bench raises its
    own soft limit as far as the run needs, as load tools do, rather than refuse it."""

    def low_soft_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "bench", f"{scheduled_server}/stream",
        "--concurrency", "150", "--requests", "150", "--json", str(tmp_path / "run.json"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=low_soft_limit,
    )  # fmt: skip
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    result = json.loads((tmp_path / "run.json").read_text())
    # Every request at once (more than the 128 files it was started with), every one served.
    assert result["counts"]["complete"] == 150
    assert result["config"]["concurrency"] == 150


@pytest.mark.parametrize("profile", ["constant", "poisson"])
async def test_an_open_loop_raises_a_low_soft_open_file_limit_too(
    scheduled_server, tmp_path, profile
):
    """An open loop sends at its own times: against replies of about 800 ms, 100 requests
    sent within 0.1 s are all in flight at once, past a soft limit of 64 files."""

    def low_soft_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replystream", "bench", f"{scheduled_server}/stream",
        "--profile", profile, "--rate", "1000", "--requests", "100",
        "--json", str(tmp_path / "run.json"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        preexec_fn=low_soft_limit,
    )  # fmt: skip
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["counts"]["complete"] == 100, result["counts"]


async def test_an_output_that_cannot_be_written_is_one_line_and_the_others_are_written(
    scheduled_server, tmp_path
):
    # /dev/full passes every check made before the run (its folder exists, it opens for
    # writing) and refuses the write itself, as a full disk does.
    returncode, stdout, stderr = await run_bench(
        f"{scheduled_server}/stream",
        *("--requests", "2", "--json", "/dev/full", "--csv", str(tmp_path / "bench.csv")),
    )
    assert returncode == 1
    assert stderr.decode().strip().splitlines() == [
        "replystream bench: --json /dev/full: No space left on device"
    ]
    assert "TTFT" in stdout.decode()  # the table was printed before
    rows = (tmp_path / "bench.csv").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 3


def test_gamma_arrivals_keep_the_mean_rate_and_burstiness_spreads_the_gaps():
    def gaps(k: float) -> list[float]:
        offsets = arrival_offsets(rate=50.0, burstiness=k, seed=1)
        times = [next(offsets) for _ in range(4001)]
        return [b - a for a, b in itertools.pairwise(times)]

    def cv(values: list[float]) -> float:
        return statistics.stdev(values) / statistics.mean(values)

    for k in (0.25, 1.0, 4.0):
        assert statistics.mean(gaps(k)) == pytest.approx(1 / 50.0, rel=0.1)
    # The coefficient of variation of gamma gaps is 1 / sqrt(k): 2, 1 and 0.5.
    assert cv(gaps(0.25)) == pytest.approx(2.0, rel=0.15)
    assert cv(gaps(1.0)) == pytest.approx(1.0, rel=0.15)
    assert cv(gaps(4.0)) == pytest.approx(0.5, rel=0.15)


async def test_open_loop_issues_on_schedule_while_replies_are_in_flight():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=20.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/stream",
            api="lab",
            profile=Profile("poisson", rate=40.0),
            requests=12,
            output_tokens=Lengths.parse("uniform:5:15", minimum=1),
            seed=3,
        )
        run = await run_load(config)
    starts = [r.start_s for r in run.records]
    assert all(r.timing.complete for r in run.records)
    assert starts == sorted(starts)
    # Arrivals do not wait for replies (each takes >= 100 ms): many overlap.
    ends = [r.start_s + r.timing.closed_ms / 1000 for r in run.records]
    assert sum(1 for i in range(1, 12) if starts[i] < ends[i - 1]) >= 6
    assert {r.timing.tokens for r in run.records} == {r.max_tokens for r in run.records}


async def test_duration_bounds_issuing_and_every_issued_request_finishes():
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=5.0, jitter_ms=0.0))) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=10",
            api="lab",
            profile=Profile("concurrent", 2),
            requests=None,
            duration_s=0.5,
        )
        run = await run_load(config)
    assert len(run.records) >= 4
    assert all(r.timing.complete for r in run.records)
    # The duration bounds when a request is issued; ``start_s`` is taken once its body is
    # built, which on a busy machine can fall just past the bound (68 µs was seen).
    assert max(r.start_s for r in run.records) < 0.5 + 0.05


async def test_incomplete_and_failed_requests_are_counted_with_reasons():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0, fail_after=3))
    async with serve_engine(engine) as url:
        run = await run_load(LoadConfig(url=f"{url}/stream", api="lab", requests=3))
    counts = summarize(run)["counts"]
    assert counts["incomplete"] == 3 and counts["complete"] == 0
    assert any("simulated failure" in reason for reason in counts["incomplete_reasons"])

    async with running(unavailable_app()) as url:
        refused = LoadConfig(url=f"{url}/stream", api="lab", requests=2, warmup=False)
        counts = summarize(await run_load(refused))["counts"]
    assert counts["failed"] == 2
    assert any("HTTP 503" in reason for reason in counts["failed_reasons"]), counts


def unavailable_app() -> web.Application:
    """A server that is there and answers every request 503 at once."""

    async def unavailable(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", unavailable)
    return app


@pytest.mark.parametrize("warmup", [True, False], ids=["warm-up", "no-warm-up"])
@pytest.mark.parametrize("pacing", [("--concurrency", "4"), ("--rate", "200")])
async def test_a_run_against_a_closed_port_stops_at_once_with_one_line(warmup, pacing):
    """A closed loop against nothing would fail as fast as it could for the whole duration:
    the run stops at its first refused request and says so, as a load tool's test request
    does."""
    url = f"http://127.0.0.1:{free_port()}/stream"  # nothing listens
    flags = [*pacing, "--duration", "60", "--quiet"] + ([] if warmup else ["--no-warmup"])
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "replystream", "bench", url, *flags),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(30):  # far less than the 60 s asked for
        out, err = await process.communicate()
    assert process.returncode == 1
    assert "Traceback" not in err.decode() and out == b""
    lines = err.decode().splitlines()
    assert len(lines) == 1 and err.endswith(b"\n"), err
    assert lines[0].startswith(f"replystream bench: cannot connect to {url[7:].split('/')[0]}:")
    assert "nothing was measured" in lines[0]


async def test_a_refused_run_stops_issuing_at_its_first_request():
    url = f"http://127.0.0.1:{free_port()}/stream"  # nothing listens
    config = LoadConfig(
        url=url,
        api="lab",
        profile=Profile("concurrent", 4),
        requests=None,
        duration_s=60.0,
        warmup=False,
    )
    async with asyncio.timeout(30):
        run = await run_load(config)
    # Each reader had one request in flight when the first was refused; none sent another.
    assert 1 <= len(run.records) <= 4
    assert run.unreachable is not None and "cannot connect" in run.unreachable
    assert not any(r.timing.connected for r in run.records)


async def test_goodput_counts_only_requests_within_every_slo():
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=5.0, jitter_ms=0.0))) as url:
        run = await run_load(LoadConfig(url=f"{url}/stream?max_tokens=5", api="lab", requests=4))
    loose = summarize(run, (SLO.parse("ttft:60000"), SLO.parse("tpot:60000")))
    # Kept by no request: five tokens 5 ms apart take 20 ms from the first to the last, however
    # the client reads them (a loaded machine may read all five at once: a TPOT of 0).
    strict = summarize(run, (SLO.parse("ttft:60000"), SLO.parse("e2el:1")))
    assert loose["goodput"]["good_requests"] == 4
    assert strict["goodput"]["good_requests"] == 0
    with pytest.raises(ValueError, match="metric must be one of"):
        SLO.parse("queue:5")


async def test_a_reply_in_one_event_meets_an_itl_bound():
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))) as url:
        run = await run_load(LoadConfig(url=f"{url}/stream?max_tokens=1", api="lab", requests=2))
    summary = summarize(run, (SLO.parse("itl=1000"),))
    assert [len(r["text_event_ms"]) for r in summary["requests"]] == [1, 1]
    assert [r["max_itl_ms"] for r in summary["requests"]] == [0.0, 0.0]
    assert summary["goodput"]["good_requests"] == 2 and summary["goodput"]["held"]


async def test_a_reply_of_one_token_is_not_judged_by_a_tpot_bound(tmp_path):
    out = tmp_path / "bench.json"
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))) as url:
        target = f"{url}/stream?max_tokens=1"
        returncode, stdout, stderr = await run_bench(
            target, *("--requests", "2", "--slo", "ttft=60000,tpot=1000", "--json", str(out))
        )
        run = await run_load(LoadConfig(url=target, api="lab", requests=2))
    assert returncode == 0, stderr.decode()
    result = json.loads(await asyncio.to_thread(out.read_text))
    assert [r["tokens"] for r in result["requests"]] == [1, 1]
    assert [r["tpot_ms"] for r in result["requests"]] == [None, None]
    assert result["goodput"]["good_requests"] == 2 and result["goodput"]["held"]
    assert result["goodput"]["no_tpot"] == 2
    assert "2 replies of under 2 tokens had no TPOT" in stdout.decode()
    # Its other bounds still judge it.
    strict = summarize(run, (SLO.parse("ttft=0.001"), SLO.parse("tpot=1000")))
    assert strict["goodput"]["good_requests"] == 0


async def test_native_replies_endpoint_counts_tokens_per_event():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        api = detect_api(f"{url}/v1/replies")
        assert api == "native"
        config = LoadConfig(
            url=f"{url}/v1/replies", api=api, requests=2, output_tokens=Lengths.parse("8")
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2, summary["counts"]
    assert all(r["tokens"] == 8 for r in summary["requests"])


async def test_openai_chat_completions_request_shape_and_stream():
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("Hello ", "there ", "friend"):
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.005)
        usage = {"choices": [], "usage": {"completion_tokens": 3}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    async with running(app) as url:
        target = f"{url}/v1/chat/completions"
        config = LoadConfig(
            url=target,
            api=detect_api(target),
            requests=2,
            model="m",
            prompt_words=Lengths.parse("5"),
            output_tokens=Lengths.parse("3"),
            warmup=False,
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2
    assert summary["tpot_ms"]["count"] == 2
    assert bodies[0] == {
        "model": "m",
        "messages": [{"role": "user", "content": "alpha bravo charlie delta echo"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 3,
    }


async def test_a_messages_run_reads_anthropic_events_and_resends_its_history():
    """Anthropic's Messages API: the body it requires (max_tokens, the system prompt apart),
    text from text deltas only (not thinking, not a tool call's JSON), tokens from the
    message_delta's usage, the end at message_stop; a later turn resends the reply."""
    bodies: list[dict[str, Any]] = []

    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

    async def messages(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = {"input_tokens": 4, "output_tokens": 1}
        await response.write(event("message_start", {"message": {"usage": usage}}))
        await response.write(event("ping", {}))
        thinking = {"type": "thinking_delta", "thinking": "hmm"}
        await response.write(event("content_block_delta", {"index": 0, "delta": thinking}))
        for word in ("Hello ", "there"):
            delta = {"type": "text_delta", "text": word}
            await response.write(event("content_block_delta", {"index": 1, "delta": delta}))
            await asyncio.sleep(0.005)
        call = {"type": "input_json_delta", "partial_json": '{"x": 1}'}
        await response.write(event("content_block_delta", {"index": 2, "delta": call}))
        ended = {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 9}}
        await response.write(event("message_delta", ended) + event("message_stop", {}))
        return response

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    async with running(app) as url:
        target = f"{url}/v1/messages"
        config = LoadConfig(
            url=target,
            api=detect_api(target),
            requests=1,
            model="claude",
            prompts=(Prompt("What is a token?", None, (Prompt("And a word?", 7),)),),
            system_words=2,
            turns=2,
            warmup=False,
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2, summary["counts"]
    assert [r["tokens"] for r in summary["requests"]] == [9, 9]
    first = [{"role": "user", "content": "What is a token?"}]
    assert bodies[0] == {
        "model": "claude",
        "max_tokens": 1024,  # the API requires one: asked for when the run leaves it open
        "stream": True,
        "system": "you are",
        "messages": first,
    }
    assert bodies[1]["max_tokens"] == 7
    assert bodies[1]["messages"] == [
        *first,
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "And a word?"},
    ]


async def test_a_messages_run_against_our_own_route_counts_its_usage():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        target = f"{url}/v1/messages"
        assert detect_api(target) == "messages"
        model = await served_model(target, timeout_s=5.0)
        config = LoadConfig(
            url=target,
            api="messages",
            requests=2,
            model=model,
            prompt_words=Lengths.parse("3"),
            output_tokens=Lengths.parse("6"),
            warmup=False,
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2, summary["counts"]
    assert [r["tokens"] for r in summary["requests"]] == [6, 6]


@pytest.mark.parametrize(
    "path",
    ["/v1/replies", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"],
)
async def test_ignore_eos_runs_every_reply_to_its_length_on_every_api(path: str):
    """``--ignore-eos``: a model that ends early on its own (here the tiny model, ending at
    a comma, a full stop or a common word) makes replies of the length asked for."""
    default = load_default_engine()
    ends = frozenset(
        default.tokenizer.encode(word)[0] for word in (",", ".", " the", " and", " of", " unto")
    )
    engine = TinyEngine(default.model, default.tokenizer, stop_tokens=ends)
    async with running(create_app(engine, ServerConfig(model_name="m"))) as url:
        tokens = {}
        for ignore_eos in (False, True):
            config = LoadConfig(
                url=f"{url}{path}",
                api=detect_api(f"{url}{path}"),
                requests=4,
                model="m",
                prompt_words=Lengths.parse("4"),
                output_tokens=Lengths.parse("24"),
                ignore_eos=ignore_eos,
                warmup=False,
            )
            summary = summarize(await run_load(config))
            assert summary["counts"]["complete"] == 4, summary["counts"]
            tokens[ignore_eos] = [r["tokens"] for r in summary["requests"]]
    assert tokens[True] == [24] * 4
    assert min(tokens[False]) < 24  # without it, the model ends where it will


def test_lab_requests_keep_the_urls_own_query():
    spec = build_request("lab", "http://h/stream?seed=7", prompt="a b", max_tokens=4, model="x")
    assert (spec.method, spec.json_body) == ("GET", None)
    assert spec.url == "http://h/stream?seed=7&prompt=a+b&max_tokens=4"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "ftp://example.com/stream"],
        ["bench", "http://127.0.0.1:1/stream", "--cacert", str(WORKLOADS / "trace.jsonl")],
        ["bench", "https://127.0.0.1:1/stream", "--cacert", str(WORKLOADS / "trace.jsonl")],
        ["bench", "http://127.0.0.1:1/v1/replies", "--resume-cursor", "query"],
        ["bench", "http://127.0.0.1:1/stream", "--api", "responses", "--drop-share", "0.5"],
        ["bench", "http://127.0.0.1:1/stream", "--slo", "queue=5"],
        ["bench", "http://127.0.0.1:1/stream", "--slo", "ttft=0"],
        ["bench", "http://127.0.0.1:1/stream", "--slo", "ttft=5,ttft=6"],
        ["bench", "http://127.0.0.1:1/stream", "--slo", "ttft=5", "--slo", "ttft:6"],
        ["bench", "http://127.0.0.1:1/stream", "--slo-share", "1.5"],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "constant"],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "concurrent"],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "synchronous", "--rate", "5"],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "poisson", "--concurrency", "2"],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--rate",
            "3",
            "--profile",
            "constant",
            "--burstiness",
            "2",
        ],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "sweep"],
        ["bench", "http://127.0.0.1:1/stream", "--profile", "throughput", "--duration", "2"],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--profile",
            "throughput",
            "--requests",
            "4",
            "--duration",
            "2",
        ],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--profile",
            "throughput",
            "--requests",
            "4",
            "--warmup-s",
            "1",
        ],
        ["bench", "http://127.0.0.1:1/stream", "--sweep-steps", "3"],
        ["bench", "http://127.0.0.1:1/stream", "--duration", "1", "--warmup-s", "2"],
        ["bench", "http://127.0.0.1:1/stream", "--steady-bound", "0"],
        ["bench", "http://127.0.0.1:1/stream", "--prompt-words", "hist:/nonexistent.hist"],
        ["bench", "http://127.0.0.1:1/stream", "--dataset", "/nonexistent.jsonl"],
        ["bench", "http://127.0.0.1:1/stream", "--dataset", str(WORKLOADS / "trace.jsonl")],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--dataset",
            str(WORKLOADS / "prompts.jsonl"),
            "--prompt-words",
            "5",
        ],
        ["bench", "http://127.0.0.1:1/stream", "--trace", str(WORKLOADS / "prompts.jsonl")],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--trace",
            str(WORKLOADS / "trace.jsonl"),
            "--rate",
            "5",
        ],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--trace",
            str(WORKLOADS / "trace.jsonl"),
            "--dataset",
            str(WORKLOADS / "prompts.jsonl"),
        ],
        ["bench", "http://127.0.0.1:1/stream", "--system-prompt-words", "-1"],
        ["bench", "http://127.0.0.1:1/stream", "--turns", "0"],
        ["bench", "http://127.0.0.1:1/stream", "--header", "Authorization Bearer k"],
        ["bench", "http://127.0.0.1:1/stream", "--header", "Host: example.com"],
        ["bench", "http://127.0.0.1:1/stream", "--header", "Bad Name: x"],
        ["bench"],
        ["bench", "--compare", str(WORKLOADS / "prompts.jsonl")],
        ["bench", "--compare", str(WORKLOADS / "prompts.jsonl"), "/nonexistent.json"],
        ["bench", "--compare", str(WORKLOADS / "prompts.jsonl"), str(WORKLOADS / "trace.jsonl")],
        ["bench", "http://127.0.0.1:1/stream", "--metrics-interval", "1"],
        ["bench", "http://127.0.0.1:1/stream", "--drop-share", "0.5", "--drop-after", "3"],
        ["bench", "http://127.0.0.1:1/v1/replies", "--drop-share", "0.5"],
        [
            "bench",
            "http://127.0.0.1:1/v1/replies",
            "--drop-share",
            "0.7",
            "--drop-after",
            "3",
            "--cancel-share",
            "0.5",
            "--cancel-after",
            "2",
        ],
        ["bench", "http://127.0.0.1:1/stream", "--cancel-share", "0.5"],
        ["bench", "http://127.0.0.1:1/stream", "--cancel-after", "3"],
        ["bench", "http://127.0.0.1:1/stream", "--cancel-share", "1.5", "--cancel-after", "3"],
        [
            "bench",
            "http://127.0.0.1:1/stream",
            "--trace",
            str(WORKLOADS / "trace.jsonl"),
            "--turns",
            "2",
        ],
        ["bench", "http://127.0.0.1:1/stream", "--output-tokens", "uniform:9:3"],
        ["bench", "http://127.0.0.1:1/stream", "--ignore-eos", "--output-tokens", "4"],
        ["bench", "http://127.0.0.1:1/v1/replies", "--ignore-eos"],
        ["doctor", "ftp://example.com/stream"],
    ],
)
def test_usage_errors_exit_2_before_sending_anything(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit:  # refused while parsing the value
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"replystream {argv[0]}:") and err.count("\n") == 1


# A capacity the schedule states: every reply takes 20 ms before its first token and then 20
# tokens 4 ms apart (100 ms), and the server admits 4 open requests per client (more get 429),
# so it completes at most 4 / 0.1 s = 40 requests per second.
CAPACITY_SCHEDULE = [
    "--first-token-ms",
    "20",
    "--delay-ms",
    "4",
    "--jitter-ms",
    "0",
    "--tokens",
    "20",
    "--max-concurrent-per-client",
    "4",
]
CAPACITY_PER_S = 4 / 0.100
# Bounds several times the schedule's (TTFT 24 ms, gaps 4 ms, 100 ms a reply), so what breaks
# goodput is the 429s past the capacity, not a busy machine: with ttft=60,itl=30,e2el=300 the
# synchronous run once missed goodput beside three other test workers.
KNEE_SLO = "ttft=100,itl=60,e2el=400"


async def test_sweep_finds_the_knee_at_the_servers_stated_capacity(tmp_path):
    out = tmp_path / "sweep.json"
    async with local_server(CAPACITY_SCHEDULE) as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "replystream", "bench", f"{url}/stream", "--quiet"),
            *("--profile", "sweep", "--requests", "16", "--sweep-steps", "4"),
            *("--slo", KNEE_SLO, "--slo-share", "0.9"),
            *("--json", str(out), "--plot", str(tmp_path / "plots")),
            *("--csv", str(tmp_path / "sweep.csv")),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
        # Above the capacity, the 429s are counted against goodput: it does not hold.
        over = LoadConfig(
            url=f"{url}/stream",
            api="lab",
            profile=Profile("constant", rate=1.5 * CAPACITY_PER_S),
            requests=24,
        )
        slo = SLO.parse_list(KNEE_SLO)
        overload = summarize(await run_load(over), slo, slo_share=0.9)
    assert process.returncode == 0, stderr.decode()
    assert "Knee:" in stdout.decode() and "(knee)" in stdout.decode()
    result = await asyncio.to_thread(lambda: json.loads(out.read_text()))
    sweep = result["sweep"]
    profiles = [run["profile"] for run in result["runs"]]
    assert profiles == ["synchronous", "throughput", *["constant"] * 4]
    # One request at a time takes 100 ms (plus overhead): at most 10 per second.
    assert 5.0 <= sweep["synchronous_rate"] <= 10.0
    # Every request at once: the 4 admitted finish together, the rest are refused.
    assert 0.5 * CAPACITY_PER_S <= sweep["max_throughput_rate"] <= CAPACITY_PER_S
    rates = sweep["rates"]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(sweep["max_throughput_rate"])
    # The knee is the top rate (just under the capacity) or, when a late timer let a fifth
    # request overlap there, the one below: within one sweep step of the capacity's rate.
    assert rates[-1] - sweep["step"] - 1e-9 <= sweep["knee_rate"] <= CAPACITY_PER_S
    # The schedule is recovered from the synchronous run: TTFT 20 + 4 ms, ITL 4 ms,
    # E2EL 20 + 20 x 4 ms. Timers fire late, never early; a quiet machine is within 3 ms
    # (docs/tools.md), the upper bounds leave room for a machine busy with other work.
    synchronous = result["runs"][0]["summary"]
    assert 24.0 <= synchronous["ttft_ms"]["p50"] <= 36.0
    assert 3.0 <= synchronous["itl_ms"]["p50"] <= 6.0
    assert 100.0 <= synchronous["e2el_ms"]["p50"] <= 115.0
    assert synchronous["counts"]["failed"] == 0, synchronous["counts"]
    # Within its SLO but for a stall or two of a machine busy with other work (two of the
    # sixteen, beside five other jobs, once broke its 90 % share); over capacity, the 429s
    # break it whatever the machine.
    assert synchronous["goodput"]["share_of_requests"] >= 0.8, synchronous["goodput"]
    assert not overload["goodput"]["held"]
    assert overload["goodput"]["share_of_requests"] < 0.85
    assert any("429" in reason for reason in overload["counts"]["failed_reasons"])
    text = await asyncio.to_thread((tmp_path / "sweep.csv").read_text, encoding="utf-8")
    rows = list(csv.DictReader(text.splitlines()))
    # Every request of every run, in the JSON's order, with the run it belongs to.
    expected = [
        (str(n), r["index"])
        for n, run in enumerate(result["runs"])
        for r in run["summary"]["requests"]
    ]
    assert [(row["run"], int(row["index"])) for row in rows] == expected
    assert {row["profile"] for row in rows} == {"synchronous", "throughput", "constant"}
    for name in ("sweep_latency.png", "sweep_distributions.png"):
        png = await asyncio.to_thread((tmp_path / "plots" / name).read_bytes)
        assert png.startswith(b"\x89PNG")


async def test_a_closed_loop_wider_than_its_requests_starts_only_what_it_needs():
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=2",
            api="lab",
            profile=Profile("concurrent", 10**8),  # a task each: gigabytes before a request
            requests=2,
            warmup=False,
        )
        async with asyncio.timeout(20):
            summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2


async def test_slo_given_twice_bounds_both_metrics(tmp_path):
    out = tmp_path / "bench.json"
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))) as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "replystream", "bench", f"{url}/stream?max_tokens=3"),
            *("--requests", "1", "--quiet", "--slo", "ttft=1000", "--slo", "tpot=500"),
            *("--json", str(out)),
        )
        assert await process.wait() == 0
    goodput = json.loads(await asyncio.to_thread(out.read_text))["goodput"]
    assert goodput["slos"] == {"ttft": 1000.0, "tpot": 500.0}


async def test_slo_before_the_url_leaves_the_url_to_be_the_url(tmp_path):
    out = tmp_path / "bench.json"
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))) as url:
        returncode, _, stderr = await run_bench(
            *("--slo", "ttft=1000,itl:500", "--slo", "e2el=5000", f"{url}/stream?max_tokens=3"),
            *("--requests", "1", "--quiet", "--json", str(out)),
        )
    assert returncode == 0, stderr.decode()
    goodput = json.loads(await asyncio.to_thread(out.read_text))["goodput"]
    assert goodput["slos"] == {"ttft": 1000.0, "itl": 500.0, "e2el": 5000.0}
    assert goodput["good_requests"] == 1


async def test_a_sweep_says_why_its_requests_failed(capsys):
    async with running(unavailable_app()) as url:
        argv = ["bench", f"{url}/stream", "--profile", "sweep", "--requests", "2", "--quiet"]
        code = await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert code == 1
    for run in ("synchronous", "throughput"):
        reasons = [line for line in out.splitlines() if line.startswith(f"  {run}: failed: 2 x ")]
        assert len(reasons) == 1 and "HTTP 503" in reasons[0], out
    # With no --slo a good request is a complete one: the knee line says so.
    assert "Knee: none; no rate completed 95 % of requests and stayed steady." in out


async def test_a_sweep_claims_only_the_constant_rates_it_ran(capsys):
    async with running(unavailable_app()) as url:  # every request refused: both rates are 0
        argv = ["bench", f"{url}/stream", "--profile", "sweep", "--requests", "2", "--quiet"]
        code = await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert code == 1
    rows = [line.split()[1] for line in out.splitlines() if line.startswith("│ ")]
    assert rows == ["synchronous", "throughput"], out
    assert "maximum throughput 0.00 req/s, 0 constant rates between." in out


def lab_words(
    stop: Callable[[], Awaitable[None]] | None = None, at_request: int = 0
) -> web.Application:
    """A lab stream of 3 words 50 ms apart; ``stop`` is awaited as request number
    ``at_request`` arrives (its own reply is still sent)."""
    arrived = 0

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        if stop is not None and arrived == at_request:
            await stop()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("a ", "b ", "c"):
            await asyncio.sleep(0.05)
            await response.write(f"data: {json.dumps(word)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    return app


async def test_a_sweep_whose_server_goes_away_reports_the_runs_it_made(tmp_path):
    """The server stops listening once the burst's requests are in: the first constant run
    cannot connect, so the sweep ends there with its two runs reported and written."""
    out, table = tmp_path / "sweep.json", tmp_path / "sweep.csv"
    listening: list[RunningServer] = []

    async def stop_listening() -> None:
        await listening[0].site.stop()
        # The site leaves the socket it was given open (the kernel would queue new
        # connections, each then timing out); closing it refuses them at once.
        listening[0].stop_listening()

    # A warm-up and 2 requests each for the synchronous run and the burst: the 6th is the last.
    async with serving(lab_words(stop_listening, at_request=6)) as server:
        listening.append(server)
        code, stdout, stderr = await run_bench(
            f"{server.url}/stream",
            *("--profile", "sweep", "--requests", "2", "--sweep-steps", "2", "--quiet"),
            *("--json", str(out), "--csv", str(table)),
        )
    text = stdout.decode()
    assert code == 1, stderr.decode()
    assert "Traceback" not in stderr.decode() and "nothing was measured" not in stderr.decode()
    result = json.loads(await asyncio.to_thread(out.read_text))
    sweep = result["sweep"]
    assert [run["profile"] for run in result["runs"]] == ["synchronous", "throughput"]
    assert all(run["summary"]["counts"]["complete"] == 2 for run in result["runs"])
    assert sweep["knee_rate"] is None and len(sweep["rates"]) == 2
    assert sweep["ended_early"].startswith(f"the run at {sweep['rates'][0]:,.2f} req/s could not")
    assert "cannot connect" in sweep["ended_early"]
    assert f"The sweep ended early: {sweep['ended_early']}." in text
    assert "0 of 2 constant rates between." in text
    # The synchronous run held, yet it is no knee: a rate the sweep never ran may hold too.
    assert "Knee: none; " in text and "a knee is judged over every rate" in text
    rows = await asyncio.to_thread(table.read_text, encoding="utf-8")
    assert [row["profile"] for row in csv.DictReader(rows.splitlines())] == [
        *["synchronous"] * 2,
        *["throughput"] * 2,
    ]


async def test_ctrl_c_in_a_sweep_reports_the_runs_before_it(tmp_path):
    """Ctrl-C while the first constant run waits on the server: the sweep ends there, its
    synchronous run and burst reported and written, with exit status 130."""
    out = tmp_path / "sweep.json"
    waiting, never = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        waiting.set()
        await never.wait()  # until the reader hangs up

    async with running(lab_words(hold, at_request=7)) as url:
        code, stdout, stderr = await bench_until_ctrl_c(
            waiting,
            *(f"{url}/stream", "--quiet", "--profile", "sweep"),
            *("--requests", "2", "--sweep-steps", "2", "--json", str(out)),
        )
    assert code == 130, stderr.decode()
    result = json.loads(await asyncio.to_thread(out.read_text))
    sweep = result["sweep"]
    assert [run["profile"] for run in result["runs"]] == ["synchronous", "throughput"]
    assert sweep["knee_rate"] is None
    assert sweep["ended_early"] == (
        f"the run at {sweep['rates'][0]:,.2f} req/s was interrupted (Ctrl-C): the sweep ends there"
    )
    assert f"The sweep ended early: {sweep['ended_early']}." in stdout.decode()


async def test_a_sweep_whose_burst_completed_nothing_failed_and_has_no_knee(tmp_path):
    """The server answers the synchronous run, then fails every request of the burst: a rate
    of 0 is no maximum, so the sweep fails there, though the synchronous rate held."""
    words = lab_words()
    arrived = 0

    @web.middleware
    async def gone_after_four(request: web.Request, handler: Any) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        # A warm-up and 2 requests for the synchronous run, the burst's warm-up; then none.
        if arrived > 4:
            return web.json_response({"error": {"message": "gone"}}, status=503)
        response: web.StreamResponse = await handler(request)
        return response

    words.middlewares.append(gone_after_four)
    out = tmp_path / "sweep.json"
    async with running(words) as url:
        code, stdout, stderr = await run_bench(
            f"{url}/stream",
            *("--profile", "sweep", "--requests", "2", "--sweep-steps", "2", "--quiet"),
            *("--json", str(out)),
        )
    text = stdout.decode()
    assert code == 1, stderr.decode()
    result = json.loads(await asyncio.to_thread(out.read_text))
    sweep, runs = result["sweep"], result["runs"]
    assert [run["profile"] for run in runs] == ["synchronous", "throughput"]
    assert runs[0]["summary"]["goodput"]["held"] and sweep["synchronous_rate"] > 0
    assert runs[1]["summary"]["counts"]["failed"] == 2
    assert sweep["knee_rate"] is None and sweep["rates"] == []
    assert "completed no request" in sweep["ended_early"]
    assert "the sweep failed" in sweep["ended_early"]
    assert f"The sweep ended early: {sweep['ended_early']}." in text
    assert "(knee)" not in text and "Knee: none; " in text


async def test_warmup_window_keeps_early_requests_out_of_every_figure():
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=5",
            api="lab",
            profile=Profile("constant", rate=20.0),
            requests=None,
            duration_s=1.0,
        )
        run = await run_load(config)
    summary = summarize(run, warmup_s=0.5)
    early = [r for r in summary["requests"] if r["start_s"] < 0.5]
    assert len(early) >= 8 and all(r["warmup"] for r in early)
    measured = len(run.records) - len(early)
    assert summary["counts"]["warmup_requests"] == len(early)
    assert summary["counts"]["requests"] == summary["ttft_ms"]["count"] == measured
    assert summary["throughput"]["output_tokens"] == 5 * measured


async def test_run_plots_leave_the_warmup_window_out_as_the_figures_do(tmp_path, monkeypatch):
    """The TTFT curve and the gap histogram draw the requests the table measured, not the
    warm-up window's (whose first replies met a cold server)."""
    async with serve_engine(SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=5",
            api="lab",
            profile=Profile("constant", rate=20.0),
            requests=None,
            duration_s=1.0,
        )
        run = await run_load(config)
    summary = summarize(run, warmup_s=0.5)
    assert summary["counts"]["warmup_requests"] >= 8
    drawn: dict[str, list[dict[str, Any]]] = {}
    monkeypatch.setattr(bench_plots, "_ttft_cdf", lambda done, path: drawn.update(ttft=done))
    monkeypatch.setattr(bench_plots, "_gap_histogram", lambda done, path: drawn.update(gaps=done))
    bench_plots.plot_all(summary, tmp_path)
    measured = [r["index"] for r in summary["requests"] if r["complete"] and not r["warmup"]]
    assert len(measured) == summary["ttft_ms"]["count"]
    assert [r["index"] for r in drawn["ttft"]] == measured
    assert [r["index"] for r in drawn["gaps"]] == measured


def _record(index: int, start_s: float, ttft_ms: float) -> RequestRecord:
    events = tuple(ttft_ms + 10.0 * i for i in range(5))
    timing = ReplyTiming(
        url="http://h/stream",
        streamed=True,
        complete=True,
        error=None,
        status=200,
        headers_ms=1.0,
        first_chunk_ms=ttft_ms,
        first_text_ms=ttft_ms,
        last_text_ms=events[-1],
        closed_ms=events[-1] + 1.0,
        body_bytes=100,
        text="a b c d e",
        tokens=5,
        text_event_ms=events,
    )
    return RequestRecord(index, start_s, 0, None, timing)


def test_steady_state_marks_a_run_whose_second_half_slowed_down():
    config = LoadConfig(url="http://h/stream", api="lab", requests=8)
    flat = LoadRun(config, tuple(_record(i, 0.1 * i, 50.0) for i in range(8)), 1.0, 0.1)
    # A queue that grows: each request waits 40 ms longer than the one before.
    growing = LoadRun(config, tuple(_record(i, 0.1 * i, 50.0 + 40 * i) for i in range(8)), 1.0, 0.1)
    assert summarize(flat)["steady_state"]["steady"] is True
    judged = summarize(growing, steady_bound=0.5)["steady_state"]
    assert judged["steady"] is False
    assert judged["change"]["ttft_ms"]["first_half_p50"] == pytest.approx(110.0)
    assert judged["change"]["ttft_ms"]["second_half_p50"] == pytest.approx(270.0)
    assert summarize(growing, steady_bound=2.0)["steady_state"]["steady"] is True
    too_few = LoadRun(config, (_record(0, 0.0, 50.0), _record(1, 0.5, 50.0)), 1.0, 0.1)
    assert summarize(too_few)["steady_state"]["steady"] is None


def test_profiles_pace_their_arrivals():
    constant = Profile("constant", rate=4.0).arrivals(seed=0)
    assert [next(constant) for _ in range(4)] == [0.0, 0.25, 0.5, 0.75]
    burst = Profile("throughput").arrivals(seed=0)
    assert [next(burst) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert Profile.synchronous().in_flight == 1 and Profile("concurrent", 3).in_flight == 3
    with pytest.raises(ValueError, match="closed loop"):
        Profile("concurrent", 3).arrivals(seed=0)


def test_sweep_rates_are_evenly_spaced_up_to_the_maximum():
    assert constant_rates(2.0, 10.0, 4) == [4.0, 6.0, 8.0, 10.0]
    assert constant_rates(5.0, 5.0, 4) == []


def test_histogram_lengths_are_drawn_in_proportion_to_their_weights(tmp_path):
    hist = tmp_path / "lengths.hist"
    hist.write_text("# length weight\n10 3\n100, 1\n\n500 0\n")
    lengths = Lengths.parse(f"hist:{hist}")
    rng = random.Random(0)
    drawn = Counter(lengths.draw(rng) for _ in range(4000))
    assert set(drawn) == {10, 100}
    assert drawn[10] / 4000 == pytest.approx(0.75, abs=0.03)
    shipped = Lengths.parse(f"hist:{WORKLOADS / 'prompt_words.hist'}")
    assert shipped.values == (8, 16, 32, 64, 128, 512, 1024)
    hist.write_text("10 3\nten 1\n")
    with pytest.raises(ValueError, match="line 2"):
        Lengths.parse(f"hist:{hist}")


def test_uniform_lengths_draw_every_whole_number_between_the_bounds_equally():
    """uniform:3:9 is seven lengths, 3 and 9 as likely as 6: a continuous draw rounded gives
    each bound half the others' share."""
    rng = random.Random(0)
    drawn = Counter(Lengths.parse("uniform:3:9").draw(rng) for _ in range(14000))
    assert set(drawn) == set(range(3, 10))
    for length in range(3, 10):
        assert drawn[length] / 14000 == pytest.approx(1 / 7, abs=0.015), drawn
    # Bounds that are not whole: the whole numbers between them; none between: the nearest.
    assert {Lengths.parse("uniform:2.5:4.5").draw(rng) for _ in range(200)} == {3, 4}
    assert {Lengths.parse("uniform:2.2:2.4").draw(rng) for _ in range(20)} == {2}


def test_a_normal_draw_past_any_float_is_clamped_to_a_length():
    """A normal of huge SD draws inf now and then (and nan from inf - inf): each draw is
    still a whole length within the bounds, not an OverflowError."""
    rng = random.Random(1)
    wide = Lengths("normal", 10, 1e308, minimum=1)
    bounded = Lengths("normal", 10, 1e308, minimum=1, maximum=50)
    draws = [wide.draw(rng) for _ in range(200)] + [bounded.draw(rng) for _ in range(200)]
    assert all(isinstance(d, int) and 1 <= d <= 2**53 for d in draws)
    assert all(d <= 50 for d in draws[200:])
    assert Lengths("normal", float("inf"), 1, minimum=1).draw(rng) == 2**53


def test_datasets_read_prompts_sharegpt_and_messages_with_their_reply_lengths():
    plain = read_dataset(WORKLOADS / "prompts.jsonl")
    assert len(plain) == 5 and plain[0].output_tokens == 60 and plain[3].output_tokens is None
    shared = read_dataset(WORKLOADS / "sharegpt.jsonl")
    assert [p.text for p in shared] == [
        "How do I stream a reply from a web server?",
        "What is a token?",
        "Why does nginx buffer responses?",
    ]
    # The reply that follows the first user turn gives the length asked for, in words.
    assert [p.output_tokens for p in shared] == [23, 11, 20]


async def test_dataset_prompts_and_a_shared_system_prompt_reach_a_chat_endpoint():
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "ok"}}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    async with running(app) as url:
        config = LoadConfig(
            url=f"{url}/v1/chat/completions",
            api="openai",
            profile=Profile("concurrent", 2),
            requests=12,
            model="m",
            prompts=read_dataset(WORKLOADS / "sharegpt.jsonl"),
            system_words=6,
            warmup=False,
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 12
    system = {"role": "system", "content": "you are a helpful assistant answer"}
    asked = {(b["messages"][1]["content"], b["max_tokens"]) for b in bodies}
    assert all(b["messages"][0] == system for b in bodies)
    assert asked <= {
        ("How do I stream a reply from a web server?", 23),
        ("What is a token?", 11),
        ("Why does nginx buffer responses?", 20),
    }
    assert len(asked) >= 2  # drawn per request from the seed, not one prompt over and over


def test_a_system_prompt_leads_the_text_of_apis_without_messages():
    spec = build_request(
        "native", "http://h/v1/replies", prompt="hi", max_tokens=3, model="x", system="be brief"
    )
    assert spec.json_body == {"prompt": "be brief\n\nhi", "max_tokens": 3}


async def test_trace_replays_its_arrival_times_and_lengths():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))
    times, prompts = read_trace(WORKLOADS / "trace.jsonl")
    assert times == pytest.approx((0.0, 0.05, 0.12, 0.30, 0.31, 0.50))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/stream",
            api="lab",
            profile=Profile("trace", times=times),
            requests=len(times),
            prompts=prompts,
            prompts_in_order=True,
        )
        run = await run_load(config)
    assert [r.timing.tokens for r in run.records] == [8, 16, 4, 12, 6, 10]
    assert [r.prompt_words for r in run.records] == [12, 40, 5, 100, 8, 20]
    starts = [record.start_s for record in run.records]
    assert starts == sorted(starts)  # in the trace's order
    for start, at in zip(starts, times, strict=True):
        # Sent at the recorded time: never early; late by a timer's slack, which a loaded
        # 2-core machine stretches (the bound catches a replay that ignores the times).
        assert at - 0.002 <= start <= at + 0.25


async def test_multi_turn_conversations_resend_their_history_with_the_replies_received():
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        reply = f"reply{len(body['messages'])}"
        chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": reply}}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    conversation = Prompt("What is a token?", 11, (Prompt("How many per word?", 7),))
    async with running(app) as url:
        config = LoadConfig(
            url=f"{url}/v1/chat/completions",
            api="openai",
            requests=2,
            model="m",
            prompts=(conversation,),
            system_words=2,
            turns=3,  # the conversation has 2 user turns: it ends there
            warmup=False,
        )
        summary = summarize(await run_load(config))
    assert [r["turn"] for r in summary["requests"]] == [0, 1, 0, 1]
    assert summary["counts"]["complete"] == 4
    system = {"role": "system", "content": "you are"}
    first = [system, {"role": "user", "content": "What is a token?"}]
    # The second turn resends the first and the reply it got (a shared prefix that grows).
    second = [
        *first,
        {"role": "assistant", "content": "reply2"},
        {"role": "user", "content": "How many per word?"},
    ]
    assert [b["messages"] for b in bodies] == [first, second, first, second]
    assert [b["max_tokens"] for b in bodies] == [11, 7, 11, 7]
    # The whole prompt sent: the 2 system words too.
    assert [r["prompt_words"] for r in summary["requests"]] == [6, 11, 6, 11]


def test_sharegpt_conversations_keep_their_follow_up_turns():
    second = read_dataset(WORKLOADS / "sharegpt.jsonl")[1]
    assert second.text == "What is a token?"
    assert second.follow_ups == (Prompt("How many per word?", 7),)


async def test_synthetic_turns_go_to_a_text_api_as_paragraphs_of_history():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/v1/replies",
            api="native",
            requests=2,
            prompt_words=Lengths.parse("3"),
            output_tokens=Lengths.parse("4"),
            turns=3,
        )
        run = await run_load(config)
    assert [r.turn for r in run.records] == [0, 1, 2, 0, 1, 2]
    assert all(r.timing.complete and r.timing.tokens == 4 for r in run.records)
    # Each turn resends 3 prompt words and 4 reply words per earlier turn.
    assert [r.prompt_words for r in run.records] == [3, 10, 17, 3, 10, 17]


async def test_prompt_words_count_the_shared_system_prompt_sent_too():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/v1/replies",
            api="native",
            requests=2,
            prompt_words=Lengths.parse("3"),
            output_tokens=Lengths.parse("4"),
            system_words=5,
            turns=2,
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 4
    # 5 system words and 3 prompt words; the second turn resends the first and its reply.
    assert [r["prompt_words"] for r in summary["requests"]] == [8, 15, 8, 15]


@pytest.mark.parametrize(
    ("api", "path", "estimated"),
    [("openai", "/v1/chat/completions", 4), ("native", "/v1/replies", 0)],
)
async def test_readers_that_left_before_the_usage_are_said_to_count_events_not_tokens(
    api: Api, path: str, estimated: int
) -> None:
    # Four tokens per event: a chat reader that leaves before the usage counts one per
    # event, a quarter of what it was sent; the native events say their own count.
    engine = SimulatedEngine(SimulatedConfig(delay_ms=5.0, jitter_ms=0.0))
    config = ServerConfig(policy=DeliveryPolicy(batch_tokens=4))
    async with running(create_app(engine, config)) as url:
        load = LoadConfig(
            url=f"{url}{path}",
            api=api,
            profile=Profile("concurrent", 2),
            requests=4,
            model="simulated",
            output_tokens=Lengths.parse("100"),
            cancel_share=1.0,
            cancel_after=5,
            server_metrics=metrics_url(url),
        )
        summary = summarize(await run_load(load))
    server = summary["server"]
    assert summary["counts"]["cancelled"] == 4
    assert server["client_counts_estimated"] == estimated
    told = "readers' counts are their events or words" in "\n".join(server_lines(server))
    assert told == bool(estimated)
    if not estimated:  # counted as sent: 8 tokens each (two events of 4 reach the limit)
        assert server["client_tokens_received"] == 4 * 8


async def test_cancelled_readers_stop_the_servers_generation_as_its_metrics_show():
    schedule = ["--delay-ms", "5", "--jitter-ms", "0", "--tokens", "200"]
    async with local_server(schedule) as url:
        config = LoadConfig(
            url=f"{url}/stream",
            api="lab",
            profile=Profile("concurrent", 5),
            requests=12,
            cancel_share=0.5,
            cancel_after=3,
            server_metrics=metrics_url(url),
            metrics_interval_s=0.03,
        )
        summary = summarize(await run_load(config))
    counts = summary["counts"]
    cancelled = [r for r in summary["requests"] if r["error"] and "cancelled" in r["error"]]
    assert counts["cancelled"] == len(cancelled) >= 2 and counts["complete"] >= 2
    assert counts["complete"] + counts["cancelled"] == 12
    assert all(r["tokens"] == 3 for r in cancelled)
    server = summary["server"]
    assert server["replies"] == {"finished": counts["complete"], "cancelled": counts["cancelled"]}
    # Had the server gone on generating for readers that left, each would add 197 tokens;
    # stopping within 100 ms of the reader's leaving (a loaded machine's turn of the loop)
    # adds at most 20.
    assert 0 <= server["excess_tokens"] <= 20 * counts["cancelled"]
    assert server["held_at_end"]["active_streams"] == 0
    # The client's mean first token less the server's: loopback and the client's own turns of
    # its loop, hundreds of milliseconds on a loaded two-core machine (291 ms seen), never the
    # 200-token reply's second.
    assert 0.0 <= server["ttft_gap_ms"] < 1000.0
    # Scraped during the run too: the streams it held, at most the 5 in flight (and a reply
    # whose reader just left, not yet noticed).
    during = server["during"]
    assert during["scrapes"] >= 2 and len(during["series"]) == during["scrapes"]
    assert 1 <= during["held"]["active_streams"]["max"] <= 7
    # Goodput is judged over the replies not cut on purpose.
    assert summary["goodput"]["share_of_requests"] == 1.0


async def test_server_metrics_that_cannot_be_read_are_reported_not_fatal():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=3",
            api="lab",
            requests=2,
            server_metrics=f"{url}/no-metrics-here",
        )
        summary = summarize(await run_load(config))
    assert summary["counts"]["complete"] == 2
    assert "HTTP 404" in summary["server"]["error"]


async def test_a_slow_scrape_during_the_run_is_not_in_its_wall_time():
    """The run is over when its last reply ended: a ``--metrics-interval`` scrape still
    waiting on a slow ``/metrics`` then is no part of the time throughput divides by."""
    app = lab_words()

    async def metrics(request: web.Request) -> web.Response:
        if scrapes:  # every scrape after the one before the run
            await asyncio.sleep(1.5)
        scrapes.append(time.perf_counter())
        return web.Response(text="replystream_active_streams 0\n")

    scrapes: list[float] = []
    app.router.add_get("/metrics", metrics)
    async with running(app) as url:
        config = LoadConfig(
            url=f"{url}/stream",
            api="lab",
            requests=2,
            warmup=False,
            server_metrics=f"{url}/metrics",
            metrics_interval_s=0.01,
        )
        run = await run_load(config)
    summary = summarize(run)
    assert summary["counts"]["complete"] == 2
    # Two replies of 3 words 50 ms apart, one after the other: about 0.3 s, not the 1.5 s
    # a scrape begun with the run waited.
    assert run.wall_s < 1.2, run.wall_s
    assert summary["throughput"]["requests_per_s"] > 2 / 1.2


async def test_dropped_readers_resume_with_last_event_id_losing_and_repeating_nothing():
    schedule = ["--delay-ms", "5", "--jitter-ms", "0", "--tokens", "40"]
    async with local_server(schedule) as url:
        config = LoadConfig(
            url=f"{url}/v1/replies",
            api="native",
            profile=Profile("concurrent", 4),
            requests=10,
            drop_share=0.6,
            drop_after=5,
        )
        summary = summarize(await run_load(config))
    resume = summary["resume"]
    dropped = [r for r in summary["requests"] if r["resume"] is not None]
    assert resume["drops"] == len(dropped) >= 3 and resume["resumed"] == resume["drops"]
    assert (resume["lost"], resume["duplicated"]) == (0, 0)
    assert summary["counts"]["complete"] == 10
    # A resumed reply is read whole: the tokens before the drop and every one after it.
    assert all(r["tokens"] == 40 and r["resume"]["dropped_after_tokens"] == 5 for r in dropped)
    assert all(r["resume"]["dropped"] for r in dropped)
    assert 0.0 < resume["reconnect_ms"]["p50"] < 200.0


async def test_a_reply_that_ends_before_its_drop_is_not_counted_as_dropped():
    schedule = ["--delay-ms", "1", "--jitter-ms", "0", "--tokens", "40"]
    async with local_server(schedule) as url:
        returncode, stdout, stderr = await run_bench(
            *(f"{url}/v1/replies", "--requests", "3", "--drop-share", "1", "--drop-after", "50"),
            *("--output-tokens", "10", "--quiet"),
        )
    assert returncode == 0, stderr.decode()
    # Each reply ended at 10 tokens, before its reader was to drop at 50: nothing to resume.
    assert "Drop and resume: 0 dropped, 0 resumed" in stdout.decode(), stdout.decode()


async def test_drop_and_resume_counts_an_event_lost_and_one_repeated():
    def event(seq: int, kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\nid: {seq}\ndata: {json.dumps(data)}\n\n".encode()

    def token(seq: int) -> bytes:
        return event(seq, "token", {"text": f"t{seq} ", "tokens": 1})

    async def start(request: web.Request) -> web.StreamResponse:
        assert (await request.json())["resumable"] is True
        assert request.headers["Authorization"] == "Bearer k"
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Reply-Id": "r1"}
        )
        await response.prepare(request)
        await response.write(event(1, "reply", {"reply_id": "r1"}) + token(2) + token(3))
        await asyncio.sleep(1)  # the reader drops before this ends
        return response

    async def resume(request: web.Request) -> web.StreamResponse:
        assert request.headers["Last-Event-ID"] == "3"
        assert request.headers["Authorization"] == "Bearer k"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        # 3 again (a duplicate), 4 never sent (lost), then the rest.
        await response.write(token(3) + token(5) + event(6, "done", {"finish_reason": "stop"}))
        return response

    app = web.Application()
    app.router.add_post("/v1/replies", start)
    app.router.add_get("/v1/replies/r1/stream", resume)
    async with running(app) as url:
        timing, outcome = await drop_and_resume(
            f"{url}/v1/replies", {"prompt": "x"}, 2, 5.0, {"Authorization": "Bearer k"}
        )
    assert timing.complete and outcome.resumed
    assert (outcome.lost, outcome.duplicated) == (1, 1)
    assert outcome.reconnect_ms is not None and outcome.reconnect_ms >= 0.0


def test_compare_prints_two_saved_results_side_by_side_with_ratios(tmp_path, capsys):
    def saved(name: str, scale: float) -> Path:
        config = LoadConfig(url="http://h/stream", api="lab", requests=8)
        records = tuple(_record(i, 0.1 * i, 50.0 * scale) for i in range(8))
        path: Path = tmp_path / name
        path.write_text(json.dumps(summarize(LoadRun(config, records, 1.0, 0.1))))
        return path

    code = main(["bench", "--compare", str(saved("a.json", 1.0)), str(saved("b.json", 2.0))])
    out = capsys.readouterr().out
    assert code == 0
    ttft = next(line for line in out.splitlines() if "TTFT p50" in line)
    # A's TTFT 50 ms, B's 100 ms: the ratio B / A is 2.
    assert "50.00" in ttft and "100.00" in ttft and "2.00" in ttft
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep": {}, "runs": []}))
    assert main(["bench", "--compare", str(saved("c.json", 1.0)), str(sweep)]) == 2
    assert "a sweep and the other a single run" in capsys.readouterr().err
    # An output file asked for with --compare would never be written: refused, not ignored.
    both = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert main(["bench", "--compare", *both, "--json", str(tmp_path / "out.json")]) == 2
    assert capsys.readouterr().err == (
        "replystream bench: --json: --compare only prints two results\n"
    )
    assert main(["bench", "--compare", *both, "--concurrency", "3"]) == 2
    assert "--concurrency: --compare only prints two results" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda r: r.pop("throughput"), "(no 'throughput')"),
        (lambda r: r["goodput"].clear(), "(no 'share_of_requests')"),
        (lambda r: r.update(ttft_ms=None), "(a figure is not where bench puts it)"),
        (lambda r: r["ttft_ms"].update(p50="fast"), "(TTFT p50 (ms): 'fast')"),
        (lambda r: r["goodput"].update(share_of_requests="all"), "(good share (%): 'all')"),
    ],
    ids=["no-throughput", "no-share", "ttft-null", "p50-text", "share-text"],
)
def test_compare_refuses_a_file_missing_a_figure_in_one_line(tmp_path, capsys, edit, says):
    config = LoadConfig(url="http://h/stream", api="lab", requests=2)
    records = tuple(_record(i, 0.1 * i, 50.0) for i in range(2))
    result = summarize(LoadRun(config, records, 1.0, 0.1))
    good, edited = tmp_path / "good.json", tmp_path / "edited.json"
    good.write_text(json.dumps(result))
    edit(result)
    edited.write_text(json.dumps(result))
    assert main(["bench", "--compare", str(good), str(edited)]) == 2
    assert capsys.readouterr().err == (
        f"replystream bench: --compare: {edited}: not a result bench wrote with --json {says}\n"
    )


async def test_custom_headers_go_with_every_request_the_model_lookup_and_the_scrapes():
    seen: list[tuple[str, str | None]] = []

    def check(request: web.Request) -> None:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.headers.get("Authorization") != "Bearer k":
            raise web.HTTPUnauthorized()

    async def models(request: web.Request) -> web.Response:
        check(request)
        return web.json_response({"data": [{"id": "m1"}]})

    async def metrics(request: web.Request) -> web.Response:
        check(request)
        return web.Response(text="replystream_tokens_generated_total 0\n")

    async def completions(request: web.Request) -> web.StreamResponse:
        check(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "ok"}}]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", completions)
    headers = {"Authorization": "Bearer k"}
    async with running(app) as url:
        target = f"{url}/v1/chat/completions"
        model = await served_model(target, headers=headers)
        config = LoadConfig(
            url=target,
            api="openai",
            requests=3,
            model=model,
            server_metrics=metrics_url(url),
            metrics_interval_s=0.01,
            headers=tuple(headers.items()),
        )
        summary = summarize(await run_load(config))
    assert model == "m1" and summary["counts"]["complete"] == 3
    assert "error" not in summary["server"]
    paths = {path for path, _ in seen}
    assert paths == {"/v1/models", "/metrics", "/v1/chat/completions"}
    assert all(auth == "Bearer k" for _, auth in seen)


@pytest.mark.parametrize("command", ["bench", "doctor"])
async def test_headers_replace_a_default_in_any_case_and_a_repeated_one_goes_twice(command):
    seen: list[tuple[str, list[tuple[str, str]]]] = []

    def record(request: web.Request) -> None:
        pairs = [(k.decode().lower(), v.decode()) for k, v in request.raw_headers]
        seen.append((request.path, pairs))

    async def models(request: web.Request) -> web.Response:
        record(request)
        return web.json_response({"data": [{"id": "m1"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        record(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("one ", "two"):
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.05)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    given = ["accept-encoding: identity", "X-Tag: a", "X-Tag: b", "accept: text/event-stream"]
    async with running(app) as url:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replystream", command, f"{url}/v1/chat/completions",
            *(["--requests", "1", "--quiet"] if command == "bench" else []),
            *(arg for header in given for arg in ("--header", header)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await process.communicate()
    # doctor's status is its verdict on two events: what matters here is what was sent.
    assert process.returncode in ((0,) if command == "bench" else (0, 1)), stderr.decode()
    assert not stderr, stderr.decode()
    assert {path for path, _ in seen} == {"/v1/models", "/v1/chat/completions"}
    for path, pairs in seen:
        assert [v for k, v in pairs if k == "accept-encoding"] == ["identity"], path
        assert [v for k, v in pairs if k == "accept"] == ["text/event-stream"], path
        assert [v for k, v in pairs if k == "x-tag"] == ["a", "b"], path


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "{url}/stream?max_tokens=3", "--requests", "2"],
        ["bench", "{url}/stream?max_tokens=3", "--requests", "2", "--quiet"],
        ["lab", "--url", "{url}", "--calls", "1", "--tokens", "3", "--json"],
    ],
    ids=["bench", "bench --quiet", "lab --json"],
)
async def test_a_progress_bar_no_one_sees_writes_nothing_on_stderr(argv):
    """stderr is not a terminal here (a CI log, a script): a bar there shows nothing, and
    must not leave the blank line that made a one-line error two lines."""
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "replystream", *(a.format(url=url) for a in argv)),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(60):
            out, err = await process.communicate()
    assert process.returncode == 0, err
    assert out and err == b""


async def test_ctrl_c_stops_a_run_and_reports_what_ended(tmp_path):
    """As load tools do, the first Ctrl-C stops sending, cancels what is in flight and
    reports the requests that ended (exit status 130); nothing is lost to a traceback."""
    started = 0
    measuring = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal started
        started += 1
        if started == 6:  # the warm-up and a few measured requests
            measuring.set()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for word in ("a ", "b ", "c"):
            body = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(body)}\n\n".encode())
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    out_json = tmp_path / "run.json"
    async with running(app) as url:
        code, out, err = await bench_until_ctrl_c(
            measuring,
            *(f"{url}/v1/chat/completions", "--model", "m", "--concurrency", "2"),
            *("--duration", "600", "--json", str(out_json)),
        )
    assert code == 130, err
    assert err == b""
    assert "interrupted (Ctrl-C)" in out.decode()
    result = json.loads(await asyncio.to_thread(out_json.read_text))
    counts = result["counts"]
    assert counts["interrupted"] is True
    assert counts["complete"] >= 3 and counts["requests"] == len(result["requests"])
    assert counts["requests"] < started  # the warm-up and the cancelled ones are not counted


async def test_ctrl_c_counts_the_requests_it_cancelled_in_flight_as_sent(tmp_path):
    """After the warm-up and 4 measured requests the server answers no more: two readers
    each have one request in flight when Ctrl-C comes, so 6 were sent and 4 ended."""
    arrived = 0
    both_waiting = asyncio.Event()
    never = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if arrived > 5:
            if arrived == 7:
                both_waiting.set()
            await never.wait()  # until the reader hangs up
        await response.write(b'data: "a"\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    out_json = tmp_path / "run.json"
    async with running(app) as url:
        code, out, err = await bench_until_ctrl_c(
            both_waiting,
            *(f"{url}/stream", "--quiet", "--concurrency", "2"),
            *("--duration", "600", "--json", str(out_json)),
        )
    assert code == 130, err
    lines = out.decode().splitlines()
    assert "Requests: 6 sent, 4 complete, 0 incomplete, 0 failed, 0 cancelled on purpose" in lines
    assert any(
        line.startswith("  interrupted (Ctrl-C): 2 in flight were cancelled") for line in lines
    )
    counts = json.loads(await asyncio.to_thread(out_json.read_text))["counts"]
    assert (counts["sent"], counts["requests"], counts["complete"]) == (6, 4, 4)
    assert counts["in_flight_cancelled"] == 2


async def test_the_client_cpu_line_divides_by_the_wall_it_shows(tmp_path):
    """The CPU share is over the whole run; the line showed the wall of the figures (the
    run less its warm-up window) beside it, so its arithmetic did not hold."""
    out_json = tmp_path / "run.json"
    engine = SimulatedEngine(SimulatedConfig(delay_ms=2.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "replystream", "bench", f"{url}/stream?max_tokens=3"),
            *("--rate", "20", "--duration", "2", "--warmup-s", "1", "--quiet"),
            *("--json", str(out_json)),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
    assert process.returncode == 0
    result = json.loads(await asyncio.to_thread(out_json.read_text))
    client, measured = result["client"], result["throughput"]["wall_s"]
    assert client["wall_s"] > measured + 0.9  # the warm-up second is in the client's wall
    assert client["cpu_share_of_one_core"] == pytest.approx(client["cpu_s"] / client["wall_s"])
    line = next(x for x in out.decode().splitlines() if x.startswith("Load client CPU: "))
    assert f" s over {client['wall_s']:,.2f} s wall = " in line, line


async def test_a_run_inside_its_own_warmup_window_is_one_line_not_a_success():
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "replystream", "bench", f"{url}/stream?max_tokens=3"),
            *("--requests", "2", "--warmup-s", "600", "--quiet"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
    assert process.returncode == 2
    lines = err.decode().splitlines()
    assert len(lines) == 1 and out == b"", err
    assert lines[0].startswith("replystream bench: --warmup-s 600: all 2 requests were sent "), err


async def test_a_server_gone_mid_run_meets_readers_that_back_off():
    """A closed loop whose server went away mid-run retried as fast as refusals came back
    (10,000 in 4 s); its readers back off now, and the run goes on to its duration."""
    schedule = ("--engine", "simulated", "--delay-ms", "1", "--jitter-ms", "0")
    async with replica(*schedule) as (server, url):
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=3",
            api="lab",
            profile=Profile("concurrent", 2),
            requests=None,
            duration_s=3.0,
            warmup=False,
        )
        async with asyncio.TaskGroup() as group:
            running_load = group.create_task(run_load(config))
            await asyncio.sleep(0.5)
            server.kill()  # gone: every later request is refused at once
            await server.wait()
    run = running_load.result()
    refused = [r for r in run.records if not r.timing.connected]
    assert any(r.timing.complete for r in run.records)
    assert run.unreachable is None  # it was reached: the run went on
    assert 2 <= len(refused) < 100, len(refused)
    assert run.wall_s < 3.5


async def test_the_servers_account_says_what_its_kv_pool_cost_in_preemptions(capsys):
    """The built-in engine on a pool too small for the load: the bench reads its preemptions
    and recomputed tokens off /metrics, as the engine's scheduler counted them."""
    engine = load_default_engine(TinyEngineConfig(num_blocks=10, block_size=16))
    app = create_app(engine)
    add_state_gauges(app)
    async with running(app) as url:
        argv = ["bench", f"{url}/stream?max_tokens=60", "--requests", "4", "--concurrency", "4"]
        code = await asyncio.to_thread(main, [*argv, "--server-metrics", "--quiet"])
    out = capsys.readouterr().out
    counted = engine.scheduler_stats()
    assert code == 0 and counted.preemptions > 0, out
    said = f"engine: {counted.preemptions} preemptions for KV blocks, {counted.recomputed} tokens"
    assert said in out, out


async def test_a_multi_turn_bench_reads_what_the_engines_prefix_cache_saved(capsys):
    """Conversations resending their history to an engine with prefix caching: the bench's
    server account gives the prompt tokens the engine found in its cache over the run."""
    engine = load_default_engine(TinyEngineConfig(prefix_caching=True))
    app = create_app(engine)
    add_state_gauges(app)
    async with running(app) as url:
        argv = ["bench", f"{url}/v1/chat/completions", "--requests", "2", "--turns", "3"]
        argv += ["--output-tokens", "8", "--system-prompt-words", "40", "--server-metrics"]
        code = await asyncio.to_thread(main, [*argv, "--quiet"])
    out = capsys.readouterr().out
    hits = engine.scheduler_stats().prefix_hit_tokens  # the warm-up, first, found none
    assert code == 0 and hits > 0, out
    assert f"{hits} prompt tokens from its prefix cache" in out, out


async def test_an_open_loops_sends_behind_schedule_are_measured_and_reported(tmp_path):
    # A client that falls behind its schedule (busy, or starved by other work) sends late;
    # every latency runs from the actual send, so the lag must be shown beside them, not
    # vanish from the figures.
    engine = SimulatedEngine(SimulatedConfig(delay_ms=1.0, jitter_ms=0.0))
    async with serve_engine(engine) as url:
        config = LoadConfig(
            url=f"{url}/stream?max_tokens=2",
            api="lab",
            profile=Profile("constant", rate=20.0),
            requests=10,
            warmup=False,
        )
        # The client's loop stalls 0.3 s once, 0.12 s in: arrivals 3 to 8 are due then.
        asyncio.get_running_loop().call_later(0.12, time.sleep, 0.3)
        run = await run_load(config)
    summary = summarize(run)
    requests = summary["requests"]
    assert [r["scheduled_s"] for r in requests] == pytest.approx([i / 20 for i in range(10)])
    for request in requests:
        assert request["send_lag_ms"] == pytest.approx(
            (request["start_s"] - request["scheduled_s"]) * 1e3
        )
    lag = summary["send_lag_ms"]
    assert lag["count"] == 10
    assert lag["max"] >= 250.0  # the one due at 0.15 s went at about 0.42 s
    console = Console(record=True, width=200)
    render(summary, console)
    assert "Sends behind schedule (open loop)" in console.export_text()
    write_csv(summary, tmp_path / "run.csv")
    rows = list(csv.DictReader((tmp_path / "run.csv").read_text(encoding="utf-8").splitlines()))
    assert [float(row["send_lag_ms"]) for row in rows] == pytest.approx(
        [r["send_lag_ms"] for r in requests]
    )


async def test_a_closed_loop_has_no_schedule_to_fall_behind(scheduled_server):
    config = LoadConfig(url=f"{scheduled_server}/stream", api="lab", requests=2, warmup=False)
    summary = summarize(await run_load(config))
    assert all(r["scheduled_s"] is None and r["send_lag_ms"] is None for r in summary["requests"])
    assert summary["send_lag_ms"]["count"] == 0
