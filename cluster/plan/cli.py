"""The command line's planning commands: `pdserve profile` and `pdserve plan`.

`pdserve.cluster.cli` builds the command line and calls `add_plan_commands` for these.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdserve.cluster.bench.workload import DEFAULT_TRACE
from pdserve.cluster.cli_help import examples

NEAR_TIE = 0.25  # predicted goodputs this close to the best are named beside it


def _base_manifest(args: argparse.Namespace) -> Any:
    from pdserve.cluster.manifest import DEFAULT_MANIFEST, load_manifest

    import yaml

    data = yaml.safe_load(Path(args.manifest or DEFAULT_MANIFEST).read_text())
    if args.model:
        data["model"] = args.model
    if args.max_model_len:
        data["max_model_len"] = args.max_model_len
    return load_manifest(data)


def _model_digest(manifest: Any) -> str:
    from pdserve.engine.model_store import model_digest
    from pdserve.engine.models.presets import resolve_model

    return model_digest(resolve_model(manifest.model))


def _profile_path(args: argparse.Namespace, manifest: Any, digest: str) -> Path:
    from pdserve.cluster.plan.costs import default_profile_path, machine

    return Path(args.profile) if args.profile else default_profile_path(manifest.model, digest, machine())


def _profile(args: argparse.Namespace) -> int:
    from pdserve.cluster.plan.profiler import profile

    manifest = _base_manifest(args)
    threads = tuple(sorted({int(t) for t in args.threads.split(",")}))
    if not threads or min(threads) < 1:
        raise ValueError(f"--threads takes positive thread counts, comma-separated; got {args.threads!r}")
    transports = tuple(t for t in args.transports.split(",") if t)
    result = profile(manifest, threads, transports, seed=args.seed)
    path = _profile_path(args, manifest, result.model_digest)
    result.save(path)
    print(f"wrote {path}")
    return 0


def _image_tokens(manifest: Any) -> Any:
    """tokens(width, height) of the manifest's model, a vision-language model (ValueError otherwise)."""
    from transformers import AutoConfig

    from pdserve.engine.models.presets import resolve_model
    from pdserve.engine.multimodal.vision import FAMILIES, image_token_counter

    model_dir = resolve_model(manifest.model)
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in FAMILIES:
        raise ValueError(f"--image-share: {manifest.model} takes no images (a {config.model_type} model, not a "
                         f"vision-language model of a family pdserve serves: {', '.join(sorted(FAMILIES))})")
    return image_token_counter(model_dir, config)


def _drafting(args: argparse.Namespace, manifest: Any) -> Any:
    """The workload's drafting (`sim_speculation.Drafting`) where the manifest speculates, else None."""
    from pdserve.cluster.plan.sim_speculation import Drafting

    described = args.draft_share != 1.0 or args.draft_length is not None or args.draft_model_share != 1.0
    spec = manifest.speculative
    if spec is None:
        if args.acceptance is not None or described:
            raise ValueError("--acceptance and the other draft options describe speculative decoding, and the "
                             "manifest has no `speculative` section")
        return None
    if args.acceptance is None:
        raise ValueError("the manifest decodes speculatively: give the workload's --acceptance (and --draft-share, "
                         "--draft-length, as `pdserve bench spec` measures them)")
    if args.draft_length is not None and args.draft_length > spec.max_draft_tokens:
        raise ValueError(f"--draft-length {args.draft_length} is more than the manifest's max_draft_tokens "
                         f"({spec.max_draft_tokens})")
    if args.draft_model_share != 1.0 and spec.method != "both":
        raise ValueError(f"--draft-model-share is for method both (the manifest's is {spec.method})")
    return Drafting(args.acceptance, args.draft_share, args.draft_length, args.draft_model_share)


def _plan(args: argparse.Namespace) -> int:
    from pdserve.cluster.bench.serve_metrics import Objective
    from pdserve.cluster.bench.workload import (ImageMix, check_azure_trace, find_trace, load_azure_trace,
                                                scale_requests, with_images)
    from pdserve.cluster.plan.costs import HardwareProfile, check_profile
    from pdserve.cluster.plan.planner import plan, plot_frontier, write_manifest

    if args.slo_ttft <= 0 or args.slo_tpot <= 0 or args.cpus < 1 or (args.rate is not None and args.rate <= 0):
        raise ValueError("--slo-ttft, --slo-tpot, --cpus and --rate must be positive")
    manifest = _base_manifest(args)
    drafting = _drafting(args, manifest)
    if args.requests < 2 or args.run_seconds <= 0:
        raise ValueError("--requests must be at least 2 and --run-seconds positive")
    digest = _model_digest(manifest)
    path = _profile_path(args, manifest, digest)
    if not path.is_file():
        given = [f"{flag} {value}" for flag, value in (("--manifest", args.manifest), ("--model", args.model),
                                                        ("--max-model-len", args.max_model_len),
                                                        ("--profile", args.profile)) if value]
        raise FileNotFoundError(f"no profile of {manifest.model} on this machine at {path}: measure it first with "
                                f"`{' '.join(['pdserve profile', *given])}` (a few minutes)")
    profile = HardwareProfile.load(path)
    check_profile(profile, manifest, path, digest)
    check_azure_trace(args.trace)
    shapes = scale_requests(load_azure_trace(find_trace(args.trace), args.requests), args.input_scale,
                            args.output_scale, manifest.max_model_len)
    if args.image_share:
        mix = ImageMix(args.image_share, args.popular_share, args.popular_images)
        shapes = with_images(shapes, mix, _image_tokens(manifest), manifest.max_model_len, args.seed)
        print(f"images: {sum(bool(s.images) for s in shapes)} of {len(shapes)} requests carry "
              f"{sum(len(s.images) for s in shapes)} ({args.popular_share:.0%} of them from {args.popular_images} "
              "popular ones)")
    objective = Objective("plan", args.slo_ttft / 1e3, args.slo_tpot / 1e3)
    print(f"planning for {manifest.model} on {profile.hardware}, {len(shapes)} requests of {args.trace} per rate")
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    result = plan(manifest, profile, shapes, objective, args.cpus, args.rate, seed=args.seed,
                  min_duration_s=args.run_seconds, threads=threads, drafting=drafting)
    best = result.best
    print(f"best: {best.candidate.name} ({best.candidate.cpus} CPUs), predicted goodput {best.goodput.rate:.2f} req/s")
    close = [e for e in result.tried if e is not best and e.goodput.rate >= best.goodput.rate * (1 - NEAR_TIE)]
    if close:  # the simulator's error on a shared machine is of this order (docs/planning.md)
        print(f"within {NEAR_TIE:.0%} of it, worth measuring with `pdserve bench serve`: " +
              ", ".join(f"{e.candidate.name} ({e.goodput.rate:.2f})" for e in close))
    write_manifest(result, manifest, args.out, profile)
    print(f"wrote {args.out}")
    if args.plot:
        plot_frontier(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def add_plan_commands(sub: Any) -> None:
    def model_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--manifest", default=None, help="the manifest whose model and limits to use (default: "
                                                        "deploy/local.yaml)")
        p.add_argument("--model", default=None, help="the model (overrides the manifest's)")
        p.add_argument("--max-model-len", type=int, default=None, help="the context limit (overrides the manifest's)")
        p.add_argument("--profile", type=Path, default=None,
                       help="the profile file (default: kept beside the model cache, by model and machine)")
        p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: %(default)s)")

    pr = sub.add_parser("profile", help="measure a model's step and KV handoff costs on this machine (for plan)",
                        description="Measure prompt passes, decode steps over batch size and context, mixed steps, "
                                    "and, in a 1P+1D cluster, the KV handoff per transport and what serving adds; "
                                    "store them by model and machine for `pdserve plan`. Run it on an idle machine.",
                        **examples("pdserve profile --model llama-20m --threads 1,2",
                                   "pdserve profile --manifest my.yaml --transports shm,tcp"))
    model_options(pr)
    pr.add_argument("--threads", default="1", help="torch thread counts per worker to measure, comma-separated "
                                                   "(default: %(default)s)")
    pr.add_argument("--transports", default="shm", help="KV transports to measure, comma-separated (default: "
                                                        "%(default)s)")
    pr.set_defaults(func=_profile)

    pl = sub.add_parser("plan", help="choose the deployment for a workload and latency objectives, by simulation",
                        description="Simulate colocated and disaggregated deployments within a CPU budget on a "
                                    "trace's request lengths (the router's own placement, the profiled costs) and "
                                    "write the manifest with the best goodput; with --rate, the fewest CPUs that "
                                    "carry it. With --image-share (a vision-language model), requests carry images "
                                    "and deployments with an encode pool are tried too.",
                        **examples("pdserve plan --slo-ttft 250 --slo-tpot 30 --cpus 2 --model llama-20m",
                                   "pdserve plan --slo-ttft 500 --slo-tpot 50 --cpus 4 --rate 6 --out plan.yaml",
                                   "pdserve plan --slo-ttft 2000 --slo-tpot 100 --cpus 3 --model qwen2-vl-20m "
                                   "--image-share 0.6"))
    model_options(pl)
    pl.add_argument("--slo-ttft", type=float, required=True, help="the TTFT objective (ms)")
    pl.add_argument("--slo-tpot", type=float, required=True, help="the TPOT objective (ms)")
    pl.add_argument("--cpus", type=int, required=True, help="CPUs the deployment may use (torch threads over all "
                                                            "workers)")
    pl.add_argument("--rate", type=float, default=None, help="the request rate to carry (req/s): the fewest CPUs "
                                                             "that carry it; default: the highest goodput")
    pl.add_argument("--trace", default=DEFAULT_TRACE, help="an Azure-style CSV trace: its lengths (default: "
                                                           "%(default)s, shipped)")
    pl.add_argument("--requests", type=int, default=400, help="requests per simulated run (default: %(default)s)")
    pl.add_argument("--threads", default=None, help="torch threads per worker to consider, comma-separated "
                                                    "(default: every count the profile measured)")
    pl.add_argument("--run-seconds", type=float, default=30.0, help="arrivals in each simulated run, at least "
                                                                   "(seconds; default: %(default)s)")
    pl.add_argument("--input-scale", type=float, default=0.25, help="scale of prompt lengths (default: %(default)s)")
    pl.add_argument("--output-scale", type=float, default=0.25, help="scale of output lengths (default: %(default)s)")
    pl.add_argument("--out", type=Path, default=Path("planned.yaml"), help="the manifest to write "
                                                                         "(default: %(default)s)")
    pl.add_argument("--acceptance", type=float, default=None,
                    help="where the manifest decodes speculatively: the workload's chance that a draft token is "
                         "accepted when the one before it was (`pdserve bench spec` measures it, at the batch "
                         "size the workers will run at)")
    pl.add_argument("--draft-share", type=float, default=1.0,
                    help="with --acceptance: the share of a request's decode steps that verify a draft "
                         "(default: %(default)s)")
    pl.add_argument("--draft-length", type=float, default=None,
                    help="with --acceptance: draft tokens such a step verifies, on average (default: "
                         "max_draft_tokens)")
    pl.add_argument("--draft-model-share", type=float, default=1.0,
                    help="with --acceptance and method both: the share of the drafts that the draft model "
                         "proposed, the others the suffix proposer's (default: %(default)s)")
    pl.add_argument("--image-share", type=float, default=0.0,
                    help="for a vision-language model: the share of requests with images (1 to 3 each, of "
                         "camera-like sizes); the plan then also tries encode pools (default: %(default)s)")
    pl.add_argument("--popular-share", type=float, default=0.3,
                    help="with --image-share: the share of images drawn from a small pool of popular ones, "
                         "which an encoder's cache serves (default: %(default)s)")
    pl.add_argument("--popular-images", type=int, default=4,
                    help="with --image-share: the popular pool's size (default: %(default)s)")
    pl.add_argument("--plot", type=Path, default=None, help="also plot the goodput of every deployment tried (PNG)")
    pl.set_defaults(func=_plan)
