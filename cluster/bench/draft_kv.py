"""`pdserve bench draft-kv`: in a disaggregated deployment, what the draft model's prompt KV costs,
sent beside the target's KV (`speculative.draft_kv: send`, the default) against computed on the decode
worker (`recompute`).

Sent, it costs the prefill worker the draft's pass beside each prompt chunk (its prompt pass takes
longer: the first token comes later) and the draft's KV bytes on the transport (through the project's
own frames and transports, as `pdserve bench kv` times them). Recomputed, it costs the decode worker the
draft's prompt pass in the request's first drafting step: every request decoding beside it waits that
long, once. All three are timed here, per prompt length, in one run, each prompt fresh and random (no
run is served from a cache): a prefill engine's whole prompt pass with and without the draft's beside
it, the draft's prompt pass alone, and its KV's frames through each transport.
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
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, resolve_model
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


def _prefill_s(engine: LLMEngine, num_tokens: int, rng: random.Random) -> float:
    """Seconds of a prefill engine's whole prompt pass over a fresh random prompt (one step), its KV
    then let go."""
    prompt = [rng.randrange(3, engine.vocab_size) for _ in range(num_tokens)]
    request_id = engine.add_request(prompt, SamplingParams.greedy(max_tokens=2), prefill_only=True)
    try:
        t0 = time.perf_counter()
        while not engine.requests[request_id].output_token_ids:  # its first token ends the pass
            engine.step()
        return time.perf_counter() - t0
    finally:
        engine.abort_request(request_id)


def run(cfg: DraftKVBenchConfig, log=print) -> dict:
    torch.set_num_threads(cfg.threads)
    spec = SpeculativeConfig(method="draft_model", draft_model=cfg.draft_model)
    model = resolve_model(cfg.model)
    budget = max(cfg.prompt_tokens)  # each prompt in one step, so that its pass is timed whole
    prefill = {sends: LLMEngine(model, EngineConfig(speculative=spec if sends else None, draft_prompt_kv=sends,
                                                    max_num_batched_tokens=budget))
               for sends in (False, True)}
    engine = prefill[True]
    proposer = engine.draft_model
    assert isinstance(proposer, DraftModelProposer)
    layout = proposer.runner.kv_cache.layout
    rng = random.Random(0)
    rows = []
    for num_tokens in cfg.prompt_tokens:
        timed: dict[str, list[float]] = {"prefill_s": [], "prefill_with_draft_s": [], "recompute_s": []}
        for repeat in range(cfg.repeats + 1):  # the first round warms up
            times = (_prefill_s(prefill[False], num_tokens, rng), _prefill_s(prefill[True], num_tokens, rng),
                     _prompt_pass_s(proposer, engine.vocab_size, num_tokens, rng))
            for name, seconds in zip(timed, times):
                if repeat:
                    timed[name].append(seconds)
        medians = {name: statistics.median(values) for name, values in timed.items()}
        target = engine.kv_layout
        rows.append({"tokens": num_tokens, **medians,
                     "draft_kv_bytes": num_tokens * layout.num_layers * layout.bytes_per_token_layer,
                     "target_kv_bytes": num_tokens * target.num_layers * target.bytes_per_token_layer})
        log(f"  {num_tokens:6d} tokens: prompt pass {medians['prefill_s'] * 1e3:.1f} ms, with the draft's beside "
            f"it {medians['prefill_with_draft_s'] * 1e3:.1f} ms; the draft's alone {medians['recompute_s'] * 1e3:.1f} ms")
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
        f"torch thread(s); medians of {cfg['repeats']} repeats, each prompt fresh. *Sent* (`speculative.draft_kv: "
        "send`, the default): the prefill worker's prompt pass with the draft's beside it, against without, and the "
        "draft's KV through a transport beside the target's, as `pdserve bench kv` times transports. *Recomputed* "
        "(`draft_kv: recompute`): the draft's prompt pass on the decode worker, in the request's first drafting step "
        "(every request decoding beside it waits that long, once).",
        "",
        "| prompt tokens | draft KV | target KV | prompt pass (ms) | with the draft's (ms) | recomputed (ms) | "
        + " | ".join(f"sent by {t} (ms)" for t in transports) + " |",
        "|---" * (6 + len(transports)) + "|",
    ]
    for row in result["rows"]:
        cells = [f"{send[(t, row['tokens'])] * 1e3:.2f}" for t in transports]
        lines.append(f"| {row['tokens']} | {row['draft_kv_bytes'] / 2**20:.1f} MiB | "
                     f"{row['target_kv_bytes'] / 2**20:.1f} MiB | {row['prefill_s'] * 1e3:.1f} | "
                     f"{row['prefill_with_draft_s'] * 1e3:.1f} | {row['recompute_s'] * 1e3:.1f} | "
                     + " | ".join(cells) + " |")
    rows = result["rows"]
    ratios = [row["recompute_s"] / min(send[(t, row["tokens"])] for t in transports) for row in rows]
    longer = [row["prefill_with_draft_s"] / row["prefill_s"] - 1 for row in rows]
    lines += ["", "Either way the draft's prompt pass runs once: sending moves it from the decode worker, where every "
              "request decoding beside it waits it out, to the prefill worker, where the request's first token waits "
              f"for it (its prompt pass {100 * min(longer):.0f}–{100 * max(longer):.0f}% longer here), and adds the "
              f"draft's bytes to the transfer ({1 / max(ratios):.1%}–{1 / min(ratios):.1%} of the pass's time on the "
              "fastest transport). The draft sees the same tokens both ways, so a disaggregated deployment accepts "
              "what a colocated one does (a test checks the counts of a request drafted by the draft model on a "
              "1P+1D cluster against one engine, and that its draft KV arrived)."]
    return "\n".join(lines)
