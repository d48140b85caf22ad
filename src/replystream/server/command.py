"""``replystream serve``: run the reply server in the foreground until SIGINT or SIGTERM.

The flags, their help and the plain settings' configs come from their declarations
(``server.serve_settings``). This file keeps what is not one plain setting: the moderation
checks and the API keys (each from several flags), the reply store, the engine choice, and
the process: ``--workers``, the listening socket, the event loop and the log.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from replystream import settings, start_hangup
from replystream.delivery.moderation import BannedPhrases, Check, RegexCheck, secret_check
from replystream.delivery.policy import DeliveryPolicy
from replystream.delivery.replay import MemoryReplayStore, ReplayStore
from replystream.engine.base import Engine
from replystream.server import engine_options, log_sink, metrics_dir
from replystream.server.api_keys import collect_keys
from replystream.server.guard_config import GuardConfig
from replystream.server.listening import REFUSED_EXIT, bind_socket, listening_lines
from replystream.server.metrics import MULTIPROCESS_DIR_ENV
from replystream.server.serve_settings import SERVE_SETTINGS
from replystream.server.server_config import ServerConfig
from replystream.server.text_files import banned_phrases
from replystream.server.workers import descriptors_problem, run_workers, tell_parent_ready

log = logging.getLogger("replystream.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``serve``, from its declaration in ``serve_settings``."""
    settings.add_arguments(parser, SERVE_SETTINGS)


class Checks(NamedTuple):
    """The moderation checks the command line asks for, in the order they run."""

    all: tuple[Check, ...]
    # Among them, the banned phrases (``--ban``, ``--ban-file``): SIGHUP reads the file again
    # into it (``server.reload``).
    phrases: BannedPhrases | None


def build_checks(args: argparse.Namespace) -> Checks:
    """The moderation checks the command line asks for.

    Raises:
        ValueError: a regular expression is malformed or a file cannot be read.
    """
    checks: list[Check] = []
    phrases = banned_phrases(args.ban, args.ban_file)
    banned = BannedPhrases(phrases) if any(p.strip() for p in phrases) else None
    if banned is not None:
        checks.append(banned)
    if args.ban_regex:
        patterns: dict[str, str] = {}
        for item in args.ban_regex:
            name, sep, pattern = item.partition("=")
            if not sep or not name or not pattern:
                raise ValueError(f"--ban-regex wants NAME=REGEX, got {item!r}")
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"--ban-regex {name}: {exc}") from None
            if compiled.search("") is not None:  # found in any text: every reply stopped
                raise ValueError(
                    f"--ban-regex {name}: {pattern} matches the empty text, so it would stop "
                    "every reply at its first token; make it match at least one character"
                )
            if name in patterns:  # the later one would replace the first: a ban dropped unsaid
                raise ValueError(f"--ban-regex {name} is given twice: name each pattern once")
            patterns[name] = pattern
        checks.append(RegexCheck(patterns, name="regex"))
    if args.block_secrets:
        checks.append(secret_check())
    return Checks(tuple(checks), banned)


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the command line asks for; raises ValueError on bad values."""
    return engine_options.build_engine(args)


def build_config(args: argparse.Namespace, moderation: Checks | None = None) -> ServerConfig:
    """Server configuration from the command line, with the checks ``moderation`` (None:
    those it asks for); raises ValueError on bad values."""
    checks = (build_checks(args) if moderation is None else moderation).all
    if args.holdback_tokens and not checks:
        # The window is for checks to read the text before it leaves: with none, it would
        # only delay every token (and a request's own window stays the request's to ask).
        raise ValueError(
            f"--holdback-tokens {args.holdback_tokens} holds tokens back for moderation "
            "checks to read, and none is given (--ban, --ban-file, --ban-regex, "
            "--block-secrets): add one, or drop --holdback-tokens"
        )
    return settings.fill(
        ServerConfig,
        args,
        SERVE_SETTINGS,
        # A relay's requests for no model are sent as --upstream-model, and labelled so
        # unless --model-name gives another name: the engine's own default
        # (``Engine.default_model``), listed only while some upstream may serve it.
        model_name=args.model_name,
        policy=settings.fill(DeliveryPolicy, args, SERVE_SETTINGS, checks=checks),
        guard=settings.fill(GuardConfig, args, SERVE_SETTINGS),
        api_keys=tuple(collect_keys(args.api_key, args.api_keys_file)),
    )


def build_store(args: argparse.Namespace) -> ReplayStore:
    """Where resumable replies are logged; raises ValueError on bad values."""
    if args.redis_url is not None:  # given empty: refused by the URL's parse, not ignored
        from replystream.delivery.redis_connect import parse_redis_url
        from replystream.delivery.redis_store import RedisReplayStore

        try:
            parse_redis_url(args.redis_url)
        except ValueError as exc:
            raise ValueError(f"--redis-url: {exc}") from None
        return RedisReplayStore(
            args.redis_url, ttl_after_end_s=args.reply_ttl_s, failover_s=args.redis_failover_s
        )
    if any(setting.flag == "--redis-failover-s" for setting in settings.given(args)):
        raise ValueError("--redis-failover-s is an option of --redis-url: add one, or drop it")
    return MemoryReplayStore(ttl_after_end_s=args.reply_ttl_s)


def check_store(store: ReplayStore, redis_url: str | None) -> None:
    """Before listening, ask the store once whether it takes this server's commands. A shared
    one that refuses them (a wrong password, or none given where one is needed, a database
    it lacks, an ACL user without a command or key the store uses) would fail every
    resumable reply; one that cannot be reached now may be later (it is still starting, or
    failing over), so it is told and the server serves.

    Raises:
        ValueError: the store refused, in one line naming its flag (and Redis by host and
            port only).
    """
    contact = asyncio.run(store.first_contact())
    if contact is None:
        return
    where = "the reply store"
    if redis_url is not None:
        from replystream.delivery.redis_connect import parse_redis_url

        where = f"--redis-url: Redis at {parse_redis_url(redis_url).shown}"
    if contact.refused:
        raise ValueError(f"{where} refuses this server's commands: {contact.why}")
    log.warning(
        "%s cannot be reached now (%s); serving: resumable replies fail until it answers",
        where,
        contact.why,
    )


def refuse_foreign_metrics_dir(args: argparse.Namespace) -> None:
    """``PROMETHEUS_MULTIPROC_DIR`` is how the workers of ``--workers`` share their metrics,
    in a folder their parent makes for them. Set from outside, a server would merge into its
    ``/metrics`` whatever other processes left in that folder (or fail on one that is not
    there), so it is refused, naming the variable.

    Raises:
        ValueError: it is set, and this process is not such a worker.
    """
    if args.listen_fd is None and MULTIPROCESS_DIR_ENV in os.environ:
        # Empty too: prometheus-client takes an empty folder for the current one, and
        # leaves its files there (or fails where it cannot write them).
        empty = "" if os.environ[MULTIPROCESS_DIR_ENV] else " (empty)"
        raise ValueError(
            f"{MULTIPROCESS_DIR_ENV} is set in the environment{empty}; serve sets it itself "
            "for the workers of --workers: unset it"
        )


def check_worker_descriptors(args: argparse.Namespace) -> None:
    """The descriptors a worker of ``--workers`` is handed (``--listen-fd``, ``--ready-fd``)
    must be open as it is to use them: told at start, naming the flag, rather than when the
    worker first uses one (a ready pipe's, once it serves: a traceback after its URL).

    Raises:
        ValueError: one is not open, or the ready pipe is not open for writing; or
            ``--workers`` asks for more than the one process a handed socket gets.
    """
    if args.listen_fd is not None and args.workers > 1:
        # A worker serves the socket it is handed, alone: --workers would be ignored.
        raise ValueError(
            f"--workers {args.workers} with --listen-fd: a process handed a socket serves it "
            "alone; drop --listen-fd (serve --workers opens the socket and hands it to its "
            "workers)"
        )
    for flag, fd in (("--listen-fd", args.listen_fd), ("--ready-fd", args.ready_fd)):
        if fd is None:
            continue
        try:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        except OSError as exc:
            raise ValueError(
                f"{flag} {fd}: not an open file descriptor ({exc.strerror}); serve --workers "
                "hands its workers their descriptors"
            ) from None
        if flag == "--ready-fd" and mode == os.O_RDONLY:
            raise ValueError(
                f"{flag} {fd}: open for reading only; the worker writes a byte to it once it serves"
            )


def refuse(exc: Exception) -> None:
    """Say why the server does not start, in one line after what it logged before."""
    log_sink.drain()
    print(f"replystream serve: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    # Written by a thread: a stderr nobody reads must not stop the server (``log_sink``).
    log_sink.install(args.log_level)
    try:
        refuse_foreign_metrics_dir(args)
        check_worker_descriptors(args)
        moderation = build_checks(args)
        config = build_config(args, moderation)
        store = build_store(args)
        choice = engine_options.parse_engines(args.engine)
        # Checked here too: with --workers the engine is built only in the workers, and a
        # worker that refuses to start stops them all (after the URL was announced).
        engine_options.check_options(args, choice.kind)
        # Before --check and before any worker starts: a loop that cannot be had is one
        # line here, not a sound check followed by every worker refusing.
        new_loop = loop_factory(args.loop)
        if args.workers > 1 and args.listen_fd is None:
            problem = descriptors_problem(args.workers)
            if problem is not None:
                raise ValueError(problem)
        if args.check:
            # What start-up would find, found without starting: the engine is built as
            # serving builds it (a model loaded, a relay's routes and TLS files read), the
            # app made; no socket, no upstream, no Redis is touched.
            check_host(args.host)
            checked = build_engine(args)
            from replystream.server.app import create_app

            create_app(checked, config, store)
            print(f"replystream serve: the configuration is sound (the {choice.kind} engine)")
            return 0
        if args.listen_fd is None:  # workers: their parent asked
            check_store(store, args.redis_url)
        if args.workers > 1:
            engine_options.check_engine(args, choice)
        announce = announcement(choice.kind)
        note = engine_options.fallback_note() if not args.engine else None
        if note is not None and args.listen_fd is None:  # workers: their parent said it
            print(f"replystream serve: {note}", file=sys.stderr)
        if config.policy.checks and not config.policy.holdback_tokens and args.listen_fd is None:
            log.warning(
                "moderation checks with --holdback-tokens 0: a check reads each token only "
                "as it is sent, so a phrase or key of several tokens is stopped at its last "
                "token, the ones before it already sent; hold back as many tokens as the "
                "longest (--holdback-tokens 4, say)"
            )
        reloads = names_files_read_again(args, choice.kind)
        # Remembered since start-up (``cli.main``): with no file to read again, SIGHUP ends
        # a start under way, as it ends any process (once serving, it stops the server as
        # SIGTERM does); with one, a SIGHUP before the server serves reads the files once
        # more as it begins to (``start_hangup``): they may have been read before the edit.
        if reloads:
            start_hangup.remember()
        else:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if args.workers > 1 and args.listen_fd is None:  # (a worker never has workers)
            if args.redis_url is None:
                log.warning(
                    "--workers without --redis-url: a reply can be resumed, and a stored "
                    "response read or continued (previous_response_id), only through the "
                    "worker that made it; elsewhere it is not found"
                )
            if args.max_concurrent_per_client or args.requests_per_minute:
                log.warning(
                    "--workers with per-client limits: each worker counts its own, so a "
                    "client may get up to %d times --max-concurrent-per-client and "
                    "--requests-per-minute",
                    args.workers,
                )
            sock = listen(args.host, args.port, shared=True)
            return run_workers(
                worker_argv(sys.argv),
                args.workers,
                sock,
                announce,
                reloads=reloads,
                grace_s=config.shutdown_grace_s,
            )
        # Listen first: a port already taken is reported at once, not after a model load.
        if args.listen_fd is not None:
            try:
                sock = socket.socket(fileno=args.listen_fd)
            except OSError as exc:
                raise ValueError(f"--listen-fd {args.listen_fd}: {exc.strerror}") from None
            sock.setblocking(False)
        else:
            sock = listen(args.host, args.port)
        engine = build_engine(args)
    except (ValueError, OSError) as exc:
        refuse(exc)
        return REFUSED_EXIT
    # The server's modules load once the command line is known to be sound: a mistake in it
    # is told before aiohttp, the app and its schemas load (and the engine's, before the
    # engine: ``engine_options``); what SIGHUP reads again, only for a server that has a file
    # to read again.
    from replystream.server.app import create_app
    from replystream.server.serve import serve_forever

    try:
        app = create_app(engine, config, store)
    except OSError as exc:  # a worker's metric files (``metric_files``): its filesystem full
        refuse(exc)
        return REFUSED_EXIT
    if args.parent_pid is not None:  # a worker: its own stop may not be the server's
        from replystream.server.context import SERVER_STOPS_KEY

        server_stops: Callable[[], bool] = partial(metrics_dir.server_stops, args.parent_pid)
        app[SERVER_STOPS_KEY] = server_stops
    rereads = None
    if reloads:
        from replystream.server import reload

        rereads = reload.reloads_for(app, args, choice, moderation.phrases)
    quiet = args.listen_fd is not None  # a worker: its parent announces the URL
    ready_fd = args.ready_fd
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(
            serve_forever(
                app,
                args.host,
                args.port,
                config.shutdown_grace_s,
                sock,
                announce=None if quiet else announce,
                parent_pid=args.parent_pid,
                on_serving=None if ready_fd is None else lambda: tell_parent_ready(ready_fd),
                on_hangup=None if rereads is None else rereads.hangup,
            )
        )
    return 0


def names_files_read_again(args: argparse.Namespace, engine_kind: str) -> bool:
    """Whether ``args`` name a file SIGHUP reads again (``server.reload``): the API keys
    file, the banned phrases file, or a relay's routes file."""
    return (
        args.api_keys_file is not None
        or args.ban_file is not None
        or (engine_kind == "upstream" and args.upstream_routes is not None)
    )


def announcement(engine_kind: str) -> Callable[[str], list[str]]:
    """The start-up lines: the one tools read (the URL ends it), then the engine and the page."""

    def lines(url: str) -> list[str]:
        return [*listening_lines(url), f"replystream: {engine_kind} engine, chat page {url}/"]

    return lines


def unresolved(host: str, exc: socket.gaierror) -> ValueError:
    return ValueError(
        f"--host {host}: not an address or a name this machine can resolve "
        f"({exc.strerror}); try 127.0.0.1, or 0.0.0.0 for every interface"
    )


def not_this_machines(host: str) -> ValueError:
    return ValueError(
        f"--host {host}: not an address of this machine; try 127.0.0.1, "
        "or 0.0.0.0 for every interface"
    )


def _link_local(host: str) -> bool:
    """Whether ``host`` is a link-local IPv6 address without its zone (``fe80::1``)."""
    try:
        return "%" not in host and ipaddress.ip_address(host).is_link_local
    except ValueError:
        return False


def cannot_listen(host: str, exc: OSError) -> ValueError:
    """Why ``--host`` cannot be bound, when no other refusal names it: a link-local IPv6
    address given without its interface (the kernel's "Invalid argument") says so."""
    if exc.errno == errno.EINVAL and _link_local(host):
        return ValueError(
            f"--host {host}: a link-local address is bound on one interface: give it with "
            f"its zone ({host}%eth0, the interface's name as ip addr shows it)"
        )
    return ValueError(f"--host {host}: cannot listen: {exc.strerror}")


def check_host(host: str) -> None:
    """What ``listen`` would find of ``--host`` short of taking ``--port``: that it resolves,
    and that it is an address of this machine (bound on a port the kernel picks, never
    listened on, and closed at once)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise unresolved(host, exc) from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise not_this_machines(host) from None
            raise cannot_listen(host, exc) from None


def _answers(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` (a wildcard host is asked on
    loopback; ``::`` on IPv4's too, a dual-stack socket holding the port for both): the port
    in use is another server's, not a connection's own port."""
    wildcards = {"": ("127.0.0.1",), "0.0.0.0": ("127.0.0.1",), "::": ("::1", "127.0.0.1")}
    for target in wildcards.get(host, (host,)):
        try:
            with socket.create_connection((target, port), timeout=1.0):
                return True
        except OSError:
            pass
    return False


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """The listening socket for ``--host`` and ``--port`` (``shared``: the port's holder for
    workers, ``bind_socket``'s).

    Raises:
        ValueError: one line naming the flag that cannot be served, and the fix.
    """
    try:
        if shared and port and _answers(host, port):
            # Bound with SO_REUSEPORT, it would share the port of another server of this
            # user's that does too (another ``serve --workers``) instead of being refused.
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        return bind_socket(host, port, shared=shared)
    except socket.gaierror as exc:
        raise unresolved(host, exc) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            if not _answers(host, port):
                raise ValueError(
                    f"--port {port}: {_host_port(host, port)} is held, though nothing listens "
                    "on it (a connection of this machine has it as its own port, or one still "
                    "closing in TIME_WAIT); choose another port (--port 0 picks a free one)"
                ) from None
            raise ValueError(
                f"--port {port}: another process already listens on {_host_port(host, port)}; "
                "stop it, or choose another port (--port 0 picks a free one)"
            ) from None
        if exc.errno == errno.EACCES:
            raise ValueError(
                f"--port {port}: this user may not listen on ports below 1024; choose 1024 or above"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise not_this_machines(host) from None
        if exc.errno == errno.EINVAL:
            raise cannot_listen(host, exc) from None
        raise ValueError(f"--host {host} --port {port}: cannot listen: {exc.strerror}") from None


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to serve on (None: the standard one). ``auto`` takes uvloop where it
    is installed: a relayed chunk costs less CPU on it (docs/performance.md, "uvloop by
    default, its connections accepted in batches")."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "auto":
            return None
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
