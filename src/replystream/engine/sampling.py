"""Picking the next token from logits, and cutting a reply at a stop sequence.

This file decides how logits become one token id: greedy at temperature 0, otherwise
softmax(logits / temperature) computed stably (the max is subtracted before ``exp``), narrowed
by top-k, then min-p (tokens less likely than that fraction of the likeliest dropped, as vLLM
does), then top-p (the smallest set of tokens whose probabilities reach p; at 0, the
likeliest token alone), and drawn with the request's own seeded generator, so the same seed
gives the same reply. Logit biases, then penalties (repetition, frequency, presence), change
the logits first, in vLLM's order, from the request's ``TokenHistory``; then the model's end
tokens are banned while the reply may not end yet (``min_tokens``, ``ignore_eos``:
``ends_held``). It also tells an engine when a stop sequence has completed (the pipeline cuts
it). It must not know about models, caches, batches or time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Container, Sequence

import numpy as np
from numpy.typing import NDArray

from replystream.engine.base import (
    RequestRejected,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    check_lengths,
    token_name,
)
from replystream.engine.stops import StopScan

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20


def check_sampling(params: SamplingParams) -> None:
    """Refuse sampling values no sampler can honour.

    Raises:
        RequestRejected: naming the offending field in ``param``.
    """
    if params.max_tokens is not None and params.max_tokens < 1:
        raise RequestRejected("max_tokens must be at least 1", param="max_tokens")
    temperature, top_p = params.temperature, params.top_p
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise RequestRejected("temperature must be a finite number >= 0", param="temperature")
    if top_p is not None and not (math.isfinite(top_p) and 0 <= top_p <= 1):
        raise RequestRejected("top_p must be from 0 to 1", param="top_p")
    if params.top_k < 0:
        raise RequestRejected("top_k must be >= 0 (0 keeps every token)", param="top_k")
    if not (math.isfinite(params.min_p) and 0 <= params.min_p <= 1):
        raise RequestRejected("min_p must be from 0 to 1 (0 keeps every token)", param="min_p")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestRejected(
            f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        # It divides positive logits: 0 has no meaning (vLLM refuses it too).
        raise RequestRejected("repetition_penalty must be > 0", param="repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise RequestRejected(f"{name} must be a finite number", param=name)
    check_lengths(params)
    if len(params.stop) > MAX_STOP_SEQUENCES or any(not s for s in params.stop):
        raise RequestRejected(
            f"stop takes at most {MAX_STOP_SEQUENCES} non-empty strings", param="stop"
        )


def penalizes(params: SamplingParams) -> bool:
    """Whether ``params`` ask for any penalty or bias (none: logits are sampled as the model
    gave them)."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
    )


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Refuse a bias on a token the model does not have.

    Raises:
        RequestRejected: naming ``logit_bias``.
    """
    unknown = [token for token, _ in params.logit_bias if token >= vocab_size]
    if unknown:
        raise RequestRejected(
            f"logit_bias names token {unknown[0]}; this model's tokens are 0 to {vocab_size - 1}",
            param="logit_bias",
        )


class TokenHistory:
    """What the penalties look at: the prompt's tokens and how often the reply made each."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt = frozenset(prompt)
        self.made: Counter[int] = Counter()

    def add(self, token: int) -> None:
        self.made[token] += 1


def penalize(
    logits: NDArray[np.floating], params: SamplingParams, history: TokenHistory
) -> NDArray[np.float32]:
    """The logits with the request's penalties applied (a copy), as vLLM applies them: each
    ``logit_bias`` is added; then ``repetition_penalty`` divides a positive logit and
    multiplies a negative one for every token of the prompt or the reply (a biased one
    as biased: vLLM's bias is a logits processor run before its penalties); then each token
    the reply made loses ``frequency_penalty`` times its count, and ``presence_penalty``
    once."""
    z = np.array(logits, dtype=np.float32)  # (vocab,)
    for token, bias in params.logit_bias:  # ids checked against the vocabulary at admission
        z[token] += bias
    if params.repetition_penalty != 1.0:
        seen = np.fromiter(history.prompt | history.made.keys(), dtype=np.int64)
        seen = seen[seen < z.size]
        # In float64, then held to float32's range: a penalty near 0 (1e-300 is one, and
        # float32's 0) would make a positive logit inf, and inf - inf a NaN in the softmax.
        rp = params.repetition_penalty
        zs = z[seen].astype(np.float64)
        big = np.finfo(np.float32).max
        z[seen] = np.clip(np.where(zs > 0, zs / rp, zs * rp), -big, big)
    if history.made and (params.frequency_penalty or params.presence_penalty):
        ids = np.fromiter(history.made.keys(), dtype=np.int64, count=len(history.made))
        counts = np.fromiter(history.made.values(), dtype=np.float32, count=len(history.made))
        z[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return z


def ends_held(params: SamplingParams, made: int) -> bool:
    """Whether the reply may not end yet after ``made`` tokens (its end tokens banned)."""
    return params.ignore_eos or made < params.min_tokens


def without_ends(logits: NDArray[np.floating], ends: Collection[int]) -> NDArray[np.float32]:
    """The logits with the model's end tokens banned (a copy), as llama.cpp's
    ``ignore_eos`` bans them: never picked, the rest of the distribution as it was."""
    z = np.array(logits, dtype=np.float32)  # (vocab,)
    z[[token for token in ends if token < z.size]] = -np.inf
    return z


def probabilities(logits: NDArray[np.floating], temperature: float = 1.0) -> NDArray[np.float64]:
    """softmax(logits / temperature); subtracting the max keeps ``exp`` from overflowing.
    Subtracted before dividing: a temperature so small that a logit over it overflows
    (1e-320) then makes the others -inf, which ``exp`` takes to 0, never inf - inf (NaN)."""
    z = logits.astype(np.float64)  # (vocab,)
    z -= z.max()
    with np.errstate(over="ignore"):  # (the overflow to -inf is the answer)
        z /= temperature
    e = np.exp(z)
    return e / e.sum()  # type: ignore[no-any-return]


def filtered_probabilities(
    logits: NDArray[np.float32], params: SamplingParams
) -> NDArray[np.float64]:
    """The distribution a token is drawn from: temperature, then top-k, min-p, top-p."""
    z = logits.astype(np.float64)  # (vocab,)
    if 0 < params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = probabilities(z, 1.0 if params.temperature is None else params.temperature)  # (vocab,)
    if params.min_p > 0:  # relative to the likeliest token, which is always kept
        p[p < params.min_p * p.max()] = 0.0
        p /= p.sum()
    top_p = 1.0 if params.top_p is None else params.top_p
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")  # most likely first
        before = np.cumsum(p[order]) - p[order]  # mass of the tokens ranked above each one
        # The set above already reached top_p; the likeliest token is always kept, so 0 (in
        # OpenAI's range, 0 to 1) keeps it alone: greedy, as transformers and llama.cpp do.
        drop = order[1:][before[1:] >= top_p]
        p[drop] = 0.0
        p /= p.sum()
    return p


def sample_token(
    logits: NDArray[np.float32], params: SamplingParams, rng: np.random.Generator
) -> int:
    """One token id from ``logits`` (vocab,); greedy when ``temperature == 0``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    p = filtered_probabilities(logits, params)
    # One uniform draw per token, inverted through the cumulative distribution. The draw is
    # scaled by the cumulative sum's own end, not by ``p.sum()``: the two add in different
    # orders, and a draw near 1 past the cumsum's end would fall off it onto the vocabulary's
    # last token, whatever its probability (0 when top-k or top-p cut it).
    cdf = np.cumsum(p)  # (vocab,)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, int(np.flatnonzero(p)[-1]))  # rounding may still reach the very end


def token_logprob(
    logits: NDArray[np.floating],
    token: int,
    top: int,
    token_bytes: Callable[[int], bytes],
    hidden: Container[int] = (),
) -> TokenLogprob:
    """The log probability of ``token`` under the model's own distribution (log-softmax of the
    logits, before temperature, top-k or top-p), and the ``top`` likeliest tokens.

    ``token_bytes``: each token's bytes as the vocabulary spells it, a control token's too
    (``<|im_end|>``); ``hidden``: the control tokens' ids, which are no part of the text.

    This is what OpenAI and vLLM report: how likely the model found each token, whatever the
    sampling settings that picked it.
    """
    z = logits.astype(np.float64)  # (vocab,)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())  # (vocab,)

    def candidate(index: int) -> TopLogprob:
        raw = token_bytes(index)
        return TopLogprob(token_name(raw), float(logp[index]), raw)

    best: list[int] = []
    if top > 0:
        count = min(top, logp.size)
        picked = np.argpartition(-logp, count - 1)[:count]
        best = sorted(picked.tolist(), key=lambda i: (-logp[i], i))
    made = candidate(token)
    alternatives = tuple(candidate(i) for i in best)
    return TokenLogprob(made.token, made.logprob, made.bytes, alternatives, token not in hidden)


class StopMatcher:
    """Tells an engine when a stop sequence has completed, so it can stop making tokens.

    It passes text through up to the end of the first stop sequence (what follows it is
    dropped) and cuts nothing itself: the reply pipeline (``delivery.moderation``) withholds and
    cuts stop sequences for every engine alike, and names the one that matched.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._scan = StopScan(stops) if stops else None
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text to deliver; sets ``stopped`` when a stop sequence has completed."""
        if self._scan is None or self.stopped:
            return "" if self.stopped else text
        before = self._scan.seen
        hit = self._scan.feed(text)
        if hit is None:
            return text
        self.stopped = True
        return text[: hit.start + len(hit.stop) - before]

    def flush(self) -> str:
        """Nothing is ever held here (kept for the engines' end-of-reply path)."""
        return ""
