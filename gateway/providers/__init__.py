"""Upstream adapters: one per upstream API, behind the `Provider` seam (`gateway.upstream`)."""

from __future__ import annotations

from contextlib import AsyncExitStack

from gateway.config import ProviderSpec, Settings
from gateway.models import Endpoint
from gateway.upstream import Provider


async def open_providers(settings: Settings, stack: AsyncExitStack) -> dict[str, Provider]:
    """Build every configured provider; their connection pools close when `stack` does."""
    from gateway.providers.anthropic import AnthropicProvider
    from gateway.providers.http import make_session
    from gateway.providers.openai import OpenAIProvider
    from gateway.providers.simulated import SimulatedProvider
    from gateway.providers.vllm import VLLMProvider

    over_http = {"openai": OpenAIProvider, "vllm": VLLMProvider, "anthropic": AnthropicProvider}

    providers: dict[str, Provider] = {}
    for name, spec in settings.providers.items():
        if spec.type == "simulated":
            providers[name] = SimulatedProvider(name, spec)
        elif spec.type == "azure":
            from gateway.providers.azure import AzureProvider

            session = make_session(spec)
            stack.push_async_callback(session.close)
            providers[name] = AzureProvider(name, spec, session)
        elif spec.type == "bedrock":
            from gateway.providers.bedrock import BedrockProvider

            session = make_session(spec)
            stack.push_async_callback(session.close)
            providers[name] = BedrockProvider(name, spec, session)
        elif spec.type in ("gemini", "vertex"):
            providers[name] = _google(name, spec, stack)
        else:
            session = make_session(spec)
            stack.push_async_callback(session.close)
            providers[name] = over_http[spec.type](name, spec, session)
    return providers


def _google(name: str, spec: ProviderSpec, stack: AsyncExitStack) -> Provider:
    """A Gemini API or Vertex AI provider (google-auth is imported only when one is configured)."""
    from gateway.providers.gemini import GeminiProvider
    from gateway.providers.http import make_session

    session = make_session(spec)
    stack.push_async_callback(session.close)
    if spec.type == "gemini":
        return GeminiProvider(name, spec, session)
    from gateway.providers.vertex import VertexAnthropic, VertexGemini

    vertex = (VertexAnthropic if spec.publisher == "anthropic" else VertexGemini)(
        name, spec, session
    )
    stack.callback(vertex.tokens.close)
    return vertex


def can_serve(provider: Provider, endpoint: Endpoint) -> bool:
    """Whether a call to `endpoint` can go to `provider`, natively or translated."""
    if endpoint in ("chat", "messages", "responses"):
        return provider.wire == "anthropic" or provider.supports("chat")
    return provider.supports(endpoint)
