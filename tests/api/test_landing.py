"""`GET /` in a browser finds its way: a small HTML page linking to the dashboard, the models,
the OpenAPI document and the docs; `/docs` leads there; `/openapi.json` is served."""

from __future__ import annotations

import re

import httpx

from tests.conftest import Upstream, one_model, run_gateway


async def test_root_is_a_landing_page_whose_links_answer(upstream: Upstream) -> None:
    async with run_gateway(one_model(upstream.base_url)) as gw, httpx.AsyncClient() as client:
        root = await client.get(gw.url + "/")
        assert root.status_code == 200
        assert root.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in root.headers["content-security-policy"]
        links = re.findall(r'href="([^"]+)"', root.text)
        local = [link for link in links if link.startswith("/")]
        assert {"/dashboard", "/v1/models", "/openapi.json"} <= set(local)
        assert any("make docs-serve" in line for line in root.text.splitlines())
        assert "<script" not in root.text and "https://" not in root.text
        for link in local:  # every link the page offers answers
            assert (await client.get(gw.url + link)).status_code == 200, link
        models = (await client.get(gw.url + "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m"]
        document = (await client.get(gw.url + "/openapi.json")).json()
        assert document["openapi"].startswith("3.") and "/v1/chat/completions" in document["paths"]
        assert "/" not in document["paths"] and "/docs" not in document["paths"]


async def test_docs_leads_to_the_landing_page(upstream: Upstream) -> None:
    async with run_gateway(one_model(upstream.base_url)) as gw, httpx.AsyncClient() as client:
        for path in ("/docs", "/redoc"):
            moved = await client.get(gw.url + path)
            assert (moved.status_code, moved.headers["location"]) == (307, "/")
        landed = await client.get(gw.url + "/docs", follow_redirects=True)
        assert landed.status_code == 200 and "Tailguard" in landed.text
        assert (await client.post(gw.url + "/")).status_code == 405
