"""OpenAI-compatible upstreams (`type: openai`): the chat, completions and embeddings APIs, and
a native Responses API with `responses: native`, authenticated with a bearer `api_key`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gateway.config import ProviderSpec
from gateway.models import Endpoint, InBandError, Wire
from gateway.providers.count import http_counter
from gateway.providers.decode import openai_error
from gateway.providers.http import HTTPProvider, Session
from gateway.upstream import Counter, TokenQuery

PATHS: Final[Mapping[Endpoint, str]] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "embeddings": "/embeddings",
}


def without_betas(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's forwarded headers less Anthropic's betas, which other counters do not take."""
    return {k: v for k, v in headers.items() if k != "anthropic-beta"}


class OpenAIProvider(HTTPProvider):
    """An OpenAI-compatible API; its counter is a native Responses API's `input_tokens`."""

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

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter | None:
        if "responses" not in self._urls:
            return None  # chat completions have no counter
        return http_counter(
            self,
            self._spec,
            deployment,
            self._base + "/responses/input_tokens",
            lambda: {**query.responses(), "model": upstream_model},
            "input_tokens",
            without_betas(headers),
            query.size,
        )
