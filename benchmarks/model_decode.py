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
weights where ours reads 513) as a third column (installed by hand: docs/dependencies.md).
Both sides use ``--threads`` BLAS/torch threads (1 by default: the serving engine's setting).
Every peer is loaded first, then each item (a batch size, a prompt length) is measured on ours
and on each peer in turn, so the two figures of a ratio come from the same minute of a shared
machine.

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

from replystream.cli_values import positive_int
from replystream.engine.gguf_engine import GGUF_ENGINE_DEFAULTS, load_gguf_model
from replystream.engine.gguf_file import open_gguf
from replystream.engine.kv_cache import PagedKVCache
from replystream.engine.model import Chunk, TinyModel
from replystream.engine.smollm2_weights import SMOLLM2_INSTALL, smollm2_path
from tool_main import tool_main

PREFIX = 64  # prompt tokens per sequence before decode is timed


def counts(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1 (batch sizes, prompt lengths)."""
    return [positive_int(part) for part in text.split(",")]


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


@dataclass(frozen=True, slots=True)
class Peer:
    """Another implementation on the same GGUF, measured item by item beside ours."""

    name: str
    load_s: float
    decode: Callable[[int], Took | None]  # median decode step at a batch size (None: not run)
    ttft: Callable[[int], Took]  # time to the first token of a prompt of that many tokens


def transformers_peer(path: Path, steps: int, threads: int) -> Peer:
    """``generate()`` in float32 on the weights ``transformers`` dequantises from the GGUF."""
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
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
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

    def decode(batch: int) -> Took:
        ids = torch.tensor(rng.integers(100, 49152, (batch, PREFIX)))
        gaps = []
        for _ in range(3):
            clock = StepClock()
            generate(ids, 1 + steps, clock)
            gaps += [
                Took(b.wall - a.wall, b.cpu - a.cpu)
                for a, b in zip(clock.marks, clock.marks[1:], strict=False)
            ]
        return median_took(gaps)

    def ttft(length: int) -> Took:
        return timed(partial(generate, torch.tensor(rng.integers(100, 49152, (1, length))), 1))

    return Peer("transformers", load_s, decode, ttft)


def llama_cpp_peer(path: Path, context: int, steps: int, threads: int) -> Peer:
    """llama.cpp (``llama-cpp-python``) on the GGUF itself, with its own 4-bit kernels.

    Decode at batch 1 only: the binding's ``eval`` runs one sequence, so larger batches are
    left out rather than faked with one-at-a-time runs."""
    from llama_cpp import Llama  # type: ignore[import-not-found, unused-ignore]

    began = time.perf_counter()
    llm = Llama(
        str(path),
        n_ctx=context,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=256,
        verbose=False,
    )
    load_s = time.perf_counter() - began
    rng = np.random.default_rng(0)

    def decode(batch: int) -> Took | None:
        if batch != 1:
            return None
        prompt = [int(t) for t in rng.integers(100, 49152, PREFIX)]
        took = []
        for _ in range(3):
            llm.reset()  # type: ignore[no-untyped-call, unused-ignore]
            llm.eval(prompt)
            took += [timed(partial(llm.eval, [int(t)])) for t in rng.integers(100, 1000, steps)]
        return median_took(took)

    def ttft(length: int) -> Took:
        prompt = [int(t) for t in rng.integers(100, 49152, length)]
        llm.reset()  # type: ignore[no-untyped-call, unused-ignore]
        return timed(partial(llm.eval, prompt))

    return Peer("llama.cpp", load_s, decode, ttft)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--batches", type=counts, default="1,4,16,32")
    parser.add_argument("--ttft", type=counts, default="128,1024,4096")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama-cpp-python's figures")
    args = parser.parse_args()
    batches: list[int] = args.batches
    lengths: list[int] = args.ttft
    path = smollm2_path()
    if path is None:
        raise SystemExit(f"the SmolLM2 weights are not installed: {SMOLLM2_INSTALL}")
    # Every position must fall in the model's context, which the file's header says: read
    # alone, before the weights are dequantised, so that a mistake is told at once.
    context = open_gguf(path).config.context
    if PREFIX + args.steps > context:
        parser.error(
            f"argument --steps: at most {context - PREFIX} (the model's context is "
            f"{context}, after a prompt of {PREFIX}), got {args.steps}"
        )
    if max(lengths) > context:
        parser.error(f"argument --ttft: at most the model's context, {context}, got {max(lengths)}")
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
    peers = []
    if not args.no_transformers:
        peers.append(transformers_peer(path, args.steps, args.threads))
    if args.llama_cpp:
        context = max([*lengths, PREFIX + args.steps]) + 8
        peers.append(llama_cpp_peer(path, context, args.steps, args.threads))
    for peer in peers:
        print(f"{peer.name}: load {peer.load_s:.1f} s")
    print("each row: ours, then each peer on the same item, so all share the same minute")
    with threadpool_limits(limits=args.threads, user_api="blas"):
        copy = copy_bandwidth(args.threads)
        read_only = read_bandwidth()
        print(
            f"measured memory bandwidth on {args.threads} thread(s): {copy / 1e9:.1f} GB/s "
            f"(512 MiB NumPy copies, read + write), {read_only / 1e9:.1f} GB/s (BLAS dot, read)"
        )
        ours: dict[int, Took] = {}
        theirs: dict[tuple[str, int], Took | None] = {}
        reads: dict[int, float] = {}
        for batch in batches:
            ours[batch], reads[batch] = ours_decode(model, batch, args.steps)
            for peer in peers:
                theirs[peer.name, batch] = peer.decode(batch)
        budget = GGUF_ENGINE_DEFAULTS.token_budget
        our_ttft: dict[int, Took] = {}
        their_ttft: dict[tuple[str, int], Took] = {}
        for n in lengths:
            our_ttft[n] = ours_ttft(model, n, budget)
            for peer in peers:
                their_ttft[peer.name, n] = peer.ttft(n)
    print(
        "\nours: batch  ms/step wall    CPU   tok/s wall    CPU  MiB/step  GB/s wall  CPU"
        "  of copy (wall CPU)  of read (wall CPU)"
    )
    for batch in batches:
        step, read = ours[batch], reads[batch]
        print(
            f"      {batch:5d} {step.wall * 1e3:12.1f} {step.cpu * 1e3:6.1f} "
            f"{batch / step.wall:11.1f} {batch / step.cpu:6.1f} {read / 2**20:9.0f} "
            f"{read / step.wall / 1e9:10.1f} {read / step.cpu / 1e9:4.1f} "
            f"{read / step.wall / copy:13.0%} {read / step.cpu / copy:4.0%} "
            f"{read / step.wall / read_only:13.0%} {read / step.cpu / read_only:4.0%}"
        )
    for n, took in our_ttft.items():
        print(
            f"ours: TTFT {n:5d} tokens: {took.wall * 1e3:8.0f} ms wall, {took.cpu * 1e3:8.0f} ms"
            f" CPU ({budget}-token chunks)"
        )
    for peer in peers:
        print(f"\n{peer.name}: decode tokens/s, and ours as a multiple of theirs")
        print("batch   ours wall    CPU   theirs wall    CPU   ours/theirs wall    CPU")
        for batch in batches:
            o, t = ours[batch], theirs[peer.name, batch]
            if t is None:
                continue
            print(
                f"{batch:5d} {batch / o.wall:11.1f} {batch / o.cpu:6.1f} {batch / t.wall:13.1f} "
                f"{batch / t.cpu:6.1f} {ratio(t.wall, o.wall):>18s} {ratio(t.cpu, o.cpu):>6s}"
            )
        print(f"{peer.name}: TTFT ms, and their time as a multiple of ours")
        print("prompt  ours wall     CPU  theirs wall     CPU  theirs/ours wall    CPU")
        for n in lengths:
            o, t = our_ttft[n], their_ttft[peer.name, n]
            print(
                f"{n:6d} {o.wall * 1e3:10.0f} {o.cpu * 1e3:7.0f} {t.wall * 1e3:12.0f} "
                f"{t.cpu * 1e3:7.0f} {ratio(t.wall, o.wall):>17s} {ratio(t.cpu, o.cpu):>6s}"
            )


if __name__ == "__main__":
    tool_main(main)
