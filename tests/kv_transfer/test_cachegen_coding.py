"""cachegen's entropy coding (`cachegen_coding`): rows of symbols come back exactly whatever their
length, radius and spread, as their values times each row's step; coding core symbols in pairs costs
no more bits than coding each symbol on its own; the core holds CORE_MASS of each row's mass."""

from __future__ import annotations

import constriction
import numpy as np
import pytest

from pdserve.kv_transfer.codecs.cachegen_coding import CORE_MASS, MAX_CORE, DecodedRows, RowModels


def peaked_probs(rows: int, radius: int, width: float, seed: int) -> np.ndarray:
    """float32 [rows, 2R + 2]: a peak about the zero symbol R of about `width` symbols each side, a
    floor elsewhere (as the profile's pseudo-count gives), the escape rare."""
    rng = np.random.default_rng(seed)
    offsets = np.abs(np.arange(2 * radius + 1) - radius)
    probs = np.exp(-offsets[None, :] / (width * rng.uniform(0.5, 2.0, size=(rows, 1)))) + 1e-5
    return np.concatenate([probs, np.full((rows, 1), 1e-5)], axis=1).astype(np.float32)


def symbols_from(probs: np.ndarray, radii: np.ndarray, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [rng.choice(2 * r + 2, size=length, p=p[: 2 * r + 2] / p[: 2 * r + 2].sum())
            for p, r in zip(probs.astype(np.float64), radii.tolist())]
    return np.array(rows, dtype=np.int32)


def symbols_of(decoded: DecodedRows, models: RowModels) -> np.ndarray:
    """The symbols of rows decoded with a step of 1, where each core symbol's value is s - R exactly."""
    symbols = decoded.values + models.radius
    assert np.array_equal(symbols, np.rint(symbols))
    symbols = symbols.astype(np.int32)
    outside = symbols[decoded.rows, decoded.columns]
    assert np.all(outside == models.radius[decoded.rows, 0])  # their values were left at 0
    symbols[decoded.rows, decoded.columns] = decoded.symbols
    return symbols


def round_trip(first: tuple[RowModels, np.ndarray], second: tuple[RowModels, np.ndarray]) -> np.ndarray:
    """Two kinds of rows in one stream, as cachegen puts anchors and deltas; returns its words."""
    coder = constriction.stream.stack.AnsCoder()
    second[0].encode(coder, second[1])
    first[0].encode(coder, first[1])
    words = coder.get_compressed()
    reader = constriction.stream.stack.AnsCoder(words)
    for models, symbols in (first, second):
        assert np.array_equal(symbols_of(models.decode(reader, symbols.shape[1]), models), symbols)
    assert reader.is_empty()
    return words


@pytest.mark.parametrize("length", [1, 2, 7, 154, 1383])
def test_rows_come_back_exactly_whatever_their_length(length):
    radii = np.array([31] * 6 + [0, 1, 2, 9], dtype=np.int32)  # 0: only the zero symbol and the escape
    probs = peaked_probs(len(radii), 31, width=2.0, seed=length)
    models = RowModels.from_probs(probs, radii)
    anchors = symbols_from(probs, radii, length, seed=1)
    deltas = symbols_from(probs[::-1].copy(), radii[::-1].copy(), length + 3, seed=2)
    round_trip((models, anchors), (RowModels.from_probs(probs[::-1].copy(), radii[::-1].copy()), deltas))


def test_rows_far_from_their_profile_come_back_exactly():
    """Escapes and symbols the profile found rare, in every row: all outside the core."""
    radii = np.full(8, 31, dtype=np.int32)
    models = RowModels.from_probs(peaked_probs(8, 31, width=1.0, seed=3), radii)
    rng = np.random.default_rng(4)
    anywhere = rng.integers(0, 64, size=(8, 301), dtype=np.int32)
    anywhere[:, ::7] = 63  # the escape
    round_trip((models, anywhere), (models, np.full((8, 10), 31, dtype=np.int32)))


def test_decoded_values_are_the_quantized_values_times_each_rows_step():
    """Bit for bit the float32 products `quantize` divided by, so that decoding changes no value."""
    radii = np.full(6, 31, dtype=np.int32)
    probs = peaked_probs(6, 31, width=2.0, seed=8)
    step = np.array([0.1, 0.3, 1e-3, 7.0, 0.6361295580863953, 3e-39], dtype=np.float32)
    symbols = symbols_from(probs, radii, 301, seed=9)
    coder = constriction.stream.stack.AnsCoder()
    RowModels.from_probs(probs, radii).encode(coder, symbols)
    decoded = RowModels.from_probs(probs, radii, step).decode(constriction.stream.stack.AnsCoder(coder.get_compressed()), 301)
    expected = (symbols - radii[:, None]).astype(np.float32) * step[:, None]
    inside = np.ones(symbols.shape, dtype=bool)
    inside[decoded.rows, decoded.columns] = False
    assert inside.mean() > 0.8 and decoded.values.dtype == np.float32
    assert np.array_equal(decoded.values[inside].view(np.int32), expected[inside].view(np.int32))
    assert np.array_equal(decoded.symbols, symbols[~inside])


@pytest.mark.parametrize("width", [0.3, 1.5, 6.0])
def test_pairs_cost_no_more_bits_than_coding_each_symbol_alone(width):
    radii = np.full(16, 31, dtype=np.int32)
    probs = peaked_probs(16, 31, width, seed=5)
    symbols = symbols_from(probs, radii, 1382, seed=6)
    models = RowModels.from_probs(probs, radii)
    paired = len(round_trip((models, symbols), (models, symbols[:, :0])))
    alone = constriction.stream.stack.AnsCoder()
    for row, p in zip(symbols[::-1], probs[::-1]):
        alone.encode_reverse(row, constriction.stream.model.Categorical(p.astype(np.float64), perfect=False))
    assert paired <= 1.005 * alone.num_words() + 2


def test_the_core_is_the_smallest_that_holds_its_share_of_the_mass():
    radii = np.full(12, 31, dtype=np.int32)
    probs = peaked_probs(12, 31, width=1.0, seed=7).astype(np.float64)
    models = RowModels.from_probs(probs.astype(np.float32), radii)
    share = CORE_MASS[0] / CORE_MASS[1]
    cores = models.core.ravel().tolist()
    assert len(set(cores)) > 2  # the rows' spreads differ, and so do their cores
    for p, k in zip(probs, cores):
        held = [p[31 - j : 32 + j].sum() / p.sum() for j in range(MAX_CORE + 1)]
        assert 0 <= k <= MAX_CORE and (held[k] >= share - 1e-6 or k == MAX_CORE)
        assert k == 0 or held[k - 1] < share + 1e-6


def test_a_row_whose_profile_has_nothing_outside_its_core_still_codes_every_symbol():
    """Hand-made tables, or a channel profiled without a pseudo-count, may put no mass outside the
    core: symbols there are rare, not impossible (an escape), and still come back."""
    probs = np.zeros((2, 8), dtype=np.float32)
    probs[:, 3] = 1.0  # R = 3: only the zero symbol was ever seen
    models = RowModels.from_probs(probs, np.array([3, 3]))
    assert models.core.ravel().tolist() == [0, 0]
    symbols = np.array([[3, 3, 7, 3, 0], [6, 3, 3, 3, 3]], dtype=np.int32)
    round_trip((models, symbols), (models, symbols[:, :2]))


def test_tables_whose_probabilities_cannot_be_a_distribution_are_refused():
    probs = np.zeros((2, 8), dtype=np.float32)
    probs[0, 3] = 1.0
    with pytest.raises(ValueError, match="all zero"):
        RowModels.from_probs(probs, np.array([3, 3]))
