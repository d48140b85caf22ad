"""``replystream serve --engine ...``: which engine a command line names, and its options.

This file decides the grammar of ``--engine`` (``smollm2``, ``tiny``, ``simulated``,
``gguf:PATH``, ``hf:PATH``, or ``upstream:URL[=WEIGHT]`` given once per upstream, or
``upstream`` for the upstreams of ``--upstream-routes`` alone), which engine serves when none
is named (SmolLM2 when its weights are installed, else the tiny model), and builds the engine
it names from the engine options (declared, with the engines each belongs to, in
``server.engine_settings``). The rest of the command (``server.command``) stays theirs.
It must not know how an engine works.

An option given to an engine that does not use it is refused at start-up (``--delay-ms`` with
the tiny engine would otherwise be accepted and silently do nothing).

Each engine's modules are imported by its builder alone: the simulated engine loads no NumPy,
no model and no HTTP client, and a mistake on the command line is told before any engine's
code loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from replystream import settings
from replystream.engine.base import Engine
from replystream.engine.hf_config import HFEngineConfig, check_model_folder
from replystream.engine.simulated import SimulatedConfig, reply_of_length, simulated_engine
from replystream.engine.smollm2_weights import SMOLLM2_INSTALL, smollm2_path
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream_config import (
    EntryMistake,
    UpstreamConfig,
    UpstreamTarget,
    key_problem,
    upstream_identity,
    upstream_limit,
)
from replystream.server import metrics_dir
from replystream.server.engine_settings import API_KEY_ENV, ENGINE_SETTINGS

KINDS = ("smollm2", "tiny", "gguf", "simulated", "hf", "upstream")
# How each engine is asked for, where a bare name is not the whole of it.
ENGINE_SPELLED = {kind: kind for kind in KINDS} | {
    "hf": "hf:PATH",
    "gguf": "gguf:PATH",
    "upstream": "upstream:URL (or upstream with --upstream-routes FILE)",
}
log = logging.getLogger("replystream.serve")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine ``--engine`` names: its kind, and the upstreams or model folder it needs."""

    kind: str  # one of KINDS
    targets: tuple[UpstreamTarget, ...] = ()
    path: Path | None = None


def default_engine() -> str:
    """``smollm2`` when its weights are installed, else ``tiny`` (always there)."""
    return "smollm2" if smollm2_path() is not None else "tiny"


def fallback_note() -> str | None:
    """The line ``serve`` prints when it cannot serve the real model by default."""
    if default_engine() == "smollm2":
        return None
    return f"the SmolLM2 weights are not installed ({SMOLLM2_INSTALL}); serving the tiny engine"


def parse_engines(specs: list[str] | None) -> EngineChoice:
    """Read every ``--engine`` value (none: ``default_engine()``).

    Raises:
        ValueError: an unknown engine, a bad URL or weight, or kinds mixed.
    """
    specs = specs or [default_engine()]
    try:
        targets = [UpstreamTarget.parse(s[9:]) for s in specs if s.startswith("upstream:")]
    except ValueError as exc:
        raise ValueError(f"--engine upstream:URL: {exc}") from None
    if "upstream" in specs:  # the upstreams of --upstream-routes
        specs = [s for s in specs if s != "upstream"]
        if len(targets) != len(specs):
            raise ValueError("--engine upstream may be given with upstream:URL, not with others")
        return EngineChoice("upstream", tuple(targets))
    if targets:
        if len(targets) != len(specs):
            raise ValueError("--engine upstream:URL may be repeated, but not mixed with others")
        return EngineChoice("upstream", tuple(targets))
    if len(specs) > 1:
        raise ValueError("only --engine upstream:URL may be given more than once")
    spec = specs[0]
    if spec in ("smollm2", "tiny", "simulated"):
        return EngineChoice(spec)
    for kind in ("hf", "gguf"):
        if spec.startswith(f"{kind}:") and len(spec) > len(kind) + 1:
            return EngineChoice(kind, path=Path(spec[len(kind) + 1 :]))
    raise ValueError(
        "--engine wants smollm2, tiny, simulated, gguf:PATH, hf:PATH or upstream:URL[=WEIGHT] "
        f"(or upstream, with --upstream-routes), got {spec!r}"
    )


def check_options(args: argparse.Namespace, kind: str) -> None:
    """Refuse any option the command line gave that engine ``kind`` would not use.

    Raises:
        ValueError: one line naming the option, its engine, and the fix.
    """
    given = [row for row in settings.given(args) if row.engines]
    for row in given:
        if kind not in row.engines:
            owners = " or ".join(row.engines)
            raise ValueError(
                f"{row.flag} is an option of the {owners} engine, and this server runs the "
                f"{kind} engine: add --engine {ENGINE_SPELLED[row.engines[0]]}, or drop "
                f"{row.flag}"
            )
    if args.speculative == "off":
        for row in given:
            if row.flag in ("--spec-tokens", "--spec-ngram"):
                raise ValueError(
                    f"{row.flag} tunes speculative decoding: add --speculative "
                    f"prompt-lookup, or drop {row.flag}"
                )


def check_engine(args: argparse.Namespace, choice: EngineChoice) -> None:
    """Before ``serve --workers`` starts any worker, find the mistakes it can find at little
    cost, so each is said once, not by every worker: the relay and the simulated engine are
    built once and dropped (they load nothing); a GGUF model's file is opened, its header
    read, and its tokenizer and chat template built (its weights stay unread); a Hugging
    Face model's folder is checked as its engine checks it first. The rest each worker finds
    as it loads its model.

    Raises:
        ValueError: what ``build_engine`` would raise.
    """
    if choice.kind == "upstream":
        build_upstream(args, choice)  # opens nothing until it serves
    elif choice.kind == "simulated":
        build_simulated(args)
    elif choice.kind == "hf":
        assert choice.path is not None
        try:
            check_model_folder(choice.path)  # the weights, and torch, are the workers' to load
        except ValueError as exc:
            raise ValueError(f"--engine hf:PATH: {exc}") from None
    elif choice.kind in ("smollm2", "gguf"):
        label = "smollm2" if choice.path is None else "gguf:PATH"
        path = smollm2_path() if choice.path is None else choice.path
        try:
            if path is None:
                raise ValueError(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
            from replystream.engine.gguf_engine import check_gguf_file

            check_gguf_file(path)
        except ValueError as exc:
            raise ValueError(f"--engine {label}: {exc}") from None


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine the command line asks for.

    Raises:
        ValueError: a bad ``--engine``, an option that engine does not use, or a bad value.
    """
    choice = parse_engines(args.engine)
    check_options(args, choice.kind)
    if choice.kind == "upstream":
        return build_upstream(args, choice)
    if choice.kind == "hf":
        return build_hf(args, choice)
    if choice.kind == "simulated":
        return build_simulated(args)
    from replystream.engine.kv_cache import PoolTooLarge

    try:
        if choice.kind == "tiny":
            from replystream.engine.tiny import load_default_engine

            spec_tokens = args.spec_tokens if args.speculative != "off" else 0
            config = settings.fill(TinyEngineConfig, args, ENGINE_SETTINGS, spec_tokens=spec_tokens)
            check_drafts(config)
            return load_default_engine(config)
        return build_gguf(args, choice)
    except PoolTooLarge as exc:
        raise ValueError(f"--kv-blocks {exc.num_blocks}: {exc}") from None


def check_drafts(config: TinyEngineConfig) -> None:
    """Refuse a step budget that leaves a speculative draft no room: a sequence drafting k
    tokens takes k + 1 in its step, and drafts are cut to fit the budget, so a budget of k or
    less would turn speculation off without a word.

    Raises:
        ValueError: one line naming both flags.
    """
    if config.spec_tokens and config.token_budget < config.spec_tokens + 1:
        raise ValueError(
            f"--token-budget {config.token_budget} leaves no room for --spec-tokens "
            f"{config.spec_tokens}: a step drafting {config.spec_tokens} tokens takes "
            f"{config.spec_tokens + 1}; raise --token-budget or lower --spec-tokens"
        )


def build_gguf(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    """SmolLM2 from its installed wheel, or any LLaMA-architecture GGUF (``gguf:PATH``).

    Their pool, budget and reply length default to the GGUF engines' own (a 135M model's KV
    is 22 times the tiny one's per token); a flag the command line gave overrides them.
    """
    from replystream.engine.gguf_engine import load_gguf_engine, load_smollm2_engine, with_defaults
    from replystream.engine.kv_cache import PoolTooLarge

    given: dict[str, object] = {
        row.fills[1]: row.value(args)
        for row in settings.given(args)
        if row.fills is not None and row.fills[0] is TinyEngineConfig
    }
    given["spec_tokens"] = args.spec_tokens if args.speculative != "off" else 0
    config = with_defaults(given)
    check_drafts(config)
    try:
        if choice.path is None:
            engine, report = load_smollm2_engine(config)
        else:
            engine, report = load_gguf_engine(choice.path, config)
    except PoolTooLarge:
        raise  # the pool's size, not the model: build_engine names --kv-blocks
    except (ValueError, OSError) as exc:
        label = "smollm2" if choice.path is None else "gguf:PATH"
        raise ValueError(f"--engine {label}: {exc}") from None
    log.info(
        "loaded %s in %.1f s: %.0f MiB of float32 weights, peak resident %.0f MiB",
        report.path.name,
        report.seconds,
        report.weight_bytes / 2**20,
        report.peak_rss_bytes / 2**20,
    )
    return engine


def build_simulated(args: argparse.Namespace) -> Engine:
    """The simulated engine; raises ValueError for values that contradict each other."""
    given = {row.flag for row in settings.given(args)}
    if args.jitter_ms > args.delay_ms and "--jitter-ms" not in given:
        args.jitter_ms = args.delay_ms  # the default jitter, for a delay shorter than it
    if args.jitter_ms > args.delay_ms:
        raise ValueError(
            f"--jitter-ms {args.jitter_ms:g} is more than --delay-ms {args.delay_ms:g}: "
            "a token's delay cannot be negative; lower --jitter-ms"
        )
    if args.reply_script is not None:
        for flag in ("--reply-text", "--tokens"):
            if flag in given:
                raise ValueError(
                    f"--reply-script gives the whole reply, and {flag} shapes it too: drop one"
                )
        if all(step.delay_ms is not None for step in args.reply_script.deltas):
            for flag in ("--delay-ms", "--jitter-ms"):
                if flag in given:
                    raise ValueError(
                        f"{flag} times the steps of --reply-script without a delay_ms of "
                        "their own, and every step has one: drop it (or the delay_ms of the "
                        "steps it should time)"
                    )
    text = args.reply_text
    if not text.split():
        raise ValueError("--reply-text has no words; give at least one")
    if args.tokens is not None:
        text = reply_of_length(text, args.tokens)
    # --seed is declared with the models' config (no default: a fresh seed per request); the
    # simulated engine keeps its own default unless the command line gave one.
    seed = {} if args.seed is None else {"seed": args.seed}
    return simulated_engine(
        settings.fill(SimulatedConfig, args, ENGINE_SETTINGS, reply_text=text, **seed)
    )


def build_upstream(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    """The relay: the ``--engine upstream:URL`` targets, then the routes file's; in a worker
    of ``--workers``, with the limits of requests at once held with the other workers."""
    from replystream.engine.upstream import UpstreamEngine

    config = upstream_config(args, choice)
    idle_flag = idle_upstream_flag(args, config)
    if idle_flag is not None:
        raise ValueError(idle_flag)
    return UpstreamEngine(config, metrics_dir.shared_slots_folder())


def upstream_key(args: argparse.Namespace) -> tuple[str | None, str]:
    """The key for every upstream without its own, and where it came from: the flag, else
    the environment. Raises ValueError naming that source for a key no header can carry,
    and for an empty flag (it would fall back to the environment's, or to none, unsaid)."""
    if args.upstream_api_key is not None:
        key, source = args.upstream_api_key, "--upstream-api-key"
        if not key:
            raise ValueError("--upstream-api-key is empty: leave it out for no key")
    else:
        key, source = os.environ.get(API_KEY_ENV) or None, f"${API_KEY_ENV}"
    problem = None if key is None else key_problem(key)
    if problem is not None:
        raise ValueError(f"{source}: the upstream API key {problem}")
    return key, source


def upstream_config(args: argparse.Namespace, choice: EngineChoice) -> UpstreamConfig:
    """The relay's configuration as the command line and the routes file give it now (read
    at start, and again for each reload of the routes file).

    Raises:
        ValueError: one line naming the flag, or the file, entry and field, at fault.
    """
    key, source = upstream_key(args)
    if key is not None and args.upstream_pass_client_key:
        raise ValueError(
            f"--upstream-pass-client-key sends each client's key upstream, and {source} "
            "gives a key for every upstream: drop one (a routes file gives keys per upstream)"
        )
    targets = list(choice.targets)
    aliases: tuple[tuple[str, str], ...] = ()
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if args.upstream_routes is not None:
        from replystream.engine.upstream_routes import load_routes

        if not args.upstream_routes:  # Path("") is the current folder: "." would be named
            raise ValueError("--upstream-routes: want a file name, got an empty one")
        try:
            routes = load_routes(Path(args.upstream_routes))
        except ValueError as exc:
            raise ValueError(f"--upstream-routes {exc}") from None
        on_command_line = {upstream_identity(t.base_url): t.base_url for t in targets}
        for target in routes.targets:
            also = on_command_line.get(upstream_identity(target.base_url))
            if also is not None:
                spelt = "" if also == target.base_url else f" (as {also})"
                raise ValueError(
                    f"--upstream-routes {target.entry}.url: {target.base_url} is given by "
                    f"--engine too{spelt}; name it in one place"
                )
        targets += routes.targets
        aliases, fallbacks = routes.aliases, routes.fallbacks
    if not targets:
        raise ValueError("--engine upstream needs --upstream-routes FILE, or give upstream:URL")
    try:
        config = settings.fill(
            UpstreamConfig,
            args,
            ENGINE_SETTINGS,
            targets=tuple(targets),
            api_key=key,
            api_key_from=source,
            aliases=aliases,
            fallbacks=fallbacks,
        )
    except EntryMistake as exc:
        raise ValueError(f"--upstream-routes {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--engine upstream: {exc}") from None
    if args.workers > 1 or metrics_dir.shared_slots_folder() is not None:
        problem = shared_slots_problem(config)
        if problem is not None:
            raise ValueError(problem)
    given = {row.flag for row in settings.given(args)}
    if "--upstream-ttft-s" in given and config.ttft_s > config.failover_s:
        # As a routes file's ttft_s past it is refused: the window would end every wait first.
        raise ValueError(
            f"--upstream-ttft-s {config.ttft_s:g} is past the failover window "
            f"({config.failover_s:g} s, which ends every wait for a first text): raise "
            "--upstream-failover-s too"
        )
    if "--upstream-timeout-s" in given and config.headers_timeout_s > config.failover_s:
        # Every wait it bounds (a text request's head, an embeddings answer) is cut at what
        # the failover window has left: a value past the window is never waited out.
        raise ValueError(
            f"--upstream-timeout-s {config.headers_timeout_s:g} is past the failover window "
            f"({config.failover_s:g} s, which ends every wait for an upstream's answer): "
            "lower it, or raise --upstream-failover-s too"
        )
    return config


def shared_slots_problem(config: UpstreamConfig) -> str | None:
    """What limits of requests at once too high for ``--workers`` are, said; None when they
    fit. The workers hold each limit together through one open file per slot, which every
    worker keeps open: past what a process may open (``ulimit -n``), the files would take
    the descriptors its connections need, and it would accept none. Half is left for them
    (each relayed reply holds two: its client's and its upstream's)."""
    limits = [(upstream_limit(t, config), t) for t in config.targets]
    limited = [(limit, t) for limit, t in limits if limit is not None]
    total = sum(limit for limit, _ in limited)
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not limited or soft == resource.RLIM_INFINITY or total <= soft // 2:
        return None
    _, largest = max(limited, key=lambda pair: pair[0])
    if largest.max_outstanding is not None and largest.entry is not None:
        source = f"--upstream-routes {largest.entry}.max_outstanding"
    else:
        source = "--upstream-max-outstanding"
    return (
        f"{source}: with --workers each worker keeps a file open per request an upstream "
        f"may be sent at once, {total} here, past half the {soft} files a process may open "
        f"(ulimit -n; the other half is for connections): lower the limits, or raise "
        f"ulimit -n to {2 * total} or more"
    )


def queue_without_limit(args: argparse.Namespace, config: UpstreamConfig) -> str | None:
    """What ``--upstream-queue-s`` given with no upstream's limit of requests at once to wait
    under would do (nothing), said; None when it has one to apply to. Refused at start; on a
    reload of the routes file (which cannot change the command line) said as a warning."""
    limited = config.max_outstanding is not None or any(
        target.max_outstanding is not None for target in config.targets
    )
    if limited or "--upstream-queue-s" not in {row.flag for row in settings.given(args)}:
        return None
    return (
        "--upstream-queue-s is how long a request waits for room at upstreams at their "
        "limit of requests at once, and no upstream has one: add --upstream-max-outstanding "
        "(or max_outstanding in the routes file), or drop it"
    )


def idle_upstream_flag(args: argparse.Namespace, config: UpstreamConfig) -> str | None:
    """What a relay flag given that no upstream would read does (nothing), said; None when
    each one given applies to some upstream: ``--upstream-queue-s`` with no limit to wait
    under (``queue_without_limit``), and a default every upstream overrides with its own
    (its routes entry's ``max_outstanding``, ``ttft_s`` or ``stall_s``; its own key, or the
    caller's, for the key to send). Refused at start; on a reload of the routes file said
    as a warning."""
    queue = queue_without_limit(args, config)
    if queue is not None:
        return queue
    given = {row.flag for row in settings.given(args)}
    targets = config.targets
    overridden = (
        (
            "--upstream-max-outstanding",
            all(target.max_outstanding is not None for target in targets),
            "its own max_outstanding",
        ),
        ("--upstream-ttft-s", all(t.ttft_s is not None for t in targets), "its own ttft_s"),
        ("--upstream-stall-s", all(t.stall_s is not None for t in targets), "its own stall_s"),
        (
            "--upstream-api-key",
            all(t.api_key is not None or config.passes_client_key(t) for t in targets),
            "its own api_key, or the client's key (pass_client_key)",
        ),
        (
            "--upstream-pass-client-key",
            all(t.api_key is not None or t.pass_client_key is not None for t in targets),
            "its own api_key or pass_client_key",
        ),
    )
    for flag, every_one, own in overridden:
        if flag in given and every_one:
            return (
                f"{flag} is the default for upstreams without a setting of their own, and "
                f"every upstream of --upstream-routes has {own}: drop it"
            )
    return None


def build_hf(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    """The Hugging Face engine (imports torch and transformers: the ``hf`` extra)."""
    assert choice.path is not None
    try:
        check_model_folder(choice.path)  # a wrong path is told first, torch or not
        from replystream.engine.hf import load_hf_engine
    except ValueError as exc:
        raise ValueError(f"--engine hf:PATH: {exc}") from None
    except ImportError as exc:
        raise ValueError(
            f"--engine hf needs torch and transformers (pip install 'replystream[hf]'): {exc}"
        ) from exc
    # --default-max-tokens and --seed are declared once, for the tiny and hf engines alike.
    config = settings.fill(
        HFEngineConfig,
        args,
        ENGINE_SETTINGS,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
    )
    try:
        return load_hf_engine(choice.path, config)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--engine hf:PATH: {exc}") from None
    except RecursionError:  # transformers reads its JSON files with json.loads, which recurses
        raise ValueError(
            f"--engine hf:PATH: {choice.path}: a JSON file of the model (its config.json, or "
            "its tokenizer's) is nested too deeply to read"
        ) from None
