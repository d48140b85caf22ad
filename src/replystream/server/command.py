"""``replystream serve``: run the reply server in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from replystream.engine.simulated import (
    DEFAULT_REPLY,
    SimulatedConfig,
    SimulatedEngine,
    reply_of_length,
)
from replystream.server.app import create_app
from replystream.server.serve import serve_forever


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimulatedConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--engine", choices=["simulated"], default="simulated")
    sim = parser.add_argument_group("simulated engine")
    sim.add_argument("--reply-text", default=DEFAULT_REPLY, help="the reply, one word per token")
    sim.add_argument("--tokens", type=int, help="cut or repeat the reply to this many tokens")
    sim.add_argument("--delay-ms", type=float, default=defaults.delay_ms)
    sim.add_argument("--jitter-ms", type=float, default=defaults.jitter_ms)
    sim.add_argument("--seed", type=int, default=defaults.seed)
    sim.add_argument(
        "--first-token-ms",
        type=float,
        default=defaults.first_token_ms,
        help="time before the first token (queueing plus prefill)",
    )
    sim.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=0.0,
        help="extra time before the first token per prompt word",
    )
    sim.add_argument(
        "--fail-after",
        type=int,
        default=None,
        help="fault injection for client tests: fail after N tokens (0: at once)",
    )
    parser.add_argument("--log-level", default="WARNING")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    text = args.reply_text if args.tokens is None else reply_of_length(args.reply_text, args.tokens)
    try:
        config = SimulatedConfig(
            reply_text=text,
            delay_ms=args.delay_ms,
            jitter_ms=args.jitter_ms,
            seed=args.seed,
            first_token_ms=args.first_token_ms,
            prefill_ms_per_token=args.prefill_ms_per_token,
            fail_after=args.fail_after,
        )
    except ValueError as exc:
        print(f"replystream serve: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_forever(create_app(SimulatedEngine(config)), args.host, args.port))
    return 0
