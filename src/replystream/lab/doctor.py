"""``replystream doctor URL [--direct URL]``: find the hop that stops a reply from streaming.

This file decides the command line, the requests (one streamed reply per path; with
``--direct``, the app's own URL and the proxied URL are measured at the same time) and how the
diagnosis is printed. It must not judge the delivery itself: the verdict, hop and fix are
``diagnosis.diagnose``'s (and ``diagnosis.together``'s, for two paths). The exit status is 0
only when the URL streams, so the command can gate CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from typing import Any

from replystream.cli_values import (
    non_empty_text,
    positive_float,
    positive_int,
    utf8_text,
    web_url,
)
from replystream.client import ReplyTiming, measure_reply
from replystream.lab.client_options import add_client_arguments, tls_for
from replystream.lab.diagnosis import (
    Diagnosis,
    Thresholds,
    compare,
    diagnose,
    never_asked,
    together,
)
from replystream.lab.served_model import ModelLookupError, served_model
from replystream.lab.workload import APIS, MODEL_APIS, Api, build_request, detect_api


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Thresholds()
    parser.add_argument(
        "url",
        type=web_url,
        help="the public (proxied) URL of a streaming endpoint, http:// or https://",
    )
    parser.add_argument(
        "--direct", type=web_url, help="the same endpoint straight at the app, to compare"
    )
    add_client_arguments(
        parser,
        header_help="a header sent with each request and the models lookup (repeatable), e.g. "
        "'Authorization: Bearer KEY'",
    )
    parser.add_argument(
        "--api", choices=["auto", *APIS], default="auto", help="request shape (auto: URL path)"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        help="reply length to ask for; long replies separate the verdicts clearly",
    )
    parser.add_argument(
        "--prompt",
        type=utf8_text,
        help=f"prompt text (default: none for the lab API, else {DEFAULT_PROMPT!r})",
    )
    parser.add_argument(
        "--model",
        type=non_empty_text,
        help="model name, openai, responses and messages APIs only (default: the one the "
        "server's /v1/models lists)",
    )
    parser.add_argument(
        "--burst-gap-ms",
        type=positive_float,
        default=defaults.burst_gap_ms,
        help="events closer than this arrived together (one read, or one held buffer split "
        "over reads); below any source's time per token, so a fast stream still streams",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0, help="per-request timeout, s"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


DEFAULT_PROMPT = "Tell me about streaming."


def _tls(url: str, args: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS context for ``url``: None for http:// (the options were checked in ``run``,
    against both URLs: one of them may be http:// when the other is https://)."""
    if not url.lower().startswith("https://"):
        return None
    return tls_for([url], args.cacert, args.insecure)


async def _measure(url: str, api: Api, args: argparse.Namespace, model: str) -> ReplyTiming:
    prompt = args.prompt
    if prompt is None:
        prompt = "" if api == "lab" else DEFAULT_PROMPT
    spec = build_request(api, url, prompt=prompt, max_tokens=args.max_tokens, model=model)
    return await measure_reply(
        spec.url,
        method=spec.method,
        json_body=spec.json_body,
        headers=args.header,
        timeout_s=args.timeout,
        tls=_tls(url, args),
    )


async def examine(args: argparse.Namespace) -> tuple[ReplyTiming, ReplyTiming | None]:
    """Measure the URL and, if given, the direct URL, both at once.

    Raises:
        ModelLookupError: the OpenAI API without ``--model``, and the server's models list
            does not name exactly one.
    """
    api: Api = api_of(args)
    model = args.model or "default"
    if api in MODEL_APIS and args.model is None:
        headers = args.header
        tls = _tls(args.url, args)
        model = await served_model(args.url, timeout_s=args.timeout, headers=headers, tls=tls)
    async with asyncio.TaskGroup() as group:
        proxied = group.create_task(_measure(args.url, api, args, model))
        direct = group.create_task(_measure(args.direct, api, args, model)) if args.direct else None
    return proxied.result(), direct.result() if direct else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def describe(d: Diagnosis) -> list[str]:
    """The human-readable report of one path."""
    gaps = d.gaps_ms
    lines = [
        f"{d.url}",
        f"  verdict:            {d.verdict.upper()}: {d.reason}",
        f"  status:             {'-' if d.status is None else d.status}",
        f"  first byte:         {_ms(d.first_byte_ms)} (response head)",
        f"  first chunk:        {_ms(d.first_chunk_ms)} (first body bytes)",
        f"  first text:         {_ms(d.first_text_ms)} (first parsed text event)",
        f"  last text:          {_ms(d.last_text_ms)}",
        f"  text events:        {d.events} ({d.tokens} tokens, {d.body_bytes:,} body bytes)",
    ]
    if gaps["count"]:
        lines.append(
            f"  gaps:               p50 {_ms(gaps['p50'])}, p90 {_ms(gaps['p90'])}, "
            f"p99 {_ms(gaps['p99'])}, max {_ms(gaps['max'])}"
        )
    if d.verdict in ("bursty", "buffered"):
        shown = ", ".join(
            f"{b.events} event{'s' if b.events != 1 else ''} (~{b.approx_bytes:,} B) "
            f"at {b.at_ms:,.0f} ms"
            for b in d.bursts[:8]
        )
        more = f", ... ({len(d.bursts)} bursts)" if len(d.bursts) > 8 else ""
        lines.append(f"  bursts:             {shown}{more}")
    for name, value in d.headers.items():
        lines.append(f"  {name + ':':<20}{value}")
    if d.hop:
        lines.append(f"  likely hop:         {d.hop}")
    if d.fix:
        lines.append(f"  fix:                {d.fix}")
    return lines


def api_of(args: argparse.Namespace) -> Api:
    api: Api = detect_api(args.url) if args.api == "auto" else args.api
    return api


def run(args: argparse.Namespace) -> int:
    try:
        api_of(args)
        if args.direct and args.api == "auto":
            detect_api(args.direct)
    except ValueError as exc:  # a path that names no endpoint
        print(f"replystream doctor: {exc}", file=sys.stderr)
        return 2
    if args.model is not None and api_of(args) not in MODEL_APIS:
        print(
            f"replystream doctor: --model names the model of an OpenAI request; "
            f"the {api_of(args)} API has none",
            file=sys.stderr,
        )
        return 2
    if args.direct and args.api == "auto" and detect_api(args.direct) != api_of(args):
        # One request shape goes to both: the URL's would not be the direct path's request.
        print(
            f"replystream doctor: --direct speaks the {detect_api(args.direct)} API by its "
            f"path, the URL the {api_of(args)} API: give the same endpoint on both sides, "
            "or name its request shape with --api",
            file=sys.stderr,
        )
        return 2
    try:
        tls_for([args.url, *([args.direct] if args.direct else [])], args.cacert, args.insecure)
    except ValueError as exc:
        print(f"replystream doctor: {exc}", file=sys.stderr)
        return 2
    thresholds = Thresholds(burst_gap_ms=args.burst_gap_ms)
    try:
        proxied_timing, direct_timing = asyncio.run(examine(args))
    except ModelLookupError as exc:
        if args.json:  # a script reading the verdict gets one, as for a reply that failed
            print(json.dumps(never_asked(args.url, str(exc)).as_dict()))
        else:
            print(f"replystream doctor: {exc}", file=sys.stderr)
        return 1
    proxied = diagnose(proxied_timing, thresholds)
    direct = None
    if direct_timing is not None:
        direct, proxied = together(diagnose(direct_timing, thresholds), proxied)
    if args.json:
        result: dict[str, Any] = proxied.as_dict()
        if direct is not None:
            result["direct"] = direct.as_dict()
            result["comparison"] = compare(direct, proxied)
        print(json.dumps(result))
    else:
        lines = describe(proxied)
        if direct is not None:
            lines += ["", "direct to the app:", *describe(direct), ""]
            lines.append(f"comparison: {compare(direct, proxied)}")
        print("\n".join(lines))
    return 0 if proxied.streams else 1
