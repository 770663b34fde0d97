"""Anthropic's Messages API (`type: anthropic`): `x-api-key`, `anthropic-version`, and its
`/v1/messages/count_tokens` counter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from gateway.config import ProviderSpec
from gateway.models import Endpoint, InBandError, Wire
from gateway.providers.decode import anthropic_error
from gateway.providers.http import CountRequest, HTTPProvider
from gateway.upstream import TokenQuery

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

    def _count_request(self, upstream_model: str, query: TokenQuery) -> CountRequest:
        return CountRequest(
            self._base + "/v1/messages/count_tokens",
            lambda: {**query.messages(), "model": upstream_model},
            "input_tokens",
            betas=True,  # a beta may change what is counted
        )
