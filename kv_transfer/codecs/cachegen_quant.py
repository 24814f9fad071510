"""CacheGen's quantizer: one frame of one layer's KV as integer symbols per channel, and back.

A channel is one (head, dim) of K or of V. The frame's tokens go in groups of G, the first group
starting at the frame's first token (frames travel alone). A group's first token, its anchor, is
quantized on its own at the anchor step; each other token of the group is coded as its difference
from the *reconstructed* anchor, quantized at the delta step. Since the difference is taken from what
the decoder will see, no error carries over: every element ends within half its step of the original.

Values are quantized with the channel's mean taken off. A channel's symbols at one (layer, level)
run over 0..2R+1: s = q + R for a quantized value q in [-R, R], and s = 2R + 1, the escape, for any
value outside that range (or not finite), whose own float32 value (the mean not taken off: taking it
off and adding it back rounds) then travels beside the coded symbols, so the bound holds for every
input and escaped values come back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv_transfer.codecs.cachegen_coding import DecodedRows


@dataclass(frozen=True)
class Steps:
    """How one layer is quantized at one level: arrays [2 (K, V), channels, 1]."""

    anchor_step: np.ndarray  # float32
    delta_step: np.ndarray  # float32
    anchor_radius: np.ndarray  # int32 R: values q in [-R, R] are coded, 2R + 1 is the escape
    delta_radius: np.ndarray  # int32


@dataclass(frozen=True)
class Symbols:
    anchors: np.ndarray  # int32 [2, channels, groups]
    deltas: np.ndarray  # int32 [2, channels, groups * (G - 1)]; a row's first coded_deltas(...) are coded
    escapes: np.ndarray  # float32: the escaped anchors' values (C order), then the escaped deltas' values


def num_groups(num_tokens: int, group_size: int) -> int:
    return -(-num_tokens // group_size)


def coded_deltas(num_tokens: int, group_size: int) -> int:
    """Delta symbols per channel that carry a token (the last group may be short)."""
    return num_tokens - num_groups(num_tokens, group_size)


def channels_first(kv: torch.Tensor, group_size: int) -> np.ndarray:
    """[2, n, heads, head_dim] in any float dtype -> float32 [2, heads * head_dim, whole groups of tokens],
    zero past token n (one copy)."""
    n = kv.shape[1]
    out = np.zeros((2, kv.shape[2] * kv.shape[3], num_groups(n, group_size) * group_size), dtype=np.float32)
    torch.from_numpy(out)[:, :, :n].copy_(kv.detach().reshape(2, n, -1).transpose(1, 2))
    return out


def quantize(x: np.ndarray, mean: np.ndarray, steps: Steps, num_tokens: int, group_size: int) -> Symbols:
    """Symbols of `x` (from `channels_first`), quantized about the channels' `mean` ([2, channels, 1])."""
    two, channels, padded = x.shape
    groups = padded // group_size
    original = x.reshape(two, channels, groups, group_size)
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows (near float32's end) escapes
        xg = original - mean[..., None]
        anchors = xg[..., 0]
        qa = np.rint(anchors / steps.anchor_step)
        escape_a = ~(np.abs(qa) <= steps.anchor_radius)  # NaN compares false: escaped too
        anchor_hat = np.where(escape_a, anchors, qa * steps.anchor_step)
        others = xg[..., 1:]
        qd = np.rint((others - anchor_hat[..., None]) / steps.delta_step[..., None])
    qd = qd.reshape(two, channels, -1)
    escape_d = ~(np.abs(qd) <= steps.delta_radius)
    coded = coded_deltas(num_tokens, group_size)
    qd[:, :, coded:] = 0  # padding: never coded, never escaped
    escape_d[:, :, coded:] = False
    escapes = original[..., 0][escape_a]
    if escape_d.any():
        escapes = np.concatenate([escapes, original[..., 1:].reshape(two, channels, -1)[escape_d]])
    return Symbols(
        anchors=np.where(escape_a, 2 * steps.anchor_radius + 1, qa + steps.anchor_radius).astype(np.int32),
        deltas=np.where(escape_d, 2 * steps.delta_radius + 1, qd + steps.delta_radius).astype(np.int32),
        escapes=escapes.astype(np.float32, copy=False),
    )


def escape_count(anchors: DecodedRows, deltas: DecodedRows, steps: Steps) -> int:
    return int(np.count_nonzero(_escaped(anchors, steps.anchor_radius))
               + np.count_nonzero(_escaped(deltas, steps.delta_radius)))


def dequantize(anchors: DecodedRows, deltas: DecodedRows, escapes: np.ndarray, mean: np.ndarray, steps: Steps,
               group_size: int, num_tokens: int, limit: float) -> np.ndarray:
    """float32 [2, channels, num_tokens] (a view: rows padded to whole groups) from a frame's decoded rows
    (anchors [2 x channels, groups], deltas [2 x channels, coded_deltas(...)], each value its quantized
    value times its step) whose escape count was checked, about the channels' `mean` ([2, channels, 1]).
    Values that were coded are clamped to ±`limit` (the largest finite value of the dtype they are
    decoded into: near its end, a value within half a step may lie past it, which the cast would make
    infinite). Writes into `anchors.values` and `deltas.values`: use neither afterwards."""
    two, channels = mean.shape[:2]
    mean = mean.reshape(-1)
    escape_a = _escaped(anchors, steps.anchor_radius)
    num_escaped_anchors = int(np.count_nonzero(escape_a))
    anchor_hat = _fill_outside(anchors, steps.anchor_radius, steps.anchor_step)
    escaped_rows, escaped_groups = anchors.rows[escape_a], anchors.columns[escape_a]
    # The deltas after an escaped anchor are against it as the encoder had it: about the mean.
    anchor_hat[escaped_rows, escaped_groups] = escapes[:num_escaped_anchors] - mean[escaped_rows]
    delta = _fill_outside(deltas, steps.delta_radius, steps.delta_step)
    groups = anchor_hat.shape[1]
    out = np.empty((two * channels, groups, group_size), dtype=np.float32)
    whole = num_tokens // group_size  # groups that hold all their tokens; a last one may be short
    with np.errstate(over="ignore", invalid="ignore"):  # clamped below
        np.add(anchor_hat, mean[:, None], out=out[..., 0])
        # One pass of float work: each delta plus its group's anchor, taken as the j-th delta of every
        # group at a time (order="C": numpy's own order would loop over a group's G - 1 deltas, a short
        # inner loop that made this pass twice as slow).
        np.add(delta[:, : whole * (group_size - 1)].reshape(len(delta), whole, group_size - 1).transpose(0, 2, 1),
               out[None, :, :whole, 0].transpose(1, 0, 2), out=out[:, :whole, 1:].transpose(0, 2, 1), order="C")
        if groups > whole:
            last = num_tokens - whole * group_size
            np.add(delta[:, whole * (group_size - 1) :], out[:, whole, :1], out=out[:, whole, 1:last])
    out = out.reshape(two * channels, -1)[:, :num_tokens]
    # Past an escaped anchor, or with steps this large, a coded value may pass the limit.
    reach = (np.abs(mean) + steps.anchor_radius.reshape(-1) * np.abs(steps.anchor_step.reshape(-1))
             + steps.delta_radius.reshape(-1) * np.abs(steps.delta_step.reshape(-1)))
    if num_escaped_anchors or not reach.max() < limit / 2:
        np.clip(out, -limit, limit, out=out)
    out[escaped_rows, escaped_groups * group_size] = escapes[:num_escaped_anchors]
    escape_d = _escaped(deltas, steps.delta_radius)
    if escape_d.any():
        group, within = np.divmod(deltas.columns[escape_d], group_size - 1)
        out[deltas.rows[escape_d], group * group_size + 1 + within] = escapes[num_escaped_anchors:]
    return out.reshape(two, channels, num_tokens)


def _escaped(decoded: DecodedRows, radius: np.ndarray) -> np.ndarray:
    """Which of the symbols outside the core are the escape."""
    return decoded.symbols == 2 * radius.reshape(-1)[decoded.rows] + 1


def _fill_outside(decoded: DecodedRows, radius: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The rows' values, with those of the symbols outside the core filled in (escapes' too: the caller
    overwrites them)."""
    rows = decoded.rows
    values = decoded.values
    values[rows, decoded.columns] = (np.subtract(decoded.symbols, radius.reshape(-1)[rows], dtype=np.float32)
                                     * step.reshape(-1)[rows])
    return values
