"""Vertex AI (`type: vertex`): Gemini models (`publisher: google`, the chat wire, translated as
for the Gemini API) and Anthropic's models (`publisher: anthropic`, the Messages wire).

Requests carry an OAuth2 bearer token from `vertex_auth.TokenSource`; a 401 expires it and the
request is sent once more with a fresh one, so a token revoked or expired early costs no failure.
Each new token joins the provider's scrubber (with the one before, which may still be echoed).

URLs: `{base}/v1/projects/{project}/locations/{location}/publishers/{publisher}/models/{model}:
{method}`, `base` being `https://{location}-aiplatform.googleapis.com` (for `global`,
`https://aiplatform.googleapis.com`) unless `base_url` says otherwise. Gemini models use
`generateContent` / `streamGenerateContent?alt=sse`; Anthropic models `rawPredict` /
`streamRawPredict`, with the Messages body minus `model` plus
`anthropic_version: vertex-2023-10-16`, answering in the Messages wire unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import quote

import aiohttp
import orjson

from gateway.config import ProviderSpec
from gateway.models import Endpoint, UpstreamRequest, Wire
from gateway.providers.base import ChunkStream
from gateway.providers.gemini import GeminiProvider
from gateway.providers.http import _Body
from gateway.providers.vertex_auth import TokenSource
from gateway.scrubbing import Scrubber

VERTEX_ANTHROPIC_VERSION: Final = "vertex-2023-10-16"


class VertexGemini(GeminiProvider):
    """Gemini models on Vertex AI: the Gemini API's translation, Vertex's URLs and OAuth2."""

    system = "gcp.vertex_ai"
    publisher = "google"
    credential = "credentials_file (or the Application Default Credentials)"

    def __init__(
        self,
        name: str,
        spec: ProviderSpec,
        session: aiohttp.ClientSession,
        tokens: TokenSource | None = None,
    ) -> None:
        assert spec.project is not None and spec.location is not None  # checked by the config
        super().__init__(name, spec, session)
        self.tokens = tokens or TokenSource(spec.credentials_file)
        self._path = (
            f"{self.base}/v1/projects/{quote(spec.project, safe='')}/locations/"
            f"{quote(spec.location, safe='')}/publishers/{self.publisher}/models/"
        )
        self._seen: tuple[str, ...] = ()  # the tokens the scrubber knows

    def url(self, model: str, stream: bool) -> str:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        return f"{self._path}{quote(model, safe='@')}:{method}"

    async def auth_headers(self, deployment: str) -> dict[str, str]:
        token = await self.tokens.get(deployment)
        if token not in self._seen:
            self._seen = (token, *self._seen[:1])
            self.scrub = Scrubber.of([*self._secrets, *self._seen])
        return {"authorization": f"Bearer {token}"}

    def auth_failed(self, sent: Mapping[str, str]) -> bool:
        token = sent.get("authorization", "").removeprefix("Bearer ")
        return self.tokens.expire(token)


class VertexAnthropic(VertexGemini):
    """Anthropic's models on Vertex AI, presenting the Messages wire."""

    publisher = "anthropic"

    def __init__(
        self,
        name: str,
        spec: ProviderSpec,
        session: aiohttp.ClientSession,
        tokens: TokenSource | None = None,
    ) -> None:
        super().__init__(name, spec, session, tokens)
        self.wire: Wire = "anthropic"

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint == "messages"

    def url(self, model: str, stream: bool) -> str:
        method = "streamRawPredict" if stream else "rawPredict"
        return f"{self._path}{quote(model, safe='@')}:{method}"

    async def open(self, deployment: str, request: UpstreamRequest) -> ChunkStream:
        body = orjson.loads(request.body)
        model = str(body.pop("model", ""))
        body["anthropic_version"] = VERTEX_ANTHROPIC_VERSION
        accept = "text/event-stream" if request.stream else "application/json"
        response = await self.post(
            deployment, self.url(model, request.stream), orjson.dumps(body), request, accept
        )
        reader = _Body(response)
        return ChunkStream(
            deployment=deployment,
            wire="anthropic",
            streaming=request.stream,
            read=reader.read_stream if request.stream else reader.read,
            close=reader.close,
            translate=lambda exc: self.error(deployment, exc),
            scrub=self.scrub,
            status=response.status,
            upstream_request_id=response.headers.get("request-id")
            or response.headers.get("x-request-id"),
        )
