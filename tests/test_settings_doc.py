"""Each setting of ``replystream serve`` is declared once: the help, the configs and
docs/settings.md are built from ``SERVE_SETTINGS`` and agree with it.

The help is read from the real command (a subprocess), the configs from ``build_config`` and
the engine builders, the reference from the document on disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from replystream import settings
from replystream.delivery.policy import DeliveryPolicy
from replystream.engine.hf_config import HFEngineConfig
from replystream.engine.reply_script import load_reply_script
from replystream.engine.simulated import SimulatedConfig, SimulatedEngine
from replystream.engine.tiny import TinyEngine
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamConfig
from replystream.server import command, engine_options
from replystream.server.guard_config import GuardConfig
from replystream.server.serve_settings import SERVE_SETTINGS, current_reference
from replystream.server.server_config import ServerConfig

DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
ROWS = list(settings.rows(SERVE_SETTINGS))

# Fields of the configs the table fills that no flag sets: built by the command from several
# flags, or not a command-line setting at all.
NOT_FLAGS = {
    "ServerConfig": {"policy", "guard", "api_keys", "gzip_min_bytes"},
    "DeliveryPolicy": {"checks"},
    "GuardConfig": set(),
    "TinyEngineConfig": {"block_size", "blas_threads", "spec_tokens"},
    "SimulatedConfig": {"seed"},  # from --seed, when given (declared for the models)
    # aliases, fallbacks: from --upstream-routes; api_key_from: which of two settings gave
    # api_key
    "UpstreamConfig": {"targets", "aliases", "fallbacks", "api_key_from"},
    "HFEngineConfig": {"default_max_tokens", "torch_threads", "seed"},
}


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_settings_reference_in_the_docs_is_current() -> None:
    document = DOCUMENT.read_text()
    assert current_reference(document) == document, (
        "docs/settings.md is stale: run python scripts/settings_table.py"
    )


def test_a_reference_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the lines"):
        current_reference("# no table here\n")


def test_every_flag_the_real_help_lists_is_in_the_reference_with_its_default() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "replystream", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    flags = set(re.findall(r"^  (--[a-z-]+)", done.stdout, re.MULTILINE)) - {"--help"}
    document = DOCUMENT.read_text()
    in_reference = set(re.findall(r"^\| `(--[a-z-]+)`", document, re.MULTILINE))
    assert flags == in_reference
    for row in ROWS:
        if row.hidden:
            continue
        line = next(x for x in document.splitlines() if x.startswith(f"| `{row.flag}`"))
        assert f"| {settings.shown_default(row)} |" in line, line
        entry = done.stdout[done.stdout.index(f"  {row.flag}") :].split("\n  --", 1)[0]
        if settings.shown_default(row):
            assert f"(default: {row.initial()})" in " ".join(entry.split()), entry


def test_every_config_field_is_filled_by_one_flag_or_named_as_not_a_flag() -> None:
    filled: dict[str, list[str]] = {}
    for row in ROWS:
        if row.fills is not None:
            filled.setdefault(row.fills[0].__name__, []).append(row.fills[1])
    assert set(filled) == set(NOT_FLAGS)
    configs = (
        ServerConfig,
        DeliveryPolicy,
        GuardConfig,
        TinyEngineConfig,
        SimulatedConfig,
        UpstreamConfig,
        HFEngineConfig,
    )
    for config in configs:
        names = [item.name for item in dataclasses.fields(config)]
        by_flags = filled[config.__name__]
        assert len(by_flags) == len(set(by_flags)), f"a field of {config.__name__} set twice"
        assert sorted(by_flags + sorted(NOT_FLAGS[config.__name__])) == sorted(names), config


def test_with_no_flags_the_configs_are_their_dataclass_defaults() -> None:
    args = args_of()
    assert command.build_config(args) == ServerConfig()
    for config in (TinyEngineConfig, SimulatedConfig, HFEngineConfig):
        assert settings.fill(config, args, SERVE_SETTINGS) == config()


def a_value(row: settings.Setting) -> tuple[str, Any]:
    """A value other than the default that ``row`` accepts, as text and as parsed."""
    wants = row.what_it_accepts()
    if row.choices:
        other = next(choice for choice in row.choices if choice != row.initial())
        return other, other
    if row.parse is None or wants.startswith("UTF-8 text"):  # text as given, checked
        return "other", "other"
    if wants.startswith("a path after the upstream's base URL"):
        return "health", "/health"
    if row.flag == "--reply-script":
        path = Path(tempfile.mkdtemp()) / "script.json"
        path.write_text('[{"text": "hi "}, {"tool_call": {"name": "f", "arguments": "{}"}}]')
        return str(path), load_reply_script(path)
    # "a number >= 0", "a whole number > 1", "a number from 0 to 60000", "a number > 0 and <=
    # 60000", "a number from 0.1 to 3600, or 0 (never)": the bound's low end
    number = re.fullmatch(
        r"a (whole )?number (?:>=|>|from) ([0-9.]+)(?: to [0-9.]+| and <= [0-9.]+)?"
        r"(?:, or 0 \(\w+\))?",
        wants,
    )
    assert number, f"{row.flag}: no sample value for {wants!r}"
    low = float(number.group(2))
    if number.group(1):
        return str(int(low) + 3), int(low) + 3
    return str(low + 2.5), low + 2.5


def config_of(row: settings.Setting, args: argparse.Namespace) -> Any:
    """The config object ``row`` fills, built the way the command builds it."""
    owner = row.fills[0] if row.fills else None
    if owner in (ServerConfig, DeliveryPolicy, GuardConfig):
        config = command.build_config(args)
        return {ServerConfig: config, DeliveryPolicy: config.policy, GuardConfig: config.guard}[
            owner
        ]
    engine = command.build_engine(args)
    assert isinstance(engine, SimulatedEngine | UpstreamEngine | TinyEngine)
    return engine.config


ENGINE_OF = {
    TinyEngineConfig: ["--engine", "tiny", "--speculative", "prompt-lookup"],
    SimulatedConfig: ["--engine", "simulated", "--jitter-ms", "0"],
    UpstreamConfig: ["--engine", "upstream:http://127.0.0.1:9/v1"],
}
VALUED = [
    row
    for row in ROWS
    if row.fills and not row.repeatable and not row.switch and row.fills[0] is not HFEngineConfig
]


@pytest.mark.parametrize("row", VALUED, ids=[row.flag for row in VALUED])
async def test_each_valued_flag_reaches_the_config_field_it_declares(row: settings.Setting):
    assert row.fills is not None
    text, parsed = a_value(row)
    assert parsed != row.initial()
    extra = ENGINE_OF.get(row.fills[0], [])
    if row.flag == "--jitter-ms":
        extra = ["--engine", "simulated", "--delay-ms", "99"]
    if row.flag == "--upstream-queue-s":  # a wait for room under a limit: one is given
        extra = [*extra, "--upstream-max-outstanding", "2"]
    if row.flag == "--token-budget":  # a small budget, with room for the drafts made
        extra = [*extra, "--spec-tokens", "1"]
    if row.flag == "--holdback-tokens":  # a window for a check to read the text in
        extra = [*extra, "--ban", "phrase"]
    args = args_of(*extra, row.flag, text)
    config = config_of(row, args)
    expected = parsed if row.convert is None else row.convert(parsed)
    assert getattr(config, row.fills[1]) == expected


def test_an_engine_option_is_refused_for_another_engine_by_its_declaration() -> None:
    for row in ROWS:
        if not row.engines or row.choices:
            continue
        other = next(kind for kind in ("simulated", "tiny", "upstream") if kind not in row.engines)
        given = [row.flag] if row.switch else [row.flag, a_value(row)[0]]
        with pytest.raises(ValueError, match=f"{row.flag} is an option of the"):
            engine_options.check_options(args_of("--engine", other, *given), other)


def test_the_engine_flags_help_names_every_engine_it_accepts() -> None:
    engine = next(row for row in ROWS if row.flag == "--engine")
    for kind in engine_options.KINDS:
        assert kind in engine.help, kind
        assert f"`{kind}" in engine.accepts, kind
    assert "round robin" not in engine.help  # routing is least outstanding, not round robin
