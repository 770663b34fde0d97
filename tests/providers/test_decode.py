"""Classifying upstream events and bodies: content, usage, finish, in-band errors, garbage."""

from __future__ import annotations

import pytest

from gateway.models import Chunk, InBandError, SSEEvent, Usage
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    OpenAIStreamDecoder,
    UpstreamProtocolError,
    anthropic_error,
    decode_anthropic_body,
    decode_openai_body,
    openai_error,
)
from gateway.scrubbing import MARGIN_CHARS, Scrubber
from gateway.sse import SSEParser


def openai_events(stream: bytes) -> list[Chunk]:
    decoder = OpenAIStreamDecoder(scrub=Scrubber.GENERIC)
    return [decoder.decode(event) for event in SSEParser().feed(stream)]


def anthropic_events(stream: bytes) -> list[Chunk]:
    decoder = AnthropicStreamDecoder(scrub=Scrubber.GENERIC)
    return [decoder.decode(event) for event in SSEParser().feed(stream)]


# --- OpenAI-compatible streams ------------------------------------------------------------------

OPENAI_CHAT_STREAM = (
    b'data: {"id":"chatcmpl-9Qx","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"gpt-4.1","system_fingerprint":"fp_1","choices":[{"index":0,"delta":'
    b'{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],'
    b'"usage":null}\n\n'
    b": keep-alive\n\n"
    b'data: {"id":"chatcmpl-9Qx","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"gpt-4.1","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,'
    b'"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-9Qx","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"gpt-4.1","choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,'
    b'"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-9Qx","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"gpt-4.1","choices":[{"index":0,"delta":{},"logprobs":null,'
    b'"finish_reason":"stop"}],"usage":null}\n\n'
    b'data: {"id":"chatcmpl-9Qx","object":"chat.completion.chunk","created":1718000000,'
    b'"model":"gpt-4.1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
    b'"total_tokens":11}}\n\n'
    b"data: [DONE]\n\n"
)


def test_openai_chat_stream_is_classified_event_by_event() -> None:
    """A chat stream yields role, keep-alive, content, finish, usage and done chunks in order."""
    role, keepalive, hello, world, finish, usage, done = openai_events(OPENAI_CHAT_STREAM)
    assert (role.content, role.tokens, role.data is not None) == (False, 0, True)
    assert (keepalive.content, keepalive.data, keepalive.raw) == (False, None, b": keep-alive\n\n")
    assert (hello.content, hello.tokens) == (True, 1)
    assert world.content is True
    assert (finish.content, finish.finish_reason) == (False, "stop")
    assert (usage.content, usage.usage) == (False, Usage(input_tokens=9, output_tokens=2))
    assert (done.done, done.content, done.data, done.raw) == (
        True,
        False,
        None,
        b"data: [DONE]\n\n",
    )


def test_openai_raw_is_the_event_frame_untouched() -> None:
    """Each chunk's raw bytes are exactly the upstream frame, so they can be forwarded as-is."""
    chunks = openai_events(OPENAI_CHAT_STREAM)
    assert b"".join(chunk.raw for chunk in chunks) == OPENAI_CHAT_STREAM


def test_openai_usage_null_is_not_usage() -> None:
    """`"usage": null` on ordinary chunks does not produce a Usage."""
    assert openai_events(OPENAI_CHAT_STREAM)[2].usage is None


@pytest.mark.parametrize(
    "delta",
    [
        b'{"reasoning_content":"Let me think"}',
        b'{"reasoning":"Let me think"}',
        b'{"refusal":"I can\'t help with that."}',
        b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
        b'"function":{"name":"get_weather","arguments":""}}]}',
        b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\""}}]}',
    ],
)
def test_openai_generated_deltas_are_content(delta: bytes) -> None:
    """Reasoning text, refusals, tool-call names and tool-call arguments count as content."""
    event = b'data: {"choices":[{"index":0,"delta":' + delta + b',"finish_reason":null}]}\n\n'
    (chunk,) = openai_events(event)
    assert (chunk.content, chunk.tokens) == (True, 1)


@pytest.mark.parametrize(
    "delta",
    [
        b'{"role":"assistant","content":""}',
        b"{}",
        b'{"content":null}',
        b'{"reasoning_content":""}',
        b'{"tool_calls":[{"index":0,"function":{"arguments":""}}]}',
    ],
)
def test_openai_empty_deltas_are_not_content(delta: bytes) -> None:
    """Role-only chunks, empty deltas and empty tool-call fragments carry no content."""
    event = b'data: {"choices":[{"index":0,"delta":' + delta + b',"finish_reason":null}]}\n\n'
    (chunk,) = openai_events(event)
    assert (chunk.content, chunk.tokens) == (False, 0)


def test_vllm_tool_call_stream_counts_name_and_arguments() -> None:
    """vLLM's tool-call chunks (id and name first, then argument fragments) are content."""
    stream = (
        b'data: {"id":"chatcmpl-b5","object":"chat.completion.chunk","created":1718000000,'
        b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":'
        b'{"tool_calls":[{"id":"chatcmpl-tool-4f2","type":"function","index":0,"function":'
        b'{"name":"get_weather"}}]},"logprobs":null,"finish_reason":null}]}\n\n'
        b'data: {"id":"chatcmpl-b5","object":"chat.completion.chunk","created":1718000000,'
        b'"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":'
        b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\": \\"Paris\\"}"}}]},'
        b'"logprobs":null,"finish_reason":"tool_calls"}]}\n\n'
    )
    name, arguments = openai_events(stream)
    assert name.content is True
    assert (arguments.content, arguments.finish_reason) == (True, "tool_calls")


def test_openai_completions_text_is_content() -> None:
    """A legacy completions chunk with non-empty text is content; an empty text is not."""
    stream = (
        b'data: {"id":"cmpl-7","object":"text_completion","created":1718000000,"choices":'
        b'[{"text":" world","index":0,"logprobs":null,"finish_reason":null}],'
        b'"model":"gpt-3.5-turbo-instruct"}\n\n'
        b'data: {"id":"cmpl-7","object":"text_completion","created":1718000000,"choices":'
        b'[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],'
        b'"model":"gpt-3.5-turbo-instruct"}\n\n'
    )
    text, end = openai_events(stream)
    assert (text.content, text.tokens) == (True, 1)
    assert (end.content, end.finish_reason) == (False, "length")


def test_openai_tokens_count_choices_with_content() -> None:
    """With n > 1, one event's token count is the number of choices that carried content."""
    event = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null},'
        b'{"index":1,"delta":{"content":""},"finish_reason":null},'
        b'{"index":2,"delta":{"content":"c"},"finish_reason":null}]}\n\n'
    )
    (chunk,) = openai_events(event)
    assert (chunk.content, chunk.tokens) == (True, 2)


def test_openai_in_band_stream_error() -> None:
    """An OpenAI error object inside the stream becomes an InBandError."""
    event = (
        b'data: {"error":{"message":"The server had an error while processing your request.",'
        b'"type":"server_error","param":null,"code":null}}\n\n'
    )
    (chunk,) = openai_events(event)
    assert chunk.error == InBandError(
        message="The server had an error while processing your request.", type="server_error"
    )
    assert chunk.content is False


def test_vllm_stream_error_takes_status_from_int_code() -> None:
    """vLLM's in-stream error carries the HTTP status as an int `code`."""
    event = (
        b'data: {"error":{"message":"Internal server error","type":"InternalServerError",'
        b'"param":null,"code":500}}\n\n'
    )
    (chunk,) = openai_events(event)
    assert chunk.error == InBandError(
        message="Internal server error", type="InternalServerError", code=None, status=500
    )


def test_openai_event_named_error_is_an_error() -> None:
    """An `event: error` frame is an error even without an `error` key (openai-python agrees)."""
    (chunk,) = openai_events(b'event: error\ndata: {"message":"overloaded"}\n\n')
    assert chunk.error is not None
    assert chunk.error.message == "overloaded"


@pytest.mark.parametrize(
    "stream",
    [
        b"data: <html><body>502 Bad Gateway</body></html>\n\n",
        b"data: {not json\n\n",
        b"data: 42\n\n",
        b'data: {"choices":"nope"}\n\n',
    ],
)
def test_openai_stream_garbage_raises(stream: bytes) -> None:
    """Data that is not a JSON object in the expected shape raises UpstreamProtocolError."""
    with pytest.raises(UpstreamProtocolError):
        openai_events(stream)


def test_protocol_error_message_is_truncated() -> None:
    """The error names the offending bytes, at most about 200 of them plus the margin its
    reader scrubs before cutting (a secret across the cut is masked whole)."""
    junk = b"x" * 10_000
    with pytest.raises(UpstreamProtocolError) as caught:
        openai_events(b"data: " + junk + b"\n\n")
    assert "xxxx" in str(caught.value)
    assert len(str(caught.value)) < 300 + MARGIN_CHARS


# --- OpenAI-compatible bodies -------------------------------------------------------------------


def test_openai_chat_body() -> None:
    """A chat completion is content, with usage tokens and the finish reason."""
    body = (
        b'{"id":"chatcmpl-B9M","object":"chat.completion","created":1741569952,'
        b'"model":"gpt-4.1-2025-04-14","choices":[{"index":0,"message":{"role":"assistant",'
        b'"content":"Hello! How can I assist you today?","refusal":null,"annotations":[]},'
        b'"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":19,'
        b'"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,'
        b'"audio_tokens":0}},"service_tier":"default"}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.raw, chunk.content, chunk.tokens, chunk.finish_reason) == (body, True, 10, "stop")
    assert chunk.usage == Usage(input_tokens=19, output_tokens=10, cached_tokens=0)
    assert chunk.data is not None and chunk.data["id"] == "chatcmpl-B9M"


def test_openai_tool_call_body_without_usage() -> None:
    """Tool calls are content; without usage the token count falls back to choices."""
    body = (
        b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":'
        b'[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1",'
        b'"type":"function","function":{"name":"f","arguments":"{}"}}]},'
        b'"finish_reason":"tool_calls"}]}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.content, chunk.tokens, chunk.usage) == (True, 1, None)
    assert chunk.finish_reason == "tool_calls"


def test_openai_empty_message_body_is_not_content() -> None:
    """A completion whose message is empty carries no content."""
    body = (
        b'{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":""},"finish_reason":"length"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.content, chunk.tokens) == (False, 0)


def test_openai_completions_body() -> None:
    """A legacy completions body with text is content."""
    body = (
        b'{"id":"cmpl-2","object":"text_completion","created":1,"model":"gpt-3.5-turbo-instruct",'
        b'"choices":[{"text":"\\n\\nThis is indeed a test","index":0,"logprobs":null,'
        b'"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":7,'
        b'"total_tokens":12}}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.content, chunk.tokens, chunk.finish_reason) == (True, 7, "length")


def test_openai_embeddings_body() -> None:
    """An embeddings list with data is content and reports only prompt tokens."""
    body = (
        b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":'
        b'[0.0023064255,-0.009327292,-0.0028842222]}],"model":"text-embedding-3-small",'
        b'"usage":{"prompt_tokens":8,"total_tokens":8}}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.content, chunk.tokens) == (True, 0)
    assert chunk.usage == Usage(input_tokens=8, output_tokens=None)


def test_openai_error_body_in_a_200() -> None:
    """`{"error": {...}}` in a body is an in-band error with OpenAI's string code."""
    body = (
        b'{"error":{"message":"Rate limit reached for gpt-4.1 on tokens per min (TPM).",'
        b'"type":"tokens","param":null,"code":"rate_limit_exceeded"}}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert chunk.error == InBandError(
        message="Rate limit reached for gpt-4.1 on tokens per min (TPM).",
        type="tokens",
        code="rate_limit_exceeded",
    )
    assert chunk.content is False


def test_old_vllm_flat_error_body() -> None:
    """Old vLLM's flat `{"object": "error", ..., "code": 400}` is an error with status 400."""
    body = (
        b'{"object":"error","message":"This model\'s maximum context length is 4096 tokens. '
        b'However, you requested 5000 tokens.","type":"BadRequestError","param":null,"code":400}'
    )
    chunk = decode_openai_body(body, scrub=Scrubber.GENERIC)
    assert chunk.error is not None
    assert (chunk.error.type, chunk.error.code, chunk.error.status) == (
        "BadRequestError",
        None,
        400,
    )
    assert chunk.error.message.startswith("This model's maximum context length")


@pytest.mark.parametrize(
    "body",
    [
        b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head></html>",
        b"",
        b"upstream connect error or disconnect/reset before headers",
        b"[1, 2, 3]",
        b'{"hello": "world"}',
    ],
)
def test_openai_body_garbage_raises(body: bytes) -> None:
    """HTML, empty, plain-text or unrecognised bodies raise UpstreamProtocolError."""
    with pytest.raises(UpstreamProtocolError):
        decode_openai_body(body, scrub=Scrubber.GENERIC)


# --- openai_error -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            b'{"error":{"message":"Incorrect API key provided: sk-***.","type":'
            b'"invalid_request_error","param":null,"code":"invalid_api_key"}}',
            InBandError(
                "Incorrect API key provided: sk-***.", "invalid_request_error", "invalid_api_key"
            ),
        ),
        (
            b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError",'
            b'"param":"model","code":404}}',
            InBandError("The model `x` does not exist.", "NotFoundError", None, 404, param="model"),
        ),
        (
            b'{"object":"error","message":"max_tokens must be at least 1","type":'
            b'"BadRequestError","param":null,"code":400}',
            InBandError("max_tokens must be at least 1", "BadRequestError", None, 400),
        ),
        (b'{"error":"Unauthorized"}', InBandError("Unauthorized")),
        (
            b'{"error":"Input validation error: `inputs` must have less than 4096 tokens",'
            b'"error_type":"validation"}',
            InBandError(
                "Input validation error: `inputs` must have less than 4096 tokens", "validation"
            ),
        ),
        (b'{"detail":"Not Found"}', InBandError("Not Found", "invalid_request_error")),
        (
            b'{"detail":[{"type":"missing","loc":["body","messages"],"msg":"Field required"}]}',
            InBandError("Field required", "invalid_request_error"),
        ),
        (b'{"message":"Forbidden"}', InBandError("Forbidden")),
    ],
)
def test_openai_error_shapes(body: bytes, expected: InBandError) -> None:
    """Every error shape an OpenAI-compatible server sends is recognised."""
    assert openai_error(body, scrub=Scrubber.GENERIC) == expected


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>",
        b"",
        b"null",
        b'"text"',
        b'{"id":"chatcmpl-1","choices":[]}',
        b"\xff\xfe",
    ],
)
def test_openai_error_returns_none_for_other_bodies(body: bytes) -> None:
    """Bodies that are not errors, or not JSON, give None rather than raising."""
    assert openai_error(body, scrub=Scrubber.GENERIC) is None


# --- Anthropic streams --------------------------------------------------------------------------

ANTHROPIC_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_01XFDUDYJgAACzvnptvVoYEL",'
    b'"type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5",'
    b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,'
    b'"cache_creation_input_tokens":0,"cache_read_input_tokens":10,"output_tokens":1}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}'
    b"\n\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":15}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)


def test_anthropic_stream_is_classified_event_by_event() -> None:
    """Only non-empty deltas are content; message_delta carries finish and usage; stop is done."""
    start, block, ping, hello, empty, stop_block, delta, stop = anthropic_events(ANTHROPIC_STREAM)
    assert (start.content, start.data is not None) == (False, True)
    assert block.content is False
    assert (ping.content, ping.data) == (False, None)
    assert (hello.content, hello.tokens) == (True, 1)
    assert (empty.content, empty.tokens) == (False, 0)
    assert stop_block.content is False
    assert delta.finish_reason == "end_turn"
    assert delta.usage == Usage(
        input_tokens=35, output_tokens=15, cached_tokens=10, cache_write_tokens=0
    )  # included
    assert (stop.done, stop.content) == (True, False)
    assert b"".join(
        chunk.raw for chunk in (start, block, ping, hello, empty, stop_block, delta, stop)
    ) == (ANTHROPIC_STREAM)


def test_anthropic_tool_and_thinking_deltas() -> None:
    """Tool input and thinking deltas are content; signature deltas and empty input are not."""
    stream = (
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
        b'"thinking":""}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
        b'"thinking":"I need to find the GCD of 1071 and 462."}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta",'
        b'"signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"}}\n\n'
        b"event: content_block_start\n"
        b'data: {"type":"content_block_start","index":1,"content_block":{"type":"tool_use",'
        b'"id":"toolu_01T1x1fJ34qAmk2tNTrN7Up6","name":"get_weather","input":{}}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
        b'"partial_json":""}}\n\n'
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta",'
        b'"partial_json":"{\\"location\\": \\"San Fra"}}\n\n'
    )
    chunks = anthropic_events(stream)
    assert [chunk.content for chunk in chunks] == [False, True, False, False, False, True]


def test_anthropic_overloaded_error_after_message_start() -> None:
    """An `event: error` after a 200 and message_start is an overloaded InBandError (529)."""
    stream = (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
        b'"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,'
        b'"stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":1}}}\n\n'
        b"event: error\n"
        b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}'
        b"\n\n"
    )
    start, error = anthropic_events(stream)
    assert start.error is None
    assert error.error == InBandError(message="Overloaded", type="overloaded_error", status=529)
    assert (error.content, error.done) == (False, False)


def test_anthropic_message_delta_input_tokens_win() -> None:
    """Cumulative input counts on message_delta replace those remembered from message_start."""
    stream = (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":'
        b'"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,'
        b'"usage":{"input_tokens":12,"output_tokens":1}}}\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
        b'"usage":{"input_tokens":14,"cache_read_input_tokens":2,"output_tokens":64}}\n\n'
    )
    _, delta = anthropic_events(stream)
    assert (delta.finish_reason, delta.usage) == ("max_tokens", Usage(16, 64, cached_tokens=2))


def test_anthropic_stream_garbage_raises() -> None:
    """Non-JSON data in an Anthropic stream raises UpstreamProtocolError."""
    with pytest.raises(UpstreamProtocolError):
        anthropic_events(b"event: content_block_delta\ndata: <html>oops</html>\n\n")


def test_anthropic_comment_frame_is_plain() -> None:
    """A comment-only frame is a plain, non-content chunk."""
    (chunk,) = anthropic_events(b": keep-alive\n\n")
    assert (chunk.content, chunk.data, chunk.done, chunk.error) == (False, None, False, None)


# --- Anthropic bodies ---------------------------------------------------------------------------


def test_anthropic_message_body() -> None:
    """A Messages response is content, with its raw stop reason and usage."""
    body = (
        b'{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","content":'
        b'[{"type":"text","text":"Hello!"}],"model":"claude-sonnet-4-5","stop_reason":"end_turn",'
        b'"stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":100,'
        b'"cache_read_input_tokens":0,"output_tokens":6}}'
    )
    chunk = decode_anthropic_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.raw, chunk.content, chunk.tokens, chunk.finish_reason) == (
        body,
        True,
        6,
        "end_turn",
    )
    assert chunk.usage == Usage(
        input_tokens=112, output_tokens=6, cached_tokens=0, cache_write_tokens=100
    )


def test_anthropic_tool_use_body_is_content() -> None:
    """A response with only a tool_use block is content."""
    body = (
        b'{"id":"msg_2","type":"message","role":"assistant","model":"m","content":[{"type":'
        b'"tool_use","id":"toolu_1","name":"get_weather","input":{"location":"Paris"}}],'
        b'"stop_reason":"tool_use","stop_sequence":null}'
    )
    chunk = decode_anthropic_body(body, scrub=Scrubber.GENERIC)
    assert (chunk.content, chunk.tokens, chunk.usage, chunk.finish_reason) == (
        True,
        1,
        None,
        "tool_use",
    )


def test_anthropic_error_body_in_a_200() -> None:
    """An Anthropic error object as a body is an in-band error with its mapped status."""
    body = (
        b'{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens '
        b'has exceeded your per-minute rate limit"},"request_id":"req_011CSHoEeqs5C35K2UUqR7Fy"}'
    )
    chunk = decode_anthropic_body(body, scrub=Scrubber.GENERIC)
    assert chunk.error is not None
    assert (chunk.error.type, chunk.error.status) == ("rate_limit_error", 429)


@pytest.mark.parametrize(
    "body",
    [b"<html>502</html>", b"", b'{"type":"completion"}', b'{"id":"chatcmpl-1","choices":[]}'],
)
def test_anthropic_body_garbage_raises(body: bytes) -> None:
    """Bodies that are not Messages responses raise UpstreamProtocolError."""
    with pytest.raises(UpstreamProtocolError):
        decode_anthropic_body(body, scrub=Scrubber.GENERIC)


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("invalid_request_error", 400),
        ("authentication_error", 401),
        ("permission_error", 403),
        ("not_found_error", 404),
        ("request_too_large", 413),
        ("rate_limit_error", 429),
        ("api_error", 500),
        ("timeout_error", 504),
        ("overloaded_error", 529),
    ],
)
def test_anthropic_error_statuses(kind: str, status: int) -> None:
    """Each Anthropic error type maps to the HTTP status Anthropic documents for it."""
    body = b'{"type":"error","error":{"type":"%s","message":"m"},"request_id":"req_1"}' % (
        kind.encode()
    )
    assert anthropic_error(body, scrub=Scrubber.GENERIC) == InBandError(
        message="m", type=kind, status=status
    )


@pytest.mark.parametrize(
    "body", [b"<html></html>", b"", b"[]", b'{"type":"message"}', b'{"error":"text"}']
)
def test_anthropic_error_returns_none_for_other_bodies(body: bytes) -> None:
    """Bodies that are not Anthropic errors give None rather than raising."""
    assert anthropic_error(body, scrub=Scrubber.GENERIC) is None


@pytest.mark.parametrize(
    "stream",
    [
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0}\n\n',
        b'event: message_start\ndata: {"type":"message_start","message":"msg"}\n\n',
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":1}}\n\n',
    ],
)
def test_anthropic_stream_malformed_events_raise(stream: bytes) -> None:
    """Events missing the fields their type requires raise UpstreamProtocolError."""
    with pytest.raises(UpstreamProtocolError):
        anthropic_events(stream)


LAZY_CASES = [
    b'{"id":"1","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}',
    b'{"id":"1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":null}',
    b'{"id":"1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
    b'{"id":"1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}',
    b'{"id":"1","choices":[{"index":0,"delta":{"content":"say \\"error\\" now"}}]}',
    b'{"id":"1","choices":[{"index":0,"delta":{"content":"x"}},{"index":1,"delta":{"content":"y"}}]}',
    b'{"id":"1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}',
    b'{"id":"1","choices":[{"index":0,"delta":{"content":null,"reasoning_content":"hmm"}}]}',
    b'{"error":{"message":"overloaded","type":"server_error","code":"x"}}',
    b'{"id":"1","choices":[{"index":0,"text":"completion text","finish_reason":null}]}',
]


@pytest.mark.parametrize("data", LAZY_CASES)
def test_lazy_decoder_classifies_like_the_full_one(data: bytes) -> None:
    """Skipping the parse for plain content events never changes how an event is classified."""
    event = SSEEvent(raw=b"data: " + data + b"\n\n", data=data)
    full = OpenAIStreamDecoder(scrub=Scrubber.GENERIC).decode(event)
    lazy = OpenAIStreamDecoder(lazy=True, scrub=Scrubber.GENERIC).decode(event)
    assert (lazy.content, lazy.tokens, lazy.finish_reason, lazy.usage, lazy.error, lazy.done) == (
        full.content,
        full.tokens,
        full.finish_reason,
        full.usage,
        full.error,
        full.done,
    )
    assert lazy.raw == full.raw


def test_lazy_decoder_skips_parsing_plain_content() -> None:
    """The common content event is recognised from its bytes alone (no parsed data)."""
    data = LAZY_CASES[0]
    chunk = OpenAIStreamDecoder(lazy=True, scrub=Scrubber.GENERIC).decode(
        SSEEvent(raw=data, data=data)
    )
    assert (chunk.content, chunk.tokens, chunk.data) == (True, 1, None)
