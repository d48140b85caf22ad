"""``HFEngine``: a local Hugging Face causal LM, served through ``transformers`` and PyTorch.

This file decides how a model folder on disk (``config.json``, weights, a tokenizer; nothing
is downloaded) makes a reply: the prompt (or the chat messages, through the tokenizer's chat
template when it has one, the template's markup with its control tokens and the messages' text
as plain text: ``HFChatPrompt``) is encoded, then one forward pass per token with the model's own KV
cache, each token picked by ``sampling.sample_token`` (the same greedy / temperature / top-k /
top-p / seeded draws as the tiny engine, a request without a seed taking the configured one
or a fresh one: ``engine.seeds``), and sent on at once as a ``Delta``. Each reply runs
in a worker thread (at most ``max_running`` at a time), never on the event loop. Closing the
stream or cancelling its reader sets the reply's ``threading.Event``, which the thread checks
before every forward pass (a long prompt is read in chunks of ``PREFILL_CHUNK`` tokens, one
pass each), so it stops between two tokens, or two chunks of its prompt. Text is decoded
incrementally (``HFDetokenizer``). It must not know about HTTP. It needs the ``hf`` extra (torch,
transformers); nothing else in replystream imports it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as transformers_logging

from replystream.engine.base import (
    Admission,
    Delta,
    EngineError,
    EngineStats,
    GenerationRequest,
    InProcessEngine,
    RequestRejected,
)
from replystream.engine.end_tokens import end_of_generation_ids
from replystream.engine.hf_config import GENERATION_CONFIG, check_model_folder
from replystream.engine.hf_config import HFEngineConfig as HFEngineConfig  # re-exported
from replystream.engine.hf_text import HFChatPrompt, HFDetokenizer, HFTokenBytes, tokenizer_spec
from replystream.engine.hf_weights import check_weights_fill, layers_named, not_the_shapes
from replystream.engine.prompts import refuse_template_controls
from replystream.engine.sampling import (
    StopMatcher,
    TokenHistory,
    check_logit_bias,
    check_sampling,
    ends_held,
    penalize,
    penalizes,
    sample_token,
    token_logprob,
    without_ends,
)
from replystream.engine.seeds import generator_seed, settled_seed

log = logging.getLogger("replystream.engine")

# The most prompt tokens one forward pass reads (a longer prompt takes several, a reply
# cancelled meanwhile stopping between two of them).
PREFILL_CHUNK = 256
# The prompt's last tokens a reply's text is decoded after (as vLLM's detokenizer does): its
# first token's leading space is then kept, as for every later token.
DETOKENIZER_CONTEXT = 5

Item = Delta | EngineError | None  # None: the thread ended (after a finish or a cancel)
Deliver = Callable[[Item], None]


class HFDeltaStream:
    """One reply's deltas; ``aclose`` stops its thread before its next token. A
    ``QueuedDeltaStream``: it says when a worker thread takes the reply up (it waits while
    ``max_running`` replies run)."""

    def __init__(
        self, deltas: AsyncGenerator[Delta], cancel: threading.Event, admission: Admission
    ) -> None:
        self._deltas = deltas
        self._cancel = cancel
        self._admission = admission

    def when_admitted(self, call: Callable[[], None]) -> None:
        self._admission.when_admitted(call)

    def __aiter__(self) -> HFDeltaStream:
        return self

    def __anext__(self) -> Awaitable[Delta]:
        return self._deltas.__anext__()

    def aclose(self) -> Awaitable[None]:
        self._cancel.set()
        return self._deltas.aclose()


def _ids(value: Any) -> list[int | None]:
    """A config's ``eos_token_id``: one id, a list of them, or none."""
    return list(value) if isinstance(value, list | tuple) else [value]


def end_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a reply (``end_tokens``): the end ids ``generate()`` stops at (the
    generation config's ``eos_token_id``, one id or a list; else the model config's; else the
    tokenizer's EOS), and the known end tokens the vocabulary holds, as for a GGUF."""
    generation = getattr(model, "generation_config", None)
    declared = _ids(getattr(generation, "eos_token_id", None))
    if declared == [None]:
        declared = _ids(getattr(model.config, "eos_token_id", None))
    if declared == [None]:
        declared = [tokenizer.eos_token_id]
    return end_of_generation_ids(declared, tokenizer.get_vocab())


def served_name(folder: Path) -> str:
    """The name a model folder is served by: its own name, or for a snapshot in the Hugging
    Face cache (``models--ORG--NAME/snapshots/COMMIT``, what ``hf download`` makes) the
    repository's, ``ORG/NAME``, rather than a commit hash."""
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--") and repo != "models--":
        return repo.removeprefix("models--").replace("--", "/")
    return folder.name or "hf"


class HFEngine(InProcessEngine):
    """Serves a ``transformers`` causal LM, one worker thread per running reply."""

    def __init__(self, model: Any, tokenizer: Any, config: HFEngineConfig | None = None) -> None:
        self.config = config or HFEngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.pushes = False
        self.queues = True  # a reply waits for a worker thread (``max_running``)
        self.makes_tool_calls = False  # text only: no tool-call parser for its output
        self.name = served_name(Path(str(getattr(model, "name_or_path", "") or "hf")))
        context = getattr(model.config, "max_position_embeddings", 2048)
        if isinstance(context, bool) or not isinstance(context, int) or context < 2:
            # Served, every request would be refused as longer than the context.
            raise ValueError(
                f"max_position_embeddings is {context!r}; a prompt and its reply need at least 2"
            )
        self.context = context
        self.eos = end_ids(model, tokenizer)
        # transformers 5 renamed ``past_key_values`` to ``cache``; older releases take the former.
        forward = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        spec = tokenizer_spec(tokenizer)
        self.token_bytes = HFTokenBytes(tokenizer, spec)
        chat = getattr(tokenizer, "chat_template", None)
        self._chat = HFChatPrompt(tokenizer, spec) if chat else None
        self._executor = ThreadPoolExecutor(self.config.max_running, thread_name_prefix="hf-engine")
        self._cancels: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._counts = {"started": 0, "finished": 0, "cancelled": 0, "failed": 0, "steps": 0}
        self._closed = False

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def count_prompt(self, request: GenerationRequest) -> int:
        return len(self._prompt_ids(request))  # what ``start`` feeds the model

    def seed_for(self, request: GenerationRequest) -> int:
        return settled_seed(request.sampling.seed, self.config.seed)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages and self._chat is not None:
            return self._chat.prompt_ids(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
        refuse_template_controls(request)
        # Chat messages in their plain-text form are all the messages' text: no control token
        # in it is real. A completion's prompt is its client's own, control tokens and all.
        chat = {"split_special_tokens": True} if request.messages is not None else {}
        ids = self.tokenizer.encode(request.prompt, **chat)
        if not ids and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id]
        return [int(i) for i in ids]

    async def start(self, request: GenerationRequest) -> HFDeltaStream:
        if self._closed:
            raise EngineError("the engine was closed", code="engine_closed")
        check_sampling(request.sampling)
        check_logit_bias(request.sampling, int(self.model.config.vocab_size))
        prompt = self._prompt_ids(request)
        if not prompt:
            raise RequestRejected(
                "the prompt is empty and the tokenizer has no BOS token", param="prompt"
            )
        if len(prompt) >= self.context:
            raise RequestRejected(
                f"the prompt is {len(prompt)} tokens; the context holds {self.context}",
                code="context_length_exceeded",
                param="prompt",
            )
        wanted = request.sampling.max_tokens or self.config.default_max_tokens
        max_new = min(wanted, self.context - len(prompt))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        cancel = threading.Event()

        def deliver(item: Item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed: nobody is reading any more
                pass

        admission = Admission()

        def admitted() -> None:  # before its first delta, on the same loop's queue of calls
            try:
                loop.call_soon_threadsafe(admission.admit)
            except RuntimeError:
                pass

        with self._lock:
            self._cancels.add(cancel)
            self._counts["started"] += 1
        seeded = replace(request, sampling=replace(request.sampling, seed=self.seed_for(request)))
        self._executor.submit(self._generate, prompt, max_new, seeded, cancel, deliver, admitted)
        return HFDeltaStream(self._deltas(queue, cancel), cancel, admission)

    async def _deltas(
        self, queue: asyncio.Queue[Item], cancel: threading.Event
    ) -> AsyncGenerator[Delta]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    raise EngineError("the engine was closed", code="engine_closed")
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancel.set()  # a no-op after a finish; stops the thread otherwise

    def _generate(
        self,
        prompt: list[int],
        max_new: int,
        request: GenerationRequest,
        cancel: threading.Event,
        deliver: Deliver,
        admitted: Callable[[], None],
    ) -> None:
        outcome = "cancelled"
        try:
            if not cancel.is_set():  # not closed while it waited for this thread
                admitted()
            if self.config.torch_threads is not None:
                torch.set_num_threads(self.config.torch_threads)
            outcome = self._decode_loop(prompt, max_new, request, cancel, deliver)
        except Exception:  # a failed forward pass ends this reply only
            outcome = "failed"
            log.exception("a forward pass failed; its reply ends")  # the client: no details
            deliver(EngineError("the model failed while generating (the server log says why)"))
        finally:
            with self._lock:
                self._cancels.discard(cancel)
                self._counts[outcome] += 1
            if outcome == "cancelled":
                deliver(None)

    @torch.inference_mode()
    def _decode_loop(
        self,
        prompt: list[int],
        max_new: int,
        request: GenerationRequest,
        cancel: threading.Event,
        deliver: Deliver,
    ) -> str:
        params = request.sampling
        rng = np.random.default_rng(generator_seed(params.seed))  # settled by ``start``
        detok = HFDetokenizer(self.tokenizer, prompt[-DETOKENIZER_CONTEXT:])
        stop = StopMatcher(params.stop)
        history = TokenHistory(prompt) if penalizes(params) else None
        past = None
        # A long prompt is read a chunk at a time, the cancel checked between chunks: read in
        # one pass, a prompt of thousands of tokens would hold the thread (and a stopping
        # server, which waits for it) for many seconds after its client left.
        last = (len(prompt) - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # where the last chunk starts
        for at in range(0, last, PREFILL_CHUNK):
            if cancel.is_set():
                return "cancelled"
            chunk = torch.tensor([prompt[at : at + PREFILL_CHUNK]], dtype=torch.long)
            out = self.model(
                input_ids=chunk, use_cache=True, **{self._cache_arg: past}, **self._keep
            )
            with self._lock:
                self._counts["steps"] += 1
            past = getattr(out, self._cache_arg)
        ids = torch.tensor([prompt[last:]], dtype=torch.long)  # (1, the last chunk's tokens)
        for made in range(1, max_new + 1):
            # The first delta says how many tokens the model read (its chat template's).
            read = len(prompt) if made == 1 else None
            if cancel.is_set():
                return "cancelled"
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past}, **self._keep)
            with self._lock:
                self._counts["steps"] += 1
            past = getattr(out, self._cache_arg)
            logits = out.logits[0, -1].float().numpy()  # (vocab,)
            z = logits if history is None else penalize(logits, params, history)
            if ends_held(params, made - 1):
                z = without_ends(z, self.eos)
            token = sample_token(z, params, rng)
            if history is not None:
                history.add(token)
            now = time.monotonic()
            logprobs = None
            if params.logprobs is not None:
                spelt, hidden = self.token_bytes, self.token_bytes.hidden
                logprobs = (token_logprob(logits, token, params.logprobs, spelt, hidden),)
            if token in self.eos:
                text = stop.feed(detok.flush())
                text += "" if stop.stopped else stop.flush()
                # The end token is never shown, so it has no log probability either.
                shown = None if logprobs is None else ()
                deliver(Delta(text, 1, now, "stop", logprobs=shown, prompt_tokens=read))
                return "finished"
            text = stop.feed(detok.push(token))
            reason = "stop" if stop.stopped else "length" if made == max_new else None
            if reason == "length":
                text += stop.feed(detok.flush())
                reason = "stop" if stop.stopped else "length"
                text += "" if stop.stopped else stop.flush()
            deliver(Delta(text, 1, now, reason, logprobs=logprobs, prompt_tokens=read))
            if reason is not None:
                return "finished"
            ids = torch.tensor([[token]], dtype=torch.long)  # (1, 1): the next step's input
        return "finished"

    def stats(self) -> EngineStats:
        with self._lock:
            c = self._counts
            return EngineStats(
                started=c["started"],
                finished=c["finished"],
                cancelled=c["cancelled"],
                failed=c["failed"],
                active=len(self._cancels),
                steps=c["steps"],
            )

    async def aclose(self) -> None:
        """Stop every reply between two tokens and wait for the worker threads."""
        self._closed = True
        with self._lock:
            for cancel in self._cancels:
                cancel.set()
        await asyncio.to_thread(self._executor.shutdown, wait=True)  # queued replies see the cancel


# How much of a loader's own words a load failure repeats.
WORDS_MAX = 300


# The line that ends a traceback: the exception's type and its words.
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception): ", re.MULTILINE)


def _conversion_error(exc: BaseException) -> str | None:
    """What weights ``transformers`` could not convert to the model's layout (a Mixtral's
    experts of unequal shapes, say), in words of our own, or None.

    It raises "look at the CONVERSION entries of the above report!", a report its quieted log
    does not print: the entries are read from the loading info its report was made of (the
    frame that raised), the first one told by the tensor it was for and the error it met.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "log_state_dict_report":
        tb = tb.tb_next
    info = None if tb is None else tb.tb_frame.f_locals.get("loading_info")
    errors = getattr(info, "conversion_errors", None)
    if not isinstance(errors, dict) or not errors:
        return None
    name, error = min(errors.items())
    said = str(error)
    found = list(_RAISED.finditer(said))
    if found:  # the words its traceback ends with (the entry repeats them, then its own)
        said = said[found[-1].end() :].split("\n", 1)[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return _cut(f"its weights could not be converted to the model's layout{more}: {name}: {said}")


def _cut(text: str) -> str:
    """``text`` on one line, cut at ``WORDS_MAX``."""
    words = " ".join(text.split())
    return words if len(words) <= WORDS_MAX else words[: WORDS_MAX - 3] + "..."


def _words(exc: BaseException) -> str:
    """An exception's words on one line, cut at ``WORDS_MAX`` (a missing key's said as that,
    not as its bare repr)."""
    if isinstance(exc, KeyError) and exc.args:
        return _cut(f"{exc.args[0]!r} is missing")
    return _cut(str(exc)) or type(exc).__name__


def _unreadable_json(folder: Path) -> str | None:
    """The first of the folder's JSON files that is not JSON, named with the parser's words
    (which the loader repeats alone, naming no file), or None."""
    for file in sorted(folder.glob("*.json")):
        try:
            json.loads(file.read_text(encoding="utf-8"))
        except RecursionError:
            continue  # told by the command, in words of its own, when the loader meets it
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return _cut(f"{file.name} is not a JSON file ({exc})")
    return None


class _NamedRefusal(ValueError):
    """A refusal that names its file already."""


def _read_generation_config(path: Path) -> None:
    """Values of a wrong type in ``generation_config.json`` make the model's loader raise in
    words that name no file (``'<=' not supported between instances of 'str' and 'int'``):
    read first, on its own, they are told with the file's name."""
    file = path / GENERATION_CONFIG
    if not file.exists():
        return
    try:
        GenerationConfig.from_pretrained(path, local_files_only=True)
    except RecursionError:
        raise
    except Exception as exc:
        raise _NamedRefusal(f"{file}: {_words(exc)}") from None


def load_hf_engine(path: Path, config: HFEngineConfig | None = None) -> HFEngine:
    """Load a causal LM and its tokenizer from a local folder (never from the network).

    Raises:
        ValueError: the folder does not hold a model ``transformers`` can load.
    """
    check_model_folder(path)
    # A start-up says its one line: the loader's bar of tensors and its report of what the
    # checkpoint lacked (which this function tells in its own words) are not printed.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        _read_generation_config(path)
        # trust_remote_code stated: a folder asking to run its own code is loaded with the
        # library's class of its kind, or refused, never asked about on a terminal.
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=False
            )
        except (RecursionError, _NamedRefusal):
            raise
        except Exception as exc:
            words = _unreadable_json(path) or f"its tokenizer cannot be loaded: {_words(exc)}"
            raise _NamedRefusal(f"cannot load a causal LM from {path}: {words}") from exc
        # A larger model's config.json over these weights, refused before that model is
        # built (at random, in memory in proportion to what config.json claims).
        check_weights_fill(
            path, AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        )
        # With output_loading_info the loader answers (model, what it found and lacked).
        # Weights of another shape than config.json's would make it raise words that send
        # the reader to its report ("look at the above report!"), which the quieted log does
        # not print: taken (at random, as it starts them), they are refused below by name.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
        model, loading = loaded
    except (RecursionError, _NamedRefusal):
        raise  # a JSON file nested past the limit: told by the command, in words of its own
    except Exception as exc:
        # Whatever a damaged or foreign folder makes ``transformers`` (or safetensors, or
        # torch) raise: its words on one line, as a mistake on the command line is told.
        words = _conversion_error(exc) or _unreadable_json(path) or _words(exc)
        raise ValueError(f"cannot load a causal LM from {path}: {words}") from exc
    finally:
        transformers_logging.set_verbosity(verbosity)
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        # The loader starts them at random and says so in a note: a model that would answer
        # with noise (weights lost, or a checkpoint of another kind, an encoder's).
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        raise ValueError(
            f"cannot load a causal LM from {path}: its weights lack {len(missing)} tensors "
            f"the model needs ({shown})"
        )
    mismatched = sorted(loading.get("mismatched_keys") or ())
    if mismatched:  # under names the loader mapped (the check before it compares its own)
        raise ValueError(f"cannot load a causal LM from {path}: {not_the_shapes(mismatched)}")
    held = layers_named(loading.get("unexpected_keys") or ())
    configured = getattr(model.config, "num_hidden_layers", None)
    if isinstance(configured, int) and held > configured:
        # The loader leaves the layers past config.json's count out with a note: a model cut
        # short, answering as none was trained to. (Other unexpected weights, a multimodal
        # checkpoint's vision tower, say, are the text model's to ignore.)
        raise ValueError(
            f"cannot load a causal LM from {path}: its weights hold {held} layers where "
            f"config.json says {configured}"
        )
    try:
        return HFEngine(model, tokenizer, config)
    except ValueError as exc:  # its chat template, say: named with the folder
        raise ValueError(f"{path}: {exc}") from None
