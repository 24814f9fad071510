"""`pdserve status`: what a running cluster is, read from its `GET /health` and printed as a table.

It asks the HTTP API's /health rather than a gRPC call: the answer is the same JSON an operator's
curl or a load balancer's probe reads (one report, one shape), /health needs no auth token, and the
gRPC API keeps to the client's calls. A cluster started with `server.http_address: null` has no
/health; `pdserve status` then says so.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TIMEOUT_S = 10.0
COLUMNS = ("POOL", "WORKER", "ROLE", "NODE", "HEALTH", "REQUESTS", "QUEUED", "KV USED")


class StatusUnavailable(ConnectionError):
    """No answer from the cluster's /health."""


def fetch_health(address: str, tls_ca: Path | None = None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The cluster's /health report (HOST:PORT of its HTTP API), serving or not."""
    context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
    url = f"{'https' if tls_ca else 'http'}://{address}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 503:  # not serving: the report says why
            return json.load(e)
        raise StatusUnavailable(f"{url} answered {e.code} {e.reason}: is this pdserve's http_address?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise StatusUnavailable(f"no pdserve cluster answers at {url} ({reason}); give its server.http_address "
                                "with --address") from None


def render(report: dict[str, Any]) -> str:
    """The report as an operator reads it: a header, then one row per worker."""
    model, state = report["model"], "serving" if report["serving"] else "NOT SERVING"
    lines = [f"{state} ({report['mode']}): model {model['name']} ({model['model_type']}, {model['dtype']}, "
             f"context {model['max_model_len']} tokens)",
             f"gRPC API {report['grpc_address']}, HTTP API {report['http_address'] or 'off'}", ""]
    rows = [COLUMNS]
    for pool in report["pools"]:
        for w in pool["workers"]:
            used = w["kv_blocks_total"] - w["kv_blocks_free"]
            rows.append((pool["name"], w["name"], w["role"], w["node"], _health(w),
                         str(w["requests"]), str(w["queued_prompts"]),
                         f"{w['kv_used']:.0%} ({used}/{w['kv_blocks_total']} blocks)" if w["kv_blocks_total"] else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if (planner := report["planner"]) is not None:
        state = f"stopped: {planner['failure']}" if planner["failure"] else \
            f"last decision {planner['action']}: {planner['reason']}" if planner["decided_at"] else "no decision yet"
        lines.append(f"\nonline planner ({planner['role_changes']} role changes, {planner['workers_added']} workers "
                     f"added, {planner['workers_removed']} removed): {state}")
    for pool in report["pools"]:
        if pool["needed"] and not pool["healthy"]:
            lines.append(f"\nno healthy worker in the {pool['name']} pool: the cluster cannot serve")
    return "\n".join(lines)


def _health(worker: dict[str, Any]) -> str:
    if not worker["healthy"]:
        return "DOWN"
    return "draining" if worker["draining"] else "healthy"
