"""Decode speed of the tiny engine's model: tokens/s, achieved vs measured memory bandwidth.

Usage: python benchmarks/engine_decode.py [--steps 40] [--prompt-tokens 64] [--blas-threads 1]

For batch 1, 8 and 32 it prefills every sequence, then times decode steps (model forward plus
a greedy pick) and prints the median. A decode step must read every weight and every live
sequence's K and V; those bytes over the step time are the achieved bandwidth, printed beside
this machine's bandwidth measured with a large NumPy copy. KV waste is the share of reserved
cache slots (in partly filled 16-token blocks) that hold no token. Where ``transformers`` and
``torch`` are installed, ``LlamaForCausalLM.generate()`` with the same configuration and the
same weights is timed at batch 1 for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from replystream.cli_values import int_at_least, positive_int
from replystream.engine.base import GenerationRequest, SamplingParams
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk, TinyModel
from replystream.engine.tiny import ASSETS, load_default_engine
from replystream.engine.tokenizer import ByteTokenizer
from tool_main import tool_main

PROMPT = (
    "And it came to pass, when the king heard the words of the book of the law, that he rent "
    "his clothes. And the king commanded Hilkiah the priest, and Ahikam the son of Shaphan, "
    "and Achbor the son of Michaiah, and Shaphan the scribe, and Asahiah a servant of the "
    "king's, saying, Go ye, enquire of the LORD for me, and for the people, and for all Judah"
)


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large array copy (each byte read once and written once)."""
    src = np.ones(megabytes * 2**20 // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - began)
    return 2 * src.nbytes / best


def decode_run(
    model: TinyModel, prompt: list[int], batch: int, steps: int
) -> tuple[float, float, float]:
    """(median seconds per decode step, mean bytes read per step, KV waste fraction)."""
    c = model.config
    blocks = batch * (-(-(len(prompt) + steps + 1) // 16))
    cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, blocks, 16)
    rng = np.random.default_rng(0)
    lengths, nxt = [], []
    for b in range(batch):  # prompts of different lengths, as real traffic has
        n = int(rng.integers(len(prompt) // 2, len(prompt) + 1))
        cache.allocator.reserve(b, n)
        logits = model.prefill(b, prompt[:n], cache)
        lengths.append(n)
        nxt.append(int(np.argmax(logits)))
    times, read = [], []
    waste = []
    for _ in range(steps):
        chunks = [Chunk(b, (nxt[b],), lengths[b]) for b in range(batch)]
        for b in range(batch):
            cache.allocator.reserve(b, lengths[b] + 1)
        began = time.perf_counter()
        logits = model.decode(chunks, cache)  # (batch, vocab)
        nxt = [int(i) for i in np.argmax(logits, axis=-1)]
        times.append(time.perf_counter() - began)
        lengths = [n + 1 for n in lengths]
        stats = cache.stats()
        read.append(model.weight_bytes + stats.live_bytes)
        waste.append(stats.wasted_fraction)
    return statistics.median(times), statistics.mean(read), statistics.mean(waste)


def engine_tokens_per_second(prompt: str, new: int) -> float:
    """Batch 1 through ``TinyEngine`` (prefill, sampling, detokenizer, worker thread)."""

    async def run() -> float:
        engine = load_default_engine()
        try:
            request = GenerationRequest(prompt, SamplingParams(max_tokens=new, temperature=0))
            for _ in range(2):  # the first run starts the worker thread
                began = time.perf_counter()
                async for _delta in await engine.start(request):
                    pass
                seconds = time.perf_counter() - began
        finally:
            await engine.aclose()
        return new / seconds

    return asyncio.run(run())


def transformers_tokens_per_second(model: TinyModel, prompt: list[int], new: int) -> str:
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return "transformers or torch is not installed: skipped the generate() comparison"
    from safetensors.torch import load_file

    c = model.config
    torch.set_num_threads(1)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.d_model,
            intermediate_size=c.d_ff,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            max_position_embeddings=c.context,
            rms_norm_eps=c.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
            tie_word_embeddings=True,
        )
    )
    hf.load_state_dict(load_file(str(ASSETS / "model.safetensors")), strict=False)
    hf.tie_weights()
    hf.eval()  # type: ignore[no-untyped-call]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        theirs = hf(ids).logits[0].numpy()  # (T, vocab)
    differ = float(np.abs(theirs - model.full_logits(prompt)).max())
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    with torch.inference_mode():
        hf.generate(ids, **kwargs)  # warm-up
        began = time.perf_counter()
        hf.generate(ids, **kwargs)
        seconds = time.perf_counter() - began
    return (
        f"{new / seconds:,.0f} tok/s (prefill included, torch threads 1; same weights, "
        f"logits differ from ours by at most {differ:.1e})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=positive_int, default=40)
    # At least 2: the batch's prompts run from half of it to all of it, none empty.
    parser.add_argument("--prompt-tokens", type=int_at_least(2), default=64)
    parser.add_argument("--blas-threads", type=positive_int, default=1)
    args = parser.parse_args()

    model = TinyModel.load(ASSETS)
    prompt = ByteTokenizer(ASSETS / "tokenizer.json").encode(PROMPT)[: args.prompt_tokens]
    context = model.config.context
    if len(prompt) + args.steps > context:  # each step is one more position
        parser.error(
            f"argument --steps: at most {context - len(prompt)} after a prompt of "
            f"{len(prompt)} tokens (the model's context is {context}), got {args.steps}"
        )
    bandwidth = memory_bandwidth()
    print(
        f"model: {model.parameter_count:,} parameters, {model.weight_bytes / 2**20:.2f} MiB "
        f"of weights read per step (float32); prompts of {len(prompt) // 2}-{len(prompt)} tokens"
    )
    print(f"measured memory bandwidth (512 MiB NumPy copy): {bandwidth / 1e9:.1f} GB/s")
    print(f"BLAS threads: {args.blas_threads}")
    print(
        f"{'batch':>5} {'ms/step':>8} {'tok/s':>8} {'MiB/step':>9} {'GB/s':>6} {'of peak':>8} "
        f"{'KV waste':>9}"
    )
    ours_b1 = 0.0
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        for batch in (1, 8, 32):
            step, read, waste = decode_run(model, prompt, batch, args.steps)
            achieved = read / step
            ours_b1 = ours_b1 or batch / step
            print(
                f"{batch:>5} {step * 1e3:>8.2f} {batch / step:>8,.0f} {read / 2**20:>9.2f} "
                f"{achieved / 1e9:>6.2f} {achieved / bandwidth:>8.1%} {waste:>9.1%}"
            )
    text = ByteTokenizer(ASSETS / "tokenizer.json").decode(prompt)
    engine_rate = engine_tokens_per_second(text, args.steps)
    print(f"TinyEngine end to end, batch 1 (prefill included): {engine_rate:,.0f} tok/s")
    hf = transformers_tokens_per_second(model, prompt, args.steps)
    if hf.endswith(")"):
        hf_rate = float(hf.split()[0].replace(",", ""))
        print(f"transformers generate(), batch 1: {hf}")
        print(
            f"ratio at batch 1: model step {ours_b1 / hf_rate:.2f}x, "
            f"TinyEngine end to end {engine_rate / hf_rate:.2f}x the speed of generate()"
        )
    else:
        print(hf)
    return 0


if __name__ == "__main__":
    tool_main(main)
