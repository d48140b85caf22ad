"""The continuous-batching scheduler, without a model: blocks, budget, preemption, abort."""

from __future__ import annotations

import random

import pytest

from replystream.engine.kv_cache import BlockAllocator
from replystream.engine.scheduler import Batch, Scheduler, SchedulerConfig


def make(
    blocks: int,
    block_size: int = 4,
    budget: int = 64,
    max_running: int = 8,
    *,
    prefix_caching: bool = False,
) -> Scheduler:
    allocator = BlockAllocator(blocks, block_size, prefix_caching=prefix_caching)
    return Scheduler(allocator, SchedulerConfig(budget, max_running))


def run(s: Scheduler, batch: Batch, token: int = 7) -> None:
    s.record(batch, {c.seq_id: token for c in batch.chunks if c.samples})


def test_admission_stops_when_free_blocks_run_out() -> None:
    s = make(blocks=5, block_size=4)
    for seq_id in range(3):
        s.add(seq_id, list(range(8)), max_new=4)  # 8 prompt tokens: 2 blocks each
    batch = s.schedule()
    assert [c.seq_id for c in batch.chunks] == [0, 1]  # the third would need blocks 5 and 6
    assert s.stats().waiting == 1
    assert s.stats().kv.free_blocks == 1


def test_admission_is_first_come_first_served() -> None:
    s = make(blocks=3, block_size=4)
    s.add(0, list(range(12)), max_new=1)  # needs all 3 blocks
    s.add(1, [1], max_new=1)
    s.add(2, [1], max_new=1)
    s.add(3, [1], max_new=1)
    first = s.schedule()
    assert [c.seq_id for c in first.chunks] == [0]  # the small ones do not jump the queue


def test_decode_steps_cost_one_token_per_running_sequence() -> None:
    s = make(blocks=16)
    s.add(0, [1, 2, 3], max_new=5)
    s.add(1, [4, 5], max_new=5)
    run(s, s.schedule())
    batch = s.schedule()
    assert [(c.seq_id, c.tokens, c.start, c.samples) for c in batch.chunks] == [
        (0, (7,), 3, True),
        (1, (7,), 2, True),
    ]


def test_chunked_prefill_lets_running_streams_decode_every_step() -> None:
    s = make(blocks=64, block_size=4, budget=8)
    s.add(0, [1, 2], max_new=50)
    run(s, s.schedule())  # sequence 0 is now decoding
    s.add(1, list(range(20)), max_new=5)  # a long prompt
    starts = []
    for _ in range(3):
        batch = s.schedule()
        assert batch.chunks[0].seq_id == 0 and len(batch.chunks[0].tokens) == 1
        assert batch.num_tokens <= 8
        starts.append([(c.start, len(c.tokens), c.samples) for c in batch.chunks if c.seq_id == 1])
        run(s, batch)
    # 20 prompt tokens go through in chunks of 7 (budget 8 minus one decode); the last samples
    assert starts == [[(0, 7, False)], [(7, 7, False)], [(14, 6, True)]]


def test_preemption_takes_the_newest_sequence_and_requeues_it_first() -> None:
    s = make(blocks=7, block_size=2, budget=64)
    for seq_id in range(4):
        s.add(seq_id, [1, 2], max_new=6)
    run(s, s.schedule())  # all four admitted with a block each: 3 free, one per other sequence
    batch = s.schedule()  # each needs a second block: the three oldest take the three free
    assert batch.preempted == (3,)
    assert [c.seq_id for c in batch.chunks] == [0, 1, 2]
    run(s, batch)
    run(s, s.schedule())
    batch = s.schedule()  # each needs a third block, and none is free: the newest goes
    assert batch.preempted == (2,)
    assert [c.seq_id for c in batch.chunks] == [0, 1]
    assert s.waiting_ids() == (2, 3)  # oldest preempted at the front
    assert s.stats().preemptions == 2


def test_preempted_sequence_is_recomputed_with_the_tokens_it_made() -> None:
    s = make(blocks=3, block_size=2, budget=64)
    s.add(0, [1, 2], max_new=3)
    s.add(1, [3, 4], max_new=3)
    run(s, s.schedule(), token=9)  # both sampled 9; each holds one block, one is free
    batch = s.schedule()  # 0 takes the free block; 1 has none for its next token
    assert batch.preempted == (1,)
    run(s, batch, token=8)
    run(s, s.schedule(), token=8)  # 0 makes its third token and finishes; 1 did not fit back
    assert s.running_ids() == ()
    again = s.schedule()
    assert [(c.seq_id, c.tokens, c.start, c.samples) for c in again.chunks] == [
        (1, (3, 4, 9), 0, True)
    ]


def test_admission_waits_for_the_whole_prompt_and_a_spare_block_per_running_sequence() -> None:
    s = make(blocks=6, block_size=4, budget=8)
    s.add(0, [1, 2], max_new=4)
    run(s, s.schedule())  # 0 decodes in its one block; 5 are free
    s.add(1, list(range(20)), max_new=1)  # 5 blocks: its first chunk would fit, all of it
    for _ in range(2):  # would too, but leave 0 nothing to grow into
        batch = s.schedule()
        assert [c.seq_id for c in batch.chunks] == [0]
        run(s, batch)
    batch = s.schedule()  # 0's last token: it finishes in this step
    run(s, batch)
    assert s.running_ids() == ()
    assert [c.seq_id for c in s.schedule().chunks] == [1]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_pool_short_by_a_little_does_not_recompute_over_and_over(prefix_caching: bool) -> None:
    """Eight 300-token prompts with 200-token replies on a pool that holds three of them.

    Admitted on a first chunk that fit, a sequence was preempted by the growth of those
    running before its prefill was done, and taken back as soon as that freed its blocks:
    176 preemptions, and eight times the useful tokens computed. Admitted only when all of
    its context fits with a block to spare per running sequence, few are preempted."""
    s = make(blocks=60, block_size=16, budget=128, max_running=32, prefix_caching=prefix_caching)
    for seq_id in range(8):  # prompts no other shares: a prefix hit is a readmission's own
        s.add(seq_id, [seq_id + 1, *range(1000, 1299)], max_new=200)
    computed = 0
    while s.has_work():
        batch = s.schedule()
        computed += batch.num_tokens
        run(s, batch)
    stats = s.stats()
    assert stats.finished == 8 and stats.kv.free_blocks == 60
    useful = 8 * (300 + 200 - 1)  # the last token made is never run
    assert computed == useful + stats.recomputed  # what the prefix cache kept is not counted
    assert stats.recomputed < 0.6 * useful, stats.recomputed / useful
    assert stats.preemptions <= 8


def test_abort_frees_blocks_at_once() -> None:
    s = make(blocks=8, block_size=4)
    s.add(0, list(range(10)), max_new=4)
    s.add(1, list(range(10)), max_new=4)
    batch = s.schedule()
    assert s.stats().kv.used_blocks == 6
    assert s.abort(0)
    assert s.stats().kv.used_blocks == 3
    run(s, batch)  # the step that was in flight for 0 is ignored
    assert s.running_ids() == (1,)
    assert not s.abort(0)


def test_abort_of_a_waiting_sequence() -> None:
    s = make(blocks=2, block_size=4)
    s.add(0, list(range(8)), max_new=1)
    s.add(1, list(range(8)), max_new=1)
    s.schedule()
    assert s.abort(1)
    assert s.stats().waiting == 0 and s.stats().aborted == 1


def test_length_finish_frees_blocks_in_record() -> None:
    s = make(blocks=8)
    s.add(0, [1, 2, 3], max_new=2)
    run(s, s.schedule())
    finished = s.record(s.schedule(), {0: 5})
    assert [f.seq_id for f in finished] == [0]
    assert s.stats().kv.used_blocks == 0 and s.stats().finished == 1


def test_a_sequence_larger_than_the_pool_is_refused() -> None:
    s = make(blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more blocks"):
        s.add(0, list(range(8)), max_new=2)


def test_no_block_leaks_after_1000_random_requests_with_cancellations() -> None:
    rng = random.Random(2024)
    s = make(blocks=40, block_size=4, budget=24, max_running=12)
    added, next_id = 0, 0
    while added < 1000 or s.has_work():
        for _ in range(rng.randint(0, 3)):
            if added < 1000:
                s.add(next_id, [1] * rng.randint(1, 30), max_new=rng.randint(1, 20))
                next_id, added = next_id + 1, added + 1
        batch = s.schedule()
        if rng.random() < 0.2 and next_id:
            s.abort(rng.randrange(next_id))  # may be running, waiting or long gone
        sampled = {c.seq_id: rng.randrange(100) for c in batch.chunks if c.samples}
        s.record(batch, sampled)
        if rng.random() < 0.05 and s.running_ids():
            s.finish(rng.choice(s.running_ids()))  # as a stop sequence would
        kv = s.stats().kv
        live = sum(len(s.allocator.table(i)) for i in s.running_ids())
        assert kv.used_blocks == live  # every used block belongs to a running sequence
        assert batch.num_tokens <= 24
    stats = s.stats()
    assert stats.kv.used_blocks == 0 and stats.kv.free_blocks == 40
    assert stats.finished + stats.aborted == 1000
    assert stats.preemptions > 0  # the pool was small enough to force preemptions
