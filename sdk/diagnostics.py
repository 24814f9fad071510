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
