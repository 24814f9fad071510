"""Serving metrics on constructed timelines with known answers, and the goodput search on a synthetic
latency model whose goodput is known analytically."""

from __future__ import annotations

import math

import pytest

from pdserve.cluster.bench.serve_metrics import (
    GoodputSearch,
    Objective,
    RequestRecord,
    attainment,
    distribution,
    percentile,
    summarize,
    summarize_runs,
)


def record(ttft: float, tpot: float, n: int = 5, send: float = 0.0, outcome: str = "ok", rid: str = "r",
           rate: float = 1.0) -> RequestRecord:
    """A request sent at `send` whose tokens arrive ttft after it, then one every tpot."""
    if outcome != "ok":
        return RequestRecord(rid, "c", rate, send, prompt_len=8, max_tokens=n, end_time=send + 0.01, outcome=outcome,
                             error="refused")
    times = [send + ttft + i * tpot for i in range(n)]
    return RequestRecord(rid, "c", rate, send, prompt_len=8, max_tokens=n, first_token_time=times[0],
                         token_times=times, end_time=times[-1], output_tokens=n)


def test_percentiles_interpolate_linearly():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert distribution(xs)["mean"] == pytest.approx(2.5)


def test_ttft_tpot_itl_e2e_of_one_timeline():
    r = RequestRecord("a", "c", 1.0, send_time=1.0, prompt_len=10, max_tokens=4, first_token_time=1.5,
                      token_times=[1.5, 1.6, 1.8, 2.1], end_time=2.2, output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)  # (e2e - ttft) / (n_out - 1)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    # Tokens that arrive in one message have zero gaps between them.
    batched = RequestRecord("b", "c", 1.0, 0.0, 4, token_times=[0.2, 0.2, 0.5], first_token_time=0.2,
                            end_time=0.5, output_tokens=3)
    assert batched.itl == pytest.approx([0.0, 0.3])
    one = record(0.3, 0.0, n=1)
    assert one.tpot is None and one.itl == []
    assert RequestRecord.from_dict(r.to_dict()) == r


def test_attainment_counts_rejected_and_failed_requests_as_misses():
    objective = Objective("o", ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0.5, 0.05),   # meets both
        record(0.9, 0.1),    # meets both, exactly at the TPOT limit
        record(1.5, 0.05),   # TTFT miss
        record(0.5, 0.2),    # TPOT miss
        record(0.2, 0.0, n=1),  # one token: no TPOT to miss
        record(0, 0, outcome="rejected"),
        record(0, 0, outcome="error"),
        record(0, 0, outcome="rejected"),
    ]
    assert attainment(records, objective) == pytest.approx(3 / 8)
    assert attainment([], objective) == 0.0


def test_summary_counts_latencies_and_throughput():
    records = [record(0.1, 0.01, n=11, send=0.0), record(0.3, 0.02, n=6, send=1.0),
               record(0, 0, send=2.0, outcome="rejected")]
    s = summarize(records)
    assert (s["sent"], s["ok"], s["rejected"], s["errors"]) == (3, 2, 1, 0)
    span = max(0.1 + 10 * 0.01, 1.0 + 0.3 + 5 * 0.02, 2.01) - 0.0
    assert s["duration_s"] == pytest.approx(span)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["tpot_s"]["p90"] == pytest.approx(0.01 + 0.9 * 0.01)
    assert s["itl_s"]["p50"] == pytest.approx(0.01)  # 10 gaps of 10 ms, 5 of 20 ms
    assert s["e2e_s"]["p50"] == pytest.approx((0.2 + 0.4) / 2)
    assert s["output_tokens_per_s"] == pytest.approx(17 / span)
    assert s["requests_per_s"] == pytest.approx(2 / span)


# --- goodput --------------------------------------------------------------------------------------
N = 100
C_TTFT, C_TPOT = 0.1, 0.01  # the synthetic server's latencies grow linearly with the rate


class SyntheticServer:
    """Request i of a run at rate r has TTFT = C_TTFT * r * (i+1)/N and TPOT = C_TPOT * r * (i+1)/N.

    Attainment for (T, P) is floor(N * min(T / C_TTFT, P / C_TPOT) / r) / N, so it is >= 0.9 exactly
    when r <= min(T / C_TTFT, P / C_TPOT) / 0.9: the true goodput.
    """

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, rate: float) -> list[RequestRecord]:
        self.calls.append(rate)
        return [record(C_TTFT * rate * (i + 1) / N, C_TPOT * rate * (i + 1) / N, rid=str(i), rate=rate)
                for i in range(N)]


def true_goodput(o: Objective) -> float:
    return min(o.ttft_s / C_TTFT, o.tpot_s / C_TPOT) / 0.9


@pytest.mark.parametrize("start", [1.0, 3.0, 40.0])
def test_goodput_search_lands_within_tolerance_and_reuses_runs(start):
    server = SyntheticServer()
    search = GoodputSearch(server, start_rate=start, rel_tol=0.05, max_runs=40)
    ttft_bound = Objective("ttft-bound", ttft_s=1.0, tpot_s=math.inf)  # goodput 11.1 req/s
    both = Objective("both", ttft_s=1.0, tpot_s=0.05)                   # TPOT binds: 5.56 req/s

    g1 = search.goodput(ttft_bound)
    first_calls = len(server.calls)
    g2 = search.goodput(both)
    second_calls = len(server.calls) - first_calls

    for g, o in ((g1, ttft_bound), (g2, both)):
        truth = true_goodput(o)
        assert g.converged and g.note == ""
        assert truth / 1.05 <= g.rate <= truth  # the pass side of a bracket no wider than rel_tol
        assert g.failed_rate > truth and g.failed_rate - g.rate <= 0.05 * g.rate
        assert g.attainment >= 0.9
    assert len(set(server.calls)) == len(server.calls), "a rate was measured twice"
    assert second_calls < first_calls  # the second pair starts from the first one's bracket
    # Asking again costs nothing.
    before = len(server.calls)
    assert search.goodput(both).rate == g2.rate and len(server.calls) == before


def test_goodput_search_respects_the_run_budget_and_the_rate_bounds():
    o = Objective("o", ttft_s=1.0, tpot_s=math.inf)
    server = SyntheticServer()
    capped = GoodputSearch(server, start_rate=1.0, rel_tol=0.01, max_runs=3).goodput(o)
    assert len(server.calls) == 3 and not capped.converged and "budget" in capped.note
    assert capped.rate == 4.0 and capped.failed_rate is None  # 1, 2, 4 passed; no failure seen yet

    top = GoodputSearch(SyntheticServer(), start_rate=1.0, max_rate=5.0).goodput(o)
    assert top.rate == 5.0 and top.failed_rate is None and "maximum" in top.note

    low = GoodputSearch(SyntheticServer(), start_rate=8.0, min_rate=2.0).goodput(Objective("x", 0.01, math.inf))
    assert low.rate == 0.0 and low.failed_rate == 2.0 and "missed" in low.note


def test_per_rate_summaries_carry_each_objectives_attainment():
    server = SyntheticServer()
    runs = [(r, server(r)) for r in (20.0, 5.0)]
    o = Objective("o", ttft_s=1.0, tpot_s=math.inf)
    rows = summarize_runs(runs, [o])
    assert [row["rate"] for row in rows] == [5.0, 20.0]
    assert rows[0]["attainment"]["o"] == 1.0
    assert rows[1]["attainment"]["o"] == pytest.approx(0.5)  # TTFT = 2 (i+1)/100 <= 1 for half
