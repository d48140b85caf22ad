"""``replystream serve --engine ...``: the grammar, and that every flag reaches its engine."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from replystream.engine.simulated import SimulatedEngine
from replystream.engine.tiny import TinyEngine
from replystream.engine.upstream import UpstreamEngine
from replystream.engine.upstream_config import UpstreamTarget
from replystream.server import command
from replystream.server.engine_options import EngineChoice, default_engine, parse_engines
from replystream.server.engine_settings import API_KEY_ENV


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_engine_specs_parse_into_a_choice():
    assert parse_engines(None) == EngineChoice(default_engine())
    assert parse_engines(["smollm2"]) == EngineChoice("smollm2")
    assert parse_engines(["gguf:/m/x.gguf"]) == EngineChoice("gguf", path=Path("/m/x.gguf"))
    assert parse_engines(["simulated"]) == EngineChoice("simulated")
    assert parse_engines(["hf:/models/x"]) == EngineChoice("hf", path=Path("/models/x"))
    two = parse_engines(["upstream:http://a:1/v1=3", "upstream:http://b:2/v1/"])
    assert two.targets == (UpstreamTarget("http://a:1/v1", 3), UpstreamTarget("http://b:2/v1"))


@pytest.mark.parametrize(
    "specs",
    [
        ["gpt"],
        ["tiny", "simulated"],
        ["upstream:http://a/v1", "tiny"],
        ["upstream:ftp://a"],
        ["hf:"],
        ["gguf:"],
    ],
)
def test_bad_engine_specs_are_refused(specs):
    with pytest.raises(ValueError):
        parse_engines(specs)


async def test_upstream_flags_reach_the_engine(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = args_of(
        "--engine",
        "upstream:http://127.0.0.1:9/v1=2",
        "--upstream-stall-s",
        "7",
        "--upstream-timeout-s",
        "3",
        "--upstream-model",
        "m",
        "--upstream-max-event-bytes",
        "99",
    )
    engine = command.build_engine(args)
    assert isinstance(engine, UpstreamEngine)
    c = engine.config
    assert (c.stall_s, c.headers_timeout_s, c.model, c.max_event_size) == (7, 3, "m", 99)
    assert c.api_key == "from-env" and c.targets[0].weight == 2
    flag = command.build_engine(
        args_of("--engine", "upstream:http://h/v1", "--upstream-api-key", "k")
    )
    assert isinstance(flag, UpstreamEngine) and flag.config.api_key == "k"


async def test_speculative_flags_reach_the_tiny_engine():
    engine = command.build_engine(
        args_of(
            *("--engine", "tiny", "--speculative", "prompt-lookup"),
            *("--spec-tokens", "6", "--spec-ngram", "2"),
        )
    )
    assert isinstance(engine, TinyEngine)
    assert (engine.config.spec_tokens, engine.config.spec_ngram) == (6, 2)
    plain = command.build_engine(args_of("--engine", "tiny"))
    assert isinstance(plain, TinyEngine) and plain.config.spec_tokens == 0  # off unless asked
    with pytest.raises(ValueError, match="--speculative prompt-lookup"):
        command.build_engine(args_of("--spec-tokens", "6"))  # would otherwise do nothing
    with pytest.raises(SystemExit):  # refused while parsing: want a whole number >= 1
        args_of("--speculative", "prompt-lookup", "--spec-tokens", "0")


@pytest.mark.parametrize(
    ("engine", "flag", "value"),
    [
        ("tiny", "--delay-ms", "20"),
        ("tiny", "--first-token-ms", "200"),
        ("tiny", "--tokens", "40"),
        ("tiny", "--reply-text", "hi"),
        ("tiny", "--hf-max-running", "2"),
        ("tiny", "--upstream-stall-s", "5"),
        ("simulated", "--kv-blocks", "64"),
        ("simulated", "--default-max-tokens", "64"),
        ("simulated", "--speculative", "prompt-lookup"),
        ("upstream:http://127.0.0.1:9/v1", "--delay-ms", "20"),
        ("upstream:http://127.0.0.1:9/v1", "--max-running", "4"),
        ("upstream:http://127.0.0.1:9/v1", "--seed", "7"),  # the relay passes clients' seeds
    ],
)
def test_an_option_the_engine_does_not_use_is_refused_naming_flag_and_engine(engine, flag, value):
    with pytest.raises(ValueError) as refused:
        command.build_engine(args_of("--engine", engine, flag, value))
    message = str(refused.value)
    assert flag in message and engine.split(":")[0] in message
    assert "\n" not in message


def test_an_option_given_at_its_default_value_is_still_refused_for_another_engine():
    # Detection is by what the command line gave, not by comparing with the default.
    with pytest.raises(ValueError, match="--delay-ms"):
        command.build_engine(args_of("--delay-ms", "33"))


async def test_the_simulated_engine_takes_its_own_options():
    engine = command.build_engine(
        args_of("--engine", "simulated", "--delay-ms", "20", "--jitter-ms", "0", "--tokens", "7")
    )
    assert isinstance(engine, SimulatedEngine)
    assert len(engine.config.reply_text.split()) == 7
    assert (engine.config.delay_ms, engine.config.jitter_ms) == (20, 0)


async def test_seed_reaches_the_models_and_the_simulator_and_each_keeps_its_own_default():
    tiny = command.build_engine(args_of("--engine", "tiny", "--seed", "7"))
    fresh = command.build_engine(args_of("--engine", "tiny"))
    simulated = command.build_engine(args_of("--engine", "simulated", "--seed", "7"))
    lab = command.build_engine(args_of("--engine", "simulated"))
    assert isinstance(tiny, TinyEngine) and isinstance(fresh, TinyEngine)
    assert isinstance(simulated, SimulatedEngine) and isinstance(lab, SimulatedEngine)
    assert (tiny.config.seed, simulated.config.seed) == (7, 7)
    assert fresh.config.seed is None  # a fresh seed per request
    assert lab.config.seed == 42  # the lab's reproducible simulator
    await tiny.aclose()
    await fresh.aclose()
