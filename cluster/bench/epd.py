"""`pdserve bench epd`: an encode pool (EPD) against encoding in the prefill worker and against colocated
workers, on the same number of workers, under an image-heavy load.

Each request has 0 to 3 images (`workload.ImageMix`: sizes drawn from a few camera-like shapes, some of
them repeated from a small pool of popular images) and a text prompt of the Azure conversation trace's lengths (scaled to
the model); arrivals are Poisson. Every deployment starts as a fresh cluster (empty caches) and gets
the same requests. Reported per deployment: TTFT p50/p90 of every request, of the text-only ones and
of those with images, the share meeting the objectives (TTFT and TPOT) and that goodput at the offered
rate, and the encode pool's embedding cache hit rate. The target: text-only TTFT p90 at least 2x
better with the encode pool than with encoding in the prefill worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import ray
from PIL import Image
from transformers import AutoConfig

from pdserve.client import AsyncClient, PDServeError
from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.serve_metrics import percentile
from pdserve.cluster.bench.workload import ImageMix, azure_trace_shapes
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.cluster.plan.costs import HardwareProfile, find_stored_profile, machine
from pdserve.cluster.plan.simulator import ClusterSimulator, SimImage, SimRequest, unique_prompt
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.multimodal.vision import image_token_counter

DEPLOYMENTS = ("epd", "encode-in-prefill", "colocated")


@dataclass
class EPDBenchConfig:
    model: str = "qwen2-vl-20m"
    num_requests: int = 120
    rate: float = 1.5  # requests/s, Poisson
    image_share: float = 0.6  # requests with images
    popular_share: float = 0.3  # images drawn from the popular pool (the cache's hits)
    popular_images: int = 4
    max_tokens: int = 24
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    deployments: tuple[str, ...] = DEPLOYMENTS
    seed: int = 0
    out: Path = Path("bench-results/epd.json")
    profile: Path | None = None  # for the simulator's predictions (None: the model's stored one, if any)


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]  # each image's placeholder and a text token, then the text
    images: tuple[bytes, ...]
    max_tokens: int
    at: float  # arrival offset (s)


@dataclass
class Outcome:
    images: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None


def _png(rng: random.Random, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(rng.randrange(2**32)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def workload(cfg: EPDBenchConfig, image_token_id: int, text_vocab: int) -> tuple[list[BenchRequest], str]:
    rng = random.Random(cfg.seed)
    shapes, source = azure_trace_shapes(cfg.num_requests, 0.25, 1.0, 512, cfg.max_tokens)
    mix = ImageMix(cfg.image_share, cfg.popular_share, cfg.popular_images)
    popular: dict[int, bytes] = {}  # the popular pool's images, made once each

    def image(key: int, size: tuple[int, int]) -> bytes:
        if key >= cfg.popular_images:
            return _png(rng, *size)
        if key not in popular:
            popular[key] = _png(rng, *size)
        return popular[key]

    requests, at = [], 0.0
    for shape, drawn in zip(shapes, mix.draw(rng, len(shapes))):
        images = tuple(image(key, size) for key, size in drawn)
        count = len(images)
        text = [rng.randrange(3, text_vocab) for _ in range(shape.prompt_len + count)]
        # Each image's placeholder before a text token: M-RoPE models take adjacent images as one.
        prompt = [t for i in range(count) for t in (image_token_id, text[i])] + text[count:]
        requests.append(BenchRequest(prompt, images, shape.output_len, at))
        at += rng.expovariate(cfg.rate)
    return requests, source


def _manifest(cfg: EPDBenchConfig, deployment: str):
    encode = 1 if deployment == "epd" else 0
    data = {"model": cfg.model, "mode": "colocated" if deployment == "colocated" else "disaggregated",
            "max_model_len": 2048, "kv_memory_mb": 256,
            "server": {"address": "127.0.0.1:0", "http_address": None},
            "pools": {"prefill": {"replicas": 2 - encode, "num_cpus": 0.5},
                      "decode": {"replicas": 1, "num_cpus": 0.5},
                      "encode": {"replicas": encode, "num_cpus": 0.5}}}
    return load_manifest(data)


async def _one(client: AsyncClient, request: BenchRequest, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async for chunk in client.generate_stream(request.prompt, images=list(request.images), temperature=0,
                                                  max_tokens=request.max_tokens, ignore_eos=True):
            now = time.perf_counter()
            if chunk.token_ids:
                first = first or now
                last, tokens = now, tokens + len(chunk.token_ids)
    except PDServeError as e:
        return Outcome(len(request.images), error=e.code.name)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return Outcome(len(request.images), first - sent, tpot)


async def _load(address: str, requests: list[BenchRequest]) -> list[Outcome]:
    async with AsyncClient(address, timeout=600) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(_one(client, r, start) for r in requests))


def _summary(cfg: EPDBenchConfig, outcomes: list[Outcome], elapsed_s: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    met = [o for o in done if o.ttft_s <= cfg.ttft_slo_s and o.tpot_s <= cfg.tpot_slo_s]
    row: dict = {"completed": len(done), "errors": len(outcomes) - len(done), "elapsed_s": elapsed_s,
                 "slo_attainment": len(met) / len(outcomes), "goodput_rps": len(met) / elapsed_s}
    for name, group in (("all", done), ("text_only", [o for o in done if not o.images]),
                        ("with_images", [o for o in done if o.images])):
        ttfts = [o.ttft_s for o in group]
        row[f"ttft_p50_s_{name}"], row[f"ttft_p90_s_{name}"] = percentile(ttfts, 50), percentile(ttfts, 90)
    row["tpot_p50_s"] = statistics.median(o.tpot_s for o in done) if done else None
    return row


def _profile(cfg: EPDBenchConfig, log) -> HardwareProfile | None:
    """The profile for the simulator's predictions: the one named, else this machine's stored one of the
    model (`pdserve profile`)."""
    model = cfg.model
    found = find_stored_profile(model, resolve_model(model), machine()) if cfg.profile is None else (cfg.profile, "")
    if found is None:
        log(f"no stored profile of {model} on this machine: `pdserve profile --model {model}` adds the simulator's "
            "predictions beside the measured figures")
        return None
    profile = HardwareProfile.load(found[0])
    try:  # what the predictions need: the image pass and the handoff, of one-thread workers on one machine
        profile.encode_cost(1), profile.transfer("shm")
    except ValueError as e:
        log(f"no predictions beside the measured figures: {e}")
        return None
    return profile


def _predict(cfg: EPDBenchConfig, deployment: str, requests: list[BenchRequest], profile: HardwareProfile) -> dict:
    """What the simulator predicts of one deployment on the same requests, summarized as a run is."""
    model_dir = resolve_model(cfg.model)
    tokens_of = image_token_counter(model_dir, AutoConfig.from_pretrained(model_dir))
    sim_requests = []
    for i, r in enumerate(requests):
        images = tuple(SimImage(hashlib.blake2b(data, digest_size=16).digest(), tokens_of(*Image.open(io.BytesIO(data)).size))
                       for data in r.images)
        length = len(r.prompt) + sum(image.tokens - 1 for image in images)  # each placeholder expanded
        sim_requests.append(SimRequest(r.at, unique_prompt(i + 1, length), r.max_tokens, images))
    result = ClusterSimulator(_manifest(cfg, deployment), profile, deployment).run(sim_requests, cfg.rate)
    outcomes = [Outcome(len(r.images), rec.ttft, rec.tpot or 0.0) if rec.outcome == "ok" else
                Outcome(len(r.images), error=rec.outcome) for r, rec in zip(requests, result.records)]
    return _summary(cfg, outcomes, max((rec.end_time or 0.0 for rec in result.records), default=0.0) or 1.0)


def run(cfg: EPDBenchConfig, log=print) -> dict:
    rows, predicted = {}, {}
    requests = source = None
    profile = _profile(cfg, log)
    for deployment in cfg.deployments:
        manifest = _manifest(cfg, deployment)
        log(f"{deployment}: starting a fresh cluster ...")
        with Cluster(manifest, log=lambda _: None) as cluster:
            info = cluster.router_stack.frontend.model.info
            if requests is None:
                requests, source = workload(cfg, info.image_token_id, min(info.image_token_id, info.vocab_size))
                log(f"  {len(requests)} requests, {sum(len(r.images) for r in requests)} images, "
                    f"{sum(not r.images for r in requests)} text-only, {cfg.rate:g} req/s")
            t0 = time.perf_counter()
            outcomes = asyncio.run(_load(cluster.address, requests))
            row = _summary(cfg, outcomes, time.perf_counter() - t0)
            if cluster.encoders:
                statuses = ray.get([e.handle.ping.remote() for e in cluster.encoders])
                hits, made = sum(s.cache_hits for s in statuses), sum(s.images_encoded for s in statuses)
                row.update(images_encoded=made, cache_hits=hits, cache_hit_rate=hits / max(1, hits + made))
        rows[deployment] = row
        log(f"  TTFT p90 text-only {_ms(row['ttft_p90_s_text_only'])}, with images {_ms(row['ttft_p90_s_with_images'])}, "
            f"SLO attainment {row['slo_attainment']:.0%}, {row['errors']} errors")
        if profile is not None:
            predicted[deployment] = _predict(cfg, deployment, requests, profile)
            log(f"  simulated: TTFT p90 text-only {_ms(predicted[deployment]['ttft_p90_s_text_only'])}, with images "
                f"{_ms(predicted[deployment]['ttft_p90_s_with_images'])}")
    popular = {"image_share": cfg.image_share, "popular_share": cfg.popular_share}
    result = {"benchmark": "epd", "provenance": provenance(), "workload": source, "mix": popular,
              "config": {k: str(v) for k, v in asdict(cfg).items()}, "rows": rows, "predicted": predicted,
              "profile": None if profile is None else {"created": profile.created, "hardware": profile.hardware}}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    log(markdown(result))
    log(f"wrote {cfg.out}")
    return result


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def markdown(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    lines = [
        f"{cfg['model']}, three workers per deployment (one torch thread each): *epd* 1 encode + 1 prefill + 1 "
        "decode; *encode-in-prefill* 2 prefill + 1 decode, each prefill worker encoding its requests' images; "
        f"*colocated* 3 workers that encode, prefill and decode. {cfg['num_requests']} requests at {cfg['rate']} "
        f"req/s (Poisson), {float(cfg['image_share']):.0%} of them with 1 to 3 images of 224x224 to 640x480 pixels "
        f"({float(cfg['popular_share']):.0%} of the images from a pool of {cfg['popular_images']} popular ones), text "
        f"lengths from {result['workload']}, up to {cfg['max_tokens']} output tokens. Objectives: TTFT ≤ "
        f"{float(cfg['ttft_slo_s']):g} s and TPOT ≤ {float(cfg['tpot_slo_s']) * 1e3:g} ms; goodput is the rate of "
        "requests meeting both at the offered rate. Each deployment a fresh cluster, the same requests.",
        "",
        "| deployment | TTFT p50 | TTFT p90 | text-only TTFT p90 | with images TTFT p90 | TPOT p50 | met both | "
        "goodput (req/s) | errors | embedding cache hits |",
        "|---" * 10 + "|",
    ]
    for name, r in rows.items():
        cache = f"{r['cache_hit_rate']:.0%} ({r['cache_hits']} of {r['cache_hits'] + r['images_encoded']})" \
            if "cache_hit_rate" in r else "–"
        lines.append(f"| {name} | {_ms(r['ttft_p50_s_all'])} | {_ms(r['ttft_p90_s_all'])} | "
                     f"{_ms(r['ttft_p90_s_text_only'])} | {_ms(r['ttft_p90_s_with_images'])} | {_ms(r['tpot_p50_s'])} | "
                     f"{r['slo_attainment']:.0%} | {r['goodput_rps']:.2f} | {r['errors']} | {cache} |")
    if "epd" in rows and "encode-in-prefill" in rows:
        epd, inline = rows["epd"]["ttft_p90_s_text_only"], rows["encode-in-prefill"]["ttft_p90_s_text_only"]
        if epd and inline:
            ratio = inline / epd
            verdict = "met" if ratio >= 2 else f"missed (by {2 / ratio:.2f}x)"
            lines += ["", f"Text-only TTFT p90, encoding in the prefill worker against the encode pool: **{ratio:.2f}x** "
                          f"(target 2x: {verdict})."]
    predicted = result.get("predicted") or {}
    if predicted:
        lines += ["", f"The cluster simulator's prediction of the same requests on each deployment (`pdserve plan`'s "
                      f"simulator, from the profile measured {result['profile']['created']}), against the measured "
                      "figures above (error: predicted / measured - 1):", "",
                  "| deployment | text-only TTFT p90 | with images TTFT p90 | TTFT p50 | met both |", "|---" * 5 + "|"]
        for name, p in predicted.items():
            m = rows[name]
            lines.append(f"| {name} | {_versus(p['ttft_p90_s_text_only'], m['ttft_p90_s_text_only'])} | "
                         f"{_versus(p['ttft_p90_s_with_images'], m['ttft_p90_s_with_images'])} | "
                         f"{_versus(p['ttft_p50_s_all'], m['ttft_p50_s_all'])} | "
                         f"{p['slo_attainment']:.0%} (measured {m['slo_attainment']:.0%}) |")
    return "\n".join(lines)


def _versus(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return "–"
    return f"{_ms(predicted)} ({predicted / measured - 1:+.0%})"
