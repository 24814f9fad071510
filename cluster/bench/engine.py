"""`pdserve bench engine`: the engine against transformers' `generate`, side by side in one run.

1. Throughput: the same mixed-length prompts (lengths from the Azure conversation trace, scaled to a
   small model) through the engine (continuous batching over the paged pool) and through
   `model.generate` in padded batches, same model, same threads, alternating, `repeats` times each.
   Only requested tokens count: generate's extra tokens for shorter requests in a batch are waste.
2. Decode-step split at several batch sizes: the median time of the model forward against the whole
   engine step (scheduling, input preparation, sampling, bookkeeping), steps where every running
   request decodes.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pdserve.cluster.bench.report import provenance
from pdserve.cluster.bench.workload import RequestShape, azure_trace_shapes, random_token_prompts
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, resolve_model


# The workload: the trace's prompt and output lengths scaled to a small model, then clipped.
INPUT_SCALE, OUTPUT_SCALE, MAX_PROMPT, MAX_OUTPUT = 0.25, 0.5, 512, 128
MIN_SPEEDUP = 2.0  # target: engine output tok/s over generate's, each batching
MAX_NON_FORWARD = 0.15  # target: a decode step's time outside the model call, at the largest batch


@dataclass
class EngineBenchConfig:
    model: str = "llama-20m"
    num_prompts: int = 64
    repeats: int = 3
    threads: int = 0  # 0: torch's default
    hf_batch_sizes: tuple[int, ...] = (64, 8)
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_len: int = 128
    decode_steps: int = 48
    out: Path = Path("bench-results/engine.json")


@dataclass
class EngineBenchResult:
    provenance: dict
    model: str
    threads: int
    workload: str
    prompt_tokens: int
    output_tokens: int
    decode_prompt_len: int = 128  # of the decode-step split's requests
    throughput: dict[str, list[float]] = field(default_factory=dict)  # system -> output tok/s per repeat
    decode_split: dict[int, dict[str, float]] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.throughput.items()}


def _engine(model_dir: Path, max_len: int) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(kv_memory_bytes=512 * 2**20, max_num_seqs=256, max_model_len=max_len))


def engine_throughput(engine: LLMEngine, prompts: list[list[int]], shapes: list[RequestShape]) -> float:
    for p, s in zip(prompts, shapes):
        engine.add_request(p, SamplingParams.greedy(max_tokens=s.output_len, ignore_eos=True))
    t0 = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    elapsed = time.perf_counter() - t0
    assert produced == sum(s.output_len for s in shapes), "engine produced an unexpected number of tokens"
    return produced / elapsed


@torch.inference_mode()
def hf_generate_throughput(model: torch.nn.Module, prompts: list[list[int]], shapes: list[RequestShape],
                           batch_size: int) -> float:
    """transformers' generate on left-padded batches; counts only the tokens each request asked for."""
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(s.output_len for s in shapes[start : start + batch_size])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    return sum(s.output_len for s in shapes) / (time.perf_counter() - t0)


def decode_step_split(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median forward time and whole-step time over steps where all `batch` requests decode."""
    prompts = random_token_prompts([RequestShape(prompt_len, steps + 2)] * batch, engine.vocab_size, seed=batch)
    for p in prompts:
        engine.add_request(p, SamplingParams.greedy(max_tokens=steps + 2, ignore_eos=True))
    forward, total = [], []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        if s.num_decode_seqs == batch == s.num_seqs:
            forward.append(s.forward_s)
            total.append(s.total_s)
    fwd, tot = statistics.median(forward), statistics.median(total)
    return {"forward_ms": fwd * 1e3, "step_ms": tot * 1e3, "overhead_fraction": (tot - fwd) / tot, "steps": len(total)}


def run(cfg: EngineBenchConfig, log=print) -> EngineBenchResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model_dir = resolve_model(cfg.model)
    shapes, source = azure_trace_shapes(cfg.num_prompts, input_scale=INPUT_SCALE, output_scale=OUTPUT_SCALE,
                                        max_prompt=MAX_PROMPT, max_output=MAX_OUTPUT)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts = random_token_prompts(shapes, hf_model.config.vocab_size)
    engine = _engine(model_dir, max_len=1024)
    result = EngineBenchResult(
        provenance=provenance(), model=cfg.model, threads=torch.get_num_threads(), workload=source,
        prompt_tokens=sum(s.prompt_len for s in shapes), output_tokens=sum(s.output_len for s in shapes),
        decode_prompt_len=cfg.decode_prompt_len,
    )
    log(f"workload: {len(shapes)} requests from {source}: {result.prompt_tokens} prompt tokens, "
        f"{result.output_tokens} output tokens; model {cfg.model}, {result.threads} threads")
    engine_throughput(engine, prompts[:4], shapes[:4])  # warm-up (allocator, kernels)
    engine.pool.reset_prefix_cache()
    for r in range(cfg.repeats):
        systems = {"engine": lambda: engine_throughput(engine, prompts, shapes)}
        for bs in cfg.hf_batch_sizes:
            systems[f"hf_generate_batch{bs}"] = lambda bs=bs: hf_generate_throughput(hf_model, prompts, shapes, bs)
        for name, fn in systems.items():
            value = fn()
            engine.pool.reset_prefix_cache()  # each engine repeat starts cold, like generate
            result.throughput.setdefault(name, []).append(value)
            log(f"  repeat {r + 1}/{cfg.repeats} {name:>20}: {value:8.1f} output tok/s")
    for batch in cfg.decode_batches:
        split = decode_step_split(engine, batch, cfg.decode_prompt_len, cfg.decode_steps)
        result.decode_split[batch] = split
        log(f"  decode batch {batch:>3}: forward {split['forward_ms']:.2f} ms of {split['step_ms']:.2f} ms step "
            f"-> non-forward {split['overhead_fraction']:.1%}")
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps({"benchmark": "engine", **asdict(result)}, indent=2))
    log(summary_table(result))
    log(f"results written to {cfg.out}")
    return result


def summary_table(result: EngineBenchResult) -> str:
    med = result.medians()
    lines = ["| system | output tok/s (median) | engine / system |", "|---|---|---|"]
    for name, value in med.items():
        lines.append(f"| {name} | {value:.1f} | {med['engine'] / value:.2f}x |")
    lines += ["", "| decode batch | forward ms | step ms | non-forward share |", "|---|---|---|---|"]
    for batch, s in result.decode_split.items():
        lines.append(f"| {batch} | {s['forward_ms']:.2f} | {s['step_ms']:.2f} | {s['overhead_fraction']:.1%} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The results as the docs show them (from a results file): the workload and the systems, the
    throughput table, the decode-step split, and the targets."""
    result = EngineBenchResult(**{k: v for k, v in results.items() if k != "benchmark"})
    result.decode_split = {int(k): v for k, v in result.decode_split.items()}
    med = result.medians()
    speedups = {name: med["engine"] / value for name, value in med.items() if name != "engine"}
    largest = max(result.decode_split) if result.decode_split else None
    repeats = ", ".join(f"{name} {min(v):.0f}–{max(v):.0f}" for name, v in result.throughput.items())
    lines = [
        f"Output tokens per second on {result.model}, float32, {result.threads} torch threads for both systems. "
        f"Workload: {result.workload}, prompt lengths × {INPUT_SCALE:g} (at most {MAX_PROMPT}), output lengths × "
        f"{OUTPUT_SCALE:g} (at most {MAX_OUTPUT}): {result.prompt_tokens:,} prompt and {result.output_tokens:,} "
        f"output tokens; random token ids, greedy, EOS ignored. The engine gets every request at once (continuous "
        f"batching over the paged pool, its prefix cache reset between repeats); `generate` runs left-padded "
        f"batches of the named size, each to its longest request, and only requested tokens count. Medians of "
        f"{len(result.throughput['engine'])} alternating repeats (per repeat, tok/s: {repeats}).",
        "",
        f"The second table splits a decode step: each batch size decodes that many requests with "
        f"{result.decode_prompt_len}-token prompts; medians over the steps in which every request decodes. "
        "Forward is the model call (paged attention included); the rest is scheduling, input preparation, "
        "sampling and bookkeeping.",
        "", summary_table(result), "",
        f"Targets: engine ≥ {MIN_SPEEDUP:g}× `generate` at each batching: "
        + ", ".join(f"{name} {x:.2f}× ({'met' if x >= MIN_SPEEDUP else 'MISSED'})" for name, x in speedups.items())
        + (f"; non-forward share ≤ {MAX_NON_FORWARD:.0%} at batch {largest}: "
           f"{result.decode_split[largest]['overhead_fraction']:.1%} "
           f"({'met' if result.decode_split[largest]['overhead_fraction'] <= MAX_NON_FORWARD else 'MISSED'})."
           if largest is not None else "."),
    ]
    return "\n".join(lines)
