"""The simulator honours every parameter a client sends, or refuses it naming it.

Against the simulator as a real HTTP server (httpx and the official openai SDK), and through the
gateway (the simulator as a vLLM server and in-process) with the openai and anthropic SDKs:
`n`, `stop`, `response_format`, tools and `tool_choice`, `logprobs`, `seed`, reasoning tokens,
the prefix cache, `/tokenize`, and the 400 for what it cannot honour.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.sim.engine import SimEngine
from gateway.sim.profile import SimProfile
from gateway.sim.schema import SchemaError, check, generate
from gateway.sim.server import create_sim_app
from gateway.sim.wire import SimConnectionReset
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway, serve

WATCHDOG_S = 10.0

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
}
TIME: Any = {
    "type": "function",
    "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_SCHEMA},
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ORDER_SCHEMA: dict[str, Any] = {
    "$defs": {
        "line": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-\\d{4}$"},
                "quantity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 99},
                "price": {"type": "number", "minimum": 0, "multipleOf": 0.25},
            },
            "required": ["sku", "quantity", "price"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1},
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "lines", "note", "gift"],
    "additionalProperties": False,
}
HELLO: Any = [{"role": "user", "content": "hello there"}]
# An assistant turn that called the weather tool (its result follows as a `tool` message).
CALLED_WEATHER: Any = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
        }
    ],
}


def chat(model: str = "m", messages: Any = None, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": HELLO if messages is None else messages, **extra}


@dataclass
class Sim:
    """A simulator served on loopback, with a raw client and the openai SDK pointed at it."""

    engine: SimEngine
    http: httpx.AsyncClient
    sdk: openai.AsyncOpenAI

    async def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post(path, json=body)

    async def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.post(path, body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    async def events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """The decoded `data:` payloads of a stream; `[DONE]` stays a string."""
        events: list[Any] = []
        async with self.http.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else orjson.loads(data))
        assert events[-1] == "[DONE]"
        return events[:-1]


@asynccontextmanager
async def sim(profile: SimProfile | None = None, *, seed: int = 1) -> AsyncIterator[Sim]:
    engine = SimEngine(default=profile or SimProfile(), seed=seed)
    async with (
        serve(create_sim_app(engine)) as url,
        httpx.AsyncClient(base_url=url, timeout=WATCHDOG_S) as http,
        openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=WATCHDOG_S
        ) as sdk,
    ):
        yield Sim(engine, http, sdk)


def choices_of(events: list[Any]) -> dict[int, dict[str, Any]]:
    """A chat stream's choices put back together: per index, its content, reasoning,
    finish reason, tool calls and logprob entries."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            one = out.setdefault(
                choice["index"],
                {"content": "", "reasoning": "", "finish": None, "calls": {}, "logprobs": []},
            )
            delta = choice["delta"]
            one["content"] += delta.get("content") or ""
            one["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                slot = one["calls"].setdefault(call["index"], {"deltas": [], "arguments": ""})
                slot["deltas"].append(call)
                slot["arguments"] += call["function"].get("arguments") or ""
            if choice["logprobs"] is not None:
                one["logprobs"] += choice["logprobs"]["content"]
            one["finish"] = choice["finish_reason"] or one["finish"]
    return out


def metric(page: str, prefix: str) -> float:
    """The value of the one sample line that starts with `prefix` (name and labels)."""
    found = [line.rsplit(" ", 1)[1] for line in page.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return float(found[0])


# --- n, stop, max_tokens ----------------------------------------------------------------------


async def test_n_choices_have_their_own_index_streamed_or_not() -> None:
    """`n` choices, indexed 0..n-1, each its own text; the stream gives each choice its own
    role chunk, tokens and finish, and the same texts under the same seed."""
    async with sim(SimProfile(output_tokens=(4, 12))) as s:
        whole = await s.ok("/v1/chat/completions", chat(n=3, seed=7))
        events = await s.events("/v1/chat/completions", chat(n=3, seed=7))
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert whole["usage"]["completion_tokens"] == sum(len(t.split()) for t in texts)
    streamed = choices_of(events)
    assert [streamed[i]["content"] for i in range(3)] == texts
    assert {streamed[i]["finish"] for i in range(3)} == {"stop"}
    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1, 2]


async def test_a_stream_of_several_choices_ends_as_one() -> None:
    """Closing a stream of `n` choices frees every slot at once (one cancelled request); a cut
    stops them all (one fault)."""
    engine = SimEngine(default=SimProfile(output_tokens=100, tokens_per_s=1000, max_batch=2))
    body = chat(n=3, stream=True)
    reply = await engine.handle("POST", "/v1/chat/completions", orjson.dumps(body))
    assert reply.stream is not None
    await anext(reply.stream)
    stats = engine.stats
    assert (stats.running, stats.waiting, stats.open_streams) == (2, 1, 1)
    await reply.stream.aclose()
    assert (stats.running, stats.waiting, stats.open_streams, stats.cancelled) == (0, 0, 0, 1)
    cut = await engine.handle(
        "POST", "/v1/chat/completions", orjson.dumps({**body, "model": "m@cut_rate=1"})
    )
    assert cut.stream is not None
    with pytest.raises(SimConnectionReset):
        async for _ in cut.stream:
            pass
    assert (stats.running, stats.waiting, stats.open_streams, stats.faults) == (0, 0, 0, 1)
    assert stats.completed == 0


async def test_stop_sequences_cut_the_text_before_their_first_occurrence() -> None:
    """The answer ends where a stop sequence first occurs (left out unless
    `include_stop_str_in_output`), `finish_reason: stop`, streamed or not, chat or completions."""
    async with sim(SimProfile(output_tokens=60)) as s:
        full = (await s.ok("/v1/chat/completions", chat(seed=3)))["choices"][0]["message"]
        cut = await s.ok("/v1/chat/completions", chat(seed=3, stop=["zzz", "fox"]))
        single = await s.ok("/v1/chat/completions", chat(seed=3, stop="fox"))
        kept = await s.ok(
            "/v1/chat/completions", chat(seed=3, stop=["fox"], include_stop_str_in_output=True)
        )
        events = await s.events("/v1/chat/completions", chat(seed=3, stop=["fox"]))
        absent = await s.ok("/v1/chat/completions", chat(seed=3, stop=["zzz"]))
        text = (await s.ok("/v1/completions", {"model": "m", "prompt": "p", "seed": 3}))["choices"]
        stopped = await s.ok(
            "/v1/completions", {"model": "m", "prompt": "p", "seed": 3, "stop": ["latency"]}
        )
    content = full["content"]
    assert "fox" in content  # 60 words of a 53-word cycle: every word occurs
    before = content[: content.index("fox")]
    choice = cut["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (before, "stop")
    assert cut["usage"]["completion_tokens"] < 60
    assert single["choices"][0]["message"]["content"] == before
    assert kept["choices"][0]["message"]["content"] == before + "fox"
    assert choices_of(events)[0]["content"] == before
    assert choices_of(events)[0]["finish"] == "stop"
    assert absent["choices"][0]["message"]["content"] == content
    whole_text = text[0]["text"]
    assert stopped["choices"][0]["text"] == whole_text[: whole_text.index("latency")]
    assert stopped["choices"][0]["finish_reason"] == "stop"


async def test_max_tokens_ends_an_answer_with_length() -> None:
    """`max_tokens` and `max_completion_tokens` cap the answer (`finish_reason: length`),
    JSON content included: it is cut where the budget ran out."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER_SCHEMA}}
    async with sim(SimProfile(output_tokens=50)) as s:
        capped = await s.ok("/v1/chat/completions", chat(max_completion_tokens=4))
        whole = await s.ok("/v1/chat/completions", chat(seed=2, response_format=schema_format))
        short = await s.ok(
            "/v1/chat/completions", chat(seed=2, response_format=schema_format, max_tokens=5)
        )
    assert capped["choices"][0]["finish_reason"] == "length"
    assert len(capped["choices"][0]["message"]["content"].split()) == 4
    document = whole["choices"][0]["message"]["content"]
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] == 5
    assert short["choices"][0]["message"]["content"] == document[:20]  # 4 characters a token


# --- structured output ------------------------------------------------------------------------


async def test_json_schema_content_validates_against_the_schema() -> None:
    """`response_format: json_schema` answers JSON valid against the schema (drawn anew per
    seed), streamed or not; `json_object` answers a JSON object; `text` answers text."""
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    async with sim(SimProfile(output_tokens=8)) as s:
        documents = [
            (await s.ok("/v1/chat/completions", chat(seed=seed, response_format=fmt)))
            for seed in range(12)
        ]
        events = await s.events("/v1/chat/completions", chat(seed=5, response_format=fmt))
        obj = await s.ok("/v1/chat/completions", chat(response_format={"type": "json_object"}))
        plain = await s.ok("/v1/chat/completions", chat(response_format={"type": "text"}))
    values = [orjson.loads(d["choices"][0]["message"]["content"]) for d in documents]
    for value in values:
        jsonschema.validate(value, ORDER_SCHEMA)
    assert len({orjson.dumps(v) for v in values}) == len(values)
    assert {d["choices"][0]["finish_reason"] for d in documents} == {"stop"}
    assert orjson.loads(choices_of(events)[0]["content"]) == values[5]
    assert isinstance(orjson.loads(obj["choices"][0]["message"]["content"]), dict)
    assert len(plain["choices"][0]["message"]["content"].split()) == 8


# --- tools --------------------------------------------------------------------------------------


def assert_valid_calls(calls: list[Any]) -> None:
    """Each call names a known function and its arguments validate against its schema."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_")
        assert call.type == "function"
        jsonschema.validate(orjson.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_tool_choice_decides_whether_and_which_tool_is_called() -> None:
    """`auto` calls a tool unless the last message is a tool result (then it answers in text,
    so an agent loop ends); `none` never calls; `required` always; a named function is the one
    called; `tool_call_rate` 0 makes `auto` answer in text."""
    after_result = [
        *HELLO,
        CALLED_WEATHER,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    async with sim(SimProfile(output_tokens=5)) as s:

        async def create(**extra: Any) -> Any:
            extra.setdefault("messages", HELLO)
            extra.setdefault("model", "m")
            return (await s.sdk.chat.completions.create(tools=[WEATHER, TIME], **extra)).choices[0]

        auto = await create()
        none = await create(tool_choice="none")
        required = await create(tool_choice="required", messages=after_result)
        answered = await create(messages=after_result)
        named = await create(tool_choice={"type": "function", "function": {"name": "get_time"}})
        never = await create(model="m@tool_call_rate=0")
        with pytest.raises(openai.BadRequestError) as unknown:
            await create(tool_choice={"type": "function", "function": {"name": "nope"}})
    assert (auto.finish_reason, auto.message.content) == ("tool_calls", None)
    assert_valid_calls(auto.message.tool_calls)
    for text in (none, answered, never):
        assert text.finish_reason == "stop"
        assert text.message.tool_calls is None
        assert len((text.message.content or "").split()) == 5
    assert required.finish_reason == "tool_calls"
    assert_valid_calls(required.message.tool_calls)
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    assert_valid_calls(named.message.tool_calls)
    assert unknown.value.param == "tool_choice"


async def test_streamed_tool_calls_arrive_as_argument_deltas() -> None:
    """A streamed call opens with its id, type and name, then sends its arguments in several
    fragments; the SDK's stream helper puts them back together into valid arguments."""
    async with sim(SimProfile(reasoning_tokens=2)) as s:
        events = await s.events("/v1/chat/completions", chat(tools=[WEATHER], seed=4))
        async with s.sdk.chat.completions.stream(
            model="m", messages=HELLO, tools=[WEATHER, TIME], seed=4
        ) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
    calls = choices_of(events)[0]["calls"]
    assert list(calls) == [0]
    first, *rest = calls[0]["deltas"]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) > 1
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest
    )
    jsonschema.validate(orjson.loads(calls[0]["arguments"]), WEATHER_SCHEMA)
    assert choices_of(events)[0]["finish"] == "tool_calls"
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls or [])


async def test_parallel_tool_calls_up_to_the_profile_limit() -> None:
    """With `parallel_tool_calls` allowed (the default) an answer makes 1 to the profile's
    `parallel_tool_calls` calls; `parallel_tool_calls: false` makes it one."""
    async with sim() as s:
        counts, single = [], []
        for seed in range(16):
            body = chat("m@parallel_tool_calls=4", tools=[WEATHER, TIME], seed=seed)
            answer = await s.ok("/v1/chat/completions", body)
            calls = answer["choices"][0]["message"]["tool_calls"]
            for call in calls:
                arguments = orjson.loads(call["function"]["arguments"])
                jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
            counts.append(len(calls))
            body["parallel_tool_calls"] = False
            answer = await s.ok("/v1/chat/completions", body)
            single.append(len(answer["choices"][0]["message"]["tool_calls"]))
    assert set(counts) <= {1, 2, 3, 4}
    assert max(counts) > 1
    assert set(single) == {1}


# --- logprobs, seed, reasoning ------------------------------------------------------------------


async def test_chat_logprobs_cover_every_content_token() -> None:
    """`logprobs` gives each content token its log probability and bytes, `top_logprobs` that
    many alternatives (the token first, likeliest first); streamed per chunk too."""
    async with sim(SimProfile(output_tokens=6)) as s:
        answer = await s.ok("/v1/chat/completions", chat(logprobs=True, top_logprobs=3))
        events = await s.events("/v1/chat/completions", chat(logprobs=True, top_logprobs=1))
        without = await s.ok("/v1/chat/completions", chat())
        refused = await s.post("/v1/chat/completions", chat(top_logprobs=2))
    choice = answer["choices"][0]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    for entry in entries:
        assert entry["logprob"] < 0
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    streamed = choices_of(events)[0]
    assert len(streamed["logprobs"]) == 6
    assert "".join(e["token"] for e in streamed["logprobs"]) == streamed["content"]
    assert without["choices"][0]["logprobs"] is None
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "top_logprobs"


async def test_completions_logprobs_and_echo() -> None:
    """`logprobs: k` gives tokens, their logprobs, `k` alternatives and text offsets; `echo`
    puts the prompt first (its first token has no logprob)."""
    async with sim(SimProfile(output_tokens=5)) as s:
        plain = await s.ok("/v1/completions", {"model": "m", "prompt": "once", "logprobs": 2})
        echoed = await s.ok(
            "/v1/completions", {"model": "m", "prompt": "once upon", "echo": True, "logprobs": 1}
        )
        events = await s.events("/v1/completions", {"model": "m", "prompt": "x", "logprobs": 0})
    choice = plain["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == 5
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    offsets = [0, *(len("".join(logprobs["tokens"][: i + 1])) for i in range(4))]
    assert logprobs["text_offset"] == offsets
    text = echoed["choices"][0]["text"]
    assert text.startswith("once upon") and len(text) > len("once upon")
    assert echoed["choices"][0]["logprobs"]["token_logprobs"][0] is None
    pieces = [e["choices"][0]["logprobs"]["tokens"][0] for e in events if e["choices"][0]["text"]]
    assert "".join(pieces) == "".join(e["choices"][0]["text"] for e in events)


async def test_a_seed_makes_the_whole_answer_reproducible() -> None:
    """The same seed and request give the same choices (text, JSON, tool calls with their ids,
    reasoning, logprobs) on any engine, whatever it served before; another seed differs."""
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER_SCHEMA}}
    requests = [
        chat(n=2, logprobs=True, top_logprobs=2, stop=["fox"]),
        chat(n=2, tools=[WEATHER, TIME]),
        chat(response_format=fmt),
    ]

    async def answers(engine_seed: int, seed: int) -> list[Any]:
        async with sim(
            SimProfile(output_tokens=(5, 40), reasoning_tokens=(0, 3)), seed=engine_seed
        ) as s:
            await s.ok("/v1/chat/completions", chat())  # moves the engine's own RNG on
            return [
                (await s.ok("/v1/chat/completions", {**body, "seed": seed}))["choices"]
                for body in requests
            ]

    first = await answers(1, 42)
    assert await answers(2, 42) == first
    assert await answers(1, 43) != first


async def test_reasoning_tokens_come_before_the_answer() -> None:
    """A profile's `reasoning_tokens` are sent as `reasoning_content` before the content,
    count in the usage details, and share `max_tokens` with the answer."""
    profile = SimProfile(output_tokens=4, reasoning_tokens=5)
    async with sim(profile) as s:
        answer = await s.ok("/v1/chat/completions", chat())
        events = await s.events(
            "/v1/chat/completions", chat(stream_options={"include_usage": True})
        )
        budget = await s.ok("/v1/chat/completions", chat(max_tokens=3))
        plain = await s.ok("/v1/chat/completions", chat("m@reasoning_tokens=0"))
    message = answer["choices"][0]["message"]
    assert len(message["reasoning_content"].split()) == 5
    assert len(message["content"].split()) == 4
    assert answer["usage"]["completion_tokens"] == 9
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == ["reasoning_content"] * 5 + ["content"] * 4
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert budget["choices"][0]["finish_reason"] == "length"
    assert budget["choices"][0]["message"]["content"] is None
    assert len(budget["choices"][0]["message"]["reasoning_content"].split()) == 3
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["usage"]


# --- the prefix cache ---------------------------------------------------------------------------


async def test_a_shared_prefix_is_served_from_the_prefix_cache() -> None:
    """The second request with the same long prompt finds all but its last block cached,
    reports them, and prefills only the rest (the planned prefill, as `/metrics` shows it); a
    longer conversation shares its history's blocks."""
    profile = SimProfile(prefix_cache_tokens=4096, prefill_ms_per_token=0.01, output_tokens=3)
    long = [{"role": "user", "content": "x" * 2400}]  # 600 tokens
    labels = 'model_name="m",engine="0"'
    async with sim(profile) as s:
        first = await s.ok("/v1/chat/completions", chat(messages=long))
        page_1 = (await s.http.get("/metrics")).text
        second = await s.ok("/v1/chat/completions", chat(messages=long))
        page_2 = (await s.http.get("/metrics")).text
        turn = [*long, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        events = await s.events(
            "/v1/chat/completions",
            chat(messages=turn, stream_options={"include_usage": True}),
        )
        page_3 = (await s.http.get("/metrics")).text
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens"] == 600
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 592}  # 37 of 37.5 blocks
    prefill = f"vllm:request_prefill_time_seconds_sum{{{labels}}}"
    first_prefill = metric(page_1, prefill)
    second_prefill = metric(page_2, prefill) - first_prefill
    assert first_prefill == pytest.approx(600 * 0.01 / 1000)
    assert second_prefill == pytest.approx(8 * 0.01 / 1000)
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 592
    assert metric(page_3, f"vllm:prefix_cache_queries_total{{{labels}}}") == 600 + 600 + 601
    hits = metric(page_3, f"vllm:prefix_cache_hits_total{{{labels}}}")
    assert hits == 592 + events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_the_prefix_cache_evicts_the_least_recently_used_blocks() -> None:
    """A cache of 8 blocks: a second 5-block prompt evicts the first prompt's tail, so its
    prefix still hits; with no cache there are no cached-token details at all."""
    a = [{"role": "user", "content": "a" * 320}]  # 80 tokens: 5 full blocks
    b = [{"role": "user", "content": "b" * 320}]
    async with sim(SimProfile(prefix_cache_tokens=128)) as s:

        async def cached(messages: list[dict[str, str]]) -> int:
            usage = (await s.ok("/v1/chat/completions", chat(messages=messages)))["usage"]
            return int(usage["prompt_tokens_details"]["cached_tokens"])

        assert [await cached(a), await cached(a), await cached(b), await cached(a)] == [
            0,
            64,  # 4 blocks: the last token is always computed
            0,
            48,  # its last blocks went first
        ]
        off = await s.ok("/v1/chat/completions", chat("m@prefix_cache_tokens=0", messages=a))
    assert "prompt_tokens_details" not in off["usage"]


# --- refusals and hints -------------------------------------------------------------------------


async def test_what_cannot_be_honoured_is_refused_naming_it() -> None:
    """Unknown parameters, audio, a completions suffix, a tool schema the generator cannot
    satisfy: a 400 in OpenAI's shape naming the parameter, before anything is drawn."""
    not_schema = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", chat(frobnicate=1), "frobnicate"),
        ("/v1/chat/completions", chat(audio={"voice": "alloy"}), "audio"),
        ("/v1/chat/completions", chat(modalities=["text", "audio"]), "modalities"),
        (
            "/v1/chat/completions",
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": not_schema}}]),
            "tools[0].function.parameters",
        ),
        ("/v1/chat/completions", chat(tools=[{"type": "custom", "custom": {}}]), "tools[0].type"),
        ("/v1/completions", {"model": "m", "prompt": "a", "suffix": "z"}, "suffix"),
        ("/v1/completions", {"model": "m", "prompt": "a", "best_of": 3}, "best_of"),
        (
            "/v1/embeddings",
            {"model": "m", "input": "a", "truncate_prompt_tokens": 4},
            "truncate_prompt_tokens",
        ),
    ]
    async with sim() as s:
        for path, body, param in cases:
            response = await s.post(path, body)
            assert response.status_code == 400, (param, response.text)
            error = response.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error")
            assert error["code"] == "unsupported_parameter"
            assert param.split("[")[0] in error["message"]
        assert s.engine.stats.requests == 0
        both = (await s.post("/v1/chat/completions", chat(foo=1, bar=2))).json()["error"]
        assert "'foo', 'bar'" in both["message"]


async def test_hints_and_what_the_gateway_adds_are_accepted() -> None:
    """Sampling and bookkeeping hints, vLLM's `priority` and `stream_options`, and the null
    value of an unsupported parameter are accepted."""
    hints: dict[str, Any] = {
        "temperature": 0.2,
        "top_p": 0.9,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "logit_bias": {"50256": -100},
        "user": "u",
        "metadata": {"k": "v"},
        "prompt_cache_key": "k",
        "store": False,
        "service_tier": "auto",
        "reasoning_effort": "low",
        "verbosity": "low",
        "safety_identifier": "s",
        "priority": 5,
        "seed": 1,
        "max_tokens": 3,
        "audio": None,
        "functions": None,
        "parallel_tool_calls": True,
        "top_k": 20,
    }
    async with sim(SimProfile(scheduling_policy="priority")) as s:
        await s.ok("/v1/chat/completions", chat(**hints))
        await s.events("/v1/chat/completions", chat(stream_options={"include_usage": True}))
        await s.ok(
            "/v1/completions",
            {"model": "m", "prompt": "a", "priority": 1, "user": "u", "temperature": 0},
        )
        await s.ok("/v1/embeddings", {"model": "m", "input": "a", "priority": 1, "user": "u"})


# --- counting tokens ----------------------------------------------------------------------------


async def test_tokenize_counts_what_usage_reports() -> None:
    """`POST /tokenize` (vLLM's) and `SimEngine.count_tokens` count a chat (with its tools) or
    a prompt as `usage.prompt_tokens` does."""
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        CALLED_WEATHER,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    async with sim(SimProfile(max_input_tokens=4000)) as s:
        used = await s.ok("/v1/chat/completions", chat(messages=conversation, tools=[WEATHER]))
        counted = await s.ok(
            "/tokenize", {"model": "m", "messages": conversation, "tools": [WEATHER]}
        )
        bare = await s.ok("/tokenize", {"model": "m", "messages": conversation})
        prompt = await s.ok("/tokenize", {"prompt": "x" * 41, "return_token_strs": True})
        completion = await s.ok("/v1/completions", {"model": "m", "prompt": "x" * 41})
        refused = await s.post("/tokenize", {"prompt": "x", "stream": True})
        engine = s.engine
    prompt_tokens = used["usage"]["prompt_tokens"]
    assert counted["count"] == prompt_tokens == len(counted["tokens"])
    assert counted["max_model_len"] == 4000
    assert bare["count"] < prompt_tokens  # the tool definitions count
    assert prompt["count"] == completion["usage"]["prompt_tokens"] == 11
    assert "".join(prompt["token_strs"]) == "x" * 41
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
    full = chat(messages=conversation, tools=[WEATHER], max_tokens=3)
    assert engine.count_tokens(full) == prompt_tokens
    assert engine.count_tokens({"prompt": ["abcd", "efgh" * 2]}) == 3


# --- the schema generator -----------------------------------------------------------------------

_TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"])
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-50, 50),
    st.floats(-50, 50, allow_nan=False).map(lambda x: round(x, 2)),
    st.text(max_size=5),
)
_LEAF = st.booleans() | st.fixed_dictionaries(
    {},
    optional={
        "type": st.one_of(_TYPES, st.lists(_TYPES, min_size=1, max_size=3, unique=True)),
        "enum": st.lists(_SCALARS, min_size=1, max_size=4),
        "minimum": st.integers(-20, 20),
        "maximum": st.integers(-20, 40),
        "exclusiveMinimum": st.integers(-20, 20),
        "multipleOf": st.sampled_from([1, 2, 3, 0.5, 0.25, 0.1]),
        "minLength": st.integers(0, 8),
        "maxLength": st.integers(0, 12),
        "pattern": st.sampled_from(["^[a-z]+$", "\\d{3}", "^(ab|cd)*$", "x"]),
        "format": st.sampled_from(["date", "email", "uuid"]),
    },
)
SCHEMA_STRATEGY = st.recursive(
    _LEAF,
    lambda inner: st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(_TYPES, st.lists(_TYPES, min_size=1, max_size=3, unique=True)),
            "properties": st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, max_size=3),
            "required": st.lists(st.sampled_from(["a", "b", "c", "e"]), max_size=3, unique=True),
            "additionalProperties": st.one_of(st.booleans(), inner),
            "items": inner,
            "prefixItems": st.lists(inner, max_size=2),
            "minItems": st.integers(0, 3),
            "maxItems": st.integers(0, 5),
            "uniqueItems": st.booleans(),
            "anyOf": st.lists(inner, min_size=1, max_size=3),
            "allOf": st.lists(inner, min_size=1, max_size=2),
            "minProperties": st.integers(0, 3),
            "maxProperties": st.integers(0, 4),
            "const": _SCALARS,
        },
    ),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(SCHEMA_STRATEGY, st.integers(0, 1000))
def test_generated_values_validate_against_their_schema(schema: Any, seed: int) -> None:
    """For any valid schema the generator either refuses it (SchemaError) or draws a value
    that jsonschema accepts."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError:
        return
    try:
        check(schema)
    except SchemaError:
        return
    value = generate(schema, random.Random(seed))
    errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(value)]
    assert errors == [], (schema, value)


@pytest.mark.parametrize(
    "schema",
    [
        {"allOf": [{"const": False}, {"const": 0}]},
        {"allOf": [{"const": 0}, {"const": False}]},
        {"allOf": [{"enum": [False, 1]}, {"enum": [0, True]}]},
        {"allOf": [{"const": 1}, {"const": 1.0}]},
        {"allOf": [{"enum": [[False], "x"]}, {"enum": [[0], [False]]}]},
    ],
)
def test_merged_constants_compare_as_json(schema: Any) -> None:
    """`false` is not `0` when two schemas that both apply are merged (as Python has it): the
    generator refuses what no value meets, and draws a valid value otherwise."""
    try:
        check(schema)
        value = generate(schema, random.Random(1))
    except SchemaError:
        assert not any(
            jsonschema.Draft202012Validator(schema).is_valid(v) for v in (False, 0, 1, True)
        )
        return
    assert jsonschema.Draft202012Validator(schema).is_valid(value), value


@pytest.mark.parametrize(
    "schema",
    [
        {"not": {}},
        {"type": "text"},
        {"$ref": "#/$defs/missing"},
        {"$ref": "https://example.com/schema.json"},
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # endless
        {"type": "integer", "minimum": 5, "maximum": 4},
        {"type": "string", "pattern": "(?=lookahead)"},
        {"type": "object", "required": ["a"], "additionalProperties": False},
        {"type": "array", "minItems": 5000},
        {"enum": []},
        False,
    ],
)
def test_schemas_without_a_valid_value_are_refused(schema: Any) -> None:
    """What the generator cannot honour raises SchemaError, never another error."""
    with pytest.raises(SchemaError):
        check(schema)


# --- through the gateway ------------------------------------------------------------------------


@pytest.fixture(params=["http", "in-process"])
async def gateway(request: pytest.FixtureRequest, upstream: Upstream) -> AsyncIterator[Gateway]:
    """A gateway over the simulator: as a vLLM server and in-process."""
    provider: dict[str, Any]
    if request.param == "http":
        provider = {"type": "vllm", "base_url": upstream.base_url}
    else:
        provider = {"type": "simulated", "default_profile": {"output_tokens": 5}}
    deployment = "m@reasoning_tokens=2,prefix_cache_tokens=4096"
    settings = gateway_settings(
        {"up": provider}, [{"name": "m", "deployments": [{"provider": "up", "model": deployment}]}]
    )
    async with run_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=WATCHDOG_S
    ) as sdk:
        yield sdk


async def test_an_agent_loop_through_the_gateway(client: openai.AsyncOpenAI) -> None:
    """Turn one calls the tool with valid arguments (streamed and put together by the SDK,
    reasoning first); given the result, turn two answers in text."""
    async with client.chat.completions.stream(model="m", messages=HELLO, tools=[WEATHER]) as stream:
        reasoning = ""
        async for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                reasoning += (event.chunk.choices[0].delta.model_extra or {}).get(
                    "reasoning_content"
                ) or ""
        first = await stream.get_final_completion()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert_valid_calls(calls)
    assert len(reasoning.split()) == 2
    history: list[Any] = [
        *HELLO,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ],
        },
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls),
    ]
    second = await client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    assert len((second.choices[0].message.content or "").split()) == 5


async def test_choices_json_and_cached_tokens_through_the_gateway(
    client: openai.AsyncOpenAI,
) -> None:
    """`n` choices of JSON valid against the schema, with logprobs; a repeated long prompt
    reports cached tokens in the usage, streamed and not."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    answer = await client.chat.completions.create(
        model="m", messages=HELLO, n=2, response_format=fmt, logprobs=True
    )
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        jsonschema.validate(orjson.loads(choice.message.content or ""), ORDER_SCHEMA)
        assert choice.logprobs is not None and choice.logprobs.content
    long: Any = [{"role": "user", "content": "y" * 4000}]
    await client.chat.completions.create(model="m", messages=long)
    again = await client.chat.completions.create(model="m", messages=long)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (1000 - 1) // 16 * 16
    stream = await client.chat.completions.create(
        model="m", messages=long, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (1000 - 1) // 16 * 16


async def test_a_refusal_reaches_the_client_through_the_gateway(
    client: openai.AsyncOpenAI,
) -> None:
    """The simulator's 400 for a parameter it cannot honour reaches the client as a 400 with
    its code, its `param` and a message naming the parameter (never a silent success)."""
    with pytest.raises(openai.BadRequestError) as raised:
        await client.chat.completions.create(
            model="m", messages=HELLO, extra_body={"frobnicate": True}
        )
    assert raised.value.status_code == 400
    assert raised.value.code == "unsupported_parameter"
    assert raised.value.param == "frobnicate"
    assert "frobnicate" in raised.value.message


async def test_anthropic_tool_use_through_the_gateway(gateway: Gateway) -> None:
    """An Anthropic client with a tool gets a `tool_use` block whose input validates against
    the tool's `input_schema`, streamed or not (the gateway translates to chat and back)."""
    tool: Any = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}
    async with anthropic.AsyncAnthropic(
        base_url=gateway.url, api_key="unused", max_retries=0, timeout=WATCHDOG_S
    ) as sdk:
        message = await sdk.messages.create(
            model="m", max_tokens=200, messages=[{"role": "user", "content": "hi"}], tools=[tool]
        )
        async with sdk.messages.stream(
            model="m", max_tokens=200, messages=[{"role": "user", "content": "hi"}], tools=[tool]
        ) as stream:
            streamed = await stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "tool_use"
        uses = [block for block in answer.content if block.type == "tool_use"]
        assert [use.name for use in uses] == ["get_weather"]
        jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
        thinking = [block for block in answer.content if block.type == "thinking"]
        assert len(thinking) == 1  # the profile's reasoning tokens


async def test_bulk_requests_with_vllm_priority_are_served(upstream: Upstream) -> None:
    """The gateway adds `priority` to bulk requests for a vLLM deployment and
    `stream_options` to streams; the simulator accepts both."""
    settings = gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url, "bulk_priority": 5}},
        [
            {
                "name": "m",
                "deployments": [{"provider": "up", "model": "m@scheduling_policy=priority"}],
            }
        ],
    )
    bulk = {"x-tailguard-priority": "bulk"}
    async with (
        run_gateway(settings) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=WATCHDOG_S) as http,
    ):
        answered = await http.post("/v1/chat/completions", json=chat(), headers=bulk)
        completed = await http.post(
            "/v1/completions", json={"model": "m", "prompt": "a"}, headers=bulk
        )
        async with http.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True), headers=bulk
        ) as streamed:
            body = await streamed.aread()
    assert (answered.status_code, completed.status_code, streamed.status_code) == (200, 200, 200)
    assert body.rstrip().endswith(b"data: [DONE]")
