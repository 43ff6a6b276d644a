"""Continuous batching with chunked prefill under a per-step token budget, and preemption by recompute.

Each step first serves running sequences (one decode token each, or the next chunk of an unfinished
prefill), then admits waiting ones while the token budget, ``max_num_seqs`` and free blocks allow. When
blocks run out, the most recently admitted running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed (mostly from the prefix cache) later.

Under the ``priority`` policy (vLLM's) the queue is kept in order of each request's priority (lower
first), then arrival; imported and preempted requests go first among their priority's; and the running
request preempted is the one with the highest priority value (the latest arrival among equals), even if it
was already given tokens this step (they are taken back).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.lora import LoRASlots
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        block_pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        lora: LoRASlots | None = None,
    ) -> None:
        """``lora``: the LoRA adapters' slots; a request takes its adapter's when admitted and gives it back
        when preempted or finished, and one whose adapter finds no slot is passed over until one frees."""
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        self.pool = block_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.lora = lora
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._queue(seq, first=False)

    def _queue(self, seq: Sequence, first: bool) -> None:
        """Into the waiting queue: at its end (``first``: its front), or under the priority policy at the
        end (front) of the requests of its priority."""
        if self.policy == "fcfs":
            if first:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        p = seq.params.priority
        for i, other in enumerate(self.waiting):
            if other.params.priority > p or (first and other.params.priority == p):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def _victim(self) -> Sequence:
        """The running request to preempt: the latest admitted (fcfs), or the one with the highest
        priority value, latest arrival among equals (priority)."""
        if self.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda s: (s.params.priority, s.arrival_time_ns))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.waiting)

    @property
    def num_running_tokens(self) -> int:
        return sum(s.num_tokens for s in self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not self.pool.append_slots(seq, seq.num_computed_tokens + n):
                victim = self._victim()
                before = self.running.index(victim) < i
                self._preempt(victim, batch)
                if victim is seq:
                    break
                if before:  # passed over already (priority policy): its tokens this step are taken back
                    i -= 1
                    if victim in batch.seqs:
                        k = batch.seqs.index(victim)
                        budget += batch.num_new_tokens[k]
                        del batch.seqs[k], batch.num_new_tokens[k]
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
        if batch.preempted:
            return batch
        j = 0  # the first waiting request not passed over (a LoRA adapter with no slot free)
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[j]
            if (
                seq.lora_name is not None
                and self.lora is not None
                and not self.lora.can_admit([seq.lora_name])
            ):
                j += 1
                continue
            if seq.block_table:  # imported KV: blocks already hold its computed tokens
                n = min(seq.num_uncomputed_tokens, budget)
                if not self.pool.append_slots(seq, seq.num_computed_tokens + n):
                    break
            else:
                hits = self.pool.match_prefix(seq)
                n = min(seq.num_tokens - len(hits) * self.pool.block_size, budget)
                if not self.allocate_prompt(seq, hits, n):
                    break
            self.admit(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def allocate_prompt(self, seq: Sequence, hits: list[int], n: int) -> bool:
        """Blocks for a new prompt's cached prefix (``hits``, from ``BlockPool.match_prefix``) and its next
        ``n`` tokens; the cached tokens count as computed. False, changing nothing, when they do not fit."""
        num_cached = len(hits) * self.pool.block_size
        if not self.pool.allocate_with_prefix(seq, hits, num_cached + n):
            return False
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_cached
        return True

    def admit_next(self) -> Sequence:
        """Move the first waiting sequence to the running ones, as ``schedule`` admits it (for a caller that
        allocated its slots itself: the engine's lookahead step)."""
        return self.admit(self.waiting[0])

    def admit(self, seq: Sequence) -> Sequence:
        """Move waiting ``seq`` to the running ones; it takes its LoRA adapter's slot."""
        if seq is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        if seq.lora_name is not None and self.lora is not None:
            seq.lora_slot = self.lora.acquire(seq.lora_name)
        if not seq.first_scheduled_ns:
            seq.first_scheduled_ns = time.time_ns()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0 and self.lora is not None:
            self.lora.release(seq.lora_slot)
        seq.lora_slot = -1

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._release_lora(seq)
        self.running.remove(seq)
        self.pool.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._queue(seq, first=True)
        self.num_preemptions += 1
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues; its blocks are freed unless it holds its KV for a transfer."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release_lora(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.hold_kv:
            self.pool.free(seq)

    def add_imported(self, seq: Sequence) -> None:
        """Queue a sequence whose blocks already hold its computed tokens (KV imported from a prefill
        worker); it is admitted ahead of new prompts (of its priority, under the priority policy)."""
        self._queue(seq, first=True)
