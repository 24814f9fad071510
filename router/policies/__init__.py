"""Placement policies, one module each behind one interface (`base.PlacementPolicy`).

`make_policy` builds the prefill and the decode pool's policy from the manifest's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.router.policies.base import Choice, PlacementPolicy, RouteRequest
from pdserve.router.policies.cache_aware import CacheAware
from pdserve.router.policies.estimated_ttft import EstimatedTTFTDecode, EstimatedTTFTPrefill, TransferCost
from pdserve.router.policies.kv_cost import KVCost
from pdserve.router.policies.least_loaded import LeastLoaded
from pdserve.router.policies.round_robin import RoundRobin

__all__ = ["POLICY_NAMES", "Choice", "PlacementPolicy", "RouteRequest", "TransferCost", "make_policy"]
POLICY_NAMES = ("round_robin", "least_loaded", "cache_aware", "kv_cost", "estimated_ttft")


def make_policy(name: str, pool: str, transfer: TransferCost, options: dict[str, Any] | None = None) -> PlacementPolicy:
    """The policy `name` for `pool` ("prefill" or "decode"); `options` holds cache_aware's thresholds
    (`balance_abs`, `balance_rel`, `match_threshold`) and kv_cost's `overlap_weight`."""
    options = options or {}
    makers: dict[str, Callable[[], PlacementPolicy]] = {
        "round_robin": RoundRobin,
        "least_loaded": LeastLoaded,
        "cache_aware": lambda: CacheAware(**{k: options[k] for k in ("balance_abs", "balance_rel", "match_threshold")
                                             if k in options}),
        "kv_cost": lambda: KVCost(**{k: options[k] for k in ("overlap_weight",) if k in options}),
        "estimated_ttft": (lambda: EstimatedTTFTPrefill(transfer)) if pool == "prefill" else EstimatedTTFTDecode,
    }
    if name not in makers:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return makers[name]()
