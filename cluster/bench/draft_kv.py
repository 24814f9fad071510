"""`pdserve bench draft-kv`: in a disaggregated deployment, what the draft model's prompt KV costs the
decode worker, computed there (what pdserve does) against sent beside the target's KV.

The decode worker computes a request's draft KV with the draft model's prompt pass, on its first
drafting step. Sending it instead would cost the draft's KV bytes on the KV transport (through the
project's own frames and transports, as `pdserve bench kv` times them) and a prompt pass of the draft on
the prefill worker. Both are timed here, per prompt length, in one run: the draft's prompt pass on the
engine's own paged attention (a fresh random prompt each time, so nothing is served from a cache), and
its KV's frames through each transport.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.cluster.bench.kv import KVBenchConfig, bench_transports
from pdserve.cluster.bench.report import provenance
from pdserve.engine import EngineConfig, LLMEngine, resolve_model
from pdserve.engine.model_runner import TokenRun
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.draft_model import DraftModelProposer


@dataclass
class DraftKVBenchConfig:
    model: str = "pystd-llama"
    draft_model: str = "pystd-llama-draft"
    prompt_tokens: tuple[int, ...] = (384, 1536)
    transports: tuple[str, ...] = ("shm", "tcp")
    repeats: int = 5
    threads: int = 1  # a decode worker's
    out: Path = Path("bench-results/draft-kv.json")


def _prompt_pass_s(proposer: DraftModelProposer, vocab_size: int, num_tokens: int, rng: random.Random) -> float:
    """Seconds of the draft's prompt pass over a fresh random prompt of `num_tokens`, into its own pool."""
    blocks = proposer.pool.allocate(-(-num_tokens // proposer.block_size))
    try:
        prompt = [rng.randrange(3, vocab_size) for _ in range(num_tokens)]  # no special ids (pad, bos, eos)
        run = TokenRun(prompt, 0, blocks, as_decode=False, num_logits=1)
        t0 = time.perf_counter()
        proposer.runner.forward([run])
        return time.perf_counter() - t0
    finally:
        proposer.pool.free(blocks)


def run(cfg: DraftKVBenchConfig, log=print) -> dict:
    torch.set_num_threads(cfg.threads)
    spec = SpeculativeConfig(method="draft_model", draft_model=cfg.draft_model)
    engine = LLMEngine(resolve_model(cfg.model), EngineConfig(speculative=spec))
    proposer = engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    layout = proposer.runner.kv_cache.layout
    rng = random.Random(0)
    rows = []
    for num_tokens in cfg.prompt_tokens:
        _prompt_pass_s(proposer, engine.vocab_size, num_tokens, rng)  # warm-up
        recompute = statistics.median(_prompt_pass_s(proposer, engine.vocab_size, num_tokens, rng)
                                      for _ in range(cfg.repeats))
        target = engine.kv_layout
        rows.append({"tokens": num_tokens, "recompute_s": recompute,
                     "draft_kv_bytes": num_tokens * layout.num_layers * layout.bytes_per_token_layer,
                     "target_kv_bytes": num_tokens * target.num_layers * target.bytes_per_token_layer})
        log(f"  {num_tokens:6d} tokens: the draft's prompt pass {recompute * 1e3:.1f} ms")
    sends = bench_transports(KVBenchConfig(transports=cfg.transports, prompt_tokens=cfg.prompt_tokens,
                                           repeats=cfg.repeats, codecs=()), layout, log)
    result = {"benchmark": "draft-kv", "provenance": provenance(),
              "config": {k: str(v) for k, v in asdict(cfg).items()}, "draft_layers": layout.num_layers,
              "target_layers": engine.kv_layout.num_layers, "rows": rows, "sends": sends}
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(result, indent=2))
    log(markdown(result))
    log(f"wrote {cfg.out}")
    return result


def markdown(result: dict) -> str:
    cfg = result["config"]
    transports = sorted({s["transport"] for s in result["sends"]})
    send = {(s["transport"], s["tokens"]): s["seconds"] for s in result["sends"]}
    lines = [
        f"{cfg['model']} (KV of {result['target_layers']} layers) and its draft {cfg['draft_model']} (KV of "
        f"{result['draft_layers']} layer{'s' if result['draft_layers'] > 1 else ''}), float32, {cfg['threads']} "
        f"torch thread(s); medians of {cfg['repeats']} "
        "repeats. *Recomputed*: the draft's prompt pass on the decode worker, what pdserve does, in the request's "
        "first drafting step (every request decoding beside it waits that long, once). *Sent*: the draft's KV "
        "through a transport beside the target's, as `pdserve bench kv` times transports; the draft's prompt pass "
        "would then run on the prefill worker instead, beside the target's.",
        "",
        "| prompt tokens | draft KV | target KV | recomputed (ms) | "
        + " | ".join(f"sent by {t} (ms)" for t in transports) + " |",
        "|---" * (4 + len(transports)) + "|",
    ]
    for row in result["rows"]:
        cells = [f"{send[(t, row['tokens'])] * 1e3:.2f}" for t in transports]
        lines.append(f"| {row['tokens']} | {row['draft_kv_bytes'] / 2**20:.1f} MiB | "
                     f"{row['target_kv_bytes'] / 2**20:.1f} MiB | {row['recompute_s'] * 1e3:.1f} | "
                     + " | ".join(cells) + " |")
    ratios = [row["recompute_s"] / min(send[(t, row["tokens"])] for t in transports) for row in result["rows"]]
    lines += ["", f"The decode worker's one-time stall is {min(ratios):.0f}–{max(ratios):.0f}× the extra "
              "transfer time on the fastest transport. Either way the draft sees the same tokens, so a disaggregated "
              "deployment accepts what a colocated one does (a test checks the counts of a request drafted by "
              "the draft model on a 1P+1D cluster against one engine)."]
    return "\n".join(lines)
