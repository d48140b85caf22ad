"""``replystream serve --engine ...``: which engine a command line names, and its options.

This file decides the grammar of ``--engine`` (``tiny``, ``simulated``, ``hf:PATH``, or
``upstream:URL[=WEIGHT]`` given once per upstream), the options that belong to one engine or
another (the tiny engine's pool and speculative decoding, the simulated engine's schedule, the
Hugging Face engine, the upstream relay), and which engine each option belongs to. It builds
those engines; the rest of the command (``server.command``) stays theirs. It must not know how
an engine works.

An option given to an engine that does not use it is refused at start-up (``--delay-ms`` with
the tiny engine would otherwise be accepted and silently do nothing).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replystream.cli_values import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from replystream.engine.base import Engine
from replystream.engine.simulated import (
    DEFAULT_REPLY,
    SimulatedConfig,
    SimulatedEngine,
    reply_of_length,
)
from replystream.engine.tiny import TinyEngineConfig, load_default_engine
from replystream.engine.upstream import UpstreamConfig, UpstreamEngine, UpstreamTarget

API_KEY_ENV = "REPLYSTREAM_UPSTREAM_API_KEY"
SPECULATIVE = ("off", "prompt-lookup")
KINDS = ("tiny", "simulated", "hf", "upstream")

# Where the namespace keeps the engine options a command line gave: dest -> (flag, engines).
_GIVEN = "engine_options_given"


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine ``--engine`` names: its kind, and the upstreams or model folder it needs."""

    kind: str  # one of KINDS
    targets: tuple[UpstreamTarget, ...] = ()
    path: Path | None = None


def parse_engines(specs: list[str] | None) -> EngineChoice:
    """Read every ``--engine`` value (default ``tiny``).

    Raises:
        ValueError: an unknown engine, a bad URL or weight, or kinds mixed.
    """
    specs = specs or ["tiny"]
    try:
        targets = [UpstreamTarget.parse(s[9:]) for s in specs if s.startswith("upstream:")]
    except ValueError as exc:
        raise ValueError(f"--engine upstream:URL: {exc}") from None
    if targets:
        if len(targets) != len(specs):
            raise ValueError("--engine upstream:URL may be repeated, but not mixed with others")
        return EngineChoice("upstream", tuple(targets))
    if len(specs) > 1:
        raise ValueError("only --engine upstream:URL may be given more than once")
    spec = specs[0]
    if spec in ("tiny", "simulated"):
        return EngineChoice(spec)
    if spec.startswith("hf:") and len(spec) > 3:
        return EngineChoice("hf", path=Path(spec[3:]))
    raise ValueError(
        f"--engine wants tiny, simulated, hf:PATH or upstream:URL[=WEIGHT], got {spec!r}"
    )


class EngineOption(argparse.Action):
    """Stores an option's value and notes that the command line gave it, and for which
    engines it means something, so ``check_options`` can refuse it for any other engine."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.engines: tuple[str, ...] = kwargs.pop("engines")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given = dict(getattr(namespace, _GIVEN, None) or {})
        given[self.dest] = (self.option_strings[0], self.engines)
        setattr(namespace, _GIVEN, given)


def _option(group: Any, flag: str, engines: tuple[str, ...], **kwargs: Any) -> None:
    group.add_argument(flag, action=EngineOption, engines=engines, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option that belongs to one engine (or a few), grouped by engine."""
    tiny = parser.add_argument_group("tiny engine (--engine tiny, the default)")
    tiny_defaults = TinyEngineConfig()
    _option(
        tiny,
        "--kv-blocks",
        ("tiny",),
        type=positive_int,
        default=tiny_defaults.num_blocks,
        help="KV cache blocks in the pool (16 tokens each)",
    )
    _option(
        tiny,
        "--token-budget",
        ("tiny",),
        type=positive_int,
        default=tiny_defaults.token_budget,
        help="tokens one engine step may process (decode plus prefill chunks)",
    )
    _option(
        tiny,
        "--max-running",
        ("tiny",),
        type=positive_int,
        default=tiny_defaults.max_running,
        help="sequences decoded together at most",
    )
    _option(
        tiny,
        "--default-max-tokens",
        ("tiny", "hf"),
        type=positive_int,
        default=tiny_defaults.default_max_tokens,
        help="reply length when a request does not set max_tokens (tiny and hf engines)",
    )
    _option(
        tiny,
        "--speculative",
        ("tiny",),
        choices=SPECULATIVE,
        default="off",
        help="prompt-lookup: draft tokens from n-grams already in the context, verified at once",
    )
    _option(
        tiny,
        "--spec-tokens",
        ("tiny",),
        type=positive_int,
        default=4,
        help="draft tokens per step at most (with --speculative prompt-lookup)",
    )
    _option(
        tiny,
        "--spec-ngram",
        ("tiny",),
        type=positive_int,
        default=3,
        help="longest n-gram to look up (with --speculative prompt-lookup)",
    )

    sim = parser.add_argument_group("simulated engine (--engine simulated)")
    sim_defaults = SimulatedConfig()
    simulated = ("simulated",)
    _option(
        sim,
        "--reply-text",
        simulated,
        default=DEFAULT_REPLY,
        help="the reply, one word per token (default: a paragraph about streaming)",
    )
    _option(
        sim,
        "--tokens",
        simulated,
        type=positive_int,
        help="cut or repeat the reply to this many tokens (default: its own length)",
    )
    _option(
        sim,
        "--delay-ms",
        simulated,
        type=non_negative_float,
        default=sim_defaults.delay_ms,
        help="mean time per token",
    )
    _option(
        sim,
        "--jitter-ms",
        simulated,
        type=non_negative_float,
        default=sim_defaults.jitter_ms,
        help="each token's delay varies uniformly by up to this much (at most --delay-ms)",
    )
    _option(
        sim,
        "--seed",
        simulated,
        type=non_negative_int,
        default=sim_defaults.seed,
        help="seeds the jitter (a request's seed overrides it)",
    )
    _option(
        sim,
        "--first-token-ms",
        simulated,
        type=non_negative_float,
        default=sim_defaults.first_token_ms,
        help="time before the first token (queueing plus prefill)",
    )
    _option(
        sim,
        "--prefill-ms-per-token",
        simulated,
        type=non_negative_float,
        default=sim_defaults.prefill_ms_per_token,
        help="extra time before the first token per prompt word",
    )
    _option(
        sim,
        "--fail-after",
        simulated,
        type=non_negative_int,
        help="fault injection for client tests: fail after N tokens (0: at once; default: never)",
    )

    defaults = UpstreamConfig(targets=(UpstreamTarget("http://127.0.0.1"),))
    upstream = parser.add_argument_group(
        "upstream engine (--engine upstream:http://HOST:PORT/v1[=WEIGHT], repeatable)"
    )
    relay = ("upstream",)
    _option(
        upstream,
        "--upstream-api-key",
        relay,
        help=f"bearer key sent upstream (default: ${API_KEY_ENV}); clients' keys never are",
    )
    _option(
        upstream,
        "--upstream-model",
        relay,
        help="model name sent upstream (default: the first one the upstream's /models lists)",
    )
    _option(
        upstream,
        "--upstream-timeout-s",
        relay,
        type=positive_float,
        default=defaults.headers_timeout_s,
        help="connect and response-head limit; past it the client gets 504",
    )
    _option(
        upstream,
        "--upstream-stall-s",
        relay,
        type=positive_float,
        default=defaults.stall_s,
        help="a reply whose upstream sends no byte for this long ends with an error event",
    )
    _option(
        upstream,
        "--upstream-max-event-bytes",
        relay,
        type=positive_int,
        default=defaults.max_event_size,
        help="largest upstream event (and most bytes without one) before the reply is cut",
    )

    hf = parser.add_argument_group("Hugging Face engine (--engine hf:PATH; the hf extra)")
    _option(
        hf,
        "--hf-max-running",
        ("hf",),
        type=positive_int,
        default=4,
        help="replies generated at once (one thread each)",
    )


def check_options(args: argparse.Namespace, kind: str) -> None:
    """Refuse any option the command line gave that engine ``kind`` would not use.

    Raises:
        ValueError: one line naming the option, its engine, and the fix.
    """
    given: dict[str, tuple[str, tuple[str, ...]]] = getattr(args, _GIVEN, None) or {}
    for flag, engines in given.values():
        if kind not in engines:
            owners = " or ".join(engines)
            raise ValueError(
                f"{flag} is an option of the {owners} engine, and this server runs the {kind} "
                f"engine: add --engine {engines[0]}, or drop {flag}"
            )
    if args.speculative == "off":
        for dest in ("spec_tokens", "spec_ngram"):
            if dest in given:
                flag = given[dest][0]
                raise ValueError(
                    f"{flag} tunes speculative decoding: add --speculative "
                    f"prompt-lookup, or drop {flag}"
                )


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
    if choice.kind == "tiny":
        return load_default_engine(
            TinyEngineConfig(
                num_blocks=args.kv_blocks,
                token_budget=args.token_budget,
                max_running=args.max_running,
                default_max_tokens=args.default_max_tokens,
                spec_tokens=args.spec_tokens if args.speculative != "off" else 0,
                spec_ngram=args.spec_ngram,
            )
        )
    return build_simulated(args)


def build_simulated(args: argparse.Namespace) -> Engine:
    """The simulated engine; raises ValueError for values that contradict each other."""
    if args.jitter_ms > args.delay_ms:
        raise ValueError(
            f"--jitter-ms {args.jitter_ms:g} is more than --delay-ms {args.delay_ms:g}: "
            "a token's delay cannot be negative; lower --jitter-ms"
        )
    text = args.reply_text
    if not text.split():
        raise ValueError("--reply-text has no words; give at least one")
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


def build_upstream(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    key = args.upstream_api_key or os.environ.get(API_KEY_ENV) or None
    return UpstreamEngine(
        UpstreamConfig(
            targets=choice.targets,
            api_key=key,
            model=args.upstream_model,
            headers_timeout_s=args.upstream_timeout_s,
            stall_s=args.upstream_stall_s,
            max_event_size=args.upstream_max_event_bytes,
        )
    )


def build_hf(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    """The Hugging Face engine (imports torch and transformers: the ``hf`` extra)."""
    try:
        from replystream.engine.hf import HFEngineConfig, load_hf_engine
    except ImportError as exc:
        raise ValueError(
            f"--engine hf needs torch and transformers (pip install 'replystream[hf]'): {exc}"
        ) from exc
    assert choice.path is not None
    config = HFEngineConfig(
        max_running=args.hf_max_running, default_max_tokens=args.default_max_tokens
    )
    try:
        return load_hf_engine(choice.path, config)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--engine hf:PATH: {exc}") from None
