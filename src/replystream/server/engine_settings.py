"""The options of each engine of ``replystream serve``, declared once (see
``server.serve_settings``): each row names the engines it belongs to, and
``server.engine_options`` refuses it for any other and builds the engine's config from it."""

from __future__ import annotations

import argparse

from replystream.cli_values import (
    Checker,
    int_between,
    non_empty_text,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    readable_file,
    schedule_ms,
)
from replystream.engine.base import MAX_TOKENS_LIMIT
from replystream.engine.hf_config import HFEngineConfig
from replystream.engine.reply_script import ReplyScript, ScriptError, load_reply_script
from replystream.engine.seeds import MAX_SEED
from replystream.engine.simulated import SimulatedConfig
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.upstream_config import ROUTINGS, UpstreamConfig, health_path
from replystream.settings import Group, Setting


def _health_path(text: str) -> str:
    try:
        return health_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


API_KEY_ENV = "REPLYSTREAM_UPSTREAM_API_KEY"
SPECULATIVE = ("off", "prompt-lookup")
# The built-in NumPy engine: the tiny model, and GGUF models (SmolLM2 by default) on its parts.
TINY = ("tiny", "smollm2", "gguf")
SIMULATED = ("simulated",)
UPSTREAM = ("upstream",)
SIMULATED_SEED = SimulatedConfig().seed  # its default, which the help of --seed states

TINY_ENGINE = Group(
    "built-in engine (--engine smollm2, the default when installed; tiny; gguf:PATH)",
    (
        Setting(
            "--kv-blocks",
            "KV cache blocks in the pool, 16 tokens each (smollm2 and gguf: 2048)",
            positive_int,
            fills=(TinyEngineConfig, "num_blocks"),
            engines=TINY,
        ),
        Setting(
            "--token-budget",
            "tokens one engine step may process, decode plus prefill chunks (smollm2, gguf: 256)",
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
            "reply length when a request sets no max_tokens (tiny, hf; smollm2 and gguf: 512), "
            "at most the largest max_tokens a request may ask; a legacy /v1/completions "
            "request's is 16 whatever this says, as OpenAI's API has it",
            int_between(1, MAX_TOKENS_LIMIT),
            fills=(TinyEngineConfig, "default_max_tokens"),
            engines=(*TINY, "hf"),
        ),
        Setting(
            "--prefix-caching",
            "keep full KV blocks for later requests that begin with the same tokens (a chat's "
            "next turn, a shared system prompt): their prefill skips them; a reply is then the "
            "same for a seed up to float rounding, not bit for bit",
            fills=(TinyEngineConfig, "prefix_caching"),
            switch=True,
            engines=TINY,
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

# Declared once for every engine that seeds, each with its own default (the help states both):
# it fills the built-in engine's config, and the hf and simulated builders pass it on to theirs.
SEEDING = Group(
    "seeds (--engine smollm2, tiny, gguf:PATH, hf:PATH, simulated)",
    (
        Setting(
            "--seed",
            "the seed of a request that gives none (its own always wins): the models (tiny, "
            "smollm2, gguf, hf) sample with it, so the same request makes the same reply "
            "(default: a fresh seed per request, as OpenAI's and vLLM's); the simulated "
            f"engine's jitter and made-up log probabilities follow it (default: {SIMULATED_SEED})",
            int_between(0, MAX_SEED),  # a request's seed is an int64; this one is no wider
            fills=(TinyEngineConfig, "seed"),
            engines=(*TINY, "hf", *SIMULATED),
        ),
    ),
)


def _reply_script(path: str) -> ReplyScript:
    # A pipe or a device would be read until a writer closes it: the command would wait
    # there, --check too.
    readable_file(path)
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
            "cut or repeat the reply to this many tokens, at most the largest max_tokens a "
            "request may ask (default: its own length)",
            # A reply longer than any request could ask for is built whole before the server
            # listens: 10**11 tokens held it from ever being ready.
            int_between(1, MAX_TOKENS_LIMIT),
            engines=SIMULATED,
        ),
        Setting(
            "--delay-ms",
            "mean time per token",
            schedule_ms,
            fills=(SimulatedConfig, "delay_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--jitter-ms",
            "each token's delay varies uniformly by up to this much (at most --delay-ms; "
            "not given, the default is lowered to --delay-ms when that is less)",
            schedule_ms,
            fills=(SimulatedConfig, "jitter_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--first-token-ms",
            "time before the first token (queueing plus prefill)",
            schedule_ms,
            fills=(SimulatedConfig, "first_token_ms"),
            engines=SIMULATED,
        ),
        Setting(
            "--prefill-ms-per-token",
            "extra time before the first token per prompt word",
            schedule_ms,
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
            "--upstream-routes",
            "a TOML file of upstreams (each one's key, weight and models), model aliases and "
            "fallbacks, read again on SIGHUP",
            metavar="FILE",
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-api-key",
            f"bearer key sent upstream (default: ${API_KEY_ENV}); clients' keys are not, "
            "unless --upstream-pass-client-key",
            fills=(UpstreamConfig, "api_key"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-pass-client-key",
            "send each client's own key upstream (its bearer token or x-api-key) to upstreams "
            "without a key of their own in --upstream-routes",
            switch=True,
            fills=(UpstreamConfig, "pass_client_key"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-model",
            "model name sent upstream when a request names none it serves, and the server's "
            "own name unless --model-name gives one (default: the first one the upstream's "
            "/models lists)",
            non_empty_text,
            fills=(UpstreamConfig, "model"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-timeout-s",
            "connect and response-head limit per upstream attempt, past it the next one is "
            "tried; a chat or completion's head is awaited no longer than its time to a first "
            "text (--upstream-ttft-s) either, an embeddings answer whole within this",
            positive_float,
            fills=(UpstreamConfig, "headers_timeout_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-keepalive-s",
            "a kept-alive connection to an upstream idle this long is closed, not reused (a NAT "
            "or load balancer may have dropped it silently)",
            positive_float,
            fills=(UpstreamConfig, "keepalive_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-ttft-s",
            "no text (nor a reasoning model's thinking) from an upstream within this long: the "
            "request goes to the next one",
            positive_float,
            fills=(UpstreamConfig, "ttft_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-failover-s",
            "other upstreams are tried until this long after the request (or a mid-reply failure)",
            positive_float,
            fills=(UpstreamConfig, "failover_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-stall-s",
            "no text (nor thinking) for this long mid-reply: the reply ends with upstream_stalled "
            "(or continues)",
            positive_float,
            fills=(UpstreamConfig, "stall_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-continue",
            "a reply whose upstream fails mid-reply continues at another one, unless the "
            "request says upstream_continue: false",
            switch=True,
            fills=(UpstreamConfig, "continuation"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-routing",
            "which upstream a request goes to first: the least loaded, or the one whose "
            "prompt cache likely holds its prompt's start (a conversation's turns, one "
            "prompt_cache_key), within a bound on load",
            choices=ROUTINGS,
            fills=(UpstreamConfig, "routing"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-max-outstanding",
            "the most requests each upstream is sent at once (default: no limit); more wait "
            "for room, least loaded upstream first (a routes file's max_outstanding is its own)",
            positive_int,
            fills=(UpstreamConfig, "max_outstanding"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-queue-s",
            "how long a request waits for room at upstreams at their limit of requests at "
            "once before a 503 (0: no wait)",
            non_negative_float,
            fills=(UpstreamConfig, "queue_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-health-s",
            "probe every upstream this often; one that does not answer gets no requests",
            positive_float,
            fills=(UpstreamConfig, "health_s"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-health-path",
            "what a probe asks each upstream for, after its base URL",
            fills=(UpstreamConfig, "health_path"),
            parse=Checker("a path after the upstream's base URL, such as /models", _health_path),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-failures",
            "consecutive failures that open an upstream's circuit (it is skipped)",
            positive_int,
            fills=(UpstreamConfig, "failures"),
            engines=UPSTREAM,
        ),
        Setting(
            "--upstream-cooldown-s",
            "how long an open circuit keeps its upstream out before one trial request (also "
            "the longest an upstream's own Retry-After keeps it out)",
            positive_float,
            fills=(UpstreamConfig, "cooldown_s"),
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

ENGINE_SETTINGS = (TINY_ENGINE, SEEDING, SIMULATED_ENGINE, UPSTREAM_ENGINE, HF_ENGINE)
