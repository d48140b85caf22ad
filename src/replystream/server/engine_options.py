"""``replystream serve --engine ...``: which engine a command line names, and its options.

This file decides the grammar of ``--engine`` (``tiny``, ``simulated``, ``hf:PATH``, or
``upstream:URL[=WEIGHT]`` given once per upstream) and the options of the upstream relay, the
Hugging Face engine and the tiny engine's speculative decoding. It builds those engines; the
rest of the command (``server.command``) stays theirs. It must not know how an engine works.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from replystream.engine.base import Engine
from replystream.engine.upstream import UpstreamConfig, UpstreamEngine, UpstreamTarget

API_KEY_ENV = "REPLYSTREAM_UPSTREAM_API_KEY"
SPECULATIVE = ("off", "prompt-lookup")


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine ``--engine`` names: its kind, and the upstreams or model folder it needs."""

    kind: str  # "tiny", "simulated", "upstream" or "hf"
    targets: tuple[UpstreamTarget, ...] = ()
    path: Path | None = None


def parse_engines(specs: list[str] | None) -> EngineChoice:
    """Read every ``--engine`` value (default ``tiny``).

    Raises:
        ValueError: an unknown engine, a bad URL or weight, or kinds mixed.
    """
    specs = specs or ["tiny"]
    targets = [UpstreamTarget.parse(s[9:]) for s in specs if s.startswith("upstream:")]
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the upstream relay, the Hugging Face engine and speculative decoding."""
    defaults = UpstreamConfig(targets=(UpstreamTarget("http://127.0.0.1"),))
    upstream = parser.add_argument_group(
        "upstream engine (--engine upstream:http://HOST:PORT/v1[=WEIGHT], repeatable)"
    )
    upstream.add_argument(
        "--upstream-api-key",
        help=f"bearer key sent upstream (default: ${API_KEY_ENV}); clients' keys never are",
    )
    upstream.add_argument(
        "--upstream-model",
        help="model name sent upstream (default: the first one the upstream's /models lists)",
    )
    upstream.add_argument(
        "--upstream-timeout-s",
        type=float,
        default=defaults.headers_timeout_s,
        help="connect and response-head limit; past it the client gets 504",
    )
    upstream.add_argument(
        "--upstream-stall-s",
        type=float,
        default=defaults.stall_s,
        help="a reply whose upstream sends no byte for this long ends with an error event",
    )
    upstream.add_argument(
        "--upstream-max-event-bytes",
        type=int,
        default=defaults.max_event_size,
        help="largest upstream event (and most bytes without one) before the reply is cut",
    )

    hf = parser.add_argument_group("Hugging Face engine (--engine hf:PATH; the hf extra)")
    hf.add_argument(
        "--hf-max-running", type=int, default=4, help="replies generated at once (one thread each)"
    )

    spec = parser.add_argument_group("speculative decoding (tiny engine)")
    spec.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        default="off",
        help="prompt-lookup: draft tokens from n-grams already in the context, verified at once",
    )
    spec.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per step at most")
    spec.add_argument("--spec-ngram", type=int, default=3, help="longest n-gram to look up")


def spec_tokens(args: argparse.Namespace) -> int:
    """Draft tokens per step for the tiny engine (0: speculative decoding off)."""
    if args.speculative == "off":
        return 0
    if args.spec_tokens < 1 or args.spec_ngram < 1:
        raise ValueError("--spec-tokens and --spec-ngram must be at least 1")
    return int(args.spec_tokens)


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
    return load_hf_engine(
        choice.path,
        HFEngineConfig(max_running=args.hf_max_running, default_max_tokens=args.default_max_tokens),
    )
