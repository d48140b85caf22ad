"""SmolLM2-135M-Instruct in our NumPy engine against transformers on the same GGUF weights.

Usage: python benchmarks/model_decode.py [--steps 8] [--batches 1,4,16,32]
       [--ttft 128,1024,4096] [--threads 1] [--no-transformers]

Prints, in one run: the load time and resident memory; decode tokens/s at each batch size
(median step of ``--steps`` after a prefill of 64 tokens per sequence); at batch 1 the bytes a
step reads (every weight, plus the live K and V) over the step time, beside this machine's
bandwidth measured by a 512 MiB NumPy copy; TTFT for each prompt length (chunked prefill with
the engine's 256-token budget, through the paged cache); then the same figures for
``transformers`` ``generate()`` (float32, ``from_pretrained(..., gguf_file=...)``, the same
thread count) and our figures as ratios of theirs. Both sides use ``--threads`` BLAS/torch
threads (1 by default: the serving engine's setting).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from replystream.engine.gguf_engine import GGUF_ENGINE_DEFAULTS, load_gguf_model
from replystream.engine.gguf_file import SMOLLM2_INSTALL, smollm2_path
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk, TinyModel

PREFIX = 64  # prompt tokens per sequence before decode is timed


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


def median_time(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def ours_decode(model: TinyModel, batch: int, steps: int) -> tuple[float, float]:
    """(median seconds per decode step, bytes a step reads) at ``batch`` sequences."""
    c = model.config
    blocks = batch * -(-(PREFIX + steps + 2) // 16)
    cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, blocks, 16)
    rng = np.random.default_rng(0)
    for b in range(batch):
        cache.allocator.reserve(b, PREFIX + steps + 1)
        prompt = tuple(int(t) for t in rng.integers(100, c.vocab_size, PREFIX))
        model.forward([Chunk(b, prompt, 0)], cache)
    times = []
    for step in range(steps):
        chunks = [Chunk(b, (int(rng.integers(100, 1000)),), PREFIX + step) for b in range(batch)]
        began = time.perf_counter()
        model.forward(chunks, cache)
        times.append(time.perf_counter() - began)
    kv_per_token = cache.allocator.bytes_per_token
    read = model.weight_bytes + batch * (PREFIX + steps // 2) * kv_per_token
    return statistics.median(times), read


def ours_ttft(model: TinyModel, length: int, budget: int) -> float:
    """Seconds to the first token's logits for a ``length``-token prompt, chunked by ``budget``."""
    c = model.config
    cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, -(-length // 16), 16)
    cache.allocator.reserve(0, length)
    prompt = [int(t) for t in np.random.default_rng(length).integers(100, c.vocab_size, length)]
    began = time.perf_counter()
    for start in range(0, length, budget):
        logits = model.forward([Chunk(0, tuple(prompt[start : start + budget]), start)], cache)
    int(np.argmax(logits[0]))
    return time.perf_counter() - began


def transformers_figures(
    path_dir: str, name: str, batches: list[int], lengths: list[int], steps: int, threads: int
) -> tuple[dict[int, float], dict[int, float], float]:
    """(decode tok/s by batch, TTFT by prompt length, load seconds) of ``generate()``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    began = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path_dir, gguf_file=name, dtype=torch.float32)
    load_s = time.perf_counter() - began
    rng = np.random.default_rng(0)

    def generate(ids: torch.Tensor, new: int) -> None:
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=2,
            )

    decode: dict[int, float] = {}
    for batch in batches:
        ids = torch.tensor(rng.integers(100, 49152, (batch, PREFIX)))
        first = median_time(partial(generate, ids, 1), 3)
        whole = median_time(partial(generate, ids, 1 + steps), 3)
        decode[batch] = batch * steps / max(whole - first, 1e-9)
    ttft: dict[int, float] = {}
    for length in lengths:
        ids = torch.tensor(rng.integers(100, 49152, (1, length)))
        ttft[length] = median_time(partial(generate, ids, 1), 1)
    return decode, ttft, load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--ttft", default="128,1024,4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.ttft.split(",")]
    path = smollm2_path()
    if path is None:
        raise SystemExit(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
    began = time.perf_counter()
    _, model, _ = load_gguf_model(path)
    load_s = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"model: {path.name}, {model.parameter_count:,} parameters")
    print(
        f"our load: {load_s:.1f} s (read + dequantise + lay out), "
        f"{model.weight_bytes / 2**20:.0f} MiB float32 weights, peak RSS {rss / 2**20:.0f} MiB"
    )
    bandwidth = memory_bandwidth()
    print(
        f"measured memory bandwidth (512 MiB NumPy copy, read + write): {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"threads: {args.threads} (BLAS for ours, torch for transformers)")
    ours: dict[int, float] = {}
    with threadpool_limits(limits=args.threads, user_api="blas"):
        print("\nours: batch  ms/step     tok/s  MiB/step   GB/s  of measured")
        for batch in batches:
            step, read = ours_decode(model, batch, args.steps)
            ours[batch] = batch / step
            print(
                f"      {batch:5d} {step * 1e3:8.1f} {ours[batch]:9.1f} {read / 2**20:9.0f} "
                f"{read / step / 1e9:6.1f} {read / step / bandwidth:10.0%}"
            )
        budget = GGUF_ENGINE_DEFAULTS.token_budget
        our_ttft = {n: ours_ttft(model, n, budget) for n in lengths}
    for n, seconds in our_ttft.items():
        print(f"ours: TTFT {n:5d} tokens: {seconds * 1e3:8.0f} ms ({budget}-token chunks)")
    if args.no_transformers:
        return
    del model
    decode, ttft, hf_load = transformers_figures(
        str(path.parent), path.name, batches, lengths, args.steps, args.threads
    )
    print(f"\ntransformers generate(): load {hf_load:.1f} s")
    print("batch   ours tok/s   transformers tok/s   ours / transformers")
    for batch in batches:
        ratio = ours[batch] / decode[batch]
        print(f"{batch:5d} {ours[batch]:12.1f} {decode[batch]:20.1f} {ratio:21.2f}x")
    print("prompt  ours TTFT ms   transformers TTFT ms   transformers / ours")
    for n in lengths:
        print(
            f"{n:6d} {our_ttft[n] * 1e3:13.0f} {ttft[n] * 1e3:22.0f} {ttft[n] / our_ttft[n]:20.2f}x"
        )


if __name__ == "__main__":
    main()
