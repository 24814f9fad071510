"""Every timing of the cluster that another one depends on, in one object derived from the manifest
(`Manifest.deadlines`) and checked there: a manifest whose timings contradict each other is refused
when it loads, naming both sides, instead of failing requests in the rare case where the order
matters.

`KVDeadlines` is the KV handoff's (both sides of a transfer get it with their `TransferSettings`),
`HealthDeadlines` the supervisor's, and `Deadlines` holds both with the orderings between them.
No torch, pydantic or Ray here: the workers, the router and the cluster all import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LEASE_CHECK_S = 0.5  # both sides look at their leases at least this often (more often for a short lease)
AUDIT_LEAK_MARGIN_S = 5.0  # past the KV lease, a worker still holding something at idle leaks it


class DeadlinesOutOfOrder(ValueError):
    pass


def _refuse(problems: list[str]) -> None:
    if problems:
        raise DeadlinesOutOfOrder("; ".join(problems))


@dataclass(frozen=True)
class KVDeadlines:
    """The KV handoff's timings. The decode side's lease lapses when no frame or renewal comes for
    `lease_s`; the prefill side's when its transfer makes no progress for `sender_lease_s`."""

    lease_s: float = 30.0  # the decode side's lease on a reservation, extended by every frame and renewal
    reserve_wait_s: float = 10.0  # how long a reservation waits for free decode KV blocks
    commit_timeout_s: float = 30.0  # the delivery of what a channel holds, before the commit
    # The prefill side's lease outlasts the decode side's by this much, so the decode side's lapses first
    # (and frees its blocks) rather than the prefill side failing a transfer the decode side still holds.
    lease_margin_s: float = 2.0
    reserve_answer_margin_s: float = 10.0  # the prefill side's wait for a lease beyond the decode side's own

    def __post_init__(self) -> None:
        problems = [f"{name} must be positive, got {value}" for name, value in (
            ("lease_s", self.lease_s), ("commit_timeout_s", self.commit_timeout_s),
            ("lease_margin_s", self.lease_margin_s),
            ("reserve_answer_margin_s", self.reserve_answer_margin_s)) if not value > 0]
        if not self.reserve_wait_s >= 0:
            problems.append(f"reserve_wait_s must be at least 0, got {self.reserve_wait_s}")
        if not problems and self.commit_timeout_s > self.sender_lease_s:
            problems.append(
                f"commit_timeout_s ({self.commit_timeout_s:g} s) exceeds the prefill side's lease (lease_s + "
                f"{self.lease_margin_s:g} s = {self.sender_lease_s:g} s), which nothing renews while a commit "
                f"waits: the lease would end the commit first; give commit_timeout_s at most {self.sender_lease_s:g}")
        _refuse(problems)

    @property
    def sender_lease_s(self) -> float:
        """The prefill side's lease: a transfer without progress this long fails."""
        return self.lease_s + self.lease_margin_s

    @property
    def reservation_bound_s(self) -> float:
        """How long the prefill side waits for a lease before it takes the decode worker for hung."""
        return self.reserve_wait_s + self.reserve_answer_margin_s

    @property
    def lease_check_s(self) -> float:
        """How often both sides look at their leases: often enough to renew one a few times over its life."""
        return min(LEASE_CHECK_S, self.lease_s / 6)


@dataclass(frozen=True)
class HealthDeadlines:
    """The supervisor's timings: a round pings every worker and waits up to `ping_timeout_s` for the
    answers, then `ping_interval_s`; a restarted worker rejoins after its back-off."""

    ping_interval_s: float = 0.5
    ping_timeout_s: float = 1.0
    misses_to_fail: int = 2  # rounds in a row without an answer before a worker counts as hung
    restart_backoff_s: float = 1.0  # a restarted worker's first back-off, doubling with each restart ...
    restart_backoff_max_s: float = 30.0  # ... up to this
    restart_window_s: float = 300.0  # ... counting the restarts of this long

    def __post_init__(self) -> None:
        problems = [f"{name} must be positive, got {value}" for name, value in (
            ("ping_interval_s", self.ping_interval_s), ("ping_timeout_s", self.ping_timeout_s),
            ("misses_to_fail", self.misses_to_fail), ("restart_backoff_s", self.restart_backoff_s),
            ("restart_window_s", self.restart_window_s)) if not value > 0]
        if not problems and self.restart_backoff_s > self.restart_backoff_max_s:
            problems.append(f"restart_backoff_s ({self.restart_backoff_s:g} s) exceeds restart_backoff_max_s "
                            f"({self.restart_backoff_max_s:g} s), the longest back-off")
        if not problems and self.restart_backoff_max_s > self.restart_window_s:
            problems.append(f"restart_backoff_max_s ({self.restart_backoff_max_s:g} s) exceeds restart_window_s "
                            f"({self.restart_window_s:g} s): a worker's restarts would be forgotten before its "
                            f"back-off ends, and a crash loop would never reach the longest back-off")
        _refuse(problems)

    @property
    def hung_after_s(self) -> float:
        """The longest a worker that stopped answering is still taken for healthy."""
        return self.misses_to_fail * (self.ping_timeout_s + self.ping_interval_s)


@dataclass(frozen=True)
class Deadlines:
    kv: KVDeadlines = field(default_factory=KVDeadlines)
    health: HealthDeadlines = field(default_factory=HealthDeadlines)

    def __post_init__(self) -> None:
        if self.health.hung_after_s >= self.kv.sender_lease_s:
            _refuse([f"a hung worker is taken for healthy up to {self.health.hung_after_s:g} s (misses_to_fail x "
                     f"(ping_timeout_s + ping_interval_s)), not less than the prefill side's KV lease "
                     f"({self.kv.sender_lease_s:g} s): the transfers to a hung decode worker would fail and be "
                     f"retried while placement still chose it; lengthen kv_transfer.lease_s or ping sooner"])

    @property
    def leak_after_s(self) -> float:
        """Past this, a worker still holding something while the cluster idles leaks it (its leases have lapsed)."""
        return self.kv.sender_lease_s + AUDIT_LEAK_MARGIN_S
