"""The options of each engine of ``replystream serve``, declared once (see
``server.serve_settings``): each row names the engines it belongs to, and
``server.engine_options`` refuses it for any other and builds the engine's config from it."""

from __future__ import annotations

import argparse

from replystream.cli_values import (
    Checker,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from replystream.engine.hf_config import HFEngineConfig
from replystream.engine.reply_script import ReplyScript, ScriptError, load_reply_script
from replystream.engine.simulated import SimulatedConfig
from replystream.engine.tiny import TinyEngineConfig
from replystream.engine.upstream import UpstreamConfig
from replystream.settings import Group, Setting

API_KEY_ENV = "REPLYSTREAM_UPSTREAM_API_KEY"
SPECULATIVE = ("off", "prompt-lookup")
TINY = ("tiny",)
SIMULATED = ("simulated",)
UPSTREAM = ("upstream",)

TINY_ENGINE = Group(
    "tiny engine (--engine tiny, the default)",
    (
        Setting(
            "--kv-blocks",
            "KV cache blocks in the pool (16 tokens each)",
            positive_int,
            fills=(TinyEngineConfig, "num_blocks"),
            engines=TINY,
        ),
        Setting(
            "--token-budget",
            "tokens one engine step may process (decode plus prefill chunks)",
            positive_int,
            fills=(TinyEngineConfig, "token_budget"),
            engines=TINY,
        ),
        Setting(
            "--max-running",
            "sequences decoded together at most",
            positive_int,
            fills=(TinyEngineConfig, "max_running"),
            engines=TINY,
        ),
        Setting(
            "--default-max-tokens",
            "reply length when a request does not set max_tokens (tiny and hf engines)",
            positive_int,
            fills=(TinyEngineConfig, "default_max_tokens"),
            engines=("tiny", "hf"),
        ),
        Setting(
            "--speculative",
            "prompt-lookup: draft tokens from n-grams already in the context, verified at once",
            choices=SPECULATIVE,
            default="off",
            engines=TINY,
        ),
        # Not TinyEngineConfig.spec_tokens: that is 0 (off) unless --speculative turns it on.
        Setting(
            "--spec-tokens",
            "draft tokens per step at most (with --speculative prompt-lookup)",
            positive_int,
            default=4,
            engines=TINY,
        ),
        Setting(
            "--spec-ngram",
            "longest n-gram to look up (with --speculative prompt-lookup)",
            positive_int,
            fills=(TinyEngineConfig, "spec_ngram"),
            engines=TINY,
        ),
    ),
)


def _reply_script(path: str) -> ReplyScript:
    try:
        return load_reply_script(path)
    except ScriptError as exc:  # argparse prints it after the flag's name, on one line
        raise argparse.ArgumentTypeError(" ".join(str(exc).split())) from None


REPLY_SCRIPT = Checker("a JSON list of text and tool_call steps (docs/api.md)", _reply_script)

SIMULATED_ENGINE = Group(
    "simulated engine (--engine simulated)",
    (
        Setting(
            "--reply-text",
            "the reply, one word per token (default: a paragraph about streaming)",
            fills=(SimulatedConfig, "reply_text"),
            engines=SIMULATED,
        ),
        Setting(
            "--reply-script",
            "make this scripted reply instead: text and tool calls with their timing (a JSON file)",
            REPLY_SCRIPT,
            fills=(SimulatedConfig, "script"),
            metavar="FILE",
            engines=SIMULATED,
        ),
        Setting(
            "--tokens",
            "cut or repeat the reply to this many tokens (default: its own length)",
            positive_int,
            engines=SIMULATED,
        ),
        Setting(
            "--delay-ms",
            "mean time per token",
            non_negative_float,
            fills=(SimulatedConfig, "delay_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--jitter-ms",
            "each token's delay varies uniformly by up to this much (at most --delay-ms)",
            non_negative_float,
            fills=(SimulatedConfig, "jitter_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--seed",
            "seeds the jitter (a request's seed overrides it)",
            non_negative_int,
            fills=(SimulatedConfig, "seed"),
            engines=SIMULATED,
        ),
        Setting(
            "--first-token-ms",
            "time before the first token (queueing plus prefill)",
            non_negative_float,
            fills=(SimulatedConfig, "first_token_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--prefill-ms-per-token",
            "extra time before the first token per prompt word",
            non_negative_float,
            fills=(SimulatedConfig, "prefill_ms_per_token"),
            engines=SIMULATED,
        ),
        Setting(
            "--fail-after",
            "fault injection for client tests: fail after N tokens (0: at once; default: never)",
            non_negative_int,
            fills=(SimulatedConfig, "fail_after"),
            engines=SIMULATED,
        ),
    ),
)

UPSTREAM_ENGINE = Group(
    "upstream engine (--engine upstream:http://HOST:PORT/v1[=WEIGHT], repeatable)",
    (
        Setting(
            "--upstream-api-key",
            f"bearer key sent upstream (default: ${API_KEY_ENV}); clients' keys never are",
            fills=(UpstreamConfig, "api_key"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-model",
            "model name sent upstream (default: the first one the upstream's /models lists)",
            fills=(UpstreamConfig, "model"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-timeout-s",
            "connect and response-head limit; past it the client gets 504",
            positive_float,
            fills=(UpstreamConfig, "headers_timeout_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-stall-s",
            "a reply whose upstream sends no byte for this long ends with an error event",
            positive_float,
            fills=(UpstreamConfig, "stall_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-max-event-bytes",
            "largest upstream event (and most bytes without one) before the reply is cut",
            positive_int,
            fills=(UpstreamConfig, "max_event_size"),
            engines=UPSTREAM,
        ),
    ),
)

HF_ENGINE = Group(
    "Hugging Face engine (--engine hf:PATH; the hf extra)",
    (
        Setting(
            "--hf-max-running",
            "replies generated at once (one thread each)",
            positive_int,
            fills=(HFEngineConfig, "max_running"),
            engines=("hf",),
        ),
    ),
)

ENGINE_SETTINGS = (TINY_ENGINE, SIMULATED_ENGINE, UPSTREAM_ENGINE, HF_ENGINE)
