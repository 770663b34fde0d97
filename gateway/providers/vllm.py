"""vLLM's OpenAI-compatible server (`type: vllm`): the OpenAI adapter, with vLLM's `/tokenize`
as its counter and, with `bulk_priority`, bulk requests sent at a lower priority (see
`providers.request`). What its `/metrics` page says is read by `gateway.latency.vllm`."""

from __future__ import annotations

from gateway.latency.vllm import beside_v1
from gateway.providers.http import CountRequest
from gateway.providers.openai import OpenAIProvider
from gateway.upstream import TokenQuery


class VLLMProvider(OpenAIProvider):
    """A vLLM server; it counts a chat request's tokens with the model's own tokenizer."""

    system = "vllm"

    def _count_request(self, upstream_model: str, query: TokenQuery) -> CountRequest:
        return CountRequest(
            beside_v1(self._base, "/tokenize"),
            lambda: {"model": upstream_model, **query.chat()},
            "count",
        )
