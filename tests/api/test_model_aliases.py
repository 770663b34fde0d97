"""Model names as agents send them: aliases and glob patterns that route to a configured model,
the name asked for kept in the access log, metrics counted under the configured name, and the
answer's `model` as the upstream has it or as the client asked, on every endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import ConfigError, ModelNames, build_settings, load_settings
from gateway.telemetry import semconv as sc
from tests.conftest import ACCESS, Upstream, gateway_settings, run_gateway, serve
from tests.fakes.agent_upstream import AgentUpstream
from tests.telemetry.test_metrics import scrape_when

pytestmark = pytest.mark.timeout(30)

HELLO = [{"role": "user", "content": "Say hello."}]


def models(*specs: dict[str, Any]) -> ModelNames:
    settings = build_settings(
        {
            "providers": {"sim": {"type": "simulated"}},
            "models": [{"deployments": [{"provider": "sim", "model": "x"}], **s} for s in specs],
        }
    )
    return ModelNames(settings.models)


def test_names_resolve_exactly_then_by_the_first_matching_pattern() -> None:
    """A configured name wins over any alias; exact aliases come next; patterns match in config
    order; a name nothing matches resolves to None."""
    names = models(
        {"name": "opus", "aliases": ["claude-opus-*"]},
        {"name": "claude-anything", "aliases": ["claude-*", "sonnet"]},
        {"name": "haiku", "aliases": ["claude-haiku-*", "gpt-5?"]},
    )

    def name(requested: str) -> str | None:
        spec = names.lookup(requested)
        return None if spec is None else spec.name

    assert name("opus") == "opus"
    assert name("claude-anything") == "claude-anything"
    assert name("sonnet") == "claude-anything"
    assert name("claude-opus-4-8") == "opus"
    assert name("claude-haiku-4-5") == "claude-anything"  # the earlier pattern wins
    assert name("gpt-51") == "haiku"
    assert name("gpt-5") is None and name("gpt-5-mini") is None
    assert name("llama") is None
    assert name("claude-opus-4-8") == "opus"  # remembered, same answer


def write(tmp_path: Path, models_yaml: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text("providers:\n  sim: {type: simulated}\nmodels:\n" + models_yaml)
    return path


@pytest.mark.parametrize(
    ("models_yaml", "expected"),
    [
        (
            "  - {name: a, aliases: ['claude *'], deployments: [{provider: sim, model: x}]}\n",
            "models[a].aliases",
        ),
        (
            "  - {name: a, aliases: [a], deployments: [{provider: sim, model: x}]}\n",
            "a model's name cannot also be its alias",
        ),
        (
            "  - {name: a, deployments: [{provider: sim, model: x}]}\n"
            "  - {name: b, aliases: [a], deployments: [{provider: sim, model: x}]}\n",
            "models[b].aliases: 'a' is a model's name",
        ),
        (
            "  - {name: a, aliases: [sonnet], deployments: [{provider: sim, model: x}]}\n"
            "  - {name: b, aliases: [sonnet], deployments: [{provider: sim, model: x}]}\n",
            "models[b].aliases: 'sonnet' is already an alias of 'a'",
        ),
        (
            "  - {name: a, answer_model: client, deployments: [{provider: sim, model: x}]}\n",
            "answer_model",
        ),
    ],
)
def test_bad_aliases_are_config_errors_naming_the_key(
    tmp_path: Path, models_yaml: str, expected: str
) -> None:
    """An alias that is not a name or pattern, that shadows a model's name, that two models
    claim, or an unknown `answer_model`, is refused naming the key."""
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, models_yaml), environ={})
    assert expected in str(caught.value)


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS]


@pytest.mark.parametrize("answer_model", ["upstream", "requested"])
async def test_an_alias_routes_on_every_endpoint(
    upstream: Upstream, access: pytest.LogCaptureFixture, answer_model: str
) -> None:
    """`claude-*` and `gpt-5*` reach the configured model on chat, Responses, Messages (whole
    and streamed) and count_tokens; the answer's `model` is the upstream's or the name asked
    for; the access log keeps the name asked for; metrics count the configured name only."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "coder",
                "aliases": ["claude-*", "gpt-5*"],
                "answer_model": answer_model,
                "deployments": [{"provider": "up", "model": "sim-model"}],
            }
        ],
    )
    expected = (lambda asked: "sim-model") if answer_model == "upstream" else (lambda a: a)
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
    ):
        chat = await client.post(
            "/v1/chat/completions", json={"model": "gpt-5.5", "messages": HELLO}
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == expected("gpt-5.5")
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "gpt-5.5", "messages": HELLO, "stream": True},
        ) as streamed:
            chunks = [
                orjson.loads(line[6:])
                async for line in streamed.aiter_lines()
                if line.startswith("data: {")
            ]
        assert {c["model"] for c in chunks} == {expected("gpt-5.5")}
        responses = await client.post(
            "/v1/responses", json={"model": "gpt-5-codex", "input": "Say hello."}
        )
        assert responses.status_code == 200, responses.text
        assert responses.json()["model"] == expected("gpt-5-codex")
        messages = await client.post(
            "/v1/messages",
            json={"model": "claude-opus-4-8", "max_tokens": 20, "messages": HELLO},
        )
        assert messages.status_code == 200, messages.text
        assert messages.json()["model"] == expected("claude-opus-4-8")
        count = await client.post(
            "/v1/messages/count_tokens", json={"model": "claude-haiku-4-5", "messages": HELLO}
        )
        assert count.status_code == 200, count.text
        assert count.json()["input_tokens"] > 0
        unknown = await client.post(
            "/v1/messages", json={"model": "llama-3", "max_tokens": 5, "messages": HELLO}
        )
        assert unknown.status_code == 404
        scraped = await scrape_when(client, gw.url, lambda s: s.value(sc.REQUESTS + "_total") >= 5)
    assert {s.labels["model"] for s in scraped.matching(sc.REQUESTS + "_total")} <= {"coder", ""}
    served = [line for line in lines(access) if line["status"] == 200]
    assert [(line["model"], line["requested_model"]) for line in served][:4] == [
        ("coder", "gpt-5.5"),
        ("coder", "gpt-5.5"),
        ("coder", "gpt-5-codex"),
        ("coder", "claude-opus-4-8"),
    ]


@pytest.fixture
async def anthropic_upstream() -> AsyncIterator[tuple[AgentUpstream, str]]:
    fake = AgentUpstream("true")
    async with serve(fake) as url:
        yield fake, url


@pytest.mark.parametrize("stream", [False, True])
async def test_a_native_answer_names_the_model_asked_for(
    anthropic_upstream: tuple[AgentUpstream, str], stream: bool
) -> None:
    """On a native Anthropic deployment the answer is forwarded as-is but for its `model`,
    which becomes the name asked for; the upstream is sent the deployment's model."""
    fake, url = anthropic_upstream
    settings = gateway_settings(
        {"up": {"type": "anthropic", "base_url": url, "api_key": "k"}},
        [
            {
                "name": "coder",
                "aliases": ["claude-*"],
                "answer_model": "requested",
                "deployments": [{"provider": "up", "model": "claude-sonnet-4-5"}],
            }
        ],
    )
    body = {"model": "claude-opus-4-8", "max_tokens": 20, "messages": HELLO, "stream": stream}
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
    ):
        response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert fake.requests[0].body["model"] == "claude-sonnet-4-5"
    if stream:
        assert b'"model":"claude-opus-4-8"' in response.content
        assert b"claude-sonnet-4-5" not in response.content
    else:
        assert response.json()["model"] == "claude-opus-4-8"


async def test_a_key_limited_to_a_model_may_use_its_aliases(upstream: Upstream) -> None:
    """A key allowed `coder` may ask for `claude-opus-4-8`, an alias of it, and not for a
    model it is not allowed."""
    import hashlib

    secret = "sk-alias-test"
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [
            {
                "name": "coder",
                "aliases": ["claude-*"],
                "deployments": [{"provider": "up", "model": "m"}],
            },
            {
                "name": "other",
                "aliases": ["gpt-*"],
                "deployments": [{"provider": "up", "model": "m"}],
            },
        ],
        auth={
            "keys": [
                {
                    "name": "a",
                    "sha256": hashlib.sha256(secret.encode()).hexdigest(),
                    "models": ["coder"],
                }
            ]
        },
    )
    headers = {"x-api-key": secret}
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10, headers=headers) as client,
    ):
        allowed = await client.post(
            "/v1/messages",
            json={"model": "claude-opus-4-8", "max_tokens": 5, "messages": HELLO},
        )
        refused = await client.post(
            "/v1/messages", json={"model": "gpt-5", "max_tokens": 5, "messages": HELLO}
        )
    assert allowed.status_code == 200, allowed.text
    assert refused.status_code == 403, refused.text
