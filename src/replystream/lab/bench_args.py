"""The flags of ``replystream bench``: each one's type, range, default and help.

This file decides every flag's range (refused while parsing, with one line naming it); which
flags fit together, and the load and sweep configs they make, are ``bench_config``. It must not
send a request or compute a metric.
"""

from __future__ import annotations

import argparse

from replystream.cli_values import (
    Checker,
    float_at_least,
    float_between,
    int_between,
    non_empty_text,
    non_negative_float,
    non_negative_int,
    output_file,
    output_folder,
    positive_float,
    positive_int,
    readable_file,
    web_url,
)
from replystream.lab.benchstats import SLO
from replystream.lab.client_options import add_client_arguments
from replystream.lab.drop_resume import CURSORS
from replystream.lab.profiles import PROFILE_KINDS
from replystream.lab.workload import APIS, MOST_PROMPT_WORDS

# The longest a run is planned to last: a week, past any load test's, so that a value whose
# run could never end (a gap of 1e300 s) is refused rather than waited for.
LONGEST_RUN_S = 7 * 24 * 3600.0
# A sweep's constant-rate runs: each is a whole run, and a hundred already maps a curve finely.
MOST_SWEEP_STEPS = 100
# Scrapes during a run come at least this far apart: one is an HTTP request to the server
# being measured, so a shorter interval would load it with scrapes, back to back.
LEAST_METRICS_INTERVAL_S = 0.01


# The share of requests that must meet every --slo for goodput to hold, unless told.
DEFAULT_SLO_SHARE = 0.95


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


# --cancel-share and --drop-share: a share of conversations, 0 (none) to 1.
cancel_share = Checker(_cancel.wants, _cancel_share)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        type=web_url,
        nargs="?",
        help="endpoint, http:// or https://: .../stream, .../v1/replies, .../chat/completions, "
        ".../v1/responses or .../v1/messages (not with --compare)",
    )
    add_client_arguments(
        parser,
        header_help="a header sent with every request, resume and scrape (repeatable), e.g. "
        "'Authorization: Bearer KEY'",
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
        "--ignore-eos",
        action="store_true",
        help="ask each reply to run to its max_tokens, past the model's end token (vLLM's, "
        "SGLang's, llama.cpp's and replystream's ignore_eos; under replystream on the Responses "
        "and Messages APIs): replies of the lengths asked for, whatever the model says",
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
        "--model",
        type=non_empty_text,
        help="model name, openai, responses and messages APIs only (default: the one the "
        "server's /v1/models lists)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds arrival times and lengths"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=300.0, help="per-request timeout, s"
    )
    parser.add_argument(
        "--slo",
        # One value each, so a URL after it is the URL; given again, it adds to the bounds.
        action="append",
        type=slo_list,
        default=[],
        metavar="METRIC=MS[,...]",
        help="goodput bounds, e.g. ttft=200,itl=50,e2el=3000 (metrics: ttft, tpot, itl: "
        "every gap, e2el; METRIC:MS is read too; repeatable)",
    )
    parser.add_argument(
        "--slo-share",
        type=share,
        default=None,
        help="goodput holds when at least this share of requests meets every --slo (a sweep "
        f"with no --slo: completes) (default: {DEFAULT_SLO_SHARE:g})",
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
