"""The relay's routes file (``--upstream-routes FILE``, TOML): what does not fit on a command
line: each upstream's own key and models, and model aliases.

    [[upstreams]]
    url = "http://gpu-a:8000/v1"
    weight = 3                      # optional, default 1
    api_key_env = "GPU_A_KEY"       # or api_key = "..." (optional: else --upstream-api-key)
    models = ["llama-3.1-8b"]       # optional: else what its GET /models lists
    max_outstanding = 64            # optional: else --upstream-max-outstanding
    ttft_s = 50                     # optional: else --upstream-ttft-s (likewise stall_s)

    [[upstreams]]
    url = "https://api.example.com/v1"
    pass_client_key = true          # each caller's own key goes to it, not a configured one

    [[upstreams]]
    url = "https://gpu-b.internal:8443/v1"
    ca_file = "certs/internal-ca.pem"   # its certificate checked against these CAs only
    cert_file = "certs/relay.pem"       # the certificate this relay shows it (mTLS), and
    key_file = "certs/relay.key"        # its key (optional: else in cert_file)

    [[upstreams]]
    url = "https://llm.example.com/v1"
    headers = { "X-Tenant" = "support" }                    # sent with every request
    headers_env = { "CF-Access-Client-Secret" = "CF_SECRET" }  # ... the value from $CF_SECRET

    [aliases]                       # optional: a name clients use = a model an upstream serves
    "gpt-4o-mini" = "llama-3.1-8b"

    [fallbacks]                     # optional: a model = the models its requests go on to,
    "llama-3.1-70b" = ["llama-3.1-8b"]  # in order, when no upstream of it can answer them

This file decides the format and checks it whole at start-up: every mistake is one line
naming the file, the entry and the field (``routes.toml: upstreams[1].weight: ...``); an
upstream given a key and ``pass_client_key = true`` is one; TLS files (paths relative to the
routes file's folder) are read and checked here, so a missing or broken one is such a line
too. It reads the environment for ``api_key_env`` and ``headers_env`` only. It must not know
how upstreams are used.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from replystream.engine.upstream_config import (
    UpstreamTarget,
    base_url_problem,
    header_problem,
    key_problem,
    lower_scheme,
    upstream_identity,
)

Name = Annotated[str, Field(min_length=1)]
_BARE = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class UpstreamEntry(_Strict):
    url: Name
    weight: Annotated[int, Field(ge=1)] = 1
    api_key: Name | None = None
    api_key_env: Name | None = None
    pass_client_key: bool | None = None
    # Absent: the upstream's own list (its ``GET /models``); given, at least one name, once.
    models: list[Name] | None = None
    max_outstanding: Annotated[int, Field(ge=1)] | None = None
    # Seconds, as the command line takes them: a positive finite number.
    ttft_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    stall_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    ca_file: Name | None = None
    cert_file: Name | None = None
    key_file: Name | None = None
    headers: dict[str, str] = {}
    headers_env: dict[str, Name] = {}

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        url = lower_scheme(url)
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        problem = base_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url.rstrip("/")

    @field_validator("models")
    @classmethod
    def _names(cls, models: list[str] | None) -> list[str] | None:
        if models is None:
            return None
        if not models:
            raise ValueError("is empty: list the names, or leave it out to take the upstream's")
        if any(not name.isprintable() for name in models):
            raise ValueError("a name holds a control character (a line break, a tab)")
        twice = sorted({m for m in models if models.count(m) > 1})
        if twice:
            raise ValueError(f"lists {', '.join(twice)} more than once")
        return models

    @field_validator("api_key")
    @classmethod
    def _sendable(cls, key: str | None) -> str | None:
        problem = None if key is None else key_problem(key)
        if problem is not None:
            raise ValueError(problem)
        return key


def _headers(
    entry: UpstreamEntry, where: str, env: Mapping[str, str]
) -> tuple[tuple[str, str], ...]:
    """An entry's own headers, those of ``headers_env`` read from ``env`` now.

    Raises:
        ValueError: one line naming the entry's field at fault (a secret's value unshown).
    """
    sent: dict[str, tuple[str, str]] = {}  # by lower-case name: one of each
    for field, given in (("headers", entry.headers), ("headers_env", entry.headers_env)):
        for name, spec in given.items():
            value = spec if field == "headers" else env.get(spec, "")
            if field == "headers_env" and not value:
                raise ValueError(f"{where}.headers_env.{shown(name)}: ${shown(spec)} is not set")
            problem = header_problem(name, value)
            if problem is not None:
                variable = f" (${shown(spec)})" if field == "headers_env" else ""
                raise ValueError(f"{where}.{field}{variable}: {problem}")
            if name.lower() in sent:
                raise ValueError(f"{where}.{field}: {name} is given twice")
            sent[name.lower()] = (name, value)
    return tuple(sent.values())


class RoutesFile(_Strict):
    upstreams: Annotated[list[UpstreamEntry], Field(min_length=1)]
    aliases: dict[Name, Name] = {}
    fallbacks: dict[Name, Annotated[list[Name], Field(min_length=1)]] = {}


@dataclass(frozen=True, slots=True)
class Routes:
    """What a routes file says. ``fallbacks``: each model (an alias written as its model)
    and the models its requests go on to, in order, likewise written as models."""

    targets: tuple[UpstreamTarget, ...]
    aliases: tuple[tuple[str, str], ...]
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...] = ()


def shown(name: str) -> str:
    """A name from the file as a message shows it: as written if TOML would take it bare,
    else quoted with JSON's escapes (which are TOML's), so a message stays one line of
    printable text whatever the file holds."""
    return name if _BARE.fullmatch(name) else json.dumps(name)


def _where(loc: tuple[int | str, ...]) -> str:
    """``upstreams[1].weight`` from pydantic's ``("upstreams", 1, "weight")``; a table's
    name at fault (``("aliases", "", "[key]")``) is ``aliases: the name ''``."""
    if len(loc) >= 2 and loc[-1] == "[key]":
        return f"{_where(loc[:-2])}: the name {str(loc[-2])!r}"
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{shown(part)}" if text else shown(part)
    return text or "the file"


def _message(error: Mapping[str, Any]) -> str:
    kind, message = error["type"], str(error["msg"])
    if kind == "extra_forbidden":
        return "is not a field of the routes file (a typo?)"
    if kind == "missing":
        return "is required"
    return message[0].lower() + message[1:].removeprefix("Value error, ")


def _tls(entry: UpstreamEntry, where: str, folder: Path) -> ssl.SSLContext | None:
    """The TLS an entry's upstream is reached with, its files read now (None: the system's
    CAs, no client certificate).

    Raises:
        ValueError: one line naming the entry's field at fault.
    """
    files = {n: getattr(entry, n) for n in ("ca_file", "cert_file", "key_file")}
    given = {n: folder / name for n, name in files.items() if name is not None}
    if not given:
        return None
    if not entry.url.startswith("https://"):
        raise ValueError(f"{where}.{next(iter(given))}: is for an https:// upstream")
    if "key_file" in given and "cert_file" not in given:
        raise ValueError(f"{where}.key_file: is the key of cert_file, which is not given")
    for field, path in given.items():
        try:
            path.read_bytes()
        except OSError as exc:
            reason = exc.strerror or exc
            raise ValueError(f"{where}.{field}: {path}: cannot be read ({reason})") from None
    ca = given.get("ca_file")
    try:
        context = ssl.create_default_context(cafile=None if ca is None else str(ca))
    except ssl.SSLError as exc:
        words = f"holds no CA certificate this relay can read ({exc.reason or exc})"
        raise ValueError(f"{where}.ca_file: {ca}: {words}") from None
    cert, key = given.get("cert_file"), given.get("key_file")
    if cert is not None:
        field, holder = ("key_file", key) if key is not None else ("cert_file", cert)

        def no_passphrase() -> str:
            # Without a callback OpenSSL asks for one on the terminal: --check, a start or a
            # reload would wait there (a reload with the whole server stopped).
            raise ValueError(
                f"{where}.{field}: {holder}: the key is encrypted, and a routes file gives no "
                "passphrase: decrypt it (openssl pkey -in KEY -out KEY.plain)"
            )

        try:
            context.load_cert_chain(
                str(cert), None if key is None else str(key), password=no_passphrase
            )
        except ssl.SSLError as exc:
            words = f"is not a certificate and a key that belong together ({exc.reason or exc})"
            raise ValueError(f"{where}.cert_file: {cert}: {words}") from None
    return context


def _not_a_file(path: Path) -> bool:
    """Whether ``path`` is there and neither a file nor a folder (which reading names).

    Raises:
        OSError: it cannot be looked at.
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False  # said by reading it
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def load_routes(path: Path, env: Mapping[str, str] | None = None) -> Routes:
    """Read and check a routes file.

    Raises:
        ValueError: one line naming the file, the entry and the field at fault.
    """
    env = os.environ if env is None else env
    try:
        if _not_a_file(path):
            # A pipe would be read until a writer closes it (a reload's wait stopping the
            # server), a device for ever.
            raise ValueError(f"{path}: is not a regular file (a pipe, a device): want the file")
        # A byte-order mark, which some Windows editors write at the start of a UTF-8 file,
        # is no part of the text: TOML would refuse it as an "invalid statement" at line 1,
        # column 1, where the operator sees nothing wrong.
        raw = tomllib.loads(path.read_text(encoding="utf-8").removeprefix("\ufeff"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    except RecursionError:  # tomllib recurses into each nested array or table
        raise ValueError(f"{path}: not valid TOML (nested too deeply)") from None
    try:
        parsed = RoutesFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = _message(first).removeprefix("value error, ")
        raise ValueError(f"{path}: {_where(first['loc'])}: {message}") from None
    targets: list[UpstreamTarget] = []
    seen: dict[tuple[str, str, int, str], str] = {}  # each upstream's identity: its URL here
    for index, entry in enumerate(parsed.upstreams):
        where = f"{path}: upstreams[{index}]"
        identity = upstream_identity(entry.url)  # one upstream however its URL is spelt
        if identity in seen:
            listed = seen[identity]
            spelt = "" if listed == entry.url else f" (as {listed})"
            raise ValueError(f"{where}.url: {entry.url} is listed twice{spelt}")
        seen[identity] = entry.url
        if entry.api_key is not None and entry.api_key_env is not None:
            raise ValueError(f"{where}.api_key_env: give api_key or api_key_env, not both")
        if entry.pass_client_key and (entry.api_key or entry.api_key_env) is not None:
            given = "api_key" if entry.api_key is not None else "api_key_env"
            raise ValueError(
                f"{where}.pass_client_key: the upstream gets the client's key or {given}, "
                "not both: drop one"
            )
        key, key_from = entry.api_key, f"{where}.api_key"
        if entry.api_key_env is not None:
            key_from = f"{where}.api_key_env (${shown(entry.api_key_env)})"
            key = env.get(entry.api_key_env) or None
            if key is None:
                raise ValueError(f"{where}.api_key_env: ${shown(entry.api_key_env)} is not set")
            problem = key_problem(key)
            if problem is not None:
                raise ValueError(f"{where}.api_key_env: ${shown(entry.api_key_env)} {problem}")
        targets.append(
            UpstreamTarget(
                entry.url,
                entry.weight,
                key,
                tuple(entry.models or ()),
                entry.pass_client_key,
                entry.max_outstanding,
                entry.ttft_s,
                entry.stall_s,
                _tls(entry, where, path.parent),
                entry=where,
                key_from=key_from if key is not None else None,
                headers=_headers(entry, where, env),
                shows_certificate=entry.cert_file is not None,
            )
        )
    served = {m for t in targets for m in t.models}
    every_listed = all(t.models for t in targets)
    for table, names in (
        ("aliases", {a: [m] for a, m in parsed.aliases.items()}),
        ("fallbacks", parsed.fallbacks),
    ):
        for name, others in names.items():
            if not all(text.isprintable() for text in (name, *others)):
                # As an upstream's models: a model name is one line of printable text.
                raise ValueError(
                    f"{path}: {table}.{shown(name)}: a name holds a control character "
                    "(a line break, a tab)"
                )
    for alias, model in parsed.aliases.items():
        if model == alias:
            raise ValueError(f"{path}: aliases.{shown(alias)}: is its own model")
        if model in parsed.aliases:  # one lookup: an alias of an alias would name no model
            raise ValueError(
                f"{path}: aliases.{shown(alias)}: {model!r} is itself an alias: name the "
                "model it stands for"
            )
        if alias in served:
            raise ValueError(
                f"{path}: aliases.{shown(alias)}: is a model an upstream serves already"
            )
        if every_listed and model not in served:
            raise ValueError(
                f"{path}: aliases.{shown(alias)}: no upstream lists the model {model!r}"
            )
    fallbacks = _fallbacks(parsed, served if every_listed else None, path)
    return Routes(tuple(targets), tuple(parsed.aliases.items()), fallbacks)


def _fallbacks(
    parsed: RoutesFile, served: set[str] | None, path: Path
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The file's fallbacks with every alias written as its model.

    Raises:
        ValueError: one line naming the entry at fault: a model its own fallback, one
            listed twice, one given fallbacks twice (as itself and by an alias), or (when
            every upstream lists its models: ``served``) one no upstream lists.
    """
    aliases = parsed.aliases
    made: dict[str, tuple[str, ...]] = {}
    for name, others in parsed.fallbacks.items():
        where = f"{path}: fallbacks.{shown(name)}"
        model = aliases.get(name, name)
        if model in made:
            raise ValueError(f"{where}: the model {model!r} is given fallbacks twice")
        models = [aliases.get(other, other) for other in others]
        for other, resolved in zip(others, models, strict=True):
            if served is not None and resolved not in served:
                raise ValueError(f"{where}: no upstream lists the model {resolved!r}")
            if resolved == model:
                raise ValueError(f"{where}: {other!r} is the model itself")
            if models.count(resolved) > 1:
                raise ValueError(f"{where}: the model {resolved!r} is listed twice")
        if served is not None and model not in served:
            raise ValueError(f"{where}: no upstream lists the model {model!r}")
        made[model] = tuple(models)
    return tuple(made.items())
