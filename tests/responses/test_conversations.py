"""The Conversations API over real HTTP, against the default config's simulated models: the
official `openai` SDK's `client.conversations` calls, the Agents SDK's `OpenAIConversationsSession`
over two turns, `responses.create(conversation=...)` keeping the history, scoping between two
keys, and the store's limits."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import Any

import agents
import httpx
import openai
import pytest

from gateway.config import PACKAGED_CONFIG, load_settings
from tests.conftest import Gateway, RedisServer, gateway_settings, run_gateway
from tests.timing import eventually

pytestmark = pytest.mark.timeout(60)

PROVIDERS = {"local": {"type": "simulated", "default_profile": {"output_tokens": 4}}}
MODELS = [{"name": "chat", "deployments": [{"provider": "local", "model": "chat"}]}]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    async with run_gateway(load_settings(PACKAGED_CONFIG)) as gw:
        yield gw


def _texts(items: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of each message item."""
    out = []
    for item in items:
        if item.type == "message":
            out.append((item.role, "".join(getattr(p, "text", "") or "" for p in item.content)))
    return out


async def test_the_openai_sdk_creates_reads_lists_and_deletes(gateway: Gateway) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        conv = await client.conversations.create(
            items=[{"type": "message", "role": "user", "content": "first"}],
            metadata={"topic": "demo"},
        )
        assert conv.id.startswith("conv_") and conv.object == "conversation"
        assert conv.metadata == {"topic": "demo"}
        assert (await client.conversations.retrieve(conv.id)).created_at == conv.created_at
        updated = await client.conversations.update(conv.id, metadata={"topic": "other"})
        assert updated.metadata == {"topic": "other"}
        added = await client.conversations.items.create(
            conv.id,
            items=[
                {"type": "message", "role": "assistant", "content": "second"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "3"}],
                },
            ],
        )
        assert [i.role for i in added.data] == ["assistant", "user"]  # type: ignore[union-attr]
        listed = [i async for i in client.conversations.items.list(conv.id, order="asc", limit=2)]
        assert _texts(listed) == [("user", "first"), ("assistant", "second"), ("user", "3")]
        newest = await client.conversations.items.list(conv.id, limit=1)
        assert newest.has_more and newest.data[0].id == listed[-1].id
        middle = listed[1].id
        assert middle is not None
        one = await client.conversations.items.retrieve(middle, conversation_id=conv.id)
        assert one.id == middle
        after = await client.conversations.items.delete(middle, conversation_id=conv.id)
        assert after.id == conv.id
        left = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert _texts(left) == [("user", "first"), ("user", "3")]
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.retrieve(middle, conversation_id=conv.id)
        deleted = await client.conversations.delete(conv.id)
        assert deleted.deleted and deleted.id == conv.id
        with pytest.raises(openai.NotFoundError) as missing:
            await client.conversations.retrieve(conv.id)
        assert missing.value.code == "conversation_not_found"


async def test_responses_with_a_conversation_keep_its_history(gateway: Gateway) -> None:
    """Each turn names the conversation: the gateway sends its items as the history (the
    stored response's input items show what was sent), and appends the turn to it."""
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        conv = await client.conversations.create()
        first = await client.responses.create(
            model="chat-fast", input="my name is Ada", conversation=conv.id
        )
        second = await client.responses.create(
            model="chat-fast", input="what is my name?", conversation={"id": conv.id}, stream=True
        )
        async for event in second:
            if event.type == "response.completed":
                second_id = event.response.id
        sent = [i async for i in client.responses.input_items.list(second_id, order="asc")]
        assert _texts(sent) == [
            ("user", "my name is Ada"),
            ("assistant", first.output_text),
            ("user", "what is my name?"),
        ]
        items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
        assert [role for role, _ in _texts(items)] == ["user", "assistant"] * 2
        with pytest.raises(openai.BadRequestError) as both:
            await client.responses.create(
                model="chat-fast", input="?", conversation=conv.id, previous_response_id=first.id
            )
        assert both.value.code == "mutually_exclusive_parameters"
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="chat-fast", input="?", conversation="conv_nope")


async def test_the_agents_sdk_session_runs_two_turns(gateway: Gateway) -> None:
    """`OpenAIConversationsSession` keeps the run's history in a conversation: the second turn
    is sent with the first turn's items, read back from the gateway."""
    agents.set_tracing_disabled(True)
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused") as client:
        session = agents.OpenAIConversationsSession(openai_client=client)
        model = agents.OpenAIResponsesModel(model="chat-fast", openai_client=client)
        agent = agents.Agent(name="plain", instructions="Be brief.", model=model)
        first = await agents.Runner.run(agent, "Remember the word tulip.", session=session)
        second = await agents.Runner.run(agent, "Which word?", session=session)
        assert isinstance(second.final_output, str) and second.final_output
        items: list[Any] = list(await session.get_items())
        assert session.session_id.startswith("conv_")
        roles = [item.get("role") for item in items if item.get("type") == "message"]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert items[0]["content"][0]["text"] == "Remember the word tulip."
        assert first.final_output in str(items[1]["content"])
        sent = second.raw_responses[0].response_id
        assert sent is not None
        history = [i async for i in client.responses.input_items.list(sent, order="asc")]
        assert _texts(history)[0] == ("user", "Remember the word tulip.")
        popped: Any = await session.pop_item()
        assert popped is not None and popped.get("role") == "assistant"
        assert len(await session.get_items()) == 3
        await session.clear_session()


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_a_conversation_is_its_keys_only() -> None:
    """Another key's conversation is not found, on every route and as a Responses history."""
    keys = {"a": "sk-a-0123456789abcdef", "b": "sk-b-0123456789abcdef"}
    auth = {"keys": [{"name": n, "sha256": _sha(k)} for n, k in keys.items()]}
    async with run_gateway(gateway_settings(PROVIDERS, MODELS, auth=auth)) as gw:
        a = httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {keys['a']}"})
        b = httpx.AsyncClient(base_url=gw.url, headers={"authorization": f"Bearer {keys['b']}"})
        async with a, b:
            made = await a.post(
                "/v1/conversations", json={"items": [{"role": "user", "content": "x"}]}
            )
            assert made.status_code == 200, made.text
            cid = made.json()["id"]
            item = (await a.get(f"/v1/conversations/{cid}/items")).json()["data"][0]["id"]
            refused = [
                await b.get(f"/v1/conversations/{cid}"),
                await b.post(f"/v1/conversations/{cid}", json={"metadata": {}}),
                await b.get(f"/v1/conversations/{cid}/items"),
                await b.post(f"/v1/conversations/{cid}/items", json={"items": []}),
                await b.get(f"/v1/conversations/{cid}/items/{item}"),
                await b.delete(f"/v1/conversations/{cid}/items/{item}"),
                await b.delete(f"/v1/conversations/{cid}"),
                await b.post(
                    "/v1/responses", json={"model": "chat", "input": "?", "conversation": cid}
                ),
            ]
            for answer in refused:
                assert answer.status_code == 404, answer.text
                assert answer.json()["error"]["code"] == "conversation_not_found"
            assert (await a.get(f"/v1/conversations/{cid}/items/{item}")).status_code == 200
            assert (await a.get(f"/v1/responses/{cid}")).status_code == 404  # not a response
            assert (await b.post("/v1/conversations", json={})).status_code == 200


async def test_a_conversation_is_held_to_the_stores_limits() -> None:
    """At most 20 items per call; a conversation that would outgrow `max_bytes_per_response`
    is left as it was (a turn that would, says it was not stored); metadata is bounded."""
    responses = {"max_bytes_per_response": 4096}
    settings = gateway_settings(PROVIDERS, MODELS, responses=responses)
    async with run_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url) as http:
        many = [{"role": "user", "content": str(i)} for i in range(21)]
        over = await http.post("/v1/conversations", json={"items": many})
        assert over.status_code == 400 and over.json()["error"]["param"] == "items"
        tags = {str(i): "v" for i in range(17)}
        assert (await http.post("/v1/conversations", json={"metadata": tags})).status_code == 400
        cid = (await http.post("/v1/conversations", json={})).json()["id"]
        big = [{"role": "user", "content": "x" * 3000}]
        assert (
            await http.post(f"/v1/conversations/{cid}/items", json={"items": big})
        ).status_code == 200
        more = await http.post(f"/v1/conversations/{cid}/items", json={"items": big})
        assert more.status_code == 400
        assert more.json()["error"]["code"] == "conversation_too_large"
        turn = await http.post(
            "/v1/responses",
            json={"model": "chat", "input": "y" * 2000, "conversation": cid, "store": False},
        )
        assert turn.status_code == 200 and turn.headers["x-tailguard-stored"] == "false"
        items = (await http.get(f"/v1/conversations/{cid}/items")).json()["data"]
        assert len(items) == 1  # unchanged


async def test_replicas_sharing_redis_see_each_others_changes(redis_server: RedisServer) -> None:
    """A conversation made on replica A is continued on B, then read and changed on A again:
    each replica reads the newest version from Redis, not the copy its memory holds."""
    shared = {"store": "redis", "redis_url": redis_server.url}
    settings = gateway_settings(PROVIDERS, MODELS, responses=shared)
    async with (
        run_gateway(settings) as gw_a,
        run_gateway(settings) as gw_b,
        httpx.AsyncClient(base_url=gw_a.url) as a,
        httpx.AsyncClient(base_url=gw_b.url) as b,
    ):
        cid = (
            await a.post("/v1/conversations", json={"items": [{"role": "user", "content": "1"}]})
        ).json()["id"]
        assert (await a.get(f"/v1/conversations/{cid}/items")).status_code == 200

        async def read_by_b() -> httpx.Response | None:  # A's write is off the request path
            seen = await b.get(f"/v1/conversations/{cid}")
            return None if seen.status_code == 503 else seen

        seen = await eventually(read_by_b, within_s=20, what="the conversation to be written")
        assert seen.status_code == 200, seen.text
        turn = await b.post(
            "/v1/responses", json={"model": "chat", "input": "2", "conversation": cid}
        )
        assert turn.status_code == 200, turn.text

        async def three_items() -> bool:  # B's write is off the request path
            return len((await a.get(f"/v1/conversations/{cid}/items")).json()["data"]) == 3

        await eventually(three_items, within_s=20, what="A to see B's turn")
        assert (await b.delete(f"/v1/conversations/{cid}")).status_code == 200
        assert (await a.get(f"/v1/conversations/{cid}")).status_code == 404
