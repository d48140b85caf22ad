"""Which flags of ``replystream bench`` fit together, and the load and sweep configs they make.

This file decides every combination that cannot work (a flag that does not fit the profile, a
trace with its own arrivals, a drop on an API that cannot resume, TLS options for an http://
URL), refused before anything is sent; it reads the workload files the flags name and the CA
file, into the TLS context every request uses. The flags themselves, and each one's range, are
``bench_args``. It must not send a request or compute a metric.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.lab.bench_args import DEFAULT_SLO_SHARE, LONGEST_RUN_S
from replystream.lab.client_options import tls_for
from replystream.lab.datasets import read_dataset, read_trace
from replystream.lab.load_types import LoadConfig
from replystream.lab.open_files import OWN_FILES, make_room, make_room_for_up_to
from replystream.lab.profiles import Profile
from replystream.lab.server_metrics import metrics_url
from replystream.lab.sweep import SweepConfig
from replystream.lab.workload import MODEL_APIS, MOST_PROMPT_WORDS, Lengths, Prompt, detect_api

T = TypeVar("T")

# The files --plot writes (``bench_plots``): for one run, and for a sweep.
RUN_PLOTS = ("ttft_cdf.png", "gap_histogram.png", "timeline.png")
SWEEP_PLOTS = ("sweep_latency.png", "sweep_distributions.png")
# An open loop's requests that may be in flight at once get room up to this many connections
# (the hard limit allowing): past it, a run's requests are not meant to overlap.
MOST_OPEN_ROOM = 1 << 20


def profile_from_args(
    args: argparse.Namespace, trace_times: tuple[float, ...] = ()
) -> Profile | None:
    """The profile of one run the options ask for (None for a sweep; the trace profile when
    ``trace_times`` are given); raises ValueError naming the flag that does not fit."""
    kind = args.profile
    if trace_times:
        for flag, value in (
            ("--profile", args.profile),
            ("--rate", args.rate),
            ("--concurrency", args.concurrency),
            ("--sweep-steps", args.sweep_steps),
        ):
            if value is not None:
                raise ValueError(f"{flag}: a --trace replays its own arrival times")
        if args.burstiness != 1.0:
            raise ValueError("--burstiness: a --trace replays its own arrival times")
        if args.duration is not None and args.warmup_s >= args.duration:
            raise ValueError("--warmup-s must be shorter than --duration")
        return Profile("trace", times=trace_times)
    if kind is None:
        kind = "synchronous"
        if args.rate is not None:
            kind = "poisson"
        elif args.concurrency is not None:
            kind = "concurrent"
    wants_rate = kind in ("constant", "poisson")
    if args.rate is not None and not wants_rate:
        raise ValueError(f"--rate paces the constant and poisson profiles, not {kind}")
    if args.rate is None and wants_rate:
        raise ValueError(f"--profile {kind} needs --rate")
    if args.concurrency is not None and kind != "concurrent":
        raise ValueError(f"--concurrency sets the concurrent profile, not {kind}")
    if args.concurrency is None and kind == "concurrent":
        raise ValueError("--profile concurrent needs --concurrency")
    if args.burstiness != 1.0 and kind != "poisson":
        raise ValueError(f"--burstiness shapes the poisson profile's gaps, not {kind}'s")
    if args.sweep_steps is not None and kind != "sweep":
        raise ValueError(f"--sweep-steps sets the sweep profile, not {kind}")
    if kind in ("sweep", "throughput") and args.requests is None:
        raise ValueError(
            f"--profile {kind} sends a burst of every request at once: give --requests"
        )
    if kind == "throughput" and args.warmup_s:
        raise ValueError("--warmup-s: the throughput profile sends every request at once")
    if kind == "throughput" and args.duration is not None:
        # Every arrival is at 0, so no duration could stop one: it would be taken and ignored.
        raise ValueError(
            "--duration: the throughput profile sends every request at once; --requests "
            "says how many"
        )
    if args.duration is not None and args.warmup_s >= args.duration:
        raise ValueError("--warmup-s must be shorter than --duration")
    if kind == "sweep":
        return None
    return Profile(kind, concurrency=args.concurrency, rate=args.rate, burstiness=args.burstiness)


def _check_run_ends(
    args: argparse.Namespace, requests: int | None, trace_times: tuple[float, ...]
) -> None:
    """Refuse arrival times that would leave the run waiting past any run's end: a rate or a
    trace whose requests span more than ``LONGEST_RUN_S`` (with nothing else to end the run),
    and a rate whose mean gap is no shorter than ``--duration`` (about one request sent)."""
    if args.rate is not None:
        gap = 1.0 / args.rate
        if args.duration is not None:
            if gap >= args.duration:
                raise ValueError(
                    f"--rate {args.rate:g}: its mean gap, {gap:.3g} s, is not shorter than "
                    f"--duration {args.duration:g}: about one request would be sent; raise --rate"
                )
        elif requests is not None and (span := (requests - 1) * gap) > LONGEST_RUN_S:
            raise ValueError(
                f"--rate {args.rate:g}: {requests} requests at this rate span about {span:.3g} s, "
                f"past the longest run bench plans, a week ({LONGEST_RUN_S:,.0f} s); raise "
                "--rate, or end the run with --duration"
            )
    if trace_times and args.duration is None and requests is not None:
        span = trace_times[requests - 1]
        if span > LONGEST_RUN_S:
            raise ValueError(
                f"--trace: {args.trace}: request {requests} comes {span:.3g} s after the first, "
                f"past the longest run bench plans, a week ({LONGEST_RUN_S:,.0f} s); replay "
                "part of it with --requests or --duration"
            )


def _check_at_once(args: argparse.Namespace, requests: int | None) -> None:
    """Refuse more requests at once than this process can hold connections for: each is a
    task and a socket, so 10**9 readers exhausted memory before the first request, and any
    past the open-file limit could only fail. The soft limit (``ulimit -n``, often 1,024) is
    raised as far as the run needs when the hard one allows it, as load tools do; an open
    loop's, which holds as many as a slow server keeps in flight, is raised toward its
    requests (and never refused)."""
    if args.concurrency is not None:
        flag, at_once = f"--concurrency {args.concurrency}", args.concurrency
        if requests is not None:  # no more readers than conversations start
            at_once = min(at_once, requests)
    elif args.profile in ("throughput", "sweep") and requests is not None:
        flag, at_once = f"--requests {requests}", requests  # a burst: every one at once
    else:
        if args.rate is not None or args.trace is not None:  # an open loop
            if requests is None:  # a --duration's worth of arrivals (a float may be inf)
                requests = int(min(args.rate * args.duration, float(MOST_OPEN_ROOM))) + 1
            make_room_for_up_to(min(requests, MOST_OPEN_ROOM))
        return
    limit = make_room(at_once)
    if limit is None:
        return
    raise ValueError(
        f"{flag}: {at_once:,} requests at once would each hold a connection, and this process "
        f"may open {limit:,} files (ulimit -Hn), {OWN_FILES} of them for itself; lower it, or "
        "raise the limit (or share the load among several bench processes)"
    )


def _read(flag: str, read: Callable[[], T]) -> T:
    """``read()``, its ValueError prefixed with the flag whose value it read."""
    try:
        return read()
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def config_from_args(
    args: argparse.Namespace, model: str | None = None
) -> tuple[LoadConfig, SweepConfig]:
    """The load (its profile the first run's, for a sweep) and how runs are judged, from
    the options (``model``: the one the server lists, when ``--model`` named none); raises
    ValueError for bad values."""
    trace_times: tuple[float, ...] = ()
    prompts: tuple[Prompt, ...] = ()
    if args.trace is not None:
        for flag, value in (("--dataset", args.dataset), ("--prompt-words", args.prompt_words)):
            if value is not None:
                raise ValueError(f"{flag}: a --trace gives each request's prompt length")
        if args.turns != 1:
            raise ValueError("--turns: a --trace replays single requests")
        trace_times, prompts = _read("--trace", lambda: read_trace(args.trace))
    elif args.dataset is not None:
        if args.prompt_words is not None:
            raise ValueError("--prompt-words: the --dataset gives the prompts")
        prompts = _read("--dataset", lambda: read_dataset(args.dataset))
    profile = profile_from_args(args, trace_times)
    if (args.cancel_after is None) != (args.cancel_share == 0):
        raise ValueError("--cancel-share and --cancel-after go together (a share above 0)")
    if (args.drop_after is None) != (args.drop_share == 0):
        raise ValueError("--drop-share and --drop-after go together (a share above 0)")
    if args.cancel_share + args.drop_share > 1:
        raise ValueError("--drop-share: with --cancel-share it must not pass 1")
    requests = args.requests
    if args.trace is not None:
        requests = min(requests or len(trace_times), len(trace_times))
    if requests is None and args.duration is None:
        requests = 10
    _check_run_ends(args, requests, trace_times)
    _check_at_once(args, requests)
    api = detect_api(args.url) if args.api == "auto" else args.api
    if args.metrics_interval is not None and not args.server_metrics:
        raise ValueError("--metrics-interval scrapes during a run: it needs --server-metrics")
    if args.drop_share and api not in ("native", "responses"):
        raise ValueError(
            f"--drop-share resumes on the native API (.../v1/replies) or the Responses API "
            f"(.../v1/responses), not {api}"
        )
    if args.resume_cursor is not None and not args.drop_share:
        raise ValueError("--resume-cursor says how a dropped reader resumes: add --drop-share")
    if args.model is not None and api not in MODEL_APIS:
        raise ValueError(f"--model names the model of an OpenAI request; the {api} API has none")
    if args.plot is not None:
        # A folder where a plot goes would be found only after the run, by a traceback.
        plots = SWEEP_PLOTS if args.profile == "sweep" else RUN_PLOTS
        held = [args.plot / name for name in plots if (args.plot / name).is_dir()]
        if held:
            raise ValueError(f"--plot {args.plot}: {held[0]} is a folder where a plot goes")
    if args.json and args.csv and args.json.resolve() == args.csv.resolve():
        raise ValueError(f"--csv {args.csv} is the --json file too: the CSV would replace it")
    slos = tuple(slo for group in args.slo for slo in group)
    if args.slo_share is not None and not slos and args.profile != "sweep":
        raise ValueError(
            "--slo-share is the share of requests that must meet every --slo: add --slo"
        )
    if args.ignore_eos:
        if api == "lab":
            raise ValueError("--ignore-eos: the lab endpoint takes no ignore_eos")
        given = args.output_tokens is not None or (
            prompts and all(p.output_tokens is not None for p in prompts)
        )
        if not given:
            raise ValueError(
                "--ignore-eos runs each reply to its max_tokens: give --output-tokens (or a "
                "dataset or trace whose prompts give output_tokens)"
            )
    names = [slo.metric for slo in slos]
    if len(set(names)) != len(names):
        raise ValueError("--slo: each metric may be bounded once")
    config = LoadConfig(
        url=args.url,
        api=api,
        profile=profile or Profile.synchronous(),
        requests=requests,
        duration_s=args.duration,
        # Not given is the default; given empty is a mistake, not the default.
        prompt_words=_read(
            "--prompt-words",
            lambda: Lengths.parse(
                "0" if args.prompt_words is None else args.prompt_words,
                minimum=0,
                maximum=MOST_PROMPT_WORDS,
            ),
        ),
        # A reply longer than any server's max_tokens would be refused by every server.
        output_tokens=_read(
            "--output-tokens",
            lambda: Lengths.parse(args.output_tokens, minimum=1, maximum=MAX_TOKENS_LIMIT),
        )
        if args.output_tokens is not None
        else None,
        prompts=prompts,
        prompts_in_order=args.trace is not None,
        system_words=args.system_prompt_words,
        turns=args.turns,
        ignore_eos=args.ignore_eos,
        cancel_share=args.cancel_share,
        cancel_after=args.cancel_after or 1,
        drop_share=args.drop_share,
        drop_after=args.drop_after or 1,
        server_metrics=metrics_url(args.url) if args.server_metrics else None,
        metrics_interval_s=args.metrics_interval,
        resume_cursor=args.resume_cursor or "header",
        headers=tuple(args.header),
        tls=tls_for([args.url], args.cacert, args.insecure),
        model=args.model or model or "default",
        seed=args.seed,
        timeout_s=args.timeout,
        warmup=not args.no_warmup,
    )
    sweep = SweepConfig(
        steps=args.sweep_steps or 5,
        slos=slos,
        slo_share=DEFAULT_SLO_SHARE if args.slo_share is None else args.slo_share,
        warmup_s=args.warmup_s,
        steady_bound=args.steady_bound,
    )
    return config, sweep
