"""``TinyEngine``: the built-in transformer behind the ``Engine`` protocol.

This file decides what a request means to the tiny model: the prompt is plain text that the
model continues (it was trained on plain prose; an empty prompt starts a new paragraph), how
many tokens a reply may have (``max_tokens``, else ``default_max_tokens``, never past the
context; the default never past what the KV pool holds either), and which requests are
refused before any token (``RequestRejected`` naming the field), and the seed a request that
gives none is sampled with (``seed``, else a fresh one per request: ``engine.seeds``).
Closing a delta stream or cancelling its reader aborts the request at the runner's next step.
It must not know about HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from replystream.engine.base import (
    Admission,
    Delta,
    EngineError,
    EngineStats,
    GenerationRequest,
    InProcessEngine,
    RequestRejected,
)
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import TinyModel
from replystream.engine.prompts import PlainPrompt, PromptFormat
from replystream.engine.runner import DeltaQueue, RequestTimings, Runner
from replystream.engine.sampling import check_logit_bias, check_sampling
from replystream.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from replystream.engine.seeds import settled_seed
from replystream.engine.tiny_config import TinyEngineConfig
from replystream.engine.tokenizer import ByteTokenizer

ASSETS = Path(__file__).parent / "tiny_assets"
EMPTY_PROMPT = "\n\n"


class TinyDeltaStream:
    """A request's deltas; ``request_id`` finds its timings (``TinyEngine.timings``). A
    ``QueuedDeltaStream``: it says when the scheduler first takes the request up (it waits
    while ``max_running`` sequences run, or the KV pool cannot hold it).

    ``aclose`` aborts the request even before the first read (an async generator that never
    started would skip its ``finally``); aborting a finished request does nothing.
    """

    def __init__(
        self,
        request_id: int,
        deltas: AsyncGenerator[Delta],
        runner: Runner,
        admission: Admission,
    ) -> None:
        self.request_id = request_id
        self._deltas = deltas
        self._runner = runner
        self._admission = admission

    def __aiter__(self) -> TinyDeltaStream:
        return self

    def __anext__(self) -> Awaitable[Delta]:
        return self._deltas.__anext__()

    def when_admitted(self, call: Callable[[], None]) -> None:
        self._admission.when_admitted(call)

    def aclose(self) -> Awaitable[None]:
        self._runner.abort(self.request_id)
        return self._deltas.aclose()


class TinyEngine(InProcessEngine):
    """Serves a NumPy transformer with a paged KV cache and continuous batching.

    The tiny model continues plain text; a chat model loaded from a GGUF (``gguf_engine``)
    comes with its own ``prompts`` (its chat template) and ``stop_tokens`` (its EOS), which
    end a reply with ``finish_reason="stop"``.
    """

    pushes = False
    queues = True  # a request waits for the scheduler (``max_running``, the KV pool)
    makes_tool_calls = False

    def __init__(
        self,
        model: TinyModel,
        tokenizer: ByteTokenizer,
        config: TinyEngineConfig | None = None,
        *,
        prompts: PromptFormat | None = None,
        stop_tokens: frozenset[int] = frozenset(),
        name: str = "tiny",
    ) -> None:
        self.config = cfg = config or TinyEngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.prompts = prompts or PlainPrompt(tokenizer, EMPTY_PROMPT)
        c = model.config
        cache = PagedKVCache(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            cfg.num_blocks,
            cfg.block_size,
            prefix_caching=cfg.prefix_caching,
        )
        scheduler = Scheduler(
            cache.allocator,
            SchedulerConfig(cfg.token_budget, cfg.max_running, cfg.spec_tokens, cfg.spec_ngram),
        )
        self.runner = Runner(
            model,
            tokenizer,
            cache,
            scheduler,
            blas_threads=cfg.blas_threads,
            stop_tokens=stop_tokens,
        )

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def count_prompt(self, request: GenerationRequest) -> int:
        return len(self.prompts.prompt_ids(request))  # what ``start`` feeds the model

    def seed_for(self, request: GenerationRequest) -> int:
        return settled_seed(request.sampling.seed, self.config.seed)

    async def start(self, request: GenerationRequest) -> TinyDeltaStream:
        check_sampling(request.sampling)
        check_logit_bias(request.sampling, self.model.config.vocab_size)
        prompt = self.prompts.prompt_ids(request)
        context = self.model.config.context
        if len(prompt) >= context:
            raise RequestRejected(
                f"the prompt is {len(prompt)} tokens; the context holds {context}, "
                f"so a prompt may have at most {context - 1}",
                code="context_length_exceeded",
                param="prompt",
            )
        fits = self.runner.scheduler.most_new_tokens(len(prompt))
        if fits < 1:
            raise RequestRejected(
                f"the prompt is {len(prompt)} tokens; the KV cache holds "
                f"{self.config.num_blocks * self.config.block_size}",
                code="context_length_exceeded",
                param="prompt",
            )
        asked = request.sampling.max_tokens
        # The default length is capped by the pool as by the context (the client asked for
        # no length); a length the client asked for that the pool cannot hold is refused.
        max_new = min(asked or self.config.default_max_tokens, context - len(prompt))
        if asked is None:
            max_new = min(max_new, fits)
        elif max_new > fits:
            # The prompt and the reply together overflow what the engine holds: OpenAI's
            # code for a context they overflow (the token limit is the field to lower).
            raise RequestRejected(
                f"the reply would need more KV blocks than the engine has: after this prompt "
                f"of {len(prompt)} tokens, the reply's token limit may be at most {fits}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        # Settled here, once: the runner keeps the one generator through any preemption.
        sampling = replace(request.sampling, seed=self.seed_for(request))
        admission = Admission()
        request_id, queue = self.runner.submit(prompt, max_new, sampling, admission.admit)
        self.runner.start()
        deltas = self._deltas(request_id, queue)
        return TinyDeltaStream(request_id, deltas, self.runner, admission)

    async def _deltas(self, request_id: int, queue: DeltaQueue) -> AsyncGenerator[Delta]:
        done = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, EngineError):
                    done = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:  # closed early or the reader was cancelled
                self.runner.abort(request_id)

    def timings(self, request_id: int) -> RequestTimings | None:
        """Timestamps of one request: queued, scheduled, each token, preemptions, finished."""
        return self.runner.timings(request_id)

    def scheduler_stats(self) -> SchedulerStats:
        """Queue, step and KV-pool state (blocks used and free, bytes wasted)."""
        return self.runner.scheduler_stats()

    def stats(self) -> EngineStats:
        return self.runner.stats()

    async def aclose(self) -> None:
        """Cancel every request and stop the worker thread (waits for at most one step)."""
        await asyncio.to_thread(self.runner.stop)


def load_default_engine(config: TinyEngineConfig | None = None) -> TinyEngine:
    """The engine with the weights and tokenizer shipped in the package."""
    return TinyEngine(TinyModel.load(ASSETS), ByteTokenizer(ASSETS / "tokenizer.json"), config)
