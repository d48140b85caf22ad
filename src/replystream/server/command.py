"""``replystream serve``: run the reply server in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from replystream.delivery.moderation import BannedPhrases, Check, RegexCheck, secret_check
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import MemoryReplayStore, ReplayStore
from replystream.engine.base import Engine
from replystream.engine.simulated import (
    DEFAULT_REPLY,
    SimulatedConfig,
    SimulatedEngine,
    reply_of_length,
)
from replystream.engine.tiny import TinyEngineConfig, load_default_engine
from replystream.server import engine_options
from replystream.server.app import create_app
from replystream.server.auth import collect_keys
from replystream.server.context import ServerConfig
from replystream.server.guard import GuardConfig, parse_trusted_proxies
from replystream.server.serve import run_workers, serve_forever

log = logging.getLogger("replystream.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SimulatedConfig()
    policy = DeliveryPolicy()
    server = ServerConfig()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes sharing the port (use --redis-url so any of them can resume any reply)",
    )
    parser.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="asyncio",
        help="event loop (uvloop needs the uvloop package; see docs/performance.md)",
    )
    # A worker started by --workers serves the socket its parent opened.
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--engine",
        action="append",
        metavar="ENGINE",
        help="tiny (default): the built-in transformer; simulated: the lab's seeded word "
        "generator; hf:PATH: a local Hugging Face causal LM; upstream:URL[=WEIGHT]: relay an "
        "OpenAI-compatible server (repeatable: weighted round robin)",
    )
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--max-body-bytes", type=int, default=server.max_body_bytes)
    parser.add_argument("--max-prompt-chars", type=int, default=server.max_prompt_chars)
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=server.shutdown_grace_s,
        help="on SIGTERM, how long replies in flight may take to finish",
    )

    limits = parser.add_argument_group("client limits (0 turns a limit off)")
    guard = GuardConfig()
    limits.add_argument(
        "--max-concurrent-per-client",
        type=int,
        default=guard.max_concurrent,
        help="open requests per API key (or per address with auth off); more get 429",
    )
    limits.add_argument(
        "--requests-per-minute",
        type=int,
        default=guard.per_minute,
        help="requests per API key (or address) per minute; more get 429 with Retry-After",
    )
    limits.add_argument(
        "--header-timeout-s",
        type=float,
        default=guard.header_timeout_s,
        help="close a connection whose first request headers take longer",
    )
    limits.add_argument(
        "--body-timeout-s",
        type=float,
        default=guard.body_timeout_s,
        help="answer 408 when a request body takes longer",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=server.max_header_bytes,
        help="longest request line or header field",
    )
    limits.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a proxy (IP address or CIDR network; repeatable or comma-separated) whose "
        "X-Forwarded-For names the client for limits and the access log (default: none)",
    )
    limits.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser pages from this origin (repeatable; * for any)",
    )

    api = parser.add_argument_group("OpenAI-compatible API, WebSocket and API keys")
    api.add_argument(
        "--model-name",
        default=server.model_name,
        help="the model name /v1/models lists and requests may name (default: the engine's)",
    )
    api.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this bearer key on /v1/* (repeatable; visible in ps: prefer a file)",
    )
    api.add_argument(
        "--api-keys-file", type=Path, help="API keys, one per line (# starts a comment line)"
    )
    api.add_argument(
        "--ws-max-replies",
        type=int,
        default=server.ws_max_replies,
        help="replies one WebSocket may run at once",
    )

    tiny = parser.add_argument_group("tiny engine")
    tiny_defaults = TinyEngineConfig()
    tiny.add_argument(
        "--kv-blocks",
        type=int,
        default=tiny_defaults.num_blocks,
        help="KV cache blocks in the pool (16 tokens each)",
    )
    tiny.add_argument(
        "--token-budget",
        type=int,
        default=tiny_defaults.token_budget,
        help="tokens one engine step may process (decode plus prefill chunks)",
    )
    tiny.add_argument(
        "--max-running",
        type=int,
        default=tiny_defaults.max_running,
        help="sequences decoded together at most",
    )
    tiny.add_argument(
        "--default-max-tokens",
        type=int,
        default=tiny_defaults.default_max_tokens,
        help="reply length when a request does not set max_tokens",
    )

    engine_options.add_arguments(parser)

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

    delivery = parser.add_argument_group("delivery defaults (requests may override the first four)")
    delivery.add_argument(
        "--batch-tokens", type=int, default=policy.batch_tokens, help="send an event every k tokens"
    )
    delivery.add_argument(
        "--batch-ms",
        type=float,
        default=policy.batch_ms,
        help="or once the oldest waiting token is this old",
    )
    delivery.add_argument(
        "--holdback-tokens",
        type=int,
        default=policy.holdback_tokens,
        help="tokens held back until moderation checks have seen them",
    )
    delivery.add_argument(
        "--keepalive-s",
        type=float,
        default=policy.keepalive_s,
        help="comment after this long without other bytes (0: never)",
    )
    delivery.add_argument(
        "--slow-client-bytes",
        type=int,
        default=policy.slow_client_bytes,
        help="cut a stream with more than this much text queued",
    )
    delivery.add_argument(
        "--slow-client-s",
        type=float,
        default=policy.slow_client_s,
        help="cut a stream whose socket has not drained for this long",
    )

    resume = parser.add_argument_group("resumable replies")
    resume.add_argument(
        "--redis-url",
        help="keep reply logs in Redis (redis://HOST:PORT/DB), so any replica can resume any "
        "reply; without it, this process's memory",
    )
    resume.add_argument(
        "--reply-ttl-s",
        type=float,
        default=600.0,
        help="how long a finished resumable reply can still be read",
    )
    resume.add_argument(
        "--resumable-by-default",
        action="store_true",
        help="make replies resumable unless a request says otherwise",
    )
    resume.add_argument(
        "--detach-grace-s",
        type=float,
        default=server.detach_grace_s,
        help="how long a resumable reply keeps generating with no reader",
    )

    checks = parser.add_argument_group("moderation checks (run on held-back text)")
    checks.add_argument(
        "--ban",
        action="append",
        default=[],
        metavar="PHRASE",
        help="a banned phrase, matched case-insensitively (repeatable)",
    )
    checks.add_argument("--ban-file", type=Path, help="banned phrases, one per line")
    checks.add_argument(
        "--ban-regex",
        action="append",
        default=[],
        metavar="NAME=REGEX",
        help="a named regular expression that must not match (repeatable)",
    )
    checks.add_argument(
        "--block-secrets",
        action="store_true",
        help="stop replies that contain credential-shaped strings",
    )


def build_checks(args: argparse.Namespace) -> list[Check]:
    """The moderation checks the command line asks for.

    Raises:
        ValueError: a regular expression is malformed or a file cannot be read.
    """
    checks: list[Check] = []
    phrases = list(args.ban)
    if args.ban_file is not None:
        phrases += [line.strip() for line in args.ban_file.read_text().splitlines()]
    if any(p.strip() for p in phrases):
        checks.append(BannedPhrases(phrases))
    if args.ban_regex:
        patterns: dict[str, str] = {}
        for item in args.ban_regex:
            name, sep, pattern = item.partition("=")
            if not sep or not name or not pattern:
                raise ValueError(f"--ban-regex wants NAME=REGEX, got {item!r}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"--ban-regex {name}: {exc}") from None
            patterns[name] = pattern
        checks.append(RegexCheck(patterns, name="regex"))
    if args.block_secrets:
        checks.append(secret_check())
    return checks


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the command line asks for; raises ValueError on bad values."""
    choice = engine_options.parse_engines(args.engine)
    if choice.kind == "upstream":
        return engine_options.build_upstream(args, choice)
    if choice.kind == "hf":
        return engine_options.build_hf(args, choice)
    if choice.kind == "tiny":
        return load_default_engine(
            TinyEngineConfig(
                num_blocks=args.kv_blocks,
                token_budget=args.token_budget,
                max_running=args.max_running,
                default_max_tokens=args.default_max_tokens,
                spec_tokens=engine_options.spec_tokens(args),
                spec_ngram=args.spec_ngram,
            )
        )
    text = args.reply_text
    if args.tokens is not None:
        text = reply_of_length(text, args.tokens)
    return SimulatedEngine(
        SimulatedConfig(
            reply_text=text,
            delay_ms=args.delay_ms,
            jitter_ms=args.jitter_ms,
            seed=args.seed,
            first_token_ms=args.first_token_ms,
            prefill_ms_per_token=args.prefill_ms_per_token,
            fail_after=args.fail_after,
        )
    )


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Server configuration from the command line; raises ValueError on bad values."""
    policy = DeliveryPolicy(
        batch_tokens=args.batch_tokens,
        batch_ms=args.batch_ms,
        holdback_tokens=args.holdback_tokens,
        keepalive_s=args.keepalive_s or None,
        slow_client_bytes=args.slow_client_bytes,
        slow_client_s=args.slow_client_s,
        checks=tuple(build_checks(args)),
    )
    return ServerConfig(
        policy=policy,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        shutdown_grace_s=args.shutdown_grace_s,
        api_keys=tuple(collect_keys(args.api_key, args.api_keys_file)),
        model_name=args.model_name,
        ws_max_replies=args.ws_max_replies,
        resumable_by_default=args.resumable_by_default,
        detach_grace_s=args.detach_grace_s,
        max_header_bytes=args.max_header_bytes,
        guard=build_guard(args),
    )


def build_guard(args: argparse.Namespace) -> GuardConfig:
    """Per-client limits from the command line; raises ValueError on bad values."""
    if min(args.max_concurrent_per_client, args.requests_per_minute) < 0:
        raise ValueError("client limits must be >= 0 (0 turns a limit off)")
    if min(args.header_timeout_s, args.body_timeout_s) <= 0:
        raise ValueError("--header-timeout-s and --body-timeout-s must be positive")
    if args.max_header_bytes < 256:
        raise ValueError("--max-header-bytes must be at least 256")
    return GuardConfig(
        max_concurrent=args.max_concurrent_per_client,
        per_minute=args.requests_per_minute,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        cors_origins=tuple(args.cors_origin),
        trusted_proxies=parse_trusted_proxies(args.trusted_proxy),
    )


def build_store(args: argparse.Namespace) -> ReplayStore:
    """Where resumable replies are logged; raises ValueError on bad values."""
    if args.reply_ttl_s <= 0:
        raise ValueError("--reply-ttl-s must be positive")
    if args.redis_url:
        if not args.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must be a redis:// URL, got {args.redis_url!r}")
        return RedisReplayStore(args.redis_url, ttl_after_end_s=args.reply_ttl_s)
    return MemoryReplayStore(ttl_after_end_s=args.reply_ttl_s)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        config = build_config(args)
        store = build_store(args)
        if args.workers < 1:
            raise ValueError("--workers must be at least 1")
        if args.workers > 1:
            if not args.redis_url:
                log.warning(
                    "--workers without --redis-url: a reply can be resumed only "
                    "through the worker that made it"
                )
            return run_workers(worker_argv(sys.argv), args.workers, args.host, args.port)
        engine = build_engine(args)
        new_loop = loop_factory(args.loop)
    except (ValueError, OSError) as exc:
        print(f"replystream serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, config, store)
    sock = None
    if args.listen_fd is not None:
        sock = socket.socket(fileno=args.listen_fd)
        sock.setblocking(False)
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(serve_forever(app, args.host, args.port, config.shutdown_grace_s, sock))
    return 0


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to serve on (None: the standard one)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ValueError("--loop uvloop needs the uvloop package") from None
    return uvloop.new_event_loop


def worker_argv(argv: list[str]) -> list[str]:
    """This command's arguments for a worker: everything after ``serve`` but ``--workers``."""
    rest = argv[argv.index("serve") + 1 :] if "serve" in argv else argv[1:]
    out: list[str] = []
    skip = False
    for arg in rest:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out
