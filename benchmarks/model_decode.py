"""SmolLM2-135M-Instruct in our NumPy engine against transformers on the same GGUF weights.

Usage: python benchmarks/model_decode.py [--steps 8] [--batches 1,4,16,32]
       [--ttft 128,1024,4096] [--threads 1] [--no-transformers] [--llama-cpp]

Prints, in one run: the load time and resident memory; decode tokens/s at each batch size
(median step of ``--steps`` after a prefill of 64 tokens per sequence); the bytes a step reads
(every weight, plus the live K and V) over the step time, beside this machine's bandwidth
measured with as many threads as the model uses (a 512 MiB NumPy copy per thread, read + write,
and a BLAS dot product of two 256 MiB vectors, read only); TTFT for each prompt length (chunked
prefill with the engine's 256-token budget, through the paged cache); then the same figures
for ``transformers`` ``generate()`` (float32, ``from_pretrained(..., gguf_file=...)``, the
same thread count) and our figures as ratios of theirs; with ``--llama-cpp``, llama.cpp
through ``llama-cpp-python`` on the same GGUF (its own 4-bit kernels: a step reads 94 MiB of
weights where ours reads 513) as a third column. Both sides use ``--threads`` BLAS/torch
threads (1 by default: the serving engine's setting).

Every time is given twice: wall-clock, and the CPU time of the process (``process_time``). On
a shared machine the wall clock also counts the time other programs held the cores; CPU time
does not, so ratios of CPU times are the steadier comparison (with 2 threads, CPU time adds up
both threads' work).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

from replystream.engine.gguf_engine import GGUF_ENGINE_DEFAULTS, load_gguf_model
from replystream.engine.gguf_file import SMOLLM2_INSTALL, smollm2_path
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk, TinyModel

PREFIX = 64  # prompt tokens per sequence before decode is timed


@dataclass(frozen=True, slots=True)
class Took:
    """Seconds by the wall clock and of the process's CPU."""

    wall: float
    cpu: float


def timed(run: Callable[[], object]) -> Took:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return Took(time.perf_counter() - wall, time.process_time() - cpu)


def median_took(took: list[Took]) -> Took:
    return Took(statistics.median(t.wall for t in took), statistics.median(t.cpu for t in took))


def copy_bandwidth(threads: int, megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second of ``threads`` simultaneous copies of ``megabytes`` each (every byte
    read once and written once; NumPy releases the GIL while it copies)."""
    pairs = [np.ones(megabytes * 2**20 // 8) for _ in range(threads)]
    targets = [np.empty_like(a) for a in pairs]
    best = float("inf")
    for _ in range(repeats):
        workers = [
            threading.Thread(target=np.copyto, args=(dst, src))
            for src, dst in zip(pairs, targets, strict=True)
        ]
        began = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - began)
    return 2 * threads * pairs[0].nbytes / best


def read_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second of a BLAS dot product of two float32 vectors (read only), on however
    many threads BLAS is allowed."""
    a = np.ones(megabytes * 2**20 // 8, dtype=np.float32)
    b = np.ones_like(a)
    best = min(timed(partial(np.dot, a, b)).wall for _ in range(repeats))
    return 2 * a.nbytes / best


def ours_decode(model: TinyModel, batch: int, steps: int) -> tuple[Took, float]:
    """(median time of a decode step, bytes a step reads) at ``batch`` sequences."""
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
        times.append(timed(partial(model.forward, chunks, cache)))
    kv_per_token = cache.allocator.bytes_per_token
    read = model.weight_bytes + batch * (PREFIX + steps // 2) * kv_per_token
    return median_took(times), read


def ours_ttft(model: TinyModel, length: int, budget: int) -> Took:
    """Time to the first token for a ``length``-token prompt, chunked by ``budget``."""
    c = model.config
    cache = PagedKVCache(c.n_layers, c.n_kv_heads, c.head_dim, -(-length // 16), 16)
    cache.allocator.reserve(0, length)
    prompt = [int(t) for t in np.random.default_rng(length).integers(100, c.vocab_size, length)]

    def run() -> int:
        for start in range(0, length, budget):
            logits = model.forward([Chunk(0, tuple(prompt[start : start + budget]), start)], cache)
        return int(np.argmax(logits[0]))

    return timed(run)


def transformers_figures(
    path_dir: str, name: str, batches: list[int], lengths: list[int], steps: int, threads: int
) -> tuple[dict[int, Took], dict[int, Took], float]:
    """(decode step time by batch, TTFT by prompt length, load seconds) of ``generate()``."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated position for the whole batch: the gaps between calls
        are decode steps (a difference of two whole generate() runs drowned in the noise)."""

        def __init__(self) -> None:
            self.marks: list[Took] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.marks.append(Took(time.perf_counter(), time.process_time()))
            return scores

    torch.set_num_threads(threads)
    began = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path_dir, gguf_file=name, dtype=torch.float32)
    load_s = time.perf_counter() - began
    rng = np.random.default_rng(0)

    def generate(ids: torch.Tensor, new: int, clock: StepClock | None = None) -> None:
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=2,
                logits_processor=LogitsProcessorList([clock] if clock else []),
            )

    decode: dict[int, Took] = {}
    for batch in batches:
        ids = torch.tensor(rng.integers(100, 49152, (batch, PREFIX)))
        gaps = []
        for _ in range(3):
            clock = StepClock()
            generate(ids, 1 + steps, clock)
            gaps += [
                Took(b.wall - a.wall, b.cpu - a.cpu)
                for a, b in zip(clock.marks, clock.marks[1:], strict=False)
            ]
        decode[batch] = median_took(gaps)
    prompts = {n: torch.tensor(rng.integers(100, 49152, (1, n))) for n in lengths}
    ttft = {n: timed(partial(generate, ids, 1)) for n, ids in prompts.items()}
    return decode, ttft, load_s


def llama_cpp_figures(
    path: Path, batches: list[int], lengths: list[int], steps: int, threads: int
) -> tuple[dict[int, Took], dict[int, Took], float]:
    """The same figures for llama.cpp (``llama-cpp-python``) on the GGUF itself, 4-bit weights.

    Batch 1 only for decode: the high-level binding decodes one sequence at a time (its
    ``n_seq_max`` batching is not exposed through ``eval``), so larger batches are left out
    rather than faked with one-at-a-time runs."""
    from llama_cpp import Llama  # type: ignore[import-not-found]

    began = time.perf_counter()
    llm = Llama(
        str(path),
        n_ctx=max([*lengths, PREFIX + steps + 2]) + 8,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=256,
        verbose=False,
    )
    load_s = time.perf_counter() - began
    rng = np.random.default_rng(0)
    decode: dict[int, Took] = {}
    if 1 in batches:
        prompt = [int(t) for t in rng.integers(100, 49152, PREFIX)]
        took = []
        for _ in range(3):
            llm.reset()
            llm.eval(prompt)
            for token in rng.integers(100, 1000, steps):
                took.append(timed(partial(llm.eval, [int(token)])))
        decode[1] = median_took(took)
    ttft: dict[int, Took] = {}
    for n in lengths:
        prompt = [int(t) for t in rng.integers(100, 49152, n)]
        llm.reset()
        ttft[n] = timed(partial(llm.eval, prompt))
    return decode, ttft, load_s


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--ttft", default="128,1024,4096")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama-cpp-python's figures")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.ttft.split(",")]
    path = smollm2_path()
    if path is None:
        raise SystemExit(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
    wall, cpu = time.perf_counter(), time.process_time()
    _, model, _ = load_gguf_model(path)
    load = Took(time.perf_counter() - wall, time.process_time() - cpu)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"model: {path.name}, {model.parameter_count:,} parameters")
    print(
        f"our load: {load.wall:.1f} s ({load.cpu:.1f} s CPU; header, dequantise, lay out), "
        f"{model.weight_bytes / 2**20:.0f} MiB float32 weights, peak RSS {rss / 2**20:.0f} MiB"
    )
    print(f"threads: {args.threads} (BLAS for ours, torch for transformers, llama.cpp's own)")
    with threadpool_limits(limits=args.threads, user_api="blas"):
        copy = copy_bandwidth(args.threads)
        read_only = read_bandwidth()
        print(
            f"measured memory bandwidth on {args.threads} thread(s): {copy / 1e9:.1f} GB/s "
            f"(512 MiB NumPy copies, read + write), {read_only / 1e9:.1f} GB/s (BLAS dot, read)"
        )
        print(
            "\nours: batch  ms/step wall    CPU   tok/s wall    CPU  MiB/step  GB/s wall  CPU"
            "  of copy (wall CPU)  of read (wall CPU)"
        )
        ours: dict[int, Took] = {}
        for batch in batches:
            step, read = ours_decode(model, batch, args.steps)
            ours[batch] = step
            print(
                f"      {batch:5d} {step.wall * 1e3:12.1f} {step.cpu * 1e3:6.1f} "
                f"{batch / step.wall:11.1f} {batch / step.cpu:6.1f} {read / 2**20:9.0f} "
                f"{read / step.wall / 1e9:10.1f} {read / step.cpu / 1e9:4.1f} "
                f"{read / step.wall / copy:13.0%} {read / step.cpu / copy:4.0%} "
                f"{read / step.wall / read_only:13.0%} {read / step.cpu / read_only:4.0%}"
            )
        budget = GGUF_ENGINE_DEFAULTS.token_budget
        our_ttft = {n: ours_ttft(model, n, budget) for n in lengths}
    for n, took in our_ttft.items():
        print(
            f"ours: TTFT {n:5d} tokens: {took.wall * 1e3:8.0f} ms wall, {took.cpu * 1e3:8.0f} ms"
            f" CPU ({budget}-token chunks)"
        )
    del model
    others: dict[str, tuple[dict[int, Took], dict[int, Took]]] = {}
    if not args.no_transformers:
        decode, ttft, hf_load = transformers_figures(
            str(path.parent), path.name, batches, lengths, args.steps, args.threads
        )
        print(f"\ntransformers generate(): load {hf_load:.1f} s")
        others["transformers"] = decode, ttft
    if args.llama_cpp:
        decode, ttft, ll_load = llama_cpp_figures(path, batches, lengths, args.steps, args.threads)
        print(f"llama.cpp (llama-cpp-python, 4-bit weights as stored): load {ll_load:.1f} s")
        others["llama.cpp"] = decode, ttft
    for name, (decode, ttft) in others.items():
        print(f"\n{name}: decode tokens/s, and ours as a multiple of theirs")
        print("batch   ours wall    CPU   theirs wall    CPU   ours/theirs wall    CPU")
        for batch in batches:
            if batch not in decode:
                continue
            o, t = ours[batch], decode[batch]
            print(
                f"{batch:5d} {batch / o.wall:11.1f} {batch / o.cpu:6.1f} {batch / t.wall:13.1f} "
                f"{batch / t.cpu:6.1f} {ratio(t.wall, o.wall):>18s} {ratio(t.cpu, o.cpu):>6s}"
            )
        print(f"{name}: TTFT ms, and their time as a multiple of ours")
        print("prompt  ours wall     CPU  theirs wall     CPU  theirs/ours wall    CPU")
        for n in lengths:
            o, t = our_ttft[n], ttft[n]
            print(
                f"{n:6d} {o.wall * 1e3:10.0f} {o.cpu * 1e3:7.0f} {t.wall * 1e3:12.0f} "
                f"{t.cpu * 1e3:7.0f} {ratio(t.wall, o.wall):>17s} {ratio(t.cpu, o.cpu):>6s}"
            )


if __name__ == "__main__":
    main()
