"""A profile with known costs, for the simulator's and the planner's tests."""

from __future__ import annotations

from pdserve.cluster.plan.costs import DecodeTable, HardwareProfile, TransferCost, WorkerCosts
from pdserve.engine.cost_model import StepCost


def synthetic_profile(prefill: StepCost, decode_s: float = 0.01, handoff: TransferCost = TransferCost(0.002, 0.0),
                      threads: tuple[int, ...] = (1,)) -> HardwareProfile:
    table = DecodeTable((1, 64), (16, 1024), ((decode_s, decode_s), (decode_s, decode_s)))
    return HardwareProfile(model="synthetic", model_digest="0" * 64, hardware="test", dtype="float32", block_size=16,
                           kv_bytes_per_token=1024, max_model_len=4096,
                           workers={t: WorkerCosts(t, prefill, table) for t in threads},
                           transfers={"shm": handoff})
