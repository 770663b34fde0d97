"""Responses API requests with a wrong type anywhere get a 400 in the OpenAI shape whose `param`
names the field, over real HTTP: never a 500, never a misleading message, and never a value
forwarded upstream or echoed back in the Response object as it came."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Gateway, gateway_settings, run_gateway

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    providers = {"local": {"type": "simulated", "default_profile": {"output_tokens": 4}}}
    models = [{"name": "chat", "deployments": [{"provider": "local", "model": "chat"}]}]
    async with run_gateway(gateway_settings(providers, models)) as gw:
        yield gw


def _message(role: str, content: Any) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": content}


def _call_output(output: Any) -> list[dict[str, Any]]:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    return [call, {"type": "function_call_output", "call_id": "c1", "output": output}]


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}

# (fields of the request besides `model`, the `param` its 400 names)
WRONG_TYPES: list[tuple[dict[str, Any], str]] = [
    # Top-level fields, refused before routing.
    ({"input": "Hi", "temperature": "hot"}, "temperature"),
    ({"input": "Hi", "top_p": True}, "top_p"),
    ({"input": "Hi", "top_logprobs": "3"}, "top_logprobs"),
    ({"input": "Hi", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": "Hi", "background": 1}, "background"),
    ({"input": "Hi", "include": 5}, "include"),
    ({"input": "Hi", "include": ["message.output_text.logprobs", 5]}, "include[1]"),
    ({"input": "Hi", "metadata": "team-a"}, "metadata"),
    ({"input": "Hi", "user": 42}, "user"),
    ({"input": "Hi", "safety_identifier": ["u"]}, "safety_identifier"),
    ({"input": "Hi", "prompt_cache_key": 7}, "prompt_cache_key"),
    ({"input": "Hi", "tool_choice": 1}, "tool_choice"),
    ({"input": "Hi", "text": "json"}, "text"),
    ({"input": "Hi", "text": {"format": "json_object"}}, "text.format"),
    ({"input": "Hi", "reasoning": "high"}, "reasoning"),
    ({"input": "Hi", "reasoning": {"effort": 3}}, "reasoning.effort"),
    # Nested fields, refused by the translation to chat.
    ({"input": [{"role": ["user"], "content": "Hi"}]}, "input[0].role"),
    ({"input": [{"role": {"a": 1}, "content": "Hi"}]}, "input[0].role"),
    (
        {"input": [_message("assistant", [{"type": "output_text", "text": 5}])]},
        "input[0].content[0].text",
    ),
    (
        {"input": [_message("user", [{"type": "input_text", "text": ["Hi"]}])]},
        "input[0].content[0].text",
    ),
    (
        {"input": [_message("assistant", [{"type": "refusal", "refusal": 1}])]},
        "input[0].content[0].refusal",
    ),
    (
        {"input": [_message("user", [{"type": "input_image", "image_url": 5}])]},
        "input[0].content[0].image_url",
    ),
    (
        {"input": [_message("user", [{"type": "input_image", "image_url": "x", "detail": 2}])]},
        "input[0].content[0].detail",
    ),
    (
        {"input": [_message("user", [{"type": "input_file", "file_data": {"b": 1}}])]},
        "input[0].content[0].file_data",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        "input[0].arguments",
    ),
    ({"input": _call_output([{"type": "input_text", "text": 5}])}, "input[1].output[0].text"),
    ({"input": _call_output(["done"])}, "input[1].output[0]"),
    (
        {"input": "Hi", "instructions": [{"role": 1, "content": "Be brief."}]},
        "instructions[0].role",
    ),
    ({"input": "Hi", "tools": [{**FUNCTION, "parameters": "{}"}]}, "tools[0].parameters"),
    ({"input": "Hi", "tools": [{**FUNCTION, "description": 1}]}, "tools[0].description"),
    ({"input": "Hi", "tools": [{**FUNCTION, "strict": "yes"}]}, "tools[0].strict"),
    (
        {"input": "Hi", "tools": [FUNCTION], "tool_choice": {"type": "function", "name": 5}},
        "tool_choice.name",
    ),
    (
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": "{}"}}},
        "text.format.schema",
    ),
    (
        {"input": "Hi", "text": {"format": {"type": "json_schema", "name": 1, "schema": {}}}},
        "text.format.name",
    ),
]


@pytest.mark.parametrize(("fields", "param"), WRONG_TYPES, ids=[p for _, p in WRONG_TYPES])
async def test_a_wrong_type_is_a_400_naming_the_field(
    gateway: Gateway, fields: dict[str, Any], param: str
) -> None:
    """A value of the wrong JSON type is refused with the field's path in `param`."""
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        response = await http.post("/v1/responses", json={"model": "chat", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert param in error["message"]
    assert "nested too deeply" not in error["message"]


async def test_every_checked_field_of_the_right_type_is_answered(gateway: Gateway) -> None:
    """The same fields with values of the right types are translated and answered, and the
    echoed ones come back in the Response object as sent."""
    request: dict[str, Any] = {
        "model": "chat",
        "instructions": [{"role": "developer", "content": "Be brief."}],
        "input": [
            _message("user", [{"type": "input_text", "text": "Look:"}]),
            _message(
                "user",
                [{"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"}],
            ),
            _message("user", [{"type": "input_file", "file_data": "aGk=", "filename": "a.txt"}]),
            _message("assistant", [{"type": "output_text", "text": "Calling f."}]),
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "done"}],
            },
        ],
        "tools": [{**FUNCTION, "description": "F.", "strict": False}],
        "tool_choice": {"type": "function", "name": "f"},
        "temperature": 0.5,
        "top_p": 1,
        "top_logprobs": 2,
        "parallel_tool_calls": False,
        "include": ["message.output_text.logprobs"],
        "metadata": {"team": "a"},
        "user": "u1",
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
    }
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as sdk:
        response = await sdk.responses.create(**request)
    assert response.status == "completed"
    assert (response.temperature, response.top_p) == (0.5, 1)
    assert response.metadata == {"team": "a"}
    assert response.parallel_tool_calls is False
    assert response.user == "u1"
