"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_PROMPTS = [
    "The water was",
    "People have been writing about the first",
    "def value(self):",
    "Many of them would look at the number",
    "How could it",
    "Some people like to make",
]


def _make_model(args: argparse.Namespace) -> int:
    from engine.presets import PRESETS, make_model

    if args.list or not args.preset:
        for name, preset in PRESETS.items():
            print(f"{name:14} {preset.model_type:8} {preset.description}")
        return 0
    out = make_model(args.preset, args.dir or Path(args.preset), seed=args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Offline engine demo: one engine, a few real prompts, continuous batching, a latency summary."""
    from engine import LLM, SamplingParams
    from engine.presets import resolve_model

    print(f"preparing model {args.model!r} (built once from its preset, then cached) ...", flush=True)
    model_dir = resolve_model(args.model)
    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)
    arrival = time.perf_counter()
    ids = [engine.add_request(p, params) for p in DEMO_PROMPTS]
    first_token: dict[str, float] = {}
    finished: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token.setdefault(out.request_id, time.perf_counter() - arrival)
            if out.finished:
                finished[out.request_id] = (out, time.perf_counter() - arrival)
    for prompt, rid in zip(DEMO_PROMPTS, ids):
        out, latency = finished[rid]
        print(f"\n[{rid}] {prompt!r} -> {out.text!r}")
        print(f"    {len(out.token_ids)} tokens, finish={out.finish_reason}, "
              f"ttft={first_token[rid] * 1e3:.0f} ms, e2e={latency * 1e3:.0f} ms")
    total = sum(len(o.token_ids) for o, _ in finished.values())
    wall = max(t for _, t in finished.values())
    print(f"\n{len(ids)} requests, {total} output tokens in {wall:.2f} s ({total / wall:.0f} tok/s); "
          f"KV blocks free {engine.num_free_blocks}/{engine.pool.num_blocks}")
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from cluster.bench_engine import EngineBenchConfig, run

    cfg = EngineBenchConfig(
        model=args.model, num_prompts=args.num_prompts, repeats=args.repeats, threads=args.threads,
        hf_batch_sizes=tuple(args.hf_batch_sizes), out=Path(args.out),
    )
    run(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode serving runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="build a small random-weight model from a preset")
    mk.add_argument("preset", nargs="?", help="preset name (see --list)")
    mk.add_argument("dir", nargs="?", type=Path, help="output directory (default: ./PRESET)")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--list", action="store_true", help="list the presets")
    mk.set_defaults(func=_make_model)

    demo = sub.add_parser("demo", help="run a few real requests through the engine and print them")
    demo.add_argument("--model", default="llama-20m", help="model directory or preset name")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--max-num-seqs", type=int, default=64)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks (results go to JSON; see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    be = bench_sub.add_parser("engine", help="engine vs transformers generate; decode-step split")
    be.add_argument("--model", default="llama-20m")
    be.add_argument("--num-prompts", type=int, default=64)
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--threads", type=int, default=0, help="torch threads for both systems (0: default)")
    be.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 8])
    be.add_argument("--out", default="bench-results/engine.json")
    be.set_defaults(func=_bench_engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: say what is wrong, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
