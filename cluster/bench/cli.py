"""The command line's benchmark commands: `pdserve bench engine|spec|kv|cluster|overload|serve|...` and `pdserve soak`.

`pdserve.cluster.cli` builds the command line and calls `add_commands` for these.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from pdserve.cluster.bench.workload import DEFAULT_TRACE
from pdserve.cluster.cli_help import examples


def _publish(args: argparse.Namespace, results_file: Path) -> None:
    """With `--docs PAGE`: the run's results, from its results file, as its section of that page."""
    if args.docs:
        from pdserve.cluster.bench.report import key_of, publish

        results = json.loads(results_file.read_text())
        publish(Path(args.docs), key_of(results), results)
        print(f"wrote its section of {args.docs}")


def _bench_report(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.report import key_of, publish

    for name in args.results:
        results = json.loads(Path(name).read_text())
        publish(Path(args.docs), key_of(results), results)
        print(f"{name}: wrote its section of {args.docs}")
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.engine import EngineBenchConfig, run

    cfg = EngineBenchConfig(
        model=args.model, num_prompts=args.num_prompts, repeats=args.repeats, threads=args.threads,
        hf_batch_sizes=tuple(args.hf_batch_sizes), out=Path(args.out),
    )
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_spec(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.spec import SpecBenchConfig, run

    cfg = SpecBenchConfig(model=args.model, draft_model=None if args.draft_model == "none" else args.draft_model,
                          batches=tuple(args.batches), repeats=args.repeats,
                          prompt_len=args.prompt_len, output_len=args.output_len, threads=args.threads,
                          open_loop_requests=args.open_loop_requests, max_runs=args.max_runs, out=Path(args.out))
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_draft_kv(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.draft_kv import DraftKVBenchConfig, run

    cfg = DraftKVBenchConfig(model=args.model, draft_model=args.draft_model, prompt_tokens=tuple(args.tokens),
                             transports=tuple(args.transports), repeats=args.repeats, out=Path(args.out))
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_migration(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.migration import MigrationBenchConfig, run

    cfg = MigrationBenchConfig(model=args.model, contexts=tuple(args.contexts), repeats=args.repeats,
                               transport=args.transport, out=Path(args.out))
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_epd(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.epd import EPDBenchConfig, run

    cfg = EPDBenchConfig(model=args.model, num_requests=args.requests, rate=args.rate,
                         deployments=tuple(args.deployments), out=Path(args.out),
                         profile=Path(args.profile) if args.profile else None)
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_replanning(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.replanning import ReplanBenchConfig, run

    cfg = ReplanBenchConfig(profile=Path(args.profile), model=args.model, workers=args.workers,
                            phase_s=args.phase_s, load=args.load, ttft_slo_s=args.ttft_slo_ms / 1000,
                            tpot_slo_s=args.tpot_slo_ms / 1000, calibration_runs=args.calibration_runs,
                            out=Path(args.out))
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_simulator_spec(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.simulator_spec import SimSpecBenchConfig, run

    cfg = SimSpecBenchConfig(model=args.model, draft_model=None if args.draft_model == "none" else args.draft_model,
                             profile=args.profile, workloads=tuple(args.workloads), batches=tuple(args.batches),
                             repeats=args.repeats,
                             prompt_len=args.prompt_len, output_len=args.output_len, threads=args.threads,
                             out=Path(args.out))
    run(cfg)
    _publish(args, cfg.out)
    return 0


def _bench_kv(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.kv import KVBenchConfig, run

    run(KVBenchConfig(model=args.model, transports=tuple(args.transports), prompt_tokens=tuple(args.tokens),
                      repeats=args.repeats, runs=args.runs, token_bytes=args.token_bytes, codecs=tuple(args.codecs),
                      windows=args.windows, out=Path(args.out)))
    _publish(args, Path(args.out))
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.cluster import ClusterBenchConfig, run

    run(ClusterBenchConfig(model=args.model, num_requests=args.num_requests, rounds=args.rounds,
                           num_long=args.long_prompts, trace=args.trace, gpus_per_worker=args.gpus_per_worker,
                           out=Path(args.out)))
    _publish(args, Path(args.out))
    return 0


def _bench_overload(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.overload import OverloadConfig, run

    result = run(OverloadConfig(manifest=args.manifest, num_requests=args.num_requests, burst_s=args.burst_s,
                                deadline_s=args.deadline_s, max_tokens=args.max_tokens, out=Path(args.out)))
    _publish(args, Path(args.out))
    failed = set(result["outcomes"]) - {"ok", "RESOURCE_EXHAUSTED"}
    return 1 if failed or result["past_deadline"] or result["reference_mismatches"] or not result[
        "pools_free_afterwards"] else 0


def _soak(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.soak import SoakConfig, run_soak

    report = run_soak(SoakConfig(minutes=args.minutes, model=args.model, rate=args.rate, max_tokens=args.max_tokens,
                                 storm=args.storm, kills=args.kills, kv_corrupt_percent=args.kv_corrupt_percent,
                                 seed=args.seed, out=Path(args.out)))
    t, r = report["tokens"], report["recovery_s"]
    print(f"requests {report['requests']}: {report['codes']}; retries {report['retries']}; faults {report['faults']}")
    for k in report["kills"]:
        detect = f"{k['detect_s']:.2f} s" if k["detect_s"] is not None else "-"
        print(f"killed {k['worker']}: {k['affected']} of {k['in_flight']} requests in flight retried, detected after "
              f"{detect}, next token after {k['recovery_s']:.2f} s (longest wait of any: {k['longest_wait_s']:.2f} s)")
    for pool, spread in r.items():
        if not spread["n"]:
            print(f"{pool} kills: no request retried")
            continue
        print(f"{pool} kills: kill to the next token after the retry over {spread['n']} retried requests: p50 "
              f"{spread['p50']:.2f} s, p99 {spread['p99']:.2f} s, max {spread['max']:.2f} s")
    print(f"tokens duplicated {t['duplicated']}, lost {t['lost']}, wrong {t['wrong']} of {t['compared']} compared")
    st = report["storm"]
    print(f"storm: {st['placed']} streams ({st['opened']} streaming) cancelled, pools free after {st['freed_s']:.2f} s; throughput "
          f"{st['tokens_per_s_before']:.0f} -> {st['tokens_per_s_after']:.0f} -> {st['tokens_per_s_settled']:.0f} "
          f"tokens/s (before, right after, settled)")
    print(f"pools free at the end: {report['pools_free_at_end']}, idle audit clean: {report['audit']['clean']}")
    print(f"{'PASS' if report['ok'] else 'FAIL'}; report in {args.out}")
    _publish(args, Path(args.out))
    return 0 if report["ok"] else 1


# `bench serve` options that belong to one of its two benchmarks (--policies picks the second).
SERVE_ONLY = ("configs", "requests_per_rate", "start_rate", "min_rate", "trace", "trace_arrivals", "input_scale",
              "output_scale", "tight", "loose", "cdf_rate", "baseline_threads")
POLICIES_ONLY = ("traces", "requests", "rate", "load", "prefill_replicas", "decode_replicas", "objective")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The options among `names` whose value is not their default, as the user spelt them."""
    parser = argparse.ArgumentParser(prog="pdserve")
    add_commands(parser.add_subparsers(dest="command", required=True))
    defaults = vars(parser.parse_args(["bench", "serve"]))
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != defaults[n]]


def _bench_serve(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.serve import DEFAULT_CONFIGS, ServeBenchConfig, run

    if args.policies is not None:
        return _bench_policies(args)
    if misplaced := _given(args, POLICIES_ONLY):
        raise ValueError(f"{', '.join(misplaced)}: only with --policies")
    cfg = ServeBenchConfig(
        model=args.model, configs=tuple(args.configs or DEFAULT_CONFIGS), requests_per_rate=args.requests_per_rate,
        start_rate=args.start_rate, min_rate=args.min_rate, max_rate=args.max_rate, rel_tol=args.rel_tol,
        max_runs=ServeBenchConfig.max_runs if args.max_runs is None else args.max_runs, seed=args.seed,
        trace=args.trace, trace_arrivals=args.trace_arrivals,
        input_scale=args.input_scale, output_scale=args.output_scale, max_output=args.max_output,
        max_model_len=args.max_model_len, calibration_requests=args.calibration_requests,
        tight=tuple(args.tight) if args.tight else None, loose=tuple(args.loose) if args.loose else None,
        cdf_rate=args.cdf_rate, timeout_s=args.timeout, baseline_threads=args.baseline_threads,
        out_dir=Path(args.out_dir or ServeBenchConfig.out_dir), progress=not args.no_progress,
    )
    run(cfg.quick() if args.quick else cfg)
    _publish(args, cfg.out_dir / "results.json")
    return 0


def _bench_simulator(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.simulator import DEFAULT_CONFIGS, DEFAULT_TRACES, SimulatorBenchConfig, run

    cfg = SimulatorBenchConfig(
        model=args.model, profile=args.profile, traces=tuple(args.traces or DEFAULT_TRACES),
        configs=tuple(args.configs or DEFAULT_CONFIGS),
        loads=tuple(args.loads), requests=args.requests, max_model_len=args.max_model_len, seed=args.seed,
        out_dir=Path(args.out_dir), progress=not args.no_progress)
    if any(not 0 < load <= 1 for load in cfg.loads) or cfg.requests < 2:
        raise ValueError("--loads are fractions of the capacity in (0, 1], and --requests at least 2")
    cfg = cfg.quick() if args.quick else cfg
    run(cfg)
    _publish(args, cfg.out_dir / "results.json")
    return 0


def _bench_policies(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.policies import TRACES, PolicyBenchConfig, parse_rates, run
    from pdserve.cluster.bench.policies import DEFAULT_CONFIGS as POLICY_DEFAULT_CONFIGS

    if misplaced := _given(args, SERVE_ONLY):
        raise ValueError(f"{', '.join(misplaced)}: not with --policies")
    traces = tuple(args.traces or TRACES)
    cfg = PolicyBenchConfig(
        model=args.model, configs=tuple(args.policies or POLICY_DEFAULT_CONFIGS), traces=traces, requests=args.requests,
        rates=parse_rates(args.rate or [], traces), load=args.load,
        max_runs=PolicyBenchConfig.max_runs if args.max_runs is None else args.max_runs, rel_tol=args.rel_tol,
        max_rate=args.max_rate, objective=tuple(args.objective) if args.objective else None,
        calibration_requests=args.calibration_requests, prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas, max_model_len=args.max_model_len, max_output=args.max_output,
        seed=args.seed, timeout_s=args.timeout, out_dir=Path(args.out_dir or PolicyBenchConfig.out_dir),
        progress=not args.no_progress,
    )
    run(cfg.quick() if args.quick else cfg)
    _publish(args, cfg.out_dir / "results.json")
    return 0


def _docs_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", default=None, metavar="PAGE",
                        help="also write the results as this benchmark's section of PAGE, with the command, machine, "
                             "date and commit (e.g. docs/benchmarks.md)")


def _spec_workload_options(parser: argparse.ArgumentParser) -> None:
    """The options `bench spec` and `bench simulator-spec` share: the models and the batches' shape."""
    parser.add_argument("--model", default="pystd-llama", help="preset or model directory (default: %(default)s)")
    parser.add_argument("--draft-model", default="pystd-llama-draft",
                        help="the model's draft model, or none: the model-free proposer only (default: %(default)s)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default: 1 8 32)")
    parser.add_argument("--prompt-len", type=int, default=384, help="code prompts' tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number, `minimum` or more."""
    def whole_number(text: str) -> int:
        n = int(text)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, not {n}")
        return n
    whole_number.__name__ = "whole number"  # argparse's word for text that is no number
    return whole_number


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `soak` and `bench` (with its own subcommands) to the command line's subparsers `sub`."""
    sk = sub.add_parser("soak", help="minutes of trace-driven load with workers killed, KV frames corrupted and a "
                                     "storm of cancels; checks that no request or token was lost (docs/reliability.md)",
                        description="Replay the Azure conversation trace against a local cluster of 2 prefill and 2 "
                                    "decode workers while killing workers of each pool, corrupting KV frames and cancelling a "
                                    "storm of streams; check that no request or token was lost and every pool is free "
                                    "at the end. Exits 1 on a failed check.",
                        **examples("pdserve soak --minutes 3 --out bench-results/soak.json --docs docs/benchmarks.md",
                                   "pdserve soak --minutes 1 --storm 200 --kv-corrupt-percent 5",
                                   "pdserve soak --minutes 4 --kills 12 --storm 200"))
    sk.add_argument("--minutes", type=float, default=5.0, help="how long the trace is replayed (default: %(default)s)")
    sk.add_argument("--model", default="llama-20m", help="preset or model directory (default: %(default)s)")
    sk.add_argument("--rate", type=float, default=2.0, help="trace requests per second")
    sk.add_argument("--max-tokens", type=int, default=32, help="cap on the trace's output lengths")
    sk.add_argument("--storm", type=int, default=1000, help="streams opened, then cancelled at once")
    sk.add_argument("--kills", type=_at_least(0), default=2, help="workers SIGKILLed under load, a decode and a prefill worker "
                                                         "in turn (default: %(default)s)")
    sk.add_argument("--kv-corrupt-percent", type=float, default=2.0, help="of KV frames, corrupted on the wire")
    sk.add_argument("--seed", type=int, default=0, help="seed of the faults and the workload (default: %(default)s)")
    sk.add_argument("--out", default="bench-results/soak.json", help="the report (JSON; default: %(default)s)")
    _docs_option(sk)
    sk.set_defaults(func=_soak)
    bench = sub.add_parser("bench", help="benchmarks (results go to JSON; see docs/benchmarks.md)",
                           description="The benchmarks. Each writes its results to JSON, with the command, machine, "
                                       "date and commit; --docs PAGE also writes them into that page "
                                       "(docs/running-benchmarks.md).",
                           **examples("pdserve bench engine --docs docs/benchmarks.md",
                                      "pdserve bench serve --quick                 # a smoke run, under two minutes",
                                      "pdserve bench COMMAND --help"))
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="COMMAND")
    be = bench_sub.add_parser("engine", help="engine vs transformers generate; decode-step split",
                              description="The engine against transformers' generate on the same requests: output "
                                          "tokens/s, and the decode step's split into forward pass and the rest.",
                              **examples("pdserve bench engine", "pdserve bench engine --num-prompts 16 --repeats 1"))
    be.add_argument("--model", default="llama-20m", help="preset or model directory (default: %(default)s)")
    be.add_argument("--num-prompts", type=int, default=64, help="requests, from the trace (default: %(default)s)")
    be.add_argument("--repeats", type=int, default=3, help="runs of each system, alternating (default: %(default)s)")
    be.add_argument("--threads", type=int, default=0, help="torch threads for both systems (0: default)")
    be.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 8],
                    help="generate's batch sizes (default: 64 8)")
    be.add_argument("--out", default="bench-results/engine.json", help="results file (default: %(default)s)")
    _docs_option(be)
    be.set_defaults(func=_bench_engine)
    bsp = bench_sub.add_parser("spec", help="decoding with and without speculation: TPOT and output tokens/s",
                               description="Speculative decoding (the model-free suffix proposer, the draft model, "
                                           "and both) against plain decoding on the same requests, in one run: code "
                                           "completion of held-out Python source, and random prompts with the "
                                           "conversation trace's lengths (greedy, and sampled), at several batch "
                                           "sizes (outputs checked identical) and under open-loop load (goodput).",
                               **examples("pdserve bench spec --docs docs/benchmarks.md",
                                          "pdserve bench spec --batches 1 --repeats 1   # a quick look"))
    _spec_workload_options(bsp)
    bsp.add_argument("--repeats", type=int, default=3, help="runs of each system per batch (default: %(default)s)")
    bsp.add_argument("--open-loop-requests", type=int, default=24,
                     help="requests per rate of the open-loop goodput search; 0: none (default: %(default)s)")
    bsp.add_argument("--max-runs", type=int, default=8, help="rates each goodput search may measure "
                                                            "(default: %(default)s)")
    bsp.add_argument("--out", default="bench-results/spec.json", help="results file (default: %(default)s)")
    _docs_option(bsp)
    bsp.set_defaults(func=_bench_spec)
    bd = bench_sub.add_parser("draft-kv", help="disaggregated speculation: the draft model's prompt KV sent with the "
                                               "target's against recomputed on the decode worker",
                              description="What a draft model's prompt KV costs a disaggregated deployment: sent "
                                          "(the prefill worker's prompt pass with the draft's beside it, and its "
                                          "bytes through each KV transport) against its prompt pass on the decode "
                                          "worker, per prompt length, in one run.",
                              **examples("pdserve bench draft-kv --docs docs/benchmarks.md",
                                         "pdserve bench draft-kv --tokens 384 --repeats 1   # a quick look"))
    bd.add_argument("--model", default="pystd-llama", help="preset or model directory (default: %(default)s)")
    bd.add_argument("--draft-model", default="pystd-llama-draft", help="its draft model (default: %(default)s)")
    bd.add_argument("--tokens", type=int, nargs="+", default=[384, 1536], help="prompt lengths (default: 384 1536)")
    bd.add_argument("--transports", nargs="+", default=["shm", "tcp"],
                    help="of shm, tcp, grpc, gloo (default: shm tcp)")
    bd.add_argument("--repeats", type=int, default=5, help="repeats of each measurement (default: %(default)s)")
    bd.add_argument("--out", default="bench-results/draft-kv.json", help="results file (default: %(default)s)")
    _docs_option(bd)
    bd.set_defaults(func=_bench_draft_kv)
    bm = bench_sub.add_parser("migration", help="live migration: how long a stream pauses when its request moves "
                                                "to another decode worker with its KV, against by recompute",
                              description="A running request moved between two decode workers of a local cluster, "
                                          "with its KV and by recompute, alternately, per context length: the "
                                          "longest gap between two tokens the client received, beside a decode step "
                                          "and the KV's transfer time measured in the same run.",
                              **examples("pdserve bench migration --docs docs/benchmarks.md",
                                         "pdserve bench migration --contexts 256 --repeats 2   # a quick look"))
    bm.add_argument("--model", default="pystd-llama", help="preset or model directory (default: %(default)s)")
    bm.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024],
                    help="tokens in context when the request moves (default: 256 512 1024)")
    bm.add_argument("--repeats", type=int, default=20, help="runs per context length and way (default: %(default)s)")
    bm.add_argument("--transport", default="auto", help="KV transport (default: %(default)s)")
    bm.add_argument("--out", default="bench-results/migration.json", help="results file (default: %(default)s)")
    _docs_option(bm)
    bm.set_defaults(func=_bench_migration)
    be = bench_sub.add_parser("epd", help="an encode pool for images against encoding in the prefill worker and "
                                          "against colocated workers, under an image-heavy load",
                              description="The same image-heavy requests (0 to 3 images each, some repeated) against "
                                          "three deployments of three workers each, every one a fresh cluster: TTFT "
                                          "p50/p90 (text-only requests apart), the share meeting the objectives, "
                                          "and the encode pool's embedding cache hit rate.",
                              **examples("pdserve bench epd --docs docs/benchmarks.md",
                                         "pdserve bench epd --requests 30 --deployments epd encode-in-prefill"))
    be.add_argument("--model", default="qwen2-vl-20m", help="vision-language preset or model directory "
                                                            "(default: %(default)s)")
    be.add_argument("--requests", type=int, default=120, help="requests per deployment (default: %(default)s)")
    be.add_argument("--rate", type=float, default=1.5, help="arrivals per second, Poisson (default: %(default)s)")
    be.add_argument("--deployments", nargs="+", default=["epd", "encode-in-prefill", "colocated"],
                    choices=["epd", "encode-in-prefill", "colocated"], help="which to run (default: all three)")
    be.add_argument("--out", default="bench-results/epd.json", help="results file (default: %(default)s)")
    be.add_argument("--profile", default=None, help="the profile whose simulator predictions go beside the measured "
                                                    "figures (default: the model's stored one on this machine, if any)")
    _docs_option(be)
    be.set_defaults(func=_bench_epd)
    br = bench_sub.add_parser("replanning", help="the online planner against every static split of the same "
                                                 "workers, on a trace whose mix shifts",
                              description="Three phases back to back (conversation, long-prompt summarisation, code "
                                          "completion), each at a rate calibrated on the simulator; every static "
                                          "split of the workers and the online planner serve the same trace on fresh "
                                          "local clusters; goodput (requests meeting both objectives per second) per "
                                          "phase and over the whole trace.",
                              **examples("pdserve bench replanning --profile profile.json --docs docs/benchmarks.md",
                                         "pdserve bench replanning --profile profile.json --phase-s 30   # a quick look"))
    br.add_argument("--profile", required=True, help="the model's profile on this machine (`pdserve profile "
                                                     "--profile FILE` writes one, in a few minutes)")
    br.add_argument("--model", default="pystd-llama", help="preset or model directory (default: %(default)s)")
    br.add_argument("--workers", type=int, default=3, help="workers to split (default: %(default)s)")
    br.add_argument("--phase-s", type=float, default=120.0, help="seconds per phase (default: %(default)s)")
    br.add_argument("--load", type=float, default=0.8,
                    help="each phase's rate, as a share of the best static split's predicted goodput "
                         "(default: %(default)s)")
    br.add_argument("--ttft-slo-ms", type=float, default=1000.0, help="TTFT objective (default: %(default)s)")
    br.add_argument("--tpot-slo-ms", type=float, default=100.0, help="TPOT objective (default: %(default)s)")
    br.add_argument("--calibration-runs", type=_at_least(1), default=8,
                    help="simulated runs of each split's goodput search per phase; the search starts at 1 request/s "
                         "and doubles, so fewer runs settle on a lower rate, sooner (default: %(default)s)")
    br.add_argument("--out", default="bench-results/replanning.json", help="results file (default: %(default)s)")
    _docs_option(br)
    br.set_defaults(func=_bench_replanning)
    bk = bench_sub.add_parser("kv", help="KV transports (bytes/s against a plain TCP socket) and codecs (bits per "
                                         "element, perplexity change, greedy agreement, speed)",
                              description="Each KV transport's bytes/s against a plain TCP socket, and each codec and "
                                          "level on the model: bits per element, perplexity change, greedy agreement, "
                                          "encode and decode speed.",
                              **examples("pdserve bench kv",
                                         "pdserve bench kv --transports shm tcp --codecs       # transports alone",
                                         "pdserve bench kv --runs 3 --codecs                  # three runs, one table",
                                         "pdserve bench kv --token-bytes 4096 --codecs         # 8B-class frames"))
    bk.add_argument("--model", default="pystd-llama", help="preset or model directory (default: %(default)s)")
    bk.add_argument("--transports", nargs="+", default=["shm", "tcp", "grpc", "gloo"],
                    help="of shm, tcp, grpc, gloo, nccl (nccl needs two GPUs)")
    bk.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384], help="prompt lengths")
    bk.add_argument("--repeats", type=int, default=20, help="repeats, transports in turn within each "
                                                          "(default: %(default)s)")
    bk.add_argument("--runs", type=int, default=1, help="whole transport runs, each setting every transport up "
                                                        "afresh, shown side by side (default: %(default)s)")
    bk.add_argument("--token-bytes", type=int, default=None,
                    help="KV bytes per token and layer of the transports' frames (default: the model's); e.g. "
                         "4096 for an 8B-class layout (8 KV heads x 128, bf16: frames of 6 MiB)")
    bk.add_argument("--codecs", nargs="*", default=["raw", "fp8", "int8", "cachegen"],
                    help="codecs to measure on the model; none: the transport table alone")
    bk.add_argument("--windows", type=int, default=16, help="held-out windows of 1024 tokens for perplexity")
    bk.add_argument("--out", default="bench-results/kv.json", help="results file (default: %(default)s)")
    _docs_option(bk)
    bk.set_defaults(func=_bench_kv)
    bc = bench_sub.add_parser("cluster", help="disaggregated (shm, tcp, grpc, gloo) vs colocated: TTFT breakdown, "
                                              "streaming overhead, KV bytes/s",
                              description="Disaggregated deployments (shm, tcp, grpc, gloo; shm streaming every prompt "
                                          "layer by layer) against colocated at low load, all running at once, each "
                                          "prompt sent to every one in turn: TTFT and its breakdown, streaming "
                                          "overhead, KV bytes/s and the share hidden behind the prompt pass.",
                              **examples("pdserve bench cluster",
                                         "pdserve bench cluster --num-requests 8 --rounds 1 --long-prompts 2",
                                         "pdserve bench cluster --gpus-per-worker 0.1        # engines on one GPU"))
    bc.add_argument("--model", default="llama-20m", help="preset or model directory (default: %(default)s)")
    bc.add_argument("--num-requests", type=int, default=24, help="prompt lengths taken from the trace")
    bc.add_argument("--rounds", type=int, default=3, help="requests per prompt length (fresh tokens each round)")
    bc.add_argument("--long-prompts", type=int, default=8, help="2K-token prompts, each to every deployment")
    bc.add_argument("--trace", default=DEFAULT_TRACE, help="Azure CSV trace (shipped with the benchmarks, or in PDSERVE_TRACES) "
                    "whose prompt lengths the low-load requests take")
    bc.add_argument("--gpus-per-worker", type=float, default=0.0,
                    help="GPUs for each worker (engines on CUDA); all 5 deployments' 10 workers run at once, "
                         "so 0.1 puts them all on one GPU")
    bc.add_argument("--out", default="bench-results/cluster.json", help="results file (default: %(default)s)")
    _docs_option(bc)
    bc.set_defaults(func=_bench_cluster)
    br = bench_sub.add_parser("report", help="write benchmarks' results files into the docs, each as its section",
                              description="Write benchmarks' results files into a docs page, each as its benchmark's "
                                          "section (in place of the one there), with the command, machine, date and "
                                          "commit the file records.",
                              **examples("pdserve bench report bench-results/kv.json --docs docs/benchmarks.md",
                                         "pdserve bench report bench-results/*.json --docs docs/benchmarks.md"))
    br.add_argument("results", nargs="+", help="results files a benchmark wrote (its --out)")
    br.add_argument("--docs", required=True, help="the page to write into (made if missing)")
    br.set_defaults(func=_bench_report)
    bo = bench_sub.add_parser("overload", help="a burst far past capacity: every request completes or gets "
                                               "RESOURCE_EXHAUSTED; memory and pools checked",
                              description="A burst of requests far past the cluster's capacity: every request must "
                                          "complete or get RESOURCE_EXHAUSTED in time, outputs are checked against "
                                          "transformers' generate, memory is measured and the pools must be free "
                                          "after. Exits 1 on a failed check.",
                              **examples("pdserve bench overload --docs docs/benchmarks.md",
                                         "pdserve bench overload --num-requests 300 --burst-s 1"))
    bo.add_argument("--manifest", default=None, help="manifest (default: deploy/local.yaml)")
    bo.add_argument("--num-requests", type=int, default=1000, help="requests in the burst (default: %(default)s)")
    bo.add_argument("--burst-s", type=float, default=2.0, help="the requests are spread over this many seconds")
    bo.add_argument("--deadline-s", type=float, default=120.0, help="each request's deadline (default: %(default)s)")
    bo.add_argument("--max-tokens", type=int, default=32, help="cap on the trace's output lengths")
    bo.add_argument("--out", default="bench-results/overload.json", help="results file (default: %(default)s)")
    _docs_option(bo)
    bo.set_defaults(func=_bench_overload)
    bs = bench_sub.add_parser("serve", help="open-loop serving benchmark: SLO attainment and goodput of "
                                            "pdserve configurations and transformers serve; with --policies, "
                                            "the router's placement policies on three traces",
                              description="Open-loop load from a trace against deployments started one at a time: "
                                          "SLO attainment against rate, and goodput (the highest rate at which 90% "
                                          "of requests meet both the TTFT and the TPOT objective). With --policies, "
                                          "the router's placement policies side by side on three traces.",
                              **examples("pdserve bench serve --quick                    # a smoke run",
                                         "pdserve bench serve --configs disaggregated colocated-chunked",
                                         "pdserve bench serve --policies --quick",
                                         "pdserve bench serve --policies estimated_ttft cache_aware --traces mooncake"))
    bs.add_argument("--configs", nargs="+", default=None, help="any of disaggregated, colocated-chunked, "
                    "colocated, transformers-serve, disaggregated-1p2d, disaggregated-http (the disaggregated deployment over its "
                    "OpenAI HTTP API) (default: the first four)")
    bs.add_argument("--model", default="llama-20m", help="preset or model directory (default: %(default)s)")
    bs.add_argument("--requests-per-rate", type=int, default=64, help="requests in each rate's run")
    bs.add_argument("--start-rate", type=float, default=None,
                    help="first rate of the search, req/s (default: 1 / idle e2e latency)")
    bs.add_argument("--min-rate", type=float, default=0.05,
                    help="the search's lowest rate, req/s (default: %(default)s)")
    bs.add_argument("--max-rate", type=float, default=64.0,
                    help="the search's highest rate, req/s (default: %(default)s)")
    bs.add_argument("--rel-tol", type=float, default=0.1, help="bisection stops at this relative bracket")
    bs.add_argument("--max-runs", type=int, default=None, help="runs per configuration, over all objective pairs "
                    "(default 10); with --policies, per trace and configuration, the common-rate run included "
                    "(default 3)")
    bs.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts (default: %(default)s)")
    bs.add_argument("--trace", default=DEFAULT_TRACE, help="Azure CSV trace (shipped with the benchmarks, or in PDSERVE_TRACES)")
    bs.add_argument("--trace-arrivals", action="store_true",
                    help="replay the trace's timestamps (scaled to each rate) instead of Poisson arrivals")
    bs.add_argument("--input-scale", type=float, default=0.25, help="prompt length factor")
    bs.add_argument("--output-scale", type=float, default=0.25, help="output length factor")
    bs.add_argument("--max-output", type=int, default=None, help="cap on output tokens")
    bs.add_argument("--max-model-len", type=int, default=1024, help="the deployments' context (default: %(default)s)")
    bs.add_argument("--calibration-requests", type=int, default=8, help="idle requests that set the objectives")
    bs.add_argument("--tight", type=float, nargs=2, metavar=("TTFT_S", "TPOT_S"), default=None,
                    help="tight objective pair (default: 2 x idle p90 TTFT, 1.5 x idle TPOT)")
    bs.add_argument("--loose", type=float, nargs=2, metavar=("TTFT_S", "TPOT_S"), default=None,
                    help="loose objective pair (default: 5 x idle p90 TTFT, 3 x idle TPOT)")
    bs.add_argument("--cdf-rate", type=float, default=None,
                    help="rate of the latency CDFs (default: the highest rate every configuration ran)")
    bs.add_argument("--timeout", type=float, default=300.0, help="per-request deadline, seconds")
    bs.add_argument("--baseline-threads", type=int, default=2, help="torch threads of transformers serve")
    bs.add_argument("--out-dir", default=None, help="default: bench-results/serve, with --policies "
                    "bench-results/policies")
    bs.add_argument("--no-progress", action="store_true", help="no progress bars")
    _docs_option(bs)
    bs.add_argument("--quick", action="store_true", help="a tiny smoke run (6 requests a rate, 2 runs each; with "
                    "--policies: the first 2 configurations on the first trace, 8 requests, 1 run)")
    pol = bs.add_argument_group("placement policies (pdserve bench serve --policies; cluster/bench/policies.py)")
    pol.add_argument("--policies", nargs="*", default=None, metavar="CONFIG",
                     help="run the policy benchmark instead, on these configurations (none named: all of "
                          "estimated_ttft, round_robin, least_loaded, cache_aware, kv_cost, estimated_ttft-fcfs, "
                          "estimated_ttft-always-disaggregate)")
    pol.add_argument("--traces", nargs="+", default=None,
                     help="any of mooncake, azure-conv, azure-code (default: all three)")
    pol.add_argument("--requests", type=int, default=64, help="requests in each run")
    pol.add_argument("--rate", nargs="+", default=None, metavar="[TRACE=]REQ_S",
                     help="the common rate of every trace, or of one (default: --load x the first configuration's "
                          "throughput with a run's requests arriving at once)")
    pol.add_argument("--load", type=float, default=0.7, help="the calibrated rate's fraction of that throughput")
    pol.add_argument("--prefill-replicas", type=int, default=4, help="prefill workers (default: %(default)s)")
    pol.add_argument("--decode-replicas", type=int, default=1, help="decode workers (default: %(default)s)")
    pol.add_argument("--objective", type=float, nargs=2, metavar=("TTFT_S", "TPOT_S"), default=None,
                     help="goodput objective for every trace (default: 5 x idle p90 TTFT, 3 x idle TPOT, per trace)")
    bs.set_defaults(func=_bench_serve)

    bsim = bench_sub.add_parser("simulator", help="the cluster simulator (pdserve plan's) against real runs of the "
                                                  "same deployments: TTFT and TPOT side by side",
                                description="For each trace and deployment: a real cluster on this machine and the "
                                            "simulator, given the same prompts, lengths and send times; a burst "
                                            "measures capacity, then Poisson runs at fractions of it. Needs this "
                                            "machine's profile (`pdserve profile`).",
                                **examples("pdserve bench simulator --quick",
                                           "pdserve bench simulator --docs docs/benchmarks.md"))
    bsim.add_argument("--model", default="llama-20m", help="preset or model directory (default: %(default)s)")
    bsim.add_argument("--profile", type=Path, default=None, help="the profile (default: the model's on this machine)")
    bsim.add_argument("--traces", nargs="+", default=None, help="shipped traces or files (default: the three "
                                                                "shipped)")
    bsim.add_argument("--configs", nargs="+", default=None, help="deployments, as `bench serve` names them (default: "
                                                                 "colocated, disaggregated, disaggregated-1p2d)")
    bsim.add_argument("--loads", nargs="+", type=float, default=[0.3, 0.6, 0.9],
                      help="rates as fractions of the measured capacity (default: %(default)s)")
    bsim.add_argument("--requests", type=int, default=64, help="requests per run (default: %(default)s)")
    bsim.add_argument("--max-model-len", type=int, default=1024, help="context limit (default: %(default)s)")
    bsim.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: %(default)s)")
    bsim.add_argument("--out-dir", default="bench-results/simulator", help="results (default: %(default)s)")
    bsim.add_argument("--quick", action="store_true", help="a smoke run: one trace, two deployments, 8 requests")
    bsim.add_argument("--no-progress", action="store_true", help="no progress bars")
    _docs_option(bsim)
    bsim.set_defaults(func=_bench_simulator)
    bss = bench_sub.add_parser("simulator-spec", help="the simulator's speculative decoding against the engine's: "
                                                      "TPOT measured and predicted",
                               description="Batches of each workload of `pdserve bench spec` decoded by the engine "
                                           "without speculation and with each proposer, and simulated given the "
                                           "drafting measured at the first batch size and at each; TPOT and the "
                                           "speedup side by side. Needs this machine's profile "
                                           "measured with speculation (`pdserve profile --manifest "
                                           "deploy/speculative.yaml`).",
                               **examples("pdserve bench simulator-spec --docs docs/benchmarks.md",
                                          "pdserve bench simulator-spec --workloads code --batches 1   # a quick look"))
    _spec_workload_options(bss)
    bss.add_argument("--profile", type=Path, default=None, help="the profile (default: the model's on this machine)")
    bss.add_argument("--workloads", nargs="+", default=["code", "conversation", "sampled"],
                     choices=["code", "conversation", "sampled"], help="as `bench spec` names them (default: all)")
    bss.add_argument("--repeats", type=int, default=3, help="runs of each batch, on fresh prompts (default: "
                                                            "%(default)s)")
    bss.add_argument("--out", default="bench-results/simulator-spec.json", help="results file (default: %(default)s)")
    _docs_option(bss)
    bss.set_defaults(func=_bench_simulator_spec)
