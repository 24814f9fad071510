"""The soak command's short version: load from the Azure trace with decode and prefill workers killed
(SIGKILL) in turn, KV frames corrupted and a storm of cancels; nothing lost, every pool free."""

from __future__ import annotations

from pdserve.cluster.bench.report import publish
from pdserve.cluster.bench.soak import SoakConfig, run_soak


def test_a_short_soak_loses_no_request_and_no_token(tmp_path):
    out = tmp_path / "soak.json"
    report = run_soak(SoakConfig(minutes=0.5, model="tiny-llama", rate=3.0, storm=200, kills=3, kv_corrupt_percent=5.0,
                                 probe_s=1.0, settle_s=1.0, out=out, log=lambda _: None))
    assert out.is_file()
    assert report["codes"] == {"OK": report["requests"]}, report["codes"]  # a kill costs no request
    assert report["faults"]["workers_killed"] == 3 and report["retries"] >= 1
    assert [k["pool"] for k in report["kills"]] == ["decode", "prefill", "decode"]
    assert report["tokens"]["compared"] > 0
    assert report["tokens"] | {"compared": 0} == {"duplicated": 0, "lost": 0, "wrong": 0, "compared": 0}
    assert all(k["rejoined_s"] is not None for k in report["kills"]), report["kills"]
    # The retries are found in the router's lifetime records and timed from the kill.
    assert sum(k["affected"] for k in report["kills"]) >= 1, report["kills"]
    assert all(k["recovery_s"] >= (k["detect_s"] or 0) >= 0 for k in report["kills"]), report["kills"]
    retried = [t for k in report["kills"] for t in k["recoveries_s"]]
    spreads = report["recovery_s"].values()
    assert sum(s["n"] for s in spreads) == len(retried) and max(s["max"] or 0 for s in spreads) == max(retried)
    storm = report["storm"]
    assert storm["placed"] >= 200 and 0 < storm["opened"] <= 200 and not storm["refused"] and storm["freed"], storm
    # The cluster serves on after the storm: every probe streamed tokens.
    assert min(storm[f"tokens_per_s_{when}"] for when in ("before", "after", "settled")) > 0, storm
    assert report["pools_free_at_end"] and report["audit"]["clean"], report["audit"]
    assert report["ok"]
    # Its section of the docs page, from the report as written.
    page = tmp_path / "benchmarks.md"
    publish(page, "soak", report)
    text = page.read_text()
    assert "## Soak" in text and "**PASS**" in text and report["provenance"]["commit"] in text
    assert "**0 / 0 / 0** |" in text and f"of {report['tokens']['compared']:,} compared" in text
    assert "SIGKILLs: decode workers 2 times, prefill workers 1 time;" in text
    assert "decode kills: kill to the next token after the retry, p50 / p99 / max" in text
    assert all(k["worker"] in text for k in report["kills"])
