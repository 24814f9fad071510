"""The `pdserve` command line. The runtime's commands are here; the benchmarks' (`bench ...`, `soak`) come
from `cluster/bench/cli.py`."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from pathlib import Path

# Before anything loads gRPC (the commands' own imports do; this module's must not): this process
# starts Ray's processes, and Ray forks them (fork, then exec) while the router's gRPC threads may run;
# gRPC's fork handlers, which only a child that goes on using gRPC needs, then log "skipping fork()
# handlers" for each, and can hang the fork. A value the user set stands.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from pdserve.cluster.bench.cli import add_commands as add_bench_commands  # noqa: E402
from pdserve.cluster.plan.cli import add_plan_commands  # noqa: E402
from pdserve.cluster.cli_help import examples  # noqa: E402
from pdserve.cluster.overrides import add_override_options  # noqa: E402

# The default model learnt Python from the standard library: it continues code best.
DEMO_PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for line in lines:\n",
    "# Return the number of",
    '"""Utilities for working with',
]


def _make_model(args: argparse.Namespace) -> int:
    from pdserve.engine.models.presets import PRESETS, make_model

    if args.list or not args.preset:
        for name, preset in PRESETS.items():
            print(f"{name:14} {preset.model_type:8} {preset.description}")
        return 0
    out = make_model(args.preset, args.dir or Path(args.preset), seed=args.seed)
    print(f"wrote {args.preset} (seed {args.seed}) to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """A local cluster on the default manifest, a few real requests streamed through the SDK."""
    import concurrent.futures
    import statistics

    from pdserve.cluster.launcher import Cluster
    from pdserve.cluster.manifest import load_manifest
    from pdserve.client import Client
    from pdserve.diagnostics import configure_diagnostics

    manifest = load_manifest(args.manifest)
    configure_diagnostics(manifest.log_level)
    # Any free ports: the demo must not clash with a running server.
    manifest.server.address, manifest.server.http_address = "127.0.0.1:0", "127.0.0.1:0"
    with Cluster(manifest) as cluster, Client(cluster.address, timeout=120, token=manifest.server.token) as client:
        print(f"\nstreaming {len(DEMO_PROMPTS)} concurrent requests to {cluster.address} ...\n")
        first = DEMO_PROMPTS[0]
        print(f"[stream] {first!r} -> ", end="", flush=True)
        for chunk in client.generate(first, stream=True, temperature=0.7, top_p=0.9, seed=0,
                                     max_tokens=args.max_tokens):
            print(chunk.text_delta, end="", flush=True)
        print()
        with concurrent.futures.ThreadPoolExecutor(len(DEMO_PROMPTS)) as pool:
            results = list(pool.map(lambda ip: client.generate(ip[1], temperature=0.7, top_p=0.9, seed=ip[0],
                                                               max_tokens=args.max_tokens), enumerate(DEMO_PROMPTS)))
        for prompt, r in zip(DEMO_PROMPTS, results):
            t = r.timings
            print(f"\n{prompt!r} -> {r.text!r}\n    {len(r.token_ids)} tokens, finish={r.finish_reason}; "
                  f"ttft {t['ttft'] * 1e3:.0f} ms = queue {t['queued'] * 1e3:.0f} + prefill {t['prefill'] * 1e3:.0f}"
                  f" (+ kv transfer {t['kv_transfer'] * 1e3:.1f} before decode), e2e {t['e2e'] * 1e3:.0f} ms")
        ttft = statistics.median(r.timings["ttft"] for r in results) * 1e3
        e2e = statistics.median(r.timings["e2e"] for r in results) * 1e3
        tpot = statistics.median((r.timings["e2e"] - r.timings["ttft"]) / max(1, len(r.token_ids) - 1)
                                 for r in results) * 1e3
        print(f"\nlatency summary ({manifest.mode}, {len(results)} requests): median TTFT {ttft:.0f} ms, "
              f"median TPOT {tpot:.1f} ms, median e2e {e2e:.0f} ms")
        _demo_http(cluster.http_address, manifest.served_name, args.max_tokens, manifest.server.token,
                   manifest.server.tls_cert)
    print("cluster stopped")
    return 0


def _demo_http(address: str, model: str, max_tokens: int, token: str | None, tls_cert: Path | None) -> None:
    """One chat completion over the OpenAI-compatible HTTP API, and a look at /metrics."""
    import json
    import ssl
    import urllib.request

    # With TLS the demo trusts the server's own certificate (a self-signed one, as a local manifest has).
    context = ssl.create_default_context(cafile=str(tls_cert)) if tls_cert else None
    base = f"{'https' if tls_cert else 'http'}://{address}"
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": DEMO_PROMPTS[0]}]}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    print(f"\nPOST {base}/v1/chat/completions ...")
    request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120, context=context) as resp:
        reply = json.load(resp)
    print(f"  -> {reply['choices'][0]['message']['content']!r} (finish={reply['choices'][0]['finish_reason']}, "
          f"usage {reply['usage']})")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30, context=context) as resp:
        lines = resp.read().decode().splitlines()
    completed = [line for line in lines if line.startswith("pdserve_requests_total{") and 'code="OK"' in line]
    print(f"GET {base}/metrics: {len(lines)} lines; completed requests: "
          + ", ".join(line.split("{", 1)[1] for line in completed))


def _up(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from pdserve.cluster.launcher import Cluster
    from pdserve.cluster.manifest import load_manifest
    from pdserve.cluster.overrides import ManifestOverrides
    from pdserve.diagnostics import configure_diagnostics

    # A bad manifest, or a bad override, fails here, before anything starts.
    manifest = load_manifest(args.manifest, ManifestOverrides.from_args(args))
    configure_diagnostics(manifest.log_level)
    lifetime = logging.getLogger("pdserve.lifetime")  # one JSON line per finished request, apart from diagnostics
    lifetime.setLevel(logging.INFO)
    lifetime.addHandler(logging.FileHandler(args.lifetime_log) if args.lifetime_log else logging.StreamHandler())
    stop = threading.Event()

    def interrupt_once(*_: object) -> None:
        # While starting, Ctrl-C or a SIGTERM interrupts the start, which stops what it started; a
        # second one must not cut that short.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt_once)
    cluster = Cluster(manifest)
    try:
        address = cluster.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"ready: pdserve generate --address {address} \"hello\"   (Ctrl-C stops the cluster)", flush=True)
        if cluster.http_address:
            base = f"{'https' if manifest.server.tls_cert else 'http'}://{cluster.http_address}"
            print(f"ready: OpenAI API at {base}/v1, metrics at {base}/metrics; pdserve status --address "
                  f"{cluster.http_address}{' --tls-ca CA.pem' if manifest.server.tls_cert else ''}", flush=True)
        stop.wait()
    finally:
        print("shutting down ...", flush=True)
        cluster.stop()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdserve.client import Client, PDServeError

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    pem = {name: path.read_bytes() if path else None for name, path in
           (("root_certificates", args.tls_ca), ("client_cert", args.client_cert), ("client_key", args.client_key))}
    try:
        with Client(args.address, timeout=args.timeout, token=args.token, **pem) as client:
            if args.stream:
                for chunk in client.generate(args.prompt, stream=True, **params):
                    print(chunk.text_delta, end="", flush=True)
                print()
            else:
                r = client.generate(args.prompt, **params)
                print(r.text)
                print(f"[{len(r.token_ids)} tokens, finish={r.finish_reason}, ttft {r.timings['ttft'] * 1e3:.0f} ms, "
                      f"e2e {r.timings['e2e'] * 1e3:.0f} ms]", file=sys.stderr)
    except PDServeError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    import json

    from pdserve.cluster.status import fetch_health, render

    report = fetch_health(args.address, args.tls_ca)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["serving"] else 1


def _workers(args: argparse.Namespace) -> int:
    import json

    from pdserve.cluster.pool_client import change

    calls = {"add": ("POST", "", {"role": args.target}), "role": ("POST", f"/{args.target}/role", {"role": args.role}),
             "drain": ("POST", f"/{args.target}/drain", None), "reopen": ("POST", f"/{args.target}/reopen", None),
             "remove": ("DELETE", f"/{args.target}", None)}
    if args.action == "role" and args.role is None:
        raise ValueError("pdserve workers role NAME ROLE: say the role (prefill or decode)")
    method, path, body = calls[args.action]
    print(json.dumps(change(args.address, method, path, args.token, body, args.tls_ca), indent=2))
    return 0


def _train_model(args: argparse.Namespace) -> int:
    from pdserve.engine.models.presets import CHECKPOINTS
    from pdserve.engine.models.training import TrainConfig, train
    from pdserve.kv_transfer.codecs.cachegen_profile import profile_cachegen

    out = args.dir or CHECKPOINTS / "pystd-llama"
    train(TrainConfig(steps=args.steps, threads=args.threads), out)
    print(f"profiling the cachegen codec's tables: {profile_cachegen(out)}")
    return 0


def _train_draft(args: argparse.Namespace) -> int:
    from pdserve.engine.models.draft_training import DraftConfig, train_draft
    from pdserve.engine.models.presets import CHECKPOINTS, resolve_model

    if args.dir is None and args.target != "pystd-llama":
        raise SystemExit("pdserve train-draft: give the output directory (the shipped draft's is pystd-llama's)")
    out = args.dir or CHECKPOINTS / "pystd-llama-draft"
    train_draft(resolve_model(args.target), DraftConfig(steps=args.steps, threads=args.threads), out)
    return 0


def _kv_profile(args: argparse.Namespace) -> int:
    from pdserve.engine.models.presets import resolve_model
    from pdserve.kv_transfer.codecs.cachegen_profile import profile_cachegen

    print(f"wrote {profile_cachegen(resolve_model(args.model), num_tokens=args.tokens)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode serving of language models on Ray: start a "
                                    "cluster from a manifest, send it requests, build models, run the benchmarks.",
        **examples("pdserve demo                                   # a local cluster, a few requests, then stop",
                   "pdserve up deploy/local.yaml                   # serve until Ctrl-C",
                   'pdserve generate "def main():" --stream        # one request to a running cluster',
                   "pdserve COMMAND --help                         # each command's options and examples"))
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('pdserve')}",
                        help="print pdserve's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mk = sub.add_parser("make-model", help="build a small random-weight model from a preset",
                        description="Write a preset's checkpoint (config, safetensors, tokenizer) into a directory: "
                                    "random weights, for tests and benchmarks. A manifest's `model` takes the preset's "
                                    "name directly, so this is needed only to keep a copy.",
                        **examples("pdserve make-model --list", "pdserve make-model llama-20m /tmp/llama-20m --seed 1"))
    mk.add_argument("preset", nargs="?", help="preset name (see --list)")
    mk.add_argument("dir", nargs="?", type=Path, help="output directory (default: ./PRESET)")
    mk.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    mk.add_argument("--list", action="store_true", help="list the presets")
    mk.set_defaults(func=_make_model)

    tm = sub.add_parser("train-model", help="train the shipped model (pystd-llama) again, on the Python standard "
                                           "library's source, then profile its cachegen tables (~25 min, 2 cores)",
                        description="Train pystd-llama again on the Python standard library's source, then profile "
                                    "its cachegen codec's tables. About 25 minutes on 2 cores.",
                        **examples("pdserve train-model /tmp/pystd-llama --steps 200   # a shorter run, elsewhere"))
    tm.add_argument("dir", nargs="?", type=Path, help="output directory (default: the shipped checkpoint's)")
    tm.add_argument("--steps", type=int, default=1000, help="training steps (default: %(default)s)")
    tm.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    tm.set_defaults(func=_train_model)

    td = sub.add_parser("train-draft", help="distil the shipped draft model (pystd-llama-draft) from its target again, "
                                           "for speculative decoding (~10 min, 2 cores)",
                        description="Distil a one-layer draft model from a target (its embeddings, first layer and "
                                    "head, trained to match its next-token distribution on the Python standard "
                                    "library's source). About 10 minutes on 2 cores.",
                        **examples("pdserve train-draft /tmp/pystd-llama-draft --steps 100   # a shorter run"))
    td.add_argument("dir", nargs="?", type=Path, help="output directory (default, for pystd-llama only: the shipped "
                                                      "draft's)")
    td.add_argument("--target", default="pystd-llama", help="the model it drafts for (default: %(default)s)")
    td.add_argument("--steps", type=int, default=600, help="training steps (default: %(default)s)")
    td.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    td.set_defaults(func=_train_draft)

    kp = sub.add_parser("kv-profile", help="profile the cachegen codec's tables for a model (written into its "
                                           "directory)",
                        description="Profile the cachegen KV codec's tables for a model and write them into its "
                                    "directory; both pools must then hold the same tables.",
                        **examples("pdserve kv-profile /models/my-llama",
                                   "pdserve kv-profile llama-20m --tokens 16384"))
    kp.add_argument("model", help="model directory or preset name")
    kp.add_argument("--tokens", type=int, default=65536, help="calibration tokens (default: %(default)s)")
    kp.set_defaults(func=_kv_profile)

    demo = sub.add_parser("demo", help="start a local cluster, stream a few real requests, print them, stop",
                          description="Start a local cluster from a manifest (on free ports), stream a few requests "
                                      "through the gRPC API, send one chat completion over the OpenAI HTTP API, read "
                                      "/metrics, and stop.",
                          **examples("pdserve demo", "pdserve demo --manifest deploy/colocated.yaml --max-tokens 16"))
    demo.add_argument("--manifest", default=None, help="manifest (default: deploy/local.yaml)")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: %(default)s)")
    demo.set_defaults(func=_demo)

    up = sub.add_parser("up", help="start (or join) a cluster from a manifest and serve until interrupted",
                        description="Start a cluster from a manifest (or join one, with ray.address: auto) and serve "
                                    "the gRPC and OpenAI HTTP APIs until Ctrl-C or SIGTERM; then stop everything it "
                                    "started. Every manifest field: docs/configuration-reference.md.",
                        **examples("pdserve up                                      # deploy/local.yaml",
                                   "pdserve up deploy/2p4d.yaml                     # on a Ray cluster's head node",
                                   "pdserve up my.yaml --lifetime-log lifetimes.jsonl",
                                   "pdserve up --model Qwen/Qwen2.5-0.5B-Instruct --decode-replicas 2",
                                   "pdserve up my.yaml --http-address 0.0.0.0:8000 --served-model-name my-model"))
    up.add_argument("manifest", nargs="?", default=None, help="manifest (default: deploy/local.yaml)")
    up.add_argument("--lifetime-log", type=Path, default=None, metavar="FILE",
                    help="write each request's lifetime (one JSON line per request) here instead of stderr")
    add_override_options(up)
    up.set_defaults(func=_up)

    gen = sub.add_parser("generate", help="send one request to a running cluster",
                         description="Send one request to a running cluster over gRPC and print the text (with "
                                     "--stream, as it arrives).",
                         **examples('pdserve generate "def read_config(path):" --stream --temperature 0',
                                    'pdserve generate "import os" --address 10.0.0.5:50051 --token "$TOKEN" '
                                    "--tls-ca ca.pem"))
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC address (default: %(default)s)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed: the same tokens for the same seed")
    gen.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up (default: %(default)s)")
    gen.add_argument("--token", default=None, help="auth token, when the server requires one")
    gen.add_argument("--tls-ca", type=Path, default=None,
                     help="PEM of the CA that signed the server's certificate: connect over TLS")
    gen.add_argument("--client-cert", type=Path, default=None,
                     help="PEM client certificate, when the server requires mutual TLS (with --client-key)")
    gen.add_argument("--client-key", type=Path, default=None, help="PEM private key of --client-cert")
    gen.set_defaults(func=_generate)

    st = sub.add_parser("status", help="show a running cluster: its model, addresses, pools and workers",
                        description="Show a running cluster as its /health answers: the model, the gRPC and HTTP "
                                    "addresses, and each worker's pool, role, node, health, requests, queued prompts "
                                    "and KV use. Exits 0 while the cluster serves, 1 when it cannot (no healthy "
                                    "worker in a pool it needs) or nothing answers.",
                        **examples("pdserve status                                  # 127.0.0.1:8000",
                                   "pdserve status --address 10.0.0.5:8000 --json",
                                   "pdserve status --address 10.0.0.5:8443 --tls-ca ca.pem"))
    st.add_argument("--address", default="127.0.0.1:8000",
                    help="the cluster's HTTP API, its manifest's server.http_address (default: %(default)s)")
    st.add_argument("--tls-ca", type=Path, default=None,
                    help="PEM of the CA that signed the server's certificate: ask over HTTPS")
    st.add_argument("--json", action="store_true", help="print /health's JSON answer as it is")
    st.set_defaults(func=_status)

    wk = sub.add_parser("workers", help="reshape a running cluster: add a worker, switch one's role, drain, reopen "
                                        "or remove one",
                        description="Change a running cluster's pools through its HTTP API's admin routes (they need "
                                    "the manifest's server.admin_token). Draining moves every request a worker decodes "
                                    "to the other decode workers with its KV, so nothing is dropped or repeated; "
                                    "role and remove drain first. Each command waits until its change is done and "
                                    "prints the cluster's answer.",
                        **examples("pdserve workers add decode --token $ADMIN_TOKEN",
                                   "pdserve workers role decode-2 prefill --token $ADMIN_TOKEN",
                                   "pdserve workers drain decode-1 --token $ADMIN_TOKEN   # out of placement, streams moved",
                                   "pdserve workers reopen decode-1 --token $ADMIN_TOKEN",
                                   "pdserve workers remove decode-1 --token $ADMIN_TOKEN"))
    wk.add_argument("action", choices=["add", "role", "drain", "reopen", "remove"], help="what to do")
    wk.add_argument("target", help="add: the new worker's role (prefill or decode); else the worker's name")
    wk.add_argument("role", nargs="?", default=None, help="role: the worker's new role (prefill or decode)")
    wk.add_argument("--address", default="127.0.0.1:8000",
                    help="the cluster's HTTP API, its manifest's server.http_address (default: %(default)s)")
    wk.add_argument("--token", default=None, help="the manifest's server.admin_token")
    wk.add_argument("--tls-ca", type=Path, default=None,
                    help="PEM of the CA that signed the server's certificate: ask over HTTPS")
    wk.set_defaults(func=_workers)

    add_bench_commands(sub)
    add_plan_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: say what is wrong, no traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, ConnectionError) as e:  # workers that never came up, a Ray cluster not there
        print(f"pdserve: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
