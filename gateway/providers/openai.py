"""OpenAI-compatible upstreams (`type: openai`): the chat, completions and embeddings APIs, and
a native Responses API with `responses: native`, authenticated with a bearer `api_key`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gateway.config import ProviderSpec
from gateway.models import Endpoint, InBandError, Wire
from gateway.providers.decode import openai_error
from gateway.providers.http import CountRequest, HTTPProvider, Session
from gateway.upstream import TokenQuery

PATHS: Final[Mapping[Endpoint, str]] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "embeddings": "/embeddings",
}


class OpenAIProvider(HTTPProvider):
    """An OpenAI-compatible API; with `responses: native`, its Responses API's `input_tokens`
    is its token counter."""

    wire: Wire = "openai"
    system = "openai"
    paths = PATHS

    def __init__(self, name: str, spec: ProviderSpec, session: Session) -> None:
        super().__init__(name, spec, session)
        if spec.responses == "native":
            self._urls["responses"] = self._base + "/responses"

    def _auth_headers(self, spec: ProviderSpec, key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"} if key else {}

    def _inband_error(self, body: bytes) -> InBandError | None:
        return openai_error(body, scrub=self.scrub)

    def _count_request(self, upstream_model: str, query: TokenQuery) -> CountRequest | None:
        if "responses" not in self._urls:
            return None  # chat completions have no counter
        return CountRequest(
            self._base + "/responses/input_tokens",
            lambda: {**query.responses(), "model": upstream_model},
            "input_tokens",
        )
