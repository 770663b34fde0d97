"""The HTTP edge: the only room that speaks HTTP and imports the web framework.

Modules: `app` (factory, lifespan, the routes the framework serves), `edge` (the ASGI entry,
the request context, the LLM endpoints' journey), `admit` (authentication, admission, key caps
and rate-limit charge, the request's headers and budget), `relay` (the race to a committed
attempt and the response), `outcome` (one record per request: meters, trace, access line,
limiter settle, SLO verdicts), `render` (the one error renderer). This package exports what the
other rooms and the CLI use.
"""

from gateway.api.admit import (
    PRIORITY_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    TOTAL_BUDGET_HEADER,
    TTFT_BUDGET_HEADER,
)
from gateway.api.app import create_app, create_app_from_env, tune_gc
from gateway.api.edge import LLM_ROUTES

__all__ = [
    "LLM_ROUTES",
    "PRIORITY_HEADER",
    "SLO_TPOT_HEADER",
    "SLO_TTFT_HEADER",
    "TOTAL_BUDGET_HEADER",
    "TTFT_BUDGET_HEADER",
    "create_app",
    "create_app_from_env",
    "tune_gc",
]
