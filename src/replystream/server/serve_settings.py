"""Every setting of ``replystream serve``, declared once, in the order the help shows them.

A row names its flag, what it accepts (a ``cli_values`` checker), its help, and the config
field it fills; that field's dataclass holds the default and the type. ``server.command``
and ``server.engine_options`` build the parser and the configs from ``SERVE_SETTINGS``, and
``scripts/settings_table.py`` writes docs/settings.md from it. A row that fills no field
(the engine spec, the listening address, the moderation lists) states its own default, and
the command reads it itself. The engines' own options are in ``server.engine_settings``.
"""

from __future__ import annotations

import argparse
from typing import Any

from replystream import settings
from replystream.cli_values import (
    Checker,
    float_between,
    host_name,
    int_between,
    non_empty_text,
    non_negative_float,
    non_negative_int,
    origin,
    port,
    positive_float,
    positive_int,
    readable_text_file,
    upper_case,
)
from replystream.delivery.policy import (
    BATCH_MS_MAX,
    BATCH_TOKENS_MAX,
    HOLDBACK_TOKENS_MAX,
    KEEPALIVE_S_MAX,
    KEEPALIVE_S_MIN,
    DeliveryPolicy,
)
from replystream.delivery.replay import FAILOVER_S, TTL_AFTER_END_S
from replystream.server.engine_settings import ENGINE_SETTINGS
from replystream.server.guard_config import GuardConfig, parse_trusted_proxies
from replystream.server.server_config import ServerConfig
from replystream.settings import Group, Setting

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Longer than any orchestrator waits for a stopping process: a typing slip such as 1e300 is
# refused rather than taken as "never stop".
SHUTDOWN_GRACE_S = float_between(0.0, 86_400.0)
# Redis refuses an expiry past about 9e15 s, which failed every resumable reply; 30 days is
# as long as any API keeps a stored reply.
REPLY_TTL_S = float_between(0.0, 30 * 86_400.0, strict=True)
# A request line or header field of a mebibyte is far past any client's (nginx: 8 KiB).
MAX_HEADER_BYTES_MAX = 1 << 20
# Far past any machine's useful count, so a slip (a port number in the wrong flag, say)
# is refused before thousands of processes are started.
MAX_WORKERS = 1024


def _zero_is_never(seconds: float) -> float | None:
    return seconds or None


def _host(text: str) -> str:
    # Empty (or blank), the socket would listen on every interface: said as 0.0.0.0 instead.
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"want an address or host name, got {text!r}: 127.0.0.1, or 0.0.0.0 for every interface"
        )
    if text.startswith("[") and text.endswith("]") and ":" in text:
        return text[1:-1]  # an IPv6 address as a URL writes it ([::1]): the resolver's is bare
    return text


def _as_tuple(items: list[Any]) -> tuple[Any, ...]:
    return tuple(items)


SERVER = Group(
    "",
    (
        Setting(
            "--host",
            "address to listen on",
            Checker("an address or host name (an IPv6 address bare or in brackets)", _host),
            default="127.0.0.1",
        ),
        Setting("--port", "0 picks a free port", port, default=8000),
        Setting(
            "--check",
            "check the whole configuration (flags, files, --host resolved to an address of "
            "this machine, the engine, built as serving would build it) and exit: 0 when "
            "sound, else one line and 2; listens on nothing, asks no upstream or Redis",
            switch=True,
            default=False,
        ),
        Setting(
            "--workers",
            "processes sharing the port (use --redis-url so any of them can resume any reply)",
            int_between(1, MAX_WORKERS),
            default=1,
        ),
        Setting(
            "--loop",
            "event loop: auto is uvloop where it is installed (a dependency on Linux and "
            "macOS), else asyncio's own (see docs/performance.md)",
            choices=("auto", "asyncio", "uvloop"),
            default="auto",
        ),
        # A worker started by --workers serves the socket its parent opened, tells its parent
        # when it accepts connections (a byte on the pipe --ready-fd), and stops when that
        # parent is gone.
        Setting("--listen-fd", "", non_negative_int, hidden=True),
        Setting("--ready-fd", "", non_negative_int, hidden=True),
        Setting("--parent-pid", "", positive_int, hidden=True),
        Setting(
            "--engine",
            "smollm2 (the default when its package is installed, else tiny): SmolLM2-135M-"
            "Instruct on the built-in transformer; tiny: the built-in transformer's own small "
            "model; gguf:PATH: a GGUF file on it; simulated: the lab's seeded word generator; "
            "hf:PATH: a local Hugging Face causal LM; upstream:URL[=WEIGHT]: relay an "
            "OpenAI-compatible server (repeatable: the least busy per unit of weight first; "
            "upstream alone: the upstreams of --upstream-routes)",
            repeatable=True,
            metavar="ENGINE",
            accepts="`smollm2`, `tiny`, `gguf:PATH`, `simulated`, `hf:PATH`, "
            "`upstream:URL[=WEIGHT]` or `upstream`",
        ),
        Setting(
            "--log-level",
            "least severe log record written to stderr",
            upper_case,
            choices=LOG_LEVELS,
            default="WARNING",
        ),
        Setting(
            "--max-body-bytes",
            "largest request body; more gets 413",
            positive_int,
            fills=(ServerConfig, "max_body_bytes"),
        ),
        Setting(
            "--max-prompt-chars",
            "longest prompt, in characters of the text the engine is given (a chat's "
            "messages joined, each with its role); more gets 400",
            positive_int,
            fills=(ServerConfig, "max_prompt_chars"),
        ),
        Setting(
            "--shutdown-grace-s",
            "on SIGTERM, how long replies in flight, and the streams still sending replies, may "
            "take to finish",
            SHUTDOWN_GRACE_S,
            fills=(ServerConfig, "shutdown_grace_s"),
        ),
    ),
)

CLIENT_LIMITS = Group(
    "client limits (0 turns a limit off)",
    (
        Setting(
            "--max-concurrent-per-client",
            "open requests per API key (or per address with auth off), a WebSocket's replies "
            "running at once past its first counting one each; more get 429",
            non_negative_int,
            fills=(GuardConfig, "max_concurrent"),
        ),
        Setting(
            "--requests-per-minute",
            "requests per API key (or address) per minute; more get 429 with Retry-After",
            non_negative_int,
            fills=(GuardConfig, "per_minute"),
        ),
        Setting(
            "--header-timeout-s",
            "close a connection whose first request headers take longer",
            positive_float,
            fills=(GuardConfig, "header_timeout_s"),
        ),
        Setting(
            "--idle-timeout-s",
            "close a kept-alive connection silent this long between requests (keep it above "
            "the idle timeout of a load balancer in front)",
            positive_float,
            fills=(GuardConfig, "idle_timeout_s"),
        ),
        Setting(
            "--body-timeout-s",
            "answer 408 when a request body takes longer",
            positive_float,
            fills=(GuardConfig, "body_timeout_s"),
        ),
        Setting(
            "--max-reading-bytes",
            "request-body bytes read at once over every connection (each body still arriving "
            "counted at its Content-Length, or at --max-body-bytes when chunked), so that "
            "many slow uploads cannot take the process's memory; more get 503 with Retry-After",
            non_negative_int,
            fills=(GuardConfig, "max_reading_bytes"),
        ),
        Setting(
            "--max-header-bytes",
            "longest request line or header field",
            # aiohttp's parser takes this as a C size: past 2**64 it drops every connection
            int_between(256, MAX_HEADER_BYTES_MAX),
            fills=(ServerConfig, "max_header_bytes"),
        ),
        Setting(
            "--trusted-proxy",
            "a proxy (IP address or CIDR network; repeatable or comma-separated) whose "
            "X-Forwarded-For names the client for limits and the access log (default: none)",
            fills=(GuardConfig, "trusted_proxies"),
            convert=parse_trusted_proxies,
            repeatable=True,
            metavar="ADDRESS",
            accepts="IP addresses or CIDR networks, comma-separated",
        ),
        Setting(
            "--cors-origin",
            "allow browser pages from this origin (repeatable; * for any)",
            origin,
            fills=(GuardConfig, "cors_origins"),
            convert=_as_tuple,
            repeatable=True,
            metavar="ORIGIN",
            accepts="an origin (`http(s)://HOST[:PORT]`) or `*`",
        ),
        Setting(
            "--allowed-host",
            "take requests for this name on connections to a loopback address (repeatable; "
            "*.DOMAIN for its subdomains, * for any): there only IP addresses, localhost and "
            "other local names are taken by default, so a site's page whose name was pointed "
            "at this machine (DNS rebinding) cannot use it; a proxy on this machine passing "
            "the browser's Host (nginx's proxy_set_header Host $host) needs its public name",
            host_name,
            fills=(GuardConfig, "allowed_hosts"),
            convert=_as_tuple,
            repeatable=True,
            metavar="NAME",
            accepts="a host name, `*.DOMAIN` or `*`",
        ),
    ),
)

API = Group(
    "OpenAI-compatible API, WebSocket and API keys",
    (
        Setting(
            "--model-name",
            "the model name /v1/models lists and requests may name; a request for no model is "
            "answered as it (default: --upstream-model when given, else the first model a "
            "relay's upstreams list, else the engine's name)",
            non_empty_text,
            fills=(ServerConfig, "model_name"),
        ),
        Setting(
            "--api-key",
            "require this bearer key on /v1/* and the lab's /wait and /stream (repeatable; "
            "visible in ps: prefer a file)",
            repeatable=True,
            metavar="KEY",
        ),
        Setting(
            "--api-keys-file",
            "API keys for /v1/* and the lab's /wait and /stream, one per line (# starts a "
            "comment line), read again on SIGHUP",
            readable_text_file,
        ),
        Setting(
            "--ws-max-replies",
            "replies one WebSocket may run at once",
            positive_int,
            fills=(ServerConfig, "ws_max_replies"),
        ),
    ),
)

DELIVERY = Group(
    "delivery defaults (requests may override the first four)",
    (
        Setting(
            "--batch-tokens",
            "send an event every k tokens (default: every token, or with --batch-ms every window)",
            int_between(1, BATCH_TOKENS_MAX),
            fills=(DeliveryPolicy, "batch_tokens"),
        ),
        Setting(
            "--batch-ms",
            "or once the oldest waiting token is this old (alone: batch by time); more than "
            "0: a window of 0 would send each token as it comes, as no window does, and undo "
            "--batch-tokens",
            # (A request may still ask 0, to send its tokens as they come on a server that
            # batches: what it asks is then what it gets.)
            float_between(0.0, BATCH_MS_MAX, strict=True),
            fills=(DeliveryPolicy, "batch_ms"),
        ),
        Setting(
            "--holdback-tokens",
            "tokens held back until moderation checks have seen them (0: a phrase of "
            "several tokens is stopped at its last, the ones before it already sent); "
            "refused without a check to read them",
            int_between(0, HOLDBACK_TOKENS_MAX),
            fills=(DeliveryPolicy, "holdback_tokens"),
        ),
        Setting(
            "--keepalive-s",
            "after this long with nothing sent, a keep-alive: an SSE comment (or the "
            "dialect's ping event), a WebSocket ping (0: never); a relay's stream begins "
            "only once an upstream has answered, so nothing leaves while it waits for room "
            "(--upstream-queue-s) or for an upstream's answer to begin (--upstream-timeout-s)",
            float_between(KEEPALIVE_S_MIN, KEEPALIVE_S_MAX, zero="never"),
            fills=(DeliveryPolicy, "keepalive_s"),
            convert=_zero_is_never,
        ),
        Setting(
            "--slow-client-bytes",
            "cut a stream whose unsent bytes pass this plus the fewest it has had unsent",
            positive_int,
            fills=(DeliveryPolicy, "slow_client_bytes"),
        ),
        Setting(
            "--slow-client-s",
            "cut a stream whose socket has not drained for this long; a connection whose client "
            "acknowledges nothing sent to it (nor the kernel's keep-alive probes) for this "
            "long plus 5 s is dropped (a peer gone without closing, or whose receive window "
            "stays shut)",
            positive_float,
            fills=(DeliveryPolicy, "slow_client_s"),
        ),
    ),
)

RESUME = Group(
    "resumable replies",
    (
        Setting(
            "--redis-url",
            "keep reply logs in Redis (redis://HOST:PORT/DB; through Sentinel: "
            "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB]; a Cluster: "
            "redis+cluster://HOST:PORT[,HOST:PORT]), so any replica can resume any "
            "reply; without it, this process's memory",
            accepts="a `redis://`, `rediss://`, `unix://`, `redis+sentinel://`, "
            "`rediss+sentinel://`, `redis+cluster://` or `rediss+cluster://` URL",
        ),
        Setting(
            "--redis-failover-s",
            "with --redis-url: how long Redis may be unreachable (a Sentinel failover) before "
            "readers are told and producers stop; meanwhile commands are retried and, once "
            "Redis answers, what it lost is written again from the producers' copies",
            non_negative_float,
            default=FAILOVER_S,
        ),
        Setting(
            "--reply-ttl-s",
            "how long a finished resumable reply can still be read (resumed, retrieved); a "
            "reader on the replica that made it, still sending it then, sends it to its end",
            REPLY_TTL_S,
            default=TTL_AFTER_END_S,
        ),
        Setting(
            "--resumable-by-default",
            "make replies resumable unless a request says otherwise",
            fills=(ServerConfig, "resumable_by_default"),
            switch=True,
        ),
        Setting(
            "--detach-grace-s",
            "how long a resumable reply keeps generating with no reader",
            non_negative_float,
            fills=(ServerConfig, "detach_grace_s"),
        ),
    ),
)

CHECKS = Group(
    "moderation checks (run on held-back text)",
    (
        Setting(
            "--ban",
            "a banned phrase, matched case-insensitively, in any compatibility form (full-width "
            "letters) and with invisible characters (zero-width spaces) inside (repeatable)",
            non_empty_text,
            repeatable=True,
            metavar="PHRASE",
        ),
        Setting(
            "--ban-file",
            "banned phrases, one per line, read again on SIGHUP (replies under way take the "
            "new list at their next token)",
            readable_text_file,
        ),
        Setting(
            "--ban-regex",
            "a named regular expression that must not match (repeatable)",
            repeatable=True,
            metavar="NAME=REGEX",
            accepts="`NAME=REGEX`",
        ),
        Setting(
            "--block-secrets",
            "stop replies that contain credential-shaped strings",
            switch=True,
        ),
    ),
)

SERVE_SETTINGS = (
    SERVER,
    CLIENT_LIMITS,
    API,
    *ENGINE_SETTINGS,
    DELIVERY,
    RESUME,
    CHECKS,
)

REFERENCE_BEGIN = "<!-- settings: begin (python scripts/settings_table.py writes this part) -->"
REFERENCE_END = "<!-- settings: end -->"


def current_reference(document: str) -> str:
    """``document`` (docs/settings.md) with the reference between its markers made from
    ``SERVE_SETTINGS``.

    Raises:
        ValueError: the markers are missing, or out of order.
    """
    table = settings.markdown(SERVE_SETTINGS, "replystream serve")
    return settings.with_current_table(document, table, REFERENCE_BEGIN, REFERENCE_END)
