"""The command line of ``replystream bench``: its flags, which fit together, and the load and
sweep configs they make.

This file decides every flag's range (refused while parsing, with one line naming it) and
every combination that cannot work (a flag that does not fit the profile, a trace with its own
arrivals, a drop on an API that cannot resume, TLS options for an http:// URL), refused before
anything is sent; it reads the workload files the flags name and the CA file, into the TLS
context every request uses. It must not send a request or compute a metric.
"""

from __future__ import annotations

import argparse
import re
import ssl
from collections.abc import Callable
from typing import TypeVar

from replystream.cli_values import (
    Checker,
    float_at_least,
    float_between,
    int_between,
    non_negative_float,
    non_negative_int,
    output_file,
    output_folder,
    positive_float,
    positive_int,
    readable_file,
    utf8_text,
    web_url,
)
from replystream.client.transport import tls_context
from replystream.lab.bench_plots import RUN_PLOTS, SWEEP_PLOTS
from replystream.lab.benchstats import SLO
from replystream.lab.datasets import read_dataset, read_trace
from replystream.lab.drop_resume import CURSORS
from replystream.lab.load import LoadConfig
from replystream.lab.open_files import OWN_FILES, make_room
from replystream.lab.profiles import PROFILE_KINDS, Profile
from replystream.lab.server_metrics import metrics_url
from replystream.lab.sweep import SweepConfig
from replystream.lab.workload import (
    APIS,
    MODEL_APIS,
    MOST_PROMPT_WORDS,
    Lengths,
    Prompt,
    detect_api,
)

T = TypeVar("T")

# The longest a run is planned to last: a week, past any load test's, so that a value whose
# run could never end (a gap of 1e300 s) is refused rather than waited for.
LONGEST_RUN_S = 7 * 24 * 3600.0
# A sweep's constant-rate runs: each is a whole run, and a hundred already maps a curve finely.
MOST_SWEEP_STEPS = 100
# Scrapes during a run come at least this far apart: one is an HTTP request to the server
# being measured, so a shorter interval would load it with scrapes, back to back.
LEAST_METRICS_INTERVAL_S = 0.01


def _slo_list(text: str) -> tuple[SLO, ...]:
    try:
        return SLO.parse_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# One --slo value: METRIC=MS pairs separated by commas.
slo_list = Checker("METRIC=MS[,METRIC=MS...] (ttft, tpot, itl, e2el)", _slo_list)
_share = float_at_least(0.0, strict=True, note="a share of requests, at most 1")


def _share_at_most_one(text: str) -> float:
    value = _share(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"want {_share.wants}, got {text}")
    return value


share = Checker(_share.wants, _share_at_most_one)
_cancel = float_at_least(0.0, note="a share of conversations, at most 1")


def _cancel_share(text: str) -> float:
    value = _cancel(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"want {_cancel.wants}, got {text}")
    return value


# Headers the measuring client writes itself: one sent by the user would be a second copy.
_OWN_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not colon or not _TOKEN.fullmatch(name) or any(c in value for c in "\r\n\0"):
        raise argparse.ArgumentTypeError(f"want 'NAME: VALUE' (one line), got {text!r}")
    # The client writes headers as ASCII (as HTTP/1.1 fields are in practice): anything else
    # could not be sent, and would fail every request with a traceback.
    if not all(c == "\t" or " " <= c <= "~" for c in value):
        raise argparse.ArgumentTypeError(
            f"a header value is printable ASCII (percent- or base64-encode the rest), got {text!r}"
        )
    if name.lower() in _OWN_HEADERS:
        raise argparse.ArgumentTypeError(f"{name} is written by the client itself")
    return name, value


header = Checker("'NAME: VALUE', a header the client does not write itself", _header)

# --cancel-share and --drop-share: a share of conversations, 0 (none) to 1.
cancel_share = Checker(_cancel.wants, _cancel_share)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        type=web_url,
        nargs="?",
        help="endpoint, http:// or https://: .../stream, .../v1/replies, .../chat/completions "
        "or .../v1/responses (not with --compare)",
    )
    parser.add_argument(
        "--cacert",
        type=readable_file,
        metavar="FILE",
        help="https: verify the server's certificate against the CAs in this PEM file "
        "(default: the system's)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="https: do not verify the server's certificate or name (a self-signed test "
        "server; the figures are a TLS server's, the trust is none)",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        type=readable_file,
        metavar=("A.json", "B.json"),
        help="print two results --json wrote side by side, with B / A ratios, and send nothing",
    )
    parser.add_argument(
        "--api",
        choices=["auto", *APIS],
        default="auto",
        help="request shape (auto: from the URL path)",
    )
    parser.add_argument(
        "--profile",
        choices=[*PROFILE_KINDS, "sweep"],
        help="pacing: synchronous, concurrent (--concurrency), throughput (all at once), "
        "constant or poisson (--rate), sweep (synchronous to saturation, finds the knee); "
        "default: poisson with --rate, concurrent with --concurrency, else synchronous",
    )
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency", type=positive_int, help="concurrent profile: requests in flight"
    )
    loop.add_argument(
        "--rate", type=positive_float, help="constant or poisson profile: requests per second"
    )
    parser.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="poisson profile: gamma shape of the gaps (1: Poisson, <1 burstier, >1 more regular)",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        help="requests per run (default 10 without --duration; sweep and throughput need it)",
    )
    parser.add_argument(
        "--duration", type=positive_float, help="per run: stop sending new requests after S s"
    )
    parser.add_argument(
        "--warmup-s",
        type=non_negative_float,
        default=0.0,
        help="per run: requests sent in the first S s are kept in the JSON but left out of "
        "every figure",
    )
    parser.add_argument(
        "--steady-bound",
        type=positive_float,
        default=0.5,
        help="a run is unsteady when its second half's median TTFT or TPOT differs from its "
        "first half's by more than this share",
    )
    parser.add_argument(
        "--sweep-steps",
        type=int_between(1, MOST_SWEEP_STEPS),
        help="sweep profile: constant rates between the synchronous rate and the maximum "
        f"(default 5, at most {MOST_SWEEP_STEPS})",
    )
    parser.add_argument(
        "--prompt-words",
        help="prompt length in words: N, uniform:LO:HI, normal:MEAN:SD or hist:FILE (lines of "
        "LENGTH WEIGHT) (default 0)",
    )
    parser.add_argument(
        "--output-tokens",
        help="max_tokens per request: N, uniform:LO:HI, normal:MEAN:SD or hist:FILE "
        "(default: the dataset's or trace's, else the server's)",
    )
    parser.add_argument(
        "--dataset",
        type=readable_file,
        metavar="FILE",
        help="prompts to draw from: JSONL (or a JSON array) of {prompt, output_tokens}, "
        "ShareGPT conversations or chat messages",
    )
    parser.add_argument(
        "--trace",
        type=readable_file,
        metavar="FILE",
        help="replay a trace: JSONL of {timestamp, prompt_words, output_tokens}, sent at "
        "the recorded times (the trace profile)",
    )
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=1,
        help="turns per conversation, each resending the conversation so far (a dataset's "
        "conversations give theirs, up to N); --requests then counts conversations",
    )
    parser.add_argument(
        "--cancel-share",
        type=cancel_share,
        default=0.0,
        help="a share of conversations whose reader hangs up after --cancel-after tokens",
    )
    parser.add_argument(
        "--cancel-after",
        type=positive_int,
        help="tokens a cancelling reader reads before it hangs up (with --cancel-share)",
    )
    parser.add_argument(
        "--drop-share",
        type=cancel_share,
        default=0.0,
        help="native or Responses API: a share of conversations whose reader drops after "
        "--drop-after tokens and resumes where it left off (a Responses request is then sent "
        "with store and background, the only kind OpenAI's API resumes)",
    )
    parser.add_argument(
        "--resume-cursor",
        choices=CURSORS,
        help="with --drop-share: say where the reader left off with the Last-Event-ID header "
        "(header, the default) or the route's query parameter (query: last_event_id native, "
        "starting_after Responses, as OpenAI's SDK sends it)",
    )
    parser.add_argument(
        "--drop-after",
        type=positive_int,
        help="tokens a dropping reader reads before its connection drops (with --drop-share)",
    )
    parser.add_argument(
        "--server-metrics",
        action="store_true",
        help="scrape the Prometheus /metrics beside the endpoint before and after each run "
        "and report the server's figures beside the client's",
    )
    parser.add_argument(
        "--metrics-interval",
        type=float_between(LEAST_METRICS_INTERVAL_S, LONGEST_RUN_S),
        metavar="S",
        help="with --server-metrics: also scrape every S s during each run (active streams, "
        f"engine requests, KV blocks: mean and peak), at least {LEAST_METRICS_INTERVAL_S:g} s",
    )
    parser.add_argument(
        "--system-prompt-words",
        type=int_between(0, MOST_PROMPT_WORDS),
        default=0,
        help="a system prompt of N words every request shares (a common prefix)",
    )
    parser.add_argument(
        "--header",
        action="append",
        type=header,
        default=[],
        metavar="'NAME: VALUE'",
        help="a header sent with every request, resume and scrape (repeatable), e.g. "
        "'Authorization: Bearer KEY'",
    )
    parser.add_argument(
        "--model",
        type=utf8_text,
        help="model name, openai and responses APIs only (default: the one the server's "
        "/v1/models lists)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds arrival times and lengths"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=300.0, help="per-request timeout, s"
    )
    parser.add_argument(
        "--slo",
        nargs="+",
        action="extend",  # --slo given twice adds to the bounds, as one list would
        type=slo_list,
        default=[],
        metavar="METRIC=MS[,...]",
        help="goodput bounds, e.g. ttft=200,itl=50,e2el=3000 (metrics: ttft, tpot, itl: "
        "every gap, e2el; METRIC:MS is read too)",
    )
    parser.add_argument(
        "--slo-share",
        type=share,
        default=0.95,
        help="goodput holds when at least this share of requests meets every --slo",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="do not send one unrecorded request first"
    )
    parser.add_argument(
        "--json", type=output_file, metavar="FILE", help="write the full result here"
    )
    parser.add_argument(
        "--csv", type=output_file, metavar="FILE", help="write one row per request here"
    )
    parser.add_argument("--plot", type=output_folder, metavar="DIR", help="write PNG plots here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


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
    if args.duration is not None and args.warmup_s >= args.duration:
        raise ValueError("--warmup-s must be shorter than --duration")
    if kind == "sweep":
        return None
    return Profile(kind, concurrency=args.concurrency, rate=args.rate, burstiness=args.burstiness)


def tls_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context for an https URL (None for http://, which has no TLS options); raises
    ValueError for a flag that does not fit."""
    if not args.url.lower().startswith("https://"):
        if args.cacert is not None:
            raise ValueError("--cacert verifies an https server: the URL is http://")
        if args.insecure:
            raise ValueError("--insecure skips verifying an https server: the URL is http://")
        return None
    if args.insecure and args.cacert is not None:
        raise ValueError("--insecure verifies nothing, so --cacert would not be used: drop one")
    try:
        return tls_context(args.cacert, verify=not args.insecure)
    except (ssl.SSLError, OSError) as exc:
        why = f"{args.cacert} holds no usable PEM certificate ({exc})"
        raise ValueError(f"--cacert: {why}") from None


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
    raised as far as the run needs when the hard one allows it, as load tools do."""
    if args.concurrency is not None:
        flag, at_once = f"--concurrency {args.concurrency}", args.concurrency
        if requests is not None:  # no more readers than conversations start
            at_once = min(at_once, requests)
    elif args.profile in ("throughput", "sweep") and requests is not None:
        flag, at_once = f"--requests {requests}", requests  # a burst: every one at once
    else:
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
    names = [slo.metric for slo in slos]
    if len(set(names)) != len(names):
        raise ValueError("--slo: each metric may be bounded once")
    config = LoadConfig(
        url=args.url,
        api=api,
        profile=profile or Profile.synchronous(),
        requests=requests,
        duration_s=args.duration,
        prompt_words=_read(
            "--prompt-words",
            lambda: Lengths.parse(args.prompt_words or "0", minimum=0, maximum=MOST_PROMPT_WORDS),
        ),
        output_tokens=_read("--output-tokens", lambda: Lengths.parse(args.output_tokens, minimum=1))
        if args.output_tokens
        else None,
        prompts=prompts,
        prompts_in_order=args.trace is not None,
        system_words=args.system_prompt_words,
        turns=args.turns,
        cancel_share=args.cancel_share,
        cancel_after=args.cancel_after or 1,
        drop_share=args.drop_share,
        drop_after=args.drop_after or 1,
        server_metrics=metrics_url(args.url) if args.server_metrics else None,
        metrics_interval_s=args.metrics_interval,
        resume_cursor=args.resume_cursor or "header",
        headers=tuple(args.header),
        tls=tls_from_args(args),
        model=args.model or model or "default",
        seed=args.seed,
        timeout_s=args.timeout,
        warmup=not args.no_warmup,
    )
    sweep = SweepConfig(
        steps=args.sweep_steps or 5,
        slos=slos,
        slo_share=args.slo_share,
        warmup_s=args.warmup_s,
        steady_bound=args.steady_bound,
    )
    return config, sweep
