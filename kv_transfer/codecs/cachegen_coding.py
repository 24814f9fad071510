"""How cachegen's symbols are entropy coded: each row (one channel's anchors, or its deltas) as pairs of
core symbols, then the symbols outside the core.

constriction's categorical decoder searches the model's cumulative table for every symbol, so a
symbol costs more the larger the alphabet (about 9 ns over 4 symbols, 18 over 64, 31 over 4096 on
the machine of docs/benchmarks.md). Quantized KV puts nearly all of a row's mass on a few symbols
about the zero symbol R, so a row's alphabet 0..2R+1 is split. Its *core*, the 2k+1 symbols R-k..R+k,
plus one *outer* symbol standing for every other, make an alphabet of C = 2k+2; core symbols are
coded two at a time, as one symbol of an alphabet of C^2 whose probabilities are the products (one
search for two symbols). Each outer symbol's own value follows, coded with the row's distribution
over the symbols outside the core. By the chain rule this costs no bits against coding each symbol
on its own, but for the coder's 24-bit rounding of the smallest products and, in a row of odd
length, one padding symbol.

Decoding gives each symbol as its value, (s - R) times the row's step, straight from the pair (one
lookup of both values), so that no array of symbols is made; only the few outer symbols come as
symbols, for the caller to place.

k is the smallest that holds `CORE_MASS` of the row's profiled mass, at most `MAX_CORE`. Both sides
must choose alike, or the decoder reads garbage that no checksum catches: the choice is made in
integers, which no platform rounds differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.metadata import version

import constriction
import numpy as np

CORE_MASS = (19, 20)  # 95%: numerator, denominator
MAX_CORE = 7  # k: core alphabets of up to 16, pairs of up to 256
# How payloads are coded, with all that decides it: part of the codec's digest, so that a peer coding
# otherwise (other constants here, or a constriction that may build its models otherwise) refuses it.
FORMAT = (f"core-pairs-1:{CORE_MASS[0]}/{CORE_MASS[1]}:{MAX_CORE}:"
          f"constriction-{'.'.join(version('constriction').split('.')[:2])}")
_MASS_UNIT = 2.0**32  # probabilities as integers, for the choice of k


@dataclass(frozen=True)
class DecodedRows:
    """Rows as decoded, each symbol s as its quantized value (s - R) x the row's step, but for the few
    symbols outside the core, which come apart: the caller makes their values (one may be the escape)."""

    values: np.ndarray  # float32 [rows, length]; 0 where a symbol lies outside the core
    rows: np.ndarray  # int64: where symbols lie outside the core, in C order (columns < length)
    columns: np.ndarray
    symbols: np.ndarray  # int32: those symbols


@dataclass(frozen=True)
class RowModels:
    """The models of one kind of row (anchors, or deltas) at one (layer, level): rows K/V-major, with
    the tables that turn a decoded pair into its two values (per row, its pairs' two float32 values side
    by side, read as one float64: one lookup for both)."""

    radius: np.ndarray  # int32 [rows, 1]: R, the zero symbol; 2R + 1 is the escape
    core: np.ndarray  # int32 [rows, 1]: k
    pair_models: list[object]
    tail_models: list[object | None]  # None where one symbol lies outside the core: it needs no bits
    pair_start: np.ndarray  # int32 [rows, 1]: where each row's (2k+2)^2 pairs begin in the tables below
    pair_values: np.ndarray  # float64: each pair's two values (float32s, first then second); outer: 0
    pair_outer: np.ndarray  # uint8: bit 0 where the pair's first symbol is outer, bit 1 where its second

    @classmethod
    def from_probs(cls, probs: np.ndarray, radius: np.ndarray, step: np.ndarray | None = None) -> RowModels:
        """probs: float32 [rows, 2 R_max + 2], each row's symbols 0..2R+1 first; radius: [rows]; step:
        float32 [rows], what `decode` multiplies values by (1: the quantized values themselves)."""
        probs = probs.astype(np.float64)
        radius = np.asarray(radius, dtype=np.int64)
        step = np.ones(len(probs), np.float32) if step is None else np.asarray(step, np.float32).reshape(-1)
        cores = _core_radii(probs, radius)
        pair_models: list[object] = [None] * len(probs)
        tail_models: list[object | None] = [None] * len(probs)
        pair_count = (2 * cores + 2) ** 2
        pair_start = np.concatenate([[0], np.cumsum(pair_count)[:-1]])
        pair_values = np.zeros((int(pair_count.sum()), 2), np.float32)
        pair_outer = np.zeros(len(pair_values), np.uint8)
        # Rows alike in (R, k) (most of a layer's) have their arrays made together.
        for r, k in {(int(r), int(k)) for r, k in zip(radius, cores)}:
            rows = np.flatnonzero((radius == r) & (cores == k))
            tails = np.concatenate([probs[rows, : r - k], probs[rows, r + k + 1 : 2 * r + 2]], axis=1)
            outer = np.array([math.fsum(row) for row in tails.tolist()])  # exactly rounded: alike everywhere
            core = np.concatenate([probs[rows, r - k : r + k + 1], outer[:, None]], axis=1)
            pairs = (core[:, :, None] * core[:, None, :]).reshape(len(rows), -1)
            # The profile may have found nothing outside a core: then any tail model will do.
            tails[outer == 0] = 1.0
            for i, row in enumerate(rows.tolist()):
                pair_models[row] = constriction.stream.model.Categorical(pairs[i], perfect=False)
                if tails.shape[1] > 1:
                    tail_models[row] = constriction.stream.model.Categorical(tails[i], perfect=False)
            # Index i of the core is the value i - k; the outer index, 2k + 1, is made by the caller.
            size = 2 * k + 2
            quantized = np.where(np.arange(size) < size - 1, np.arange(size) - k, 0).astype(np.float32)
            first, second = np.divmod(np.arange(size * size), size)
            at = pair_start[rows][:, None] + np.arange(size * size)
            # float32 products, as `quantize` took them apart: values come back bit for bit.
            pair_values[at, 0] = quantized[first] * step[rows, None]
            pair_values[at, 1] = quantized[second] * step[rows, None]
            pair_outer[at] = (first == size - 1) | ((second == size - 1) << 1)
        return cls(_column(radius), _column(cores), pair_models, tail_models, _column(pair_start),
                   pair_values.reshape(-1).view(np.float64), pair_outer)

    def encode(self, coder: constriction.stream.stack.AnsCoder, symbols: np.ndarray) -> None:
        """Push rows of symbols [rows, n] so that `decode` reads them first, in order."""
        low, width = self.radius - self.core, 2 * self.core + 1  # the core: low .. low + width - 1
        index = symbols - low
        outside = np.flatnonzero((index < 0) | (index >= width))  # few: positions, not a mask
        rows = outside // symbols.shape[1]
        index.flat[outside] = width[rows, 0]  # the outer symbol
        tails = symbols.flat[outside]
        tails = np.where(tails < low[rows, 0], tails, tails - width[rows, 0])
        ends = np.cumsum(np.bincount(rows, minlength=len(self.tail_models))).tolist()
        if index.shape[1] % 2:  # a row of odd length ends in a padding zero symbol: index k
            index = np.concatenate([index, self.core], axis=1)
        pairs = index[:, 0::2] * (width + 1) + index[:, 1::2]
        # A stack: what is decoded last is pushed first, each array reversed within.
        for row in reversed(range(len(ends))):
            start = ends[row - 1] if row else 0
            if ends[row] > start and self.tail_models[row] is not None:
                coder.encode_reverse(tails[start : ends[row]], self.tail_models[row])
        for row_pairs, model in zip(pairs[::-1], reversed(self.pair_models)):
            coder.encode_reverse(row_pairs, model)

    def decode(self, coder: constriction.stream.stack.AnsCoder, length: int) -> DecodedRows:
        """Rows of `length` symbols, as `encode` pushed them."""
        if not length:
            empty = np.zeros(0, np.int64)
            return DecodedRows(np.zeros((len(self.pair_models), 0), np.float32), empty, empty, empty.astype(np.int32))
        half = -(-length // 2)
        pairs = np.concatenate([coder.decode(model, half) for model in self.pair_models]).reshape(-1, half)
        # Whatever the words, a row's pairs index its own part of the tables: garbage, never out of bounds.
        pairs += self.pair_start
        values = self.pair_values.take(pairs).view(np.float32)[:, :length]
        outer = self.pair_outer.take(pairs)
        if length % 2:  # the padding symbol: the encoder's is in the core, damaged words' may not be
            outer[:, -1] &= 1
        outer_pairs = np.flatnonzero(outer != 0)  # few: positions, not a mask
        bits = outer.ravel()[outer_pairs]
        # Outer symbols in C order over [rows, 2 * half]: a pair's first before its second.
        per_pair = (bits & 1) + (bits >> 1)
        outside = np.repeat(2 * outer_pairs, per_pair)
        outside[np.cumsum(per_pair) - 1] += bits >> 1  # a pair's last is its second if bit 1 is set
        rows, columns = np.divmod(outside, 2 * half)
        counts = np.bincount(rows, minlength=len(self.tail_models)).tolist()
        tails = [coder.decode(model, n) if model is not None else np.zeros(n, dtype=np.int32)
                 for n, model in zip(counts, self.tail_models) if n]
        symbols = np.zeros(0, np.int32)
        if tails:
            tail = np.concatenate(tails)
            low, width = (self.radius - self.core)[rows, 0], (2 * self.core + 1)[rows, 0]
            symbols = np.where(tail < low, tail, tail + width).astype(np.int32)
        return DecodedRows(values, rows, columns, symbols)


def check_probabilities(probs: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """The rows' probabilities, zero past each row's symbols 0..2R+1; ValueError unless each row's can
    make a distribution. probs: [..., 2 R_max + 2]; radius: [...]."""
    in_alphabet = np.arange(probs.shape[-1]) < 2 * np.asarray(radius)[..., None] + 2
    used = probs[in_alphabet]
    probs = np.where(in_alphabet, probs, 0)
    if not (np.all(np.isfinite(used)) and np.all(used >= 0) and np.all(probs.max(-1) > 0)):
        raise ValueError("cachegen tables: a channel's symbol probabilities are negative, not finite, or all zero")
    return probs


def _column(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1, 1)


def _core_radii(probs: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """Per row, the smallest k whose core R-k..R+k holds CORE_MASS of the row's mass, at most
    min(MAX_CORE, R) (the escape stays out). Counted in integers: each row divided by its exactly
    rounded sum, then in units of 2^-32, so that every platform chooses alike."""
    rows, width = probs.shape
    radius = np.asarray(radius, dtype=np.int64)
    probs = check_probabilities(probs, radius)
    totals = np.array([math.fsum(row) for row in probs.tolist()])
    mass = np.rint(probs / totals[:, None] * _MASS_UNIT).astype(np.int64)
    cumulative = np.concatenate([np.zeros((rows, 1), np.int64), np.cumsum(mass, axis=1)], axis=1)
    k = np.arange(MAX_CORE + 1)[None, :]
    low = np.maximum(radius[:, None] - k, 0)
    high = np.minimum(radius[:, None] + k + 1, width)
    held = np.take_along_axis(cumulative, high, axis=1) - np.take_along_axis(cumulative, low, axis=1)
    numerator, denominator = CORE_MASS
    enough = (held * denominator >= cumulative[:, -1:] * numerator) | (k >= np.minimum(MAX_CORE, radius)[:, None])
    return np.argmax(enough, axis=1)
