"""Codex CLI's Responses requests on deployments that do not serve the Responses API: translated
to chat completions or to Messages, over real HTTP, against the scripted agent upstream.

`CODEX_REQUEST` has the shape Codex CLI 0.171 sends (recorded from `codex exec`, trimmed): its
own bookkeeping in `client_metadata`, function tools, a `namespace` of functions, the hosted
`web_search`, and the encrypted reasoning it asks to be included. A freeform `custom` tool (as
Codex declares `apply_patch` for some models) and one held to a grammar complete the set.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import orjson
import pytest

from tests.conftest import Gateway, gateway_settings, run_gateway, serve
from tests.fakes.agent_upstream import FINAL_TEXT, AgentUpstream
from tests.telemetry.test_access_log import counted, lines

_STRING: Final = {"type": "string"}
CODEX_REQUEST: Final[dict[str, Any]] = {
    "model": "MODEL",
    "stream": False,
    "input": [
        {
            "type": "message",
            "id": "msg_6546f34d",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are a coding agent."}],
        },
        {
            "type": "message",
            "id": "msg_01a23783",
            "role": "user",
            "content": [{"type": "input_text", "text": "run echo hi in the shell"}],
        },
    ],
    "tools": [
        {
            "type": "function",
            "name": "exec_command",
            "description": "Runs a command in a PTY.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"cmd": _STRING},
                "required": ["cmd"],
                "additionalProperties": False,
            },
        },
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "Tools for spawning and managing sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn_agent",
                    "description": "Spawn a sub-agent.",
                    "strict": False,
                    "parameters": {"type": "object", "properties": {"message": _STRING}},
                },
                {
                    "type": "function",
                    "name": "exec_command",  # taken at the top level: renamed on the chat wire
                    "strict": False,
                    "parameters": {"type": "object", "properties": {"cmd": _STRING}},
                },
            ],
        },
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch."},
        {
            "type": "custom",
            "name": "strict_patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        },
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a23783-e021-7150-a7b8-50f67068bfc7",
    "client_metadata": {
        "session_id": "01a23783-e021-7150-a7b8-50f67068bfc7",
        "x-codex-window-id": "01a23783-e021-7150-a7b8-50f67068bfc7:0",
    },
}
CODEX_HEADERS: Final = {
    "session-id": "01a23783-e021-7150-a7b8-50f67068bfc7",
    "originator": "codex_exec",
    "x-codex-window-id": "01a23783-e021-7150-a7b8-50f67068bfc7:0",
}
ROUTES: Final = ("chat", "claude")  # the two translated deployments
DROPPED: Final = "custom:strict_patch, web_search"


def codex_request(model: str, **changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(CODEX_REQUEST), "model": model, **changes}


@pytest.fixture
async def upstream() -> AsyncIterator[AgentUpstream]:
    fake = AgentUpstream()
    async with serve(fake) as url:
        fake.url = url
        yield fake


def _settings(fake: AgentUpstream, **refusing: Any) -> Any:
    url = fake.url
    providers = {
        "native": {"type": "openai", "base_url": url + "/v1", "responses": "native"},
        "openai": {"type": "openai", "base_url": url + "/v1"},
        "anthropic": {"type": "anthropic", "base_url": url, "api_key": "sk-ant-test"},
    }
    models = [
        {"name": name, "deployments": [{"provider": provider, "model": f"{name}-up"}]}
        for name, provider in (("native", "native"), ("chat", "openai"), ("claude", "anthropic"))
    ]
    models.append(
        {
            "name": "strict",
            "deployments": [{"provider": "openai", "model": "strict-up"}],
            "unsupported_tools": "refuse",
            **refusing,
        }
    )
    return gateway_settings(providers, models)


@pytest.fixture
async def gateway(upstream: AgentUpstream) -> AsyncIterator[Gateway]:
    async with run_gateway(_settings(upstream)) as gw:
        yield gw


@pytest.fixture
async def http(gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as client:
        yield client


def _sent_tools(fake: AgentUpstream) -> dict[str, dict[str, Any]]:
    """The last upstream request's tools by name, in the chat or the Messages shape."""
    tools = fake.requests[-1].body.get("tools") or []
    return {(t.get("function") or t)["name"]: t.get("function") or t for t in tools}


@pytest.mark.parametrize("model", ROUTES)
async def test_codex_request_is_translated_dropping_what_it_cannot_run(
    http: httpx.AsyncClient, upstream: AgentUpstream, model: str
) -> None:
    """`client_metadata` and the hosted tools go (named in a header), the namespace's functions
    and the freeform tool arrive as functions; before, the request was a 400."""
    answer = await http.post("/responses", json=codex_request(model), headers=CODEX_HEADERS)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tailguard-dropped-tools"] == DROPPED
    sent = upstream.requests[-1]
    assert "client_metadata" not in sent.body
    assert not CODEX_HEADERS.keys() & sent.headers.keys()  # for OpenAI's own API only
    tools = _sent_tools(upstream)
    assert set(tools) == {
        "exec_command",
        "spawn_agent",
        "multi_agent_v1__exec_command",
        "apply_patch",
    }
    patch = tools["apply_patch"]
    schema: dict[str, Any] = patch.get("parameters") or patch["input_schema"]
    assert schema["properties"] == {"input": {"type": "string", "description": "The tool's input."}}
    assert schema["required"] == ["input"]
    # The scripted upstream called the shell: the answer's call keeps its plain name.
    (call,) = [i for i in answer.json()["output"] if i["type"] == "function_call"]
    assert call["name"] == "exec_command" and "namespace" not in call


async def test_a_model_set_to_refuse_refuses_hosted_tools(http: httpx.AsyncClient) -> None:
    """`unsupported_tools: refuse`: a 400 in the Responses error shape naming the tool."""
    answer = await http.post("/responses", json=codex_request("strict"))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "tools[3].type"
    assert "'custom'" in error["message"] and "grammar" in error["message"]
    assert "unsupported_tools: refuse" in error["message"]
    body = codex_request("strict")
    body["tools"] = body["tools"][:3] + body["tools"][4:]
    answer = await http.post("/responses", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "tools[3].type"
    assert "'web_search'" in answer.json()["error"]["message"]


async def test_native_upstreams_get_the_request_and_codex_headers_untouched(
    http: httpx.AsyncClient, upstream: AgentUpstream
) -> None:
    answer = await http.post("/responses", json=codex_request("native"), headers=CODEX_HEADERS)
    assert answer.status_code == 200, answer.text
    assert "x-tailguard-dropped-tools" not in answer.headers
    sent = upstream.requests[-1]
    assert sent.body["client_metadata"] == CODEX_REQUEST["client_metadata"]
    assert sent.body["tools"] == CODEX_REQUEST["tools"]
    assert {k: sent.headers.get(k) for k in CODEX_HEADERS} == CODEX_HEADERS
    # Not to a chat request, even to the same upstream.
    chat = {"model": "chat", "messages": [{"role": "user", "content": "Hi"}]}
    assert (await http.post("/chat/completions", json=chat, headers=CODEX_HEADERS)).is_success
    assert not CODEX_HEADERS.keys() & upstream.requests[-1].headers.keys()


# --- calls of namespaced and custom tools, mapped back ------------------------------------------


async def _create(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items of a Response, asked for whole or streamed (then from the events)."""
    if not body.get("stream"):
        answer = await http.post("/responses", json=body)
        assert answer.status_code == 200, answer.text
        return list(answer.json()["output"])
    events = []
    async with http.stream("POST", "/responses", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed", kinds
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]
    custom = [e for e in events if e["type"].startswith("response.custom_tool_call_input")]
    for event in custom:  # a custom call's input arrives in its own events
        assert event["type"] != "response.custom_tool_call_input.done" or event["input"]
    return done


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ROUTES)
async def test_namespaced_call_comes_back_with_its_namespace(
    http: httpx.AsyncClient, upstream: AgentUpstream, model: str, stream: bool
) -> None:
    upstream.call = ("multi_agent_v1__exec_command", '{"cmd": "ls"}')
    (call,) = await _create(http, codex_request(model, stream=stream))
    assert call["type"] == "function_call"
    assert (call["namespace"], call["name"]) == ("multi_agent_v1", "exec_command")
    assert orjson.loads(call["arguments"]) == {"cmd": "ls"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ROUTES)
async def test_freeform_call_comes_back_as_a_custom_tool_call(
    http: httpx.AsyncClient, upstream: AgentUpstream, model: str, stream: bool
) -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    upstream.call = ("apply_patch", orjson.dumps({"input": patch}).decode())
    (call,) = await _create(http, codex_request(model, stream=stream))
    assert call["type"] == "custom_tool_call"
    assert (call["name"], call["input"], call["status"]) == ("apply_patch", patch, "completed")
    assert call["call_id"] and "arguments" not in call


# --- what Codex replays ---------------------------------------------------------------------------


REPLAYED: Final[list[dict[str, Any]]] = [
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "encrypted_content": "gAAAAB-opaque-to-anyone-but-openai",
    },
    {
        "type": "function_call",
        "call_id": "call_ns",
        "namespace": "multi_agent_v1",
        "name": "spawn_agent",
        "arguments": '{"message": "look"}',
    },
    {"type": "function_call_output", "call_id": "call_ns", "output": "agent-1"},
    {"type": "custom_tool_call", "call_id": "call_patch", "name": "apply_patch", "input": "P"},
    {"type": "custom_tool_call_output", "call_id": "call_patch", "output": "Done!"},
    {
        "type": "local_shell_call",
        "id": "lsh_1",
        "call_id": "call_shell",
        "status": "completed",
        "action": {"type": "exec", "command": ["ls"], "env": {}},
    },
    {"type": "local_shell_call_output", "call_id": "call_shell", "output": "a.txt"},
]


async def test_replayed_items_translate_to_chat(
    http: httpx.AsyncClient, upstream: AgentUpstream
) -> None:
    """Reasoning OpenAI encrypted is left out; custom and local shell calls and their outputs
    become tool calls and tool messages. (No tools are declared: a namespaced call takes its
    qualified name.)"""
    body = {"model": "chat", "input": [*CODEX_REQUEST["input"], *REPLAYED]}
    answer = await http.post("/responses", json=body)
    assert answer.status_code == 200, answer.text
    messages = upstream.requests[-1].body["messages"]
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3
    calls = [m["tool_calls"][0] for m in messages if m["role"] == "assistant"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [
        ("call_ns", "multi_agent_v1__spawn_agent"),
        ("call_patch", "apply_patch"),
        ("call_shell", "local_shell"),
    ]
    assert orjson.loads(calls[1]["function"]["arguments"]) == {"input": "P"}
    assert orjson.loads(calls[2]["function"]["arguments"])["command"] == ["ls"]
    outputs = [(m["tool_call_id"], m["content"]) for m in messages if m["role"] == "tool"]
    assert outputs == [("call_ns", "agent-1"), ("call_patch", "Done!"), ("call_shell", "a.txt")]


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({"type": "item_reference", "id": "msg_123"}, "cannot be resolved"),
        ({"type": "compaction", "encrypted_content": "gAAAAB"}, "only that upstream can read"),
    ],
)
async def test_items_only_openai_can_read_are_refused_with_the_reason(
    http: httpx.AsyncClient, item: dict[str, Any], reason: str
) -> None:
    for model in ROUTES:
        body = {"model": model, "input": [item, *CODEX_REQUEST["input"]]}
        answer = await http.post("/responses", json=body)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "input[0].type"
        assert reason in error["message"] and f"'{item['type']}'" in error["message"]


# --- the access log -------------------------------------------------------------------------------


async def test_the_access_log_names_the_dropped_tools(
    gateway: Gateway, http: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    assert (await http.post("/responses", json=codex_request("chat"))).is_success
    plain = {"model": "chat", "input": "Hi"}
    answer = await http.post("/responses", json=plain)
    assert answer.json()["output"][0]["content"][0]["text"] == FINAL_TEXT
    async with httpx.AsyncClient() as client:
        await counted(client, gateway.url, 2)
    logged = [line["dropped_tools"] for line in lines(access)]
    assert logged == [DROPPED.split(", "), None]
