"""The engine seam: what every token source (simulated, built-in model, upstream server) offers.

An engine knows nothing about HTTP. It takes a ``GenerationRequest`` and, once admitted, yields
``Delta`` values as tokens are made. An engine whose requests may wait in a queue of its own
after ``start`` has returned (a scheduler at its ``max_running``) says when each one leaves it
(``QueuedDeltaStream``); any other's requests are at work once ``start`` returns. The consumer
cancels a generation by closing the stream (``aclose()``) or by cancelling the task that
iterates it; an engine must stop making tokens at the next step either way and free what the
request held (a request still queued holds nothing but its place in the queue).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable


class EngineError(Exception):
    """Generation failed. ``code`` is a short machine-readable reason sent to clients.

    ``status`` is the HTTP status a server answers with when this is raised by ``start``
    (before any byte of the reply): 500 here, 502 or 504 for an unreachable upstream.
    ``retry_after_s``, when set, is how long the client should wait before it asks again
    (an engine that cannot take a request now, and knows when it may): a server sends it
    as ``Retry-After``. ``lasting``: the cause is this server's configuration (a key, a URL,
    a CA), which asking again in seconds does not change: a server says so (``X-Should-Retry:
    false``), or clients' SDKs retry it as they would any 5xx, waiting out its
    ``Retry-After`` each time, before their callers see the error.
    """

    status = 500
    lasting = False

    def __init__(
        self,
        message: str,
        *,
        code: str = "generation_failed",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class RequestRejected(EngineError):
    """The engine refused the request before making any token (bad input, no capacity)."""

    status = 400

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",  # a value the engine cannot take, as the schemas say it
        param: str | None = None,
        retry_after_s: float | None = None,
        names_upstream_field: bool = False,
    ):
        super().__init__(message, code=code, retry_after_s=retry_after_s)
        self.param = param
        # ``param`` names a field of the chat request a relay sent its upstream (the
        # upstream's words), not of the ``GenerationRequest``.
        self.names_upstream_field = names_upstream_field


# The most tokens a request may ask for (``max_tokens``, and the counts bounded alike): past
# any context a model here has, and small enough that a typing slip is refused, not planned.
MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token. ``seed=None`` lets the engine choose (``Engine.seed_for``)."""

    max_tokens: int | None = None
    # None: the model's default (1.0 for the built-in engines; a relay's upstream applies its
    # own, such as a model's recommended sampling, only to a request that leaves these out).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    # vLLM's ``min_p``: tokens less likely than this fraction of the likeliest are dropped
    # (0: none).
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Log probabilities of each made token (None: not asked), with this many of the likeliest
    # alternatives at each position (0 to 20).
    logprobs: int | None = None
    # OpenAI's penalties on the tokens the reply has made so far: ``frequency_penalty`` per
    # time a token was made, ``presence_penalty`` once it was; vLLM's and transformers'
    # ``repetition_penalty`` on every token of the prompt and the reply (1: none).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's ``logit_bias``: (token id, bias) pairs, each bias added to that token's logit
    # before any pick (-100 all but bans it, 100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's: the model's end tokens are never picked before ``min_tokens`` tokens were made,
    # nor at all with ``ignore_eos`` (the reply then runs to its token limit).
    min_tokens: int = 0
    ignore_eos: bool = False


class ChoiceGroup:
    """The choices of one request of several (``n > 1``), as ``engine.choices`` starts them
    one after another: every choice's request names the same group, so an engine that must
    admit them together (a relay takes room at its upstreams for all of them before the
    first is sent, or for none) knows which starts belong to one request. Its identity is
    all it is."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked for a reply, as an engine may pass it on: set once, when the request is
    read, so the handler and the engine keep one request between them."""

    request_id: str = ""  # the id the access log names this request by ("" outside HTTP)
    # The caller's own API key (its bearer token, or Anthropic's x-api-key), for a relay
    # configured to pass it on to an upstream; no other engine reads it. Never logged.
    key: str | None = field(default=None, repr=False)
    # The caller's W3C trace context (``traceparent``, and ``tracestate`` with it), checked,
    # as header name and value pairs: a relay passes them on so its upstream's trace joins
    # the caller's. Empty: none given, or none sane.
    trace_context: tuple[tuple[str, str], ...] = ()


NO_CALLER = Caller()


def check_lengths(params: SamplingParams) -> None:
    """Refuse reply lengths that contradict each other, whatever the engine (one that never
    holds an end token back would answer them all the same).

    Raises:
        RequestRejected: naming ``min_tokens``.
    """
    if params.min_tokens < 0:
        raise RequestRejected("min_tokens must be >= 0", param="min_tokens")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise RequestRejected(
            # Worded for every route: the limit is max_tokens, max_completion_tokens or
            # max_output_tokens, as the request's dialect names it.
            f"min_tokens ({params.min_tokens}) must not be more than the reply's token limit "
            f"({params.max_tokens})",
            param="min_tokens",
        )


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One reply to make: the prompt text and how to sample it.

    ``messages`` are the chat messages as the client sent them (validated, else unchanged),
    for an engine that relays them to a chat model; ``prompt`` is always their plain-text
    form, which every other engine reads.
    """

    prompt: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: tuple[Mapping[str, Any], ...] | None = None
    # The tools the client offers, in OpenAI chat's form (``{"type": "function", "function":
    # {...}}``, whatever the route's dialect), and its ``tool_choice`` in that form: relayed
    # to chat upstreams. None: no tools offered.
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    # The form the text must take, in chat's ``response_format`` form (``json_object``, or
    # ``json_schema`` with its schema), whatever the route's dialect: relayed to chat
    # upstreams. None: plain text. Refused by an engine that cannot honour it
    # (``Engine.follows_response_format``).
    response_format: Mapping[str, Any] | None = None
    # The model name the client asked for (None: the server's default); a relay routes by it.
    model: str | None = None
    # The start of the reply, written already (a final assistant message the client asked to
    # continue): the engine writes what follows it, and its deltas hold only that.
    prefix: str = ""
    # Whether the final message (the assistant's, whose text is ``prefix``) is continued
    # rather than closed (vLLM's ``continue_final_message``): a chat template leaves its turn
    # open. True even when that message is empty.
    continue_final_message: bool = False
    # Whether a chat template adds its generation prompt (the opening of the assistant's turn)
    # after the messages; None: the template's usual way (added, unless the final message is
    # continued). An engine that builds no prompt from a template refuses True (there is no
    # generation prompt to add).
    add_generation_prompt: bool | None = None
    # More variables for the chat template (vLLM's ``chat_template_kwargs``, such as Qwen3's
    # ``enable_thinking``), none of the names the template is given anyway. An engine with no
    # chat template refuses them; a relay passes them on. None: none given.
    chat_template_kwargs: Mapping[str, Any] | None = None
    # Whether a relayed reply whose upstream stalls or fails mid-reply may go on at another
    # upstream (None: the server's default). Engines with no upstream have nothing to do.
    continuation: bool | None = None
    # Whether ``prompt`` is to be continued as written, with no chat template around it:
    # OpenAI's legacy completions. A relay sends it to its upstream's ``/completions`` (a
    # base model, a code model's fill-in markup); any other prompt goes up as a chat's user
    # message. The built-in engines continue every bare prompt as written anyway.
    raw_prompt: bool = False
    # Who asked, as an engine may pass it on (an upstream's log and trace, a key passed on).
    caller: Caller = NO_CALLER
    # Whether the reply may hold more than one tool call (chat and Responses'
    # ``parallel_tool_calls``; Anthropic's ``disable_parallel_tool_use`` negated). None: the
    # client did not say (the APIs' default allows several).
    parallel_tool_calls: bool | None = None
    # Whether the client's dialect shows a reasoning model's thinking (``Delta.reasoning``):
    # a relay then passes on what its upstream streams as thinking; otherwise the thinking
    # only tells the relay its upstream is at work. Engines that do not think ignore it.
    reasoning: bool = False
    # Whether the client is told which stop string ended the reply (Anthropic's
    # ``stop_sequence``, the native routes'), not only that one did: an engine must then let
    # the reply pipeline see the stop string whole, for it to name it. A relay sends no stop
    # strings to its upstream (most upstreams cut at one without saying which), and stops
    # the upstream itself when one completes. Engines that make their own tokens ignore it.
    names_stop_sequence: bool = False
    # OpenAI's ``prompt_cache_key``: requests that give the same one share a prompt's start,
    # and a relay routing by prefix keeps them at one upstream (None: not given).
    prompt_cache_key: str | None = None
    # Chat fields only an upstream reads, as the client gave them, sent to a relay's upstream
    # under these names (``reasoning_effort``, ``user``, ``safety_identifier``,
    # ``service_tier``, ``metadata``, ``store``): the upstream decides what it takes. Engines
    # that make their own tokens ignore them. None: none given.
    relayed: Mapping[str, Any] | None = None
    # How many choices the request asks for (``n``), this one of them, each its own generation
    # (``engine.choices``): an engine that runs only so many requests at once refuses a
    # request whose choices could never all run together.
    choices: int = 1
    # The request of several choices this one is a choice of (None: a request of one).
    group: ChoiceGroup | None = field(default=None, compare=False, repr=False)
    # Whether the caller answers before the reply begins (a background response): an engine
    # that waits for room inside ``start`` (a relay at its upstreams' limits) then returns at
    # once, its stream waiting (``QueuedDeltaStream``), and a failure to begin ends the
    # stream instead of ``start``. Engines that never wait in ``start`` ignore it.
    background: bool = False

    @property
    def forces_tool_call(self) -> bool:
        """Whether the client demands a tool call (``"required"`` or a named function), which
        only an engine that makes tool calls can honour (``Engine.makes_tool_calls``)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, Mapping)


class ToolCallDelta(NamedTuple):
    """One piece of a tool call, as chat models stream them (OpenAI's ``tool_calls`` delta).

    The first piece of a call (its ``index``, counted from 0 in the reply) names it: ``id``
    and ``name`` set, ``arguments`` usually empty; later pieces carry only ``arguments``
    fragments, which joined in order are the call's JSON arguments, byte for byte.
    """

    index: int  # type: ignore[assignment]  # OpenAI's name for it; shadows tuple.index
    id: str | None
    name: str | None
    arguments: str


def escaped_bytes(raw: bytes) -> str:
    """``raw`` as Python writes it inside a bytes literal: printable ASCII as itself, other
    bytes escaped (``\\xf0\\x9f``, `` \\xe6\\x9e``, ``\\n``)."""
    return repr(raw)[2:-1]  # the repr without its b'...'


# How a bytes literal's inside escapes a byte: the ones ``repr`` writes.
_ESCAPED = {"n": 10, "r": 13, "t": 9, "\\": 92, "'": 39, '"': 34}


def unescaped_bytes(text: str) -> bytes | None:
    """The bytes ``escaped_bytes`` writes as ``text`` (None: no such spelling)."""
    out = bytearray()
    at = 0
    while at < len(text):
        char = text[at]
        if char != "\\":
            if not " " <= char <= "~":
                return None
            out.append(ord(char))
            at += 1
            continue
        escape = text[at + 1 : at + 2]
        digits = text[at + 2 : at + 4]
        if escape == "x" and len(digits) == 2 and all(c in "0123456789abcdef" for c in digits):
            out.append(int(digits, 16))
            at += 4
        elif escape in _ESCAPED:
            out.append(_ESCAPED[escape])
            at += 2
        else:
            return None
    return bytes(out)


def token_name(raw: bytes) -> str:
    """What log probabilities call a token of these bytes: its text; or, when its bytes are
    not whole UTF-8 characters (part of one), the bytes escaped (``\\xf0\\x9f``), as OpenAI's
    chat completions name such a token. Its text would read U+FFFD, the same for every such
    token, and say nothing of which bytes it holds."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return escaped_bytes(raw)


class TopLogprob(NamedTuple):
    """One candidate token at a position, and its log probability under the model."""

    token: str
    logprob: float
    bytes: bytes


class TokenLogprob(NamedTuple):
    """A made token's log probability under the model (its distribution before temperature
    or top-k/top-p narrowed it), and the likeliest tokens at that position, best first.

    ``token`` is the token's name, ``token_name`` of its bytes for our engines (its text, or
    its bytes escaped when they are not whole UTF-8 characters); a relayed token's is its
    upstream's. ``bytes`` are its exact bytes. A control token (``<|im_start|>``) is named
    and has the bytes of its spelling in the vocabulary, as vLLM and llama.cpp's server name
    it, though it is no part of the reply's text: ``in_text`` is False for it.
    """

    token: str
    logprob: float
    bytes: bytes
    top: tuple[TopLogprob, ...] = ()
    in_text: bool = True


class Delta(NamedTuple):
    """Text made by one engine step.

    Immutable like every value here, but a NamedTuple rather than a frozen dataclass: one is
    made per token, and a frozen dataclass's ``__init__`` costs several times more.

    Attributes:
        text: the new text (may be empty while a multi-byte character is incomplete).
        tokens: how many tokens this delta carries (more than one with speculative decoding).
        made_at: ``time.monotonic()`` when the engine made it.
        finish_reason: set on the last delta: ``"stop"``, ``"length"``, or ``"tool_calls"``
            (the reply ended with tool calls for the client to run).
        logprobs: one entry per token of this delta, when the request asked for them.
        choice: which of a request's several generations made it (``n > 1``; else 0).
        tool_call: a piece of a tool call (then ``text`` is empty), else None.
        prompt_tokens: the prompt's size as the engine itself counted it, on any one delta
            (the built-in engines: their first, the tokens their chat template made; a relay:
            its last, as its upstream reports it); None: the server estimates it.
        cached_prompt_tokens: of ``prompt_tokens``, on the same delta, those the engine
            found in its prefix cache rather than computed (a relay: its upstream's
            ``prompt_tokens_details.cached_tokens``); None: it did not say.
        continued: on an empty marker delta (no text, no tokens), why the reply goes on at
            another upstream from here (a relay's continuation); None otherwise.
        reasoning: a reasoning model's thinking (then ``text`` is empty), made only for a
            request that asked for it (``GenerationRequest.reasoning``); "" otherwise.
        reasoning_tokens: of ``tokens``, on a delta with no ``reasoning`` of its own, those
            that were thinking (a relay's last delta: what its upstream's usage counts as
            thinking beyond the pieces already relayed); 0 otherwise.
        refusal: on an empty marker delta (no text, no tokens), before any text: the text
            from here on is the model's refusal to answer, not its answer (OpenAI's
            ``refusal``, which a relayed upstream streams in place of a reply held to a
            JSON form); False otherwise. One after text or a call (a relay's reply continued
            at an upstream that refuses) is not heeded: that reply's words stay text.
    """

    text: str
    tokens: int = 1
    made_at: float = 0.0
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    choice: int = 0
    tool_call: ToolCallDelta | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    continued: str | None = None
    reasoning: str = ""
    reasoning_tokens: int = 0
    refusal: bool = False


class DeltaStream(Protocol):
    """An async iterator of deltas that can be closed early (an async generator fits)."""

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    def __anext__(self) -> Awaitable[Delta]: ...

    def aclose(self) -> Awaitable[None]: ...


class DeltaSink(Protocol):
    """Where a push-capable stream delivers: called on the event loop, must not block."""

    def on_deltas(self, deltas: Sequence[Delta]) -> None:
        """Deltas that came due together, in order (one, while the stream keeps its
        schedule; several when the loop fell behind, so they can leave in one write)."""
        ...

    def on_end(self, error: EngineError | None) -> None:
        """The stream ended: normally (None) or with a failure."""
        ...


@runtime_checkable
class PushDeltaStream(DeltaStream, Protocol):
    """A delta stream that can also push its deltas to a sink, with no task per stream.

    Serving many replies, a consumer that attaches a sink avoids one task wake-up per token
    per reply, and needs no task of its own. ``attach`` may call the sink before it returns
    (with what is ready already, or the end). After ``attach`` the stream must not be
    iterated; ``close`` stops it at once (``aclose`` too).
    """

    def attach(self, sink: DeltaSink) -> None: ...

    def close(self) -> None:
        """Stop now: the sink is called no more. Safe from inside the sink's own calls."""
        ...


@runtime_checkable
class QueuedDeltaStream(DeltaStream, Protocol):
    """A delta stream whose request may wait in the engine's own queue after ``start`` has
    returned, before the engine does any work on it (its prompt is not read yet)."""

    def when_admitted(self, call: Callable[[], None]) -> None:
        """Call ``call`` once, on the event loop, when the engine takes the request up (now,
        if it has): before the stream's first delta, and never for a request that ends
        while it waits (closed, cancelled, or failed in the queue)."""
        ...


class Admission:
    """When a queued request was admitted, for a ``QueuedDeltaStream`` to tell: ``admit`` is
    called on the event loop (from a worker thread, through ``call_soon_threadsafe``), once
    or more; the call ``when_admitted`` gave runs at the first."""

    __slots__ = ("_call", "admitted")

    def __init__(self) -> None:
        self.admitted = False
        self._call: Callable[[], None] | None = None

    def when_admitted(self, call: Callable[[], None]) -> None:
        if self.admitted:
            call()
        else:
            self._call = call

    def admit(self) -> None:
        if self.admitted:
            return
        self.admitted = True
        call, self._call = self._call, None
        if call is not None:
            call()


# What became of an attempt, as a relay counts it per backend (``BackendStats.attempts``).
ATTEMPT_RESULTS = (
    "ok",  # it relayed the reply (or its part of it) to the end
    "cancelled",  # our client left, or the reply was stopped
    "rejected",  # the upstream refused the request itself (a 400): not its fault
    "connect_error",  # refused, unreachable, TLS, hung up or not HTTP before answering
    "head_timeout",  # no response head within the head timeout
    "overloaded",  # 429 or 503
    "model_not_found",  # a 404: it does not serve the model sent (not counted on its circuit)
    "too_large",  # a 413: the request is larger than it takes (not counted on its circuit)
    "no_route",  # a 404, 405 or 501 to a route beside chat it lacks (not counted on its circuit)
    "error_status",  # any other status
    "ttft_timeout",  # no text within the time-to-first-token limit (a head still awaited too)
    "stalled",  # no text for the stall limit mid-reply
    "stream_error",  # the stream broke or carried an error
)


@dataclass(frozen=True, slots=True)
class BackendStats:
    """One server an engine relays to, as the engine sees it now.

    Attributes:
        name: its base URL.
        circuit: ``closed`` (in use), ``open`` (failing: not used until a cool-down ends) or
            ``half_open`` (one trial request may go).
        probe_ok: whether its last health probe answered (None: not probed yet).
        outstanding: requests it is serving now.
        attempts: requests sent to it so far, by result (one of ``ATTEMPT_RESULTS``).
        probes: health probes so far, by result (``ok``, ``failed``).
        first_text_counts: its time to first text (from the attempt's start, a connect
            included, to the first text read), per attempt that sent text, as a count per
            ``stats.LATENCY_BOUNDS`` bucket, the last one past them all.
        first_text_sum: the sum of those times, seconds.
        max_outstanding: its limit of requests at once (None: it has none).
        slots_taken: requests at once it is sent by the whole server, as its limit counts
            them: this process's outstanding count, or, with the workers of one server
            sharing the limit, the slots every worker holds (None: it has no limit).
        connections: connections opened to it so far (each request on one kept alive adds
            none).
        idle_connections: its kept-alive connections idle now.
    """

    name: str
    circuit: str
    probe_ok: bool | None
    outstanding: int
    attempts: tuple[tuple[str, int], ...] = ()
    probes: tuple[tuple[str, int], ...] = ()
    first_text_counts: tuple[int, ...] = ()
    first_text_sum: float = 0.0
    max_outstanding: int | None = None
    slots_taken: int | None = None
    connections: int = 0
    idle_connections: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters an engine reports as data (for metrics, the lab and tests)."""

    started: int
    finished: int
    cancelled: int
    failed: int
    active: int
    steps: int
    kv_blocks_used: int | None = None  # KV cache blocks held (None: no paged KV cache)
    kv_blocks_total: int | None = None  # the paged KV cache's pool
    running: int | None = None  # of ``active``, in the batch (the rest wait: queued, preempted)
    preemptions: int = 0  # requests that gave their KV blocks back to make room, since start
    recomputed_tokens: int = 0  # cached tokens those preemptions threw away, computed again
    kv_blocks_cached: int = 0  # free KV blocks keeping a prefix for later requests
    prefix_hit_tokens: int = 0  # prompt tokens found in cached blocks, not computed, since start
    # Model names requests may ask for (a relay's upstreams' own, and aliases); empty: the
    # engine answers to one name, the server's.
    models: tuple[str, ...] = ()
    backends: tuple[BackendStats, ...] = ()  # the servers a relay sends requests to
    failovers: int = 0  # replies moved to another backend before their first token
    continuations: int = 0  # replies that went on at another backend mid-reply
    fallbacks: int = 0  # replies that went on to a fallback model
    queued: int = 0  # requests waiting for room at backends at their limit of requests
    spills: int = 0  # requests routed by prefix that went first past their key's own backend


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether an engine can serve requests now; if not, why, in words for an operator."""

    ready: bool
    reason: str = ""
    retry_after_s: float | None = None  # when it may be ready again, if the engine knows


READY = Readiness(True)


class InProcessEngine:
    """What every engine that makes its tokens in this process answers alike: it serves one
    model, under the server's name, and is ready whenever the process is up to answer; and
    it samples every token freely (no grammar holds its text to a JSON form)."""

    __slots__ = ()

    follows_response_format = False

    def model_names(self) -> tuple[str, ...]:
        return ()

    def default_model(self) -> str | None:
        return None

    def passes_unlisted_models(self) -> bool:
        return False

    async def readiness(self) -> Readiness:
        return READY


@dataclass(frozen=True, slots=True)
class Embeddings:
    """An engine's answer to ``POST /v1/embeddings``, as the client gets it: its JSON, and
    the prompt tokens it counted (None: none was reported)."""

    body: bytes
    prompt_tokens: int | None


@runtime_checkable
class Embedder(Protocol):
    """An engine that makes embeddings (a relay: its upstreams do). Every other engine makes
    text alone, and the route says so."""

    async def embed(
        self, fields: dict[str, Any], model: str | None, answer_as: str, caller: Caller
    ) -> Embeddings:
        """``fields`` (the request's, but its model) embedded by ``model`` (None: the
        default), the answer named ``answer_as``.

        Raises:
            RequestRejected: the request is refused (a 4xx).
            EngineError: no embeddings could be made now.
        """
        ...


@runtime_checkable
class Engine(Protocol):
    """A source of tokens."""

    name: str
    # Whether every delta stream ``start`` returns is a ``PushDeltaStream``: the consumer then
    # attaches a sink (no task per stream) instead of iterating.
    pushes: bool
    # Whether a stream ``start`` returns may wait in the engine's own queue before any work on
    # it begins (a relay's: a background request's, ``GenerationRequest.background``): every
    # stream is then a ``QueuedDeltaStream``, which tells when the request is admitted.
    # False: every request is at work once ``start`` returns.
    queues: bool
    # Whether its replies can hold tool calls (``Delta.tool_call``). A request that forces a
    # call (``GenerationRequest.forces_tool_call``) is refused before ``start`` by the server
    # when this is False; ``tool_choice: "auto"`` is served (the engine chose text).
    makes_tool_calls: bool
    # Whether it can hold its text to a JSON form (``GenerationRequest.response_format``); a
    # request that asks for one is refused before ``start`` by the server when this is False.
    follows_response_format: bool

    async def start(self, request: GenerationRequest) -> DeltaStream:
        """Admit a request and return its delta stream.

        Raises:
            RequestRejected: the request is invalid for this engine or cannot be admitted.
            EngineError: the engine failed before the first token (the server answers 500).
        """
        ...

    def seed_for(self, request: GenerationRequest) -> int | None:
        """The seed ``request`` is sampled with: its own, else the engine's for a request that
        gives none (a configured one, or a fresh one on every call: ask once per request).
        None: the engine picks no seed (a relay leaves it to its upstream).

        ``start`` settles its request's seed this way; a request of several choices asks once
        and gives choice ``i`` the seed ``seed + i`` (``engine.choices``).
        """
        ...

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` is for this engine (prompt usage accounting)."""
        ...

    def count_prompt(self, request: GenerationRequest) -> int | None:
        """How many tokens ``request``'s prompt is, as its reply's usage will count it, found
        without starting it: the count the engine's first delta would carry
        (``Delta.prompt_tokens``, its chat template's tokens included), built by the same code
        as ``start`` builds the prompt; for an engine whose deltas carry none, the server's
        ``count_tokens(request.prompt)``. None: only the reply itself can tell (a relay, whose
        upstream counts the prompt as it answers).

        Raises:
            RequestRejected: the request cannot be put in this engine's prompt format.
        """
        ...

    def stats(self) -> EngineStats: ...

    def model_names(self) -> tuple[str, ...]:
        """The model names requests may ask for (``EngineStats.models``), asked on every
        request: answered without gathering the engine's stats. Empty: the engine answers to
        one name, the server's."""
        ...

    def default_model(self) -> str | None:
        """The model a request that names none is sent as when the engine is told one (a
        relay's ``--upstream-model``), listed by ``model_names`` or not (a name no upstream
        serves is not listed, and its requests are refused in words that name the option);
        None: the first of ``model_names``, else the server's name."""
        ...

    def passes_unlisted_models(self) -> bool:
        """Whether a request may name a model ``model_names`` does not list, passed on as
        named (a relay with an upstream whose models are not known: that upstream says whether
        it serves it, as a plain relay would let it); False: any other name is refused."""
        ...

    async def readiness(self) -> Readiness:
        """Whether requests can be served now (``/healthz`` asks). Cheap enough for a health
        check every second: an engine that depends on something remote answers from what it
        learned recently, and asks again only when that is old."""
        ...

    async def aclose(self) -> None:
        """Stop every generation and release the engine's resources."""
        ...
