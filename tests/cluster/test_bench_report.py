"""Benchmark results written into the docs: each benchmark's section replaced in place with its
provenance, sections in the page's order, a smoke run marked as one, a foreign file refused."""

from __future__ import annotations

import json

import pytest
from plan_helpers import synthetic_profile

from pdserve.cluster import cli
from pdserve.cluster.bench.report import SECTIONS, key_of, plot_record, provenance, publish
from pdserve.cluster.bench.serve import LONG_PROMPTS_FROM

KV_RESULTS = {
    "benchmark": "kv", "model": "pystd-llama", "kv_per_token_layer": "2 KV heads x 64, float32", "codecs": [],
    "transports": [{"transport": "tcp", "tokens": 2048, "bytes": 8 << 20, "gb_per_s": 2.5, "socket_gb_per_s": 2.7,
                    "share_of_socket": 0.93, "frames": 8, "frame_bytes": 1 << 20, "seconds": 0.003}],
}


def results(gb_per_s: float, smoke: bool = False) -> dict:
    transports = [{**KV_RESULTS["transports"][0], "gb_per_s": gb_per_s}]
    return {**KV_RESULTS, "transports": transports, "provenance": provenance(quick=smoke)}


def test_a_section_is_replaced_in_place_with_where_its_figures_come_from(tmp_path):
    page = tmp_path / "benchmarks.md"
    publish(page, "kv", results(2.5))
    publish(page, "kv", results(3.25))
    text = page.read_text()
    assert text.count("## KV transfer") == 1 and "| 3.25 |" in text and "| 2.50 |" not in text
    p = results(0)["provenance"]
    assert p["machine"] in text and p["date"][:10] in text and "cores" in p["machine"]
    assert "smoke run" not in text


def test_runs_of_the_kv_benchmark_share_one_row_per_transport(tmp_path):
    page = tmp_path / "benchmarks.md"
    row = KV_RESULTS["transports"][0]
    runs = [{**row, "run": 1, "share_of_socket": 0.81, "gb_per_s": 2.0},
            {**row, "run": 2, "share_of_socket": 0.93, "gb_per_s": 3.0},
            {**row, "run": 3, "share_of_socket": 0.88, "gb_per_s": 2.5}]
    publish(page, "kv", {**KV_RESULTS, "transports": runs, "provenance": provenance()})
    text = page.read_text()
    assert "| tcp | 2,048 | 8 | 2.50 | 2.70 | 81% / 93% / 88% |" in text and "3 run(s)" in text


def test_sections_keep_the_pages_order_and_text_around_them(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nA note kept as it is.\n")
    publish(page, "kv", results(2.5))
    engine = {"benchmark": "engine", "provenance": provenance(), "model": "llama-20m", "threads": 2,
              "workload": "a trace", "prompt_tokens": 10, "output_tokens": 20,
              "throughput": {"engine": [100.0], "hf_generate_batch8": [50.0]},
              "decode_split": {"1": {"forward_ms": 1.0, "step_ms": 1.2, "overhead_fraction": 0.17, "steps": 9}}}
    publish(page, "engine", engine)
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nA note kept as it is.")
    assert text.index("## The engine") < text.index("## KV transfer")  # engine comes first in SECTIONS
    assert list(SECTIONS).index("engine") < list(SECTIONS).index("kv")
    assert "| hf_generate_batch8 | 50.0 | 2.00x |" in text


def test_a_smoke_run_is_marked_as_no_measurement(tmp_path):
    page = tmp_path / "benchmarks.md"
    publish(page, "kv", results(2.5, smoke=True))
    assert "**A smoke run (`--quick`)**" in page.read_text()


def test_a_file_no_benchmark_wrote_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="not a results file of a pdserve benchmark"):
        key_of({"benchmark": "mine"})
    with pytest.raises(ValueError, match="has no provenance"):
        key_of({"benchmark": "kv"})
    foreign = tmp_path / "results.json"
    foreign.write_text(json.dumps({"what": "else"}))
    assert cli.main(["bench", "report", str(foreign), "--docs", str(tmp_path / "page.md")]) == 2
    assert "not a results file of a pdserve benchmark" in capsys.readouterr().err


def test_the_report_command_writes_a_results_file_into_the_page(tmp_path):
    made = tmp_path / "kv.json"
    made.write_text(json.dumps(results(2.5)))
    page = tmp_path / "docs" / "benchmarks.md"
    assert cli.main(["bench", "report", str(made), "--docs", str(page)]) == 0
    assert "| tcp | 2,048 | 8 | 2.50 | 2.70 | 93% |" in page.read_text()


def serve_results(tmp_path, other: str = "colocated-chunked", prompt_len: int = 40) -> dict:
    """A serve benchmark's results as `assemble` makes them: two deployments, two rates each."""
    from pdserve.cluster.bench.serve import ConfigResult, ServeBenchConfig, ServeWorkload, api_medians, assemble
    from pdserve.cluster.bench.serve_metrics import Goodput, Objective, RequestRecord
    from pdserve.cluster.bench.workload import TraceRequest

    tight, loose = Objective("tight", 0.1, 0.02), Objective("loose", 0.3, 0.04)

    def run(name: str, rate: float, step_s: float) -> list[RequestRecord]:
        return [RequestRecord(f"{name}-{i}", name, rate, i / rate, prompt_len, 8, i / rate + 0.05,
                              [i / rate + 0.05 + k * step_s for k in range(8)], i / rate + 0.05 + 7 * step_s, 8)
                for i in range(10)]

    results = []
    for name, step_s, rates in (("disaggregated", 0.015, (1.0, 2.0)), (other, 0.03, (1.0, 2.0))):
        r = ConfigResult(name, runs={rate: run(name, rate, step_s) for rate in rates})
        r.metrics_checks = {rate: {"cached_prompt_share": 0.0} for rate in rates}
        r.loops = {2.0: {"worker-1": {"busy": 0.5, "forward_share": 0.45}, "worker-0": {"busy": 0.0}}}
        r.goodput = [Goodput(tight, 2.0 if step_s < 0.02 else 0.0, None if step_s < 0.02 else 1.0, 1.0, True),
                     Goodput(loose, 2.0, 4.0, 1.0, False)]
        results.append(r)
    if other == "disaggregated-http":  # its idle comparison: the same cluster one request at a time
        results[1].idle_apis = {"requests_per_api": 24, **api_medians(run("grpc", 1.0, 0.012), run("http", 1.0, 0.011))}
    cfg = ServeBenchConfig(configs=("disaggregated", other))
    workload = ServeWorkload(tmp_path / "azure2023_conv.csv", [TraceRequest(0.0, prompt_len, 8)] * 10, None, 0)
    out = assemble(cfg, {"objectives": [tight, loose], "calibration": None}, results, tmp_path, workload, 2.0)
    plot, replaced = tmp_path / "attainment.png", tmp_path / "latency_cdf.png"
    plot.write_bytes(b"\x89PNG not really")
    replaced.write_bytes(b"this run's plot")
    plots = [plot_record(plot), plot_record(replaced), {"path": str(tmp_path / "gone.png"), "sha256": "0" * 64}]
    replaced.write_bytes(b"a later run's plot, in the same place")
    return {**json.loads(json.dumps(out)), "plots": plots}


def test_the_serve_benchmark_writes_its_goodput_table_and_plots(tmp_path):
    page = tmp_path / "docs" / "benchmarks.md"
    publish(page, key_of(serve_results(tmp_path)), serve_results(tmp_path))
    text = page.read_text()
    assert "## Serving under load: goodput" in text and "azure2023_conv.csv" in text
    assert "| disaggregated | 2.00 | 2.00 (missed at 4.00) | 50.0 ms / 50.0 ms | 15.0 ms / 15.0 ms |" in text
    assert "| colocated-chunked | 0 (missed at 1.00) | 2.00 (missed at 4.00) |" in text
    assert "Goodput ratios: disaggregated/colocated-chunked 1.00x (loose)." in text  # none against 0 (tight)
    assert "(the most any run served from a prefix cache: 0.0% of its prompt tokens)" in text
    assert ("Engine loops busy at 2 req/s (share of the run's wall time): disaggregated: worker-0 idle, worker-1 "
            "0.50 (90% of it the forward pass); colocated-chunked:") in text
    # A plot no longer there, or replaced by a later run's, is not shown.
    assert "![attainment](img/serve-attainment.png)" in text and "gone" not in text and "latency" not in text
    assert (page.parent / "img" / "serve-attainment.png").read_bytes() == b"\x89PNG not really"


def test_long_prompts_get_a_goodput_section_of_their_own_beside_the_short_ones(tmp_path):
    page = tmp_path / "benchmarks.md"
    short, long = serve_results(tmp_path), serve_results(tmp_path, prompt_len=LONG_PROMPTS_FROM)
    assert (key_of(short), key_of(long)) == ("serve", "serve-long-prompts")
    publish(page, key_of(long), long)
    publish(page, key_of(short), short)  # goes before it, as the page orders them
    text = page.read_text()
    assert text.index("## Serving under load: goodput\n") < text.index("## Serving under load: goodput on long prompts")
    assert "prompts mean 40 tokens" in text and f"prompts mean {LONG_PROMPTS_FROM} tokens" in text
    publish(page, key_of(long), long)  # in place of the long one: the short one stays
    assert page.read_text() == text


def test_the_serve_benchmark_shows_the_http_layers_cost_when_both_apis_ran(tmp_path):
    page = tmp_path / "benchmarks.md"
    publish(page, "serve", serve_results(tmp_path, other="disaggregated-http"))
    text = page.read_text()
    assert "| load | TTFT gRPC | TTFT HTTP | HTTP − gRPC | TPOT gRPC | TPOT HTTP | HTTP − gRPC |" in text
    # Idle: the same cluster over each API; at each rate: the two configurations' runs (HTTP's steps twice as long).
    assert ("| idle, one at a time (24 per API, same cluster) | 50.0 ms | 50.0 ms | +0.0 ms | 12.0 ms | 11.0 ms | "
            "−1.0 ms |") in text
    assert "| 2 req/s | 50.0 ms | 50.0 ms | +0.0 ms | 15.0 ms | 30.0 ms | +15.0 ms |" in text
    assert "HTTP's median excess: +0.0 ms per request (TTFT), +15.0 ms per token (TPOT)." in text
    # Without an HTTP configuration there is no such table.
    publish(page, "serve", serve_results(tmp_path))
    assert "HTTP − gRPC" not in page.read_text()


def test_the_simulator_benchmark_shows_each_figure_measured_and_simulated_with_its_error(tmp_path):
    from pdserve.cluster.bench.serve_metrics import RequestRecord
    from pdserve.cluster.bench.simulator import SimulatorBenchConfig, compare, simulator_speed
    from pdserve.engine.cost_model import StepCost

    def records(ttft: float, tpot: float) -> list[RequestRecord]:
        return [RequestRecord(f"r{i}", "c", 1.0, send_time=i, prompt_len=10, max_tokens=5, first_token_time=i + ttft,
                              end_time=i + ttft + 4 * tpot, output_tokens=5) for i in range(10)]

    row = {"load": 0.3, "rate": 2.4, **compare(records(0.100, 0.020), records(0.105, 0.030))}
    assert row["error"]["ttft_s_p50"] == pytest.approx(0.05) and row["error"]["tpot_s_p90"] == pytest.approx(0.5)
    profile = synthetic_profile(StepCost(0.002, 0.0001, 0.0), decode_s=0.005)
    speed = simulator_speed(profile, SimulatorBenchConfig(), requests=300, workers=8, log=lambda s: None)
    assert speed["ok"] == 300 and speed["events"] > 300 and speed["wall_s"] > 0
    assert simulator_speed(profile, SimulatorBenchConfig(), requests=100, workers=80, log=lambda s: None)["workers"] \
        == 80  # past a manifest's 64 replicas per pool
    results = {"benchmark": "simulator", "provenance": provenance(), "model": "llama-20m",
               "profile": {"created": "2026-11-29T10:00:00+00:00"},
               "deployments": [{"trace": "azure2023_conv.csv", "config": "colocated",
                                "capacity": {"real": 8.0, "sim": 9.0}, "runs": [row]}], "speed": [speed]}
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(results), results)
    text = page.read_text()
    assert "## The cluster simulator against measured runs" in text
    assert "**2 of 4 figures within 10%**; the largest error +50%." in text
    assert "| azure2023_conv.csv | colocated | 8.00 / 9.00 | 30% (2.40 req/s) | 100 / 105 (+5%) |" in text
    assert "20 / 30 (+50%) ✗" in text
    assert f"| 300 | 8 | 300 | {speed['wall_s']:.1f} s |" in text


def test_the_engine_benchmark_says_how_it_measured_and_whether_each_target_is_met(tmp_path):
    """A results file as `pdserve bench engine` writes it: one batching of `generate` under the 2x
    target, a decode step's share outside the forward pass within its 15%."""
    engine = {"benchmark": "engine", "provenance": provenance(), "model": "llama-20m", "threads": 2,
              "workload": "azure2023_conv.csv", "prompt_tokens": 9024, "output_tokens": 3830, "decode_prompt_len": 64,
              "throughput": {"engine": [400.0, 300.0, 350.0], "hf_generate_batch64": [150.0, 160.0, 170.0],
                             "hf_generate_batch8": [200.0, 190.0, 210.0]},
              "decode_split": {"1": {"forward_ms": 7.0, "step_ms": 7.5, "overhead_fraction": 0.067, "steps": 40},
                               "32": {"forward_ms": 24.0, "step_ms": 25.0, "overhead_fraction": 0.04, "steps": 40}}}
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(engine), engine)
    text = page.read_text()
    assert "## The engine against transformers' `generate`" in text
    assert "9,024 prompt and 3,830 output tokens" in text and "(per repeat, tok/s: engine 300–400," in text
    assert "| engine | 350.0 | 1.00x |" in text and "| 32 | 24.00 | 25.00 | 4.0% |" in text
    assert "64-token prompts" in text
    assert "hf_generate_batch64 2.19× (met), hf_generate_batch8 1.75× (MISSED)" in text
    assert "non-forward share ≤ 15% at batch 32: 4.0% (met)." in text
