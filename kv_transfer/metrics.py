"""Prometheus figures of the KV transfers a worker sent, per transport and codec.

Each worker keeps its own registry and hands its text exposition to the router with every health
report; the router re-exports it with the worker's name (`router.metrics`), so one scrape of the
router sees every worker. The text format is data, never code: safe to move between processes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Handoffs run from about a millisecond (a short prompt over shared memory) to seconds (long prompts
# over a slow link).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OUTCOMES = ("success", "recomputed", "failed")  # recomputed: the decode worker rebuilt the KV from the tokens


class TransferMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["transport", "codec"]
        self.bytes = Counter("pdserve_kv_transfer_bytes", "Encoded KV bytes sent to decode workers",
                             labels, registry=self.registry)
        self.duration = Histogram("pdserve_kv_transfer_duration_seconds",
                                  "KV handoff time: reservation granted to commit", labels,
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.transfers = Counter("pdserve_kv_transfers", "KV handoffs ended, by outcome", labels + ["outcome"],
                                 registry=self.registry)

    def ended(self, transport: str, codec: str, outcome: str, sent_bytes: int = 0,
              seconds: float | None = None) -> None:
        """One handoff ended. `transport` is "none" when nothing was sent (recomputed by choice)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown transfer outcome {outcome!r}; one of {', '.join(OUTCOMES)}")
        self.transfers.labels(transport, codec, outcome).inc()
        if sent_bytes:
            self.bytes.labels(transport, codec).inc(sent_bytes)
        if seconds is not None:
            self.duration.labels(transport, codec).observe(seconds)

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()
