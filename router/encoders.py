"""The encode pool as the router sees it: which encode worker takes a request's images, and what to do
when it fails.

A request's images go to the encoder that encoded most of them lately (by a hash of their bytes, which
the router has without decoding them), else to the one with the fewest requests in hand, so a
repeated image is found in that encoder's cache instead of being encoded again elsewhere. An encoder
that fails a call (its process died, its node went away, or it did not answer within the encode
timeout) is skipped until Ray has restarted it and answers again; when none answers, the request goes
on without embeddings and its prefill worker encodes the images itself: an encoder's fault never
fails a request, nor holds it past the timeout. An encoder whose tower raised on a request's images
is not skipped (the images are at fault, and would break another's tower too): that request alone
goes to its prefill worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from pdserve.wire import EncodedImages

log = logging.getLogger(__name__)

KEYS_KEPT = 65_536  # image keys remembered (each maps to the encoder that made its embeddings)
RETRY_AFTER_FAULT_S = 5.0  # an encoder that failed is tried again after this (Ray restarts it meanwhile)
TRIES = 2  # encoders tried per request before its prefill worker encodes instead


@dataclass(eq=False)
class EncoderRef:
    name: str
    handle: Any  # Ray actor handle
    outstanding: int = 0  # requests sent and not answered
    failed_at: float | None = None  # monotonic time of its last failed call

    def available(self, now: float) -> bool:
        return self.failed_at is None or now - self.failed_at > RETRY_AFTER_FAULT_S


@dataclass
class EncodeStats:
    requests: int = 0  # requests with images sent to the pool
    images: int = 0
    routed_to_holder: int = 0  # images sent to the encoder that made them before
    faults: int = 0  # encoder calls that failed: the encoder died, went away or did not answer in time
    errors: int = 0  # encoder calls whose images made its tower raise (another encoder would too)
    fallbacks: int = 0  # requests left to their prefill worker to encode (no encoder answered)
    per_encoder: dict[str, int] = field(default_factory=dict)


class EncodePool:
    def __init__(self, encoders: list[EncoderRef], timeout_s: float = 60.0) -> None:
        self.encoders = encoders
        self.timeout_s = timeout_s  # one encoder's answer; past it the encoder counts as failed
        self._holder: OrderedDict[bytes, EncoderRef] = OrderedDict()  # image key -> encoder that made it
        self.stats = EncodeStats()

    async def encode(self, request_id: str, images: tuple[bytes, ...]) -> EncodedImages | None:
        """Where the images' embeddings wait once an encoder has made them (it sends them to the
        prompt-pass worker that asks); None when no encoder could (that worker then encodes them).
        ValueError: a bad image (an encoder decodes them first), which no other encoder would take either."""
        keys = [hashlib.blake2b(data, digest_size=16).digest() for data in images]
        self.stats.requests += 1
        self.stats.images += len(images)
        tried: set[EncoderRef] = set()
        for _ in range(min(TRIES, len(self.encoders))):
            encoder = self.choose(keys, tried)
            if encoder is None:
                break
            tried.add(encoder)
            encoder.outstanding += 1
            try:
                ref = encoder.handle.encode.remote(request_id, images)
                specs = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)  # a late one: dropped
            except Exception as e:
                cause = getattr(e, "cause", None)  # what the encoder's method raised (Ray's task error), if it ran
                if isinstance(cause or e, ValueError):
                    raise ValueError(str(cause or e)) from None
                if cause is not None:  # the encoder lives: these images broke its tower, and would break another's
                    self.stats.errors += 1
                    log.warning("request %s: encoder %s failed on its images (%s); its prefill worker encodes them",
                                request_id, encoder.name, type(cause).__name__)
                    break
                encoder.failed_at = time.monotonic()
                self.stats.faults += 1
                log.warning("request %s: encoder %s failed (%s); trying another", request_id, encoder.name,
                            type(e).__name__)
                continue
            finally:
                encoder.outstanding -= 1
            encoder.failed_at = None
            self.stats.per_encoder[encoder.name] = self.stats.per_encoder.get(encoder.name, 0) + 1
            self.remember(keys, encoder)
            return EncodedImages(encoder.handle, encoder.name, request_id, tuple(specs))
        self.stats.fallbacks += 1
        return None

    def choose(self, keys: list[bytes], tried: Collection[EncoderRef] = ()) -> EncoderRef | None:
        """The encoder for images of these keys: of those not `tried` and not failed lately, the one that
        made most of them, else the one with the fewest requests in hand; None when none is left."""
        now = time.monotonic()
        candidates = [e for e in self.encoders if e not in tried and e.available(now)]
        if not candidates:
            return None
        held = {e: sum(self._holder.get(k) is e for k in keys) for e in candidates}
        best = max(candidates, key=lambda e: (held[e], -e.outstanding))
        self.stats.routed_to_holder += held[best]
        return best

    def remember(self, keys: list[bytes], encoder: EncoderRef) -> None:
        """`encoder` made the embeddings of images of these keys (its cache holds them now)."""
        for key in keys:
            self._holder[key] = encoder
            self._holder.move_to_end(key)
        while len(self._holder) > KEYS_KEPT:
            self._holder.popitem(last=False)


class EncodeCollector:
    """The encode pool's counts on /metrics, read at scrape time (none while the cluster has no pool)."""

    def __init__(self, pool: Callable[[], EncodePool | None]) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self.pool()
        if pool is None:
            return
        s = pool.stats
        for name, value, what in (
                ("pdserve_encode_requests", s.requests, "Requests whose images went to the encode pool"),
                ("pdserve_encode_images", s.images, "Images sent to the encode pool"),
                ("pdserve_encode_images_to_holder", s.routed_to_holder,
                 "Images sent to the encoder that made their embeddings before (its cache has them)"),
                ("pdserve_encode_faults", s.faults, "Encoder calls that failed (the request tried another encoder)"),
                ("pdserve_encode_fallbacks", s.fallbacks,
                 "Requests no encoder answered, their images encoded by their prefill worker"),
                ("pdserve_encode_errors", s.errors,
                 "Encoder calls whose images made the tower raise (left to the prefill worker)")):
            yield CounterMetricFamily(name, what, value=value)
        per = CounterMetricFamily("pdserve_encode_worker_requests", "Requests each encoder answered",
                                  labels=["worker"])
        for worker, count in sorted(s.per_encoder.items()):
            per.add_metric([worker], count)
        yield per
