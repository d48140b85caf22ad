"""``UpstreamEngine``: an OpenAI-compatible model server (vLLM, TGI, llama.cpp, Ollama) relayed.

This file decides how a ``GenerationRequest`` becomes a streaming ``POST {base}/chat/completions``
(the client's chat messages unchanged, or the prompt as one user message; sampling fields
mapped; ``stream_options.include_usage``), which upstream serves it (smooth weighted round
robin over ``UpstreamTarget``s), and what an upstream failure before the first byte means to
our client: connection refused is ``UpstreamUnavailable`` (502), no response head within
``headers_timeout_s`` is ``UpstreamTimeout`` (504), an upstream 4xx about the request is a
``RequestRejected`` (400) carrying the upstream's message, 429 and 503 stay overload (503).
Every message is ours (``upstream_errors``); an upstream's own words appear only quoted, from
a JSON error body. Readiness is ``upstream_health``'s. Upstream API keys come from
configuration only, never from our clients. Everything after the head is
``upstream_stream.UpstreamStream``'s. It must not know about our HTTP server.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from replystream.engine.base import (
    EngineError,
    EngineStats,
    GenerationRequest,
    Readiness,
    RequestRejected,
)
from replystream.engine.upstream_errors import connect_failure, quoted
from replystream.engine.upstream_health import UpstreamHealth
from replystream.engine.upstream_stream import UpstreamStream

BODY_LIMIT = 64 * 1024  # bytes of an upstream error body we read to quote its message


class UpstreamUnavailable(EngineError):
    """No upstream answered: connection refused, reset, or a broken response head (502)."""

    status = 502


class UpstreamTimeout(EngineError):
    """An upstream took longer than the head timeout to connect or answer (504)."""

    status = 504


class UpstreamOverloaded(EngineError):
    """An upstream answered 429 or 503 (503 to our client: try again later)."""

    status = 503


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """One upstream: the base URL of its OpenAI API (``http://host:port/v1``) and its weight."""

    base_url: str
    weight: int = 1

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"an upstream URL must be http:// or https://, got {self.base_url!r}")
        if self.weight < 1:
            raise ValueError(f"an upstream weight must be at least 1, got {self.weight}")

    @classmethod
    def parse(cls, spec: str) -> UpstreamTarget:
        """``URL`` or ``URL=WEIGHT`` (only a trailing ``=digits`` is a weight)."""
        url, sep, weight = spec.rpartition("=")
        if sep and weight.isdigit() and url:
            return cls(url.rstrip("/"), int(weight))
        return cls(spec.rstrip("/"))


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Where the upstreams are and how long each phase of a relayed reply may take."""

    targets: tuple[UpstreamTarget, ...]
    api_key: str | None = None
    model: str | None = None  # None: the first model the upstream's /models lists
    headers_timeout_s: float = 30.0  # connect plus the response head
    stall_s: float = 60.0  # no byte for this long mid-reply ends it
    max_event_size: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("give at least one upstream")
        if not (self.headers_timeout_s > 0 and self.stall_s > 0 and self.max_event_size > 0):
            raise ValueError("upstream timeouts and the event size limit must be positive")


class WeightedRoundRobin:
    """Smooth weighted round robin (nginx's): weights 3 and 1 give A A B A, A A B A, ..."""

    def __init__(self, weights: Sequence[int]) -> None:
        self._weights = list(weights)
        self._current = [0] * len(weights)

    def pick(self) -> int:
        total = sum(self._weights)
        for i, weight in enumerate(self._weights):
            self._current[i] += weight
        best = max(range(len(self._weights)), key=lambda i: self._current[i])
        self._current[best] -= total
        return best


def request_body(request: GenerationRequest, model: str | None) -> dict[str, Any]:
    """The upstream chat-completion body for ``request``."""
    s = request.sampling
    messages = (
        [dict(m) for m in request.messages]
        if request.messages
        else [{"role": "user", "content": request.prompt}]
    )
    body: dict[str, Any] = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    if model is not None:
        body["model"] = model
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    if s.top_k > 0:
        body["top_k"] = s.top_k  # vLLM, TGI, llama.cpp and Ollama take it; OpenAI does not
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = s.logprobs
    if request.tools:  # already in chat's form, whatever dialect the client spoke
        body["tools"] = [dict(tool) for tool in request.tools]
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    return body


def _upstream_message(raw: bytes) -> tuple[str | None, str | None, str | None]:
    """Message, code and param of an upstream's JSON error body (any of the common shapes);
    no message for a body that is not one (an HTML page, a proxy's text, nothing)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, None, None
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        code, param = error.get("code"), error.get("param")
        message = error.get("message") or error.get("detail")
        return (
            quoted(message) if isinstance(message, str) and message.strip() else None,
            code if isinstance(code, str) else None,
            param if isinstance(param, str) else None,
        )
    return (quoted(error) if isinstance(error, str) and error.strip() else None), None, None


class UpstreamEngine:
    """Relays OpenAI-compatible streaming servers; one aiohttp session per engine."""

    name = "upstream"
    pushes = False
    makes_tool_calls = True  # the upstream's calls are relayed (it refuses what it cannot do)

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._balancer = WeightedRoundRobin([t.weight for t in config.targets])
        self._models: dict[str, str | None] = {}
        self._session: aiohttp.ClientSession | None = None
        self._health = UpstreamHealth([t.base_url for t in config.targets])
        self._counts = {"started": 0, "finished": 0, "cancelled": 0, "failed": 0}
        self._active = 0
        self._deltas = 0

    def count_tokens(self, text: str) -> int:
        """An estimate (about 4 bytes per token): the upstream's tokenizer is not ours."""
        return math.ceil(len(text.encode("utf-8")) / 4)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.headers_timeout_s)
            self._session = aiohttp.ClientSession(
                timeout=timeout,
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
            )
        return self._session

    async def _model_for(self, target: UpstreamTarget) -> str | None:
        """The configured model, else the first one the upstream lists (asked once)."""
        if self.config.model is not None:
            return self.config.model
        if target.base_url not in self._models:
            model: str | None = None
            try:
                async with asyncio.timeout(self.config.headers_timeout_s):
                    async with self._client().get(
                        f"{target.base_url}/models", headers=self._headers()
                    ) as response:
                        if response.status == 200:
                            listing = await response.json(content_type=None)
                            model = str(listing["data"][0]["id"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
                return None  # not cached: ask again next time; the request goes without one
            self._models[target.base_url] = model
        return self._models[target.base_url]

    async def start(self, request: GenerationRequest) -> UpstreamStream:
        """Send the request upstream and return its stream once the response head arrived.

        Raises:
            UpstreamUnavailable: connection refused or broken, or a bad response (502).
            UpstreamTimeout: no response head within ``headers_timeout_s`` (504).
            UpstreamOverloaded: the upstream answered 429 or 503.
            RequestRejected: the upstream refused the request itself (400).
        """
        target = self.config.targets[self._balancer.pick()]
        url = f"{target.base_url}/chat/completions"
        model = await self._model_for(target)
        data = json.dumps(request_body(request, model)).encode()
        timeout = self.config.headers_timeout_s
        try:
            async with asyncio.timeout(timeout):
                response = await self._client().post(url, data=data, headers=self._headers())
        except TimeoutError:
            raise self._failed(
                UpstreamTimeout(
                    f"the upstream at {target.base_url} did not answer within {timeout:g} s",
                    code="upstream_timeout",
                )
            ) from None
        except aiohttp.ClientError as exc:
            failure = connect_failure(exc, target.base_url, timeout)
            kind = UpstreamTimeout if failure.timed_out else UpstreamUnavailable
            if failure.code in ("upstream_unavailable", "upstream_tls"):
                self._health.saw(target.base_url, failure.message)
            raise self._failed(kind(failure.message, code=failure.code)) from None
        if response.status != 200:
            raise self._failed(await self._refusal(response, target))
        if response.content_type != "text/event-stream":
            response.close()
            raise self._failed(
                UpstreamUnavailable(
                    f"the upstream at {target.base_url} answered "
                    f"{response.content_type or 'no content type'}, not an event stream",
                    code="upstream_bad_response",
                )
            )
        self._health.saw(target.base_url, None)
        self._counts["started"] += 1
        self._active += 1
        return UpstreamStream(
            response,
            stall_s=self.config.stall_s,
            max_event_size=self.config.max_event_size,
            on_end=self._ended,
            logprobs=request.sampling.logprobs is not None,
        )

    def _failed(self, error: EngineError) -> EngineError:
        self._counts["failed"] += 1
        return error

    def _ended(self, outcome: str, deltas: int) -> None:
        self._active -= 1
        self._counts[outcome] += 1
        self._deltas += deltas

    async def _refusal(
        self, response: aiohttp.ClientResponse, target: UpstreamTarget
    ) -> EngineError:
        try:
            async with asyncio.timeout(self.config.headers_timeout_s):
                raw = await response.content.read(BODY_LIMIT)
        except (TimeoutError, aiohttp.ClientError):
            raw = b""
        finally:
            response.close()
        message, code, param = _upstream_message(raw)
        status = response.status
        where = f"the upstream at {target.base_url} answered {status}"
        said = f"{where}: {message}" if message else where
        if status in (400, 413, 422):
            return RequestRejected(said, code=code or "upstream_rejected", param=param)
        if status in (429, 503):
            return UpstreamOverloaded(said, code="upstream_overloaded")
        if status in (401, 403):  # our configuration, not the client's request
            said = f"{where}: it refused our API key (see --upstream-api-key)"
        return UpstreamUnavailable(said, code="upstream_error_status")

    def stats(self) -> EngineStats:
        return EngineStats(
            started=self._counts["started"],
            finished=self._counts["finished"],
            cancelled=self._counts["cancelled"],
            failed=self._counts["failed"],
            active=self._active,
            steps=self._deltas,
        )

    async def readiness(self) -> Readiness:
        """Whether every upstream answers (asked again when the last answer is 5 s old)."""
        return await self._health.readiness(self._client(), self._headers())

    async def aclose(self) -> None:
        """Close the session and with it every upstream connection still open."""
        if self._session is not None:
            await self._session.close()
            self._session = None
