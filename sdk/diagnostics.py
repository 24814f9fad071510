"""pdserve's diagnostics: Python logging under the `pdserve` logger, at one level and in one format in
the launcher, the router and every worker. Lifetime events (`pdserve.lifetime`, one JSON line per
request) are kept apart: they have their own handler (`pdserve up --lifetime-log`) and never mix into
the diagnostics.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error"]
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def shown(value: object, limit: int = 80) -> str:
    """A peer's value for a log line or an error message: its repr (control characters such as a newline
    escaped, so it cannot forge a line), cut to about `limit` characters (a message stays readable, and
    a gRPC status's message travels in a header of at most 16 KiB)."""
    if isinstance(value, int) and value.bit_length() > 256:  # repr fails past 4300 digits
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > limit:  # (no repr of all of a huge value)
        return f"{repr(value[:limit])[:limit]}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _DiagnosticsHandler(logging.StreamHandler):
    """The handler `configure_diagnostics` installs (found again by its type: configuring twice adds none)."""


def configure_diagnostics(level: LogLevel) -> None:
    """pdserve's diagnostics at `level` and above to stderr: in `pdserve up`, its console; in a worker,
    Ray's `worker-*.err` on that node, which Ray also forwards to the console of `pdserve up`."""
    logger = logging.getLogger("pdserve")
    logger.setLevel(level.upper())
    if not any(isinstance(h, _DiagnosticsHandler) for h in logger.handlers):
        handler = _DiagnosticsHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    logging.getLogger("pdserve.lifetime").propagate = False
