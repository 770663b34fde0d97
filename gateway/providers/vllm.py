"""vLLM's OpenAI-compatible server (`type: vllm`): the OpenAI adapter, with vLLM's `/tokenize`
as its counter and, with `bulk_priority`, bulk requests sent at a lower priority (see
`providers.request`). What its `/metrics` page says is read by `gateway.latency.vllm`."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from gateway.providers.count import http_counter
from gateway.providers.openai import OpenAIProvider, without_betas
from gateway.upstream import Counter, TokenQuery


def tokenize_url(base_url: str) -> str:
    """vLLM serves `/tokenize` at the root, beside `/v1`."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urlunsplit((parts.scheme, parts.netloc, path + "/tokenize", "", ""))


class VLLMProvider(OpenAIProvider):
    """A vLLM server; it counts a chat request's tokens with the model's own tokenizer."""

    system = "vllm"

    def counter(
        self, deployment: str, upstream_model: str, query: TokenQuery, headers: Mapping[str, str]
    ) -> Counter:
        return http_counter(
            self,
            self._spec,
            deployment,
            tokenize_url(self._base),
            lambda: {"model": upstream_model, **query.chat()},
            "count",
            without_betas(headers),
            query.size,
        )
