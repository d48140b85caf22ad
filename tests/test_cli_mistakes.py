"""Ordinary command-line mistakes: one line naming the flag and the fix, a non-zero exit.

Every case runs the real command as a subprocess and reads its exit status and stderr, as a
user (or a script) would. Cases cover each subcommand's numbers, URLs and files, engine
specs and engine options, and the socket the server cannot have.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from replystream.client import measure_reply
from replystream.lab.local_server import READY_PREFIX, stop_process
from replystream.lab.workload import MODEL_APIS
from replystream.server.metrics import MULTIPROCESS_DIR_ENV as MULTIPROCESS
from tests.conftest import fast_engine, serve_engine
from tests.processes import replica
from tests.rawhttp import raw_request
from tests.services import free_port

CLI = [sys.executable, "-m", "replystream"]


def run(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | (env or {})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    return lines[0]


def run_in_bounded_memory(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``run``, in at most 3 GiB of address space (a child it starts too): a value that once
    made the command build something without end fails it with a MemoryError, not the
    machine."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=bound
    )


FILE = str(Path(__file__))
FOLDER = str(Path(__file__).parent)
QUICK_LAB = ["--calls", "1", "--tokens", "2", "--delay-ms", "1", "--jitter-ms", "0"]

# A relay to an upstream no test reaches (its flags are refused before it is tried).
RELAY = ["serve", "--port", "0", "--engine", "upstream:http://127.0.0.1:9/v1"]

CASES: list[tuple[list[str], str]] = [
    # serve: numbers
    (["serve", "--port", "99999"], "argument --port: want a port from 0 to 65535"),
    (["serve", "--port", "-1"], "argument --port: want a port from 0 to 65535"),
    (["serve", "--port", "http"], "argument --port: want a whole number, got 'http'"),
    (["serve", "--workers", "0"], "argument --workers: want a whole number from 1 to 1024"),
    (["serve", "--workers", "8000"], "argument --workers: want a whole number from 1 to 1024"),
    # A Host header's name alone: a URL would match no request.
    (
        ["serve", "--allowed-host", "https://chat.example.com"],
        "argument --allowed-host: want a host name, *.DOMAIN for its subdomains, or *, got "
        "'https://chat.example.com' (the name alone: no scheme, port or path)",
    ),
    # A request's seed is an int64; the server's default seed is held to the same.
    (
        ["serve", "--seed", str(1 << 63)],
        "argument --seed: want a whole number from 0 to 9223372036854775807",
    ),
    (["serve", "--shutdown-grace-s", "-1"], "argument --shutdown-grace-s: want a number from 0 to"),
    (["serve", "--max-body-bytes", "-5"], "argument --max-body-bytes: want a whole number >= 1"),
    (["serve", "--ws-max-replies", "0"], "argument --ws-max-replies: want a whole number >= 1"),
    (["serve", "--detach-grace-s", "-1"], "argument --detach-grace-s: want a number >= 0"),
    (["serve", "--keepalive-s", "nan"], "argument --keepalive-s: want a finite number"),
    (["serve", "--kv-blocks", "0"], "argument --kv-blocks: want a whole number >= 1"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
    (
        ["serve", "--max-header-bytes", "10"],
        "argument --max-header-bytes: want a whole number from 256 to 1048576",
    ),
    # serve: an origin is scheme://host[:port], as a browser sends it, and nothing more
    (
        ["serve", "--cors-origin", "nope"],
        "argument --cors-origin: want an origin, http(s)://HOST[:PORT], or *, got 'nope'",
    ),
    (
        ["serve", "--cors-origin", "app.example.com"],
        "argument --cors-origin: want an origin, http(s)://HOST[:PORT], or *, got "
        "'app.example.com' (https://app.example.com?)",
    ),
    (
        ["serve", "--cors-origin", "https://app.example.com/"],
        "argument --cors-origin: an origin ends at its host or port: drop the trailing slash "
        "(https://app.example.com)",
    ),
    (
        ["serve", "--cors-origin", "https://app.example.com/path?q=1"],
        "argument --cors-origin: an origin has no path, query or fragment: want "
        "https://app.example.com, got",
    ),
    # An IPv6 origin: its brackets closed, round an address, with no zone (no browser
    # takes a URL with one)
    (
        ["serve", "--check", "--cors-origin", "http://[::1"],
        "argument --cors-origin: want an origin, http(s)://HOST[:PORT], or *, got 'http://[::1'",
    ),
    (
        ["serve", "--check", "--cors-origin", "http://[fe80::1%25eth0]:3000"],
        "argument --cors-origin: want an origin, http(s)://HOST[:PORT], or * (an IPv6 address "
        "in brackets, with no zone), got 'http://[fe80::1%25eth0]:3000'",
    ),
    (
        ["serve", "--cors-origin", "https://app.example.com:0"],
        "argument --cors-origin: want a port from 1 to 65535",
    ),
    # serve: files and engines
    (["serve", "--api-keys-file", "/nonexistent"], "--api-keys-file: /nonexistent does not exist"),
    # an empty file name is no file, not the current folder
    (["serve", "--api-keys-file", ""], "--api-keys-file: want a file name, got an empty one"),
    (["serve", "--ban-file", ""], "--ban-file: want a file name, got an empty one"),
    (
        ["serve", "--engine", "upstream", "--upstream-routes", ""],
        "--upstream-routes: want a file name, got an empty one",
    ),
    (["serve", "--ban-file", FOLDER], f"--ban-file: {FOLDER} is a folder"),
    (["serve", "--ban-file", "/dev/null"], "--ban-file: /dev/null is not a regular file"),
    (
        ["serve", "--ban-regex", "card=[0-9]{16}", "--ban-regex", "card=x"],
        "--ban-regex card is given twice: name each pattern once",
    ),
    (
        ["serve", "--ban-regex", "digits=[0-9]*"],
        "--ban-regex digits: [0-9]* matches the empty text, so it would stop every reply",
    ),
    (
        ["serve", "--engine", "gpt"],
        "--engine wants smollm2, tiny, simulated, gguf:PATH, hf:PATH or",
    ),
    (["serve", "--engine", "hf:/nonexistent"], "--engine hf:PATH: /nonexistent is not"),
    (
        ["serve", "--engine", "gguf:/nonexistent"],
        "--engine gguf:PATH: /nonexistent: cannot be read",
    ),
    (["serve", "--engine", "upstream:ftp://x"], "--engine upstream:URL: an upstream URL must be"),
    (
        ["serve", "--engine", "upstream:http://"],
        "--engine upstream:URL: an upstream URL has no host",
    ),
    (
        ["serve", "--engine", "upstream:http://127.0.0.1:port/v1"],
        "--engine upstream:URL: an upstream URL has a port that is not a number from 1 to 65535",
    ),
    (
        ["serve", "--engine", "upstream:http://127.0.0.1:9/v1?key=k"],
        "--engine upstream:URL: an upstream URL may not have a query or a fragment",
    ),
    # A weight that is not a whole number was once read as part of the URL's path.
    (
        ["serve", "--engine", "upstream:http://127.0.0.1:9/v1=0.5"],
        "--engine upstream:URL: an upstream weight (after =) must be a whole number, got '0.5'",
    ),
    (
        ["serve", "--engine", "upstream:http://127.0.0.1:9/v1=²"],
        "--engine upstream:URL: an upstream weight (after =) must be a whole number, got '²'",
    ),
    # Python's int() reads these, and no one means them on a command line.
    (["serve", "--port", "80_00"], "argument --port: want a whole number, got '80_00'"),
    (
        ["serve", "--port", "\uff18\uff10"],
        "argument --port: want a whole number, got '\uff18\uff10'",
    ),
    (["serve", "--delay-ms", "1_0.5"], "argument --delay-ms: want a number, got '1_0.5'"),
    # The probe's path goes into its request line as it is.
    (
        [*RELAY, "--upstream-health-path", "/a b\r\nX-Injected: yes"],
        "argument --upstream-health-path: a path of visible ASCII characters (no space, no #;",
    ),
    (
        [*RELAY, "--upstream-health-path", "http://elsewhere/x"],
        "argument --upstream-health-path: want a path after the upstream's base URL, not a URL",
    ),
    ([*RELAY, "--upstream-health-path", ""], "want a path after the upstream's base URL, such"),
    ([*RELAY, "--upstream-queue-s", "5"], "--upstream-queue-s is how long a request waits"),
    ([*RELAY, "--upstream-ttft-s", "61"], "--upstream-ttft-s 61 is past the failover window (60 s"),
    # Every wait it bounds is cut where the failover window ends: a longer one was ignored.
    (
        [*RELAY, "--upstream-timeout-s", "61"],
        "--upstream-timeout-s 61 is past the failover window (60 s",
    ),
    (
        [*RELAY, "--check", "--upstream-timeout-s", "20", "--upstream-failover-s", "10"],
        "--upstream-timeout-s 20 is past the failover window (10 s",
    ),
    (
        [*RELAY, "--upstream-api-key", "ключ"],
        "--upstream-api-key: the upstream API key must be one word of printable ASCII",
    ),
    (  # an empty flag would fall back to the environment's key, or to none, unsaid
        [*RELAY, "--upstream-api-key", ""],
        "--upstream-api-key is empty: leave it out for no key",
    ),
    (  # a key with a space (two keys, a comment after one) is never one an upstream takes
        [*RELAY, "--upstream-api-key", "sk a"],
        "--upstream-api-key: the upstream API key must be one word of printable ASCII",
    ),
    (
        [
            "serve",
            "--port",
            "0",
            "--engine",
            "upstream:http://LocalHost:80/v1/",
            "--engine",
            "upstream:http://localhost/v1",
        ],
        "--engine upstream: the upstream at http://LocalHost:80/v1 is given twice "
        "(also as http://localhost/v1)",
    ),
    (
        [
            *RELAY[:3],
            "--check",
            "--engine",
            "upstream:http://[::1]:9/v1",
            "--engine",
            "upstream:http://[0::1]:9/v1",
        ],
        "--engine upstream: the upstream at http://[::1]:9/v1 is given twice "
        "(also as http://[0::1]:9/v1)",
    ),
    (["serve", "--redis-url", "http://x"], "--redis-url: expected one of redis://"),
    (["serve", "--redis-url", "redis+sentinel://127.0.0.1:26379"], "names its service"),
    (["serve", "--redis-failover-s", "5"], "--redis-failover-s is an option of --redis-url"),
    # serve: an option the engine would not use
    (["serve", "--delay-ms", "20"], "--delay-ms is an option of the simulated engine"),
    (["serve", "--first-token-ms", "200"], "add --engine simulated, or drop --first-token-ms"),
    # The fix names how the engine is asked for, where its bare name would be refused.
    (["serve", "--hf-max-running", "2"], "add --engine hf:PATH, or drop --hf-max-running"),
    (
        ["serve", "--upstream-queue-s", "3"],
        "add --engine upstream:URL (or upstream with --upstream-routes FILE), or drop",
    ),
    (
        ["serve", "--engine", "simulated", "--kv-blocks", "9"],
        "--kv-blocks is an option of the tiny",
    ),
    (["serve", "--spec-tokens", "3"], "add --speculative prompt-lookup, or drop --spec-tokens"),
    (  # drafts are cut to the step's budget: one of 3 leaves a draft of 3 no room at all
        [
            *("serve", "--check", "--engine", "tiny", "--speculative", "prompt-lookup"),
            *("--spec-tokens", "3", "--token-budget", "3"),
        ],
        "--token-budget 3 leaves no room for --spec-tokens 3: a step drafting 3 tokens takes 4",
    ),
    # a delivery default a request could not set: the request's own range holds for the server's
    (
        ["serve", "--engine", "simulated", "--port", "0", "--keepalive-s", "1e-9"],
        "argument --keepalive-s: want a number from 0.1 to 3600, or 0 (never), got 1e-9",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--batch-ms", "1e300"],
        "argument --batch-ms: want a number > 0 and <= 60000, got 1e300",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--batch-tokens", "4097"],
        "argument --batch-tokens: want a whole number from 1 to 4096, got 4097",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--holdback-tokens", "4097"],
        "argument --holdback-tokens: want a whole number from 0 to 4096, got 4097",
    ),
    # a window of no time: every token sent as it comes, as with none, --batch-tokens undone
    (
        ["serve", "--check", "--engine", "simulated", "--batch-tokens", "4", "--batch-ms", "0"],
        "argument --batch-ms: want a number > 0 and <= 60000, got 0",
    ),
    # a window for checks that are not there: every token delayed, for nothing to read it
    (
        ["serve", "--engine", "simulated", "--port", "0", "--holdback-tokens", "4"],
        "--holdback-tokens 4 holds tokens back for moderation checks to read, and none is "
        "given (--ban, --ban-file, --ban-regex, --block-secrets): add one, or drop "
        "--holdback-tokens",
    ),
    # Past what Redis takes as an expiry (every resumable reply failed), aiohttp's parser as a
    # C size (every connection dropped), or any orchestrator's wait for a stopping process
    (
        ["serve", "--engine", "simulated", "--port", "0", "--reply-ttl-s", "1e300"],
        "argument --reply-ttl-s: want a number > 0 and <= 2592000, got 1e300",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--max-header-bytes", str(2**64)],
        f"argument --max-header-bytes: want a whole number from 256 to 1048576, got {2**64}",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--shutdown-grace-s", "1e300"],
        "argument --shutdown-grace-s: want a number from 0 to 86400, got 1e300",
    ),
    # a default reply length no request could ask for (max_tokens is at most 2**20)
    (
        ["serve", "--engine", "tiny", "--port", "0", "--default-max-tokens", "1048577"],
        "argument --default-max-tokens: want a whole number from 1 to 1048576, got 1048577",
    ),
    (
        ["serve", "--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "8"],
        "--jitter-ms 8 is more than --delay-ms 5",
    ),
    (["serve", "--workers", "2", "--delay-ms", "5"], "--delay-ms is an option of the simulated"),
    # serve --workers: what each worker would refuse is refused before any starts
    (
        ["serve", "--workers", "2", "--engine", "upstream", "--upstream-routes", FILE],
        f"--upstream-routes {FILE}: not valid TOML",
    ),
    (
        ["serve", "--workers", "2", "--engine", "simulated", "--delay-ms", "5", "--jitter-ms", "8"],
        "--jitter-ms 8 is more than --delay-ms 5",
    ),
    # lab
    (["lab", "--url", "https://127.0.0.1:8443"], "argument --url: https is not spoken"),
    (["lab", "--url", "http://127.0.0.1:1"], "--url http://127.0.0.1:1: cannot connect"),
    (["lab", "--calls", "-2"], "argument --calls: want a whole number >= 1"),
    # the lab adds /wait?... and /stream?... to --url: a query there would come before them
    (
        ["lab", "--url", "http://127.0.0.1:9?x=1"],
        "--url http://127.0.0.1:9?x=1: the lab adds its own paths and queries",
    ),
    (["lab", "--url", "http://127.0.0.1:9/#top"], "--url http://127.0.0.1:9/#top: the lab adds"),
    (["lab", "--out", FILE], f"argument --out: {FILE}: {FILE} is a file, not a folder"),
    (["lab", "--delay-ms", "-5"], "argument --delay-ms: want a number from 0 to 60000"),
    # A schedule no reply could end in is refused, not served as a run that never ends.
    (["lab", "--delay-ms", "1e300"], "argument --delay-ms: want a number from 0 to 60000"),
    (["serve", "--first-token-ms", "1e9"], "--first-token-ms: want a number from 0 to 60000"),
    # call i asks for seed + i: a seed the API refuses would fail every call
    (
        ["lab", "--seed", "9223372036854775807", "--calls", "2"],
        "--seed 9223372036854775807: call i asks for seed + i, and 2 calls need a seed of at "
        "most 9223372036854775806",
    ),
    # An output folder nothing can be made in (whatever its permission bits say, as for
    # root) is refused before the experiment runs, not by a traceback after it.
    (["lab", *QUICK_LAB, "--out", "/proc/nope"], "argument --out: /proc/nope: "),
    (["lab", *QUICK_LAB, "--out", "/sys/nope"], "argument --out: /sys/nope: "),
    # bench
    (["bench", "ftp://x/stream"], "argument url: want http(s)://HOST[:PORT]/PATH"),
    (
        ["bench", "http://127.0.0.1:9/stream", "--insecure"],
        "--insecure skips verifying an https server: the URL is http://",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--duration", "-1"],
        "argument --duration: want a number > 0",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--timeout", "0"],
        "argument --timeout: want a number > 0",
    ),
    (["bench", "http://127.0.0.1:9/stream", "--rate", "0"], "argument --rate: want a number > 0"),
    # bench, doctor: a path that names no endpoint would get every request wrong
    (["bench", "http://127.0.0.1:9"], "names no endpoint (one ending in /completions, "),
    # An unclosed IPv6 bracket: argparse's own "invalid web_url value" named no form
    (["bench", "http://[::1"], "argument url: want http(s)://HOST[:PORT]/PATH (an IPv6 host"),
    (["doctor", "http://[zz]/"], "argument url: want http(s)://HOST[:PORT]/PATH (an IPv6 host"),
    (["lab", "--url", "http://[::1"], "argument --url: want http://HOST[:PORT]/PATH (an IPv6"),
    (["bench", "http://127.0.0.1:9/v1/"], "or name its request shape with --api"),
    (["doctor", "http://127.0.0.1:9/v1"], "or name its request shape with --api"),
    (
        ["doctor", "http://127.0.0.1:9/stream", "--direct", "http://127.0.0.1:8/"],
        "http://127.0.0.1:8/: its path names no endpoint",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--json", FOLDER],
        f"argument --json: {FOLDER} is a folder",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "normal:inf:1"],
        "--prompt-words: 'normal:inf:1': want finite numbers",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "uniform:1:1e400"],
        "--prompt-words: 'uniform:1:1e400': want finite numbers",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--output-tokens", "normal:8:inf"],
        "--output-tokens: 'normal:8:inf': want finite numbers",
    ),
    # a header the client could not write is refused, not a traceback at the first request
    (
        ["bench", "http://127.0.0.1:9/stream", "--header", "X-User: Jos\u00e9"],
        "argument --header: a header value is printable ASCII (percent- or base64-encode the "
        "rest), got 'X-User: Jos\u00e9'",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--header", "X-Tab: a\x7fb"],
        "argument --header: a header value is printable ASCII",
    ),
    # a prompt too long to build is refused, not a traceback or an exhausted memory
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "normal:1e300:0"],
        "--prompt-words: 'normal:1e300:0': lengths must be at most 10,000,000",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "uniform:1:1e12"],
        "--prompt-words: 'uniform:1:1e12': lengths must be at most 10,000,000",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "99999999999999999999"],
        "--prompt-words: '99999999999999999999': length must be at most 10,000,000",
    ),
    # a draw past what a whole number can be made of: refused, not a traceback at the first
    # request (the server refuses max_tokens past 2**20 anyway)
    (
        ["bench", "http://127.0.0.1:9/stream", "--output-tokens", "normal:1e308:1e308"],
        "--output-tokens: 'normal:1e308:1e308': lengths must be at most 1,048,576",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--output-tokens", "2000000"],
        "--output-tokens: '2000000': length must be at most 1,048,576, got 2,000,000",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "normal:10:1e308"],
        "--prompt-words: 'normal:10:1e308': the SD must be at most 10,000,000",
    ),
    # a length spec in another shape says which shapes are read, not Python's words
    (
        ["bench", "http://127.0.0.1:9/stream", "--output-tokens", "uniform:1:2:3"],
        "--output-tokens: 'uniform:1:2:3': want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "many"],
        "--prompt-words: 'many': want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE (>= 0",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", "normal:5"],
        "--prompt-words: 'normal:5': want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE",
    ),
    # empty is a mistake (a script's unset variable), not the default
    (
        ["bench", "http://127.0.0.1:9/stream", "--prompt-words", ""],
        "--prompt-words: '': want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--output-tokens", ""],
        "--output-tokens: '': want N, uniform:LO:HI, normal:MEAN:SD or hist:FILE",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--system-prompt-words", "3000000000"],
        "argument --system-prompt-words: want a whole number from 0 to 10000000, got 3000000000",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--json", "/proc/nope.json"],
        "argument --json: /proc/nope.json: ",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--plot", FILE],
        f"argument --plot: {FILE}: {FILE} is a file",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--slo", "ttft=100", "--slo", "ttft=200"],
        "--slo: each metric may be bounded once",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--concurrency", "2", "--rate", "1"],
        "not allowed with argument",
    ),
    # arrivals no run could wait for: refused, not slept on (10 requests, 1e300 s apart)
    (
        ["bench", "http://127.0.0.1:9/stream", "--rate", "1e-300"],
        "--rate 1e-300: 10 requests at this rate span about 9e+300 s, past the longest run "
        "bench plans, a week (604,800 s); raise --rate, or end the run with --duration",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--rate", "0.1", "--duration", "5"],
        "--rate 0.1: its mean gap, 10 s, is not shorter than --duration 5: about one request "
        "would be sent; raise --rate",
    ),
    # doctor
    (
        ["doctor", "http://127.0.0.1:9/stream", "--timeout", "-1"],
        "argument --timeout: want a number > 0",
    ),
    (
        ["doctor", "http://127.0.0.1:9/stream", "--max-tokens", "0"],
        "argument --max-tokens: want a whole number >= 1",
    ),
    (["doctor", "http://127.0.0.1:99999/stream"], "argument url: want a port from 1 to 65535"),
    # an empty model name was sent as "default", a model no server may have
    (
        ["doctor", "http://127.0.0.1:9/v1/messages", "--model", ""],
        "argument --model: must not be empty, got ''",
    ),
    (
        ["bench", "http://127.0.0.1:9/v1/chat/completions", "--model", ""],
        "argument --model: must not be empty, got ''",
    ),
    # one request shape goes to both paths: two paths of two APIs would fail one of them
    (
        ["doctor", "http://127.0.0.1:9/stream", "--direct", "http://127.0.0.1:9/v1/replies"],
        "--direct speaks the native API by its path, the URL the lab API: give the same",
    ),
    # a request line is printable ASCII: what is not is refused, not a traceback once sent
    (["doctor", "http://127.0.0.1:9/a b"], "argument url: a URL is printable ASCII with no"),
    (["bench", "http://127.0.0.1:9/caf\u00e9"], "argument url: a URL is printable ASCII with no"),
    (["lab", "--url", "http://127.0.0.1:9/\tx"], "argument --url: a URL is printable ASCII"),
    (
        ["doctor", "http://127.0.0.1:9/stream", "--direct", "http://b\u00fccher.example/stream"],
        "argument --direct: a URL is printable ASCII with no spaces",
    ),
    # a URL's port 0 is no port to connect to (not port 80, as an absent port would be)
    (["doctor", "http://127.0.0.1:0/stream"], "argument url: want a port from 1 to 65535"),
    (["bench", "http://127.0.0.1:0/stream"], "argument url: want a port from 1 to 65535"),
    (["lab", "--url", "http://127.0.0.1:0"], "argument --url: want a port from 1 to 65535"),
    # kv: an amount whose arithmetic would leave the floats' range
    (["kv", "--model", "llama-3-8b", "--memory-gib", "inf"], "argument --memory-gib: want a fin"),
    (["kv", "--model", "llama-3-8b", "--memory-gib", "nan"], "argument --memory-gib: want a fin"),
    (
        ["kv", "--model", "llama-3-8b", "--memory-gib", "1e300"],
        "argument --memory-gib: want a number from 1e-09 to 1e+12, got 1e300",
    ),
    (
        ["kv", "--model", "llama-3-8b", "--bandwidth-tbs", "inf"],
        "argument --bandwidth-tbs: want a finite number, got 'inf'",
    ),
    (
        ["kv", "--model", "llama-3-8b", "--bandwidth-tbs", "nan"],
        "argument --bandwidth-tbs: want a finite number, got 'nan'",
    ),
    (
        ["kv", "--model", "llama-3-8b", "--bandwidth-tbs", "1e300"],
        "argument --bandwidth-tbs: want a number from 1e-09 to 1e+12, got 1e300",
    ),
    (
        ["kv", "--model", "llama-3-8b", "--bandwidth-tbs", "1", "--weights-gb", "-1"],
        "argument --weights-gb: want a number from 1e-09 to 1e+12, got -1",
    ),
    # kv and lab-engine
    # kv: each count is refused by its flag's name
    (
        ["kv", "--layers", "0", "--kv-heads", "1", "--head-dim", "1", "--tokens", "1"],
        "argument --layers: want a whole number from 1 to 1000000, got 0",
    ),
    (["kv", "--model", "llama-3-8b", "--kv-heads", "0"], "argument --kv-heads: want a whole"),
    (["kv", "--model", "llama-3-8b", "--head-dim", "-1"], "argument --head-dim: want a whole"),
    (
        ["kv", "--model", "llama-3-8b", "--tokens", "0"],
        "argument --tokens: want a whole number from 1 to 1000000000000, got 0",
    ),
    (["kv", "--model", "llama-3-8b", "--tokens", "1" + "0" * 400], "argument --tokens: want a"),
    (["kv", "--model", "llama-3-8b", "--window", "-3"], "argument --window: want a whole number"),
    (
        ["kv", "--model", "llama-3-8b", "--memory-gib", "8", "--batch", "0"],
        "argument --batch: want a whole number from 1 to 1000000000, got 0",
    ),
    (["kv", "--model", "nope"], "argument --model: invalid choice: 'nope'"),
    # kv: no sequence of the preset's model is longer than its context
    (
        ["kv", "--model", "llama-3-8b", "--tokens", "8193"],
        "--tokens 8,193 is past llama-3-8b's context of 8,192 tokens: give at most 8,192",
    ),
    # kv: a decode-step option without the bandwidth would be ignored: refused instead
    (
        ["kv", "--model", "llama-3-8b", "--weights-gb", "16"],
        "--weights-gb sizes the decode step: add --bandwidth-tbs",
    ),
    (
        ["kv", "--model", "llama-3-8b", "--memory-gib", "8", "--batch", "4"],
        "--batch sizes the decode step: add --bandwidth-tbs",
    ),
    (  # a step reads the weights too: without them (no preset) the floor is no model's
        [
            "kv",
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--tokens",
            "4096",
            "--bandwidth-tbs",
            "2",
        ],
        "--bandwidth-tbs bounds a step that reads the weights too: give --weights-gb",
    ),
    (["lab-engine", "ttft", "--repeats", "0"], "argument --repeats: want a whole number >= 1"),
    (
        ["lab-engine", "pool", "--engine", "tiny", "--requests", "1", "--out", "/proc/nope"],
        "argument --out: /proc/nope: ",
    ),
    (
        ["lab-engine", "pool", "--small-blocks", "0"],
        "argument --small-blocks: want a whole number >= 1",
    ),
    (  # the small pool must be smaller than the one that holds every request
        ["lab-engine", "pool", "--engine", "tiny", "--small-blocks", "1000000000000"],
        "--small-blocks 1000000000000: the pool that holds all 16 requests has 128 blocks; "
        "give fewer",
    ),
    (  # an option another experiment reads is refused, not ignored
        ["lab-engine", "ttft", "--batches", "99"],
        "--batches: the ttft experiment does not use it (step)",
    ),
    (
        ["lab-engine", "pool", "--repeats", "5"],
        "--repeats: the pool experiment does not use it (ttft, step, spec)",
    ),
    (  # a reply longer than the context has room for is refused, not cut short unsaid
        ["lab-engine", "pool", "--engine", "tiny", "--tokens", "1000"],
        "--tokens: 1000 tokens do not fit after the pool experiment's prompt in the tiny "
        "model's context of 256; give at most 216",
    ),
    (
        ["lab-engine", "step", "--engine", "tiny", "--tokens", "1"],
        "--tokens: the step experiment times the gaps between tokens; give 2 or more",
    ),
    (
        ["lab-engine", "step", "--engine", "tiny", "--batches", "100000000"],
        "--batches: a batch of 100000000: a KV pool of",
    ),
    (  # and hold one request
        ["lab-engine", "pool", "--engine", "tiny", "--small-blocks", "1"],
        "--small-blocks 1: the prompt is 40 tokens; the KV cache holds 16",
    ),
    # A pool past this machine's memory is refused before it is allocated, not allocated
    # lazily and the process killed under load (or a traceback, past what can be mapped).
    (
        ["serve", "--engine", "tiny", "--port", "0", "--kv-blocks", "100000000"],
        "--kv-blocks 100000000: a KV pool of 100,000,000 blocks takes 3,051.8 GiB, more than",
    ),
    (
        ["serve", "--engine", "tiny", "--port", "0", "--kv-blocks", str(10**15)],
        f"--kv-blocks {10**15}: a KV pool of",
    ),
    (
        ["lab-engine", "ttft", "--engine", "nope"],
        "argument --engine: want tiny, smollm2 or gguf:PATH, got 'nope'",
    ),
    (
        ["lab-engine", "ttft", "--engine", "gguf:/no/such.gguf"],
        "argument --engine: want tiny, smollm2 or gguf:PATH: no file '/no/such.gguf'",
    ),
    (
        ["lab-engine", "ttft", "--lengths", "8,x"],
        "argument --lengths: want whole numbers >= 1 separated by commas, got '8,x'",
    ),
    (
        ["lab-engine", "ttft", "--engine", "tiny", "--lengths", "8,256"],
        "--lengths: 256 tokens leave no room for a reply in the tiny model's context of 256",
    ),
]


@pytest.mark.parametrize(("argv", "says"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_mistake_is_one_line_naming_the_flag_and_a_nonzero_exit(argv: list[str], says: str):
    done = run(*argv)
    assert done.returncode != 0
    line = one_line(done)
    assert line.startswith(f"replystream {argv[0]}: "), line
    assert says in line, line


def test_without_torch_a_wrong_hf_path_is_told_first(tmp_path: Path):
    """Without the ``hf`` extra, a wrong ``--engine hf:PATH`` is the mistake named (the first
    to fix); a folder that may hold a model asks for the extra."""
    hiding = tmp_path / "no-torch"
    hiding.mkdir()
    (hiding / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    paths = [str(hiding), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths)}
    wrong = one_line(run("serve", "--engine", f"hf:{tmp_path / 'missing'}", env=env))
    assert wrong.startswith("replystream serve: --engine hf:PATH: "), wrong
    assert "is not a Hugging Face model folder" in wrong, wrong
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    done = run("serve", "--engine", f"hf:{folder}", env=env)
    assert done.returncode != 0
    assert "--engine hf needs torch and transformers" in one_line(done)


# Values that once made a command build or start something without end: each is refused
# before anything is made (run in bounded memory, so the old behaviour fails the case).
UNBOUNDED: list[tuple[list[str], str]] = [
    # the simulated reply is built whole before the server listens
    (
        ["serve", "--engine", "simulated", "--port", "0", "--tokens", "99999999999"],
        "argument --tokens: want a whole number from 1 to 1048576, got 99999999999",
    ),
    (
        ["lab", "--calls", "1", "--tokens", "99999999999"],
        "argument --tokens: want a whole number from 1 to 1048576, got 99999999999",
    ),
    # a sweep of 10**9 runs (its list of rates alone would not fit in memory)
    (
        [
            *("bench", "http://127.0.0.1:9/stream", "--profile", "sweep", "--requests", "2"),
            *("--sweep-steps", "1000000000"),
        ],
        "argument --sweep-steps: want a whole number from 1 to 100, got 1000000000",
    ),
    # scrapes back to back, loading the server being measured
    (  # an empty name or phrase would be taken and do nothing
        ["serve", "--engine", "simulated", "--port", "0", "--ban", ""],
        "argument --ban: must not be empty, got ''",
    ),
    (
        ["serve", "--engine", "simulated", "--port", "0", "--model-name", " "],
        "argument --model-name: must not be empty, got ' '",
    ),
    (  # it would be the model a request for none is sent as, and the server's own name
        ["serve", "--engine", "upstream:http://127.0.0.1:9/v1", "--upstream-model", ""],
        "argument --upstream-model: must not be empty, got ''",
    ),
    (  # read only when the first client is made, with urllib's words
        ["serve", "--engine", "simulated", "--port", "0", "--redis-url", "redis://h:99999"],
        "--redis-url: the port is not a whole number from 0 to 65535",
    ),
    (  # said once by serve, not once by each worker that would have loaded it
        ["serve", "--port", "0", "--workers", "2", "--engine", "gguf:/no/such.gguf"],
        "--engine gguf:PATH: /no/such.gguf: cannot be read (No such file or directory)",
    ),
    (  # an empty Redis URL is not "no Redis"
        ["serve", "--engine", "simulated", "--port", "0", "--redis-url", ""],
        "--redis-url: expected one of redis://",
    ),
    (  # a single run without bounds has no goodput for the share to judge
        ["bench", "http://127.0.0.1:9/stream", "--slo-share", "0.5"],
        "--slo-share is the share of requests that must meet every --slo: add --slo",
    ),
    (
        ["bench", "http://127.0.0.1:9/stream", "--server-metrics", "--metrics-interval", "1e-300"],
        "argument --metrics-interval: want a number from 0.01 to 604800, got 1e-300",
    ),
    # 10**9 readers (a task and a socket each) for as long as a duration lasts
    (
        ["bench", "http://127.0.0.1:9/stream", "--concurrency", "1000000000", "--duration", "5"],
        "--concurrency 1000000000: 1,000,000,000 requests at once would each hold a "
        "connection, and this process may open ",
    ),
    # a burst of 10**9 requests, each a task and a socket, all at once
    (
        [
            *("bench", "http://127.0.0.1:9/stream", "--profile", "throughput"),
            *("--requests", "1000000000"),
        ],
        "--requests 1000000000: 1,000,000,000 requests at once would each hold a connection",
    ),
]


@pytest.mark.parametrize(("argv", "says"), UNBOUNDED, ids=[" ".join(a) for a, _ in UNBOUNDED])
def test_a_value_without_end_is_refused_before_anything_is_made(argv: list[str], says: str):
    done = run_in_bounded_memory(*argv)
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert line.startswith(f"replystream {argv[0]}: "), line
    assert says in line, line


@pytest.mark.parametrize("command", ["serve", "lab"])
async def test_a_delay_shorter_than_the_default_jitter_lowers_the_jitter(
    command: str, tmp_path: Path
):
    """--delay-ms 2 alone: the default jitter (8 ms) is lowered to it, not refused naming a
    flag the command line never gave."""
    if command == "lab":
        argv = ["lab", "--calls", "1", "--tokens", "2", "--delay-ms", "2", "--json"]
        argv += ["--out", str(tmp_path)]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "replystream", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return
    async with replica("--engine", "simulated", "--delay-ms", "2", "--tokens", "3") as (_, url):
        timing = await measure_reply(f"{url}/stream")
    assert timing.complete and timing.tokens == 3


async def test_a_cors_origin_is_matched_as_a_browser_writes_it():
    # A browser's Origin header is lower case and leaves out the scheme's default port.
    server = replica("--engine", "simulated", "--cors-origin", "HTTPS://App.Example.COM:443")
    async with server as (_, url):
        preflight = await raw_request(
            f"{url}/v1/replies",
            "OPTIONS",
            headers={
                "Origin": "https://app.example.com",
                "Access-Control-Request-Method": "POST",
            },
        )
        await preflight.read_body()
    assert preflight.status == 204


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [["lab", *QUICK_LAB], ["lab-engine", "pool", "--requests", "1"]])
def test_a_default_output_folder_nothing_can_be_made_in_is_one_line(argv: list[str]):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [*CLI, *argv], capture_output=True, text=True, timeout=120, env=env, cwd="/proc"
    )
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith(f"replystream {argv[0]}: "), line
    assert re.search(r"--out:? \.: ", line) and "/proc" in line, line


@pytest.mark.parametrize("flag", ["--api-keys-file", "--ban-file"])
def test_a_file_of_lines_that_is_not_utf8_is_one_line_naming_flag_and_file(
    flag: str, tmp_path: Path
):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"sk-\xff\xfe\n")
    done = run("serve", "--engine", "simulated", "--port", "0", flag, str(path))
    assert done.returncode == 2
    line = one_line(done)
    assert line == (
        f"replystream serve: argument {flag}: {path} is not UTF-8 text "
        "(byte 0xff at offset 3: invalid start byte)"
    ), line


@pytest.mark.parametrize("flag", ["--delay-ms", "--jitter-ms"])
def test_a_schedule_flag_no_step_of_a_timed_script_would_use_is_refused(flag: str, tmp_path: Path):
    """Every step of this script gives its own delay_ms: the engine's delay and jitter would
    time none of its tokens, so either flag would be taken and do nothing."""
    path = tmp_path / "timed.json"
    path.write_text('[{"text": "a ", "delay_ms": 10}, {"text": "b", "delay_ms": 10}]')
    script = ("--engine", "simulated", "--reply-script", str(path))
    done = run("serve", "--check", *script, flag, "5")
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith(f"replystream serve: {flag} ") and "delay_ms" in line, line
    # A step without its own delay is timed by the flags: then they are read, and taken.
    path.write_text('[{"text": "a ", "delay_ms": 10}, {"text": "b"}]')
    assert run("serve", "--check", *script, flag, "5").returncode == 0


def test_a_script_step_delay_past_the_bound_is_refused_naming_the_bound(tmp_path: Path):
    """delay_ms has an upper bound as well as a lower one: a refusal of 1e12 that said only
    ">= 0" would refuse a number that is >= 0."""
    path = tmp_path / "slow.json"
    path.write_text('[{"text": "a", "delay_ms": 1e12}]')
    done = run("serve", "--check", "--engine", "simulated", "--reply-script", str(path))
    assert done.returncode == 2
    assert one_line(done) == (
        "replystream serve: argument --reply-script: step 1: delay_ms must be a number from 0 "
        "to below 1000000000 (about 11.6 days)"
    )


def test_a_key_no_client_could_send_is_refused_naming_its_line(tmp_path: Path):
    """Two keys on a line, or a comment after one, would be one key with a space that no
    request could ever match: the server would start and refuse everybody."""
    path = tmp_path / "keys.txt"
    path.write_text("# the team's keys\nsk-one\nsk-two  # rotated in March\n", encoding="utf-8")
    done = run("serve", "--engine", "simulated", "--port", "0", "--api-keys-file", str(path))
    assert done.returncode == 2
    line = one_line(done)
    assert line == (
        f"replystream serve: --api-keys-file {path}: line 3: a key is one word of visible "
        "ASCII characters; this one has ' '"
    ), line
    assert "sk-two" not in line  # a key is never repeated back
    done = run("serve", "--engine", "simulated", "--port", "0", "--api-key", "sk-\u00e9t\u00e9")
    assert done.returncode == 2
    assert "--api-key: a key is one word of visible ASCII" in one_line(done)


def test_a_password_in_an_upstream_url_is_refused_without_being_repeated():
    """A key in the URL would be in every error, log line and metric that names the upstream."""
    done = run("serve", "--engine", "upstream:http://user:s3cret@127.0.0.1:9/v1")
    assert done.returncode != 0
    line = one_line(done)
    assert "an upstream URL may not carry a user name or password" in line, line
    assert "s3cret" not in line


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "http://alice:s3cret@127.0.0.1:9/stream"],
        ["bench", "https://alice:s3cret@127.0.0.1:9/v1/replies"],
        ["lab", "--url", "http://alice:s3cret@127.0.0.1:9"],
    ],
)
def test_a_password_in_a_measured_url_is_refused_without_being_repeated(argv: list[str]):
    """The client would have written it into the Host header, in clear, to every hop."""
    done = run(*argv)
    assert done.returncode == 2
    line = one_line(done)
    assert "a URL with a user name or password" in line, line
    assert "s3cret" not in line
    # Each of these tools takes the key as a header; the line says how, for the tool run.
    assert "send the key with --header 'Authorization: Bearer KEY'" in line, line


def test_a_histogram_length_too_long_to_build_names_its_line(tmp_path: Path):
    hist = tmp_path / "prompt_words.hist"
    hist.write_text("5 1\n20000000 1\n")
    done = run("bench", "http://127.0.0.1:9/stream", "--prompt-words", f"hist:{hist}")
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --prompt-words: hist:{hist} line 2: want LENGTH WEIGHT "
        "(length >= 0 and <= 10,000,000, weight >= 0), got '20000000 1'"
    )


def test_json_and_csv_to_one_file_are_refused_before_sending(tmp_path: Path):
    out = tmp_path / "result.out"
    same = f"{tmp_path}/./result.out"
    done = run("bench", "http://127.0.0.1:9/stream", "--json", str(out), "--csv", same)
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --csv {out} is the --json file too: the CSV would replace it"
    )
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--dataset", "--trace"])
def test_an_empty_json_array_is_no_records_as_an_empty_file_is(flag: str, tmp_path: Path):
    # Not a silent fall-back to synthetic prompts (--dataset), nor a traceback (--trace).
    workload = tmp_path / "workload.json"
    workload.write_text("[]\n")
    done = run("bench", "http://127.0.0.1:9/stream", flag, str(workload))
    assert done.returncode == 2
    assert one_line(done) == f"replystream bench: {flag}: {workload}: no records"


@pytest.mark.parametrize("flag", ["--dataset", "--trace"])
@pytest.mark.parametrize("shape", ["array", "lines"])
def test_a_workload_nested_past_the_recursion_limit_is_one_line(
    flag: str, shape: str, tmp_path: Path
):
    workload = tmp_path / "workload.json"
    nested = '{"prompt": ' + "[" * 100_000 + "}"
    workload.write_text(f"[{nested}]\n" if shape == "array" else f"{nested}\n")
    done = run("bench", "http://127.0.0.1:9/stream", flag, str(workload))
    assert done.returncode == 2
    where = f"{workload}" if shape == "array" else f"{workload} line 1"
    assert one_line(done) == f"replystream bench: {flag}: {where}: not JSON (nested too deeply)"


def test_a_result_to_compare_nested_past_the_recursion_limit_is_one_line(tmp_path: Path):
    result = tmp_path / "a.json"
    result.write_text("[" * 100_000)
    done = run("bench", "--compare", str(result), str(result))
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --compare: {result}: not a JSON file bench wrote (nested too deeply)"
    )


@pytest.mark.parametrize(
    "record",
    [
        '{"conversations": ["hi"]}',  # a turn that is not an object: was a traceback
        '{"messages": [null]}',
        '{"prompt": "hi", "output_tokens": true}',  # was sent as max_tokens: true
    ],
)
def test_a_dataset_record_of_another_shape_names_its_record(record: str, tmp_path: Path):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "hello"}\n' + record + "\n")
    done = run("bench", "http://127.0.0.1:9/stream", "--dataset", str(dataset))
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --dataset: {dataset} record 2: want {{'prompt', 'output_tokens'?}}, "
        "ShareGPT 'conversations' or 'messages' with a non-empty user turn"
    )


@pytest.mark.parametrize(
    "record",
    [
        '{"timestamp": NaN, "prompt_words": 1}',  # in no order
        '{"timestamp": Infinity, "prompt_words": 1}',  # never comes: the run would hang
        '{"timestamp": 1, "prompt_words": 100000000000}',  # too long to build (memory)
        '{"timestamp": 1, "prompt_words": 1, "output_tokens": 1e400}',  # was a traceback
        '{"timestamp": 1, "prompt_words": 2.5}',  # not a whole number of words
    ],
)
def test_a_trace_record_that_cannot_be_replayed_names_its_record(record: str, tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_words": 1}\n' + record + "\n")
    done = run("bench", "http://127.0.0.1:9/stream", "--trace", str(trace), timeout=30)
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --trace: {trace} record 2: want {{'timestamp': S, 'prompt_words': "
        "N, 'output_tokens': M}, finite timestamps in order, 0 <= N <= 10,000,000, M >= 1"
    )


def test_a_trace_longer_than_any_run_is_refused_unless_cut_short(tmp_path: Path):
    """A gap of 1e300 s once left the run asleep for good; --duration or --requests cut the
    replay before that record, and then it is no mistake."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_words": 1}\n{"timestamp": 1e300}\n')
    done = run("bench", "http://127.0.0.1:9/stream", "--trace", str(trace), timeout=30)
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --trace: {trace}: request 2 comes 1e+300 s after the first, past "
        "the longest run bench plans, a week (604,800 s); replay part of it with --requests "
        "or --duration"
    )
    for cut in (["--requests", "1"], ["--duration", "1"]):
        done = run("bench", "http://127.0.0.1:9/stream", "--trace", str(trace), *cut, timeout=30)
        assert "longest run" not in done.stderr, done.stderr
        # The run started: nothing listens on port 9, so it stopped at its first request.
        assert done.returncode == 1, done.stderr
        assert "the run stopped at its first request" in one_line(done)


# (An open loop's first arrival is at the start; a --rate whose gap is not shorter than
# such a duration is refused before sending.)
@pytest.mark.parametrize("loop", [[], ["--concurrency", "3"]])
async def test_a_duration_too_short_to_start_a_reader_still_measures_a_request(
    loop: list[str], tmp_path: Path
):
    """--duration 1e-300 once ended a closed loop before its reader took a request: nothing
    was sent and the run exited 0. Each reader's first request is sent at the start."""
    schedule = ["--delay-ms", "1", "--jitter-ms", "0", "--first-token-ms", "1"]
    async with replica("--engine", "simulated", "--port", "0", *schedule) as (_, url):
        result = tmp_path / "result.json"
        argv = [f"{url}/stream?max_tokens=2", "--duration", "1e-300", *loop, "--quiet"]
        done = await asyncio.to_thread(run, "bench", *argv, "--json", str(result))
    assert done.returncode == 0, done.stderr
    counts = json.loads(result.read_text())["counts"]
    readers = int(loop[1]) if loop[:1] == ["--concurrency"] else 1
    assert counts["requests"] == counts["complete"] == readers, counts


def test_histogram_weights_whose_sum_is_infinite_are_refused_before_sending(tmp_path: Path):
    hist = tmp_path / "prompt_words.hist"
    hist.write_text("5 1e308\n6 1e308\n")  # each finite; their sum is not
    done = run("bench", "http://127.0.0.1:9/stream", "--prompt-words", f"hist:{hist}")
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --prompt-words: hist:{hist}: the weights add up to more than a "
        "number can hold"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "http://127.0.0.1:9/stream", "--prompt", "caf\udce9"],
        ["doctor", "http://127.0.0.1:9/v1/chat/completions", "--model", "caf\udce9"],
        ["bench", "http://127.0.0.1:9/v1/chat/completions", "--model", "caf\udce9"],
    ],
)
def test_text_that_is_not_utf8_is_one_line_naming_the_flag_and_the_byte(argv: list[str]):
    """Bytes a shell passes that are not UTF-8 (here Latin-1's é) reach Python as a lone
    surrogate; sent, they made a traceback (a lab URL) or JSON no server reads."""
    flag = argv[-2]
    done = subprocess.run(
        [*CLI, *(a.encode("utf-8", "surrogateescape") for a in argv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream {argv[0]}: argument {flag}: not UTF-8 text (byte 0xe9 at offset 3); "
        "check the terminal's or the script's encoding"
    )


@pytest.mark.parametrize(
    ("profile", "name"), [([], "gap_histogram.png"), (["--profile", "sweep"], "sweep_latency.png")]
)
def test_a_folder_where_bench_writes_a_plot_is_refused_before_sending(
    profile: list[str], name: str, tmp_path: Path
):
    (tmp_path / name).mkdir()
    url = "http://127.0.0.1:9/stream"
    done = run("bench", url, *profile, "--requests", "1", "--plot", str(tmp_path))
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream bench: --plot {tmp_path}: {tmp_path / name} is a folder where a plot goes"
    )


@pytest.mark.parametrize("name", ["timeline.json", "timeline.png"])
def test_a_folder_where_lab_writes_a_file_is_refused_before_the_run(name: str, tmp_path: Path):
    (tmp_path / name).mkdir()
    done = run("lab", *QUICK_LAB, "--out", str(tmp_path))
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream lab: --out {tmp_path}: {tmp_path / name} is a folder where the lab "
        "writes a file"
    )


def test_a_port_in_use_is_one_line_not_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run("serve", "--port", str(port))
    assert done.returncode == 2
    line = one_line(done)
    assert f"--port {port}: another process already listens" in line
    assert "--port 0 picks a free one" in line


def test_a_port_an_ipv4_server_holds_is_its_for_a_dual_stack_host():
    # --host :: takes the port for IPv4 too (Linux's default): a server on 127.0.0.1 holds it.
    with socket.socket(socket.AF_INET6) as probe:
        if probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
            pytest.skip("IPv6 sockets here are IPv6 only")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run("serve", "--host", "::", "--port", str(port))
    assert done.returncode == 2
    line = one_line(done)
    assert f"--port {port}: another process already listens on [::]:{port}" in line, line


@pytest.mark.parametrize(
    ("flag", "fd", "says"),
    [
        ("--ready-fd", "99", "not an open file descriptor"),
        ("--listen-fd", "99", "not an open file descriptor"),
        ("--ready-fd", "0", "open for reading only"),  # stdin: a file opened to be read
        ("--listen-fd", "0", "non-socket"),
    ],
)
def test_a_worker_descriptor_that_cannot_be_used_is_one_line_naming_its_flag(
    flag: str, fd: str, says: str, tmp_path: Path
):
    readable = tmp_path / "in"
    readable.write_bytes(b"")
    with readable.open("rb") as stdin:
        done = subprocess.run(
            [*CLI, "serve", "--engine", "simulated", "--port", "0", flag, fd],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith(f"replystream serve: {flag} {fd}: "), line
    assert says in line, line
    assert READY_PREFIX not in done.stdout  # refused before it listens


def test_a_port_a_connection_holds_is_not_said_to_be_listened_on():
    # Bound, not listening: as an outgoing connection's own port, or one in TIME_WAIT, is.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        done = run("serve", "--port", str(port))
    assert done.returncode == 2
    line = one_line(done)
    assert f"--port {port}: 127.0.0.1:{port} is held, though nothing listens on it" in line
    assert "another process" not in line and "--port 0 picks a free one" in line


@pytest.mark.parametrize("folder", ["/nonexistent", FOLDER])
def test_a_metrics_folder_set_from_outside_is_one_line_naming_it(folder: str):
    # Whether the folder exists (other processes' files would be merged) or not (the
    # server could not write there), it is the workers' own mechanism: refused at start.
    done = run("serve", "--engine", "simulated", "--port", "0", env={MULTIPROCESS: folder})
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("replystream serve: PROMETHEUS_MULTIPROC_DIR is set"), line
    assert "unset it" in line


def test_an_empty_metrics_folder_set_from_outside_is_refused_too():
    # prometheus-client reads an empty folder as the current one: it wrote its files there,
    # or failed with a bare "No such file" where it could not.
    done = run("serve", "--check", "--engine", "simulated", env={MULTIPROCESS: ""})
    assert done.returncode == 2
    assert one_line(done) == (
        "replystream serve: PROMETHEUS_MULTIPROC_DIR is set in the environment (empty); "
        "serve sets it itself for the workers of --workers: unset it"
    )


OWN_SETTINGS = """
[[upstreams]]
url = "http://127.0.0.1:9/v1"
api_key = "sk-own"
max_outstanding = 4
ttft_s = 5
stall_s = 5
[[upstreams]]
url = "http://127.0.0.2:9/v1"
pass_client_key = true
max_outstanding = 2
ttft_s = 9
stall_s = 9
"""


@pytest.mark.parametrize(
    "given",
    [
        ["--upstream-max-outstanding", "8"],
        ["--upstream-ttft-s", "3"],
        ["--upstream-stall-s", "3"],
        ["--upstream-api-key", "sk-all"],
        ["--upstream-pass-client-key"],
    ],
    ids=lambda given: given[0],
)
def test_a_relay_default_every_upstream_overrides_is_refused(given: list[str], tmp_path: Path):
    """Every upstream of this routes file has its own limit and its own way to a key: a
    default for upstreams without them would be taken, and read by none."""
    routes = tmp_path / "routes.toml"
    routes.write_text(OWN_SETTINGS)
    relay = ("serve", "--check", "--engine", "upstream", "--upstream-routes", str(routes))
    done = run(*relay, *given)
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith(f"replystream serve: {given[0]} is the default for upstreams "), line
    assert "drop it" in line, line
    # One upstream without a setting of its own takes the default: then it is read.
    routes.write_text(OWN_SETTINGS + '[[upstreams]]\nurl = "http://127.0.0.3:9/v1"\n')
    assert run(*relay, *given).returncode == 0


def test_a_head_timeout_past_the_time_to_a_first_text_is_sound():
    # It still bounds an embeddings answer, which has no first text.
    done = run(*RELAY, "--check", "--upstream-timeout-s", "10", "--upstream-ttft-s", "2")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("check", [(), ("--check",)])
def test_an_unresolvable_host_is_one_line_naming_host(check: tuple[str, ...]):
    # --check once passed a host that serve then refused.
    done = run("serve", "--host", "no-such-host.invalid", "--port", "0", *check)
    assert done.returncode == 2
    assert "--host no-such-host.invalid: not an address" in one_line(done)


@pytest.mark.parametrize("check", [(), ("--check",)])
def test_a_link_local_host_without_its_zone_is_told_to_give_it(check: tuple[str, ...]):
    done = run("serve", "--engine", "simulated", "--host", "fe80::1", "--port", "0", *check)
    assert done.returncode == 2
    line = one_line(done)
    assert "--host fe80::1: a link-local address is bound on one interface" in line, line
    assert "(fe80::1%eth0," in line, line


def test_an_ipv6_host_in_brackets_is_taken_as_the_address():
    # As a URL writes it ([::1]), which the resolver does not take.
    done = run("serve", "--engine", "simulated", "--host", "[::1]", "--port", "0", "--check")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("check", [(), ("--check",)])
def test_an_address_of_another_machine_is_one_line_naming_host(check: tuple[str, ...]):
    # 192.0.2.1 resolves (RFC 5737's documentation range) but is no address of this machine:
    # --check once called the configuration sound, and serve then refused it.
    done = run("serve", "--engine", "simulated", "--host", "192.0.2.1", "--port", "0", *check)
    assert done.returncode == 2
    assert "--host 192.0.2.1: not an address of this machine" in one_line(done)


def test_an_empty_host_is_refused_not_every_interface():
    done = run("serve", "--host", "", "--check")
    assert done.returncode == 2
    assert "argument --host: want an address or host name, got ''" in one_line(done)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["serve", "--no-such-flag"],
            "replystream serve: unrecognized arguments: --no-such-flag",
        ),
        # A prefix of a flag is not that flag: ``--work 2`` once started workers whose
        # command line still said ``--work 2``, each starting workers of its own.
        (["serve", "--work", "2"], "replystream serve: unrecognized arguments: --work 2"),
        (
            ["bench", "http://127.0.0.1:9/stream", "--concurency", "2"],
            "replystream bench: unrecognized arguments: --concurency 2",
        ),
        (["doctor"], "replystream doctor: the following arguments are required: url"),
        (["no-such-command"], "replystream: argument COMMAND: invalid choice: 'no-such-command'"),
        # Once "the following arguments are required: COMMAND", naming no flag.
        (["--port", "8000"], "replystream: unrecognized arguments: --port: an option follows"),
    ],
)
def test_a_wrong_flag_or_a_missing_argument_is_one_line(argv: list[str], line: str):
    done = run(*argv)
    assert done.returncode == 2
    said = one_line(done)
    assert said.startswith(line), said
    assert said.endswith("--help lists them)"), said


def test_help_states_every_serve_default_and_the_top_level_has_no_markup():
    top = run("--help")
    assert top.returncode == 0 and "``" not in top.stdout and "[/" not in top.stdout
    serve = run("serve", "--help").stdout
    # Every option with a value to state says its default.
    for flag in ("--port", "--host", "--kv-blocks", "--delay-ms", "--batch-tokens", "--seed"):
        entry = serve[serve.index(f"  {flag} ") :].split("\n  --", 1)[0]
        assert "default" in " ".join(entry.split()), entry


def test_api_key_help_names_every_path_a_key_guards():
    """The lab's /wait and /stream need the key as /v1/* does (``server.auth``): help that
    named /v1/* alone told an operator the lab's routes stayed open."""
    from replystream.server.auth import LAB_PATHS

    shown = " ".join(run("serve", "--help").stdout.split("options:", 1)[1].split())
    for flag in ("--api-key KEY ", "--api-keys-file "):
        entry = shown[shown.index(flag) :].split(" --", 1)[0]
        for path in ("/v1/*", *sorted(LAB_PATHS)):
            assert path in entry, entry


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_model_help_names_every_api_whose_requests_name_a_model(command: str):
    shown = " ".join(run(command, "--help").stdout.split())
    entry = shown[shown.index("--model MODEL ") :].split(" --", 1)[0]
    for api in MODEL_APIS:
        assert api in entry, entry


def test_tables_are_not_cut_to_80_columns_when_output_is_not_a_terminal(tmp_path: Path):
    done = run(
        "lab-engine",
        "pool",
        "--engine",
        "tiny",
        "--requests",
        "4",
        "--tokens",
        "8",
        "--small-blocks",
        "8",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("│")]
    assert any("│ pool holds all │" in row for row in rows), done.stdout
    assert len(rows) == 2  # one line per pool: no cell wrapped


async def test_startup_names_engine_and_chat_page_below_the_line_tools_read():
    process = await asyncio.create_subprocess_exec(
        *CLI, "serve", "--port", "0", "--engine", "simulated", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        first = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        second = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        assert first.startswith(READY_PREFIX)
        url = first.removeprefix(READY_PREFIX)
        assert " " not in url  # readers take the rest of the first line as the URL
        assert second == f"replystream: simulated engine, chat page {url}/"
        page = await measure_reply(f"{url}/")
        assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    finally:
        await stop_process(process)


def run_with_open_files(
    soft: int, hard: int, *args: str, held: int = 0
) -> subprocess.CompletedProcess[str]:
    """``run``, allowed ``soft`` and at most ``hard`` open files, ``held`` of them already
    open (inherited) when it starts."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    inherited = [os.open(os.devnull, os.O_RDONLY) for _ in range(held)]
    try:
        return subprocess.run(
            [*CLI, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            preexec_fn=bound,
            pass_fds=inherited,
        )
    finally:
        for fd in inherited:
            os.close(fd)


async def test_a_lab_out_of_open_files_says_so_and_not_that_the_server_is_down():
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        # 2 x 10 connections at once fit the lab's own reckoning of 52 files, but 40 more
        # files were open before it started: its sockets run out.
        argv = ("lab", "--url", url, "--calls", "10", "--tokens", "2", "--json")
        done = await asyncio.to_thread(run_with_open_files, 52, 52, *argv, held=40)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith(f"replystream lab: --url {url}: cannot connect to "), line
    assert "Too many open files" in line, line
    assert "is the server running?" not in line, line


async def test_a_lab_raises_its_soft_open_file_limit_to_hold_every_call():
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        # 2 x 100 connections at once; the soft limit (64) is raised, the hard one allows it.
        argv = ("lab", "--url", url, "--calls", "100", "--tokens", "2", "--json")
        done = await asyncio.to_thread(run_with_open_files, 64, 4096, *argv)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["stream"]["complete"] == result["wait"]["complete"] == 100


def test_a_lab_past_the_hard_open_file_limit_is_refused_naming_calls():
    done = run_with_open_files(64, 64, "lab", "--calls", "100", "--tokens", "2")
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("replystream lab: --calls 100: 2 x 100 calls at once would "), line
    assert "may open 64 files (ulimit -Hn)" in line, line


def test_a_lab_refused_by_its_url_asks_whether_the_server_runs():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    line = one_line(run("lab", "--url", url, "--calls", "1"))
    assert line.startswith(f"replystream lab: --url {url}: cannot connect to "), line
    assert line.endswith("; is the server running?"), line


def test_a_local_lab_out_of_open_files_names_no_url_it_was_not_given():
    # As above, with the server the lab starts itself: there is no --url to name.
    argv = ("lab", "--calls", "10", "--tokens", "2", "--delay-ms", "1", "--jitter-ms", "0")
    done = run_with_open_files(52, 52, *argv, "--json", held=40)
    assert done.returncode == 1
    line = one_line(done)
    assert line.startswith("replystream lab: the local server: cannot connect to "), line
    assert "Too many open files" in line and "None" not in line, line


def run_with_stdout_gone(*args: str) -> subprocess.CompletedProcess[str]:
    """``run``, its stdout a pipe whose reader has left (``| head -1`` after one line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    try:
        return subprocess.run(
            [*CLI, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=env
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_a_reader_that_leaves_stops_the_output_without_a_traceback(json_flag: list[str]):
    done = run_with_stdout_gone("kv", "--model", "llama-3-8b", *json_flag)
    assert done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE, as a shell reports a writer cut off


async def test_a_bench_whose_reader_left_still_writes_its_files(tmp_path: Path):
    out = tmp_path / "run.json"
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        argv = ("bench", f"{url}/stream?max_tokens=3", "--requests", "2", "--json", str(out))
        done = await asyncio.to_thread(run_with_stdout_gone, *argv)
    assert done.stderr == ""
    assert done.returncode == 0
    assert json.loads(out.read_text())["counts"]["complete"] == 2


def run_probe(probe: str) -> subprocess.CompletedProcess[str]:
    """``probe`` run by a fresh interpreter, so what it finds imported is what it imported."""
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )


@pytest.mark.parametrize("command", ["lab", "bench", "lab-engine", "serve"])
def test_a_mistake_is_found_without_loading_the_server(command: str) -> None:
    """A command that needs a constant of the server's (a schema's limit) imports that module
    alone: the app, its routes and their schemas are not loaded to report a wrong flag."""
    probe = (
        "import sys\n"
        "from replystream import cli\n"
        "try:\n"
        f"    cli.parse([{command!r}, '--no-such-flag'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 2, exc.code\n"
        "print('replystream.server.app' in sys.modules)\n"
    )
    done = run_probe(probe)
    assert done.stdout.strip() == "False", done.stderr


def test_serve_checks_its_command_line_before_the_server_or_an_engine_loads() -> None:
    """A mistake ``serve`` finds once its flags are parsed (values that contradict each other)
    is told with none of aiohttp, the app, pydantic, NumPy or Redis loaded; and the simulated
    engine, built, loads none of them either (each engine's modules load with it alone)."""
    probe = (
        "import sys\n"
        "from replystream import cli\n"
        "from replystream.server import engine_options\n"
        "heavy = ('aiohttp', 'numpy', 'redis', 'pydantic', 'replystream.server.app')\n"
        "code = cli.main(['serve', '--engine', 'simulated', '--delay-ms', '1', "
        "'--jitter-ms', '5'])\n"
        "print(code, [name for name in heavy if name in sys.modules])\n"
        "args = cli.parse(['serve', '--engine', 'simulated'])\n"
        "engine_options.build_engine(args)\n"
        "print([name for name in heavy if name in sys.modules])\n"
    )
    done = run_probe(probe)
    refused, built = done.stdout.splitlines()
    assert refused == "2 []", done.stderr
    assert built == "[]", done.stderr


def test_lab_engine_checks_its_command_line_before_a_model_or_matplotlib_loads() -> None:
    """A wrong value, and a flag the chosen experiment does not read (found once parsed), are
    told before the engine's NumPy, the GGUF reader or matplotlib is imported."""
    probe = (
        "import sys\n"
        "from replystream import cli\n"
        "heavy = ('numpy', 'gguf', 'matplotlib', 'replystream.engine.tiny')\n"
        "try:\n"
        "    cli.parse(['lab-engine', 'ttft', '--repeats', '0'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, [name for name in heavy if name in sys.modules])\n"
        "code = cli.main(['lab-engine', 'pool', '--engine', 'tiny', '--repeats', '5'])\n"
        "print(code, [name for name in heavy if name in sys.modules])\n"
    )
    done = run_probe(probe)
    assert done.stdout.splitlines() == ["2 []", "2 []"], done.stderr
    assert "--repeats: the pool experiment does not use it" in done.stderr


def test_a_ban_file_with_no_phrase_is_refused_as_moderation_would_be_off(tmp_path: Path):
    blank = tmp_path / "bans.txt"
    blank.write_text("\n  \n")
    done = run("serve", "--engine", "simulated", "--port", "0", "--ban-file", str(blank))
    assert done.returncode != 0
    assert (
        done.stderr
        == f"replystream serve: --ban-file {blank}: no phrase in it (every line is blank)\n"
    )


def test_a_ban_file_is_read_as_utf8_whatever_the_locale(tmp_path: Path):
    # Checked as UTF-8, it must be read so: under an ASCII locale (LC_ALL=POSIX with UTF-8
    # mode off) the locale's codec refused it, and a Latin-1 one would garble its phrases.
    bans = tmp_path / "bans.txt"
    bans.write_bytes("caf\u00e9\nlanguage\n".encode())
    env = {"LC_ALL": "POSIX", "PYTHONUTF8": "0"}
    done = run("serve", "--check", "--engine", "simulated", "--ban-file", str(bans), env=env)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert "the configuration is sound" in done.stdout


def test_serve_check_says_a_configuration_is_sound_without_serving_it(tmp_path: Path):
    """``serve --check`` builds what a start builds, then exits: 0 and one line on stdout for
    a sound configuration (its port taken and its upstream unreachable change nothing: it
    listens on nothing and asks nobody), 2 and the start's own one line for a mistake."""
    routes = tmp_path / "routes.toml"
    routes.write_text('[[upstreams]]\nurl = "http://127.0.0.1:9/v1"\nmodels = ["m"]\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        sound = run(
            "serve",
            "--check",
            "--port",
            port,
            "--engine",
            "upstream",
            "--upstream-routes",
            str(routes),
            "--redis-url",
            "redis://127.0.0.1:9",
        )
    assert sound.returncode == 0, sound.stderr
    assert sound.stdout == "replystream serve: the configuration is sound (the upstream engine)\n"
    assert sound.stderr == ""
    routes.write_text('[[upstreams]]\nurl = "http://127.0.0.1:9/v1"\nweight = 0\n')
    unsound = run("serve", "--check", "--engine", "upstream", "--upstream-routes", str(routes))
    assert unsound.returncode == 2 and unsound.stdout == ""
    assert f"{routes}: upstreams[0].weight: input should be" in one_line(unsound)


def test_workers_with_a_handed_socket_are_refused_not_ignored():
    # A process handed a socket (--listen-fd) is one worker: it served alone, --workers unsaid.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        fd = listening.fileno()
        done = subprocess.run(
            [*CLI, "serve", "--engine", "simulated", "--listen-fd", str(fd), "--workers", "2"],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("replystream serve: --workers 2 with --listen-fd: "), line
    assert READY_PREFIX not in done.stdout


@pytest.mark.parametrize(
    "how", [(), ("--check",), ("--workers", "2")], ids=["serve", "check", "workers"]
)
def test_a_loop_that_is_not_installed_is_one_line_before_anything_starts(
    how: tuple[str, ...], tmp_path: Path
):
    # --check once called --loop uvloop sound where uvloop cannot be imported, and serve
    # --workers started every worker before each of them refused it.
    (tmp_path / "uvloop.py").write_text("raise ImportError('No module named uvloop')\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    done = run(
        *("serve", "--engine", "simulated", "--port", "0", "--loop", "uvloop", *how),
        env={"PYTHONPATH": path},
    )
    assert done.returncode == 2
    assert one_line(done) == "replystream serve: --loop uvloop needs the uvloop package"
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("query", "line"),
    [
        ("health_check_interval=-1", "health_check_interval must be 0 or more seconds, got -1"),
        ("socket_read_size=0", "socket_read_size must be 1 or more bytes, got 0"),
        ("client_name=replica%20a", "client_name 'replica a': Redis takes a name of visible"),
    ],
)
def test_a_redis_url_value_redis_py_would_fail_on_is_refused_by_check(query: str, line: str):
    # --check once called these sound; serve then refused at start (a negative interval, a
    # name with a space) or served with every resumable reply failing (a read size of 0).
    done = run("serve", "--check", "--engine", "simulated", "--redis-url", f"redis://h/0?{query}")
    assert done.returncode == 2
    assert one_line(done).startswith(f"replystream serve: --redis-url: {line}")


def test_a_reply_script_that_is_a_pipe_is_refused_not_waited_on(tmp_path: Path):
    # --check (and serve) once waited for ever, reading a pipe until a writer closed it.
    pipe = tmp_path / "script.json"
    os.mkfifo(pipe)
    done = run("serve", "--check", "--engine", "simulated", "--reply-script", str(pipe), timeout=30)
    assert done.returncode == 2
    assert one_line(done) == (
        f"replystream serve: argument --reply-script: {pipe} is not a regular file; want a "
        "readable file"
    )


@pytest.mark.parametrize("check", [(), ("--check",)])
def test_workers_past_the_open_file_limit_are_one_line_naming_both(check: tuple[str, ...]):
    # Once "cannot start a worker: [Errno 24] Too many open files", naming neither.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    argv = ("serve", *check, "--port", "0", "--engine", "simulated", "--workers", "8")
    done = run_with_open_files(20, hard, *argv)
    assert done.returncode != 0
    line = one_line(done)
    assert line.startswith("replystream serve: --workers 8: the parent keeps 2 files open"), line
    assert "past the 20 a process may open (ulimit -n)" in line, line
    # Room for the parent's files: the check lets it start.
    sound = ("serve", "--check", *argv[1 + len(check) :])
    assert run_with_open_files(64, hard, *sound).returncode == 0


@pytest.mark.parametrize(
    "env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "POSIX", "PYTHONUTF8": "0"}],
    ids=["ascii", "posix"],
)
async def test_a_report_stdout_cannot_encode_is_escaped_and_its_files_written(
    env: dict[str, str], tmp_path: Path
):
    # An ASCII-only stdout (strict errors, or surrogateescape under the POSIX locale) meets
    # a "µs" in the client line and a model name the server's error quotes.
    out = tmp_path / "run.json"
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        bench = ("bench", f"{url}/stream?max_tokens=3", "--requests", "2", "--json", str(out))
        done = await asyncio.to_thread(run, *bench, env=env)
        doctor = ("doctor", f"{url}/v1/chat/completions", "--model", "caf\u00e9")
        told = await asyncio.to_thread(run, *doctor, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0
    assert "\\xb5s of CPU per text event read" in done.stdout
    assert json.loads(out.read_text())["counts"]["complete"] == 2
    assert "Traceback" not in told.stderr, told.stderr
    assert told.returncode == 1
    assert "caf\\xe9" in told.stdout


async def test_a_command_started_with_stdout_closed_ends_without_a_traceback(tmp_path: Path):
    # ``>&-``: Python gives such a process no sys.stdout at all.
    out = tmp_path / "run.json"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}

    def closed(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            env=env,
            preexec_fn=lambda: os.close(1),
        )

    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        bench = ("bench", f"{url}/stream?max_tokens=3", "--requests", "2", "--json", str(out))
        done = await asyncio.to_thread(closed, *bench)
    assert done.stderr == ""
    assert done.returncode == 0
    assert json.loads(out.read_text())["counts"]["complete"] == 2
    told = await asyncio.to_thread(closed, "kv", "--model", "llama-3-8b")
    assert (told.returncode, told.stderr) == (0, "")


async def test_utf8_text_given_under_a_locale_that_is_not_utf8_is_sent_as_given():
    # LC_ALL=POSIX with UTF-8 mode off: Python reads the command line's UTF-8 "é" as two
    # undecodable bytes; they are the UTF-8 the user typed, not a mistake.
    env = {"LC_ALL": "POSIX", "PYTHONUTF8": "0"}
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        argv = ("doctor", f"{url}/v1/chat/completions", "--model", "caf\u00e9", "--json")
        done = await asyncio.to_thread(run, *argv, env=env)
    assert done.returncode == 1, done.stderr
    assert "The model 'caf\u00e9' does not exist" in json.loads(done.stdout)["reason"]


async def test_bench_draws_its_plots_whatever_backend_mplbackend_names(tmp_path: Path):
    # Its plots are PNG files drawn without a display; a MPLBACKEND this matplotlib does not
    # know (a user's setting for other work) made its import fail, after the whole run.
    async with serve_engine(fast_engine(delay_ms=1.0, jitter_ms=0.0)) as url:
        argv = ("bench", f"{url}/stream?max_tokens=3", "--requests", "2")
        done = await asyncio.to_thread(
            run, *argv, "--plot", str(tmp_path), env={"MPLBACKEND": "nonsense"}
        )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "gap_histogram.png").stat().st_size > 0
