"""Run inside a network namespace by test_netns.py: start a pdserve cluster on the Ray cluster the test
built, send the prompts, print what came back (and where each worker ran) as one JSON line, stop.

stdin: {"manifest": {...}, "prompts": [[ids...], ...], "max_tokens": N}
"""

from __future__ import annotations

import json
import sys

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest


def main() -> None:
    job = json.load(sys.stdin)
    with Cluster(load_manifest(job["manifest"]), log=lambda s: print(s, file=sys.stderr)) as cluster:
        with Client(cluster.address, timeout=120) as client:
            outputs = [client.generate(p, max_tokens=job["max_tokens"], temperature=0, ignore_eos=True).token_ids
                       for p in job["prompts"]]
        idle, status = cluster.wait_idle(10.0)  # fresh health reports, the transfers' figures in them
        workers = {w.name: {"pool": w.pool, "node_ip": s.node_ip, "kv_addresses": s.kv_addresses,
                            "metrics": s.metrics}
                   for w, s in zip(cluster.workers, status)}
    print(json.dumps({"outputs": outputs, "workers": workers, "idle": idle}))


if __name__ == "__main__":
    main()
