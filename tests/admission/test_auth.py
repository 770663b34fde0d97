"""API keys: who may call which model and endpoint, and the limits a key carries.

Real gateways on loopback with keys configured as hashes; the official SDKs as clients. A
recording upstream shows what the gateway forwards: never the client's key.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.admission.auth import KeyRing, hash_key, new_key, presented_key
from gateway.config import AuthSpec
from tests.api.test_proxy import Scripted
from tests.conftest import Upstream, gateway_settings, run_gateway, serve
from tests.fakes.anthropic_upstream import AnthropicFake
from tests.telemetry.test_metrics import scrape
from tests.timing import eventually

CLIENT_KEY, CLIENT_HASH = new_key()
OTHER_KEY, OTHER_HASH = new_key()
ADMIN_KEY, ADMIN_HASH = new_key()
STALL = "m@stall_rate=1,stall_ms=30000"
CHAT: Any = [{"role": "user", "content": "hi"}]  # as both SDKs type a message


def auth(**client: Any) -> dict[str, Any]:
    return {
        "keys": [
            {"name": "team-a", "sha256": CLIENT_HASH, **client},
            {"name": "team-b", "sha256": OTHER_HASH, "models": ["m", "stall"]},
        ],
        "admin_keys": [{"name": "ops", "sha256": ADMIN_HASH}],
    }


def settings(base_url: str, *, server: dict[str, Any] | None = None, **client: Any) -> Any:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": base_url}},
        [
            {"name": "m", "deployments": [{"provider": "up", "model": "m"}]},
            {"name": "other", "deployments": [{"provider": "up", "model": "m"}]},
            # A simulated upstream that never sends a first token (see gateway/sim).
            {"name": "stall", "deployments": [{"provider": "up", "model": STALL}]},
        ],
        auth=auth(**client),
        server=server or {},
    )


ANSWER = orjson.dumps(
    {
        "id": "cmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Scripted, str]]:
    """An upstream that answers one fixed completion and keeps every request it got."""
    app = Scripted(200, ANSWER)
    async with serve(app) as url:
        yield app, url + "/v1"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


# --- the key ring, on its own ---------------------------------------------------------------------


def test_presented_key_forms() -> None:
    """Bearer anywhere, x-api-key only on the Anthropic endpoint, Basic's password (a browser
    asking for the dashboard); anything else is no key."""
    basic = b"Basic " + base64.b64encode(b"anyone:" + ADMIN_KEY.encode())
    assert presented_key([(b"authorization", b"Bearer abc")], anthropic=False) == b"abc"
    assert presented_key([(b"authorization", b"bearer  abc ")], anthropic=False) == b"abc"
    assert presented_key([(b"authorization", basic)], anthropic=False) == ADMIN_KEY.encode()
    assert presented_key([(b"x-api-key", b"abc")], anthropic=True) == b"abc"
    assert presented_key([(b"x-api-key", b"abc")], anthropic=False) is None
    assert presented_key([(b"authorization", b"Basic !!notbase64")], anthropic=False) is None
    assert presented_key([(b"authorization", b"Token abc")], anthropic=False) is None
    assert presented_key([(b"authorization", b"Bearer ")], anthropic=False) is None


def test_key_ring_identifies_by_hash_only() -> None:
    ring = KeyRing(AuthSpec.model_validate(auth(rpm=5)))
    found = ring.identify(CLIENT_KEY.encode())
    assert found is not None and found.name == "team-a" and found.rpm == 5 and not found.admin
    admin = ring.identify(ADMIN_KEY.encode())
    assert admin is not None and admin.admin
    assert ring.identify(CLIENT_KEY.encode() + b"x") is None
    assert ring.identify(CLIENT_HASH.encode()) is None  # the hash is not a key
    assert not KeyRing(None).enabled and ring.enabled


def test_duplicate_key_names_and_hashes_are_config_errors() -> None:
    with pytest.raises(ValueError, match="used twice"):
        AuthSpec.model_validate(
            {"keys": [{"name": "a", "sha256": CLIENT_HASH}, {"name": "a", "sha256": OTHER_HASH}]}
        )
    with pytest.raises(ValueError, match="same hash"):
        AuthSpec.model_validate(
            {
                "keys": [{"name": "a", "sha256": CLIENT_HASH}],
                "admin_keys": [{"name": "b", "sha256": CLIENT_HASH}],
            }
        )


# --- clients ------------------------------------------------------------------------------------


async def test_a_client_key_calls_models_and_is_never_forwarded(
    recorder: tuple[Scripted, str],
) -> None:
    """The right key is served; the upstream sees neither the key nor the client's
    Authorization header (upstream credentials come from the config alone)."""
    fake, base_url = recorder
    async with run_gateway(settings(base_url)) as gw, sdk(gw.base_url, CLIENT_KEY) as client:
        reply = await client.chat.completions.create(model="m", messages=CHAT)
    assert reply.choices[0].message.content == "ok"
    assert all("authorization" not in headers for headers in fake.requests)
    assert CLIENT_KEY not in repr(fake.requests) + repr(fake.bodies)


async def test_missing_or_wrong_key_is_401_without_echo(upstream: Upstream) -> None:
    async with run_gateway(settings(upstream.base_url)) as gw:
        async with sdk(gw.base_url, "tg-not-a-key-123") as stranger:
            with pytest.raises(openai.AuthenticationError) as wrong:
                await stranger.chat.completions.create(model="m", messages=CHAT)
        async with httpx.AsyncClient() as client:
            missing = await client.post(
                gw.base_url + "/chat/completions", json={"model": "m", "messages": CHAT}
            )
    assert wrong.value.status_code == 401
    assert "tg-not-a-key-123" not in wrong.value.response.text
    assert wrong.value.code == "invalid_api_key"
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.headers["x-request-id"]
    assert upstream.stats.requests == 0  # refused before anything was sent on


async def test_anthropic_endpoint_takes_x_api_key() -> None:
    fake = AnthropicFake(api_key="sk-ant-upstream")
    async with serve(fake) as url:
        config = gateway_settings(
            {"claude": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-upstream"}},
            [
                {"name": n, "deployments": [{"provider": "claude", "model": "claude-x"}]}
                for n in ("m", "stall")
            ],
            auth=auth(),
        )
        async with run_gateway(config) as gw:
            async with anthropic.AsyncAnthropic(
                base_url=gw.url, api_key=CLIENT_KEY, max_retries=0
            ) as client:
                reply = await client.messages.create(model="m", max_tokens=16, messages=CHAT)
            async with anthropic.AsyncAnthropic(
                base_url=gw.url, api_key="nope", max_retries=0
            ) as stranger:
                with pytest.raises(anthropic.AuthenticationError) as refused:
                    await stranger.messages.create(model="m", max_tokens=16, messages=CHAT)
    assert reply.content[0].type == "text"
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    sent = fake.requests[0].headers
    assert sent["x-api-key"] == "sk-ant-upstream"  # the configured credential, not the client's
    assert CLIENT_KEY not in repr(fake.requests)


async def test_a_key_sees_and_uses_only_its_models(upstream: Upstream) -> None:
    async with (
        run_gateway(settings(upstream.base_url)) as gw,
        sdk(gw.base_url, OTHER_KEY) as limited,
        sdk(gw.base_url, CLIENT_KEY) as full,
    ):
        listed = [m.id async for m in limited.models.list()]
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await limited.chat.completions.create(model="other", messages=CHAT)
        with pytest.raises(openai.NotFoundError) as unknown:
            await limited.chat.completions.create(model="nope", messages=CHAT)
        everything = [m.id async for m in full.models.list()]
        assert (await full.models.retrieve("other")).id == "other"
        with pytest.raises(openai.NotFoundError) as hidden:
            await limited.models.retrieve("other")  # exists, but not for this key
    assert listed == ["m", "stall"]
    assert hidden.value.code == "model_not_found"
    assert "other" not in hidden.value.message.split("Available models:")[1]
    assert sorted(everything) == ["m", "other", "stall"]
    assert denied.value.code == "model_not_allowed"
    assert "other" not in unknown.value.message.split("Available models:")[1]


async def test_n_and_max_tokens_caps(recorder: tuple[Scripted, str]) -> None:
    """Over a cap is a 400 naming the field; a request without max_tokens gets the key's cap."""
    fake, base_url = recorder
    async with (
        run_gateway(settings(base_url, max_n=2, max_tokens=50)) as gw,
        sdk(gw.base_url, CLIENT_KEY) as client,
    ):
        with pytest.raises(openai.BadRequestError) as too_many:
            await client.chat.completions.create(model="m", messages=CHAT, n=3)
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.chat.completions.create(model="m", messages=CHAT, max_tokens=51)
        await client.chat.completions.create(model="m", messages=CHAT, n=2, max_tokens=50)
        await client.chat.completions.create(model="m", messages=CHAT)
    assert too_many.value.param == "n" and too_many.value.code == "key_limit_exceeded"
    assert too_long.value.param == "max_tokens"
    sent = [orjson.loads(body) for body in fake.bodies if body]  # not the GETs of /metrics
    assert len(sent) == 2
    assert sent[0]["max_tokens"] == 50
    assert sent[1]["max_completion_tokens"] == 50


# --- admin endpoints ----------------------------------------------------------------------------


async def test_admin_endpoints_need_an_admin_key(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    async with run_gateway(settings(upstream.base_url)) as gw:
        bare = await http.get(gw.url + "/admin/latency")
        client = await http.get(gw.url + "/dashboard", headers=bearer(CLIENT_KEY))
        admin = await http.get(gw.url + "/admin/latency", headers=bearer(ADMIN_KEY))
        browser = await http.get(gw.url + "/dashboard", auth=("ops", ADMIN_KEY))
        admin_calls_model = await http.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers=bearer(ADMIN_KEY),
        )
        open_paths = [await http.get(gw.url + p) for p in ("/healthz", "/readyz", "/metrics")]
    assert bare.status_code == 401
    assert bare.headers["www-authenticate"].startswith("Basic")  # the browser asks for it
    assert bare.json()["error"]["type"] == "invalid_request_error"
    assert client.status_code == 403 and client.json()["error"]["code"] == "admin_key_required"
    assert admin.status_code == 200 and "deployments" in admin.json()
    assert browser.status_code == 200 and b"<html" in browser.content.lower()
    assert admin_calls_model.status_code == 403
    assert [r.status_code for r in open_paths] == [200, 200, 200]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --- secrets stay out of logs ---------------------------------------------------------------------


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name in ("tailguard", "tailguard.access"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "disabled", logger.disabled)
    caplog.set_level(logging.DEBUG)
    yield caplog


async def test_keys_never_reach_the_logs(
    upstream: Upstream, http: httpx.AsyncClient, logs: pytest.LogCaptureFixture
) -> None:
    """The access log names the key, never carries it, for good and refused requests alike."""
    async with run_gateway(settings(upstream.base_url)) as gw:
        for key in (CLIENT_KEY, "tg-wrong-key-456", ADMIN_KEY):
            await http.post(
                gw.base_url + "/chat/completions",
                json={"model": "m", "messages": CHAT},
                headers=bearer(key),
            )
        await http.get(gw.url + "/admin/latency", headers=bearer("tg-wrong-key-456"))
        await gw_settled(http, gw.url, 3)
    text = "\n".join(r.getMessage() for r in logs.records)
    for secret in (CLIENT_KEY, ADMIN_KEY, "tg-wrong-key-456"):
        assert secret not in text
    access = [orjson.loads(r.getMessage()) for r in logs.records if r.name == "tailguard.access"]
    assert {line.get("key") for line in access} >= {"team-a"}


async def gw_settled(http: httpx.AsyncClient, url: str, requests: int) -> None:
    """Wait (bounded) until /metrics counts `requests`: each is logged just after."""
    from tests.telemetry.test_metrics import scrape_when

    await scrape_when(http, url, lambda s: s.value("tailguard_requests_total") >= requests)


# --- concurrency caps -----------------------------------------------------------------------------


async def test_concurrent_requests_per_key_and_overall(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """Beyond a key's (or the gateway's) requests in flight: 503 with retry-after, at once;
    the slot is free again once the request ends."""
    config = settings(upstream.base_url, server={"max_concurrent": 2}, max_concurrent=1)
    async with run_gateway(config) as gw:
        stalled = {"model": "stall", "messages": CHAT, "stream": True}
        first = asyncio.create_task(
            http.post(gw.base_url + "/chat/completions", json=stalled, headers=bearer(CLIENT_KEY))
        )
        await upstream.stats.wait_for(lambda s: s.requests >= 1)
        same_key = await http.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers=bearer(CLIENT_KEY),
        )
        second = asyncio.create_task(
            http.post(gw.base_url + "/chat/completions", json=stalled, headers=bearer(OTHER_KEY))
        )
        await upstream.stats.wait_for(lambda s: s.requests >= 2)
        overall = await http.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers=bearer(OTHER_KEY),
        )
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        await upstream.stats.wait_for(lambda s: s.cancelled >= 2)
        again = await until_not_busy(http, gw.base_url)
        metrics = await scrape(http, gw.url)
    assert same_key.status_code == 503
    assert same_key.json()["error"]["code"] == "too_many_concurrent_requests"
    assert same_key.headers["retry-after"] == "1"
    assert overall.status_code == 503 and overall.json()["error"]["code"] == "overloaded"
    assert again.status_code == 200
    assert metrics.value("tailguard_concurrency_refused_total", cap="key") >= 1
    assert metrics.value("tailguard_concurrency_refused_total", cap="gateway") >= 1


async def until_not_busy(http: httpx.AsyncClient, base_url: str) -> httpx.Response:
    """The gateway frees a slot when the request's handler ends, just after the upstream saw
    the close: retry (bounded) across that instant."""

    async def not_busy() -> httpx.Response | None:
        reply = await http.post(
            base_url + "/chat/completions",
            json={"model": "m", "messages": CHAT},
            headers=bearer(CLIENT_KEY),
        )
        return None if reply.status_code == 503 else reply

    return await eventually(not_busy, within_s=5, what="a free slot", every_s=0.01)


# --- the command line -----------------------------------------------------------------------------


def tailguard(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_keys_new_prints_the_key_once_and_its_config_line() -> None:
    done = tailguard("keys", "new", "team-x", "--models", "m,other", "--rpm", "60")
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    assert key.startswith("tg-") and len(key) > 40
    line = done.stderr.split("\n- ", 1)[1].strip()
    entry = orjson.loads(line)
    assert entry == {"name": "team-x", "sha256": hash_key(key), "models": ["m", "other"], "rpm": 60}
    assert key not in done.stderr
    assert tailguard("keys", "hash", stdin=key + "\n").stdout.strip() == hash_key(key)
    assert tailguard("keys", "new", "bad name!").returncode == 2


def test_serve_refuses_public_interfaces_without_keys(tmp_path: Any) -> None:
    """No keys and a non-loopback host: exit before binding, unless told otherwise."""
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "providers: {sim: {type: simulated}}\nmodels: [{name: m, deployments: [{provider: sim, "
        "model: fast}]}]\n"
    )
    done = tailguard("serve", "--config", str(config), "--host", "0.0.0.0", "--port", "1")
    assert done.returncode == 2
    assert "only listens on loopback" in " ".join(done.stderr.split())


def test_keys_can_come_from_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import load_settings

    config = tmp_path / "gateway.yaml"
    config.write_text(
        "providers: {sim: {type: simulated}}\nmodels: [{name: m, deployments: [{provider: sim, "
        "model: fast}]}]\n"
    )
    monkeypatch.setenv(
        "TAILGUARD_AUTH__KEYS", orjson.dumps([{"name": "env-key", "sha256": CLIENT_HASH}]).decode()
    )
    loaded = load_settings(config)
    assert loaded.auth is not None
    principal = KeyRing(loaded.auth).identify(CLIENT_KEY.encode())
    assert principal is not None and principal.name == "env-key"
