"""Translating requests, responses and streams between the OpenAI and Anthropic wires.

Stream and response outputs are checked with the official SDKs: their own models validate every
event, and their stream accumulators (fed over an in-memory transport) reassemble the message.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import TypeAdapter

from gateway.models import Chunk, InBandError
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    OpenAIStreamDecoder,
    decode_anthropic_body,
)
from gateway.providers.translate import (
    DEFAULT_MAX_TOKENS,
    AnthropicToOpenAIStream,
    OpenAIPassthrough,
    OpenAIToAnthropicStream,
    StreamTranslator,
    TranslationError,
    anthropic_response_to_openai,
    chat_request_to_anthropic,
    messages_request_to_openai,
    openai_response_to_anthropic,
)
from gateway.scrubbing import Scrubber
from gateway.sse import SSEParser

ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


# --- helpers ------------------------------------------------------------------------------------


def translate(
    stream: bytes,
    decoder: OpenAIStreamDecoder | AnthropicStreamDecoder,
    translator: StreamTranslator,
) -> bytes:
    """Run upstream bytes through the decoder and the translator, as the attempt loop does."""
    return b"".join(translator.feed(decoder.decode(event)) for event in SSEParser().feed(stream))


def data_frames(stream: bytes) -> list[dict[str, Any]]:
    """The JSON data of every event in `stream`, skipping comments and `[DONE]`."""
    return [
        orjson.loads(event.data)
        for event in SSEParser().feed(stream)
        if event.data and event.data != b"[DONE]"
    ]


def sse_response(body: bytes) -> httpx2.MockTransport:
    return httpx2.MockTransport(
        lambda request: httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=body
        )
    )


@contextmanager
def openai_sdk(body: bytes) -> Iterator[openai.OpenAI]:
    """An OpenAI client whose every request is answered with `body`."""
    http = httpx2.Client(transport=sse_response(body))
    with openai.OpenAI(
        api_key="test", base_url="http://gateway.test/v1", http_client=http, max_retries=0
    ) as client:
        yield client


@contextmanager
def anthropic_sdk(body: bytes) -> Iterator[anthropic.Anthropic]:
    """An Anthropic client whose every request is answered with `body`."""
    http = httpx2.Client(transport=sse_response(body))
    with anthropic.Anthropic(
        api_key="test", base_url="http://gateway.test", http_client=http, max_retries=0
    ) as client:
        yield client


HELLO: list[Any] = [{"role": "user", "content": "Hello"}]


# --- requests: OpenAI → Anthropic ---------------------------------------------------------------

OPENAI_REQUEST: dict[str, Any] = {
    "model": "chat-large",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image? And the weather in Paris?"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "high"},
                },
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": ""},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, cloudy"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
        {"role": "user", "content": "Merci"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_completion_tokens": 512,
    "temperature": 0.3,
    "top_p": 0.9,
    "stop": "END",
    "stream": True,
    "stream_options": {"include_usage": True},
    "user": "user-42",
    "seed": 7,
}

ANTHROPIC_EQUIVALENT: dict[str, Any] = {
    "model": "chat-large",
    "system": "You are terse.\n\nAnswer in French.",
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image? And the weather in Paris?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                },
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18°C, cloudy"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": [{"type": "text", "text": "14:05"}],
                },
            ],
        },
        {"role": "user", "content": "Merci"},
    ],
    "max_tokens": 512,
    "temperature": 0.3,
    "top_p": 0.9,
    "stop_sequences": ["END"],
    "stream": True,
    "metadata": {"user_id": "user-42"},
    "tools": [
        {
            "name": "get_weather",
            "description": "Current weather in a city",
            "input_schema": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
    ],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
}


def test_chat_request_to_anthropic() -> None:
    """A full chat request (system, images, tool calls, tool results, tools) becomes Messages."""
    assert chat_request_to_anthropic(OPENAI_REQUEST) == ANTHROPIC_EQUIVALENT


def test_chat_request_translation_does_not_mutate_input() -> None:
    """The caller's body is left as it was."""
    before = copy.deepcopy(OPENAI_REQUEST)
    chat_request_to_anthropic(OPENAI_REQUEST)
    assert before == OPENAI_REQUEST


def test_chat_request_defaults_max_tokens() -> None:
    """Anthropic requires max_tokens, so a request without one gets the default."""
    assert chat_request_to_anthropic({"messages": HELLO}) == {
        "messages": HELLO,
        "max_tokens": DEFAULT_MAX_TOKENS,
    }


def test_chat_request_legacy_max_tokens_and_stop_list() -> None:
    """`max_tokens` is used when `max_completion_tokens` is absent; a stop list stays a list."""
    out = chat_request_to_anthropic({"messages": HELLO, "max_tokens": 10, "stop": ["a", "b"]})
    assert (out["max_tokens"], out["stop_sequences"]) == (10, ["a", "b"])


def test_chat_request_clamps_temperature() -> None:
    """OpenAI's 0-2 temperature is clamped to Anthropic's 0-1."""
    assert chat_request_to_anthropic({"messages": HELLO, "temperature": 1.7})["temperature"] == 1.0


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("auto", {"type": "auto"}),
        ("none", {"type": "none"}),
        ("required", {"type": "any"}),
        (
            {"type": "function", "function": {"name": "get_time"}},
            {"type": "tool", "name": "get_time"},
        ),
    ],
)
def test_chat_tool_choice(choice: object, expected: dict[str, Any]) -> None:
    """Each OpenAI tool_choice has its Anthropic spelling."""
    body = {"messages": HELLO, "tools": OPENAI_REQUEST["tools"], "tool_choice": choice}
    assert chat_request_to_anthropic(body)["tool_choice"] == expected


def test_chat_json_schema_becomes_output_format() -> None:
    """A json_schema response_format becomes Anthropic's structured output format."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "messages": HELLO,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    assert chat_request_to_anthropic(body)["output_config"] == {
        "format": {"type": "json_schema", "schema": schema}
    }


def test_chat_pdf_file_becomes_document() -> None:
    """A PDF sent as file_data becomes a base64 document block titled with its filename."""
    part = {
        "type": "file",
        "file": {"filename": "report.pdf", "file_data": "data:application/pdf;base64,JVBERi0x"},
    }
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert chat_request_to_anthropic(body)["messages"][0]["content"] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0x"},
            "title": "report.pdf",
        }
    ]


def test_chat_text_file_becomes_text_document() -> None:
    """A plain-text file becomes a text document block with the decoded text."""
    part = {"type": "file", "file": {"file_data": "data:text/plain;base64,aGVsbG8="}}
    body = {"messages": [{"role": "user", "content": [part]}]}
    assert chat_request_to_anthropic(body)["messages"][0]["content"] == [
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "hello"},
        }
    ]


def test_chat_tool_ids_are_made_anthropic_safe() -> None:
    """Tool-call ids with characters Anthropic refuses are rewritten the same way everywhere."""
    call = {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup"}}
    body = {
        "messages": [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "functions.lookup:0", "content": "ok"},
        ]
    }
    assistant, results = chat_request_to_anthropic(body)["messages"]
    assert assistant["content"][0]["id"] == "functions_lookup_0"
    assert results["content"][0]["tool_use_id"] == "functions_lookup_0"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO, "n": 2}, "n"),
        ({"messages": HELLO, "logprobs": True}, "logprobs"),
        ({"messages": HELLO, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": HELLO, "modalities": ["text", "audio"]}, "modalities"),
        ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"messages": HELLO, "tools": [{"type": "custom", "custom": {"name": "x"}}]},
            "tools[0].type",
        ),
        ({"messages": "Hello"}, "messages"),
        ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}
                ]
            },
            "messages[0].content[0].file.file_data",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": "not json"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_chat_untranslatable_inputs_raise(body: dict[str, Any], param: str) -> None:
    """What Messages cannot express raises TranslationError naming the field."""
    with pytest.raises(TranslationError) as caught:
        chat_request_to_anthropic(body)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)


# --- requests: Anthropic → OpenAI ---------------------------------------------------------------

ANTHROPIC_REQUEST: dict[str, Any] = {
    "model": "claude-proxy",
    "max_tokens": 1024,
    "system": [
        {"type": "text", "text": "You are a weather bot."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"},
                },
                {"type": "text", "text": "Where is this, and what's the weather?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Looks like Paris.", "signature": "EqQB"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "18°C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ],
    "tools": [
        {
            "name": "get_weather",
            "description": "Current weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\nHuman:"],
    "temperature": 0.5,
    "top_k": 40,
    "stream": True,
    "metadata": {"user_id": "u-7"},
    "thinking": {"type": "enabled", "budget_tokens": 512},
}


def test_messages_request_to_openai() -> None:
    """A full Messages request becomes a chat request, with usage asked for when streaming."""
    assert messages_request_to_openai(ANTHROPIC_REQUEST) == {
        "model": "claude-proxy",
        "messages": [
            {"role": "system", "content": "You are a weather bot.\n\nBe brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
                    {"type": "text", "text": "Where is this, and what's the weather?"},
                ],
            },
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "toolu_01A",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_01A", "content": "18°C"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "max_completion_tokens": 1024,
        "temperature": 0.5,
        "stop": ["\n\nHuman:"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "reasoning_effort": "low",
        "safety_identifier": hashlib.sha256(b"u-7").hexdigest(),
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
    }


def test_messages_request_string_system_and_url_image() -> None:
    """A string system prompt and a URL image source translate directly; no stream options."""
    body = {
        "max_tokens": 5,
        "system": "Be kind.",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}
                ],
            }
        ],
    }
    assert messages_request_to_openai(body) == {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}],
            },
        ],
        "max_completion_tokens": 5,
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_messages_tool_choice(choice: dict[str, Any], expected: object) -> None:
    """Each Anthropic tool_choice has its OpenAI spelling."""
    body = {
        "max_tokens": 5,
        "messages": HELLO,
        "tools": ANTHROPIC_REQUEST["tools"],
        "tool_choice": choice,
    }
    assert messages_request_to_openai(body)["tool_choice"] == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "max_tokens": 5,
                "messages": HELLO,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0].type",
        ),
        ({"max_tokens": 5, "messages": HELLO, "mcp_servers": [{"type": "url"}]}, "mcp_servers"),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [
                                    {"type": "image", "source": {"type": "url", "url": "u"}}
                                ],
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].content[0].type",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "search_result"}]}],
            },
            "messages[0].content[0].type",
        ),
    ],
)
def test_messages_untranslatable_inputs_raise(body: dict[str, Any], param: str) -> None:
    """What chat completions cannot express raises TranslationError naming the field."""
    with pytest.raises(TranslationError) as caught:
        messages_request_to_openai(body)
    assert caught.value.param == param


def test_openai_request_round_trip_keeps_the_meaning() -> None:
    """OpenAI → Anthropic → OpenAI gives back the same conversation, tools and settings."""
    back = messages_request_to_openai(chat_request_to_anthropic(OPENAI_REQUEST))
    assert back == {
        "model": "chat-large",
        "messages": [
            {"role": "system", "content": "You are terse.\n\nAnswer in French."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image? And the weather in Paris?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                    },
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                ],
            },
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, cloudy"},
            {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
            {"role": "user", "content": "Merci"},
        ],
        "max_completion_tokens": 512,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": ["END"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "safety_identifier": hashlib.sha256(b"user-42").hexdigest(),
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather in a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "get_time",
                    "parameters": {"type": "object", "properties": {}},
                },
            },
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }


def test_anthropic_request_round_trip_keeps_the_meaning() -> None:
    """Anthropic → OpenAI → Anthropic keeps the conversation; only reasoning history is lost."""
    back = chat_request_to_anthropic(messages_request_to_openai(ANTHROPIC_REQUEST))
    assert back["system"] == "You are a weather bot.\n\nBe brief."
    assert back["messages"] == [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/4AAQ"},
                },
                {"type": "text", "text": "Where is this, and what's the weather?"},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "18°C"}],
        },
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert (back["max_tokens"], back["stop_sequences"]) == (1024, ["\n\nHuman:"])
    assert back["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert back["tools"] == ANTHROPIC_REQUEST["tools"]


# --- responses ----------------------------------------------------------------------------------

ANTHROPIC_MESSAGE: dict[str, Any] = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": "EqQB"},
        {"type": "text", "text": "I'll check "},
        {"type": "text", "text": "the weather."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 100,
        "cache_creation_input_tokens": 20,
        "cache_read_input_tokens": 1000,
        "output_tokens": 50,
    },
}


def test_anthropic_response_to_openai() -> None:
    """A Messages response becomes a chat.completion the OpenAI SDK accepts."""
    completion = ChatCompletion.model_validate(
        orjson.loads(anthropic_response_to_openai(ANTHROPIC_MESSAGE, model="chat-large"))
    )
    assert (completion.id, completion.model, completion.object) == (
        "chatcmpl-msg_01XFDUDYJgAACzvnptvVoYEL",
        "chat-large",
        "chat.completion",
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll check the weather."
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert (call.id, call.function.name, orjson.loads(call.function.arguments)) == (
        "toolu_01",
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.message.model_extra == {"reasoning_content": "The user wants weather."}
    assert completion.usage is not None
    assert (
        completion.usage.prompt_tokens,
        completion.usage.completion_tokens,
        completion.usage.total_tokens,
    ) == (1120, 50, 1170)
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 1000


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("stop_sequence", "stop"),
        ("refusal", "content_filter"),
        ("pause_turn", "stop"),
    ],
)
def test_stop_reasons_map_to_finish_reasons(stop_reason: str, finish_reason: str) -> None:
    """Each Anthropic stop_reason has its OpenAI finish_reason."""
    message = {
        **ANTHROPIC_MESSAGE,
        "content": [{"type": "text", "text": "x"}],
        "stop_reason": stop_reason,
    }
    out = orjson.loads(anthropic_response_to_openai(message, model="m"))
    assert out["choices"][0]["finish_reason"] == finish_reason


OPENAI_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
    "object": "chat.completion",
    "created": 1741570283,
    "model": "gpt-4.1-2025-04-14",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Checking the weather.",
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "call_abc",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
                "annotations": [],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 1117,
        "completion_tokens": 46,
        "total_tokens": 1163,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    },
}


def test_openai_response_to_anthropic() -> None:
    """A chat.completion becomes a Messages response the Anthropic SDK accepts."""
    message = Message.model_validate(
        orjson.loads(openai_response_to_anthropic(OPENAI_COMPLETION, model="claude-proxy"))
    )
    assert (message.id, message.model, message.role, message.stop_reason) == (
        "msg_chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "claude-proxy",
        "assistant",
        "tool_use",
    )
    text, tool = message.content
    assert text.type == "text" and text.text == "Checking the weather."
    assert tool.type == "tool_use"
    assert (tool.id, tool.name, tool.input) == ("call_abc", "get_weather", {"city": "Paris"})
    assert (
        message.usage.input_tokens,
        message.usage.cache_read_input_tokens,
        message.usage.output_tokens,
    ) == (93, 1024, 46)


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("function_call", "tool_use"),
        ("content_filter", "refusal"),
    ],
)
def test_finish_reasons_map_to_stop_reasons(finish_reason: str, stop_reason: str) -> None:
    """Each OpenAI finish_reason has its Anthropic stop_reason."""
    choice = {**OPENAI_COMPLETION["choices"][0], "finish_reason": finish_reason}
    out = orjson.loads(
        openai_response_to_anthropic({**OPENAI_COMPLETION, "choices": [choice]}, model="m")
    )
    assert out["stop_reason"] == stop_reason


def test_vllm_reasoning_response_to_anthropic() -> None:
    """vLLM's reasoning_content becomes a thinking block before the text."""
    body = {
        "id": "chatcmpl-9",
        "object": "chat.completion",
        "created": 1,
        "model": "Qwen/Qwen3-8B",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "42", "reasoning_content": "6 x 7"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22},
    }
    message = Message.model_validate(orjson.loads(openai_response_to_anthropic(body, model="m")))
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "6 x 7"
    assert text.type == "text" and text.text == "42"
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
        "end_turn",
        10,
        12,
    )


def test_response_round_trip_through_decode() -> None:
    """A translated Anthropic response decodes as content with the same usage and finish."""
    chunk = decode_anthropic_body(
        openai_response_to_anthropic(OPENAI_COMPLETION, model="m"), scrub=Scrubber.GENERIC
    )
    assert (chunk.content, chunk.finish_reason, chunk.tokens) == (True, "tool_use", 46)


# --- streams: Anthropic → OpenAI ----------------------------------------------------------------

ANTHROPIC_TOOL_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_014p7gG3wDgGV9EUtLvnow3U","type":'
    b'"message","role":"assistant","model":"claude-opus-4-6","stop_sequence":null,"usage":'
    b'{"input_tokens":472,"cache_read_input_tokens":128,"output_tokens":2},"content":[],'
    b'"stop_reason":null}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
    b'"thinking":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    b'"thinking":"The user wants the weather."}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta",'
    b'"signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}\n\n'
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Okay"}}'
    b"\n\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta",'
    b'"text":", let\'s check the weather."}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":1}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":2,"content_block":{"type":"tool_use",'
    b'"id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta",'
    b'"partial_json":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta",'
    b'"partial_json":"{\\"location\\":"}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta",'
    b'"partial_json":" \\"San Francisco, CA\\"}"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":2}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
    b'"usage":{"output_tokens":89}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)


def anthropic_to_openai(stream: bytes, *, include_usage: bool) -> bytes:
    translator = AnthropicToOpenAIStream(model="chat-large", include_usage=include_usage)
    return translate(stream, AnthropicStreamDecoder(scrub=Scrubber.GENERIC), translator)


def test_anthropic_stream_to_openai_sdk() -> None:
    """The OpenAI SDK's stream helper reassembles text, tool call, finish and usage."""
    out = anthropic_to_openai(ANTHROPIC_TOOL_STREAM, include_usage=True)
    with (
        openai_sdk(out) as client,
        client.chat.completions.stream(
            model="chat-large", messages=HELLO, stream_options={"include_usage": True}
        ) as stream,
    ):
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    (choice,) = completion.choices
    assert choice.message.content == "Okay, let's check the weather."
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name, orjson.loads(call.function.arguments)) == (
        "toolu_01T1x1fJ34qAmk2tNTrN7Up6",
        "get_weather",
        {"location": "San Francisco, CA"},
    )
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (600, 89)
    assert completion.usage.total_tokens == 689


def test_anthropic_stream_to_openai_chunks_are_valid() -> None:
    """Every frame is a valid chunk sharing one id and created, usage null until the last."""
    out = anthropic_to_openai(ANTHROPIC_TOOL_STREAM, include_usage=True)
    assert out.endswith(b"data: [DONE]\n\n")
    chunks = [ChatCompletionChunk.model_validate(data) for data in data_frames(out)]
    assert len({(chunk.id, chunk.created, chunk.model) for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = [c.choices[0].delta.model_extra for c in chunks if c.choices]
    assert {"reasoning_content": "The user wants the weather."} in reasoning
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert all(b'"usage":null' in line for line in out.split(b"\n\n")[:-3] if line)


def test_anthropic_stream_to_openai_without_usage() -> None:
    """Without include_usage there is no usage chunk and no usage key."""
    out = anthropic_to_openai(ANTHROPIC_TOOL_STREAM, include_usage=False)
    assert b"usage" not in out
    frames = data_frames(out)
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert out.endswith(b'"finish_reason":"tool_calls"}]}\n\ndata: [DONE]\n\n')


def test_anthropic_ping_and_block_stop_send_nothing() -> None:
    """Pings and content_block_stop produce no bytes."""
    translator = AnthropicToOpenAIStream(model="m", include_usage=False)
    decoder = AnthropicStreamDecoder(scrub=Scrubber.GENERIC)
    events = SSEParser().feed(
        b'event: ping\ndata: {"type": "ping"}\n\n'
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    )
    assert [translator.feed(decoder.decode(event)) for event in events] == [b"", b""]


def test_anthropic_overloaded_error_reaches_openai_client_as_error() -> None:
    """An in-band overloaded error mid-stream becomes an error event the OpenAI SDK raises on."""
    stream = ANTHROPIC_TOOL_STREAM.split(b"event: content_block_start")[0] + (
        b"event: error\n"
        b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}'
        b"\n\n"
    )
    out = anthropic_to_openai(stream, include_usage=False)
    assert b"[DONE]" not in out
    with (
        openai_sdk(out) as client,
        pytest.raises(openai.APIError, match="Overloaded"),
    ):
        for _ in client.chat.completions.create(model="m", messages=HELLO, stream=True):
            pass


# --- streams: OpenAI → Anthropic ----------------------------------------------------------------


def openai_chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-7Qy",
        "object": "chat.completion.chunk",
        "created": 1718000000,
        "model": "Qwen/Qwen3-8B",
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


VLLM_STREAM = b"".join(
    [
        openai_chunk({"role": "assistant", "content": ""}),
        b": keep-alive\n\n",
        openai_chunk({"reasoning_content": "Two cities, "}),
        openai_chunk({"reasoning_content": "two calls."}),
        openai_chunk({"content": "Checking "}),
        openai_chunk({"content": "both."}),
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-a1",
                        "type": "function",
                        "index": 0,
                        "function": {"name": "get_weather"},
                    }
                ]
            }
        ),
        openai_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        openai_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        openai_chunk(
            {
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-b2",
                        "type": "function",
                        "index": 1,
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                    }
                ]
            }
        ),
        openai_chunk({}, "tool_calls"),
        openai_chunk(
            None,
            usage={
                "prompt_tokens": 300,
                "completion_tokens": 42,
                "total_tokens": 342,
                "prompt_tokens_details": {"cached_tokens": 256},
            },
        ),
        b"data: [DONE]\n\n",
    ]
)


def openai_to_anthropic(stream: bytes) -> bytes:
    return translate(
        stream,
        OpenAIStreamDecoder(scrub=Scrubber.GENERIC),
        OpenAIToAnthropicStream(model="claude-proxy"),
    )


def test_openai_stream_to_anthropic_sdk() -> None:
    """The Anthropic SDK's stream helper reassembles thinking, text, two tool calls and usage."""
    out = openai_to_anthropic(VLLM_STREAM)
    with (
        anthropic_sdk(out) as client,
        client.messages.stream(model="claude-proxy", max_tokens=100, messages=HELLO) as stream,
    ):
        for _ in stream:
            pass
        message = stream.get_final_message()
    assert message.model == "claude-proxy"
    assert message.id == "msg_chatcmpl-7Qy"
    thinking, text, paris, rome = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Two cities, two calls."
    assert text.type == "text" and text.text == "Checking both."
    assert paris.type == "tool_use" and rome.type == "tool_use"
    assert (paris.id, paris.name, paris.input) == (
        "chatcmpl-tool-a1",
        "get_weather",
        {"city": "Paris"},
    )
    assert (rome.id, rome.input) == ("chatcmpl-tool-b2", {"city": "Rome"})
    assert message.stop_reason == "tool_use"
    assert (
        message.usage.input_tokens,
        message.usage.cache_read_input_tokens,
        message.usage.output_tokens,
    ) == (44, 256, 42)


def test_openai_stream_to_anthropic_events_are_valid() -> None:
    """Every event validates as a documented Messages stream event, named by its type."""
    out = openai_to_anthropic(VLLM_STREAM)
    events = [event for event in SSEParser().feed(out) if event.data]
    kinds = []
    for event in events:
        data = orjson.loads(event.data)
        ANTHROPIC_EVENT.validate_python(data)
        assert event.event == data["type"]
        kinds.append(data["type"])
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    assert b": keep-alive\n\n" in out  # keep-alives stay keep-alives


def test_openai_text_stream_without_usage_to_anthropic() -> None:
    """A plain text stream with no usage chunk ends with end_turn and zero output tokens."""
    stream = (
        openai_chunk({"role": "assistant", "content": "Hi"})
        + openai_chunk({"content": " there"}, "stop")
        + b"data: [DONE]\n\n"
    )
    out = openai_to_anthropic(stream)
    with (
        anthropic_sdk(out) as client,
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream_,
    ):
        message = stream_.get_final_message()
    (text,) = message.content
    assert text.type == "text" and text.text == "Hi there"
    assert (message.stop_reason, message.usage.output_tokens) == ("end_turn", 0)


def test_openai_stream_length_finish_to_anthropic() -> None:
    """A `length` finish becomes `max_tokens`."""
    stream = openai_chunk({"content": "a"}, "length") + b"data: [DONE]\n\n"
    frames = data_frames(openai_to_anthropic(stream))
    assert frames[-2]["delta"] == {
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "stop_details": None,
        "container": None,
    }


def test_openai_stream_error_reaches_anthropic_client_as_error() -> None:
    """An OpenAI in-band error becomes an Anthropic `event: error` the SDK raises on."""
    stream = openai_chunk({"content": "a"}) + (
        b'data: {"error":{"message":"The server had an error while processing your request.",'
        b'"type":"server_error","param":null,"code":null}}\n\n'
    )
    out = openai_to_anthropic(stream)
    assert out.split(b"\n")[-4:-2] == [
        b"event: error",
        b'data: {"type":"error","error":{"type":"api_error","message":'
        b'"The server had an error while processing your request."}}',
    ]
    with (
        anthropic_sdk(out) as client,
        pytest.raises(anthropic.APIError, match="The server had an error"),
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream_,
    ):
        stream_.get_final_message()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InBandError("slow down", "rate_limit_error", status=429), "rate_limit_error"),
        (InBandError("busy", "ServiceUnavailableError", status=503), "overloaded_error"),
        (InBandError("bad", "BadRequestError", status=400), "invalid_request_error"),
        (InBandError("oops"), "api_error"),
    ],
)
def test_in_band_errors_get_anthropic_types(error: InBandError, kind: str) -> None:
    """An in-band error's Anthropic type follows its type, else its status."""
    out = OpenAIToAnthropicStream(model="m").feed(Chunk(raw=b"", error=error))
    assert orjson.loads(out.split(b"data: ")[1])["error"] == {
        "type": kind,
        "message": error.message,
    }


def test_anthropic_stream_round_trip() -> None:
    """Anthropic → OpenAI → Anthropic reassembles the same text, tool call and stop reason."""
    out = openai_to_anthropic(anthropic_to_openai(ANTHROPIC_TOOL_STREAM, include_usage=True))
    with (
        anthropic_sdk(out) as client,
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream,
    ):
        message = stream.get_final_message()
    thinking, text, tool = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
    assert text.type == "text" and text.text == "Okay, let's check the weather."
    assert tool.type == "tool_use" and tool.input == {"location": "San Francisco, CA"}
    assert (message.stop_reason, message.usage.output_tokens) == ("tool_use", 89)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (472, 128)


# --- streams: OpenAI passthrough ----------------------------------------------------------------

USAGE_CHUNK = openai_chunk(
    None, usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
)
PASSTHROUGH_STREAM = (
    openai_chunk({"role": "assistant", "content": ""})
    + b": keep-alive\n\n"
    + openai_chunk({"content": "Hi"}, "stop")
    + USAGE_CHUNK
    + b"data: [DONE]\n\n"
)


def test_passthrough_forwards_everything_when_usage_asked() -> None:
    """With include_usage the upstream stream is forwarded byte for byte."""
    out = translate(
        PASSTHROUGH_STREAM,
        OpenAIStreamDecoder(scrub=Scrubber.GENERIC),
        OpenAIPassthrough(include_usage=True),
    )
    assert out == PASSTHROUGH_STREAM


def test_passthrough_drops_usage_chunk_when_not_asked() -> None:
    """Without include_usage only the usage-only chunk is dropped."""
    out = translate(
        PASSTHROUGH_STREAM,
        OpenAIStreamDecoder(scrub=Scrubber.GENERIC),
        OpenAIPassthrough(include_usage=False),
    )
    assert out == PASSTHROUGH_STREAM.replace(USAGE_CHUNK, b"")


def test_openai_stream_without_tool_indexes_to_anthropic() -> None:
    """Tool calls without `index` (each new id starts a call) still become separate blocks."""
    stream = (
        openai_chunk({"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"x"'}}]})
        + openai_chunk({"tool_calls": [{"function": {"arguments": ": 1}"}}]})
        + openai_chunk({"tool_calls": [{"id": "b", "function": {"name": "g", "arguments": "{}"}}]})
        + openai_chunk({}, "tool_calls")
        + b"data: [DONE]\n\n"
    )
    out = openai_to_anthropic(stream)
    with (
        anthropic_sdk(out) as client,
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream_,
    ):
        message = stream_.get_final_message()
    first, second = message.content
    assert first.type == "tool_use" and (first.id, first.name, first.input) == ("a", "f", {"x": 1})
    assert second.type == "tool_use" and (second.id, second.name, second.input) == ("b", "g", {})


def test_openai_to_anthropic_sends_nothing_after_an_error() -> None:
    """Once an error event is sent, later chunks (even [DONE]) produce no bytes."""
    translator = OpenAIToAnthropicStream(model="m")
    assert translator.feed(Chunk(raw=b"", error=InBandError("boom"))).startswith(b"event: error")
    assert translator.feed(Chunk(raw=b"data: [DONE]\n\n", done=True)) == b""


def test_empty_openai_stream_still_forms_a_message() -> None:
    """A stream that is only [DONE] still gives the Anthropic client a whole, empty message."""
    out = openai_to_anthropic(b"data: [DONE]\n\n")
    with (
        anthropic_sdk(out) as client,
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as stream_,
    ):
        message = stream_.get_final_message()
    assert (message.content, message.stop_reason) == ([], "end_turn")


# --- prompt caching -----------------------------------------------------------------------------

EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
HOUR: dict[str, Any] = {"type": "ephemeral", "ttl": "1h"}


def test_chat_cache_markers_are_carried_to_anthropic() -> None:
    """Anthropic-style `cache_control` markers an OpenAI client puts on content parts, whole
    messages and tools land on the blocks and tools they become (a part's own marker wins over
    its message's); a marked system prompt stays in blocks; `prompt_cache_key` and
    `prompt_cache_retention`, which Anthropic does not take, are dropped."""
    body = {
        "model": "m",
        "prompt_cache_key": "tenant-7",
        "prompt_cache_retention": "24h",
        "messages": [
            {"role": "system", "content": "You are terse.", "cache_control": HOUR},
            {
                "role": "developer",
                "content": [
                    {"type": "text", "text": "Answer in French."},
                    {"type": "text", "text": ""},
                    {"type": "text", "text": "Cite sources.", "cache_control": EPHEMERAL},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "A long document.", "cache_control": EPHEMERAL},
                    {
                        "type": "image_url",
                        "image_url": {"url": "https://example.com/cat.jpg"},
                        "cache_control": HOUR,
                    },
                    {"type": "text", "text": "What is it?"},
                ],
                "cache_control": HOUR,  # the last part's: the first two have their own
            },
            {"role": "assistant", "content": "A cat.", "cache_control": EPHEMERAL},
            {"role": "user", "content": "And this?", "cache_control": EPHEMERAL},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok", "cache_control": EPHEMERAL},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": "done", "cache_control": HOUR}],
            },
        ],
        "tools": [
            {"type": "function", "function": {"name": "f"}, "cache_control": EPHEMERAL},
            {"type": "function", "function": {"name": "g"}},
        ],
    }
    assert chat_request_to_anthropic(body) == {
        "model": "m",
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": HOUR},
            {"type": "text", "text": "Answer in French."},
            {"type": "text", "text": "Cite sources.", "cache_control": EPHEMERAL},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "A long document.", "cache_control": EPHEMERAL},
                    {
                        "type": "image",
                        "source": {"type": "url", "url": "https://example.com/cat.jpg"},
                        "cache_control": HOUR,
                    },
                    {"type": "text", "text": "What is it?", "cache_control": HOUR},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "A cat.", "cache_control": EPHEMERAL}],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "And this?", "cache_control": EPHEMERAL}],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "c1",
                        "content": "ok",
                        "cache_control": EPHEMERAL,
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "c1",
                        "content": [{"type": "text", "text": "done", "cache_control": HOUR}],
                    },
                ],
            },
        ],
        "max_tokens": DEFAULT_MAX_TOKENS,
        "tools": [
            {
                "name": "f",
                "input_schema": {"type": "object", "properties": {}},
                "cache_control": EPHEMERAL,
            },
            {"name": "g", "input_schema": {"type": "object", "properties": {}}},
        ],
    }


def test_chat_cache_marker_that_is_not_an_object_is_dropped() -> None:
    """A `cache_control` that is not an object is left out rather than refused or forwarded."""
    body = {
        "messages": [
            {"role": "system", "content": "Be brief.", "cache_control": "ephemeral"},
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": True}]},
        ]
    }
    out = chat_request_to_anthropic(body)
    assert (out["system"], out["messages"]) == (
        "Be brief.",
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    )


def test_messages_cache_markers_are_dropped_towards_openai() -> None:
    """Anthropic `cache_control` on system blocks, user, assistant and tool-result blocks and
    tools never reaches an OpenAI-compatible upstream, and is never refused."""
    body = {
        "max_tokens": 10,
        "system": [{"type": "text", "text": "Long rules.", "cache_control": HOUR}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Doc.", "cache_control": EPHEMERAL},
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                        "cache_control": EPHEMERAL,
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me see.", "cache_control": EPHEMERAL},
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "f",
                        "input": {},
                        "cache_control": EPHEMERAL,
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "ok", "cache_control": EPHEMERAL}],
                        "cache_control": EPHEMERAL,
                    }
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}],
    }
    out = messages_request_to_openai(body)
    assert b"cache_control" not in orjson.dumps(out)
    assert out["messages"] == [
        {"role": "system", "content": "Long rules."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Doc."}, {"type": "text", "text": "x"}],
        },
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
    ]
    assert out["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]


CACHED_ANTHROPIC_USAGE: dict[str, Any] = {
    "input_tokens": 20,
    "cache_creation_input_tokens": 300,
    "cache_read_input_tokens": 1000,
    "output_tokens": 7,
}
CACHED_OPENAI_USAGE: dict[str, Any] = {
    "prompt_tokens": 1320,
    "completion_tokens": 7,
    "total_tokens": 1327,
    "prompt_tokens_details": {"cached_tokens": 1000, "cache_write_tokens": 300},
}


def test_anthropic_cache_counts_reach_an_openai_client_whole() -> None:
    """A Messages answer's cache reads and writes count in `prompt_tokens`; reads are
    `prompt_tokens_details.cached_tokens` and writes `prompt_tokens_details.cache_write_tokens`."""
    data = {**ANTHROPIC_MESSAGE, "usage": CACHED_ANTHROPIC_USAGE}
    completion = ChatCompletion.model_validate(
        orjson.loads(anthropic_response_to_openai(data, model="m"))
    )
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.total_tokens) == (1320, 1327)
    details = completion.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 1000
    assert details.cache_write_tokens == 300


def test_anthropic_cache_counts_reach_an_openai_client_streamed() -> None:
    """The same counts, remembered from message_start, end a translated stream's usage chunk."""
    stream = ANTHROPIC_TOOL_STREAM.replace(
        b'{"input_tokens":472,"cache_read_input_tokens":128,"output_tokens":2}',
        orjson.dumps({**CACHED_ANTHROPIC_USAGE, "output_tokens": 1}),
    )
    assert stream != ANTHROPIC_TOOL_STREAM
    out = anthropic_to_openai(stream, include_usage=True)
    with (
        openai_sdk(out) as client,
        client.chat.completions.stream(
            model="m", messages=HELLO, stream_options={"include_usage": True}
        ) as events,
    ):
        completion = events.get_final_completion()
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (1320, 89)
    details = completion.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 1000
    assert details.cache_write_tokens == 300


def test_openai_cache_counts_reach_an_anthropic_client_whole() -> None:
    """A chat answer's cached and cache-written tokens leave Anthropic's `input_tokens` and
    become `cache_read_input_tokens` and `cache_creation_input_tokens`."""
    data = {**OPENAI_COMPLETION, "usage": CACHED_OPENAI_USAGE}
    message = Message.model_validate(orjson.loads(openai_response_to_anthropic(data, model="m")))
    usage = message.usage
    assert (
        usage.input_tokens,
        usage.cache_read_input_tokens,
        usage.cache_creation_input_tokens,
        usage.output_tokens,
    ) == (20, 1000, 300, 7)


def test_openai_cache_counts_reach_an_anthropic_client_streamed() -> None:
    """The same, from a stream's usage chunk to its `message_delta`."""
    stream = VLLM_STREAM.replace(
        orjson.dumps(
            {
                "prompt_tokens": 300,
                "completion_tokens": 42,
                "total_tokens": 342,
                "prompt_tokens_details": {"cached_tokens": 256},
            }
        ),
        orjson.dumps({**CACHED_OPENAI_USAGE, "completion_tokens": 42}),
    )
    assert stream != VLLM_STREAM
    with (
        anthropic_sdk(openai_to_anthropic(stream)) as client,
        client.messages.stream(model="m", max_tokens=100, messages=HELLO) as events,
    ):
        message = events.get_final_message()
    usage = message.usage
    assert (
        usage.input_tokens,
        usage.cache_read_input_tokens,
        usage.cache_creation_input_tokens,
        usage.output_tokens,
    ) == (20, 1000, 300, 42)


def test_usage_without_cache_counts_has_no_cache_fields() -> None:
    """With no cache reads or writes, OpenAI's usage gains no cache-write field, and Anthropic's
    counts its cache fields as 0 (its schema requires them)."""
    plain = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    to_anthropic = orjson.loads(
        openai_response_to_anthropic({**OPENAI_COMPLETION, "usage": plain}, model="m")
    )
    usage = to_anthropic["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (10, 2)
    assert (usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]) == (0, 0)
    to_openai = orjson.loads(
        anthropic_response_to_openai(
            {**ANTHROPIC_MESSAGE, "usage": {"input_tokens": 10, "output_tokens": 2}}, model="m"
        )
    )
    assert to_openai["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
