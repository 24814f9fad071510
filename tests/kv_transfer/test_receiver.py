"""The receiving side of the handoff on a real engine: every failure path frees the reservation."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompts
from helpers import assert_pool_idle

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.engine_loop import EngineLoop
from pdserve.kv_transfer.codec import RawCodec, checksum
from pdserve.kv_transfer.interface import TransferError
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.state import IllegalTransition, Transfer, TransferState

ARCH = "tiny-llama"
GREEDY = SamplingParams.greedy(max_tokens=6, ignore_eos=True)


@pytest.fixture()
def sides(model_dirs):
    """A prefill engine holding one prefilled request, and a decode engine behind a receiver."""
    prefill = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    decode = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=8 * 2**20))
    outputs = []
    loop = EngineLoop(decode, outputs.extend).start()
    yield prefill, decode, KVReceiver(loop, lease_s=0.2), outputs
    loop.stop()


def prefilled(prefill: LLMEngine, prompt: list[int]) -> str:
    request_id = prefill.add_request(prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    return request_id


def reserve(receiver, prefill, request_id, transfer_id="t1"):
    handoff = prefill.export_handoff(request_id)
    return handoff, receiver.reserve(transfer_id, request_id, handoff.prompt_token_ids, handoff.params,
                                     handoff.num_computed_tokens)


def test_a_full_handoff_commits_and_decodes(sides, hf_reference):
    prefill, decode, receiver, outputs = sides
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=1)[0]
    request_id = prefilled(prefill, prompt)
    handoff, lease = reserve(receiver, prefill, request_id)
    assert lease.num_blocks == 3
    for layer in range(decode.kv_layout.num_layers):
        payload = RawCodec.encode(prefill.export_kv(request_id, layer=layer).data)
        receiver.receive_layer("t1", layer, payload, checksum(payload))
    receiver.commit("t1", handoff)
    prefill.release(request_id)
    deadline = time.time() + 10
    while not any(o.finished for o in outputs) and time.time() < deadline:
        time.sleep(0.01)
    assert outputs[-1].token_ids == hf_reference[ARCH].greedy(prompt, 6)
    assert_pool_idle(decode)


def test_bad_checksum_aborts_and_frees(sides, hf_reference):
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=2)[0])
    reserve(receiver, prefill, request_id)
    payload = RawCodec.encode(prefill.export_kv(request_id, layer=0).data)
    with pytest.raises(TransferError, match="checksum mismatch"):
        receiver.receive_layer("t1", 0, payload, checksum(payload) ^ 1)
    with pytest.raises(TransferError, match="no open transfer"):
        receiver.receive_layer("t1", 1, payload, checksum(payload))
    assert receiver.loop.call(lambda e: (len(e.requests), e.num_free_blocks)) == (0, decode.pool.num_blocks)


def test_commit_with_missing_layers_fails_and_frees(sides, hf_reference):
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 20, 20, seed=3)[0])
    handoff, _ = reserve(receiver, prefill, request_id)
    with pytest.raises(TransferError, match=r"layers \[0, 1\] never arrived"):
        receiver.commit("t1", handoff)
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_lease_expiry_frees_the_reservation(sides, hf_reference):
    prefill, decode, receiver, _ = sides
    request_id = prefilled(prefill, random_prompts(1, hf_reference[ARCH].vocab_size, 50, 50, seed=4)[0])
    reserve(receiver, prefill, request_id)
    assert receiver.loop.call(lambda e: e.num_free_blocks) < decode.pool.num_blocks
    assert receiver.expire_leases(now=time.time()) == []  # not yet
    assert receiver.expire_leases(now=time.time() + 1.0) == ["t1"]
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks
    assert not receiver.abort("t1", "again")  # idempotent


def test_reserve_refused_when_the_pool_is_full(sides):
    _, decode, receiver, _ = sides
    held = [receiver.reserve(f"t{i}", f"r{i}", [5] * 1000, GREEDY, 1000) for i in range(2)]
    while receiver.loop.call(lambda e: e.num_free_blocks) >= 1000 // decode.config.block_size + 1:
        held.append(receiver.reserve(f"t{len(held)}", f"r{len(held)}", [5] * 1000, GREEDY, 1000))
    with pytest.raises(TransferError, match="cannot take request 'big'.*KV blocks"):
        receiver.reserve("big-t", "big", [5] * 1000, GREEDY, 1000)
    for lease in held:
        receiver.abort(lease.transfer_id, "test over")
    assert receiver.num_in_flight == 0
    assert receiver.loop.call(lambda e: e.num_free_blocks) == decode.pool.num_blocks


def test_state_machine_rejects_illegal_moves():
    t = Transfer("t", "r")
    with pytest.raises(IllegalTransition):
        t.advance(TransferState.SUCCESS)
    t.advance(TransferState.RESERVED)
    t.advance(TransferState.TRANSFERRING)
    assert t.fail("boom") and not t.fail("twice") and t.error == "boom"
    with pytest.raises(IllegalTransition):
        t.advance(TransferState.SUCCESS)
