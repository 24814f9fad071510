"""The KV handoff in a running cluster: only what the decode worker lacks is sent, faults on the wire
(a corrupt frame, a stream cut off, a codec the decode side cannot use) end exactly as designed, and
the output stays identical to transformers'. Faults are injected by running code inside the workers
(Ray's `__ray_call__`), the real checksum and lease code does the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from transformers import AutoConfig
from cluster_helpers import (assert_idle, install_gate, lifetime_records, manifest, on_worker, open_gate,
                             prefill_job_states, set_layerwise_min_tokens, worker)
from helpers import random_prompts, wait_until

from pdserve.client import Client, DeadlineExceeded, PDServeError, Unavailable
from pdserve.cluster.launcher import Cluster
from pdserve.engine import SamplingParams
from pdserve.engine.models.presets import resolve_model
from pdserve.kv_transfer.codecs.cachegen import TABLES_FILE
from pdserve.wire import WorkRequest

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injected functions travel by value
ARCH = "tiny-llama"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with Cluster(manifest(model_dirs[ARCH], transport="shm"), log=lambda _: None) as c:
        yield c


@pytest.fixture(params=["layerwise", "held"])
def frames(request, cluster):
    """The prompt's frames leave layer by layer beside its pass (the module's manifest), or all once its
    pass ends (as the default `layerwise_min_tokens` has it for these short prompts)."""
    if request.param == "layerwise":
        yield request.param
        return
    prefill = worker(cluster, "prefill")
    before = on_worker(prefill, set_layerwise_min_tokens, 10**6)
    try:
        yield request.param
    finally:
        on_worker(prefill, set_layerwise_min_tokens, before)


def generate(cluster, prompt):
    with Client(cluster.address) as client:
        return client.generate(prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def last_transfer(cluster) -> dict:
    """The prefill worker's record of its latest KV transfer, once it holds no job: the sender writes the
    record when the commit's answer comes, which can be after the client had every token."""
    prefill = worker(cluster, "prefill")
    assert wait_until(lambda: on_worker(prefill, prefill_job_states) == [], 30), on_worker(prefill, prefill_job_states)
    return on_worker(prefill, lambda self: self.sender.transfer_log[-1])


def counters(cluster, pool: str) -> dict:
    if pool == "prefill":
        return on_worker(worker(cluster, pool), lambda self: dict(self.counters))
    return on_worker(worker(cluster, pool), lambda self: dict(self.receiver.counters))


def corrupt_frames(self, layer: int, times: int) -> None:
    """Flip a byte of the next `times` frames of `layer` as they arrive (before the checksum test)."""
    receiver, left = self.receiver, [times]
    original = receiver._verify

    def damaging(header, payload):
        if header.layer == layer and left[0] > 0:
            left[0] -= 1
            damaged = bytearray(payload)
            damaged[len(damaged) // 2] ^= 0xFF
            payload = memoryview(damaged)
        return original(header, payload)

    receiver._verify = damaging


def test_a_prefix_the_decode_worker_holds_is_not_sent_again(cluster, hf_reference):
    vocab = hf_reference[ARCH].vocab_size
    first = random_prompts(1, vocab, 100, 100, seed=31)[0]
    generate(cluster, first)  # the decode worker now caches its 6 full blocks
    prompt = first[:64] + random_prompts(1, vocab, 40, 40, seed=32)[0]
    out = generate(cluster, prompt)
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sent = last_transfer(cluster)
    config = hf_reference[ARCH].model.config
    head_dim = config.hidden_size // config.num_attention_heads
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # float32 K and V
    assert sent["cached_tokens"] == 64 and sent["bytes"] == (len(prompt) - 64) * token_bytes
    assert_idle(cluster)


def forget_prefixes(self) -> None:
    """Inside the prefill worker: its prefix cache forgets every block no request uses."""
    self.loop.call(lambda engine: engine.pool.reset_prefix_cache())


def slow_chunks_before(self, token: int, chunk_tokens: int, pause_s: float) -> int | None:
    """Inside the prefill worker: prompts go in chunks of `chunk_tokens`, and each chunk ending at or
    before `token` takes `pause_s` more; returns the chunk setting before (`restore_chunks`)."""
    config = self.engine.scheduler.config
    before, config.prefill_chunk_size = config.prefill_chunk_size, chunk_tokens
    original = self.engine.runner.layer_hook

    def slow(layer, chunks):
        if layer == 0 and all(c.seq.num_computed_tokens + c.num_tokens <= token for c in chunks):
            time.sleep(pause_s)
        original(layer, chunks)

    self.engine.runner.layer_hook = slow
    self.test_restore = lambda: setattr(self.engine.runner, "layer_hook", original)
    return before


def restore_chunks(self, before: int | None) -> None:
    self.test_restore()
    self.engine.scheduler.config.prefill_chunk_size = before


def test_the_decode_lease_lasts_while_the_pass_computes_a_prefix_only_the_decode_worker_holds(cluster,
                                                                                             hf_reference):
    """The decode worker holds 64 tokens the prefill worker must compute, in chunks that together take
    longer than the lease: they send no frame, which is what extends the lease on the decode side, so
    the prefill worker renews it itself (the lease expired under a progressing transfer before, and the
    request failed over to a retry)."""
    vocab = hf_reference[ARCH].vocab_size
    first = random_prompts(1, vocab, 100, 100, seed=241)[0]
    generate(cluster, first)  # both workers now cache its 6 full blocks
    prefill = worker(cluster, "prefill")
    on_worker(prefill, forget_prefixes)  # now only the decode worker does
    expired = counters(cluster, "decode").get("leases_expired", 0)
    lease_s = cluster.manifest.kv_transfer.lease_s
    before = on_worker(prefill, slow_chunks_before, 64, 16, 0.4 * lease_s)  # 4 chunks: 1.6 leases
    try:
        prompt = first[:64] + random_prompts(1, vocab, 40, 40, seed=242)[0]
        out = generate(cluster, prompt)
    finally:
        on_worker(prefill, restore_chunks, before)
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    assert last_transfer(cluster)["cached_tokens"] == 64
    assert counters(cluster, "decode").get("leases_expired", 0) == expired
    assert_idle(cluster)


def shm_segments(self) -> tuple[int, int]:
    """Inside the prefill worker: shm segments made so far, and those back in the pools for reuse."""
    shm = self.sender._transports["shm"]
    with shm._lock:
        return shm.segments_made, sum(len(pool) for pool in shm._pools.values())


def set_drain_s(self, seconds: float) -> float:
    """Inside the prefill worker: how long an early-ended channel waits for its answers; the value before."""
    sender_module = sys.modules[type(self.sender).__module__]
    before, sender_module.DRAIN_S = sender_module.DRAIN_S, seconds
    return before


@contextlib.contextmanager
def segments_drained_in_full(prefill):
    """A loaded machine may answer an early-ended channel's frames later than the default drain waits
    (the segment is then released, as it should be); these tests are about what happens once they are
    answered. Yields a wait until every segment is back in its pool but those gone before (released by
    earlier tests)."""
    def out_of_pools() -> int:
        made, pooled = on_worker(prefill, shm_segments)
        return made - pooled

    drain_s = on_worker(prefill, set_drain_s, 30.0)
    gone_before = out_of_pools()

    def wait_all_pooled() -> None:
        assert wait_until(lambda: out_of_pools() <= gone_before, 30), \
            f"shm segments (made, pooled): {on_worker(prefill, shm_segments)}; {gone_before} gone before"

    try:
        yield wait_all_pooled
    finally:
        on_worker(prefill, set_drain_s, drain_s)


def test_requests_ending_at_their_first_token_leave_their_shm_segment_to_the_next(cluster, hf_reference):
    """A request that ends at its first token needs no handoff, but its frames are already on their
    way: its channel closes once they are answered, so the next transfer reuses the mapped segment
    instead of making a new one (up to 64 MiB of zeroed pages, costlier than a short prompt's transfer)."""
    prefill = worker(cluster, "prefill")
    prompts = random_prompts(7, hf_reference[ARCH].vocab_size, 60, 60, seed=38)
    with Client(cluster.address) as client, segments_drained_in_full(prefill) as wait_all_pooled:
        made = None
        for prompt in prompts:
            out = client.generate(prompt, max_tokens=1, temperature=0)
            assert out.token_ids == hf_reference[ARCH].greedy(prompt, 1)
            wait_all_pooled()
            made = made if made is not None else on_worker(prefill, shm_segments)[0]
    assert_idle(cluster)
    # Before, every one of these requests made a segment (its channel closed with frames unanswered).
    assert on_worker(prefill, shm_segments)[0] == made


def test_transfers_failed_mid_prompt_leave_their_shm_segment_to_the_next(cluster, hf_reference):
    """A job that fails with frames in flight (here preempted after its first layer went out: its
    prefill worker's KV memory full) drains its channel like one that ended early, so the next
    transfer reuses the segment (for gloo and NCCL: the pair's group stays, and the other transfers
    to that decode worker with it)."""
    def preempt_after_layer_0(self, times: int) -> None:
        push, self.test_preempted = self._push_layer, []

        def push_then_preempt(layer, chunks):
            push(layer, chunks)
            for chunk in chunks if layer == 1 and len(self.test_preempted) < times else []:
                prompt = tuple(chunk.seq.prompt_token_ids)
                if prompt not in self.test_preempted:  # its retry (another request id) goes through
                    self.test_preempted.append(prompt)
                    self._on_preempted(chunk.seq.request_id)

        self.engine.runner.layer_hook = push_then_preempt
        self.test_restore = lambda: setattr(self.engine.runner, "layer_hook", push)

    def receive_slowly(self) -> None:
        """Each frame takes the decode worker 0.2 s: layer 0's is still unanswered at the preemption."""
        decode_frame = self.receiver._decode

        def slow(*args):
            time.sleep(0.2)
            return decode_frame(*args)

        self.receiver._decode = slow
        self.test_restore = lambda: vars(self.receiver).pop("_decode") and None

    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    prompts = random_prompts(5, hf_reference[ARCH].vocab_size, 200, 200, seed=47)
    with segments_drained_in_full(prefill) as wait_all_pooled:
        generate(cluster, prompts[0])
        wait_all_pooled()
        made, retries = on_worker(prefill, shm_segments)[0], cluster.router.stats.retries
        on_worker(prefill, preempt_after_layer_0, 4)
        on_worker(decode, receive_slowly)
        try:
            for prompt in prompts[1:5]:  # each preempted once, then placed afresh and completed
                assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
                wait_all_pooled()
        finally:
            on_worker(prefill, lambda self: self.test_restore())
            on_worker(decode, lambda self: self.test_restore())
    assert cluster.router.stats.retries == retries + 4
    assert_idle(cluster)
    # Before, each failed job's channel closed with its frames unanswered: 4 segments made. The retry
    # beside the first failed job's draining channel needs a second one.
    assert on_worker(prefill, shm_segments)[0] - made <= 1


def slow_first_layer_with_threshold(self, layerwise_min_tokens: int | None) -> None:
    """Each prompt pass pauses before handing over its first layer, so a long prompt's lease (asked for
    beside its pass) is taken before any layer is written; and prompts of at least `layerwise_min_tokens` stream
    layer by layer. None: both as they were."""
    if layerwise_min_tokens is None:
        self.sender.settings, self.engine.runner.layer_hook = self.test_kept
        return
    self.test_kept = (self.sender.settings, self.engine.runner.layer_hook)
    original = self.engine.runner.layer_hook

    def slow(layer, chunks):
        if layer == 0:
            time.sleep(1.0)
        original(layer, chunks)
        # A layer-by-layer transfer sends its first layer while the pass goes on: the pass waits here
        # until that frame has left (bounded), since on a tiny model the rest of the pass takes less
        # time than the sender's thread may take to wake.
        jobs = [self._jobs.get(c.seq.request_id) for c in chunks if len(c.seq.prompt_token_ids) >= layerwise_min_tokens]
        streaming = [job.kv for job in jobs if job is not None and job.kv is not None]
        deadline = time.monotonic() + 10
        while layer == 0 and not all("first_frame" in kv.times for kv in streaming) and time.monotonic() < deadline:
            time.sleep(0.01)

    self.sender.settings = dataclasses.replace(self.sender.settings, layerwise_min_tokens=layerwise_min_tokens)
    self.engine.runner.layer_hook = slow


def test_a_short_prompt_is_sent_when_its_pass_ends_a_long_one_layer_by_layer(cluster, hf_reference):
    vocab = hf_reference[ARCH].vocab_size
    short, long = random_prompts(1, vocab, 40, 40, seed=53)[0], random_prompts(1, vocab, 120, 120, seed=54)[0]
    prefill = worker(cluster, "prefill")
    on_worker(prefill, slow_first_layer_with_threshold, 100)
    try:
        sent = {}
        for name, prompt in (("short", short), ("long", long)):
            assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
            sent[name] = last_transfer(cluster)
    finally:
        on_worker(prefill, slow_first_layer_with_threshold, None)
    assert not sent["short"]["layerwise"] and sent["long"]["layerwise"]
    # The short prompt's first frame left after its pass; the long one's during it.
    assert sent["short"]["first_layer"] >= sent["short"]["prompt_done"]
    assert sent["long"]["first_layer"] < sent["long"]["prompt_done"]
    assert sent["short"]["bytes"] > 0 and sent["long"]["bytes"] > 0
    assert_idle(cluster)


def test_a_corrupt_frame_is_sent_again(cluster, hf_reference, frames):
    before = counters(cluster, "prefill"), counters(cluster, "decode")
    on_worker(worker(cluster, "decode"), corrupt_frames, 1, 1)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 90, 90, seed=33 if frames == "layerwise" else 133)[0]
    assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    after = counters(cluster, "prefill"), counters(cluster, "decode")
    assert after[0]["frames_resent"] == before[0]["frames_resent"] + 1
    assert after[0]["recomputed"] == before[0]["recomputed"]
    assert after[1]["corrupt_frames"] == before[1].get("corrupt_frames", 0) + 1
    config = hf_reference[ARCH].model.config
    head_dim = config.hidden_size // config.num_attention_heads
    layer_bytes = len(prompt) * 2 * config.num_key_value_heads * head_dim * 4  # one layer's float32 K and V
    assert last_transfer(cluster)["bytes"] == (config.num_hidden_layers + 1) * layer_bytes  # layer 1 twice
    assert_idle(cluster)


def hold_resend_until_cancelled(self) -> None:
    """A transfer's second channel (its resend's) opens only once the job has been cancelled (or after
    30 s): the cancel lands between the old channel's close and the new one's open."""
    sender = self.sender
    original, opened, self.test_reopened = sender._open_channel, [], []

    def opening(lease, transfer_id):
        if transfer_id not in opened:
            opened.append(transfer_id)
            return original(lease, transfer_id)
        deadline = time.monotonic() + 30
        while any(j.kv is not None and j.kv.transfer.transfer_id == transfer_id for j in list(self._jobs.values())) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        vars(sender).pop("_open_channel", None)  # the class's method again
        self.test_reopened.append(original(lease, transfer_id))
        return self.test_reopened[-1]

    sender._open_channel = opening


def test_a_cancel_during_a_resend_closes_the_fresh_channel(cluster, hf_reference):
    prefill = worker(cluster, "prefill")
    resent = counters(cluster, "prefill")["frames_resent"]
    on_worker(worker(cluster, "decode"), corrupt_frames, 1, 1)
    on_worker(prefill, hold_resend_until_cancelled)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 80, 80, seed=39)[0]
    try:
        with Client(cluster.address) as client, pytest.raises(DeadlineExceeded):  # the router then cancels it
            client.generate(prompt, max_tokens=NEW_TOKENS, temperature=0, timeout=5.0)
    finally:  # the hook removes itself once used; if the resend never came, it must not outlive the test
        on_worker(prefill, lambda self: vars(self.sender).pop("_open_channel", None) and None)
    assert_idle(cluster)
    assert counters(cluster, "prefill")["frames_resent"] == resent + 1
    deadline = time.time() + 10  # the link closes it once it finds the job gone
    while (closed := on_worker(prefill, lambda self: [c._closed for c in self.test_reopened])) != [True] \
            and time.time() < deadline:
        time.sleep(0.1)
    assert closed == [True], "the resend's channel was left open"


def test_a_frame_corrupt_twice_makes_the_decode_worker_recompute(cluster, hf_reference, frames):
    before = counters(cluster, "prefill"), counters(cluster, "decode")
    on_worker(worker(cluster, "decode"), corrupt_frames, 0, 2)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 70, 70, seed=34 if frames == "layerwise" else 134)[0]
    assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    after = counters(cluster, "prefill"), counters(cluster, "decode")
    assert after[0]["recomputed"] == before[0]["recomputed"] + 1
    assert after[1]["recomputed"] == before[1].get("recomputed", 0) + 1
    assert last_transfer(cluster)["recomputed"]
    assert_idle(cluster)


def test_over_a_slow_link_the_decode_worker_recomputes_instead_of_receiving(cluster, hf_reference):
    def link(self, recompute: bool, bandwidth: dict | None) -> dict:
        """Set the choice and the measured bandwidths (None: one byte/s to every peer); the old ones."""
        old = self.sender._bandwidth
        self.sender.settings = dataclasses.replace(self.sender.settings, recompute=recompute)
        self.sender._bandwidth = dict.fromkeys(old, 1.0) if bandwidth is None else bandwidth
        return old

    vocab = hf_reference[ARCH].vocab_size
    generate(cluster, random_prompts(1, vocab, 60, 60, seed=37)[0])  # sent: the frame sizes are measured
    prefill = worker(cluster, "prefill")
    before = counters(cluster, "prefill")
    measured = on_worker(prefill, link, True, None)  # one byte per second: any prompt is faster to recompute
    assert measured, "the launcher's probe measured no bandwidth"
    try:
        prompt = random_prompts(1, vocab, 60, 60, seed=36)[0]
        assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    finally:
        on_worker(prefill, link, False, measured)
    assert counters(cluster, "prefill")["recompute_chosen"] == before["recompute_chosen"] + 1
    sent = last_transfer(cluster)
    assert sent["recomputed"] and sent["bytes"] == 0
    assert_idle(cluster)


def test_a_lease_expiring_just_after_the_commit_fails_nothing(cluster, hf_reference):
    """The prefill worker's lease check (or a fault) comes the moment after a transfer's commit
    succeeded: the request is the decode worker's by then, so the client gets no error, the router
    redoes nothing, and no lease counts as expired."""
    def expire_after_the_commit(self):
        sender = self.sender
        ended = sender.metrics.ended  # called once the commit has succeeded, before the transfer is ended

        def expire_then_end(*args, **kwargs):
            sender.metrics.ended = ended
            for job in list(self._jobs.values()):
                if job.kv is not None:
                    job.kv.progress_at = time.monotonic() - 3600  # lapsed: the lease check would expire it now
                    sender._keep_leases(job.kv, time.monotonic())
            return ended(*args, **kwargs)

        sender.metrics.ended = expire_then_end

    retries, expired = cluster.router.stats.retries, counters(cluster, "prefill")["leases_expired"]
    on_worker(worker(cluster, "prefill"), expire_after_the_commit)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 50, 50, seed=48)[0]
    assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    assert cluster.router.stats.retries == retries
    assert counters(cluster, "prefill")["leases_expired"] == expired
    assert_idle(cluster)


def test_an_unknown_codec_is_negotiated_down_to_raw(cluster, hf_reference):
    def offer_unknown(self):
        """Offer first a codec the decode worker does not know, as a newer prefill worker could."""
        self.test_codecs = self.sender.codecs
        self.sender.codecs = {"no-such-codec": self.sender.codecs["raw"], **self.sender.codecs}

    prefill = worker(cluster, "prefill")
    on_worker(prefill, offer_unknown)
    try:
        prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 50, 50, seed=35)[0]
        assert generate(cluster, prompt).token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
        assert last_transfer(cluster)["codec"] == "raw"
    finally:
        on_worker(prefill, lambda self: setattr(self.sender, "codecs", self.test_codecs))
    assert_idle(cluster)


def test_a_prefill_worker_offers_only_the_codecs_it_can_encode_with(cluster, tmp_path):
    """A decode worker that can decode a codec this side cannot build (cachegen without the model's
    tables here, fp8 with a torch that lacks it there) would otherwise agree to it and fail every
    transfer: such codecs are left out of the offer, raw always in it. An unreadable tables file
    leaves cachegen out too, and the worker serves (it is built as the worker starts)."""
    def usable(self, names: tuple[str, ...], model_dir: str | None = None) -> list[str]:
        kept, self.model_dir = self.model_dir, model_dir or self.model_dir
        try:
            return list(self._usable_codecs(names))
        finally:
            self.model_dir = kept

    prefill = worker(cluster, "prefill")
    assert on_worker(prefill, usable, ("no-such-codec", "cachegen", "int8")) == ["int8", "raw"]  # no tables here
    (tmp_path / TABLES_FILE).write_bytes(b"not the tables")
    assert on_worker(prefill, usable, ("cachegen", "int8"), str(tmp_path)) == ["int8", "raw"]


def stall_after_layer_0(self) -> None:
    """On the prefill worker: its next forward pass stops after layer 0 until `resume`."""
    original, self.test_gate, self.test_stalled = self._push_layer, threading.Event(), threading.Event()

    def push(layer, chunks):
        original(layer, chunks)
        if layer == 0:
            self.test_stalled.set()
            self.test_gate.wait(60)  # the forward pass does not get to layer 1 until the gate opens

    self.engine.runner.layer_hook = push
    self.test_restore = lambda: setattr(self.engine.runner, "layer_hook", original)


def resume(self) -> None:
    self.test_restore()
    self.test_gate.set()


@contextlib.contextmanager
def stalled_request(cluster, prompt: list[int]) -> Iterator[list]:
    """A request for `prompt` (greedy, 4 tokens) sent from a thread while the prefill worker's next pass
    stalls after layer 0; on exit the pass resumes and the request ends. Yields its outcome's list
    (the tokens or the error, once it ended)."""
    prefill, outcomes = worker(cluster, "prefill"), []
    on_worker(prefill, stall_after_layer_0)

    def call():
        with Client(cluster.address) as client:
            try:
                outcomes.append(client.generate(prompt, max_tokens=4, temperature=0, timeout=60).token_ids)
            except PDServeError as e:
                outcomes.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        yield outcomes
    finally:
        on_worker(prefill, resume)
        caller.join(90)


def test_a_stream_cut_off_mid_transfer_ends_in_lease_expiry(cluster, hf_reference):
    """The prefill worker's stream stops in the middle of the prompt pass, with layer 0 sent (its layers
    go beside the pass: the module's manifest), and nothing else happens (a cut link): the decode
    worker's lease on the half-filled reservation expires; when the prefill side resumes, its transfer
    is gone and it reports the failure; the router tries the request again, which completes with
    exactly the undisturbed tokens, and both pools are free."""
    expired_before = counters(cluster, "decode").get("leases_expired", 0)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 120, 120, seed=36)[0]
    retries = cluster.router.stats.retries
    with stalled_request(cluster, prompt) as outcomes:
        deadline = time.time() + cluster.manifest.kv_transfer.lease_s + 15
        while counters(cluster, "decode").get("leases_expired", 0) == expired_before:
            assert time.time() < deadline, "the lease never expired"
            time.sleep(0.2)
    assert outcomes == [hf_reference[ARCH].greedy(prompt, 4)], outcomes
    assert cluster.router.stats.retries == retries + 1
    assert_idle(cluster)


def test_a_pass_whose_kv_goes_after_it_holds_nothing_on_its_decode_worker_until_it_ends(cluster, hf_reference):
    """A short prompt's frames go once its pass ends (`layerwise_min_tokens`), so its reservation is
    asked for only then: while the pass stalls, its decode worker holds nothing of it (no lease to
    lapse), and once the pass goes on the request completes exactly, without a retry."""
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")
    before = on_worker(prefill, set_layerwise_min_tokens, 10**6)
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 120, 120, seed=136)[0]
    retries = cluster.router.stats.retries
    try:
        with stalled_request(cluster, prompt) as outcomes:
            assert wait_until(lambda: on_worker(prefill, lambda self: self.test_stalled.is_set()), 30)
            assert on_worker(decode, lambda self: self.receiver.num_in_flight) == 0
    finally:
        on_worker(prefill, set_layerwise_min_tokens, before)
    assert outcomes == [hf_reference[ARCH].greedy(prompt, 4)], outcomes
    assert cluster.router.stats.retries == retries
    assert_idle(cluster)


def test_a_decode_worker_hanging_in_the_commit_lets_the_prefill_lease_expire(cluster, hf_reference):
    """The decode worker takes every frame but never answers the commit (a hang, not a death: its
    pings still answer). Both leases lapse: the decode side's (no frame for `lease_s`) and then the
    prefill side's (no progress for `lease_s` + margin), which frees the prefill worker's blocks and
    tells the router; the request is retried and completes with exactly the undisturbed tokens."""
    decode = worker(cluster, "decode")
    expired_before = counters(cluster, "prefill")["leases_expired"]
    on_worker(decode, install_gate, "receiver.commit")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 60, 60, seed=37)[0]
    outcomes: list[object] = []
    retries = cluster.router.stats.retries
    caller = threading.Thread(target=lambda: outcomes.append(generate(cluster, prompt).token_ids))
    caller.start()
    try:
        deadline = time.time() + cluster.manifest.kv_transfer.lease_s + 20
        while counters(cluster, "prefill")["leases_expired"] == expired_before:
            assert time.time() < deadline, "the prefill side's lease never expired"
            time.sleep(0.2)
    finally:
        on_worker(decode, open_gate)
        caller.join(90)
    assert outcomes == [hf_reference[ARCH].greedy(prompt, NEW_TOKENS)], outcomes
    assert cluster.router.stats.retries == retries + 1
    assert_idle(cluster)


def test_the_prefill_worker_lets_go_of_a_restarted_decode_workers_old_address(cluster, hf_reference):
    """Killed (SIGKILL) and restarted by Ray, the decode worker listens on new addresses; the prefill
    worker's first lease from it makes it let go of what it held for the old one (its idle shm
    segments, up to 64 MiB each, mapped for a receiver that no longer exists)."""
    prefill, decode = worker(cluster, "prefill"), worker(cluster, "decode")

    def pooled(self) -> list[str]:
        return sorted(self.sender._transports["shm"]._pools)

    before, after = random_prompts(2, hf_reference[ARCH].vocab_size, 50, 50, seed=40)
    generate(cluster, before)  # its transfer leaves its segment pooled for the decode worker
    old = on_worker(decode, lambda self: self.kv_addresses["shm"])
    assert old in on_worker(prefill, pooled)
    os.kill(on_worker(decode, lambda self: os.getpid()), signal.SIGKILL)
    deadline = time.monotonic() + 120
    # Until the supervisor has seen the restarted worker alive and profiled (its status is the new
    # incarnation's, with the new address).
    while not (decode.healthy and decode.status.kv_addresses.get("shm") not in (None, old)):
        assert time.monotonic() < deadline, "the decode worker never came back"
        time.sleep(0.2)
    new = decode.status.kv_addresses["shm"]
    assert generate(cluster, after).token_ids == hf_reference[ARCH].greedy(after, NEW_TOKENS)
    assert_idle(cluster)
    assert on_worker(prefill, pooled) == [new]


def dispatch(prefill, prompt: list[int], decode, name: str) -> None:
    """Hand a prompt to a prefill worker for a chosen decode worker, as the router does (minus its stream)."""
    work = WorkRequest(f"{name}-{uuid.uuid4().hex}", prompt, SamplingParams.greedy(max_tokens=4))
    prefill.handle.prefill.remote(work, decode.handle)


def committed(self) -> int:
    """On a prefill worker: how many transfers it has committed."""
    return len(self.sender.transfer_log)


# A reservation left unanswered is found out 1 + 4 s after it was asked for (10 + 10 s by default).
QUICK_RESERVATIONS = {"reserve_wait_s": 1, "reserve_answer_margin_s": 4}
TWO_DECODE_POOLS = {"prefill": {"num_cpus": 0.25}, "decode": {"replicas": 2, "num_cpus": 0.25}}


@pytest.fixture(scope="module")
def two_decode_cluster(model_dirs):
    """One prefill and two decode workers, the default reservation bounds."""
    with Cluster(manifest(model_dirs[ARCH], pools=TWO_DECODE_POOLS), log=lambda _: None) as c:
        yield c


@pytest.fixture(scope="module")
def two_decode_quick_cluster(model_dirs):
    """One prefill and two decode workers; an unanswered reservation is found out quickly, and the
    router alternates between the decode workers."""
    with Cluster(manifest(model_dirs[ARCH], pools=TWO_DECODE_POOLS, kv_transfer=QUICK_RESERVATIONS,
                          router={"decode_policy": "round_robin"}), log=lambda _: None) as c:
        yield c


@contextlib.contextmanager
def one_of_two_decode_workers_hung_in(cluster: Cluster, method: str):
    """The cluster's first decode worker hangs in `method` (alive: its pings answer) until the block
    ends; yields (prefill, hung, healthy) and checks afterwards that every pool ends free. Starts once
    whatever an earlier test on the cluster left (had it failed) has ended."""
    prefill = worker(cluster, "prefill")
    hung, healthy = [w for w in cluster.workers if w.pool == "decode"]
    settle(cluster, prefill)
    on_worker(hung, install_gate, method)
    try:
        yield prefill, hung, healthy
    finally:
        on_worker(hung, open_gate)
    settle(cluster, prefill)


def settle(cluster: Cluster, prefill) -> None:
    """Until every pool is free and the prefill worker refuses no decode worker (bounded)."""
    idle, status = cluster.wait_idle(60)
    assert idle, status
    assert wait_until(lambda: on_worker(prefill, refuses_no_decode_worker), 10), "a decode worker stayed refused"


def refuses_no_decode_worker(self) -> bool:
    """On a prefill worker: whether it would start a prompt for every decode worker it knows."""
    return all(self.sender.refusal(peer) is None for peer in self._peers.values())


def unanswered_reservations(self) -> int:
    """On a prefill worker: how many decode workers' reservations it has found unanswered."""
    return self.counters["reservations_unanswered"]


def test_a_decode_worker_hanging_in_its_commits_holds_up_no_transfer_to_another(two_decode_cluster, hf_reference):
    """One decode worker hangs in every commit with more commits waiting on it than the prefill worker
    had commit threads in all. A transfer to the other decode worker still commits at once: within the
    lease, where behind the hung worker's commits it waited until its own lease lapsed. The hung
    transfers end in lease expiry."""
    prompts = random_prompts(6, hf_reference[ARCH].vocab_size, 40, 40, seed=41)
    c = two_decode_cluster
    with one_of_two_decode_workers_hung_in(c, "receiver.commit") as (prefill, hung, healthy):
        for prompt in prompts[:5]:
            dispatch(prefill, prompt, hung, "to-hung")
        assert wait_until(lambda: on_worker(prefill, prefill_job_states).count("committing") == 5, 20), \
            "the transfers to the hung worker never reached their commit"
        before = on_worker(prefill, committed)
        dispatch(prefill, prompts[5], healthy, "to-healthy")
        assert wait_until(lambda: on_worker(prefill, committed) > before, c.manifest.kv_transfer.lease_s), \
            "the transfer to the healthy decode worker waited behind the hung one"  # till its own lease lapsed


def test_a_decode_worker_not_answering_its_reservation_holds_up_no_prompt_for_another(two_decode_cluster,
                                                                                       hf_reference):
    """One decode worker hangs in its reservations, with prompts started for it (one, or a batch of
    shorts) and any others queued behind them. A prompt for the other decode worker starts and commits
    at once, where it waited behind the hung reservation for its whole bounded wait (`reserve_wait_s`
    + 10 s); those for the hung worker stay where they were."""
    prompts = random_prompts(5, hf_reference[ARCH].vocab_size, 40, 40, seed=42)
    c = two_decode_cluster
    with one_of_two_decode_workers_hung_in(c, "receiver.reserve") as (prefill, hung, healthy):
        for prompt in prompts[:4]:
            dispatch(prefill, prompt, hung, "to-hung")

        def all_there_and_started() -> bool:
            states = on_worker(prefill, prefill_job_states)
            return len(states) == 4 and states.count("queued") < 4

        assert wait_until(all_there_and_started, 20), "the prompts for the hung worker never got there"
        queued = on_worker(prefill, prefill_job_states).count("queued")
        before = on_worker(prefill, committed)
        dispatch(prefill, prompts[4], healthy, "to-healthy")
        assert wait_until(lambda: on_worker(prefill, committed) > before, c.manifest.kv_transfer.reserve_wait_s), \
            "the prompt for the healthy decode worker waited behind the hung one"  # the hung reservation waits longer
        states = on_worker(prefill, prefill_job_states)  # none committed or failed, none started since
        assert len(states) == 4 and states.count("queued") == queued, states


def record_errors(self) -> None:
    """On a prefill worker: keep each error it reports to the router (`self.test_errors`: request -> code)
    until `stop_recording_errors`."""
    self.test_errors, send = {}, self.sink.send

    def recording(request_id, *args, **kwargs):
        if kwargs.get("error") is not None:
            self.test_errors[request_id] = kwargs.get("error_code")
        return send(request_id, *args, **kwargs)

    self.sink.send = recording


def stop_recording_errors(self) -> None:
    vars(self.sink).pop("send")


def test_a_decode_worker_leaving_a_reservation_unanswered_gets_no_prompt_until_it_answers(two_decode_quick_cluster,
                                                                                         hf_reference):
    """A decode worker hangs in its reservations (its pings answer). Once the first one outlives its
    bound, the prompts queued for it fail at once with UNAVAILABLE (the router places them elsewhere),
    where each waited out the bound in turn, filling `max_queued` for every decode worker; a new prompt
    for it fails at once too. When it answers that reservation, it takes prompts again."""
    prompts = random_prompts(6, hf_reference[ARCH].vocab_size, 40, 40, seed=43)
    c = two_decode_quick_cluster
    with one_of_two_decode_workers_hung_in(c, "receiver.reserve") as (prefill, hung, healthy):
        on_worker(prefill, record_errors)
        try:
            unanswered = on_worker(prefill, unanswered_reservations)
            bound = c.manifest.deadlines.kv.reservation_bound_s
            for prompt in prompts[:4]:  # the first waits for its lease; the others queue behind it
                dispatch(prefill, prompt, hung, "queued-for-hung")
            assert wait_until(lambda: len(on_worker(prefill, lambda self: self.test_errors)) == 4, bound + 5), \
                "the prompts queued for the unanswering decode worker did not all fail"  # one per bound before
            assert set(on_worker(prefill, lambda self: self.test_errors).values()) == {"UNAVAILABLE"}
            assert on_worker(prefill, unanswered_reservations) == unanswered + 1

            dispatch(prefill, prompts[4], hung, "new-for-hung")  # refused on arrival: not queued
            assert wait_until(lambda: len(on_worker(prefill, lambda self: self.test_errors)) == 5, 2)
            assert on_worker(prefill, prefill_job_states) == []

            before = on_worker(prefill, committed)
            on_worker(hung, open_gate)  # the reservation is answered (refused: its transfer was aborted)
            assert wait_until(lambda: on_worker(prefill, refuses_no_decode_worker), 10)
            dispatch(prefill, prompts[5], hung, "after-answer")
            assert wait_until(lambda: on_worker(prefill, committed) > before, 10), "the decode worker got no prompt again"
            assert len(on_worker(prefill, lambda self: self.test_errors)) == 5
        finally:
            on_worker(prefill, stop_recording_errors)


def test_every_request_completes_through_the_router_while_a_decode_worker_leaves_reservations_unanswered(
        two_decode_quick_cluster, hf_reference):
    """Requests through the router, half of them placed on a decode worker that hangs in its
    reservations: each completes with transformers' tokens. Those placed on it fail over to the other
    decode worker, the ones queued behind the first unanswered reservation as soon as it outlives its
    bound, not one bound after another."""
    prompts = random_prompts(8, hf_reference[ARCH].vocab_size, 30, 60, seed=44)
    c = two_decode_quick_cluster
    with one_of_two_decode_workers_hung_in(c, "receiver.reserve") as (prefill, hung, healthy):
        retries, unanswered = c.router.stats.retries, on_worker(prefill, unanswered_reservations)
        with Client(c.address, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                              ignore_eos=True).token_ids, prompts))
        assert outputs == [hf_reference[ARCH].greedy(p, NEW_TOKENS) for p in prompts]
        assert c.router.stats.retries - retries >= len(prompts) // 2  # each one placed on the hung worker
        # One unanswered reservation failed every transfer queued behind it: each waiting out a bound
        # of its own would count one each.
        assert on_worker(prefill, unanswered_reservations) == unanswered + 1


def test_the_trained_model_serves_with_cachegen_frames():
    """CacheGen end to end on the shipped model (its tables ship with it): the decode side agrees to
    it, the frames are a fraction of the raw bytes, and the request completes with text."""
    model_dir = resolve_model("pystd-llama")
    m = manifest(model_dir, kv_transfer={"codec": ["cachegen", "raw"]})
    with Cluster(m, log=lambda _: None) as c, Client(c.address) as client:
        out = client.generate("import os\nimport sys\n\n\ndef main(argv):\n" * 20, max_tokens=16, temperature=0)
        sent = last_transfer(c)
        assert sent["codec"] == "cachegen" and not sent["recomputed"]
        assert len(out.token_ids) == 16 and out.text
        hf = AutoConfig.from_pretrained(model_dir)
        raw_bytes = sent["tokens"] * hf.num_hidden_layers * 2 * hf.num_key_value_heads * (
            hf.hidden_size // hf.num_attention_heads) * 4
        assert sent["bytes"] < raw_bytes / 6, (sent["bytes"], raw_bytes)
        assert_idle(c)


def test_pools_set_up_apart_are_the_clusters_fault_not_the_requests(cluster, hf_reference, caplog):
    """A prefill worker wanting gRPC for a decode worker that listens on shared memory only fails the
    attempt as UNAVAILABLE, naming the mismatch, so the router retries it: on the decode worker, where
    it completes, or on the same prefill worker until the retries are spent (the router's choice
    rests on its timing estimates; either way each failed attempt names the mismatch). It failed as
    INVALID_ARGUMENT, telling the client its request was wrong, and nothing retried it."""
    def want(self, transport: str) -> None:
        self.sender.settings = dataclasses.replace(self.sender.settings, transport=transport)

    prefill = worker(cluster, "prefill")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 60, 60, seed=49)[0]
    on_worker(prefill, want, "grpc")
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"):
        try:
            out = generate(cluster, prompt)
        except PDServeError as e:
            assert isinstance(e, Unavailable) and "does not listen on 'grpc'" in str(e), e
        else:
            assert out.token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
        finally:
            on_worker(prefill, want, "shm")
        assert wait_until(lambda: lifetime_records(caplog), 10), "the router never ended the request"
    (ended,) = lifetime_records(caplog)
    assert ended["retries"] and all("does not listen on 'grpc'" in cause for cause in ended["retries"]), ended
    assert_idle(cluster)
