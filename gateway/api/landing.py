"""`GET /`: a small page that says what answers here and where to look next (the dashboard,
the models, the OpenAPI document, the docs), so that a browser pointed at the gateway finds its
way instead of a JSON 404. `/docs` and `/redoc` (where other frameworks serve API docs) lead
here too: the gateway serves no documentation UI, which would load scripts from elsewhere."""

from __future__ import annotations

from html import escape

from fastapi import FastAPI
from starlette.responses import RedirectResponse, Response

from gateway import __version__

LINKS = (
    (
        "/dashboard",
        "Dashboard",
        "SLO attainment, percentiles against the budget, hedges and "
        "fallbacks, live (an admin key when keys are configured).",
    ),
    ("/v1/models", "Models", "The model names this gateway serves (OpenAI's list format)."),
    (
        "/openapi.json",
        "OpenAPI document",
        "Every endpoint, header and error, for clients and code generators.",
    ),
    ("/metrics", "Metrics", "Prometheus exposition."),
    ("/readyz", "Readiness", "Providers, stores and the config in force."),
)
DOCS_SERVE_URL = "http://127.0.0.1:8000/"  # where `make docs-serve` serves the docs site


def page() -> bytes:
    """The landing page: the version and the links. Nothing is loaded from elsewhere."""
    items = "\n".join(
        f'<li><a href="{href}">{escape(title)}</a> <code>{href}</code> — {escape(text)}</li>'
        for href, title, text in LINKS
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tailguard {escape(__version__)}</title>
<style>
body {{ font: 16px/1.5 system-ui, sans-serif; max-width: 46rem; margin: 2rem auto;
  padding: 0 1rem; color: #1f2328; }}
code {{ background: #f3f4f6; padding: 0 .25rem; border-radius: 3px; }}
li {{ margin: .4rem 0; }}
</style></head>
<body>
<h1>Tailguard {escape(__version__)}</h1>
<p>A latency-aware LLM API gateway. Point an OpenAI SDK at <code>/v1</code>, an Anthropic SDK at
<code>/</code> (<code>/v1/messages</code>).</p>
<ul>
{items}
<li><a href="{DOCS_SERVE_URL}">Documentation</a> — the repository's <code>docs/</code>, served
at {DOCS_SERVE_URL} by <code>make docs-serve</code> (or built into <code>site/</code> by
<code>make docs</code>).</li>
</ul>
</body></html>
""".encode()


def add_landing_routes(app: FastAPI) -> None:
    body = page()

    @app.get("/", include_in_schema=False)
    async def landing() -> Response:
        return Response(
            body,
            media_type="text/html; charset=utf-8",
            headers={
                "cache-control": "no-cache",
                "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'",
            },
        )

    for path in ("/docs", "/redoc"):

        @app.get(path, include_in_schema=False)
        async def to_landing() -> Response:
            return RedirectResponse("/", status_code=307)
