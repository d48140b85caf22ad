"""``replystream serve``: run the reply server in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import re
import socket
import sys
from collections.abc import Callable

from replystream.cli_values import (
    int_at_least,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    readable_file,
)
from replystream.delivery.moderation import BannedPhrases, Check, RegexCheck, secret_check
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.redis_store import RedisReplayStore
from replystream.delivery.replay import MemoryReplayStore, ReplayStore
from replystream.engine.base import Engine
from replystream.server import engine_options
from replystream.server.app import create_app
from replystream.server.auth import collect_keys
from replystream.server.context import ServerConfig
from replystream.server.guard import GuardConfig, parse_trusted_proxies
from replystream.server.serve import bind_socket, listening_lines, run_workers, serve_forever

log = logging.getLogger("replystream.serve")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    policy = DeliveryPolicy()
    server = ServerConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--workers",
        type=positive_int,
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
    parser.add_argument("--listen-fd", type=non_negative_int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--engine",
        action="append",
        metavar="ENGINE",
        help="tiny (default): the built-in transformer; simulated: the lab's seeded word "
        "generator; hf:PATH: a local Hugging Face causal LM; upstream:URL[=WEIGHT]: relay an "
        "OpenAI-compatible server (repeatable: weighted round robin)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING",
        help="least severe log record written to stderr",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=server.max_body_bytes,
        help="largest request body; more gets 413",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=positive_int,
        default=server.max_prompt_chars,
        help="longest prompt (all messages' text together); more gets 400",
    )
    parser.add_argument(
        "--shutdown-grace-s",
        type=non_negative_float,
        default=server.shutdown_grace_s,
        help="on SIGTERM, how long replies in flight may take to finish",
    )

    limits = parser.add_argument_group("client limits (0 turns a limit off)")
    guard = GuardConfig()
    limits.add_argument(
        "--max-concurrent-per-client",
        type=non_negative_int,
        default=guard.max_concurrent,
        help="open requests per API key (or per address with auth off); more get 429",
    )
    limits.add_argument(
        "--requests-per-minute",
        type=non_negative_int,
        default=guard.per_minute,
        help="requests per API key (or address) per minute; more get 429 with Retry-After",
    )
    limits.add_argument(
        "--header-timeout-s",
        type=positive_float,
        default=guard.header_timeout_s,
        help="close a connection whose first request headers take longer",
    )
    limits.add_argument(
        "--body-timeout-s",
        type=positive_float,
        default=guard.body_timeout_s,
        help="answer 408 when a request body takes longer",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int_at_least(256),
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
        "--api-keys-file",
        type=readable_file,
        help="API keys, one per line (# starts a comment line)",
    )
    api.add_argument(
        "--ws-max-replies",
        type=positive_int,
        default=server.ws_max_replies,
        help="replies one WebSocket may run at once",
    )

    engine_options.add_arguments(parser)

    delivery = parser.add_argument_group("delivery defaults (requests may override the first four)")
    delivery.add_argument(
        "--batch-tokens",
        type=positive_int,
        default=policy.batch_tokens,
        help="send an event every k tokens",
    )
    delivery.add_argument(
        "--batch-ms",
        type=non_negative_float,
        default=policy.batch_ms,
        help="or once the oldest waiting token is this old",
    )
    delivery.add_argument(
        "--holdback-tokens",
        type=non_negative_int,
        default=policy.holdback_tokens,
        help="tokens held back until moderation checks have seen them",
    )
    delivery.add_argument(
        "--keepalive-s",
        type=non_negative_float,
        default=policy.keepalive_s,
        help="comment after this long without other bytes (0: never)",
    )
    delivery.add_argument(
        "--slow-client-bytes",
        type=positive_int,
        default=policy.slow_client_bytes,
        help="cut a stream with more than this much text queued",
    )
    delivery.add_argument(
        "--slow-client-s",
        type=positive_float,
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
        type=positive_float,
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
        type=non_negative_float,
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
    checks.add_argument("--ban-file", type=readable_file, help="banned phrases, one per line")
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
    return engine_options.build_engine(args)


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
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        config = build_config(args)
        store = build_store(args)
        choice = engine_options.parse_engines(args.engine)
        # Checked here too: with --workers the engine is built only in the workers, and a
        # worker that refuses to start would be restarted for ever.
        engine_options.check_options(args, choice.kind)
        announce = announcement(choice.kind)
        if args.workers > 1:
            if not args.redis_url:
                log.warning(
                    "--workers without --redis-url: a reply can be resumed only "
                    "through the worker that made it"
                )
            sock = listen(args.host, args.port)
            return run_workers(worker_argv(sys.argv), args.workers, sock, announce)
        engine = build_engine(args)
        new_loop = loop_factory(args.loop)
        if args.listen_fd is not None:
            sock = socket.socket(fileno=args.listen_fd)
            sock.setblocking(False)
        else:
            sock = listen(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"replystream serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, config, store)
    quiet = args.listen_fd is not None  # a worker: its parent announced the URL
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(
            serve_forever(
                app,
                args.host,
                args.port,
                config.shutdown_grace_s,
                sock,
                announce=None if quiet else announce,
            )
        )
    return 0


def announcement(engine_kind: str) -> Callable[[str], list[str]]:
    """The start-up lines: the one tools read (the URL ends it), then the engine and the page."""

    def lines(url: str) -> list[str]:
        return [*listening_lines(url), f"replystream: {engine_kind} engine, chat page {url}/"]

    return lines


def listen(host: str, port: int) -> socket.socket:
    """The listening socket for ``--host`` and ``--port``.

    Raises:
        ValueError: one line naming the flag that cannot be served, and the fix.
    """
    try:
        return bind_socket(host, port)
    except socket.gaierror as exc:
        raise ValueError(
            f"--host {host}: not an address or a name this machine can resolve "
            f"({exc.strerror}); try 127.0.0.1, or 0.0.0.0 for every interface"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: another process already listens on {host}:{port}; stop it, "
                "or choose another port (--port 0 picks a free one)"
            ) from None
        if exc.errno == errno.EACCES:
            raise ValueError(
                f"--port {port}: this user may not listen on ports below 1024; choose 1024 or above"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(
                f"--host {host}: not an address of this machine; try 127.0.0.1, "
                "or 0.0.0.0 for every interface"
            ) from None
        raise ValueError(f"--host {host} --port {port}: cannot listen: {exc.strerror}") from None


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
