"""Continuous-batching scheduler of the colocated engine.

Request lifecycle (each stage is a queue):
  waiting  --admit (KV blocks for the next chunk, prefix-cache hit first)-->  running
  running  --chunk after chunk until the prompt is computed, then one token a step--> running
  running  --EOS / stop / max_tokens / abort-->  finished (blocks freed)
  running  --KV pool full: the newest running request is preempted-->  waiting (front),
           its blocks freed; it is recomputed (prompt + tokens so far) when readmitted.

Every step has a token budget (``max_num_batched_tokens``) and a cap on the running batch
(``schedule(max_running)``: the engine's, from its ITL target; at most ``max_num_seqs``).
Running requests are served first (oldest first), then waiting ones in arrival order, while
the batch is below the cap; a cap below the running batch admits nothing and preempts
nothing. Without chunked prefill a prompt is computed in one step; with it, a prompt takes
at most the budget left in each step, so decode steps stay short while a long prompt is
being prefilled. The scheduler owns the sequences and the block manager; it touches no
tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_hash import hash_blocks
from engine.block_manager import BlockManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class BatchLimits:
    """What one step may hold, as the engine derives it from its ``EngineConfig`` (which
    validates the numbers)."""

    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget: the chunk size when chunked
    chunked_prefill: bool


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, from seq.num_computed

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerStep:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, limits: BatchLimits, blocks: BlockManager) -> None:
        self.limits = limits
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    # -- queue management ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its blocks (computed by a prefill worker)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        self._by_id[seq.request_id] = seq
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished, free its blocks and drop it from the queues. Idempotent."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.release(seq)
        self._by_id.pop(seq.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step --------------------------------------------------------------------
    def schedule(self, max_running: int | None = None) -> SchedulerStep:
        """The next step: the running sequences' tokens, then waiting ones admitted while
        fewer than ``max_running`` (default: ``max_num_seqs``) run."""
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.pending
            if self.limits.chunked_prefill:
                n = min(n, budget)
            if not self._grow(seq, n, preempted):
                break  # seq itself was preempted: it was the last one running
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        if not preempted:
            cap = self.limits.max_num_seqs if max_running is None else max_running
            self._admit(scheduled, budget, min(cap, self.limits.max_num_seqs))
        return SchedulerStep(tuple(scheduled), tuple(preempted))

    def _grow(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Ensure blocks for ``n`` more tokens of a running seq, preempting the newest."""
        need = self.blocks.blocks_needed(seq.num_computed + n) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _admit(self, scheduled: list[ScheduledSeq], budget: int, max_running: int) -> None:
        limits = self.limits
        while self.waiting and budget > 0 and len(self.running) < max_running:
            seq = self.waiting[0]
            hit_blocks: list[int] = []
            if seq.num_computed == 0 and not seq.block_table:
                hit_blocks = self.match_prefix(seq)
            n = seq.pending
            if limits.chunked_prefill:
                n = min(n, budget)
            elif n > budget and scheduled:
                self.undo_hit(seq, hit_blocks)
                break  # whole prompts only: wait for an emptier step
            need = self.blocks.blocks_needed(seq.num_computed + n) - len(seq.block_table)
            if need > 0 and not self.blocks.can_allocate(need):
                self.undo_hit(seq, hit_blocks)
                break  # head-of-line waits for blocks; FCFS keeps fairness
            if need > 0:
                seq.block_table.extend(self.blocks.allocate(need))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Give a fresh sequence the cached blocks of its longest cached prefix."""
        bs = self.blocks.block_size
        # At least one token must be computed to produce logits, so the cached prefix
        # covers at most num_tokens - 1 tokens.
        ids = seq.all_ids
        hashes = hash_blocks(ids[: len(ids) - 1], bs)
        hit = self.blocks.match_prefix(hashes)
        if hit.block_ids:
            seq.block_table = list(hit.block_ids)
            seq.block_hashes = list(hashes[: len(hit.block_ids)])
            seq.num_exported_blocks = len(hit.block_ids)  # cached: computed or loaded before
            seq.num_computed = hit.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
        return list(hit.block_ids)

    def undo_hit(self, seq: Sequence, hit_blocks: list[int]) -> None:
        if hit_blocks:
            self.blocks.free(hit_blocks)
            seq.block_table = []
            seq.block_hashes = []
            seq.num_exported_blocks = 0
            seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Free a sequence's blocks and forget its progress (it keeps its tokens)."""
        if seq.block_table:
            self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_exported_blocks = 0
        seq.num_computed = 0

    # -- after the forward pass ------------------------------------------------------
    def advance(self, item: ScheduledSeq) -> None:
        """Record that ``item``'s tokens now have KV; publish newly full blocks' hashes."""
        seq = item.seq
        seq.num_computed += item.num_tokens
        bs = self.blocks.block_size
        full = seq.num_computed // bs
        done = len(seq.block_hashes)
        if full > done:
            ids = seq.all_ids
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            new = hash_blocks(
                ids[done * bs : full * bs], bs, *(() if parent is None else (parent,))
            )
            for j, h in enumerate(new, start=done):
                self.blocks.commit_full_block(seq.block_table[j], h)
            seq.block_hashes.extend(new)
