"""Anthropic's Messages API (`type: anthropic`): `x-api-key`, `anthropic-version`, and its
`/v1/messages/count_tokens` counter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gateway.config import ProviderSpec
from gateway.models import Endpoint, InBandError, Wire
from gateway.providers.count import http_counter
from gateway.providers.decode import anthropic_error
from gateway.providers.http import HTTPProvider
from gateway.upstream import Counter, TokenQuery

PATHS: Final[Mapping[Endpoint, str]] = {"messages": "/v1/messages"}


class AnthropicProvider(HTTPProvider):
    """Anthropic's API, or one that speaks its Messages wire."""

    wire: Wire = "anthropic"
    system = "anthropic"
    paths = PATHS

    def _auth_headers(self, spec: ProviderSpec, key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": spec.anthropic_version}
        return headers | {"x-api-key": key} if key else headers

    def _inband_error(self, body: bytes) -> InBandError | None:
        return anthropic_error(body, scrub=self.scrub)

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter:
        return http_counter(
            self,
            self._spec,
            deployment,
            self._base + "/v1/messages/count_tokens",
            lambda: {**query.messages(), "model": upstream_model},
            "input_tokens",
            headers,  # its betas too: a beta may change what is counted
            query.size,
        )
