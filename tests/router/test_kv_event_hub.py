"""KV events from workers to the router's exact prefix index, over real pyzmq sockets on loopback.

A worker here is a real `BlockPool` driven by requests (hits, allocations, evictions, resets) whose
listener is a real `KVEventPublisher`; its cached set is the truth the index must equal. To lose,
repeat and reorder events, the publisher sends to a tap (a PULL socket of the test) and the test
PUSHes batches of its choosing, cut from the worker's real event stream, to the hub.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import wait_until
import zmq

from pdserve.engine.block_pool import BlockPool, hash_prompt_blocks
from pdserve.kv_events import KVEvent, KVEventBatch, KVEventPublisher, KVSnapshot, parse_kv_event_batch
from pdserve.router.event_loop import EventLoopThread
from pdserve.router.kv_event_hub import KVEventHub
from pdserve.router.prefix_index import PrefixIndex
from pdserve.wire import MalformedMessage

BLOCK = 4
PREFIXES = [[base + i for i in range(6 * BLOCK)] for base in (100, 200, 300)]  # shared prompt heads


class PoolWorker:
    """A worker's prefix cache as its engine drives it. `lock` stands for the engine loop thread: the
    pool changes, and snapshots are taken, under it."""

    def __init__(self, name: str, address: str, *, seed: int = 0, heartbeat_s: float = 60.0) -> None:
        self.name = name
        self.pool = BlockPool(16)
        self.publisher = KVEventPublisher(address, name, heartbeat_s=heartbeat_s)
        self.pool.listener = self.publisher
        self.lock = threading.Lock()
        self._rng = random.Random(seed)

    def run_requests(self, n: int) -> None:
        """n prompts: a shared head of 0-6 blocks and a new tail, cached and freed (16 blocks: evictions)."""
        with self.lock:
            for _ in range(n):
                head = self._rng.choice(PREFIXES)[: self._rng.randint(0, 6) * BLOCK]
                prompt = head + [self._rng.randrange(1000, 9000) for _ in range(self._rng.randint(1, 3) * BLOCK)]
                hashes = hash_prompt_blocks(prompt, BLOCK)
                hits = self.pool.lookup_prefix(hashes)
                new = self.pool.allocate(len(hashes) - len(hits))
                for j, block in enumerate(new, start=len(hits)):
                    self.pool.cache_block(block, hashes[j], hashes[j - 1] if j else None)
                self.pool.free(hits + new)
                if self._rng.random() < 0.05:
                    self.pool.reset_prefix_cache()

    def snapshot(self) -> KVSnapshot:
        with self.lock:
            return self.publisher.snapshot(self.pool.cached_blocks())

    def truth(self) -> dict[bytes, bytes | None]:
        with self.lock:
            return dict(self.pool.cached_blocks())

    def close(self) -> None:
        self.publisher.close()


class Snapshots:
    """The hub's `request_snapshot`: records each request; with `auto`, answers it from the worker on a
    thread of its own, as the launcher does with a Ray call. The first `failures` requests raise."""

    def __init__(self, auto: bool, failures: int = 0) -> None:
        self.auto = auto
        self.failures = failures
        self.hub: KVEventHub | None = None
        self.workers: dict[str, PoolWorker] = {}
        self.requested: list[str] = []
        self._threads: list[threading.Thread] = []

    def __call__(self, worker: str) -> None:
        self.requested.append(worker)
        if len(self.requested) <= self.failures:
            raise RuntimeError(f"{worker} could not be reached")
        if self.auto:
            thread = threading.Thread(target=self.answer, args=(worker,))
            self._threads.append(thread)
            thread.start()

    def answer(self, worker: str, snapshot: KVSnapshot | None = None) -> None:
        snapshot = snapshot or self.workers[worker].snapshot()
        assert self.hub is not None
        self.hub.apply_snapshot(worker, snapshot.epoch, snapshot.seq, snapshot.blocks)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(5.0)


class Tap:
    """Where a publisher sends: the test reads its events and forwards batches of its choosing."""

    def __init__(self, hub_address: str) -> None:
        context = zmq.Context.instance()
        self._pull = context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self._pull.bind_to_random_port('tcp://127.0.0.1')}"
        self._push = context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(hub_address)
        self.events: dict[tuple[str, str], dict[int, KVEvent]] = {}  # (worker, epoch) -> seq -> event

    def sync(self, worker: PoolWorker) -> None:
        """Receive the worker's events up to its publisher's last sequence number."""
        key, last = (worker.name, worker.publisher.epoch), worker.publisher.last_seq
        deadline = time.monotonic() + 5.0
        while max(self.events.get(key, {}), default=0) < last:
            assert self._pull.poll(max(0.0, deadline - time.monotonic()) * 1000), f"events of {key} missing"
            batch = parse_kv_event_batch(self._pull.recv())
            stream = self.events.setdefault((batch.worker_id, batch.epoch), {})
            for i, event in enumerate(batch.events):
                stream[batch.first_seq + i] = event

    def batch(self, worker: PoolWorker, first: int, last: int) -> KVEventBatch:
        stream = self.events[(worker.name, worker.publisher.epoch)]
        return KVEventBatch(worker_id=worker.name, epoch=worker.publisher.epoch, first_seq=first,
                            events=[stream[seq] for seq in range(first, last + 1)])

    def forward(self, *batches: KVEventBatch) -> None:
        for batch in batches:
            self._push.send(batch.SerializeToString())

    def send_raw(self, data: bytes) -> None:
        self._push.send(data)

    def close(self) -> None:
        self._pull.close()
        self._push.close()


class Setup:
    def __init__(self, loop: asyncio.AbstractEventLoop, *, auto: bool, failures: int = 0, **hub_options: object) -> None:
        self.index = PrefixIndex()
        self.snapshots = Snapshots(auto, failures)
        self.hub = KVEventHub(self.index, self.snapshots, loop, **hub_options)
        self.snapshots.hub = self.hub
        self.tap = Tap(self.hub.address)
        self._workers: list[PoolWorker] = []

    def worker(self, name: str, *, seed: int = 0, tapped: bool = True, heartbeat_s: float = 60.0) -> PoolWorker:
        worker = PoolWorker(name, self.tap.address if tapped else self.hub.address, seed=seed,
                            heartbeat_s=heartbeat_s)
        self.snapshots.workers[name] = worker
        self._workers.append(worker)
        return worker

    def step(self, worker: PoolWorker, n: int = 5) -> tuple[int, int]:
        """Run n requests on the worker; returns the range of sequence numbers they published."""
        first = worker.publisher.last_seq + 1
        worker.run_requests(n)
        self.tap.sync(worker)
        return first, worker.publisher.last_seq

    def exact(self, worker: PoolWorker) -> bool:
        return wait_until(lambda: self.index.blocks(worker.name) == worker.truth()
                          and self.hub.last_seq(worker.name) == worker.publisher.last_seq)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self.snapshots.join()
        self.tap.close()
        self.hub.close()


@pytest.fixture
def setup_factory(router_loop: EventLoopThread) -> Iterator[Callable[..., Setup]]:
    made: list[Setup] = []

    def make(**options: object) -> Setup:
        made.append(Setup(router_loop.loop, **options))
        return made[-1]

    yield make
    for setup in made:
        setup.close()


def test_parse_rejects_garbage_and_incomplete_batches():
    with pytest.raises(MalformedMessage, match="not a KVEventBatch"):
        parse_kv_event_batch(b"\x0a\xff")
    for batch, message in [
        (KVEventBatch(epoch="e", first_seq=1), "without worker_id or epoch"),
        (KVEventBatch(worker_id="w", first_seq=1), "without worker_id or epoch"),
        (KVEventBatch(worker_id="w", epoch="e"), "first_seq 0"),
        (KVEventBatch(worker_id="w", epoch="e", first_seq=1, events=[KVEvent()]), "without a block hash"),
        (KVEventBatch(worker_id="w", epoch="e", first_seq=1,
                      events=[KVEvent(block_hash=b"h", parent_hash=b"h")]), "chained on itself"),
    ]:
        with pytest.raises(MalformedMessage, match=message):
            parse_kv_event_batch(batch.SerializeToString())


def test_published_events_keep_the_index_exact(setup_factory):
    setup = setup_factory(auto=True)
    workers = [setup.worker(f"w{i}", seed=i, tapped=False, heartbeat_s=0.1) for i in range(2)]
    idle = setup.worker("idle", tapped=False, heartbeat_s=0.1)
    for _ in range(5):
        for worker in workers:
            worker.run_requests(8)
    for worker in workers:
        assert setup.exact(worker)
        assert worker.pool.stats.evictions > 0
    assert wait_until(lambda: setup.hub.last_seq("idle") == 0)  # known from its heartbeat
    assert setup.hub.resyncs == 0 and setup.snapshots.requested == [] and setup.hub.duplicates == 0
    assert setup.hub.applied == sum(w.publisher.last_seq for w in workers) and idle.publisher.last_seq == 0

    for prefix in PREFIXES:
        hashes = hash_prompt_blocks(prefix, BLOCK)
        expected = {}
        for worker in workers:
            truth = worker.truth()
            run = next((i for i, h in enumerate(hashes) if h not in truth), len(hashes))
            if run:
                expected[worker.name] = run
        assert setup.index.match(hashes) == expected


def test_a_lost_batch_is_noticed_and_resynced_from_a_snapshot(setup_factory):
    setup = setup_factory(auto=False)
    worker = setup.worker("w")
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert setup.exact(worker)

    setup.step(worker)  # lost
    first, last = setup.step(worker)
    setup.tap.forward(setup.tap.batch(worker, first, last))
    assert wait_until(lambda: setup.snapshots.requested == ["w"])
    assert setup.hub.is_resyncing("w") and setup.hub.resyncs == 1
    snapshot = worker.snapshot()  # taken now; the worker goes on while it travels

    # More events arrive while the worker resyncs, one more gap among them: kept, no second request.
    setup.step(worker)  # lost too
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    time.sleep(0.1)
    assert setup.snapshots.requested == ["w"] and setup.hub.last_seq("w") < snapshot.seq

    # The snapshot lands: it replaces the worker's set; kept events after it cannot fill the second
    # gap, so the worker resyncs again, and the next snapshot makes it exact.
    setup.snapshots.answer("w", snapshot)
    assert wait_until(lambda: setup.snapshots.requested == ["w", "w"]) and setup.hub.resyncs == 2
    setup.snapshots.answer("w")
    assert setup.exact(worker) and not setup.hub.is_resyncing("w")
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert setup.exact(worker) and setup.hub.snapshots == 2


def test_duplicated_and_overlapping_batches_apply_each_event_once(setup_factory):
    setup = setup_factory(auto=False)
    worker = setup.worker("w")
    _, k1 = setup.step(worker)
    _, k2 = setup.step(worker)
    setup.tap.forward(setup.tap.batch(worker, 1, k1), setup.tap.batch(worker, 1, k1))
    assert wait_until(lambda: setup.hub.duplicates == k1)
    setup.tap.forward(setup.tap.batch(worker, k1 - 2, k2), setup.tap.batch(worker, 2, 3))
    assert setup.exact(worker)
    assert wait_until(lambda: setup.hub.duplicates == k1 + 3 + 2)
    assert setup.hub.applied == k2 and setup.hub.resyncs == 0 and setup.snapshots.requested == []


def test_reordered_batches_resync_once_and_end_exact(setup_factory):
    setup = setup_factory(auto=False)
    worker = setup.worker("w")
    _, k1 = setup.step(worker)
    early = worker.snapshot()  # as of k1: the kept batches after it are applied in order
    _, k2 = setup.step(worker)
    _, k3 = setup.step(worker)
    b1, b2, b3 = (setup.tap.batch(worker, 1, k1), setup.tap.batch(worker, k1 + 1, k2),
                  setup.tap.batch(worker, k2 + 1, k3))
    setup.tap.forward(b1, b3, b2)
    assert wait_until(lambda: setup.snapshots.requested == ["w"])
    time.sleep(0.1)
    setup.snapshots.answer("w", early)
    assert setup.exact(worker)
    assert setup.hub.resyncs == 1 and setup.hub.snapshots == 1 and setup.snapshots.requested == ["w"]


def test_a_forgotten_worker_is_out_at_once_and_resynced_when_it_comes_back(setup_factory):
    setup = setup_factory(auto=True)
    worker = setup.worker("w", tapped=False)
    worker.run_requests(10)
    assert setup.exact(worker)
    cached = [h for h, parent in worker.truth().items() if parent is None]
    assert cached and setup.index.match(cached[:1]) == {"w": 1}

    setup.hub.forget("w")
    assert setup.index.match(cached[:1]) == {} and setup.index.workers() == [] and setup.hub.last_seq("w") is None

    worker.run_requests(3)  # its events go on from where they were: the hub resyncs it
    assert setup.exact(worker) and setup.snapshots.requested == ["w"] and setup.hub.resyncs == 1


def test_a_restarted_worker_replaces_its_old_entries(setup_factory):
    setup = setup_factory(auto=True)
    old = setup.worker("w", tapped=False)
    old.run_requests(10)
    assert setup.exact(old)
    old.close()

    # A new process under the same name: its events from 1 on are its whole history.
    new = setup.worker("w", seed=1, tapped=False)
    new.run_requests(2)
    assert new.publisher.epoch != old.publisher.epoch
    assert setup.exact(new) and setup.snapshots.requested == [] and setup.hub.resyncs == 0


def test_a_restart_noticed_late_resyncs_and_ignores_the_old_process(setup_factory):
    setup = setup_factory(auto=False)
    old = setup.worker("w")
    old_batch = setup.tap.batch(old, *setup.step(old))
    setup.tap.forward(old_batch)
    assert setup.exact(old)
    stale = old.snapshot()
    old.close()

    new = setup.worker("w", seed=1)
    setup.step(new)  # lost: the hub meets the new epoch mid-stream
    setup.tap.forward(setup.tap.batch(new, *setup.step(new)))
    assert wait_until(lambda: setup.snapshots.requested == ["w"])
    assert setup.index.blocks("w") == {}  # a new process holds nothing of the old one's cache

    # An answer from the old process, and a straggler of its events, change nothing; the new one
    # is asked again. (A malformed message after the straggler tells when the hub has read it.)
    setup.snapshots.answer("w", stale)
    setup.tap.forward(old_batch)
    setup.tap.send_raw(b"\x0a\xff")
    assert wait_until(lambda: setup.hub.malformed == 1)
    assert setup.snapshots.requested == ["w", "w"] and setup.hub.is_resyncing("w")
    setup.snapshots.answer("w")
    assert setup.exact(new) and setup.hub.snapshots == 1


def test_a_straggler_of_a_forgotten_dead_process_does_not_pass_for_a_new_one(setup_factory):
    """The worker's process dies and the hub forgets it (the supervisor saw it unhealthy); the restarted
    process publishes; then a batch the dead one sent before it died arrives. The hub still knows the
    dead epoch and drops it: the new process's events go on applying, with no snapshot needed."""
    setup = setup_factory(auto=False)
    old = setup.worker("w")
    setup.tap.forward(setup.tap.batch(old, *setup.step(old)))
    assert setup.exact(old)
    straggler = setup.tap.batch(old, *setup.step(old))  # sent before the death, delivered after all this
    old.close()
    setup.hub.forget("w")

    new = setup.worker("w", seed=1)
    setup.tap.forward(setup.tap.batch(new, *setup.step(new)))
    assert setup.exact(new)
    setup.tap.forward(straggler, setup.tap.batch(new, *setup.step(new)))
    assert setup.exact(new)
    assert setup.snapshots.requested == [] and setup.hub.resyncs == 0


def test_a_restart_during_a_resync_starts_afresh(setup_factory):
    setup = setup_factory(auto=False)
    old = setup.worker("w")
    setup.step(old)  # lost
    setup.tap.forward(setup.tap.batch(old, *setup.step(old)))
    assert wait_until(lambda: setup.snapshots.requested == ["w"])  # never answered: the process dies
    old.close()

    new = setup.worker("w", seed=1)
    setup.tap.forward(setup.tap.batch(new, *setup.step(new)))
    assert setup.exact(new) and not setup.hub.is_resyncing("w")
    setup.step(new)  # lost: this gap is asked about at once
    setup.tap.forward(setup.tap.batch(new, *setup.step(new)))
    assert wait_until(lambda: setup.snapshots.requested == ["w", "w"])
    setup.snapshots.answer("w")
    assert setup.exact(new)


def test_an_overflow_of_kept_batches_only_means_another_resync(setup_factory):
    setup = setup_factory(auto=False, max_kept_events=8)
    worker = setup.worker("w")
    setup.step(worker)  # lost
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert wait_until(lambda: setup.snapshots.requested == ["w"])
    early = worker.snapshot()
    for _ in range(3):  # more than 8 events kept: the oldest are dropped
        setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    time.sleep(0.1)
    setup.snapshots.answer("w", early)
    assert wait_until(lambda: setup.snapshots.requested == ["w", "w"])
    setup.snapshots.answer("w")
    assert setup.exact(worker) and setup.hub.resyncs == 2


def test_a_failed_snapshot_request_is_made_again_on_the_next_batch(setup_factory):
    setup = setup_factory(auto=True, failures=1)
    worker = setup.worker("w")
    setup.step(worker)  # lost
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert wait_until(lambda: setup.snapshots.requested == ["w"])
    assert setup.hub.is_resyncing("w")
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert setup.exact(worker) and setup.snapshots.requested == ["w", "w"]


def test_malformed_messages_are_dropped_and_counted(setup_factory):
    setup = setup_factory(auto=False)
    worker = setup.worker("w")
    setup.tap.send_raw(b"\x0a\xff")
    setup.tap.forward(KVEventBatch(worker_id="w", first_seq=1, events=[KVEvent(block_hash=b"h")]))
    setup.tap.forward(setup.tap.batch(worker, *setup.step(worker)))
    assert setup.exact(worker) and setup.hub.malformed == 2
