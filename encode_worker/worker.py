"""An encode worker: images in, embeddings out, cached by the images' pixels.

It holds the vision tower and projector of the served model and nothing of its language model, so the
prompt-pass workers never stop their engine for an image: the router sends a request's images here
first, and the prefill worker receives the embeddings (through Ray's object store) to splice into the
prompt. Passes run one at a time (each a batched pass of the tower over a request's images); the actor
is threaded so that `ping` answers during one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import ray
import torch

from pdserve.diagnostics import LogLevel, configure_diagnostics
from pdserve.engine.model_store import ModelSource, materialize
from pdserve.engine.multimodal.images import ImageLimits, decode_image
from pdserve.engine.multimodal.vision import EncodedImage, load_encoder


ENCODER_CONCURRENCY = 4  # Ray threads: a pass, its health checks, and calls queued behind the pass's lock


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


class EncodeWorker:
    def __init__(self, worker_id: str, model: ModelSource, dtype: str, device: str, limits: ImageLimits,
                 cache_bytes: int, num_threads: int | None = None, log_level: LogLevel = "warning") -> None:
        configure_diagnostics(log_level)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.worker_id = worker_id
        model_dir, _ = materialize(model, ray.get)
        self.vision = load_encoder(model_dir, getattr(torch, dtype), device)
        self.limits = limits
        self.cache = EmbeddingCache(cache_bytes)
        self.node_ip = ray.util.get_node_ip_address()
        self.images_encoded = self.cache_hits = 0
        self._lock = threading.Lock()  # one pass at a time: Ray runs this actor's calls on several threads

    def encode(self, images: tuple[bytes, ...]) -> list[EncodedImage]:
        """The embeddings of each image, in order (ValueError naming a bad image)."""
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
        return [hit or made[image.content_hash] for image, hit in zip(decoded, found)]

    def ping(self) -> EncoderStatus:
        """Answers while a pass runs (the actor is threaded): counters read without the pass's lock."""
        return EncoderStatus(self.worker_id, self.node_ip, self.images_encoded, self.cache_hits, len(self.cache),
                             self.cache.bytes)
