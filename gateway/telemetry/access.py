"""The access log: one JSON line per LLM request on the `tailguard.access` logger, no bodies."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

_log = logging.getLogger("tailguard.access")


class AccessLog:
    """Writes when the `tailguard.access` logger is enabled for INFO (see `server.access_log`)."""

    def __init__(self, enabled: bool = True) -> None:
        _log.disabled = not enabled

    @property
    def enabled(self) -> bool:
        return not _log.disabled and _log.isEnabledFor(logging.INFO)

    def write(self, fields: dict[str, Any]) -> None:
        _log.info(orjson.dumps(fields).decode())


def configure_logging(level: str = "info") -> None:
    """Logging for a serving process: access lines as bare JSON on stdout; the gateway's other
    messages at `level` on stderr. Call once, before the app starts."""
    access = logging.StreamHandler(sys.stdout)
    access.setFormatter(logging.Formatter("%(message)s"))
    _log.handlers[:] = [access]
    _log.setLevel(logging.INFO)
    _log.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("tailguard", "gateway"):  # the app's logger and the modules' (`gateway.latency`)
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
