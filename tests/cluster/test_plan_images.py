"""The planner and simulator with images (a vision-language model's workload): the image pass measured
by the profiler, an encode pool simulated with the router's own choice of encoder and its cache, images
encoded where the prompt pass runs holding that engine's loop, and `pdserve plan` sizing three pools."""

from __future__ import annotations

import random

import pytest
import torch
import yaml
from plan_helpers import RARE_LONG_TOWER, TOWER, synthetic_profile, vision_profile
from test_plan import manifest

from pdserve.cluster.bench.serve_metrics import Objective, percentile
from pdserve.cluster.bench.workload import ImageMix, TraceImage, TraceRequest, with_images
from pdserve.cluster.manifest import load_manifest
from pdserve.cluster.plan.costs import HardwareProfile
from pdserve.cluster.plan.planner import Candidate, candidates, evaluate
from pdserve.cluster.plan.profiler import profile_encoder
from pdserve.cluster.plan.simulator import ClusterSimulator, SimImage, SimRequest, trace_requests, unique_prompt
from pdserve.engine.cost_model import StepCost
from pdserve.wire import LifetimeEvent

def requests_with_images(n: int, rate: float, seed: int = 3, share: float = 0.6) -> list[SimRequest]:
    """Poisson arrivals; a `share` of requests carry one new image of 64 tokens (a 100-token prompt besides)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        images = (SimImage(f"image-{i}".encode(), 64),) if rng.random() < share else ()
        out.append(SimRequest(t, unique_prompt(i + 1, 100 + 64 * len(images)), 4, images))
    return out


def text_only_ttft_p90(result, requests) -> float:
    ttfts = [rec.ttft for rec, req in zip(result.records, requests) if not req.images]
    return percentile(ttfts, 90)


def test_an_encode_pool_keeps_text_only_prompts_from_waiting_behind_images():
    requests = requests_with_images(150, rate=4.0)
    in_prefill = manifest(pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                          router={"local_prefill_tokens": 0})
    epd = manifest(pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "encode": {"replicas": 1}},
                   router={"local_prefill_tokens": 0})
    without = ClusterSimulator(in_prefill, vision_profile(), "in-prefill").run(requests, 4.0)
    with_pool = ClusterSimulator(epd, vision_profile(), "epd").run(requests, 4.0)
    assert all(r.outcome == "ok" for r in without.records + with_pool.records)
    # in the prefill worker, every image pass (160 ms) holds the engine loop a text-only prompt needs
    assert text_only_ttft_p90(without, requests) > 0.15
    assert text_only_ttft_p90(with_pool, requests) < text_only_ttft_p90(without, requests) / 3
    encoder = with_pool.workers["encode-0"]
    assert encoder.role == "encode" and encoder.steps == sum(bool(r.images) for r in requests)
    assert encoder.busy_s == pytest.approx(encoder.steps * TOWER.pass_s(1, 64))
    assert without.workers["prefill-0"].busy_s > with_pool.workers["prefill-0"].busy_s + encoder.busy_s * 0.99
    for record, request in zip(with_pool.records, requests):  # images: encoded, then queued for the prompt pass
        if request.images:
            assert record.events[LifetimeEvent.ENCODED] <= record.events[LifetimeEvent.PREFILL_QUEUED]


def test_an_image_encoded_in_the_prompt_pass_worker_holds_its_engine_loop():
    m = manifest(mode="colocated", pools={"prefill": {"replicas": 0}, "decode": {"replicas": 1}})
    image = SimImage(b"photo", 64)
    requests = [SimRequest(0.0, unique_prompt(1, 164), 2, (image,)), SimRequest(0.01, unique_prompt(2, 20), 2)]
    records = ClusterSimulator(m, vision_profile()).run(requests, 1.0).records
    tower = TOWER.pass_s(1, 64)
    assert records[0].ttft > tower
    assert records[1].ttft > tower - 0.01  # the text-only prompt waited for the image pass
    assert records[1].events[LifetimeEvent.PREFILL_START] < tower  # queued meanwhile, not computed


def test_repeated_images_go_to_the_encoder_that_holds_them_and_are_encoded_once():
    m = manifest(pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "encode": {"replicas": 2}})
    popular = SimImage(b"popular", 64)
    requests = [SimRequest(i * 0.5, unique_prompt(i + 1, 164), 2, (popular,)) for i in range(6)]
    result = ClusterSimulator(m, vision_profile()).run(requests, 2.0)
    passes = {name: load.steps for name, load in result.workers.items() if load.role == "encode"}
    assert sorted(passes.values()) == [0, 1]  # the first made it; every later one went where it is cached


def test_trace_images_are_shared_within_a_pass_over_the_shapes_and_never_across_passes():
    shapes = [TraceRequest(0, 100, 4, images=(TraceImage(0, 30),)), TraceRequest(0, 100, 4, images=(TraceImage(0, 30),))]
    requests = trace_requests(shapes, [0.0, 1.0, 2.0, 3.0])
    keys = [r.images[0].key for r in requests]
    assert keys[0] == keys[1] != keys[2] == keys[3]


def test_an_image_mix_adds_its_tokens_to_the_prompt_within_the_context():
    requests = [TraceRequest(0, 50, 10) for _ in range(200)]
    shaped = with_images(requests, ImageMix(share=0.5, popular_share=0.5, popular_images=2),
                         lambda w, h: (w * h) // 4096, max_model_len=200, seed=1)
    carrying = [r for r in shaped if r.images]
    assert 0.35 < len(carrying) / len(shaped) < 0.65
    assert all(r.prompt_len == 50 + r.image_tokens and r.prompt_len + r.output_len <= 200 for r in shaped)
    assert any(i.key < 2 for r in carrying for i in r.images)  # popular images, repeated
    assert any(r.image_tokens < sum((w * h) // 4096 for w, h in [(640, 480)] * 3) for r in carrying)


def test_the_planner_tries_encode_pools_for_images_and_one_wins_when_image_passes_hold_text_back():
    profile = vision_profile(tower=RARE_LONG_TOWER)
    base = manifest(router={"local_prefill_tokens": 0})
    tried = candidates(base, profile, cpus=3, images=True)
    encoding = [c for c in tried if c.encode[0]]
    assert encoding and all(c.cpus <= 3 for c in tried)
    assert Candidate("disaggregated", (1, 1), (1, 1), 4096, encode=(1, 1)) in encoding
    assert not any(c.encode[0] for c in candidates(base, profile, cpus=3))  # a text workload: none
    made = Candidate("disaggregated", (1, 1), (1, 1), 4096, encode=(1, 1)).manifest(base)
    assert (made.pools.encode.replicas, made.pools.encode.threads) == (1, 1)
    # One request in 20 with a long image pass: in a prefill worker it holds back the text-only prompts
    # behind it past the objective; an encoder takes it off their path.
    shapes = [TraceRequest(0, 164 if i % 20 == 0 else 100, 4, images=(TraceImage(i, 64),) if i % 20 == 0 else ())
              for i in range(60)]
    objective = Objective("t", ttft_s=0.4, tpot_s=0.05)
    rates = {c.name: evaluate(c, base, profile, shapes, objective, min_duration_s=5).goodput.rate
             for c in (Candidate("disaggregated", (2, 1), (1, 1), 4096),
                       Candidate("disaggregated", (1, 1), (1, 1), 4096, encode=(1, 1)))}
    assert rates["disaggregated 1x1tP+1x1tD+1x1tE"] > 1.5 * rates["disaggregated 2x1tP+1x1tD"], rates


def test_the_profiler_measures_a_vision_models_image_pass(vision_models, model_dirs):
    measured = profile_encoder(vision_models["tiny-qwen2-vl"], 1, "float32", "cpu", seed=0, log=lambda s: None)
    assert measured is not None
    cost, row_bytes = measured
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vision_models["tiny-qwen2-vl"])
    assert row_bytes == config.text_config.hidden_size * 4
    assert cost.pass_s(1, 100) > 0 and cost.pass_s(3, 300) > cost.pass_s(1, 100)
    assert profile_encoder(model_dirs["tiny-llama"], 1, "float32", "cpu", seed=0, log=lambda s: None) is None
    torch.set_num_threads(torch.get_num_threads())


def test_a_profile_with_an_image_pass_round_trips_through_its_file(tmp_path):
    profile = vision_profile((1, 2))
    profile.save(tmp_path / "p.json")
    loaded = HardwareProfile.load(tmp_path / "p.json")
    assert loaded.encode_cost(2) == TOWER and loaded.embedding_bytes_per_token == 256
    text = synthetic_profile(StepCost(0.002, 0.0001, 0.0))
    with pytest.raises(ValueError, match="no image-encoding cost"):
        text.encode_cost(1)


def test_pdserve_plan_with_images_sizes_three_pools(vision_models, tmp_path, capsys):
    from pdserve.cluster.cli import main
    from pdserve.engine.model_store import model_digest

    model = str(vision_models["tiny-qwen2-vl"])
    profile = vision_profile(tower=RARE_LONG_TOWER)
    profile.model_digest = model_digest(model)
    profile.save(tmp_path / "p.json")
    args = ["plan", "--slo-ttft", "400", "--slo-tpot", "50", "--cpus", "3", "--model", model, "--max-model-len", "2048",
            "--profile", str(tmp_path / "p.json"), "--requests", "80", "--run-seconds", "5", "--image-share", "0.1",
            "--out", str(tmp_path / "planned.yaml")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "requests carry" in out and "best:" in out
    chosen = load_manifest(yaml.safe_load((tmp_path / "planned.yaml").read_text()))
    assert chosen.pools.encode.replicas >= 1  # rare image passes of 0.6 s or more: an encode pool won


def test_pdserve_plan_refuses_images_for_a_text_model(model_dirs, tmp_path, capsys):
    from pdserve.cluster.cli import main
    from pdserve.engine.model_store import model_digest

    model = str(model_dirs["tiny-llama"])
    profile = vision_profile()
    profile.model_digest = model_digest(model)
    profile.save(tmp_path / "p.json")
    code = main(["plan", "--slo-ttft", "400", "--slo-tpot", "50", "--cpus", "2", "--model", model, "--profile",
                 str(tmp_path / "p.json"), "--requests", "10", "--image-share", "0.5"])
    assert code != 0 and "takes no images" in capsys.readouterr().err
