"""Continuous batching as pure state: which tokens of which sequences run in the next step.

This file decides, step by step, how a token budget is spent and who holds KV blocks:
1. Running sequences go first, oldest first: a decoding sequence costs 1 token, a sequence
   still in prefill gets its next chunk (what is left of the budget, so a long prompt is
   prefilled over several steps instead of stalling every running stream for one long step).
2. When a running sequence needs a block and none is free, the newest running sequence is
   preempted: its blocks are freed and it goes back to the front of the queue, to be
   recomputed (prompt plus the tokens it already made) when blocks allow.
3. Then waiting sequences are admitted in arrival order while budget and ``max_running``
   allow, and while the free blocks hold the whole context of the next one (prompt, plus the
   tokens it made if it was preempted) with one block to spare per running sequence (none are
   admitted in a step that had to preempt). With prefix caching, a sequence whose tokens begin
   with cached blocks takes them (``BlockAllocator.match``, ``adopt``), and its prefill starts
   after them; each chunk's full blocks are named for later ones in ``record``.
4. ``abort`` and ``finish`` free a sequence's blocks at once.
5. With ``spec_tokens`` > 0 a decoding sequence's chunk also carries a draft (prompt lookup,
   ``speculative.propose``), never past ``max_new`` nor the budget less a token for each
   running sequence after it (drafts never keep one from its step); ``record`` then takes the
   tokens the model accepted and rolls the cache back over the rejected draft positions.
``schedule()`` returns a frozen ``Batch``; ``record()`` takes the sampled tokens back. It must
not know about models, clocks, threads or asyncio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from replystream.engine.kv_cache import BlockAllocator, KVCacheStats, PrefixMatch
from replystream.engine.speculative import propose


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step."""

    token_budget: int = 128
    max_running: int = 32
    spec_tokens: int = 0  # draft tokens per decode step at most (0: no speculative decoding)
    spec_ngram: int = 3  # longest tail looked up in the context for a draft

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_running < 1:
            raise ValueError("token_budget and max_running must be at least 1")
        if self.spec_tokens < 0 or self.spec_ngram < 1:
            raise ValueError("spec_tokens must be >= 0 and spec_ngram >= 1")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run, the first at position ``start``.

    ``samples`` is true when the chunk reaches the sequence's last known token, so the step
    must sample the next one (a decode step, or the last chunk of a prefill). The last
    ``draft`` tokens are a speculative draft to verify, not yet part of the sequence.
    """

    seq_id: int
    tokens: tuple[int, ...]
    start: int
    samples: bool
    draft: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's work, and the sequences preempted while planning it.

    ``step`` counts the steps that ran something: an empty batch (nothing to run) carries the
    number of the last step that did. ``admitted``: the sequences admitted (or admitted again
    after a preemption) while planning it, each with the tokens it found cached."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[int, ...] = ()
    admitted: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that ended in ``record``: it made its last allowed token."""

    seq_id: int
    reason: str = "length"


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Queue and pool state as data."""

    waiting: int
    running: int
    steps: int
    preemptions: int
    finished: int
    aborted: int
    kv: KVCacheStats
    draft_proposed: int = 0  # draft tokens sent to the model for verification
    draft_accepted: int = 0  # of those, tokens the model agreed with
    # Tokens preemption threw away and a readmitted sequence computed again (those the
    # prefix cache still held for it are not: they are prefix hits).
    recomputed: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens found in cached blocks, not computed again


@dataclass(slots=True, eq=False)  # compared by identity
class _Sequence:
    seq_id: int
    tokens: list[int]  # prompt, then every token made so far
    max_new: int
    prompt_len: int
    computed: int = 0  # tokens whose keys and values are in the cache
    lost: int = 0  # tokens it had in the cache when it was last preempted

    @property
    def made(self) -> int:
        return len(self.tokens) - self.prompt_len


class Scheduler:
    """Plans steps over a ``BlockAllocator``; owns each sequence's tokens for recompute."""

    def __init__(self, allocator: BlockAllocator, config: SchedulerConfig | None = None) -> None:
        self.allocator = allocator
        self.config = config or SchedulerConfig()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # admission order: the last is the newest
        self._by_id: dict[int, _Sequence] = {}
        self._steps = 0
        self._preemptions = 0
        self._recomputed = 0
        self._prefix_hits = 0
        self._finished = 0
        self._aborted = 0
        self._proposed = 0
        self._accepted = 0

    def blocks_to_finish(self, prompt_len: int, max_new: int) -> int:
        """Blocks a sequence holds at most (the last token made is never run)."""
        return self.allocator.blocks_for(prompt_len + max_new - 1)

    def most_new_tokens(self, prompt_len: int) -> int:
        """Most tokens a sequence with this prompt may make and still fit the whole pool
        (0 or less: the prompt alone does not fit)."""
        return self.allocator.num_blocks * self.allocator.block_size - prompt_len + 1

    def add(self, seq_id: int, prompt: Sequence[int], max_new: int) -> None:
        """Queue a sequence.

        Raises:
            ValueError: an empty prompt, a reused id, or a sequence the whole pool cannot hold.
        """
        if not prompt or max_new < 1:
            raise ValueError("need a non-empty prompt and max_new >= 1")
        if self._find(seq_id) is not None:
            raise ValueError(f"sequence {seq_id} is already scheduled")
        if self.blocks_to_finish(len(prompt), max_new) > self.allocator.num_blocks:
            raise ValueError("the sequence needs more blocks than the pool has")
        seq = _Sequence(seq_id, list(prompt), max_new, len(prompt))
        self._by_id[seq_id] = seq
        self._waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def schedule(self) -> Batch:
        """Plan the next step (may preempt; reserves the blocks the chunks need)."""
        budget = self.config.token_budget
        chunks: list[ScheduledChunk] = []
        preempted: list[int] = []
        admitted: list[tuple[int, int]] = []
        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            n = min(len(seq.tokens) - seq.computed, budget)
            # A draft leaves a token of the budget to each running sequence after this one:
            # speculation may save steps, but never at the cost of another stream's token.
            later = len(self._running) - index - 1
            draft = self._draft(seq, budget - later) if n == 1 else ()
            while not self.allocator.can_hold(seq.seq_id, seq.computed + n + len(draft)):
                if draft:  # drop the draft before preempting anyone for it
                    draft = ()
                    continue
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if preempted and preempted[-1] == seq.seq_id:
                break  # it was the newest: nothing after it is running any more
            chunks.append(self._take(seq, n, draft))
            budget -= n + len(draft)
            index += 1
        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.config.max_running
        ):
            seq = self._waiting[0]
            match = self._admission(seq)
            if match is None:
                break
            seq.computed = self.allocator.adopt(seq.seq_id, match)
            self._prefix_hits += seq.computed
            # Counted as it is taken back: what the prefix cache kept of it is no recompute.
            self._recomputed += max(0, seq.lost - seq.computed)
            seq.lost = 0
            admitted.append((seq.seq_id, seq.computed))
            n = min(len(seq.tokens) - seq.computed, budget)
            self._running.append(self._waiting.popleft())
            chunks.append(self._take(seq, n))
            budget -= n
        if chunks:  # a plan with nothing in it runs no model pass, so it is not a step
            self._steps += 1
        return Batch(self._steps, tuple(chunks), tuple(preempted), tuple(admitted))

    def _admission(self, seq: _Sequence) -> PrefixMatch | None:
        # All of its context must fit, not only this step's chunk, and leave a block for each
        # running sequence's next token: admitted on less, it would be preempted by their
        # growth before its prefill pays off, and readmitted as soon as that freed its blocks,
        # over and over (a pool short by a little recomputed several times the useful work).
        # Cached blocks it begins with need no new block, but leave the free ones if idle.
        allocator = self.allocator
        match = allocator.match(seq.tokens)
        needed = allocator.blocks_for(len(seq.tokens)) - len(match.blocks)
        needed += allocator.idle_among(match.blocks)
        return match if needed + len(self._running) <= allocator.free_blocks else None

    def _draft(self, seq: _Sequence, budget: int) -> tuple[int, ...]:
        # A draft of k tokens makes up to k + 1: never more than the reply may still have.
        k = min(self.config.spec_tokens, budget - 1, seq.max_new - seq.made - 1)
        return propose(seq.tokens, self.config.spec_ngram, k) if k > 0 else ()

    def _take(self, seq: _Sequence, n: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        end = seq.computed + n
        self.allocator.reserve(seq.seq_id, end + len(draft))
        self._proposed += len(draft)
        tokens = (*seq.tokens[seq.computed : end], *draft)
        return ScheduledChunk(seq.seq_id, tokens, seq.computed, end == len(seq.tokens), len(draft))

    def _preempt(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.allocator.free(seq.seq_id)
        seq.lost, seq.computed = seq.computed, 0
        self._waiting.appendleft(seq)
        self._preemptions += 1

    def record(
        self, batch: Batch, sampled: Mapping[int, int | Sequence[int]]
    ) -> tuple[Finished, ...]:
        """Take a step's results: chunks are now cached, sampled tokens appended.

        A chunk with a draft takes the tokens its verification made (the accepted draft
        tokens, then the model's own); the cache keeps the positions up to the last accepted
        one and gives back blocks reserved past them. Sequences aborted since ``schedule`` are
        skipped. A sequence that made ``max_new`` tokens finishes here and frees its blocks.
        """
        finished: list[Finished] = []
        for chunk in batch.chunks:
            seq = self._find(chunk.seq_id)
            if seq is None or seq not in self._running or seq.computed != chunk.start:
                continue
            made = sampled.get(chunk.seq_id, ())
            new = [made] if isinstance(made, int) else list(made)
            if chunk.draft:
                accepted = len(new) - 1
                self._accepted += accepted
                seq.computed += len(chunk.tokens) - chunk.draft + accepted
                self.allocator.truncate(seq.seq_id, seq.computed)
            else:
                seq.computed += len(chunk.tokens)
            if chunk.samples:
                seq.tokens.extend(new)
            # The blocks this chunk filled, findable by later requests (with prefix caching).
            self.allocator.name_full_blocks(seq.seq_id, seq.tokens, seq.computed)
            if chunk.samples and seq.made >= seq.max_new:
                self._release(seq)
                self._finished += 1
                finished.append(Finished(seq.seq_id))
        return tuple(finished)

    def finish(self, seq_id: int) -> bool:
        """End a sequence early (a stop sequence); frees its blocks. False if unknown."""
        seq = self._find(seq_id)
        if seq is None:
            return False
        self._release(seq)
        self._finished += 1
        return True

    def abort(self, seq_id: int) -> bool:
        """Drop a sequence (cancelled); frees its blocks at once. False if unknown."""
        seq = self._find(seq_id)
        if seq is None:
            return False
        self._release(seq)
        self._aborted += 1
        return True

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        del self._by_id[seq.seq_id]
        self.allocator.free(seq.seq_id)

    def _find(self, seq_id: int) -> _Sequence | None:
        return self._by_id.get(seq_id)

    def running_ids(self) -> tuple[int, ...]:
        return tuple(s.seq_id for s in self._running)

    def waiting_ids(self) -> tuple[int, ...]:
        return tuple(s.seq_id for s in self._waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            waiting=len(self._waiting),
            running=len(self._running),
            steps=self._steps,
            preemptions=self._preemptions,
            finished=self._finished,
            aborted=self._aborted,
            kv=self.allocator.stats(),
            draft_proposed=self._proposed,
            draft_accepted=self._accepted,
            recomputed=self._recomputed,
            prefix_hit_tokens=self._prefix_hits,
        )
