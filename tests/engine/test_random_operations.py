"""The engine under random interleavings of what workers do to it: requests added (some sharing
prefixes, some prefill-only), steps, aborts in every state, held requests handed off into the same
engine (export, import into the blocks reserved beside the prefix it caches, commit) or released,
in a pool small enough that requests wait for room, are preempted and evict cached blocks.

After every operation, each block's reference count is the number of live requests whose block
table holds it, and every block no request holds is free (none leaked, none freed twice). Every
greedy request that runs to its length has exactly transformers' tokens, handed off or not. At the
end everything is aborted and the pool is idle. Derandomized: CI runs the same examples every time."""

from __future__ import annotations

import dataclasses
from collections import Counter

from helpers import random_prompts
from fuzz_strategies import fuzz_settings
from helpers import assert_pool_idle
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_pool import OutOfBlocks
from pdserve.engine.sequence import SequenceStatus

ARCH = "tiny-llama"
POOL_BLOCKS = 10


class EngineOperations(RuleBasedStateMachine):
    model_dir = None  # set by the test: hypothesis makes the machines
    reference = None

    def __init__(self) -> None:
        super().__init__()
        probe = LLMEngine(self.model_dir, EngineConfig(kv_memory_bytes=16 * 2**20))
        self.block_size = probe.config.block_size
        self.engine = LLMEngine(self.model_dir, EngineConfig(
            kv_memory_bytes=POOL_BLOCKS * probe.kv_layout.bytes_per_block, max_model_len=POOL_BLOCKS * self.block_size,
            max_num_batched_tokens=64, max_num_seqs=4))
        self.prefixes = random_prompts(3, self.reference.vocab_size, 8, 40, seed=21)
        self.expected: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt, max_tokens), greedy
        self.finished = 0

    # --- operations -----------------------------------------------------------------------------
    @rule(prefix=st.integers(0, 3), suffix=st.integers(1, 60), max_tokens=st.integers(1, 24),
          prefill_only=st.booleans(), seed=st.integers(0, 2**16))
    def add(self, prefix: int, suffix: int, max_tokens: int, prefill_only: bool, seed: int) -> None:
        prompt = (self.prefixes[prefix] if prefix < 3 else []) + random_prompts(
            1, self.reference.vocab_size, suffix, suffix, seed=seed)[0]
        params = SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True)
        request_id = self.engine.add_request(prompt, params, prefill_only=prefill_only and max_tokens > 1)
        self.expected[request_id] = (prompt, max_tokens)

    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for out in self.engine.step():
                if out.finished and out.finish_reason == "length":
                    prompt, max_tokens = self.expected.pop(out.request_id)
                    assert out.token_ids == self.reference.greedy(prompt, max_tokens), out.request_id
                    self.finished += 1

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.engine.requests)))
        assert self.engine.abort_request(request_id)
        self.expected.pop(request_id, None)

    @precondition(lambda self: self._held())
    @rule(data=st.data(), hand_off=st.booleans())
    def release_or_hand_off(self, data: st.DataObject, hand_off: bool) -> None:
        """Release a held request; first, maybe, continue it in a new request that imports its KV."""
        request_id = data.draw(st.sampled_from(self._held()))
        if hand_off:
            self._hand_off(request_id)
        self.engine.release(request_id)
        self.expected.pop(request_id, None)

    def _hand_off(self, request_id: str) -> None:
        engine = self.engine
        handoff = engine.export_handoff(request_id)
        successor = f"{request_id}-imported"
        try:
            reservation = engine.begin_import(successor, handoff.prompt_token_ids, handoff.params,
                                              handoff.num_computed_tokens)
        except OutOfBlocks:
            return
        missing = list(range(reservation.cached_blocks, len(reservation.block_ids)))
        if missing:  # the blocks it found cached are shared: never written
            kv = engine.export_kv(request_id, block_indices=missing)
            engine.import_kv(dataclasses.replace(kv, request_id=successor))
        engine.commit_import(dataclasses.replace(handoff, request_id=successor))
        self.expected[successor] = self.expected[request_id]

    def _held(self) -> list[str]:
        return sorted(r for r, seq in self.engine.requests.items() if seq.status == SequenceStatus.HELD)

    # --- what holds after every operation -------------------------------------------------------
    @invariant()
    def every_block_is_held_exactly_by_its_requests(self) -> None:
        pool = self.engine.pool
        holders = Counter(b for seq in self.engine.requests.values() for b in seq.block_table)
        refcounts = [pool.refcount(b) for b in range(pool.num_blocks)]
        assert refcounts == [holders[b] for b in range(pool.num_blocks)]
        assert pool.num_free == refcounts.count(0)

    def teardown(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        assert_pool_idle(self.engine)


def test_random_operations_keep_the_pool_consistent_and_outputs_exact(model_dirs, hf_reference):
    EngineOperations.model_dir, EngineOperations.reference = model_dirs[ARCH], hf_reference[ARCH]
    run_state_machine_as_test(EngineOperations, settings=fuzz_settings(60))
