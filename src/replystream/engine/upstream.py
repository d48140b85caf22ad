"""``UpstreamEngine``: OpenAI-compatible model servers (vLLM, TGI, llama.cpp, Ollama) relayed.

This file decides how a ``GenerationRequest`` is sent upstream: to which path, with which model
name and headers (its body is ``upstream_request``'s: the client's chat messages, or a legacy
completion's prompt, with ``stream_options.include_usage`` always, so usage is the upstream's
own); and how a connection that fails before a response head ends the attempt
(``UpstreamUnavailable``, 502, or ``UpstreamTimeout``, 504, past ``headers_timeout_s``); what
an upstream's answer other than a stream means is ``upstream_refusals``'s. Which upstream
serves a request and which are failing is ``upstream_pool``'s (with ``serve --workers``, each
limit of requests at once is held by all the workers together: ``upstream_slots``,
``upstream_shared_limits``); failover, stalls and continuation are ``upstream_relay``'s (the
next attempt's upstream, ``upstream_attempts``'s); active health probes are
``upstream_health``'s; everything after one response head is
``upstream_stream.UpstreamStream``'s (what each chunk means, ``upstream_chunks``'s); an
embeddings request is ``upstream_embeddings``'s. What goes upstream as ``Authorization`` is
configured per upstream: its own key, or the caller's own key passed on (``pass_client_key``,
for an upstream where each client has an account), else the key for all; a client's key is
never sent to an upstream not configured to take it. It must not know about our HTTP server.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic_core import to_json

from replystream import stalls
from replystream.engine.base import (
    READY,
    Caller,
    ChoiceGroup,
    Embeddings,
    EngineError,
    EngineStats,
    GenerationRequest,
    Readiness,
    RequestRejected,
)
from replystream.engine.upstream_admission import ChoiceRoom
from replystream.engine.upstream_affinity import affinity_key
from replystream.engine.upstream_attempts import named
from replystream.engine.upstream_config import (
    UpstreamConfig,
    UpstreamKeys,
    UpstreamTarget,
    key_problem,
    upstream_limit,
)
from replystream.engine.upstream_embeddings import EmbeddingsRelay
from replystream.engine.upstream_errors import OWN_SHORTAGE, connect_failure
from replystream.engine.upstream_health import HealthProber
from replystream.engine.upstream_http import HttpOrigin
from replystream.engine.upstream_http_connection import Response
from replystream.engine.upstream_http_failures import HttpFailure
from replystream.engine.upstream_pool import Backend, BreakerConfig, UpstreamPool
from replystream.engine.upstream_proxy import proxy_handshake_s
from replystream.engine.upstream_queue import RoomQueue
from replystream.engine.upstream_refusals import (
    CHAT_PATH,
    OutOfResources,
    OwnFieldRefused,
    UpstreamMisconfigured,
    UpstreamRefusedClientKey,
    UpstreamTimeout,
    UpstreamUnavailable,
    refusal,
)
from replystream.engine.upstream_relay import RelayedReply
from replystream.engine.upstream_relay_types import (
    FirstContentLate,
    ModelUnserved,
    RelayCounts,
    RelayLimits,
)
from replystream.engine.upstream_request import request_body
from replystream.engine.upstream_shared_limits import OtherWorkers, backend_stats, open_slots
from replystream.engine.upstream_slots import SharedLimits
from replystream.engine.upstream_stream import UpstreamStream

log = logging.getLogger("replystream.upstream")
# Models remembered per upstream as taking a token limit only as max_completion_tokens.
COMPLETION_LIMIT_MODELS = 1024


def _backend(target: UpstreamTarget, config: UpstreamConfig) -> Backend:
    return Backend(
        target.base_url,
        target.weight,
        tuple(target.models),
        fixed_models=bool(target.models),
        max_outstanding=upstream_limit(target, config),
        ttft_s=target.ttft_s,
        stall_s=target.stall_s,
    )


@dataclass(frozen=True, slots=True)
class RouteChange:
    """What a ``reroute`` changed: the upstreams that joined and left, and how many of each
    there are now."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    upstreams: int
    aliases: int
    fallbacks: int  # models given fallbacks


class UpstreamEngine:
    """Relays OpenAI-compatible streaming servers: requests over the relay's own HTTP client
    (``upstream_http``, a keep-alive pool per upstream), and health probes over the same
    client, on connections of their own (``upstream_health``)."""

    name = "upstream"
    # A reply is a RelayedReply over its attempts: attached, it attaches itself to each
    # attempt's UpstreamStream, so the connection's reads push deltas (no task per reply).
    pushes = True
    # Its streams say when the request took room at an upstream (``when_admitted``): a
    # background request's waits for it after ``start`` returns, any other's inside ``start``.
    queues = True
    makes_tool_calls = True  # the upstream's calls are relayed (it refuses what it cannot do)
    follows_response_format = True  # relayed likewise: the upstream's grammar holds the text

    def __init__(self, config: UpstreamConfig, shared_limits: Path | None = None) -> None:
        """``shared_limits``: the folder where the workers of one server hold the upstreams'
        limits of requests at once together (``upstream_slots``); None: this process counts
        its own requests alone."""
        self.config = config
        self._keys = UpstreamKeys.of(config)
        self.pool = UpstreamPool(
            [_backend(t, config) for t in config.targets],
            BreakerConfig(config.failures, config.cooldown_s),
            time.monotonic,
            dict(config.aliases),
            dict(config.fallbacks),
        )
        self._limits = RelayLimits(config.ttft_s, config.stall_s, config.failover_s, config.queue_s)
        self._relay_counts = RelayCounts()
        self._shared = None if shared_limits is None else SharedLimits(shared_limits)
        # Requests waiting for room at upstreams at their limit (with shared limits, it also
        # looks for slots the other workers gave back).
        others = None
        if self._shared is not None:
            others = OtherWorkers(self.pool, self._shared, lambda: len(self._queue))
        self._queue = RoomQueue(others)
        # The choices of each request of several while they start (``upstream_admission``).
        self._choice_rooms: dict[ChoiceGroup, ChoiceRoom] = {}
        self._origins: dict[str, HttpOrigin] = {}  # relayed requests, per upstream
        # Those of upstreams taken out of the routes, while replies under way still use them.
        self._retired: list[HttpOrigin] = []
        # Upstreams a reload took out, by name, kept whole: the replies still running there
        # end against them, and one put back is the same upstream (its requests at once, its
        # circuit, and its counts, which count on as a counter must), not a fresh one that
        # would let its limit be passed.
        self._departed: dict[str, Backend] = {}
        self._rerouting = asyncio.Lock()
        self._prober = HealthProber(
            self.pool,
            keys=self._keys,
            interval_s=config.health_s,
            path=config.health_path,
            keepalive_s=config.keepalive_s,
            after_round=self._note_default,
        )
        # Whether ``--upstream-model`` is known to be served by no upstream, and said so
        # (None: no round of probes yet). Start-up says it with the server's readiness.
        self._default_unserved: bool | None = None
        self._counts = {"started": 0, "finished": 0, "cancelled": 0, "failed": 0}
        self._deltas = 0
        for name, proxy in self._keys.proxies.items():
            log.info("the upstream at %s is reached through the proxy at %s", name, proxy.shown)

    def count_tokens(self, text: str) -> int:
        """An estimate (about 4 bytes per token), for when the upstream reports no usage."""
        return math.ceil(len(text.encode("utf-8")) / 4)

    def count_prompt(self, request: GenerationRequest) -> None:
        """None: the upstream counts a prompt only as it answers it (an OpenAI-compatible
        server has no count of its own to ask for), and an estimate is no count."""
        return None

    def seed_for(self, request: GenerationRequest) -> int | None:
        """The client's seed, passed on; none when it gave none (the upstream draws its own,
        one per choice of a request of several)."""
        return request.sampling.seed

    def _headers(
        self, backend: Backend, client_key: str | None, accept: str = "text/event-stream"
    ) -> dict[str, str]:
        return self._keys.headers(backend.name, client_key, accept)

    def _model_for(self, backend: Backend, request: GenerationRequest) -> str | None:
        """The model name sent: the one asked for (an alias resolved), else the configured
        one, else the first one the upstream lists (None while it is not known)."""
        asked = self.pool.resolve(request.model)
        if asked is not None and (asked in backend.models or not backend.models):
            return asked
        if self.config.model is not None:
            return self.config.model
        return backend.models[0] if backend.models else None

    async def start(self, request: GenerationRequest) -> RelayedReply:
        """Send the request upstream (another upstream if one fails before it answers) and
        return the reply once a response head arrived.

        Raises:
            UpstreamUnavailable: connection refused or broken, or a bad response (502).
            UpstreamTimeout: no response head within ``headers_timeout_s`` (504).
            RelayStalled: no response head within the attempt's time to its first content,
                when that is shorter (504, ``upstream_ttft_timeout``).
            UpstreamOverloaded: the upstream answered 429 or 503 (with when some upstream
                may take a request: ``retry_after_s``).
            RequestRejected: the upstream refused the request itself (400), or, passed the
                caller's own key, refused or rate-limited it (401, 403, 429).
            NoUpstream: no upstream serving the model can take a request now (503, with
                ``retry_after_s``).
            ModelUnserved: every upstream lists its models, and none lists the model the
                request would be sent as (404).
            RequestRejected: the request asks for more choices than the upstreams serving
                its model take requests at once (each choice is a request of its own).
        """
        choices = self._choice_room(request)
        try:
            return await self._start(request, choices)
        except BaseException:
            if request.group is not None:  # no choice of its request starts after this one
                self._choice_rooms.pop(request.group, None)
            if choices is not None:  # what was taken for those goes back
                choices.give_back(self._queue)
            raise

    async def _start(self, request: GenerationRequest, choices: ChoiceRoom | None) -> RelayedReply:
        await self._prober.first_round()
        if request.model is None and self.config.model is not None:
            # Sent as --upstream-model, so routed as it: only to upstreams that serve it.
            request = replace(request, model=self.config.model)
        problem = self._unserved(request.model)
        if problem is not None:
            raise ModelUnserved(problem, code="model_not_found", param="model")
        self._refuse_more_choices_than_room(request)
        continuation = request.continuation
        if request.add_generation_prompt is False and not request.continue_final_message:
            # The reply follows the rendered conversation with no assistant turn opened, so its
            # text so far is no assistant message, the only form a continuation can send it in.
            continuation = False
        if request.response_format is not None:
            # Sent on as an assistant's start, the text so far would not be in the grammar's
            # reach: the next upstream would hold only what follows it to the schema, from
            # the schema's start.
            continuation = False
        reply = RelayedReply(
            request,
            pool=self.pool,
            opener=self.open_attempt,
            limits=self._limits,
            continuation=self.config.continuation if continuation is None else continuation,
            counts=self._relay_counts,
            queue=self._queue,
            shared=self._shared,
            affinity=affinity_key(request) if self.config.routing == "prefix" else None,
            choices=choices,
        )
        if request.background and choices is None:
            # Its caller answers before the reply begins: the reply waits for room and opens
            # its first attempt once attached, and a failure to is its end, not a refusal.
            return reply
        try:
            await reply.open()
        except EngineError:
            self._counts["failed"] += 1
            raise
        if choices is not None:
            choices.sent += 1
        return reply

    def _choice_room(self, request: GenerationRequest) -> ChoiceRoom | None:
        """The room taken for the choices of ``request``'s request not started yet, as this
        one starts: the first takes it for them all (None: a request of one choice)."""
        group = request.group
        if group is None:
            return None
        choices = self._choice_rooms.get(group)
        if choices is None:
            choices = self._choice_rooms[group] = ChoiceRoom(request.choices)
        choices.unstarted -= 1
        if not choices.unstarted:  # the last: the others know it from here
            del self._choice_rooms[group]
        return choices

    def _may_serve(self, model: str | None, *, or_fallback: bool = True) -> bool:
        """Whether some upstream may serve ``model`` (lists it, or lists nothing known), or
        (``or_fallback``: a reply's request, which goes on to them) one of its fallbacks."""
        real = self.pool.resolve(model)
        return bool(self.pool.serving(real)) or (
            or_fallback and self.pool.reached_by_fallback(real)
        )

    def _unserved(self, model: str | None, *, or_fallback: bool = True) -> str | None:
        """What is wrong when no upstream serves ``model`` (each lists its models, and none
        lists it), naming what they do list and, for ``--upstream-model``, that it is the
        option's; None while some upstream may serve it, or (``or_fallback``: a reply's
        request, which goes on to them) one of its fallbacks."""
        if self._may_serve(model, or_fallback=or_fallback):
            return None
        named = f"the model {model!r}"
        if model == self.config.model:
            named += " (--upstream-model, what a request that names no model is sent as)"
        listed = ", ".join(repr(name) for name in self.pool.model_names())
        return f"no upstream serves {named}: they serve {listed}"

    def _refuse_more_choices_than_room(self, request: GenerationRequest) -> None:
        """Each choice of a request is a request upstream, and a request's choices get room
        all at once (``upstream_admission``): more choices than the upstreams take at once
        never would, and would wait until the wait for room is over (a 503 that says to
        retry what can never be served), so such a request is refused at once; unless one of
        its model's fallbacks takes them all (they go on to it together)."""
        model = self.pool.resolve(request.model)
        fallbacks = () if model is None else self.pool.fallbacks.get(model, ())
        mosts = [self.pool.most_at_once(m) for m in (model, *fallbacks)]
        limited = [m for m in mosts if m is not None]
        if len(limited) < len(mosts) or request.choices <= max(limited):
            return  # some model's upstreams have no limit, or take them all
        most = max(limited)
        serving = "the upstreams" if model is None else f"the upstreams serving {model!r}"
        if fallbacks:
            serving += f" (or any of its fallbacks: {', '.join(map(repr, fallbacks))})"
        raise RequestRejected(
            f"n is {request.choices}, and each choice is a request of its own to an upstream, "
            f"but {serving} take at most {most} at once (their limits of requests at once): "
            f"n can be at most {most}",
            param="n",
        )

    def _origin(self, backend: Backend) -> HttpOrigin:
        origin = self._origins.get(backend.name)
        if origin is None:
            tls = self._keys.tls.get(backend.name)
            proxy = self._keys.proxies.get(backend.name)
            # One taken out of the routes and put back gets a new origin, with its new
            # Backend (which took over its counts).
            origin = HttpOrigin(
                backend.name,
                keepalive_s=self.config.keepalive_s,
                tls=tls,
                proxy=proxy,
                proxy_handshake_s=proxy_handshake_s(self.config.headers_timeout_s),
                on_connect=backend.connected,
            )
            self._origins[backend.name] = origin
        return origin

    def _heed(
        self,
        backend: Backend,
        request: GenerationRequest,
        model: str | None,
        refused: OwnFieldRefused,
    ) -> bool:
        """Write the field ``refused`` (as the relay wrote it) as ``backend`` asks, from now
        on; whether ``request``, which it refused, is then written otherwise (else that
        refusal stands: the field was already written so, or the request has none such)."""
        if refused.field == "content":
            nulls = any(m.get("content", "") is None for m in request.messages or ())
            if not backend.takes_null_content or request.raw_prompt or not nulls:
                return False
            backend.takes_null_content = False
            then = "an assistant message's null content goes to it as an empty string from now on"
        elif refused.field == "stream_options":
            if not backend.takes_stream_options:
                return False
            backend.takes_stream_options = False
            then = "it is sent no stream_options from now on, and the usage of its replies is "
            then += "counted by this relay"
        else:
            limits = backend.completion_limit_models
            if model in limits:
                return False
            while len(limits) >= COMPLETION_LIMIT_MODELS:
                del limits[next(iter(limits))]
            limits[model] = None
            # A client's name, passed on as named, may hold a line break, or be very long.
            which = f"for {named(model)}" if model is not None else "when no model is named"
            then = f"a token limit goes to it as max_completion_tokens {which} from now on"
        # Both are fields as the relay writes them, not the client's: its request stands.
        log.warning("%s: %s", refused, then)
        return True

    async def _post(
        self,
        backend: Backend,
        path: str,
        body: bytes,
        caller: Caller,
        within_s: float,
        accept: str = "text/event-stream",
    ) -> Response:
        """``POST {backend}{path}`` with ``body`` as ``caller`` is to be seen there (the
        caller's key when it is passed on, its request id and trace context), asking for
        ``accept``; the response once its head came.

        Raises:
            TimeoutError: no head within ``within_s`` seconds (the caller words it).
            UpstreamUnavailable: the connection failed before the head.
            OutOfResources: this process had no file descriptor (or memory) for it.
            UpstreamRefusedClientKey: the caller's key, to be passed on, fits no HTTP header.
        """
        key = caller.key
        if key and backend.name in self._keys.passing and key_problem(key) is not None:
            # No HTTP header can carry it: the caller's to fix, not the upstream's failure
            # (counted on its circuit, a client's bad key would take it out for everyone).
            raise UpstreamRefusedClientKey(
                f"the API key you sent cannot be passed on to the upstream at {backend.name}: "
                "an HTTP header carries printable ASCII characters only",
                status=401,
            )
        try:
            # Back from a stall of this process (stopped, frozen), a head that came
            # meanwhile is read before the wait is judged too long.
            async with stalls.timeout(within_s):
                headers = self._headers(backend, key, accept)
                if caller.request_id:  # our access log's name for it, in the upstream's log
                    headers["X-Request-Id"] = caller.request_id
                headers.update(caller.trace_context)
                return await self._origin(backend).post(path, body, headers)
        except TimeoutError:
            raise
        except (HttpFailure, OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            shows = backend.name in self._keys.certified
            failure = connect_failure(exc, backend.name, shows_certificate=shows)
            if failure.code == OWN_SHORTAGE:
                raise OutOfResources(failure.message, code=failure.code) from None
            failed = UpstreamMisconfigured if failure.lasting else UpstreamUnavailable
            raise failed(failure.message, code=failure.code) from None

    @staticmethod
    def _timed_out(backend: Backend, timeout: float) -> UpstreamTimeout:
        return UpstreamTimeout(
            f"the upstream at {backend.name} did not answer within {timeout:.3g} s",
            code="upstream_timeout",
        )

    async def open_attempt(
        self, backend: Backend, request: GenerationRequest, within_s: float | None = None
    ) -> UpstreamStream:
        """One attempt: the request to ``backend``, its stream once the head arrived (what a
        relayed reply is made of; no failover here). The head is awaited for the head
        timeout, or ``within_s`` if that is shorter (a relay's time to the attempt's first
        content, within what its failover window has left: ``FirstContentLate`` when it
        passes).
        """
        key = request.caller.key
        model = self._model_for(backend, request)
        path = "/completions" if request.raw_prompt else CHAT_PATH
        # (A legacy completion's limit has the one name.)
        limited_so = model in backend.completion_limit_models and not request.raw_prompt
        limit_field = "max_completion_tokens" if limited_so else "max_tokens"
        body = request_body(
            request,
            model,
            ask_usage=backend.takes_stream_options,
            limit_field=limit_field,
            null_content=backend.takes_null_content,
        )
        timeout = self.config.headers_timeout_s
        first_content_due = within_s is not None and within_s < timeout
        if within_s is not None:
            timeout = min(timeout, within_s)
        sent_at = time.monotonic()
        try:
            response = await self._post(backend, path, to_json(body), request.caller, timeout)
        except TimeoutError:
            if first_content_due:  # the relay's limit fired, not the head's: it says which
                raise FirstContentLate from None
            raise self._timed_out(backend, timeout) from None
        if response.status != 200:
            # Its body is quoted if it comes while the failover window is open: one sent
            # slowly must not hold the request past it.
            read_s = self.config.headers_timeout_s
            if within_s is not None:
                read_s = min(read_s, max(0.0, within_s - (time.monotonic() - sent_at)))
            refused = await self._refusal(response, backend, key, path, read_s)
            if isinstance(refused, OwnFieldRefused) and self._heed(
                backend, request, model, refused
            ):
                left = within_s
                if left is not None:
                    left = max(0.0, left - (time.monotonic() - sent_at))
                return await self.open_attempt(backend, request, left)
            raise refused
        if response.content_type != "text/event-stream":
            response.close()
            raise UpstreamUnavailable(
                f"the upstream at {backend.name} answered "
                f"{response.content_type or 'no content type'}, not an event stream",
                code="upstream_bad_response",
            )
        encoding = response.content_encoding
        if encoding:
            response.close()
            # Named when it is a coding's name (gzip, br, zstd), not whatever the header held.
            named = f"{encoding}-" if encoding.isascii() and encoding.isalnum() else ""
            raise UpstreamUnavailable(
                f"the upstream at {backend.name} answered a {named}compressed stream, "
                "though asked for none",
                code="upstream_bad_response",
            )
        self._counts["started"] += 1
        return UpstreamStream(
            response,
            name=backend.name,
            withheld=self._keys.withheld(backend.name, key),
            max_event_size=self.config.max_event_size,
            on_end=self._ended,
            logprobs=request.sampling.logprobs is not None,
            reasoning=request.reasoning,
        )

    async def embed(
        self, fields: dict[str, Any], model: str | None, answer_as: str, caller: Caller
    ) -> Embeddings:
        """``POST /v1/embeddings``'s ``fields`` (but its model) relayed
        (``upstream_embeddings``): sent as ``model`` (an alias resolved; None: as
        ``--upstream-model``, else to any upstream, as it serves it), the answer named
        ``answer_as``.

        Raises:
            ModelUnserved: every upstream lists its models, and none lists that one (404).
            RequestRejected: an upstream refused the request itself (a 4xx).
            EngineError: no upstream could answer (the last failure, or a 503 that says when
                one may).
        """
        await self._prober.first_round()
        if model is None:
            model = self.config.model
        problem = self._unserved(model, or_fallback=False)  # (another model's vectors: no)
        if problem is not None:
            raise ModelUnserved(problem, code="model_not_found", param="model")
        relay = EmbeddingsRelay(
            pool=self.pool,
            shared=self._shared,
            queue=self._queue,
            limits=self._limits,
            headers_timeout_s=self.config.headers_timeout_s,
            post=self._post_embeddings,
            refusal=self._embeddings_refusal,
        )
        return await relay.relay(fields, self.pool.resolve(model), answer_as, caller)

    async def _post_embeddings(
        self, backend: Backend, body: bytes, caller: Caller, within_s: float
    ) -> Response:
        try:
            return await self._post(
                backend, "/embeddings", body, caller, within_s, "application/json"
            )
        except TimeoutError:
            raise self._timed_out(backend, within_s) from None

    async def _embeddings_refusal(
        self, response: Response, backend: Backend, caller: Caller
    ) -> EngineError:
        return await self._refusal(
            response, backend, caller.key, "/embeddings", self.config.headers_timeout_s
        )

    async def _refusal(
        self, response: Response, backend: Backend, key: str | None, path: str, read_s: float
    ) -> EngineError:
        """What ``backend``'s answer other than 200 to ``POST {path}`` means
        (``upstream_refusals.refusal``), as sent with the caller's ``key``."""
        return await refusal(
            response,
            backend.name,
            key,
            passes_key=backend.name in self._keys.passing,
            key_from=self._keys.key_from(backend.name),
            withheld=self._keys.withheld(backend.name, key),
            read_s=read_s,
            cooldown_s=self.config.cooldown_s,
            path=path,
        )

    def _ended(self, outcome: str, deltas: int) -> None:
        self._counts[outcome] += 1
        self._deltas += deltas

    def model_names(self) -> tuple[str, ...]:
        """The upstreams' models, the default first: ``--upstream-model`` when given, what
        a request for no model is sent as; but not while no upstream may serve it (every
        one lists its models, and none lists it: a typo, said in the log and by
        ``readiness``), since a request for it is refused (``default_model`` still sends
        a request for no model there, to be refused in words that name the option)."""
        names, default = self.pool.model_names(), self.config.model
        if default is None or names[:1] == (default,):
            return names
        if default not in names and not self._may_serve(default):
            return names
        return (default, *(n for n in names if n != default))

    def default_model(self) -> str | None:
        return self.config.model

    def _note_default(self) -> None:
        """After each round of probes: when ``--upstream-model`` has come to be a model no
        upstream serves since the round before (their lists learned only after start-up,
        say, whose readiness said so of the first round), say so once in the log, naming the
        option, until it is served again."""
        model = self.config.model
        if model is None:
            return
        unserved = self._unserved(model)
        if unserved is not None and self._default_unserved is False:
            log.warning("%s; /healthz answers 503", unserved)
        self._default_unserved = unserved is not None

    def passes_unlisted_models(self) -> bool:
        """While some upstream's models are not known (its ``/models`` does not list them,
        nor does the routes file), a model named is sent there as named: it is the judge."""
        return any(not backend.models for backend in self.pool.backends)

    def _idle(self, name: str) -> int:
        origin = self._origins.get(name)
        return 0 if origin is None else origin.idle

    def stats(self) -> EngineStats:
        now = self.pool.clock()
        return EngineStats(
            started=self._counts["started"],
            finished=self._counts["finished"],
            cancelled=self._counts["cancelled"],
            failed=self._counts["failed"] + self._relay_counts.unopened,
            # Queued or running: attempts sent to an upstream (its head awaited or its stream
            # open), and requests waiting for room at one.
            active=sum(b.outstanding for b in self.pool.backends) + len(self._queue),
            steps=self._deltas,
            models=self.model_names(),
            backends=tuple(
                replace(backend_stats(self._shared, b, now), idle_connections=self._idle(b.name))
                for b in self.pool.backends
            ),
            failovers=self._relay_counts.failovers,
            continuations=self._relay_counts.continuations,
            fallbacks=self._relay_counts.fallbacks,
            queued=len(self._queue),
            spills=self._relay_counts.spills,
        )

    async def reroute(self, config: UpstreamConfig) -> RouteChange:
        """Serve ``config``'s upstreams, aliases and fallbacks from now on (a routes file
        read again; the rest of ``config`` is the command line's, as before). An upstream
        that stays keeps its circuit, counts and connections, with its weight, key and models
        as now given; a new one is probed before it joins, and one whose models are no
        longer given is asked for its list again. One taken out gets no new request; the
        replies under way there go on to their end (and with the fallbacks they began with)."""
        async with self._rerouting:  # two reloads at once: one after the other
            before = {b.name: b for b in self.pool.backends}
            backends = [
                before.get(t.base_url) or self._departed.get(t.base_url) or _backend(t, config)
                for t in config.targets
            ]
            joining = [b for b in backends if b.name not in before]
            # A staying upstream whose models are no longer given: its list is asked for by
            # a stand-in, so nothing routed changes before the swap.
            relisted = {
                t.base_url: _backend(t, config)
                for t in config.targets
                if not t.models and t.base_url in before and before[t.base_url].fixed_models
            }
            keys = UpstreamKeys.of(config)
            if joining or relisted:  # with the keys they will be sent
                await self._prober.probe([*joining, *relisted.values()], keys=keys)
            # The swap: no await from here on.
            for target, backend in zip(config.targets, backends, strict=True):
                backend.weight = target.weight
                backend.max_outstanding = upstream_limit(target, config)
                backend.ttft_s, backend.stall_s = target.ttft_s, target.stall_s
                if target.models:
                    backend.models, backend.fixed_models = tuple(target.models), True
                elif target.base_url in relisted:
                    backend.models, backend.fixed_models = relisted[target.base_url].models, False
            self.config, self._keys, self._prober.keys = config, keys, keys
            for name, staying in self._origins.items():  # its files, as read again
                staying.tls = keys.tls.get(name)
            self.pool.backends = backends
            self.pool.aliases = dict(config.aliases)
            self.pool.fallbacks = dict(config.fallbacks)
            # New aliases may stand in front of models the upstreams already list.
            self._prober.note_shadowed(backends)
            if self._shared is not None:
                open_slots(self._shared, backends)
            self._queue.wake_all()  # room may be elsewhere now, or more of it
            kept = {b.name for b in backends}
            removed = tuple(name for name in before if name not in kept)
            for backend in joining:
                self._departed.pop(backend.name, None)
            for name in removed:
                self._departed[name] = before[name]
                if self._shared is not None:
                    self._shared.forget(name)
                origin = self._origins.pop(name, None)
                if origin is not None:
                    origin.retire()
                    self._retired.append(origin)
            self._retired = [o for o in self._retired if o.in_use]
            return RouteChange(
                added=tuple(b.name for b in joining),
                removed=removed,
                upstreams=len(backends),
                aliases=len(config.aliases),
                fallbacks=len(config.fallbacks),
            )

    async def readiness(self) -> Readiness:
        """Ready while at least one upstream is: its circuit not open, its last probe
        answered (probed in the background every ``health_s``), and, with ``--upstream-model``,
        some upstream may serve that model (a mistyped one is said at start-up, not found out
        by each request). Not ready, it says when the first circuit lets a request through,
        or, when every probe failed or lists no such model, the next probe."""
        await self._prober.first_round()
        unserved = None if self.config.model is None else self._unserved(self.config.model)
        if unserved is not None:
            return Readiness(False, unserved, self.config.health_s)
        ready, reason, wait_s = self.pool.ready()
        if ready:
            return READY
        return Readiness(False, reason, self.config.health_s if wait_s is None else wait_s)

    async def aclose(self) -> None:
        """Stop probing; close every upstream connection still open."""
        await self._prober.aclose()
        if self._shared is not None:
            self._shared.close()
        for origin in (*self._origins.values(), *self._retired):
            origin.close()
        self._origins.clear()
        self._retired.clear()
