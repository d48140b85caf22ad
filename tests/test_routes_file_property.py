"""Any routes file: a relay's configuration read (``load_routes``), or one line naming the file
and what is wrong, never another exception.

The files are TOML written here from random values of every kind TOML has, in every field an
entry may have (and some it may not), mostly beside valid ones so that the checks past the
first are reached: TLS files that exist or not, environment variables set or not, header
names and values of any text.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replystream.engine.upstream_routes import Routes, load_routes
from tests.test_bench_tls import make_certificates

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
FIELDS = [
    "url",
    "weight",
    "api_key",
    "api_key_env",
    "pass_client_key",
    "models",
    "max_outstanding",
    "ttft_s",
    "stall_s",
    "ca_file",
    "cert_file",
    "key_file",
    "headers",
    "headers_env",
    "unknown",
]
ENV = {"KEY": "sk-ok", "BAD": "two words", "EMPTY": "", "SECRET": "s3cr3t"}
text = st.text(st.characters(codec="utf-8"), max_size=12)  # any text a file can hold
scalars = (
    text
    | st.sampled_from(["http://a/v1", "https://localhost/v1", "ca.pem", "server.pem", "KEY"])
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.booleans()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (inline: arrays and inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's escapes are TOML's; raw UTF-8 for the rest (TOML has no surrogate pairs),
        # but for DEL, a control character TOML takes only escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float):
        return ("-" if value < 0 else "") + "inf" if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


url = st.sampled_from(["http://a/v1", "https://localhost/v1", "http://[::1]:8000/v1"])
valid = {
    "weight": st.integers(1, 5),
    "api_key_env": st.sampled_from(list(ENV)),
    "models": st.lists(st.sampled_from(["m", "n"]), max_size=2),
    "ca_file": st.sampled_from(["ca.pem", "missing.pem", "server.key"]),
    "cert_file": st.sampled_from(["server.pem", "ca.pem"]),
    "headers": st.dictionaries(text, text, max_size=2),
    "headers_env": st.dictionaries(text, st.sampled_from(list(ENV)), max_size=2),
}
# Mostly valid entries, each with a field or two of any value at times: a first mistake in
# every example would leave the checks after it unread.
odd_fields: st.SearchStrategy[dict[str, Any]] = st.just({}) | st.dictionaries(
    st.sampled_from(FIELDS), values, max_size=2
)
entries = st.lists(
    st.tuples(st.fixed_dictionaries({"url": url}, optional=valid), odd_fields).map(
        lambda parts: {**parts[0], **parts[1]}
    ),
    min_size=1,
    max_size=3,
)
aliases = st.dictionaries(text, values, max_size=2)
# A model's fallbacks: mostly lists of the models and aliases a file may name, at times any
# value at all.
named = st.sampled_from(["m", "n", "a", "x"]) | text
fallbacks = st.dictionaries(named, st.lists(named, max_size=3) | values, max_size=2)


def test_any_routes_file_is_read_or_refused_in_one_line(tmp_path: Path) -> None:
    make_certificates(tmp_path)  # ca.pem, server.pem and server.key beside the file

    @SETTINGS
    @given(entries, aliases, fallbacks)
    def check(
        upstreams: list[dict[str, Any]], named: dict[str, Any], falls: dict[str, Any]
    ) -> None:
        lines = []
        for entry in upstreams:
            lines.append("[[upstreams]]")
            lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in entry.items()]
        if named:
            lines.append("[aliases]")
            lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in named.items()]
        if falls:
            lines.append("[fallbacks]")
            lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in falls.items()]
        path = tmp_path / "routes.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            routes = load_routes(path, env=ENV)
        except ValueError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: ") and message.isprintable(), message
            assert "s3cr3t" not in message, message  # a secret's value is never shown
            return
        assert isinstance(routes, Routes) and routes.targets

    check()


def test_a_files_fallbacks_are_of_models_its_upstreams_serve(tmp_path: Path) -> None:
    """Where a file reads, each model its fallbacks name (a key or in a list) is one an
    upstream lists, or one whose upstreams' lists are not all known, never itself, never
    twice."""

    @SETTINGS
    @given(fallbacks)
    def check(falls: dict[str, Any]) -> None:
        lines = ["[[upstreams]]", 'url = "http://a/v1"', 'models = ["m", "n"]']
        lines += ["[aliases]", 'a = "m"', "[fallbacks]"]
        lines += [f"{toml_value(k)} = {toml_value(v)}" for k, v in falls.items()]
        path = tmp_path / "routes.toml"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            routes = load_routes(path)
        except ValueError:
            return
        for model, others in routes.fallbacks:
            assert {model, *others} <= {"m", "n"} and model not in others
            assert len(set(others)) == len(others)

    check()


@pytest.mark.parametrize(
    ("models", "said"),
    [
        ("[]", "upstreams[0].models: is empty: list the names, or leave it out"),
        ('["a", "b", "a"]', "upstreams[0].models: lists a more than once"),
        ('["a\\nb"]', "upstreams[0].models: a name holds a control character"),
    ],
    ids=["empty", "twice", "line-break"],
)
def test_a_list_of_models_names_each_once_printably(tmp_path: Path, models: str, said: str):
    # An empty list was taken as none given (the upstream's own list used), a name twice or
    # with a line break without a word.
    path = tmp_path / "routes.toml"
    path.write_text(f'[[upstreams]]\nurl = "http://127.0.0.1:9/v1"\nmodels = {models}\n')
    with pytest.raises(ValueError, match=re.escape(said)):
        load_routes(path)


@pytest.mark.parametrize(
    ("tables", "said"),
    [
        ('[aliases]\n"a\\nb" = "m"\n', 'aliases."a\\nb": a name holds a control character'),
        ('[aliases]\na = "m\\tx"\n', "aliases.a: a name holds a control character"),
        ('[fallbacks]\nm = ["n\\rx"]\n', "fallbacks.m: a name holds a control character"),
    ],
    ids=["alias", "aliased-model", "fallback"],
)
def test_alias_and_fallback_names_are_printable_as_models_are(
    tmp_path: Path, tables: str, said: str
):
    # An upstream's models refused a line break; an alias (listed by /v1/models as a model)
    # or a fallback took one without a word.
    path = tmp_path / "routes.toml"
    path.write_text(f'[[upstreams]]\nurl = "http://127.0.0.1:9/v1"\n{tables}')
    with pytest.raises(ValueError, match=re.escape(said)):
        load_routes(path)
