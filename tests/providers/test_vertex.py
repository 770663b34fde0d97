"""`type: vertex`: Gemini and Anthropic models on Vertex AI from every client wire, with OAuth2
tokens that google-auth gets from a fake token endpoint for a service account made here (a fresh
RSA key; the endpoint verifies the signed JWT), and the same model on two clouds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gateway.cli import app
from tests.conftest import serve
from tests.fakes.anthropic_upstream import answer_text
from tests.fakes.gemini_upstream import GeminiFake
from tests.fakes.google_oauth import ServiceAccount, TokenEndpoint, make_service_account
from tests.google_harness import (
    CHAT,
    chat_tool_round_trip,
    messages_tool_round_trip,
    model,
    open_gateway,
    responses_tool_round_trip,
    sse,
)
from tests.schemas import validate, validate_stream
from tests.timing import scaled

GEMINI_KEY = "AIzaSyFAKE-configured-gemini-key-0123456789"
WATCHDOG_S = 10.0
PROJECT, LOCATION = "my-project-123", "us-central1"


@dataclass
class Google:
    fake: GeminiFake
    url: str
    tokens: TokenEndpoint
    account: ServiceAccount

    def vertex(self, **extra: Any) -> dict[str, Any]:
        return {
            "type": "vertex",
            "base_url": self.url,
            "project": PROJECT,
            "location": LOCATION,
            "credentials_file": str(self.account.path),
            **extra,
        }

    def providers(self, **vertex: Any) -> dict[str, Any]:
        return {
            "vertex": self.vertex(**vertex),
            "claude": self.vertex(publisher="anthropic", **vertex),
            "gemini": {"type": "gemini", "base_url": self.url, "api_key": GEMINI_KEY},
            "local": {"type": "simulated", "default_profile": {"output_tokens": 4}},
        }


@pytest.fixture
async def google(tmp_path: Path) -> AsyncIterator[Google]:
    tokens = TokenEndpoint()
    async with serve(tokens) as token_url:
        account = make_service_account(tmp_path / "sa.json", token_url + "/token")
        tokens.account = account
        fake = GeminiFake(api_key=GEMINI_KEY, token_ok=tokens.valid)
        async with serve(fake) as url:
            yield Google(fake, url, tokens, account)


# --- Gemini models on Vertex ---------------------------------------------------------------------


async def test_gemini_on_vertex_with_a_cached_token(google: Google) -> None:
    """Vertex's URL, a bearer token from the service account (fetched once, then reused), and
    the same chat translation as the Gemini API."""
    async with open_gateway(google.providers(), model("g", "vertex/gemini-2.5-flash")) as c:
        whole = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        streamed = await c.post(
            "/v1/chat/completions", {"model": "g", "messages": CHAT, "stream": True}
        )
    validate("chat", "CreateChatCompletionResponse", whole.json())
    validate_stream("chat", streamed.content)
    assert whole.json()["choices"][0]["message"]["content"] == answer_text(5)
    assert len(google.tokens.issued) == 1
    paths = [r.path for r in google.fake.requests]
    prefix = f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/google/models/"
    assert paths == [
        prefix + "gemini-2.5-flash:generateContent",
        prefix + "gemini-2.5-flash:streamGenerateContent",
    ]
    assert {r.headers["authorization"] for r in google.fake.requests} == {
        "Bearer " + google.tokens.issued[0]
    }
    assert all("x-goog-api-key" not in r.headers for r in google.fake.requests)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_gemini_on_vertex_tool_round_trips(google: Google, stream: bool) -> None:
    async with open_gateway(google.providers(), model("g", "vertex/gemini-2.5-flash@tool")) as c:
        await chat_tool_round_trip(c, "g", stream=stream)
        await responses_tool_round_trip(c, "g", stream=stream)
        await messages_tool_round_trip(c, "g", stream=stream)
    # Vertex gave no call ids: none is invented for the function responses.
    followup = google.fake.requests[-1].body["contents"][-1]["parts"][0]["functionResponse"]
    assert "id" not in followup


# --- Anthropic models on Vertex ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_claude_on_vertex_from_every_wire(google: Google, stream: bool) -> None:
    """rawPredict / streamRawPredict with the Messages body (no model, Vertex's
    anthropic_version), answering every client wire through the Messages translation."""
    async with open_gateway(google.providers(), model("c", "claude/claude-x@tool")) as c:
        await messages_tool_round_trip(c, "c", stream=stream, passthrough=True)
        await chat_tool_round_trip(c, "c", stream=stream)
        await responses_tool_round_trip(c, "c", stream=stream)
    method = "streamRawPredict" if stream else "rawPredict"
    first = google.fake.requests[0]
    assert first.path == (
        f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/anthropic/models/"
        f"claude-x@tool:{method}"
    )
    assert first.body["anthropic_version"] == "vertex-2023-10-16"
    assert "model" not in first.body
    assert first.headers["authorization"].startswith("Bearer ya29.")


async def test_claude_on_vertex_plain_text_from_the_anthropic_sdk(google: Google) -> None:
    async with open_gateway(google.providers(), model("c", "claude/claude-sonnet-4@20250514")) as c:
        message = await c.anthropic.messages.create(
            model="c", max_tokens=50, messages=[{"role": "user", "content": "hi"}]
        )
        stream = await c.anthropic.messages.create(
            model="c", max_tokens=50, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        events = [event async for event in stream]
    assert message.content[0].type == "text" and message.content[0].text == answer_text(5)
    assert events[-1].type == "message_stop"
    assert google.fake.requests[-1].path.endswith("/claude-sonnet-4@20250514:streamRawPredict")


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_token_expiring_mid_run_is_refreshed_before_it_fails(google: Google) -> None:
    """Tokens that live 4 s: requests keep flowing while the token is replaced ahead of its
    expiry (google-auth signs a new assertion each time, the endpoint verifies it); none
    fails and none is refused for an expired token."""
    google.tokens.lifetime_s = scaled(4.0)
    answered = 0
    async with open_gateway(google.providers(), model("g", "vertex/gemini-2.5-flash")) as c:
        async with asyncio.timeout(scaled(WATCHDOG_S) + google.tokens.lifetime_s * 2):
            while len(google.tokens.issued) < 2:
                answer = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
                assert answer.status_code == 200, answer.text
                answered += 1
    assert google.fake.unauthorized == 0
    assert answered > 1
    assert google.tokens.rejected == 0


@pytest.mark.slow
async def test_a_failing_refresh_leaves_the_valid_token_in_service(google: Google) -> None:
    """The token endpoint starts refusing: the current token serves on until it expires, then
    requests fail over with the reason; once the endpoint answers again, so does Vertex."""
    google.tokens.lifetime_s = scaled(4.0)
    async with open_gateway(
        google.providers(),
        model("g", "vertex/gemini-2.5-flash", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        first = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
        google.tokens.refuse = True
        async with asyncio.timeout(scaled(WATCHDOG_S) + google.tokens.lifetime_s):
            while google.tokens.rejected == 0:  # until a refresh has been refused
                served = await c.openai.chat.completions.with_raw_response.create(
                    model="g", messages=CHAT
                )
                assert served.headers["x-tailguard-deployment"] == "vertex/gemini-2.5-flash"
            after = await c.openai.chat.completions.with_raw_response.create(
                model="g", messages=CHAT
            )
            while True:  # until the token has expired: then the fallback answers
                expired = await c.openai.chat.completions.with_raw_response.create(
                    model="g", messages=CHAT
                )
                if expired.headers["x-tailguard-deployment"] == "local/m":
                    break
        google.tokens.refuse = False
        again = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
    assert first.headers["x-tailguard-deployment"] == "vertex/gemini-2.5-flash"
    assert after.headers["x-tailguard-deployment"] == "vertex/gemini-2.5-flash"
    assert expired.headers["x-tailguard-route"] == "error_fallback"
    assert again.headers["x-tailguard-deployment"] == "vertex/gemini-2.5-flash"


async def test_a_revoked_token_is_replaced_and_the_request_retried(google: Google) -> None:
    async with open_gateway(google.providers(), model("g", "vertex/gemini-2.5-flash")) as c:
        first = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        google.tokens.revoke(google.tokens.issued[0])
        second = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
    assert first.status_code == second.status_code == 200
    assert google.fake.unauthorized == 1
    assert len(google.tokens.issued) == 2


async def test_application_default_credentials(
    google: Google, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without credentials_file, google-auth's ADC finds the account (here through
    GOOGLE_APPLICATION_CREDENTIALS)."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(google.account.path))
    providers = google.providers()
    del providers["vertex"]["credentials_file"]
    async with open_gateway(providers, model("g", "vertex/gemini-2.5-flash")) as c:
        answer = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
    assert answer.status_code == 200
    assert len(google.tokens.issued) == 1


async def test_a_key_the_endpoint_does_not_know_fails_over_and_stays_secret(
    google: Google, tmp_path: Path, access: pytest.LogCaptureFixture
) -> None:
    """A service account signed with another key: the token endpoint refuses the assertion
    (bad signature), the deployment fails over, and no key material reaches the client."""
    impostor = make_service_account(tmp_path / "other.json", "http://127.0.0.1:1/token")
    info = json.loads(google.account.path.read_text())
    info["private_key"] = impostor.private_key_pem
    impostor.path.write_text(json.dumps(info))
    providers = google.providers(credentials_file=str(impostor.path))
    async with open_gateway(
        providers,
        model("alone", "vertex/gemini-2.5-flash"),
        model("g", "vertex/gemini-2.5-pro", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        alone = await c.post("/v1/chat/completions", {"model": "alone", "messages": CHAT})
        rescued = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
    assert alone.status_code == 502
    assert "could not get a Google access token" in alone.json()["error"]["message"]
    assert google.tokens.rejected >= 1 and not google.tokens.issued
    for line in impostor.private_key_pem.splitlines()[1:-1]:
        assert line not in alone.text + access.text
    assert rescued.headers["x-tailguard-deployment"] == "local/m"
    assert not google.fake.requests


async def test_an_echoed_token_is_scrubbed(
    google: Google, access: pytest.LogCaptureFixture
) -> None:
    """An upstream error that repeats the bearer token reaches neither the client, nor the
    access log and warnings, nor /admin; what it says to check is the service account."""
    async with open_gateway(
        google.providers(), model("g", "vertex/gemini-2.5-flash@status=401")
    ) as c:
        whole = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        admin = await c.http.get("/admin/latency")
    assert whole.status_code == 502
    assert len(google.tokens.issued) == 2  # the 401 replaced the token once, then gave up
    seen = whole.text + admin.text + access.text
    # What to check is Vertex's own credential, not an api_key it does not have.
    assert "check the provider's credentials_file" in seen
    assert "check the provider's api_key" not in seen
    for token in google.tokens.issued:
        assert token.removeprefix("ya29.") not in seen


# --- one model on two clouds ---------------------------------------------------------------------


async def test_the_same_model_on_two_clouds_fails_over(google: Google) -> None:
    """A model served by the Gemini API and by Vertex: while the Gemini API is overloaded
    (503 UNAVAILABLE), Vertex answers every request."""
    async with open_gateway(
        google.providers(),
        model("g", "gemini/gemini-2.5-flash@status=503", "vertex/gemini-2.5-flash"),
    ) as c:
        answers = [
            await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
            for _ in range(4)
        ]
    assert {a.headers["x-tailguard-deployment"] for a in answers} == {"vertex/gemini-2.5-flash"}
    assert all(a.parse().choices[0].message.content == answer_text(5) for a in answers)


async def test_the_same_model_on_two_clouds_hedges(google: Google) -> None:
    """The Gemini API slow to its first token past the budget: Vertex is hedged and answers."""
    slow = "gemini/gemini-2.5-flash@slow_ms=" + str(int(scaled(5000)))
    spec = model("g", slow, "vertex/gemini-2.5-flash", on_ttft_miss="hedge")
    spec["deployments"][0]["weight"] = 1_000_000  # the slow one leads
    spec["deployments"][1]["weight"] = 0.000001
    spec["budget"] = {"ttft_ms": int(scaled(1000))}
    spec["hedge_max_fraction"] = 1.0
    async with open_gateway(google.providers(), spec) as c:
        raw = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT, "stream": True})
        async with asyncio.timeout(scaled(WATCHDOG_S)):  # the slow attempt was closed
            await google.fake.wait_for(lambda fake: fake.streams_abandoned == 1)
    assert raw.status_code == 200
    assert raw.headers["x-tailguard-route"] == "hedge"
    assert raw.headers["x-tailguard-deployment"] == "vertex/gemini-2.5-flash"
    text = "".join(
        ch["choices"][0]["delta"].get("content") or ""
        for ch in sse(raw.content)
        if ch != "[DONE]" and ch["choices"]
    )
    assert text == answer_text(5)


# --- check-config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        (
            "{type: gemini}",
            "a gemini provider needs api_key: the Gemini API key, sent as x-goog-api-key "
            "(write api_key: ${GEMINI_API_KEY})",
        ),
        (
            "{type: vertex, location: us-central1}",
            "a vertex provider needs project: the Google Cloud project id",
        ),
        (
            "{type: vertex, project: My_Project, location: us-central1}",
            "project 'My_Project' is not a Google Cloud project id (6 to 30 lowercase letters, "
            "digits and hyphens, e.g. my-project-123)",
        ),
        (
            "{type: vertex, project: my-project-123}",
            "a vertex provider needs location: a region such as us-central1, or global",
        ),
        (
            "{type: vertex, project: my-project-123, location: Mars}",
            "location 'Mars' is not a Vertex AI location (a region such as us-central1 or "
            "europe-west4, or global)",
        ),
        (
            "{type: vertex, project: my-project-123, location: global, credentials_file: /no.json}",
            "credentials_file '/no.json' is not a file (a service-account JSON key; leave it out "
            "to use Application Default Credentials)",
        ),
        (
            "{type: vertex, project: my-project-123, location: global, api_key: AIza-SECRET-1}",
            "a vertex provider takes no api_key: it authenticates with OAuth2, from "
            "credentials_file (a service-account JSON key) or Application Default Credentials",
        ),
        (
            "{type: gemini, api_key: AIza-SECRET-1, project: p, location: global}",
            "project and location are for providers of type vertex",
        ),
    ],
    ids=[
        "gemini-key",
        "project",
        "project-form",
        "location",
        "location-form",
        "credentials-file",
        "vertex-key",
        "vertex-keys-elsewhere",
    ],
)
def test_check_config_explains_the_google_keys(tmp_path: Path, provider: str, message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        f"providers:\n  up: {provider}\nmodels:\n  - name: m\n"
        "    deployments: [{provider: up, model: gemini-2.5-flash}]\n"
    )
    result = CliRunner().invoke(app, ["check-config", "--config", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {path}:2: providers.up: {message}"
    assert "SECRET" not in result.stdout + result.stderr


def test_check_config_shows_where_google_providers_send(google: Google) -> None:
    path = google.account.path.parent / "gateway.yaml"
    path.write_text(
        "providers:\n"
        "  g: {type: gemini, api_key: AIza-SECRET-1}\n"
        f"  v: {{type: vertex, project: {PROJECT}, location: europe-west4, "
        f"credentials_file: {google.account.path}}}\n"
        "models:\n  - name: m\n"
        "    deployments: [{provider: g, model: gemini-2.5-flash},\n"
        "                  {provider: v, model: gemini-2.5-flash}]\n"
    )
    result = CliRunner().invoke(app, ["check-config", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)["providers"]
    assert shown["g"]["base_url"] == "https://generativelanguage.googleapis.com"
    assert shown["v"]["base_url"] == "https://europe-west4-aiplatform.googleapis.com"
    assert "SECRET" not in result.stdout
    assert google.account.private_key_pem.splitlines()[1] not in result.stdout
