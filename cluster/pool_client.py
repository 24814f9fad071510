"""`pdserve workers ...`: reshape a running cluster's pools through its HTTP API's admin routes
(`router.pool_admin`): add a worker, switch one's role, drain, reopen or remove one.

Each call waits for its change to be done (a worker started and measured, or drained of what it
decodes) and prints the cluster's answer as JSON.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.cluster.status import StatusUnavailable

TIMEOUT_S = 3600.0  # a change waits for workers to drain, start (model load) and measure themselves


class AdminRefused(ValueError):
    """The cluster refused the change (a bad name or role, no auth token, another change under way);
    the message is its answer."""


def change(address: str, method: str, path: str, token: str | None, body: dict[str, Any] | None = None,
           tls_ca: Path | None = None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Make one admin call (`path` under /admin/workers) and return the cluster's JSON answer."""
    context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
    url = f"{'https' if tls_ca else 'http'}://{address}/admin/workers{path}"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise AdminRefused(f"{e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise StatusUnavailable(f"no pdserve cluster answers at {url} ({reason}); give its server.http_address "
                                "with --address") from None
