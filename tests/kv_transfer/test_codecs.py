"""Codecs: lossless ones round-trip bit-exactly, lossy ones stay within their stated error bound,
damaged payloads raise CorruptFrame, and a codec that cannot be used here says so (CodecUnavailable).

CacheGen's tables come from `build_tables` on synthetic KV (`kv_helpers`); the shipped model's own
tables are checked too."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kv_helpers import LAYOUT, synthetic_kv, synthetic_tables

from pdserve.engine.kv_cache import KVLayout
from pdserve.kv_transfer import codecs as codecs_module
from pdserve.kv_transfer.codecs import CODEC_NAMES, CodecUnavailable, checksum, make_codec
from pdserve.kv_transfer.codecs.base import device_bytes, payload_nbytes
from pdserve.kv_transfer.codecs.cachegen import CacheGenCodec, CacheGenTables
from pdserve.kv_transfer.codecs.cachegen_profile import collect_kv
from pdserve.kv_transfer.codecs.scaled import token_scales
from pdserve.kv_transfer.interface import CorruptFrame

@pytest.fixture(scope="module")
def tables_dir(tmp_path_factory):
    return synthetic_tables(tmp_path_factory.mktemp("cachegen"))


def codec(name: str, tables_dir, layout: KVLayout = LAYOUT):
    return make_codec(name, tables_dir, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_round_trips_bit_exactly(dtype):
    layout = KVLayout(2, 2, 8, 16, dtype)
    kv = synthetic_kv(37, seed=1).to(dtype)
    raw = make_codec("raw", None, layout)
    payload = raw.encode(kv, layer=1)
    assert payload.nbytes == kv.numel() * kv.element_size()
    out = raw.decode(memoryview(payload), 1, 0, 37, dtype)
    assert torch.equal(out.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       kv.view(torch.uint8 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_a_payload_on_a_device_decodes_as_its_host_bytes_do(name, tables_dir):
    """What an NCCL receiver gets is a uint8 tensor (on its GPU; here the CPU stands in): every codec
    decodes it to what the same bytes give, raw as a view of the received buffer."""
    c = codec(name, tables_dir)
    kv = synthetic_kv(23, seed=4)
    payload = c.encode(kv, 1, 0)
    received = device_bytes(payload, torch.device("cpu"))
    assert received.dtype == torch.uint8 and received.nbytes == payload_nbytes(payload)
    from_host = c.decode(memoryview(payload), 1, 0, 23, torch.float32)
    assert torch.equal(c.decode(received, 1, 0, 23, torch.float32), from_host)
    if name == "raw":
        assert torch.equal(from_host, kv) and c.decode(received, 1, 0, 23, torch.float32).data_ptr() == received.data_ptr()


def test_a_tensor_payloads_checksum_catches_every_flipped_bit_and_swapped_words():
    data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 4099, dtype=np.uint8))  # not whole words
    base = checksum(data)
    assert checksum(data.clone()) == base and 0 <= base < 2**32
    missed = []
    for byte in [*range(16), *range(2048, 2056), *range(4091, 4099)]:  # words at the start, middle and end
        for bit in range(8):
            flipped = data.clone()
            flipped[byte] ^= 1 << bit
            if checksum(flipped) == base:
                missed.append((byte, bit))
    assert not missed, f"flipped bits the checksum did not catch: {missed}"
    swapped = data.clone()
    swapped[0:4], swapped[4:8] = data[4:8].clone(), data[0:4].clone()
    assert checksum(swapped) != base
    assert checksum(data[1:]) == checksum(data[1:].clone())  # a view at an unaligned offset


def test_a_tensor_checksum_is_the_same_in_any_number_of_passes(monkeypatch):
    data = torch.from_numpy(np.random.default_rng(1).integers(0, 256, 4 * 13 + 3, dtype=np.uint8))
    payloads = [data[:n] for n in range(0, 4 * 13, 4)] + [data[1:], data[3:50]]  # unaligned views too
    whole = [checksum(p) for p in payloads]
    monkeypatch.setattr(codecs_module, "_CHECKSUM_PASS_WORDS", 3)
    assert [checksum(p) for p in payloads] == whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_raw_kv_on_a_gpu_stays_there_with_the_checksum_its_bytes_have_on_the_cpu():
    kv = synthetic_kv(40, seed=5).cuda()
    payload = make_codec("raw", None, LAYOUT).encode(kv, 0)
    assert payload.device == kv.device and payload.dtype == torch.uint8
    assert checksum(payload) == checksum(payload.cpu())


@pytest.mark.parametrize("name", ["int8", "fp8", "cachegen"])
@pytest.mark.parametrize("num_tokens", [1, 9, 10, 11, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossy_codecs_stay_within_their_bound(name, num_tokens, dtype, tables_dir):
    """Decoded in the engine's dtype (the KV's), as the receiver asks, every element is within the
    codec's stated bound."""
    c = codec(name, tables_dir)
    for level in range(c.num_levels):
        for layer in range(LAYOUT.num_layers):
            kv = synthetic_kv(num_tokens, seed=7 + layer).to(dtype)
            out = c.decode(memoryview(c.encode(kv, layer, level)), layer, level, num_tokens, dtype)
            assert out.shape == kv.shape and out.dtype == dtype
            error = (out.float() - kv.float()).abs()  # exact: not rounded to dtype again
            bound = c.error_bound(kv, layer, level)  # float32's own rounding included: no slack
            assert bool((error <= bound).all()), f"{name} level {level} layer {layer}: {float((error - bound).max())}"


@pytest.mark.parametrize("name", ["int8", "fp8", "cachegen"])
@pytest.mark.parametrize("magnitude", [torch.finfo(torch.float32).max, 1e30, 1e-30, 1e-38, 1e-41])
def test_lossy_codecs_hold_their_bound_at_the_ends_of_float32(name, magnitude, tables_dir):
    """Tokens whose largest value is float32's largest (int8 decoded it as inf) or subnormal (the
    scale's coarse rounding pushed values past int8's range), with no slack added to the bound."""
    c = codec(name, tables_dir)
    kv = synthetic_kv(9, seed=11).double()
    kv = (kv / kv.abs().amax() * magnitude).float()
    assert bool(torch.isfinite(kv).all()) and float(kv.abs().max()) > 0
    for level in range(c.num_levels):
        out = c.decode(memoryview(c.encode(kv, 0, level)), 0, level, 9, torch.float32)
        error = (out.double() - kv.double()).abs()
        assert bool(torch.isfinite(out).all()) and bool((error <= c.error_bound(kv, 0, level).double()).all())


def test_int8_holds_its_bound_where_float32_rounds_a_quotient_onto_a_half():
    """141.02283 / (166.60371 / 127) is just above 107.5, rounded in float32 to 107.5, which rounds
    to 107 (half to even): an error past scale / 2 by float32's rounding of the quotient."""
    c = make_codec("int8", None, LAYOUT)
    kv = torch.zeros(2, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    kv[:, 0, 0, 0] = 166.6037139892578  # the token's absmax
    kv[0, 0, 0, 1] = 141.0228271484375
    out = c.decode(memoryview(c.encode(kv, 0)), 0, 0, 1, torch.float32)
    error = (out.double() - kv.double()).abs()
    assert float(error[0, 0, 0, 1]) > float(token_scales(c.tokens(kv), c.qmax)[0, 0]) / 2  # the case arises
    assert bool((error <= c.error_bound(kv, 0).double()).all())


def test_cachegen_levels_trade_size_for_error_and_beat_int8(tables_dir):
    c, int8 = codec("cachegen", tables_dir), codec("int8", tables_dir)
    kv = synthetic_kv(1500, seed=3)
    sizes = [c.encode(kv, 1, level).nbytes for level in range(c.num_levels)]
    errors = [float((c.decode(c.encode(kv, 1, lv), 1, lv, 1500, torch.float32) - kv).abs().mean())
              for lv in range(c.num_levels)]
    assert sizes == sorted(sizes, reverse=True) and errors == sorted(errors)
    assert sizes[0] < int8.encode(kv, 1).nbytes


def test_cachegen_values_far_outside_the_profile_escape_and_come_back_exactly(tables_dir):
    c = codec("cachegen", tables_dir)
    kv = synthetic_kv(50, seed=4)
    kv[0, 5, 1, 3] = 1e6
    kv[1, 0, 0, 2] = -3e5  # an anchor
    kv[1, 7, 1, 1] = float("nan")
    out = c.decode(c.encode(kv, 0, 2), 0, 2, 50, torch.float32)
    assert out[0, 5, 1, 3] == 1e6 and out[1, 0, 0, 2] == -3e5 and torch.isnan(out[1, 7, 1, 1])


def one_channel_cachegen(step: float, mean: float, dtype: torch.dtype) -> CacheGenCodec:
    """CacheGen on one layer of one channel (K and V alike), with tables made to order: a step and
    mean where float32's rounding shows, flat symbol distributions (they change sizes, not values)."""
    radius, shape = 31, (1, 1, 2, 1)
    flat = np.full((*shape, 2 * radius + 2), 1 / (2 * radius + 2), np.float32)
    tables = CacheGenTables(group_size=10, layout=np.array([1, 1, 1]), level_factors=np.ones(1, np.float32),
                            layer_factors=np.ones(1, np.float32), mean=np.full((1, 2, 1), mean, np.float32),
                            anchor_step=np.full(shape, step, np.float32), delta_step=np.full(shape, step, np.float32),
                            radius=np.full(shape, radius, np.int32), anchor_probs=flat, delta_probs=flat.copy())
    return CacheGenCodec(tables, KVLayout(1, 1, 1, 16, dtype))


def test_cachegen_tables_that_cannot_be_distributions_leave_the_codec_unavailable():
    """Found when the codec is made (and so left out of what a worker offers), not at its first frame."""
    made = one_channel_cachegen(0.1, 0.0, torch.float32)
    probs = made.tables.delta_probs.copy()
    probs[0, 0, 1, 0] = 0.0  # V's deltas: no symbol has any probability
    with pytest.raises(CodecUnavailable, match="all zero"):
        CacheGenCodec(dataclasses.replace(made.tables, delta_probs=probs), made.layout)


@pytest.mark.parametrize("case", ["quotient-on-a-half", "escaped-far-from-the-mean", "float16-largest"])
def test_cachegen_holds_its_bound_where_float32_rounding_shows(case):
    """Each case broke the stated bound once (no slack added here):
    - a quotient that float32 rounds onto a half rounds to even the wrong way (x / step just past k + 1/2);
    - an escaped value went out with the mean taken off and came back with it added: two roundings,
      0.125 off at 1.2e6 where half a step is 0.025 (escaped values must come back exactly);
    - float16's largest value, within half a step of a coded value past it, decoded as inf."""
    step, mean, value, dtype = {
        "quotient-on-a-half": (0.6361295580863953, 0.0, -11.768397331237793, torch.float32),
        "escaped-far-from-the-mean": (0.05, -372.4375, 1188305.375, torch.float32),
        "float16-largest": (40.0, 65000.0, 65504.0, torch.float16),
    }[case]
    c = one_channel_cachegen(step, mean, dtype)
    kv = torch.full((2, 12, 1, 1), value, dtype=dtype)  # an anchor, its deltas, and a second group's anchor
    out = c.decode(memoryview(c.encode(kv, 0)), 0, 0, 12, dtype)
    error = (out.double() - kv.double()).abs()
    assert bool(torch.isfinite(out).all()) and bool((error <= c.error_bound(kv, 0).double()).all()), error.max()
    if case == "escaped-far-from-the-mean":  # the anchors (tokens 0 and 10) escape; their deltas, 0, do not
        assert torch.equal(out[:, ::10], kv[:, ::10])


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_damaged_payloads_raise_corrupt_frame(name, tables_dir):
    c = codec(name, tables_dir)
    payload = np.array(c.encode(synthetic_kv(40, seed=5), 0, 0))
    with pytest.raises(CorruptFrame):
        c.decode(payload[:-3], 0, 0, 40, torch.float32)
    with pytest.raises(CorruptFrame):
        c.decode(payload, 0, c.num_levels, 40, torch.float32)  # a level the codec does not have


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_any_damaged_payload_decodes_to_a_frame_of_its_shape_or_raises_corrupt_frame(name, tables_dir):
    """Flipped bits, random words behind a sound header, a token count off by a little: decoding gives a
    frame of the asked shape or CorruptFrame (which the receiver counts and has resent), never another
    error. (cachegen once read an odd row's padding symbol as an outer one and raised IndexError.)"""
    c = codec(name, tables_dir)
    rng = np.random.default_rng(12)
    for num_tokens in (1, 9, 10, 11, 40):
        payload = np.array(c.encode(synthetic_kv(num_tokens, seed=num_tokens), 0, 0))
        damaged = [(payload, num_tokens + d) for d in (-1, 1, 2) if num_tokens + d > 0]
        for _ in range(40):
            flipped = payload.copy()
            flipped[rng.integers(len(flipped))] ^= np.uint8(1 << int(rng.integers(8)))
            random_words = np.concatenate([payload[:4] * 0, rng.integers(0, 256, len(payload) - 4, dtype=np.uint8)])
            damaged += [(flipped, num_tokens), (random_words, num_tokens)]
        for data, n in damaged:
            try:
                out = c.decode(data, 0, 0, n, torch.float32)
            except CorruptFrame:
                continue
            assert out.shape == (2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def test_unusable_codecs_say_why(tables_dir):
    with pytest.raises(CodecUnavailable, match="unknown codec 'zstd'"):
        make_codec("zstd", None, LAYOUT)
    with pytest.raises(CodecUnavailable, match="kv-profile"):
        make_codec("cachegen", tables_dir.parent, LAYOUT)  # no tables there
    other = KVLayout(4, 2, 8, 16, torch.float32)
    with pytest.raises(CodecUnavailable, match="layout"):
        make_codec("cachegen", tables_dir, other)


def test_the_shipped_model_has_cachegen_tables():
    from pdserve.engine.model_loader import load_model
    from pdserve.engine.models.presets import resolve_model

    model_dir = resolve_model("pystd-llama")
    layout = load_model(model_dir, torch.float32, "cpu", block_size=16).kv_layout
    assert isinstance(CacheGenCodec.for_model(model_dir, layout), CacheGenCodec)


def test_profiling_a_sliding_window_model_counts_only_the_tokens_its_layers_keep(model_dirs):
    """tiny-gemma2's sliding layers cache their last 23 tokens of each 100-token window: profiled as
    whole groups of those, not padded with zeros to the next group (which skewed their means, steps
    and symbol counts); its full-attention layers keep the whole window."""
    kv, heads = collect_kv(model_dirs["tiny-gemma2"], num_tokens=300, window=100, progress=False)
    assert heads[0] >= 1 and len(kv) >= 2
    lengths = [x.shape[2] for x in kv]
    assert min(lengths) < max(lengths) == 300  # sliding and full layers both profiled
    for x in kv:
        assert (np.abs(x).sum(axis=(0, 1)) > 0).all(), "a token of zeros: padding in the statistics"


@pytest.mark.parametrize("num_tokens, window, profiled", [(57, 1000, 50), (250, 100, 250)])
def test_profiling_takes_every_whole_group_asked_for_even_past_the_last_whole_window(model_dirs, num_tokens,
                                                                                     window, profiled):
    """Fewer tokens than a window are one shorter window (it raised numpy's "need at least one array"
    before); what is left after the last whole window is a last, shorter one (dropped before)."""
    kv, _ = collect_kv(model_dirs["tiny-llama"], num_tokens=num_tokens, window=window, progress=False)
    assert {x.shape[2] for x in kv} == {profiled}


def test_profiling_fewer_tokens_than_a_group_says_so(model_dirs):
    with pytest.raises(ValueError, match="a group of 10"):
        collect_kv(model_dirs["tiny-llama"], num_tokens=9, window=1000, progress=False)
