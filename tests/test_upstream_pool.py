"""The relay's routing state as pure state: circuits on an injected clock, least outstanding
requests with weights, model routes, aliases, and the routes file's checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from replystream.engine.upstream_pool import (
    NOT_SERVED_LIMIT,
    NOT_SERVED_S,
    Backend,
    BreakerConfig,
    Circuit,
    UpstreamPool,
)
from replystream.engine.upstream_routes import load_routes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(*backends: Backend, failures: int = 3, cooldown_s: float = 10.0, **kw):
    clock = Clock()
    return UpstreamPool(list(backends), BreakerConfig(failures, cooldown_s), clock, **kw), clock


def test_consecutive_failures_open_a_circuit_and_a_trial_after_the_cooldown_closes_it():
    a, b = Backend("http://a/v1"), Backend("http://b/v1")
    pool, clock = pool_of(a, b, failures=3, cooldown_s=10.0)
    pool.failed(a, "refused")
    pool.failed(a, "refused")
    a.succeeded()  # a success in between: failures are counted in a row only
    for _ in range(3):
        pool.failed(a, "refused")
    assert a.circuit is Circuit.OPEN
    assert [x.name for x in pool.plan(None)] == ["http://b/v1"]  # skipped while open
    clock.now += 9.9
    assert a not in pool.plan(None)
    assert a.stats(clock.now).circuit == "open"
    clock.now += 0.2  # the cool-down is over: the next request there is the trial
    assert a in pool.plan(None)
    # Its state says so before the trial is sent, as /healthz does (not "open, skipped");
    # a failed probe keeps requests away while another upstream serves: open, then.
    assert a.stats(clock.now).circuit == "half_open"
    a.probe_ok = False
    assert a.stats(clock.now).circuit == "open"
    a.probe_ok = None
    trial = a.begin()
    assert a.circuit.value == "half_open"
    assert a not in pool.plan(None)  # one trial at a time
    a.end(trial)
    a.succeeded()
    assert a.circuit.value == "closed" and a in pool.plan(None)


def test_a_trial_whose_client_left_leaves_the_next_request_to_try():
    a = Backend("http://a/v1")
    pool, clock = pool_of(a, failures=1, cooldown_s=5.0)
    pool.failed(a, "refused")
    clock.now += 5.0
    trial = a.begin()
    assert pool.plan(None) == []
    a.end(trial)  # cancelled: no verdict
    assert a.circuit.value == "open" and pool.plan(None) == [a]


def test_a_failed_trial_opens_the_circuit_for_another_cooldown():
    a = Backend("http://a/v1")
    pool, clock = pool_of(a, failures=1, cooldown_s=5.0)
    pool.failed(a, "refused")
    assert pool.plan(None) == [] and pool.ready() == (False, "refused", 5.0)
    clock.now += 2.0
    assert pool.ready() == (False, "refused", 3.0)  # how soon its trial may go
    clock.now += 3.0
    trial = a.begin()
    pool.failed(a, "refused again")
    a.end(trial)
    assert a.circuit is Circuit.OPEN and a.reopens_at == clock.now + 5.0
    clock.now += 4.0
    assert pool.plan(None) == []
    clock.now += 1.0
    assert pool.plan(None) == [a]


def test_an_upstreams_wait_opens_its_circuit_for_that_long_before_the_row_is_long_enough():
    a, b = Backend("http://a/v1"), Backend("http://b/v1")
    pool, clock = pool_of(a, b, failures=3, cooldown_s=10.0)
    pool.failed(a, "busy", wait_s=2.0)  # one failure of three, but it said when to come back
    assert a.circuit is Circuit.OPEN and pool.plan(None) == [b]
    assert pool.wait_s(None) == 0.0  # b can take a request now
    b.begin()
    pool.failed(b, "busy", wait_s=4.0)
    b.end(False)
    clock.now += 0.5
    assert pool.plan(None) == [] and pool.wait_s(None) == 1.5  # the sooner of the two
    clock.now += 1.5  # a's wait is over (not its cool-down): the next request is its trial
    assert pool.plan(None) == [a]
    trial = a.begin()
    assert trial and pool.wait_s(None) == 0.0  # a trial is out: its verdict may come soon
    pool.failed(a, "busy again", wait_s=1.0)  # the trial is told to wait too: that long
    a.end(trial)
    assert a.reopens_at == clock.now + 1.0
    clock.now += 1.0
    trial = a.begin()
    pool.failed(a, "busy a third time", wait_s=1.0)  # the row is long enough: sick
    a.end(trial)
    assert a.reopens_at == clock.now + 10.0
    assert pool.wait_s(None) == 1.0  # b's wait, 4 s from 3 s ago, is over first now
    a.models = b.models = ("m",)
    assert pool.wait_s("other") is None


def test_a_wait_keeps_a_circuit_open_past_its_cooldown_and_a_trial_failing_silently_is_sick():
    a = Backend("http://a/v1")
    pool, clock = pool_of(a, failures=1, cooldown_s=5.0)
    pool.failed(a, "refused")
    pool.failed(a, "busy", wait_s=8.0)  # a request begun before it opened: it asks for more
    assert a.reopens_at == clock.now + 8.0
    clock.now += 8.0
    trial = a.begin()
    pool.failed(a, "refused")
    a.end(trial)
    assert a.reopens_at == clock.now + 5.0 and pool.wait_s(None) == 5.0


def test_least_outstanding_per_weight_goes_first_and_the_rest_follow_as_failover_order():
    a, b, c = Backend("http://a/v1", 2), Backend("http://b/v1"), Backend("http://c/v1")
    pool, _ = pool_of(a, b, c)
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2  # per weight: 1.5, 1, 2
    assert [x.name[7] for x in pool.plan(None)] == ["b", "a", "c"]


def test_a_failed_probe_steers_requests_away_while_another_upstream_can_serve():
    a, b = Backend("http://a/v1"), Backend("http://b/v1")
    pool, _ = pool_of(a, b)
    a.probed("cannot connect", None)
    assert pool.plan(None) == [b]
    b.probed("cannot connect either", None)
    assert set(pool.plan(None)) == {a, b}  # none answers: each is tried, for its own error
    # Every probe failed: no circuit can say when, only the next probe.
    assert pool.ready() == (False, "cannot connect; cannot connect either", None)
    a.probed(None, ["m"])
    assert pool.ready() == (True, "", None) and pool.plan(None) == [a]


def test_models_route_requests_and_aliases_name_them():
    a = Backend("http://a/v1", models=("llama",), fixed_models=True)
    b = Backend("http://b/v1")
    pool, _ = pool_of(a, b, aliases={"gpt-4o-mini": "qwen"})
    b.probed(None, ["qwen", "mistral"])
    a.probed(None, ["other"])  # configured models are not replaced by its list
    assert pool.model_names() == ("llama", "mistral", "qwen", "gpt-4o-mini")
    assert pool.plan("llama") == [a]
    assert pool.plan(pool.resolve("gpt-4o-mini")) == [b]


def test_the_model_names_are_made_again_once_what_they_are_made_of_changes():
    """Asked for by every request, the names are kept; a probe's new list, new routes'
    aliases or fallbacks and a reload's new upstreams each make them anew."""
    a, b = Backend("http://a/v1", models=("llama",)), Backend("http://b/v1", models=("qwen",))
    pool, _ = pool_of(a, b, aliases={"small": "qwen"})
    first = pool.model_names()
    assert first == ("llama", "qwen", "small") and pool.model_names() is first
    b.probed(None, ["qwen", "mistral"])
    assert pool.model_names() == ("llama", "mistral", "qwen", "small")
    b.probed(None, ["mistral"])  # qwen gone: its alias names nothing served
    assert pool.model_names() == ("llama", "mistral")
    pool.aliases = {"big": "llama"}
    assert pool.model_names() == ("llama", "mistral", "big")
    pool.backends = [Backend("http://c/v1", models=("gemma",))]
    assert pool.model_names() == ("gemma",)
    pool.fallbacks = {"llama": ("gemma",)}  # listed by none now, but its fallback is served
    assert pool.model_names() == ("gemma", "llama", "big")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "routes.toml"
    path.write_text(text)
    return path


def test_a_routes_file_gives_keys_weights_models_and_aliases(tmp_path: Path):
    path = write(
        tmp_path,
        """
[[upstreams]]
url = "http://a:8000/v1/"
weight = 3
api_key_env = "A_KEY"
models = ["llama"]

[[upstreams]]
url = "http://b:8000/v1"
api_key = "b-key"
models = ["qwen"]
max_outstanding = 8
ttft_s = 90
stall_s = 2.5

[aliases]
"gpt-4o-mini" = "qwen"
""",
    )
    routes = load_routes(path, env={"A_KEY": "a-key"})
    a, b = routes.targets
    assert (a.base_url, a.weight, a.api_key, a.models) == (
        "http://a:8000/v1",
        3,
        "a-key",
        ("llama",),
    )
    assert (b.base_url, b.weight, b.api_key, b.models) == (
        "http://b:8000/v1",
        1,
        "b-key",
        ("qwen",),
    )
    assert (a.max_outstanding, b.max_outstanding) == (None, 8)
    assert (a.ttft_s, a.stall_s, b.ttft_s, b.stall_s) == (None, None, 90.0, 2.5)
    assert routes.aliases == (("gpt-4o-mini", "qwen"),)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[[upstreams]]\nurl = 'http://a/v1'\nweight = 0", "upstreams[0].weight: input should be"),
        ("[[upstreams]]\nurl = 'ftp://a/v1'", "upstreams[0].url: must start with http://"),
        ("[[upstreams]]\nurl = 'http://a/v1'\nttft_s = 0", "upstreams[0].ttft_s: input should be"),
        ("[[upstreams]]\nurl = 'http://a/v1'\nstall_s = 'x'", "upstreams[0].stall_s: input should"),
        # A limit that is no number of seconds, as the command line refuses one.
        ("[[upstreams]]\nurl = 'http://a/v1'\nstall_s = inf", "upstreams[0].stall_s: input should"),
        ("[[upstreams]]\nurl = 'http://a/v1'\nttft_s = inf", "upstreams[0].ttft_s: input should"),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nmodels = ['m']\n[aliases]\n'' = 'm'",
            "aliases: the name '': string should have at least 1 character",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nmax_outstanding = 0",
            "upstreams[0].max_outstanding: input should be greater than or equal to 1",
        ),
        ("[[upstreams]]\nurl = 'http://a/v1'\nwieght = 2", "upstreams[0].wieght: is not a field"),
        ("[[upstreams]]\nweight = 2", "upstreams[0].url: is required"),
        ("upstreams = []", "upstreams: list should have at least 1 item"),
        ("[[upstreams]]\nurl = 'http://a/v1'\napi_key_env = 'NOPE'", "$NOPE is not set"),
        ("[[upstreams]]\nurl = 'http://a/v1'\n[[upstreams]]\nurl = 'http://a/v1'", "listed twice"),
        # One upstream however it is spelt: the file's own line says so, not --engine's.
        (
            "[[upstreams]]\nurl = 'http://A:80/v1'\n[[upstreams]]\nurl = 'HTTP://a/v1/'",
            "upstreams[1].url: http://a/v1 is listed twice (as http://A:80/v1)",
        ),
        # An IPv6 address however it is written.
        (
            "[[upstreams]]\nurl = 'http://[::1]:8000/v1'\n[[upstreams]]\n"
            "url = 'http://[0:0:0:0:0:0:0:1]:8000/v1'",
            "upstreams[1].url: http://[0:0:0:0:0:0:0:1]:8000/v1 is listed twice (as "
            "http://[::1]:8000/v1)",
        ),
        # An alias's model is looked up once: an alias of an alias, or of itself, names none.
        (
            "[[upstreams]]\nurl = 'http://a/v1'\n[aliases]\nx = 'y'\ny = 'm'",
            "aliases.x: 'y' is itself an alias: name the model it stands for",
        ),
        ("[[upstreams]]\nurl = 'http://a/v1'\n[aliases]\nc = 'c'", "aliases.c: is its own model"),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nmodels = ['m']\n[aliases]\nx = 'n'",
            "aliases.x: no upstream lists the model 'n'",
        ),
        ("[[upstreams]\nurl = 1", "not valid TOML"),
        ("[[upstreams]]\nurl = 'http://'", "upstreams[0].url: has no host"),
        (
            "[[upstreams]]\nurl = 'http://a:x/v1'",
            "upstreams[0].url: has a port that is not a number",
        ),
        ("[[upstreams]]\nurl = 'http://u:p@a/v1'", "upstreams[0].url: may not carry a user name"),
        ("[[upstreams]]\nurl = 'http://a/v1#x'", "upstreams[0].url: may not have a query"),
        ("[[upstreams]]\nurl = 'http://[::1/v1'", "upstreams[0].url: is not a valid URL"),
        # A space would split the request line; a control character would reach it and the
        # logs; a host not in ASCII would be sent as no Host header can be.
        ("[[upstreams]]\nurl = 'http://a/ v1'", "upstreams[0].url: may hold printable ASCII"),
        ('[[upstreams]]\nurl = "http://a/v1\\u001b[2J"', "upstreams[0].url: may hold printable"),
        ("[[upstreams]]\nurl = 'http://bücher.example/v1'", "give a host in its ASCII form"),
        # A name of the file's, however odd, is shown quoted on the one line.
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nmodels = ['m']\n[aliases]\n\"a\\nb\" = 5",
            'aliases."a\\nb": input should be a valid string',
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\napi_key = \"a\\nb\"",
            "upstreams[0].api_key: must be",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\napi_key_env = 'BAD'",
            "upstreams[0].api_key_env: $BAD",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { 'X Tenant' = 'a' }",
            "upstreams[0].headers: the name 'X Tenant' is no HTTP header name",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { Authorization = 'Bearer k' }",
            "upstreams[0].headers: Authorization is a header the relay writes itself (give",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { host = 'b' }",
            "upstreams[0].headers: host is a header the relay writes itself",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { X-T = \"a\\r\\nX-Evil: 1\" }",
            "upstreams[0].headers: the value of X-T must be printable ASCII",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { X-T = 1 }",
            "upstreams[0].headers.X-T: input should be a valid string",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders_env = { X-T = 'NOPE' }",
            "upstreams[0].headers_env.X-T: $NOPE is not set",
        ),
        (
            # The value is a secret: which variable is told, never what it holds.
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders_env = { X-T = 'BAD' }",
            "upstreams[0].headers_env ($BAD): the value of X-T must be printable ASCII",
        ),
        (
            "[[upstreams]]\nurl = 'http://a/v1'\nheaders = { X-T = 'a' }\n"
            "headers_env = { x-t = 'A_KEY' }",
            "upstreams[0].headers_env: x-t is given twice",
        ),
    ],
)
def test_a_bad_routes_file_is_one_line_naming_the_file_the_entry_and_the_field(
    tmp_path: Path, text: str, says: str
):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as caught:
        load_routes(path, env={"BAD": "ключ", "A_KEY": "a-key"})
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message
    assert "ключ" not in message


def test_serve_stops_at_a_bad_routes_file_with_one_line(tmp_path: Path):
    bad = write(tmp_path, "[[upstreams]]\nurl = 'http://127.0.0.1:9/v1'\nweight = 0\n")
    for argv, says in (
        (
            ["--engine", "upstream", "--upstream-routes", str(bad)],
            f"replystream serve: --upstream-routes {bad}: upstreams[0].weight: input should be",
        ),
        (
            ["--engine", "upstream"],
            "replystream serve: --engine upstream needs --upstream-routes FILE",
        ),
        (
            ["--engine", "simulated", "--upstream-continue"],
            "replystream serve: --upstream-continue is an option of the upstream engine",
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "replystream", "serve", "--port", "0", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith(says), done.stderr


def test_a_routes_files_first_text_limit_past_the_failover_window_names_file_and_field(
    tmp_path: Path,
):
    # Checked against a flag, not within the file alone: named all the same, as the file's
    # own mistakes are.
    routes = write(
        tmp_path,
        "[[upstreams]]\nurl = 'http://127.0.0.1:9/v1'\n"
        "[[upstreams]]\nurl = 'http://127.0.0.1:10/v1'\nttft_s = 90\n",
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "replystream", "serve", "--port", "0", "--engine", "upstream"),
            *("--upstream-routes", str(routes), "--upstream-failover-s", "60"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith(
        f"replystream serve: --upstream-routes {routes}: upstreams[1].ttft_s: 90 s to the "
        "first text is past the failover window (60 s"
    ), done.stderr


def test_an_upstream_at_its_limit_is_skipped_and_all_at_theirs_is_full_not_unusable():
    a = Backend("http://a/v1", max_outstanding=1)
    b = Backend("http://b/v1", max_outstanding=2)
    pool = UpstreamPool([a, b], BreakerConfig(), lambda: 0.0)
    a.begin()
    assert pool.plan(None) == [b] and not pool.full(None)
    b.begin()
    b.begin()
    assert pool.plan(None) == [] and pool.full(None)
    assert not pool.full(None, excluding=[a, b])  # tried them all: nothing to wait for
    b.end(False)
    assert pool.plan(None) == [b]
    # An open circuit is no reason to wait: full only while some upstream would let it in.
    b.begin()
    for _ in range(3):
        pool.failed(a, "down")
        pool.failed(b, "down")
    assert pool.plan(None) == [] and not pool.full(None)


def test_a_request_from_before_the_circuit_opened_ending_leaves_the_trial_alone():
    a = Backend("http://a/v1")
    pool, clock = pool_of(a, failures=1, cooldown_s=5.0)
    long_reply = a.begin()  # streaming since before the circuit opened
    a.answered()
    assert not long_reply
    pool.failed(a, "refused")  # another request failed: the circuit opens
    clock.now += 5.0
    trial = a.begin()
    assert trial and a.circuit is Circuit.HALF_OPEN
    a.ended_well()
    a.end(long_reply)  # the long reply ends: it says nothing of the trial under way
    assert a.circuit is Circuit.HALF_OPEN and pool.plan(None) == []  # one trial at a time
    a.end(trial)  # the trial's client left: no verdict, the next request tries
    assert a.circuit.value == "open" and pool.plan(None) == [a]


def test_a_404_for_a_model_puts_its_upstream_last_for_that_model_until_listed_or_timed_out():
    a, b, c = Backend("http://a/v1"), Backend("http://b/v1"), Backend("http://c/v1")
    pool, clock = pool_of(a, b, c)
    b.begin()
    c.begin()  # a is the least loaded: first in every plan, unless it lacks the model
    pool.not_serving(a, "qwen")
    assert pool.plan("qwen")[-1] is a and pool.plan("llama")[0] is a
    assert pool.plan("qwen", prefer=lambda usable: a if a in usable else usable[0])[-1] is a
    pool.failed(b, "down", 30.0)
    pool.failed(c, "down", 30.0)
    assert pool.plan("qwen") == [a]  # the only one left is still asked
    b.succeeded()
    c.succeeded()
    # A probe's listing without the model renews it; with it, lifts it.
    clock.now += NOT_SERVED_S - 1.0
    pool.listed(a, ["llama"])
    clock.now += NOT_SERVED_S - 1.0
    assert pool.plan("qwen")[-1] is a
    pool.listed(a, ["llama", "qwen"])
    assert pool.plan("qwen")[0] is a
    # With nothing listed, it stands for NOT_SERVED_S.
    pool.not_serving(a, "qwen")
    clock.now += NOT_SERVED_S - 0.1
    assert pool.plan("qwen")[-1] is a
    clock.now += 0.2
    assert pool.plan("qwen")[0] is a
    # An attempt there that ended well says it serves the model.
    pool.not_serving(a, "qwen")
    pool.served(a, "qwen")
    assert pool.plan("qwen")[0] is a


def test_the_404s_kept_per_upstream_are_bounded_oldest_first():
    a = Backend("http://a/v1")
    pool, _ = pool_of(a)
    for i in range(NOT_SERVED_LIMIT + 10):
        pool.not_serving(a, f"model-{i}")
    assert len(a.unserved) == NOT_SERVED_LIMIT
    assert "model-0" not in a.unserved and f"model-{NOT_SERVED_LIMIT + 9}" in a.unserved
