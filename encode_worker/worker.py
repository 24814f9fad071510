"""An encode worker: images in, embeddings out, cached by the images' pixels.

It holds the vision tower and projector of the served model and nothing of its language model, so the
prompt-pass workers never stop their engine for an image: the router sends a request's images here
first (`encode`: the answer is their shapes), and the worker that runs the request's prompt pass asks
for the embeddings (`send_embeddings`), which travel over the KV-transfer layer into its reservation.
A request's embeddings are held here for `HELD_S` after they are made (a worker that resumes the
request elsewhere asks again), within a bound on their bytes; one let go is encoded by the worker
that asks instead. Passes run one at a time (each a batched pass of the tower over a request's
images); sends run on threads of their own (`SEND_GROUP`), and `ping` answers during either.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray
import torch

from pdserve.diagnostics import LogLevel, configure_diagnostics
from pdserve.engine.model_store import ModelSource, materialize
from pdserve.engine.multimodal.images import ImageLimits, decode_image
from pdserve.engine.multimodal.placement import EmbeddingSpec
from pdserve.engine.multimodal.vision import EncodedImage, load_encoder
from pdserve.kv_transfer.embeddings import EmbeddingSender
from pdserve.kv_transfer.interface import Lease
from pdserve.kv_transfer.settings import TransferSettings


ENCODER_CONCURRENCY = 4  # Ray threads: a pass, its health checks, and calls queued behind the pass's lock
SEND_GROUP = "send"  # sends wait on the receiver, not on the pass: threads of their own
SEND_THREADS = 8
HELD_S = 300.0  # a request's embeddings wait this long for the workers that ask for them
HELD_MIN_BYTES = 64 << 20  # held embeddings take up to the cache's size, and at least this


@dataclass(frozen=True)
class EncoderStatus:
    worker_id: str
    node_ip: str
    images_encoded: int  # by its tower, since it started
    cache_hits: int  # images answered from its cache
    cached_images: int
    cached_bytes: int


class EmbeddingCache:
    """The embeddings of recent images by pixel hash, least recently used out past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._images: OrderedDict[bytes, EncodedImage] = OrderedDict()
        self.bytes = 0

    def get(self, content_hash: bytes) -> EncodedImage | None:
        image = self._images.get(content_hash)
        if image is not None:
            self._images.move_to_end(content_hash)
        return image

    def put(self, image: EncodedImage) -> None:
        size = image.embeddings.nbytes
        if size > self.capacity_bytes or image.content_hash in self._images:
            return
        self._images[image.content_hash] = image
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, evicted = self._images.popitem(last=False)
            self.bytes -= evicted.embeddings.nbytes

    def __len__(self) -> int:
        return len(self._images)


class HeldEmbeddings:
    """Each request's embeddings, from its `encode` until `HELD_S` later, oldest let go past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[str, tuple[float, list[EncodedImage]]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, images: list[EncodedImage]) -> None:
        with self._lock:
            self._drop(self._held.pop(key, None))
            self._held[key] = (time.monotonic(), images)
            self.bytes += _nbytes(images)
            now = time.monotonic()
            while self._held and (self.bytes > self.capacity_bytes or now - next(iter(self._held.values()))[0] > HELD_S):
                self._drop(self._held.popitem(last=False)[1])

    def get(self, key: str) -> list[EncodedImage]:
        with self._lock:
            held = self._held.get(key)
        if held is None or time.monotonic() - held[0] > HELD_S:
            raise LookupError(f"the embeddings of {key!r} are no longer held here")
        return held[1]

    def _drop(self, held: tuple[float, list[EncodedImage]] | None) -> None:
        if held is not None:
            self.bytes -= _nbytes(held[1])


def _nbytes(images: list[EncodedImage]) -> int:
    return sum(image.embeddings.nbytes for image in images)


class EncodeWorker:
    def __init__(self, worker_id: str, model: ModelSource, dtype: str, device: str, limits: ImageLimits,
                 cache_bytes: int, kv_settings: TransferSettings, num_threads: int | None = None,
                 log_level: LogLevel = "warning") -> None:
        configure_diagnostics(log_level)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        model_dir, _ = materialize(model, ray.get)
        self.vision = load_encoder(model_dir, getattr(torch, dtype), device)
        self.limits = limits
        self.cache = EmbeddingCache(cache_bytes)
        self.node_ip = ray.util.get_node_ip_address()
        self.held = HeldEmbeddings(max(cache_bytes, HELD_MIN_BYTES))
        self.sender = EmbeddingSender(kv_settings.on_node(self.node_ip), ray.get_runtime_context().get_node_id())
        self.images_encoded = self.cache_hits = 0
        self._lock = threading.Lock()  # one pass at a time: Ray runs this actor's calls on several threads

    def encode(self, key: str, images: tuple[bytes, ...]) -> tuple[EmbeddingSpec, ...]:
        """Make (or find in the cache) the embeddings of each image, in order, and hold them under
        `key` for `send_embeddings`; their shapes. ValueError naming a bad image."""
        self.limits.check_count(len(images))
        decoded = [decode_image(data, self.limits, i) for i, data in enumerate(images)]
        with self._lock:
            found = [self.cache.get(image.content_hash) for image in decoded]
            missing = {image.content_hash: image for image, hit in zip(decoded, found) if hit is None}
            prepared = [self.vision.prepare(image) for image in missing.values()]
            made = dict(zip(missing, self.vision.encode_images(prepared)))
            for image in made.values():
                self.cache.put(image)
            self.images_encoded += len(made)
            self.cache_hits += len(images) - len(missing)
        encoded = [hit or made[image.content_hash] for image, hit in zip(decoded, found)]
        self.held.put(key, encoded)
        return tuple(image.spec for image in encoded)

    @ray.method(concurrency_group=SEND_GROUP)
    def send_embeddings(self, key: str, lease: Lease) -> int:
        """Send the embeddings held under `key` into the reservation `lease` names (the KV-transfer
        layer: the transport it picks for the pair, raw frames with checksums); the bytes sent.
        LookupError when they are no longer held; TransferError when the transfer fails."""
        return self.sender.send(lease, self.held.get(key), timeout_s=lease.lease_s)

    def shutdown(self) -> None:
        """Let the sending halves go (shared-memory segments, connections) before the actor is killed."""
        self.sender.close()

    def ping(self) -> EncoderStatus:
        """Answers while a pass runs (the actor is threaded): counters read without the pass's lock."""
        return EncoderStatus(self.worker_id, self.node_ip, self.images_encoded, self.cache_hits, len(self.cache),
                             self.cache.bytes)
