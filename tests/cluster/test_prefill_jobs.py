"""The prefill worker's jobs in a running cluster, at the moments where two of its threads meet: shorts
released together share one step, and each one's lease is taken as it comes, each one's commit waits
for its own frames only; a job cancelled while queued leaves the queues, and a request done at its
first token is reported once. The moments are made by running code inside
the worker (Ray's `__ray_call__`); the worker's own threads do the rest."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from collections.abc import Callable

import pytest
import ray
from cluster_helpers import assert_idle, install_gate, manifest, on_worker, open_gate, worker
from helpers import random_prompts
from helpers import wait_until

from pdserve.client import AsyncClient, Client
from pdserve.cluster.launcher import Cluster
from pdserve.engine import SamplingParams
from pdserve.wire import WorkRequest

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injected functions travel by value
ARCH = "tiny-llama"


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with Cluster(manifest(model_dirs[ARCH], transport="shm"), log=lambda _: None) as c:
        yield c


def hold_the_feeder(self) -> None:
    """The feeder takes nothing from the queues until `release_the_feeder` (jobs pile up queued). Returns
    once the feeder is held: a `take` already under way could still hand out the next job put."""
    held = threading.Event()

    def take_nothing(timeout, *args, **kwargs):
        held.set()
        time.sleep(timeout)
        return []

    self.queues.take = take_nothing
    assert held.wait(5), "the feeder did not come back to the queues"


def release_the_feeder(self) -> None:
    vars(self.queues).pop("take", None)
    self.queues.wake()


def laps_with_a_step_log(self) -> tuple:
    """LAPS with shorts up to 64 tokens, batched at once, and a log of the requests in each step
    (`self.test_steps`); returns the queues' settings before, for `restore_laps`."""
    kept = (self.queues.length_aware, self.queues.short_tokens, self.queues.window_s, self.queues.short_room)
    self.queues.configure(True, short_tokens=64, window_s=0.0, short_room=1024)
    original, self.test_steps = self.engine.runner.layer_hook, []

    def log_layer(layer, chunks):
        if layer == 0:
            self.test_steps.append(sorted(chunk.seq.request_id for chunk in chunks))
        original(layer, chunks)

    self.engine.runner.layer_hook = log_layer
    self.test_restore = lambda: setattr(self.engine.runner, "layer_hook", original)
    return kept


def restore_laps(self, kept: tuple) -> list[list[str]]:
    self.test_restore()
    self.queues.configure(*kept)
    return self.test_steps


def queued_shorts(self) -> list[list[int]]:
    """The prompts in the short queue, in order."""
    with self.queues._cv:
        return [job.work.prompt_token_ids for job, _, _ in self.queues._short]


def queued_request_id(self, prompt: list[int]) -> str:
    with self._lock:
        return next(job.request_id for job in self._jobs.values() if job.work.prompt_token_ids == prompt)


async def release_together(client: AsyncClient, prefill, prompts: list[list[int]],
                           before_release: Callable[[list[int]], None] = lambda order: None,
                           ) -> tuple[list[asyncio.Task], list[int]]:
    """Send `prompts` (greedy, 4 tokens each) while the prefill worker's feeder is held; once all are
    queued, call `before_release` with their order in the queue (indexes into `prompts`), then release
    the feeder: they go as one batch. Returns the calls, under way, and that order."""
    on_worker(prefill, hold_the_feeder)
    try:
        calls = [asyncio.create_task(client.generate(p, temperature=0, max_tokens=4, ignore_eos=True))
                 for p in prompts]
        all_queued = lambda: len(on_worker(prefill, queued_shorts)) == len(prompts)  # noqa: E731
        assert await asyncio.to_thread(wait_until, all_queued, 10), "the prompts never all queued"
        order = [prompts.index(p) for p in on_worker(prefill, queued_shorts)]
        await asyncio.to_thread(before_release, order)
    finally:
        on_worker(prefill, release_the_feeder)
    return calls, order


def test_shorts_bound_for_one_decode_worker_released_together_share_a_step(cluster, hf_reference):
    """Three short prompts wait in LAPS's short queue, all bound for the one decode worker; released
    as one batch, their passes run in one engine step (each had waited for the lease of the one
    before, a step apart), and every output is exact."""
    prefill = worker(cluster, "prefill")
    prompts = random_prompts(3, hf_reference[ARCH].vocab_size, 20, 40, seed=50)

    async def run():
        async with AsyncClient(cluster.address, timeout=60) as client:
            calls, _ = await release_together(client, prefill, prompts)
            return await asyncio.gather(*calls)

    kept = on_worker(prefill, laps_with_a_step_log)
    try:
        results = asyncio.run(run())
    finally:
        steps = on_worker(prefill, restore_laps, kept)
    assert [r.token_ids for r in results] == [hf_reference[ARCH].greedy(p, 4) for p in prompts]
    assert [len(step) for step in steps] == [3], f"the prompts' passes ran in steps {steps}"
    assert_idle(cluster)


def test_a_lease_granted_is_taken_at_once_while_others_before_it_wait(cluster, hf_reference):
    """Six shorts for the one decode worker start as one batch, and the decode worker holds the
    reservations of the first five (as a full KV memory does, for up to `reserve_wait_s`). The sixth's
    lease, granted at once, is taken and committed at once, and its request completes while the
    others still wait. Before, it waited for them: its lease taken in the batch's order, or its
    commit behind theirs on the lane's four commit threads; its decode-side lease (5 s here) lapsed
    meanwhile. The others complete once their reservations are answered; all exactly."""
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    prompts = random_prompts(6, hf_reference[ARCH].vocab_size, 20, 40, seed=52)

    def hold_all_but_the_last(order: list[int]) -> None:
        held = [on_worker(prefill, queued_request_id, prompts[i]) for i in order[:-1]]
        on_worker(decode, install_gate, "receiver.reserve", lambda transfer_id, request_id, *_: request_id in held)

    async def run():
        async with AsyncClient(cluster.address, timeout=60) as client:
            calls, order = await release_together(client, prefill, prompts, hold_all_but_the_last)
            held, granted = [calls[i] for i in order[:-1]], calls[order[-1]]
            await asyncio.wait([granted], timeout=10)
            assert granted.done() and not any(call.done() for call in held), \
                "the granted lease waited behind the held ones"
            on_worker(decode, open_gate)
            return await asyncio.gather(*calls)

    retries, expired = cluster.router.stats.retries, on_worker(prefill, lambda self: self.counters["leases_expired"])
    kept = on_worker(prefill, laps_with_a_step_log)
    try:
        results = asyncio.run(run())
    finally:
        on_worker(decode, lambda self: hasattr(self, "test_gate") and open_gate(self))
        on_worker(prefill, restore_laps, kept)
    assert [r.token_ids for r in results] == [hf_reference[ARCH].greedy(p, 4) for p in prompts]
    # Not by a retry: waiting, the granted one's transfer made no progress, and its lease lapsed.
    assert cluster.router.stats.retries == retries
    assert on_worker(prefill, lambda self: self.counters["leases_expired"]) == expired
    assert_idle(cluster)


def hold_frames_and_gate_all_but_the_first_jobs_sends(self) -> int:
    """Short prompts' frames held for their pass's end (the default for them); each pass pauses before
    its first layer, so every lease is taken before the pass ends and the pass's end queues each job's
    frames in one go on the link, one job after the other; every frame of a job other than the first
    whose frames reach the link waits at a gate (`open_gate`). Returns the setting before
    (`restore_frames`)."""
    sender = self.sender
    before = sender.settings.layerwise_min_tokens
    sender.settings = dataclasses.replace(sender.settings, layerwise_min_tokens=10**6)
    first: list[object] = []

    def others(kv, layer) -> bool:
        first[:] = first or [kv]
        return kv is not first[0]

    install_gate(self, "sender._send_written", others)
    hook = self.engine.runner.layer_hook
    self.engine.runner.layer_hook = lambda layer, chunks: (layer == 0 and time.sleep(0.5)) or hook(layer, chunks)
    self.test_hook = hook
    return before


def restore_frames(self, before: int) -> None:
    if hasattr(self, "test_gate"):
        open_gate(self)
    self.engine.runner.layer_hook = self.test_hook
    self.sender.settings = dataclasses.replace(self.sender.settings, layerwise_min_tokens=before)


def test_a_jobs_commit_waits_for_its_own_frames_not_the_links(cluster, hf_reference):
    """Two shorts share a step, and their frames, held for the pass's end, queue one job after the
    other on their decode worker's link; the second job's frames are held up. The first job's commit
    waits for its own frames only, so it completes meanwhile."""
    prefill = worker(cluster, "prefill")
    prompts = random_prompts(2, hf_reference[ARCH].vocab_size, 20, 40, seed=55)

    async def run():
        async with AsyncClient(cluster.address, timeout=60) as client:
            calls, _ = await release_together(client, prefill, prompts)
            # Within the decode side's lease (5 s): waiting past it, the commit would be redone by a retry.
            done, _ = await asyncio.wait(calls, timeout=4, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1 and not all(call.done() for call in calls), \
                "a commit waited for the other job's frames"
            on_worker(prefill, open_gate)
            return await asyncio.gather(*calls)

    retries = cluster.router.stats.retries
    kept = on_worker(prefill, laps_with_a_step_log)
    before = on_worker(prefill, hold_frames_and_gate_all_but_the_first_jobs_sends)
    try:
        results = asyncio.run(run())
    finally:
        on_worker(prefill, restore_frames, before)
        steps = on_worker(prefill, restore_laps, kept)
    assert [r.token_ids for r in results] == [hf_reference[ARCH].greedy(p, 4) for p in prompts]
    assert [len(step) for step in steps] == [2], f"the prompts' passes ran in steps {steps}"
    assert cluster.router.stats.retries == retries
    assert_idle(cluster)


def test_a_job_cancelled_in_the_queue_leaves_it(cluster):
    """A job cancelled while queued is taken out of the queues at once (left there, it counted toward a
    short batch's room and kept its decode worker's place until the feeder skipped it)."""
    def queue_then_cancel(self, decode) -> list[str]:
        work = WorkRequest("queued-then-cancelled", [5] * 20, SamplingParams.greedy(max_tokens=2))
        self.prefill(work, decode)
        self.abort([work.request_id])
        return [j.request_id for j in self.queues.remove(lambda j: True)]

    prefill = worker(cluster, "prefill")
    on_worker(prefill, hold_the_feeder)
    try:
        left_queued = on_worker(prefill, queue_then_cancel, worker(cluster, "decode").handle)
    finally:
        on_worker(prefill, release_the_feeder)
    assert left_queued == [], "the cancelled job stayed in the queues"
    assert_idle(cluster)


def test_a_request_done_at_its_first_token_is_reported_once(cluster, hf_reference):
    """A fault or lease expiry ends the job just after its final message (its one token) was sent: that
    job is already over, so nothing reports it failed as well, and the router retries nothing."""
    def fail_after_the_last_message(self) -> None:
        original, self.test_reports = self.sink.send, []

        def send(request_id, *args, **kwargs):
            original(request_id, *args, **kwargs)
            if kwargs.get("finish_reason"):
                job = self._jobs.get(request_id)
                self.test_reports.append(job is not None and self._finish(job, error="injected fault"))

        self.sink.send = send

    def restore(self) -> list[bool]:
        deadline = time.monotonic() + 5  # the client may have its token before the injected call returns
        while not self.test_reports and time.monotonic() < deadline:
            time.sleep(0.01)
        vars(self.sink).pop("send", None)
        return self.test_reports

    prefill = worker(cluster, "prefill")
    retries = cluster.router.stats.retries
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=51)[0]
    on_worker(prefill, fail_after_the_last_message)
    try:
        with Client(cluster.address, timeout=30) as client:
            out = client.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)
    finally:
        reports = on_worker(prefill, restore)
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, 1) and out.finish_reason == "length"
    assert reports == [False], "the job was reported failed after its final message"
    assert cluster.router.stats.retries == retries
    assert_idle(cluster)
