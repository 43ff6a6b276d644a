"""The scheduler's priority policy on a real block pool, step by step (engine/scheduler.py): queue order,
and a preemption that takes back the tokens a lower-priority request was already given this step."""

from __future__ import annotations

from engine import SamplingParams
from engine.block_pool import BlockPool
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence


def _seq(rid: str, n: int, priority: int, arrival: int) -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams(priority=priority), arrival_time_ns=arrival)


def _run(batch: ScheduledBatch) -> None:
    """What the engine does with a step's result: tokens computed, a new token for a finished prompt."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(1)


def test_the_queue_is_kept_by_priority_then_arrival_and_requeued_ones_go_first() -> None:
    sched = Scheduler(BlockPool(8, 4, root_hash=1, enable_prefix_caching=False), 4, 64, "priority")
    for rid, priority, arrival in (("a", 2, 1), ("b", 0, 2), ("c", 2, 3), ("d", 1, 4), ("e", 0, 5)):
        sched.add(_seq(rid, 3, priority, arrival))
    assert [s.request_id for s in sched.waiting] == ["b", "e", "d", "a", "c"]
    sched.add_imported(_seq("imported", 3, 2, 6))  # ahead of its priority's, behind more urgent ones
    assert [s.request_id for s in sched.waiting] == ["b", "e", "d", "imported", "a", "c"]
    fcfs = Scheduler(BlockPool(8, 4, root_hash=1), 4, 64)
    for rid, priority, arrival in (("a", 2, 1), ("b", 0, 2)):
        fcfs.add(_seq(rid, 3, priority, arrival))
    fcfs.add_imported(_seq("imported", 3, 5, 3))
    assert [s.request_id for s in fcfs.waiting] == ["imported", "a", "b"]


def test_a_preempted_request_already_in_the_step_gives_its_tokens_back() -> None:
    """A (priority 5) runs first, alone; B (priority 0) joins. When B needs a block and none is free, A is
    the victim although it comes before B in the running list and was already given its token this step:
    the step is B's alone, with A's token budget back, and A waits at the front of its priority."""
    pool = BlockPool(4, 4, root_hash=1, enable_prefix_caching=False)
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    a, b = _seq("a", 6, 5, 1), _seq("b", 8, 0, 2)
    sched.add(a)
    _run(sched.schedule())  # A's prompt: 2 blocks
    sched.add(b)
    step = sched.schedule()  # A's first decode token, B's prompt: 2 more blocks, the pool is full
    assert [s.request_id for s in step.seqs] == ["a", "b"] and pool.num_free_blocks == 0
    _run(step)
    step = sched.schedule()  # A's next token fits its blocks; B's needs a fifth block
    assert [s.request_id for s in step.preempted] == ["a"]
    assert [s.request_id for s in step.seqs] == ["b"] and step.num_new_tokens == [1]
    assert [s.request_id for s in sched.running] == ["b"] and list(sched.waiting) == [a]
    assert a.num_computed_tokens == 0 and not a.block_table and len(b.block_table) == 3
    assert pool.num_free_blocks == 1
