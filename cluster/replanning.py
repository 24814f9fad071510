"""The online planner at work in a running cluster (`ReplanLoop`): every `planner.interval_s` it hands the
requests the router finished lately or serves now, and the current split, to
`plan.online.OnlinePlanner`, and carries out its decision (the splits' simulations run in processes of
their own, Ray tasks, so the router's event loop in this process never waits on them): one worker
changes role (drained first, its requests moved with their KV; `Cluster.switch_role`), is added
(`Cluster.add_worker`: it asks for its pool's resources, which Ray's autoscaler, where there is one,
starts a node for) or is removed (`Cluster.remove_worker`: drained first, then stopped; the autoscaler
stops its node once idle). A worker to change role or to go is one that stopped serving, else one with
the fewest other workers on its node (removed, it may leave that node idle, for the autoscaler to stop),
else, of the decode pool, the one holding the fewest requests; of the prefill pool, the one with the
fewest prompts waiting.

Every decision is logged as one JSON line on the `pdserve.planner` logger (INFO), a change also on the
launcher's log; counted on /metrics (`pdserve_planner_decisions_total{action}`,
`pdserve_planner_predicted_goodput{split}` of the last decision); and the last one is in `/health`
and `pdserve status`. A failure stops the planner (said there, and logged): the cluster serves on as
it is.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Protocol

import ray
from ray.exceptions import RayError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.cluster.plan.online import Decision, GoodputQuestion, OnlinePlanner, Split, split_goodput
from pdserve.router.frontend import ObservedRequest, DrainReport
from pdserve.router.health_report import PlannerHealth
from pdserve.router.workers import NoHealthyWorker, WorkerRef
from pdserve.threads import start_guarded

log = logging.getLogger("pdserve.planner")
KEPT = 256  # the last decisions kept


class Reshapable(Protocol):
    """What the loop needs of the cluster (the launcher's `Cluster`)."""

    workers: list[WorkerRef]

    def observed_requests(self) -> list[ObservedRequest]: ...

    def switch_role(self, worker_name: str, role: str, timeout_s: float) -> WorkerRef: ...

    def add_worker(self, role: str, timeout_s: float) -> WorkerRef: ...

    def remove_worker(self, worker_name: str, timeout_s: float) -> DrainReport: ...


class ReplanLoop:
    def __init__(self, cluster: Reshapable, planner: OnlinePlanner, say: Callable[[str], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.cluster = cluster
        self.planner = planner
        self.say = say  # the launcher's log, for role changes
        self.clock = clock
        self.decisions: deque[Decision] = deque(maxlen=KEPT)
        self.actions: Counter[str] = Counter()
        self.role_changes = 0
        self.workers_added = 0
        self.workers_removed = 0
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ReplanLoop:
        # A thread of its own: a decision simulates every split for seconds, and a role change waits for a
        # drain and a worker's start; neither may hold the router's loop or the supervisor's rounds.
        self._thread = start_guarded("online-planner", self._run, self._crashed)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def decide_once(self) -> Decision:
        """One decision, carried out."""
        decision = self.decide()
        self.carry_out(decision)
        return decision

    def decide(self) -> Decision:
        """One decision on the cluster as it is now (logged and counted), not yet carried out."""
        workers = list(self.cluster.workers)
        current = Split(sum(w.pool == "prefill" for w in workers), sum(w.pool == "decode" for w in workers))
        decision = self.planner.decide(self.clock(), self.cluster.observed_requests(), current)
        self.decisions.append(decision)
        self.actions[decision.action] += 1
        log.info(json.dumps(asdict(decision), default=str))
        return decision

    def carry_out(self, decision: Decision) -> None:
        """A "change" decision's step: one worker added, removed (drained first) or switched to the other
        pool. A change that fails is said and left: the next decision sees the cluster as it is."""
        if decision.action != "change":
            return
        step, current, reason = decision.step, decision.current, decision.reason
        grows = "prefill" if step.prefill > current.prefill else "decode"
        shrinks = "prefill" if step.prefill < current.prefill else "decode"
        timeout_s = self.planner.settings.start_timeout_s
        try:
            if step.total > current.total:
                self.say(f"planner: adding a {grows} worker: {reason}")
                done = f"{self.cluster.add_worker(grows, timeout_s).name} joined"
                self.workers_added += 1
            elif step.total < current.total:
                worker = self._worker_to_take(shrinks)
                self.say(f"planner: removing {worker.name}: {reason}")
                self.cluster.remove_worker(worker.name, timeout_s)
                done = f"{worker.name} removed"
                self.workers_removed += 1
            else:
                worker = self._worker_to_take(shrinks)
                self.say(f"planner: {worker.name} becomes a {grows} worker: {reason}")
                done = f"{worker.name} is now {self.cluster.switch_role(worker.name, grows, timeout_s).name}"
                self.role_changes += 1
        # The cluster's state, not a bug (no room, no node in time, a worker that failed to start, one
        # that is needed): the next decision sees the cluster as it is then.
        except (ValueError, NoHealthyWorker, TimeoutError, RayError) as e:
            self.say(f"planner: the change to {step} failed: {type(e).__name__}: {e}")
            return
        self.say(f"planner: {done}; split {step}")

    def health(self) -> PlannerHealth:
        last = self.decisions[-1] if self.decisions else None
        return PlannerHealth(last.at if last else None, last.action if last else "", last.reason if last else "",
                             self.role_changes, self.workers_added, self.workers_removed, self.failure)

    def _worker_to_take(self, pool: str) -> WorkerRef:
        """The worker of `pool` to remove or switch: one that stopped serving first (its restarts spent,
        say), else one with the fewest other workers on its node (removed, it may leave its node idle,
        which the autoscaler then stops), else the one holding the least."""
        workers = list(self.cluster.workers)
        on_node = Counter(w.status.node_id for w in workers if w.status is not None)
        members = [w for w in workers if w.pool == pool]
        load = (lambda w: w.outstanding) if pool == "decode" else (lambda w: len(w.queued))
        return min(members, key=lambda w: (w.healthy, on_node[w.status.node_id] if w.status else 0, load(w)))

    def _run(self) -> None:
        # Decisions `interval_s` apart from start to start: the simulations take seconds, and a shift of
        # the mix waits for no more than the interval to be seen.
        interval = self.planner.settings.interval_s
        next_at = time.monotonic() + interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = time.monotonic() + interval
            self.decide_once()

    def _crashed(self, error: BaseException) -> None:
        if self._stop.is_set():  # the cluster is stopping: Ray went down under the decision
            return
        self.failure = f"{type(error).__name__}: {error}"
        self.say(f"planner stopped: {self.failure}; the cluster serves on with its current split")


@ray.remote(num_cpus=0)  # the workers keep their CPUs
def _answer(question: GoodputQuestion) -> float:
    # In a process of its own: a split's simulation holds the GIL for a second or more, which the
    # router's event loop, in the launcher's process, must not wait out. A task, not a kept actor: a
    # process kept on a node would keep the autoscaler from stopping it.
    run_only_when_idle()
    return split_goodput(question)


def run_only_when_idle() -> None:
    """Let this thread have a CPU only when no other task wants it (all but a sliver). Nice 19 is not enough: a worker
    waking between two steps waits for a niced task to finish its time slice (measured with two
    simulating processes beside a 2P+1D cluster on 2 cores: code-completion goodput 9.5 -> 7.2 req/s at
    nice 19), while SCHED_IDLE yields at once. Where the policy does not exist, nice 19."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19 - os.nice(0))


def answered_by_ray(questions: list[GoodputQuestion]) -> list[float]:
    """The splits' goodputs, simulated in Ray worker processes at once."""
    return ray.get([_answer.remote(q) for q in questions])


class PlannerCollector:
    """The planner's figures on the router's /metrics."""

    def __init__(self, loop: ReplanLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("pdserve_planner_decisions", "The online planner's decisions, by action "
                                        "(keep, wait, change, none: too few requests)", labels=["action"])
        for action in ("keep", "wait", "change", "none"):
            decisions.add_metric([action], self.loop.actions[action])
        yield decisions
        predicted = GaugeMetricFamily("pdserve_planner_predicted_goodput", "Goodput each split of the workers "
                                      "was predicted to carry at the last decision (requests/s)", labels=["split"])
        last = self.loop.decisions[-1] if self.loop.decisions else None
        for split, goodput in (last.goodputs.items() if last else ()):
            predicted.add_metric([split], goodput)
        yield predicted
