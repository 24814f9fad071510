"""The idle audit: proof, while the cluster runs, that every pool returns to fully free when idle.

Once the router has held no request for `settle_s` (nothing outstanding, nothing routed since) and
every healthy worker has sent a health report since it went idle, each worker must hold no request,
no transfer, no queued job and no KV block beyond its prefix cache (cached blocks count as free:
they are evictable). Every such moment is one audit, clean or not; each worker's held blocks at the
last audit are exported (`pdserve_idle_audit_*` on /metrics). A worker still holding something after
the KV lease has had time to expire leaks it: that is logged as an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.router.workers import WorkerRef

log = logging.getLogger(__name__)
SETTLE_S = 1.0  # idle this long before auditing: cancels and aborts are asynchronous


@dataclass
class AuditResult:
    at: float  # wall-clock time
    idle_s: float  # how long the router had been idle
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> what it still holds (nonzero only)
    blocks: dict[str, int] = field(default_factory=dict)  # worker -> KV blocks held beyond the prefix cache

    @property
    def clean(self) -> bool:
        return not self.held


class IdleAudit:
    def __init__(self, workers: list[WorkerRef], routed: Callable[[], int], leak_after_s: float,
                 settle_s: float = SETTLE_S) -> None:
        self.workers = workers
        self.routed = routed  # requests the router has placed so far (a retry counts too)
        self.leak_after_s = leak_after_s  # the KV lease and then some: past it, holding at idle is a leak
        self.settle_s = settle_s
        self.last: AuditResult | None = None
        self.clean = 0
        self.dirty = 0
        self._seen_routed = -1
        self._idle_since: float | None = None
        self._audited_at = 0.0

    def observe(self) -> AuditResult | None:
        """Call after every health round; returns the audit made now, if the cluster was idle long enough."""
        now = time.monotonic()
        routed = self.routed()
        busy = any(w.outstanding for w in self.workers)
        if busy or routed != self._seen_routed:
            self._seen_routed, self._idle_since = routed, None
            return None
        if self._idle_since is None:
            self._idle_since = now
            return None
        live = [w for w in self.workers if w.healthy]
        reported = all(w.reported_at > self._idle_since for w in live)
        if now - self._idle_since < self.settle_s or not reported or self._audited_at > now - self.settle_s:
            return None
        self._audited_at = now
        result = AuditResult(time.time(), now - self._idle_since)
        for w in live:
            result.blocks[w.name] = max(0, w.status.kv.held_blocks)
            held = w.status.holdings
            if held:
                result.held[w.name] = held
        self.last = result
        if result.clean:
            self.clean += 1
        else:
            self.dirty += 1
            level = logging.ERROR if result.idle_s > self.leak_after_s else logging.INFO
            log.log(level, "idle for %.1f s, yet workers hold %s%s", result.idle_s, result.held,
                    " (leaked: their leases have expired)" if level == logging.ERROR else "")
        return result


class AuditCollector:
    """The audit's figures for the router's /metrics."""

    def __init__(self, audit: IdleAudit) -> None:
        self.audit = audit

    def collect(self) -> Iterator[Metric]:
        audits = CounterMetricFamily("pdserve_idle_audits", "Audits of the pools while the cluster was idle; "
                                     "clean: every worker held nothing beyond its prefix cache", labels=["result"])
        audits.add_metric(["clean"], self.audit.clean)
        audits.add_metric(["dirty"], self.audit.dirty)
        yield audits
        held = GaugeMetricFamily("pdserve_idle_audit_held_blocks", "KV blocks a worker held beyond its prefix "
                                 "cache at the last idle audit (0 when the pools were fully free)", labels=["worker"])
        last = self.audit.last
        for name, blocks in (last.blocks.items() if last else ()):
            held.add_metric([name], blocks)
        yield held
