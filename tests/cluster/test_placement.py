"""Placement policies spread work over every worker of each pool, even when one request uses two pools."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.router.placement import POLICIES, WorkerRef


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_pool_takes_turns_when_requests_alternate_between_pools(policy):
    choose = POLICIES[policy]().choose
    prefill = [WorkerRef("prefill-0", "prefill", None)]
    decode = [WorkerRef(f"decode-{i}", "decode", None) for i in range(2)]
    picks = Counter()
    for _ in range(10):  # an idle cluster: every worker holds nothing, so least_loaded ties everywhere
        choose(prefill)
        picks[choose(decode).name] += 1
    assert picks == {"decode-0": 5, "decode-1": 5}


def test_least_loaded_prefers_the_emptier_worker():
    workers = [WorkerRef("a", "decode", None, outstanding=3), WorkerRef("b", "decode", None, outstanding=1)]
    assert {POLICIES["least_loaded"]().choose(workers).name for _ in range(4)} == {"b"}
