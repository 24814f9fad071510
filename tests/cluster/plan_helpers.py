"""A profile with known costs, for the simulator's and the planner's tests."""

from __future__ import annotations

from dataclasses import replace

from pdserve.cluster.plan.costs import DecodeTable, EncodeCost, HardwareProfile, TransferCost, WorkerCosts
from pdserve.engine.cost_model import StepCost


def synthetic_profile(prefill: StepCost, decode_s: float = 0.01, handoff: TransferCost = TransferCost(0.002, 0.0),
                      threads: tuple[int, ...] = (1,)) -> HardwareProfile:
    table = DecodeTable((1, 64), (16, 1024), ((decode_s, decode_s), (decode_s, decode_s)))
    return HardwareProfile(model="synthetic", model_digest="0" * 64, hardware="test", dtype="float32", block_size=16,
                           kv_bytes_per_token=1024, max_model_len=4096,
                           workers={t: WorkerCosts(t, prefill, table) for t in threads},
                           transfers={"shm": handoff})


TOWER = EncodeCost(a=0.01, per_image=0.15, per_token=0.0)  # an image pass far longer than a prompt pass
RARE_LONG_TOWER = EncodeCost(a=0.0, per_image=0.6, per_token=0.0)


def vision_profile(threads: tuple[int, ...] = (1,), tower: EncodeCost = TOWER) -> HardwareProfile:
    """A vision-language model's: `synthetic_profile`'s costs, and an image pass."""
    profile = synthetic_profile(StepCost(0.002, 0.00005, 0.0), decode_s=0.004, threads=threads)
    profile.workers = {t: replace(c, encode=tower) for t, c in profile.workers.items()}
    profile.embedding_bytes_per_token = 256
    return profile
