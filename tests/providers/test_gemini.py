"""`type: gemini`: every client wire on the Gemini API, through the chat <-> generateContent
translation, against a fake of the API that checks the key and the request's schema
(`tests/fakes/gemini_upstream.py`), all over real HTTP on loopback."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.providers.translate.gemini import chat_request_to_gemini
from gateway.providers.translate.gemini_answers import GeminiToChatStream, gemini_response_to_chat
from gateway.scrubbing import Scrubber
from tests.conftest import serve
from tests.fakes.gemini_upstream import THOUGHT, GeminiFake
from tests.google_harness import (
    CHAT,
    chat_tool_round_trip,
    messages_tool_round_trip,
    model,
    open_gateway,
    responses_tool_round_trip,
    sse,
)
from tests.schemas import validate, validate_error, validate_stream

API_KEY = "AIzaSyFAKE-configured-gemini-key-0123456789"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image bytes").decode()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[GeminiFake, str]]:
    app = GeminiFake(api_key=API_KEY)
    async with serve(app) as url:
        yield app, url


def providers(url: str, key: str = API_KEY) -> dict[str, Any]:
    return {
        "gemini": {"type": "gemini", "base_url": url, "api_key": key},
        "local": {"type": "simulated", "default_profile": {"output_tokens": 4}},
    }


def gemini(fake: tuple[GeminiFake, str], *models: dict[str, Any]) -> Any:
    return open_gateway(providers(fake[1]), *models)


# --- chat ----------------------------------------------------------------------------------------


async def test_chat_reaches_generate_content_and_comes_back(fake: tuple[GeminiFake, str]) -> None:
    """A chat request becomes a generateContent call (key in x-goog-api-key, system prompt in
    systemInstruction, sampling in generationConfig); its answer a valid chat completion."""
    app, _ = fake
    async with gemini(fake, model("g", "gemini/gemini-2.5-flash@cached=2")) as c:
        answer = await c.post(
            "/v1/chat/completions",
            {
                "model": "g",
                "messages": CHAT,
                "max_tokens": 50,
                "temperature": 0.2,
                "top_p": 0.9,
                "stop": "END",
                "seed": 7,
                "user": "dropped",
            },
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    validate("chat", "CreateChatCompletionResponse", body)
    assert body["choices"][0]["message"]["content"] == "Hello from the fake Claude"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert body["usage"]["completion_tokens"] == 5
    sent = app.requests[-1]
    assert sent.path == "/v1beta/models/gemini-2.5-flash@cached=2:generateContent"
    assert sent.headers["x-goog-api-key"] == API_KEY
    assert "authorization" not in sent.headers
    assert sent.body["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert sent.body["contents"] == [{"role": "user", "parts": [{"text": "hello there"}]}]
    assert sent.body["generationConfig"] == {
        "maxOutputTokens": 50,
        "temperature": 0.2,
        "topP": 0.9,
        "seed": 7,
        "stopSequences": ["END"],
    }


async def test_chat_stream_is_exact_openai_chunks(fake: tuple[GeminiFake, str]) -> None:
    """A streamed answer: role chunk, one content chunk per Gemini event, the finish chunk, the
    usage chunk and [DONE], each a valid chunk of one id; SDK clients read it whole."""
    app, _ = fake
    async with gemini(fake, model("g", "gemini/gemini-2.5-flash")) as c:
        raw = await c.post(
            "/v1/chat/completions",
            {
                "model": "g",
                "messages": CHAT,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        stream = await c.openai.chat.completions.create(model="g", messages=CHAT, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    validate_stream("chat", raw.content)
    events = sse(raw.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [ch["choices"][0]["delta"].get("content") for ch in chunks[1:6]] == [
        "Hello",
        " from",
        " the",
        " fake",
        " Claude",
    ]
    assert chunks[6]["choices"][0]["finish_reason"] == "stop"
    assert chunks[7]["choices"] == [] and chunks[7]["usage"]["completion_tokens"] == 5
    assert text == "Hello from the fake Claude"
    assert app.requests[-1].path.endswith(":streamGenerateContent")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_tool_round_trip_on_every_wire(fake: tuple[GeminiFake, str], stream: bool) -> None:
    """Chat, Responses and Messages each hold a tool round trip with a Gemini 3 model: the
    function call's id and thought signature come back to Gemini through the tool-call id."""
    app, _ = fake
    async with gemini(fake, model("g", "gemini/gemini-3-pro-preview@tool")) as c:
        await chat_tool_round_trip(c, "g", stream=stream)
        await responses_tool_round_trip(c, "g", stream=stream)
        await messages_tool_round_trip(c, "g", stream=stream)
    followups = [r.body for r in app.requests if len(r.body["contents"]) > 1]
    assert len(followups) == 3
    for body in followups:
        call_turn, answer_turn = body["contents"][-2:]
        (call,) = call_turn["parts"]
        assert call["thoughtSignature"] in app.signatures  # the real one, not the skip value
        assert call["functionCall"]["id"].startswith("fc-")
        (response,) = answer_turn["parts"]
        assert response["functionResponse"] == {
            "name": "get_weather",
            "response": {"forecast": "sunny"},
            "id": call["functionCall"]["id"],
        }
        declaration = body["tools"][0]["functionDeclarations"][0]
        assert declaration["parametersJsonSchema"]["additionalProperties"] is False


async def test_tool_choice_response_format_and_images_are_translated(
    fake: tuple[GeminiFake, str],
) -> None:
    app, _ = fake
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    async with gemini(fake, model("g", "gemini/gemini-2.5-flash")) as c:
        await c.openai.chat.completions.create(
            model="g",
            messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}],
            tools=[
                {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
            ],
            tool_choice={"type": "function", "function": {"name": "look"}},
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object"}},
            },
        )
    sent = app.requests[-1].body
    assert sent["contents"][0]["parts"][1] == {"inlineData": {"mimeType": "image/png", "data": PNG}}
    assert sent["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["look"]}
    }
    assert sent["generationConfig"]["responseMimeType"] == "application/json"
    assert sent["generationConfig"]["responseJsonSchema"] == {"type": "object"}


async def test_reasoning_becomes_thinking_and_back(fake: tuple[GeminiFake, str]) -> None:
    """`reasoning_effort` becomes a thinking budget; thought parts come back as
    `reasoning_content` (chat), a thinking block (Messages), and the thought tokens are counted
    as reasoning tokens."""
    app, _ = fake
    async with gemini(fake, model("g", "gemini/gemini-2.5-pro@thinking")) as c:
        chat = await c.post(
            "/v1/chat/completions", {"model": "g", "messages": CHAT, "reasoning_effort": "low"}
        )
        sent = app.requests[-1].body["generationConfig"]["thinkingConfig"]
        streamed = await c.post(
            "/v1/messages",
            {
                "model": "g",
                "max_tokens": 4000,
                "stream": True,
                "thinking": {"type": "enabled", "budget_tokens": 2000},
                "messages": [{"role": "user", "content": "hello"}],
            },
        )
    assert sent == {"thinkingBudget": 1024, "includeThoughts": True}
    message = chat.json()["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT
    assert chat.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    assert chat.json()["usage"]["completion_tokens"] == 8
    validate_stream("messages", streamed.content)
    thinking = [
        e["delta"]["thinking"]
        for e in sse(streamed.content)
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
    ]
    assert "".join(thinking) == THOUGHT


def test_thinking_levels_and_budgets_by_model() -> None:
    """Gemini 3 takes a thinking level; 2.5 a budget, off for `none` except on Pro."""

    def thinking(effort: str, model: str) -> Any:
        body = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": effort}
        return chat_request_to_gemini(body, model)["generationConfig"]["thinkingConfig"]

    assert thinking("high", "gemini-3-pro-preview") == {
        "thinkingLevel": "high",
        "includeThoughts": True,
    }
    assert thinking("none", "gemini-2.5-flash") == {"thinkingBudget": 0, "includeThoughts": False}
    assert thinking("none", "gemini-2.5-pro") == {"thinkingBudget": 128, "includeThoughts": True}
    assert thinking("medium", "gemini-2.5-pro")["thinkingBudget"] == 8192


# --- safety --------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["safety", "blocked"])
async def test_safety_blocks_are_the_content_filter_answer(
    fake: tuple[GeminiFake, str], script: str
) -> None:
    """`finishReason: SAFETY` and `promptFeedback.blockReason` are the content-filter answer of
    each wire, whole and streamed, and valid by its schema."""
    async with gemini(fake, model("g", f"gemini/gemini-2.5-flash@{script}")) as c:
        chat = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        chat_stream = await c.post(
            "/v1/chat/completions", {"model": "g", "messages": CHAT, "stream": True}
        )
        messages = await c.post(
            "/v1/messages",
            {"model": "g", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]},
        )
        responses = await c.post("/v1/responses", {"model": "g", "input": "hi"})
    validate("chat", "CreateChatCompletionResponse", chat.json())
    assert chat.json()["choices"][0]["finish_reason"] == "content_filter"
    validate_stream("chat", chat_stream.content)
    finishes = [
        ch["finish_reason"]
        for e in sse(chat_stream.content)
        if e != "[DONE]"
        for ch in e["choices"]
        if ch["finish_reason"]
    ]
    assert finishes == ["content_filter"]
    validate("messages", "Message", messages.json())
    assert messages.json()["stop_reason"] == "refusal"
    validate("responses", "ResponseResource", responses.json())
    assert responses.json()["incomplete_details"] == {"reason": "content_filter"}


# --- errors, failover and secrets ----------------------------------------------------------------


async def test_exhausted_quota_fails_over_and_cools_down(fake: tuple[GeminiFake, str]) -> None:
    """429 RESOURCE_EXHAUSTED is a rate limit: the fallback answers, and the throttled
    deployment rests (its RetryInfo delay) instead of being asked again at once."""
    app, _ = fake
    async with gemini(
        fake,
        model("g", "gemini/gemini-2.5-flash@status=429", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        first = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
        second = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
    assert first.headers["x-tailguard-deployment"] == "local/m"
    assert second.headers["x-tailguard-deployment"] == "local/m"
    assert len(app.requests) == 1  # cooling down: not asked the second time


async def test_unavailable_fails_over(fake: tuple[GeminiFake, str]) -> None:
    async with gemini(
        fake,
        model("g", "gemini/gemini-2.5-flash@status=503", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        raw = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
    assert raw.headers["x-tailguard-deployment"] == "local/m"
    assert raw.headers["x-tailguard-route"] == "error_fallback"


async def test_an_error_inside_the_stream_before_content_fails_over(
    fake: tuple[GeminiFake, str],
) -> None:
    """An error event in a 200 stream, before any content, is a failover: the client sees only
    the fallback's answer."""
    async with gemini(
        fake,
        model("g", "gemini/gemini-2.5-flash@inband_unavailable", fallbacks=["backup"]),
        model("backup", "gemini/gemini-2.5-flash@words=3"),
    ) as c:
        raw = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT, "stream": True})
    assert raw.headers["x-tailguard-route"] == "error_fallback"
    validate_stream("chat", raw.content)
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in sse(raw.content) if e != "[DONE]"
    )
    assert text == "Hello from the"


def test_google_credentials_are_scrubbed_wherever_they_appear() -> None:
    """A Google OAuth token or API key is masked in any upstream text, configured or not."""
    text = "token ya29.a0AfB_byC-secret-token.part and key AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUv"
    cleaned = Scrubber.GENERIC(text)
    assert "secret-token" not in cleaned and "SyA1b2" not in cleaned
    assert cleaned == "token ya29.*** and key AIza***"


async def test_invalid_argument_is_the_clients_400_on_its_wire(
    fake: tuple[GeminiFake, str],
) -> None:
    """400 INVALID_ARGUMENT is the client's own bad request, in its wire's error shape, and
    not retried on the next deployment."""
    app, _ = fake
    async with gemini(
        fake,
        model("g", "gemini/gemini-2.5-flash@status=400", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        chat = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        messages = await c.post(
            "/v1/messages",
            {"model": "g", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert chat.status_code == messages.status_code == 400
    validate_error("chat", chat.json())
    validate_error("messages", messages.json())
    assert chat.json()["error"]["code"] == "INVALID_ARGUMENT"
    assert len(app.requests) == 2


async def test_a_wrong_key_is_an_auth_failure_not_a_bad_request(
    fake: tuple[GeminiFake, str],
) -> None:
    """The Gemini API answers a wrong key with 400 API_KEY_INVALID: the gateway takes it as a
    credential failure (the next deployment answers), and the key is never repeated."""
    _, url = fake
    wrong = "AIzaSyWRONG-key-that-must-stay-secret-000"
    async with open_gateway(
        providers(url, wrong),
        model("alone", "gemini/gemini-2.5-flash"),
        model("g", "gemini/gemini-2.5-pro", fallbacks=["backup"]),
        model("backup", "local/m"),
    ) as c:
        alone = await c.post("/v1/chat/completions", {"model": "alone", "messages": CHAT})
        rescued = await c.openai.chat.completions.with_raw_response.create(model="g", messages=CHAT)
    assert alone.status_code == 502, alone.text
    assert "credentials" in alone.json()["error"]["message"]
    assert rescued.headers["x-tailguard-deployment"] == "local/m"
    assert wrong not in alone.text


async def test_an_echoed_credential_is_scrubbed(fake: tuple[GeminiFake, str]) -> None:
    """An upstream error that repeats the key reaches no client with it."""
    async with gemini(fake, model("g", "gemini/gemini-2.5-flash@status=401")) as c:
        chat = await c.post("/v1/chat/completions", {"model": "g", "messages": CHAT})
        stream = await c.post(
            "/v1/chat/completions", {"model": "g", "messages": CHAT, "stream": True}
        )
    assert chat.status_code == stream.status_code == 502
    assert API_KEY not in chat.text + stream.text


def test_a_stream_cut_short_is_not_finished() -> None:
    """Without a finishReason the translated stream never says [DONE]: the gateway sees a
    truncated stream, not a complete answer."""
    stream = GeminiToChatStream(model="g", include_usage=True)
    out = stream.feed({"candidates": [{"content": {"parts": [{"text": "Hel"}]}, "index": 0}]})
    assert b'"content":"Hel"' in out
    assert stream.end() == b""
    finished = GeminiToChatStream(model="g", include_usage=False)
    finished.feed({"candidates": [{"content": {"parts": [{"text": "x"}]}, "finishReason": "STOP"}]})
    assert finished.end() == b"data: [DONE]\n\n"


def test_untranslatable_requests_are_refused_naming_the_field() -> None:
    from gateway.providers.translate.shapes import TranslationError

    with pytest.raises(TranslationError) as caught:
        chat_request_to_gemini(
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom"}]}, "m"
        )
    assert caught.value.param == "tools[0].type"
    with pytest.raises(TranslationError):
        chat_request_to_gemini({"messages": [{"role": "tool", "tool_call_id": "nope"}]}, "m")


def test_candidates_are_choices_whole_and_streamed() -> None:
    """`n` asks for candidates; each candidate is the choice of its index, with its own finish."""
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    assert chat_request_to_gemini(body, "m")["generationConfig"] == {"candidateCount": 2}
    answer = {
        "candidates": [
            {"content": {"parts": [{"text": "a"}]}, "finishReason": "STOP", "index": 0},
            {"content": {"parts": [{"text": "b"}]}, "finishReason": "MAX_TOKENS", "index": 1},
        ],
        "usageMetadata": {"promptTokenCount": 1, "candidatesTokenCount": 2},
    }
    whole = gemini_response_to_chat(answer, model="m")
    validate("chat", "CreateChatCompletionResponse", whole)
    assert [
        (c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]
    ] == [
        (0, "a", "stop"),
        (1, "b", "length"),
    ]
    stream = GeminiToChatStream(model="m", include_usage=True)
    raw = stream.feed(answer) + stream.end()
    validate_stream("chat", raw)
    finishes = {
        ch["index"]: ch["finish_reason"]
        for e in sse(raw)
        if e != "[DONE]"
        for ch in e["choices"]
        if ch["finish_reason"]
    }
    assert finishes == {0: "stop", 1: "length"}
