"""vLLM's OpenAI-compatible server (`type: vllm`): the OpenAI adapter, with vLLM's `/tokenize`
as its counter and, with `bulk_priority`, bulk requests sent at a lower priority (see
`providers.request`). What its `/metrics` page says is read by `gateway.latency.vllm`."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.latency.vllm import beside_v1
from gateway.providers.count import http_counter
from gateway.providers.openai import OpenAIProvider, without_betas
from gateway.upstream import Counter, TokenQuery


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
            beside_v1(self._base, "/tokenize"),
            lambda: {"model": upstream_model, **query.chat()},
            "count",
            without_betas(headers),
            query.size,
        )
