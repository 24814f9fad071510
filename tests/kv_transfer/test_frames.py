"""The level controller: the finest CacheGen level that still fits the time left at the measured
bandwidth, the coarsest when nothing fits, and the transfer-time estimate the recompute decision uses."""

from __future__ import annotations

import time

import pytest
import torch
from kv_helpers import LAYOUT, synthetic_kv, synthetic_tables

from pdserve.kv_transfer.codecs import make_codec
from pdserve.kv_transfer.frames import LevelController, LevelSizes


@pytest.fixture(scope="module")
def cachegen(tmp_path_factory):
    return make_codec("cachegen", synthetic_tables(tmp_path_factory.mktemp("cachegen")), LAYOUT)


def sizes_by_level(codec, kv) -> list[int]:
    return [codec.encode(kv, 0, level).nbytes for level in range(codec.num_levels)]


def test_without_an_objective_every_frame_is_finest(cachegen):
    controller = LevelController(cachegen, LevelSizes({}), bandwidth_bps=1.0, deadline=None)
    level, _ = controller.encode(synthetic_kv(200, seed=1), 0, tokens_left=10**9)
    assert level == 0


@pytest.mark.parametrize("fits_level", [0, 1, 2])
def test_the_finest_level_that_fits_the_time_left(cachegen, fits_level):
    kv = synthetic_kv(300, seed=2)
    sizes = sizes_by_level(cachegen, kv)
    tokens_left = 3000  # ten such frames to go
    # A bandwidth at which level `fits_level` takes 1 s for what is left, every finer level more.
    bandwidth = sizes[fits_level] / 300 * tokens_left / 1.0
    controller = LevelController(cachegen, LevelSizes({}), bandwidth, deadline=time.time() + 1.05)
    level, payload = controller.encode(kv, 0, tokens_left)
    assert level == fits_level
    decoded = cachegen.decode(memoryview(payload), 0, level, 300, torch.float32)
    assert decoded.shape == kv.shape


def test_the_coarsest_level_when_nothing_fits_and_the_estimate_uses_it(cachegen):
    kv = synthetic_kv(300, seed=3)
    controller = LevelController(cachegen, LevelSizes({}), bandwidth_bps=1e3, deadline=time.time() + 0.001)
    assert controller.transfer_s(1000) is None  # nothing measured yet
    level, _ = controller.encode(kv, 0, tokens_left=300)
    assert level == cachegen.num_levels - 1
    coarsest = min(controller.sizes.bytes_per_token.values())
    assert controller.transfer_s(1000) == pytest.approx(coarsest * 1000 / 1e3)


def test_a_level_first_measured_on_a_short_frame_is_measured_again_on_a_long_one(cachegen):
    """A short frame's fixed bytes (header, escape count, a group's anchor token) make its bytes per
    token larger than a long frame's: a level measured once on a 1-token frame, and judged by that
    figure alone, would look too large for every long frame after, and never be chosen again."""
    short, long = synthetic_kv(1, seed=4), synthetic_kv(1200, seed=5)
    per_token = [size / 1200 for size in sizes_by_level(cachegen, long)]
    sizes = LevelSizes({})
    LevelController(cachegen, sizes, bandwidth_bps=1.0, deadline=None).encode(short, 0, tokens_left=1)
    assert sizes.bytes_per_token[0] > 1.2 * per_token[0]  # as the short frame measured it
    # Room for level 0 at its long-frame size, but not at the short frame's figure.
    bandwidth = 1.1 * per_token[0] * 12000 / 1.0
    controller = LevelController(cachegen, sizes, bandwidth, deadline=time.time() + 1.0)
    level, _ = controller.encode(long, 0, tokens_left=12000)
    assert level == 0
    assert sizes.bytes_per_token[0] == pytest.approx(per_token[0]) and sizes.measured_on[0] == 1200
    controller.encode(short, 0, tokens_left=1)  # a short frame again: it does not skew the long frames' figure
    assert sizes.bytes_per_token[0] == pytest.approx(per_token[0])


def test_a_bandwidth_of_zero_is_refused():
    with pytest.raises(ValueError, match="bandwidth"):
        LevelController(make_codec("raw", None, LAYOUT), LevelSizes({}), bandwidth_bps=0.0, deadline=None)


@pytest.mark.parametrize("name", ["raw", "int8", "fp8"])
def test_a_codec_of_fixed_size_has_a_transfer_estimate_before_its_first_frame(name):
    """The recompute decision needs the estimate on a worker's first transfer too; for these codecs
    it is exact: what a frame of any length encodes to."""
    codec = make_codec(name, None, LAYOUT)
    controller = LevelController(codec, LevelSizes.of(codec), bandwidth_bps=1e3, deadline=None)
    for num_tokens in (1, 37, 300):
        kv = synthetic_kv(num_tokens, seed=num_tokens).to(LAYOUT.dtype)
        assert controller.transfer_s(num_tokens) == pytest.approx(codec.encode(kv, 0).nbytes / 1e3)


def test_a_codec_whose_size_depends_on_the_values_is_measured(cachegen):
    assert LevelController(cachegen, LevelSizes.of(cachegen), 1e3, None).transfer_s(1000) is None


def test_a_frame_larger_than_raw_is_measured_at_raw_size_the_size_it_travels_at(cachegen):
    """KV far outside the tables' range escapes value by value, past raw's size: such a frame goes raw,
    so the transfer-time estimate (and the recompute decision on it) counts raw's bytes, not CacheGen's."""
    kv = synthetic_kv(100, seed=7).to(LAYOUT.dtype) * 1e6
    raw_bytes = kv.numel() * kv.element_size()
    assert cachegen.encode(kv, 0).nbytes > raw_bytes
    controller = LevelController(cachegen, LevelSizes({}), 1e3, None)
    controller.encode(kv, 0, tokens_left=100)
    assert controller.transfer_s(100) == pytest.approx(raw_bytes / 1e3)
