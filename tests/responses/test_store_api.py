"""Stored responses seen through the gateway's HTTP API: a replica that cannot find a pending
write answers 503, not 404; a response too large to store says so; deleting a response
refuses the conversation that continues it; responses belong to a key's identity, not its
name; `/readyz`, `/admin/latency` and `/metrics` show the store's state and its writes."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.responses.store import KEY_PREFIX
from tests.conftest import RedisServer, free_port, gateway_settings, run_gateway
from tests.timing import eventually

pytestmark = pytest.mark.timeout(60)

PROVIDERS = {"local": {"type": "simulated", "default_profile": {"output_tokens": 4}}}
MODELS = [{"name": "chat", "deployments": [{"provider": "local", "model": "chat"}]}]


def settings(responses: dict[str, Any] | None = None, **extra: Any) -> Any:
    return gateway_settings(PROVIDERS, MODELS, responses=responses or {}, **extra)


def dead_redis() -> dict[str, Any]:
    """A responses section on a Redis that refuses connections."""
    return {"store": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}


async def create(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    response = await http.post("/v1/responses", json={"model": "chat", "input": "hi", **body})
    assert response.status_code == 200, response.text
    return response


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


async def test_another_replica_answers_503_for_a_pending_write(redis_server: RedisServer) -> None:
    """Replica A cannot reach Redis (its write is pending), replica B can: B answers 503
    `store_unavailable` for A's new response, on GET and on continuation, never 404/400."""
    shared = {"store": "redis", "redis_url": redis_server.url}
    async with (
        run_gateway(settings(dead_redis())) as a,
        run_gateway(settings(shared)) as b,
        httpx.AsyncClient(base_url=a.url) as on_a,
        httpx.AsyncClient(base_url=b.url) as on_b,
    ):
        rid = (await create(on_a)).json()["id"]
        fetched = await on_b.get(f"/v1/responses/{rid}")
        assert fetched.status_code == 503, fetched.text
        assert error_of(fetched)["code"] == "store_unavailable"
        continued = await on_b.post(
            "/v1/responses", json={"model": "chat", "input": "and?", "previous_response_id": rid}
        )
        assert continued.status_code == 503, continued.text
        assert error_of(continued)["code"] == "store_unavailable"
        assert (await on_a.get(f"/v1/responses/{rid}")).status_code == 200  # A holds it


async def test_a_response_too_large_to_store_says_so() -> None:
    """Over `max_bytes_per_response`: the answer carries `x-tailguard-stored: false`, and its
    id's GET and continuation name the limit instead of a bare "not found"."""
    async with (
        run_gateway(settings({"max_bytes_per_response": 2048})) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        created = await create(http, input="x" * 4000)
        assert created.headers["x-tailguard-stored"] == "false"
        rid = created.json()["id"]
        fetched = await http.get(f"/v1/responses/{rid}")
        assert fetched.status_code == 404
        assert "responses.max_bytes_per_response (2048 bytes)" in error_of(fetched)["message"]
        for stream in (False, True):
            continued = await http.post(
                "/v1/responses",
                json={"model": "chat", "input": "?", "previous_response_id": rid, "stream": stream},
            )
            assert continued.status_code == 400
            error = error_of(continued)
            assert error["code"] == "previous_response_not_found"
            assert "max_bytes_per_response" in error["message"]
        small = await create(http)
        assert "x-tailguard-stored" not in small.headers


async def test_deleting_a_response_refuses_the_conversation_that_continues_it() -> None:
    """r2 continues r1 and so holds r1's content: once r1 is deleted, r2's GET, input items and
    continuation are refused, saying why; a conversation not continuing r1 is untouched."""
    async with run_gateway(settings()) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        r1 = (await create(http, input="my secret")).json()["id"]
        r2 = (await create(http, input="and?", previous_response_id=r1)).json()["id"]
        other = (await create(http, input="unrelated")).json()["id"]
        items = await http.get(f"/v1/responses/{r2}/input_items")
        assert "my secret" in items.text
        assert (await http.delete(f"/v1/responses/{r1}")).status_code == 200
        for path in (f"/v1/responses/{r2}", f"/v1/responses/{r2}/input_items"):
            refused = await http.get(path)
            assert refused.status_code == 404
            assert "continues a response that was deleted" in error_of(refused)["message"]
            assert "my secret" not in refused.text
        continued = await http.post(
            "/v1/responses", json={"model": "chat", "input": "?", "previous_response_id": r2}
        )
        assert continued.status_code == 400
        assert error_of(continued)["code"] == "previous_response_not_found"
        assert (await http.get(f"/v1/responses/{other}")).status_code == 200


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_a_replacement_key_with_the_same_name_cannot_read_the_old_keys_responses(
    redis_server: RedisServer,
) -> None:
    """The key named `team` is replaced (a new secret under the same name, deployed as a new
    config on a replica sharing the store): the replacement neither reads, continues nor
    deletes the old key's response."""
    old, new = "sk-team-old-0123456789", "sk-team-new-0123456789"
    shared = {"store": "redis", "redis_url": redis_server.url}

    def keyed(key: str) -> Any:
        return settings(shared, auth={"keys": [{"name": "team", "sha256": _sha(key)}]})

    async with (
        run_gateway(keyed(old)) as before,
        run_gateway(keyed(new)) as after,
        httpx.AsyncClient(base_url=before.url, headers={"authorization": f"Bearer {old}"}) as a,
        httpx.AsyncClient(base_url=after.url, headers={"authorization": f"Bearer {new}"}) as b,
        Redis.from_url(redis_server.url) as raw,
    ):
        rid = (await create(a)).json()["id"]

        async def written() -> bool:  # the write is off the request path
            return bool(await raw.exists(KEY_PREFIX + rid))

        await eventually(written, within_s=20, what="the response to be written")
        assert (await b.get(f"/v1/responses/{rid}")).status_code == 404
        continued = await b.post(
            "/v1/responses", json={"model": "chat", "input": "?", "previous_response_id": rid}
        )
        assert continued.status_code == 400
        assert (await b.delete(f"/v1/responses/{rid}")).status_code == 404
        assert (await a.get(f"/v1/responses/{rid}")).status_code == 200
        owner = await raw.hget(KEY_PREFIX + rid, "owner")
        assert owner not in (b"team", _sha(old).encode())  # neither the name nor the digest


async def _store_state(http: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await http.get("/readyz")).json()
    state: dict[str, Any] = body["responses_store"]
    return state


async def test_readyz_admin_and_metrics_show_a_degraded_store() -> None:
    """With the store's Redis down, a new response's write fails and is kept: `/readyz` stays
    ready (chat does not need the store) and shows the store degraded with a pending write;
    `/admin/latency` and `/metrics` show the same."""
    server = {"readiness_detail": "public"}
    async with (
        run_gateway(settings(dead_redis(), server=server)) as gw,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        await create(http)

        async def degraded() -> bool:  # the writer's first try
            return bool((await _store_state(http))["state"] == "degraded")

        await eventually(degraded, within_s=20, what="the failed write to show", every_s=0.05)
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        state = ready.json()["responses_store"]
        assert (state["store"], state["pending_writes"], state["dropped_writes"]) == ("redis", 1, 0)
        admin = (await http.get("/admin/latency")).json()["responses_store"]
        assert admin["retried_writes"] >= 1 and admin["pending_writes"] == 1
        metrics = (await http.get("/metrics")).text
        assert 'tailguard_responses_store_up{store="redis"} 0.0' in metrics
        assert 'tailguard_responses_store_pending_writes{store="redis"} 1.0' in metrics
        assert 'tailguard_responses_store_writes_total{result="retried",store="redis"}' in metrics


async def test_the_store_connects_before_the_first_request(redis_server: RedisServer) -> None:
    """The store's Redis connection is made while the gateway starts (for a Cluster, the slot
    map is read then), so the first stored-response read does not pay for it."""
    shared = {"store": "redis", "redis_url": redis_server.url}
    async with Redis.from_url(redis_server.url) as raw:
        assert len(await raw.client_list()) == 1  # this client
        async with run_gateway(settings(shared)):
            assert len(await raw.client_list()) == 2
