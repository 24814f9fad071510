"""Continuous batching with a per-step token budget (Sarathi-Serve style chunked prefill).

Every sequence is a list of tokens of which the first `num_computed_tokens` have KV in the pool. A
step gives each scheduled sequence a number of new tokens to compute: one for a decoding sequence,
a chunk for one still prefilling. Running sequences are served first, in admission order; waiting
ones are admitted while the token budget, `max_num_seqs` and free blocks allow, after committed
imports (`ready`: KV already in the pool, waiting only for a batch slot). When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the head of the queue, to be recomputed (cheaply, through the
prefix cache, when its blocks were not evicted in the meantime).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_pool import BlockPool, hash_block, hash_prompt_blocks
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (drafts included)
    # Draft tokens to verify after a decoding sequence's newest token: they follow it in the step's
    # input, and the step samples a token after each of them as well as after the newest.
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the end of the sequence, so the step samples its next token."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens

    @property
    def input_ids(self) -> list[int]:
        first = self.seq.num_computed_tokens
        return self.seq.token_ids[first : first + self.num_tokens - len(self.draft)] + self.draft


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ready: deque[Sequence] = deque()  # committed imports, waiting for a batch slot
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_ready(self, seq: Sequence) -> None:
        """Queue a sequence whose KV is already in the pool (an import that was committed): it joins
        the batch at the first step with a slot under `max_num_seqs`, before any waiting prompt."""
        seq.status = SequenceStatus.WAITING
        self.ready.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute for every queued and running sequence (the work ahead)."""
        return sum(s.num_uncomputed_tokens for queue in (self.waiting, self.running, self.ready) for s in queue)

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            draft = self._fitting_draft(seq, budget, len(self.running) - index - 1)
            n = 1 + len(draft) if draft else min(seq.num_uncomputed_tokens, budget, self.config.chunk_limit)
            if not draft and not self._reserve_blocks_preempting(seq, n, out):
                break  # `seq` itself was preempted; everything after it already was
            out.chunks.append(ScheduledChunk(seq, n, draft))
            budget -= n
            index += 1

        while self.ready and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.ready[0]
            n = min(seq.num_uncomputed_tokens, budget, self.config.chunk_limit)
            need = self._blocks_needed(seq, n)
            # Imports queued behind it give their blocks back (recomputed later, through the prefix
            # cache); with nothing running to finish and free blocks, at last the head itself does.
            while not self.pool.can_allocate(need) and (len(self.ready) > 1 or not self.running):
                victim = self.ready.pop()
                self._preempt(victim)
                out.preempted.append(victim)
            if not self.ready or not self.pool.can_allocate(need):  # empty: the head itself gave way
                break
            self.ready.popleft()
            seq.block_table.extend(self.pool.allocate(need))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            # Its draft too, as a running sequence's (an import decodes from its first step here), where
            # it fits without taking a block the imports behind it need.
            draft = self._fitting_draft(seq, budget, len(self.ready)) if n == 1 else []
            out.chunks.append(ScheduledChunk(seq, 1 + len(draft), draft) if draft else ScheduledChunk(seq, n))
            budget -= out.chunks[-1].num_tokens

        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget, out):
                break
            self.waiting.popleft()
            budget -= out.chunks[-1].num_tokens
        return out

    def _fitting_draft(self, seq: Sequence, budget: int, later: int) -> list[int]:
        """The part of a decoding sequence's draft that fits the step's budget and the free blocks (its
        blocks taken), or [] when none does. Speculation never preempts anything: `later` running
        sequences after this one keep a block each for their own next token."""
        draft = seq.draft_token_ids[: budget - 1] if seq.num_uncomputed_tokens == 1 else []
        if not draft:
            return []
        need = self._blocks_needed(seq, 1 + len(draft))
        if not self.pool.can_allocate(need + later):
            return []
        seq.block_table.extend(self.pool.allocate(need))
        return draft

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _reserve_blocks_preempting(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        need = self._blocks_needed(seq, n)
        while not self.pool.can_allocate(need):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        # Reuse cached full blocks, but always leave at least one token to compute: the step that
        # computes it produces the logits to sample from, and it must not write into a shared block.
        cacheable = (seq.num_tokens - 1) // self.block_size * self.block_size
        hashes = hash_prompt_blocks(seq.token_ids[:cacheable], self.block_size, seq.block_extra)
        hits = self.pool.lookup_prefix(hashes)
        seq.block_table = list(hits)
        seq.block_hashes = hashes[: len(hits)]
        seq.num_computed_tokens = len(hits) * self.block_size
        n = min(seq.num_uncomputed_tokens, budget, self.config.chunk_limit)
        need = self._blocks_needed(seq, n)
        if not self.pool.can_allocate(need):
            self.pool.free(hits)
            seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
            return False
        seq.block_table.extend(self.pool.allocate(need))
        self.pool.count_lookup(len(hashes), len(hits))
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.chunks.append(ScheduledChunk(seq, n))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed_tokens = [], [], 0
        seq.exact_kv = True  # recomputed from its tokens when it comes back
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # --- after the forward pass -----------------------------------------------------------------
    def mark_computed(self, chunk: ScheduledChunk) -> None:
        """Advance the sequence past the chunk and publish blocks it filled to the prefix cache."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_tokens
        self.publish_full_blocks(seq)

    def mark_verified(self, chunk: ScheduledChunk) -> None:
        """After a verifying step whose sampled tokens are appended: every token but the newest has its
        KV now (the drafts it accepted), and the blocks that only held rejected drafts go back."""
        seq = chunk.seq
        seq.num_computed_tokens = seq.num_tokens - 1
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        self.publish_full_blocks(seq)

    def publish_full_blocks(self, seq: Sequence) -> None:
        if not seq.exact_kv:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            start, end = i * self.block_size, (i + 1) * self.block_size
            h = hash_block(parent, seq.token_ids[start:end], seq.block_extra(start, end))
            seq.block_hashes.append(h)
            self.pool.cache_block(seq.block_table[i], h, parent)

    def hold(self, seq: Sequence) -> bool:
        """Take a decoding sequence (running, or a committed import waiting for its slot) out of the
        batch with its blocks (HELD), to be moved; False, changing nothing, for any other."""
        queue = self.running if seq in self.running else self.ready if seq in self.ready else None
        if queue is None or seq.num_uncomputed_tokens != 1:
            return False
        queue.remove(seq)
        seq.status = SequenceStatus.HELD
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence; a prefill-only one keeps its blocks (HELD) until `release`."""
        seq.finish_reason = reason
        for queue in (self.running, self.waiting, self.ready):
            if seq in queue:
                queue.remove(seq)
                break
        if seq.prefill_only and reason == "prefilled":
            seq.status = SequenceStatus.HELD
            return
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
