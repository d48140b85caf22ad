"""``replystream serve --engine ...``: which engine a command line names, and its options.

This file decides the grammar of ``--engine`` (``tiny``, ``simulated``, ``hf:PATH``, or
``upstream:URL[=WEIGHT]`` given once per upstream), and builds the engine it names from the
engine options (declared, with the engines each belongs to, in ``server.engine_settings``).
The rest of the command (``server.command``) stays theirs. It must not know how an engine
works.

An option given to an engine that does not use it is refused at start-up (``--delay-ms`` with
the tiny engine would otherwise be accepted and silently do nothing).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from replystream import settings
from replystream.engine.base import Engine
from replystream.engine.hf_config import HFEngineConfig
from replystream.engine.simulated import SimulatedConfig, reply_of_length, simulated_engine
from replystream.engine.tiny import TinyEngineConfig, load_default_engine
from replystream.engine.upstream import UpstreamConfig, UpstreamEngine, UpstreamTarget
from replystream.server.engine_settings import API_KEY_ENV, ENGINE_SETTINGS

KINDS = ("tiny", "simulated", "hf", "upstream")


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
                f"{kind} engine: add --engine {row.engines[0]}, or drop {row.flag}"
            )
    if args.speculative == "off":
        for row in given:
            if row.flag in ("--spec-tokens", "--spec-ngram"):
                raise ValueError(
                    f"{row.flag} tunes speculative decoding: add --speculative "
                    f"prompt-lookup, or drop {row.flag}"
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
        spec_tokens = args.spec_tokens if args.speculative != "off" else 0
        return load_default_engine(
            settings.fill(TinyEngineConfig, args, ENGINE_SETTINGS, spec_tokens=spec_tokens)
        )
    return build_simulated(args)


def build_simulated(args: argparse.Namespace) -> Engine:
    """The simulated engine; raises ValueError for values that contradict each other."""
    if args.jitter_ms > args.delay_ms:
        raise ValueError(
            f"--jitter-ms {args.jitter_ms:g} is more than --delay-ms {args.delay_ms:g}: "
            "a token's delay cannot be negative; lower --jitter-ms"
        )
    if args.reply_script is not None:
        given = {row.flag for row in settings.given(args)}
        for flag in ("--reply-text", "--tokens"):
            if flag in given:
                raise ValueError(
                    f"--reply-script gives the whole reply, and {flag} shapes it too: drop one"
                )
    text = args.reply_text
    if not text.split():
        raise ValueError("--reply-text has no words; give at least one")
    if args.tokens is not None:
        text = reply_of_length(text, args.tokens)
    return simulated_engine(settings.fill(SimulatedConfig, args, ENGINE_SETTINGS, reply_text=text))


def build_upstream(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    key = args.upstream_api_key or os.environ.get(API_KEY_ENV) or None
    return UpstreamEngine(
        settings.fill(UpstreamConfig, args, ENGINE_SETTINGS, targets=choice.targets, api_key=key)
    )


def build_hf(args: argparse.Namespace, choice: EngineChoice) -> Engine:
    """The Hugging Face engine (imports torch and transformers: the ``hf`` extra)."""
    try:
        from replystream.engine.hf import load_hf_engine
    except ImportError as exc:
        raise ValueError(
            f"--engine hf needs torch and transformers (pip install 'replystream[hf]'): {exc}"
        ) from exc
    assert choice.path is not None
    # --default-max-tokens is declared once, for the tiny and hf engines alike.
    config = settings.fill(
        HFEngineConfig, args, ENGINE_SETTINGS, default_max_tokens=args.default_max_tokens
    )
    try:
        return load_hf_engine(choice.path, config)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--engine hf:PATH: {exc}") from None
