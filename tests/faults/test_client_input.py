"""Client input of any shape: the gateway answers a 4xx in the client's wire shape, or forwards a
body the upstream can parse, holding exactly what the gateway checked.

JSON of any depth, duplicate keys, odd numbers, invalid UTF-8 and lone surrogates reach a gateway
with keys (whose caps rewrite the body) and one without, on every LLM endpoint, towards an
OpenAI-compatible and an Anthropic upstream, on the paths that forward the body as is and the
ones that re-serialise it (model rename, usage injection, key caps, translation, batching). The
upstream is a recording raw HTTP server that answers whatever it can parse.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.auth import new_key
from gateway.admission.validate import MAX_JSON_DEPTH
from tests.conftest import Gateway, gateway_settings, run_gateway
from tests.faults.wire import DONE, Exchange, RawUpstream
from tests.timing import scaled

KEY, KEY_HASH = new_key()
CAP: Final = 50  # the key's max_tokens
MAX_N: Final = 2  # the key's max_n
ECHO_LIMIT: Final = 400  # no error message made from client input is longer than this
PATHS: Final = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "messages": "/v1/messages",
}
# Models: `m` is renamed upstream (the body is re-serialised), `same` is not (forwarded as is),
# `a` is an Anthropic upstream (OpenAI chat is translated), `bulk` is micro-batched.
MODELS: Final = ("m", "same", "a", "bulk")
# Fields whose value is an output length, by the wire of the forwarded body's path.
OUTPUT_LENGTH: Final = {
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/messages": ("max_tokens",),
    "/v1/embeddings": (),
}


# --- the upstream: answers what it can parse, and keeps every body ------------------------------


class DuplicateKeyError(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise DuplicateKeyError(f"duplicate key among {[k for k, _ in pairs][:10]}")
    return found


def strict_loads(raw: bytes) -> Any:
    """What a strict upstream parser accepts: UTF-8 JSON (orjson) without a repeated key."""
    orjson.loads(raw)
    return json.loads(raw.decode(), object_pairs_hook=_unique)


def _inputs(value: Any) -> int:
    """How many inputs a batched field holds, as the batcher counts them."""
    if isinstance(value, list) and value and not all(isinstance(v, int) for v in value):
        return len(value)
    return 1


def _chunk(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _answer(path: str, body: dict[str, Any]) -> tuple[bytes, bool]:
    """A minimal valid answer to `body` at `path`, and whether it is an SSE stream."""
    stream = body.get("stream") is True
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    if path == "/v1/messages":
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
        if not stream:
            return orjson.dumps(message), False
        start = {**message, "content": [], "stop_reason": None}
        return b"".join(
            [
                _chunk({"type": "message_start", "message": start}, "message_start"),
                _chunk(
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                    "content_block_start",
                ),
                _chunk(
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": "ok"},
                    },
                    "content_block_delta",
                ),
                _chunk({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                _chunk(
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn"},
                        "usage": {"output_tokens": 1},
                    },
                    "message_delta",
                ),
                _chunk({"type": "message_stop"}, "message_stop"),
            ]
        ), True
    if path == "/v1/embeddings":
        count = _inputs(body.get("input"))
        data = [{"object": "embedding", "index": i, "embedding": [0.5]} for i in range(count)]
        return orjson.dumps({"object": "list", "data": data, "model": "e", "usage": usage}), False
    chat = path == "/v1/chat/completions"
    asked = body.get("n")
    n = asked if isinstance(asked, int) else 1
    count = (1 if chat else _inputs(body.get("prompt"))) * max(1, n)
    if count > 64:
        raise ValueError("too many choices asked")
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": "ok"}
        choices = [{"index": i, "message": delta, "finish_reason": "stop"} for i in range(count)]
        kind = "chat.completion"
    else:
        choices = [{"index": i, "text": "ok", "finish_reason": "stop"} for i in range(count)]
        kind = "text_completion"
    whole = {"id": "x", "object": kind, "created": 0, "model": "u", "choices": choices}
    if not stream:
        return orjson.dumps({**whole, "usage": usage}), False
    kind += ".chunk" if chat else ""
    events = []
    for i in range(count):
        part = {"index": i, "delta": delta} if chat else {"index": i, "text": "ok"}
        events.append(_chunk({**whole, "object": kind, "choices": [part]}))
        end = {"index": i, "delta": {}} if chat else {"index": i, "text": ""}
        events.append(
            _chunk({**whole, "object": kind, "choices": [{**end, "finish_reason": "stop"}]})
        )
    events.append(_chunk({**whole, "object": kind, "choices": [], "usage": usage}))
    return b"".join(events) + DONE, True


@dataclass
class Received:
    path: str
    raw: bytes
    error: str | None  # why a strict parser refused the body, if it did
    body: Any = None


@dataclass
class Recorder:
    """What the upstream received, in order."""

    received: list[Received] = field(default_factory=list)

    async def script(self, exchange: Exchange) -> None:
        raw = await exchange.read_request()
        path = exchange.head.split(b" ", 2)[1].decode()
        try:
            body = strict_loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:  # orjson's and json's errors included
            self.received.append(Received(path, raw, f"{type(exc).__name__}: {exc}"))
            error = {"error": {"message": "bad json", "type": "invalid_request_error"}}
            await exchange.respond(400, orjson.dumps(error))
            return
        self.received.append(Received(path, raw, None, body))
        try:
            answer, stream = _answer(path, body if isinstance(body, dict) else {})
        except ValueError:
            error = {"error": {"message": "too many", "type": "invalid_request_error"}}
            await exchange.respond(400, orjson.dumps(error))
            return
        if not stream:
            await exchange.respond(200, answer)
            return
        await exchange.start_stream()
        await exchange.chunk(answer)
        await exchange.end_chunks()


# --- the gateways -------------------------------------------------------------------------------


def _settings(up: RawUpstream, *, keyed: bool) -> Any:
    providers = {
        "up": {"type": "openai", "base_url": up.base_url},
        "ant": {"type": "anthropic", "base_url": up.url, "api_key": "sk-ant-upstream"},
    }
    models: list[dict[str, Any]] = [
        {"name": "m", "deployments": [{"provider": "up", "model": "up-m"}]},
        {"name": "same", "deployments": [{"provider": "up", "model": "same"}]},
        {"name": "a", "deployments": [{"provider": "ant", "model": "claude"}]},
        {
            "name": "bulk",
            "deployments": [{"provider": "up", "model": "b"}],
            "priority": "bulk",
            "batching": {"max_batch_size": 4, "max_wait_ms": 1},
        },
    ]
    extra: dict[str, Any] = {"server": {"access_log": False, "max_body_bytes": 4 * 1024 * 1024}}
    if keyed:
        key = {
            "name": "capped",
            "sha256": KEY_HASH,
            "max_tokens": CAP,
            "max_n": MAX_N,
            "rpm": 10**7,
            "tpm": 10**12,
        }
        extra["auth"] = {"keys": [key]}
    return gateway_settings(providers, models, **extra)


@dataclass
class Setup:
    recorder: Recorder
    open: Gateway
    keyed: Gateway


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    recorder = Recorder()
    async with AsyncExitStack() as stack:
        up = await stack.enter_async_context(RawUpstream(recorder.script))
        opened = await stack.enter_async_context(run_gateway(_settings(up, keyed=False)))
        keyed = await stack.enter_async_context(run_gateway(_settings(up, keyed=True)))
        yield Setup(recorder, opened, keyed)


@dataclass
class Outcome:
    status: int
    text: str
    forwarded: list[Received]


def _post(http: httpx.Client, setup: Setup, endpoint: str, raw: bytes, *, keyed: bool) -> Outcome:
    gateway = setup.keyed if keyed else setup.open
    headers = {"content-type": "application/json"}
    if keyed:
        headers["authorization"] = f"Bearer {KEY}"
    before = len(setup.recorder.received)
    response = http.post(gateway.url + PATHS[endpoint], content=raw, headers=headers)
    return Outcome(response.status_code, response.text, setup.recorder.received[before:])


def check(outcome: Outcome, endpoint: str, *, keyed: bool) -> None:
    """No 5xx and no internal error; a refusal is in the client's wire shape and quotes no more
    than a bounded excerpt of the input; whatever was forwarded is strict JSON within the caps."""
    assert outcome.status < 500, outcome.text[:2000]
    assert "internal_error" not in outcome.text, outcome.text[:2000]
    if outcome.status >= 400:
        error = orjson.loads(outcome.text)
        if endpoint == "messages":
            assert error["type"] == "error", error
        assert isinstance(error["error"]["type"], str), error
        assert isinstance(error["error"]["message"], str), error
        assert len(error["error"]["message"]) <= ECHO_LIMIT, error["error"]["message"][:2000]
    for received in outcome.forwarded:
        assert received.error is None, (received.error, received.raw[:2000])
        if keyed and isinstance(received.body, dict):
            for name in OUTPUT_LENGTH[received.path]:
                value = received.body.get(name)
                assert value is None or 1 <= value <= CAP, (name, value)
            assert received.body.get("n") in (None, *range(1, MAX_N + 1)), received.body
            assert received.body.get("best_of") in (None, *range(1, MAX_N + 1)), received.body


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=scaled(10)) as client:
        yield client


async def _sends(
    http: httpx.Client, setup: Setup, endpoint: str, raw: bytes, *, keyed: bool
) -> Outcome:
    return await asyncio.to_thread(_post, http, setup, endpoint, raw, keyed=keyed)


def _base(endpoint: str, model: str = "m") -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if endpoint == "completions":
        return {"model": model, "prompt": "hi"}
    if endpoint == "embeddings":
        return {"model": model, "input": "hi"}
    return {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def _with_deep(body: dict[str, Any], where: str, marker: str) -> tuple[bytes, int]:
    """`body` with the string `marker` placed at `where` (the caller swaps in deep JSON), and
    the level the marker sits at (the body object is level 1)."""
    body = orjson.loads(orjson.dumps(body))
    level = {"top": 2, "messages": 4, "input": 3}.get(where, 0)
    if where == "top":
        body["metadata"] = marker
    elif where == "messages":
        body["messages"][0]["content"] = marker
    elif where == "tools" and "max_tokens" in body and "messages" in body:  # Anthropic's
        body["tools"] = [{"name": "f", "input_schema": {"x": marker}}]
        level = 5
    elif where == "tools":
        body["tools"] = [
            {"type": "function", "function": {"name": "f", "parameters": {"x": marker}}}
        ]
        level = 6
    elif where == "input":
        body["input"] = [marker]
    return orjson.dumps(body), level


def deep(levels: int) -> bytes:
    """JSON nested `levels` deep: arrays and objects in turn, innermost an empty array."""
    opens = b"".join(b'{"k":' if i % 2 else b"[" for i in range(levels - 1))
    closes = b"".join(b"}" if i % 2 else b"]" for i in reversed(range(levels - 1)))
    return opens + b"[]" + closes


def body_nested(endpoint: str, where: str, total: int, model: str = "m") -> bytes:
    """A body of `endpoint` whose deepest value, at `where`, is nested `total` levels."""
    marker = "@@DEEP@@"
    raw, level = _with_deep(_base(endpoint, model), where, marker)
    levels = total - level + 1
    return raw.replace(orjson.dumps(marker), deep(levels))


def depth_of(raw: bytes) -> int:
    value = json.loads(raw)
    best, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            best = max(best, level)
            items = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in items)
    return best


def test_nested_bodies_are_as_deep_as_they_say() -> None:
    """The helper builds bodies of exactly the depth asked for (the tests below rely on it)."""
    for endpoint, where in _DEPTH_CASES:
        for total in (10, 11, MAX_JSON_DEPTH):
            assert depth_of(body_nested(endpoint, where, total)) == total, (endpoint, where)


_DEPTH_CASES: Final = [
    ("chat", "top"),
    ("chat", "messages"),
    ("chat", "tools"),
    ("completions", "top"),
    ("embeddings", "input"),
    ("embeddings", "top"),
    ("messages", "top"),
    ("messages", "messages"),
    ("messages", "tools"),
]
_DEPTHS: Final = [
    MAX_JSON_DEPTH - 1,
    MAX_JSON_DEPTH,
    MAX_JSON_DEPTH + 1,
    253,
    254,
    255,
    256,
    1024,
    1025,
    5000,
]


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize(("endpoint", "where"), _DEPTH_CASES, ids=lambda v: str(v))
async def test_depth_up_to_the_limit_is_forwarded_and_beyond_is_a_400_naming_it(
    setup: Setup, http: httpx.Client, endpoint: str, where: str, keyed: bool
) -> None:
    """A body nested up to the limit reaches the upstream on every model (renamed, as is,
    translated, batched); one level more, or far more, is a 400 that names the limit."""
    for model in MODELS:
        for total in _DEPTHS:
            raw = body_nested(endpoint, where, total, model)
            outcome = await _sends(http, setup, endpoint, raw, keyed=keyed)
            check(outcome, endpoint, keyed=keyed)
            if total <= MAX_JSON_DEPTH:
                if outcome.status == 400 and _untranslatable(outcome):
                    continue  # deep content the other wire has no place for
                assert outcome.status == 200, (model, total, outcome.text[:500])
                assert outcome.forwarded, (model, total)
            else:
                assert outcome.status == 400, (model, total, outcome.text[:500])
                error = orjson.loads(outcome.text)["error"]
                assert str(MAX_JSON_DEPTH) in error["message"], error
                assert not outcome.forwarded


def _untranslatable(outcome: Outcome) -> bool:
    message = orjson.loads(outcome.text)["error"]["message"]
    return "cannot be sent" in message or "must be" in message or "no deployment" in message


async def test_tool_arguments_too_deep_to_translate_are_a_400(
    setup: Setup, http: httpx.Client
) -> None:
    """Tool-call arguments are a JSON string that translation to Anthropic parses: nested
    beyond what can be re-serialised, they are refused with a 400, not a 500."""
    for levels in (MAX_JSON_DEPTH, 300, 1000, 1100):
        arguments = deep(levels).decode()
        body = {
            "model": "a",
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x":' + arguments + "}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ],
        }
        for keyed in (False, True):
            outcome = await _sends(http, setup, "chat", orjson.dumps(body), keyed=keyed)
            check(outcome, "chat", keyed=keyed)
            if levels == MAX_JSON_DEPTH:  # the input sits 6 levels deep once translated
                assert outcome.status == 200, outcome.text[:300]
            else:
                assert outcome.status == 400, outcome.text[:300]


# --- output-length caps -------------------------------------------------------------------------

_CAP_BYPASSES: Final = [
    ("chat", {"max_completion_tokens": 10, "max_tokens": 100_000}, "max_tokens"),
    ("chat", {"max_tokens": 10, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 0, "max_tokens": 100_000}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": None, "max_tokens": 100_000}, "max_tokens"),
    ("chat", {"max_completion_tokens": 10, "max_tokens": "lots"}, "max_tokens"),
    ("completions", {"max_tokens": 100_000}, "max_tokens"),
    ("completions", {"best_of": 20}, "best_of"),
    ("messages", {"max_tokens": 100_000}, "max_tokens"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), _CAP_BYPASSES)
async def test_output_length_caps_hold_on_every_field(
    setup: Setup, http: httpx.Client, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    """Every field that sets an output length (or how many outputs are generated) is held to the
    key's caps, whichever other fields are sent: over a cap, a 400 naming that field."""
    for model in ("m", "same", "a"):
        raw = orjson.dumps({**_base(endpoint, model), **fields})
        outcome = await _sends(http, setup, endpoint, raw, keyed=True)
        check(outcome, endpoint, keyed=True)
        assert outcome.status == 400, (model, outcome.text[:300])
        error = orjson.loads(outcome.text)["error"]
        if endpoint != "messages":
            assert error["param"] == param, error
        assert not outcome.forwarded


async def test_caps_within_limits_are_forwarded_as_checked(
    setup: Setup, http: httpx.Client
) -> None:
    """Within the caps both chat fields pass, and the upstream gets the values checked."""
    raw = orjson.dumps({**_base("chat", "m"), "max_completion_tokens": 10, "max_tokens": CAP})
    outcome = await _sends(http, setup, "chat", raw, keyed=True)
    check(outcome, "chat", keyed=True)
    assert outcome.status == 200
    [sent] = outcome.forwarded
    assert (sent.body["max_completion_tokens"], sent.body["max_tokens"]) == (10, CAP)


# --- duplicate keys -----------------------------------------------------------------------------

_DUPLICATES: Final = [
    ("chat", b'{"model":"same","model":"m","messages":[{"role":"user","content":"hi"}]}'),
    (
        "chat",
        b'{"model":"same","max_tokens":10,"max_tokens":100000,'
        b'"messages":[{"role":"user","content":"hi"}]}',
    ),
    (
        "chat",
        b'{"model":"same","stream":false,"stream":true,'
        b'"messages":[{"role":"user","content":"hi"}]}',
    ),
    (
        "chat",
        b'{"model":"same","messages":[{"role":"user","role":"system","content":"hi"}]}',
    ),
    (
        "chat",
        b'{"model":"m","stream":true,"stream_options":{"include_usage":true,'
        b'"include_usage":false},"messages":[{"role":"user","content":"hi"}]}',
    ),
    ("chat", b'{"model":"same","messages":[{"role":"user","content":"hi"}],"x":{"a":1,"a":2}}'),
    # The same key, spelled once with an escape.
    ("chat", b'{"model":"same","\\u006dodel":"m","messages":[{"role":"user","content":"hi"}]}'),
    ("completions", b'{"model":"same","prompt":"hi","max_tokens":1,"max_tokens":100000}'),
    ("embeddings", b'{"model":"same","input":"hi","input":"ho"}'),
    ("embeddings", b'{"model":"bulk","input":["a"],"model":"same"}'),
    (
        "messages",
        b'{"model":"a","max_tokens":10,"max_tokens":100000,'
        b'"messages":[{"role":"user","content":"hi"}]}',
    ),
    (
        "messages",
        b'{"model":"a","max_tokens":10,"metadata":{"user_id":"a","user_id":"b"},'
        b'"messages":[{"role":"user","content":"hi"}]}',
    ),
]


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "keyed"])
@pytest.mark.parametrize(("endpoint", "raw"), _DUPLICATES)
async def test_duplicate_keys_are_refused_on_every_path(
    setup: Setup, http: httpx.Client, endpoint: str, raw: bytes, keyed: bool
) -> None:
    """A body with a key twice in any object is a 400 `duplicate_key` in the client's wire:
    never forwarded, so what the upstream reads is always what the gateway checked."""
    outcome = await _sends(http, setup, endpoint, raw, keyed=keyed)
    check(outcome, endpoint, keyed=keyed)
    assert outcome.status == 400, outcome.text[:300]
    error = orjson.loads(outcome.text)["error"]
    if endpoint != "messages":
        assert error["code"] == "duplicate_key", error
    assert "more than once" in error["message"], error
    assert not outcome.forwarded


async def test_repeated_keys_in_different_objects_and_escaped_colons_are_fine(
    setup: Setup, http: httpx.Client
) -> None:
    """The same key in different objects is no duplicate, nor is a colon spelled as an escape."""
    raw = (
        b'{"model":"same","messages":[{"role":"user","content":"a\\u003ab"},'
        b'{"role":"assistant","content":"c:d"},{"role":"user","content":"e"}]}'
    )
    outcome = await _sends(http, setup, "chat", raw, keyed=False)
    check(outcome, "chat", keyed=False)
    assert outcome.status == 200
    assert outcome.forwarded[0].raw == raw


# --- odd numbers and strings --------------------------------------------------------------------

_ODD: Final[list[tuple[str, bytes, int]]] = [
    # (what, a JSON value, the status a chat request with it as max_tokens gets, keyless)
    ("1e400", b"1e400", 400),
    ("-1e400", b"-1e400", 400),
    ("NaN", b"NaN", 400),
    ("Infinity", b"Infinity", 400),
    ("-Infinity", b"-Infinity", 400),
    ("-0", b"-0", 200),
    ("1.0", b"1.0", 400),
    ("2**64", b"18446744073709551616", 400),
    ("2**64-1", b"18446744073709551615", 200),
    ("-2**63-1", b"-9223372036854775809", 400),
    ("1e-400", b"1e-400", 400),
    ("100 digits", b"1" * 100, 400),
    ("lone surrogate", b'"\\ud800"', 400),
    ("invalid utf-8", b'"\xff\xfe"', 400),
    ("surrogate pair", b'"\\ud83d\\ude00"', 400),
]


@pytest.mark.parametrize(("what", "value", "status"), _ODD, ids=[o[0] for o in _ODD])
async def test_odd_values_in_integer_fields(
    setup: Setup, http: httpx.Client, what: str, value: bytes, status: int
) -> None:
    """Odd numbers and strings as `max_tokens`, `n` or anywhere else: a 400, or (for what is a
    valid value) forwarded, with and without a key, renamed or not."""
    del what
    for model in ("m", "same"):
        for name in (b"max_tokens", b"n", b"temperature"):
            raw = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"%s":%s}' % (
                model.encode(),
                name,
                value,
            )
            for keyed in (False, True):
                outcome = await _sends(http, setup, "chat", raw, keyed=keyed)
                check(outcome, "chat", keyed=keyed)
                if name == b"max_tokens" and not keyed:
                    assert outcome.status == status, outcome.text[:300]


# --- client strings in errors -------------------------------------------------------------------

HUGE: Final = "x" * (1024 * 1024)


async def test_client_strings_in_errors_are_truncated(setup: Setup, http: httpx.Client) -> None:
    """A 1 MiB model name, role, content type or tool choice is quoted in the error only in
    part, on both wires, with and without a key."""
    cases: list[tuple[str, dict[str, Any]]] = [
        ("chat", {**_base("chat"), "model": HUGE}),
        ("messages", {**_base("messages"), "model": HUGE}),
        ("embeddings", {**_base("embeddings"), "model": HUGE}),
        ("chat", {**_base("chat", "a"), "messages": [{"role": HUGE, "content": "hi"}]}),
        (
            "chat",
            {**_base("chat", "a"), "messages": [{"role": "user", "content": [{"type": HUGE}]}]},
        ),
        ("chat", {**_base("chat", "a"), "tool_choice": {"type": "x", "y": HUGE}}),
        ("chat", {**_base("chat", "a"), "tool_choice": HUGE}),
        ("chat", {**_base("chat", "a"), "tools": [{"type": HUGE}]}),
        ("chat", {**_base("chat", "a"), "response_format": {"type": HUGE}}),
        ("messages", {**_base("messages", "m"), "tools": [{"type": HUGE, "name": "f"}]}),
        ("messages", {**_base("messages", "m"), "tool_choice": {"type": HUGE}}),
        (
            "messages",
            {**_base("messages", "m"), "messages": [{"role": "user", "content": [{"type": HUGE}]}]},
        ),
        (
            "messages",
            {
                **_base("messages", "m"),
                "messages": [{"role": "assistant", "content": [{"type": HUGE}]}],
            },
        ),
        (
            "chat",
            {
                **_base("chat", "a"),
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "file", "file": {"file_data": "data:" + HUGE + ";base64,AA"}}
                        ],
                    }
                ],
            },
        ),
    ]
    for endpoint, body in cases:
        for keyed in (False, True):
            outcome = await _sends(http, setup, endpoint, orjson.dumps(body), keyed=keyed)
            check(outcome, endpoint, keyed=keyed)
            assert 400 <= outcome.status < 500, outcome.text[:300]
            assert not outcome.forwarded


# --- generated input ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    """A JSON token written as is (odd numbers, escapes, invalid bytes, deep nesting)."""

    text: bytes


@dataclass(frozen=True)
class Obj:
    """A JSON object whose keys may repeat."""

    pairs: tuple[tuple[str, Any], ...]


def encode(node: Any) -> bytes:
    if isinstance(node, Lit):
        return node.text
    if isinstance(node, Obj):
        inner = b",".join(orjson.dumps(k) + b":" + encode(v) for k, v in node.pairs)
        return b"{" + inner + b"}"
    if isinstance(node, list):
        return b"[" + b",".join(encode(item) for item in node) + b"]"
    if isinstance(node, int) and not isinstance(node, bool):
        return str(node).encode()  # beyond 64 bits too
    return orjson.dumps(node)


_ODD_LITERALS = st.sampled_from(
    [
        Lit(b"1e400"),
        Lit(b"-0"),
        Lit(b"-0.0"),
        Lit(b"18446744073709551615"),
        Lit(b"18446744073709551616"),
        Lit(b"-9223372036854775809"),
        Lit(b"1" * 40),
        Lit(b"NaN"),
        Lit(b"Infinity"),
        Lit(b"1.0"),
        Lit(b"1E2"),
        Lit(b'"\\ud800"'),
        Lit(b'"\\udc00\\ud800"'),
        Lit(b'"\\ud83d\\ude00"'),
        Lit(b'"\xff"'),
        Lit(b'"\xed\xa0\x80"'),  # a surrogate encoded as UTF-8
        Lit(b'"\\u0000"'),
        Lit(b'"a\\u003ab"'),
    ]
)
_DEPTH_LEVELS = st.sampled_from(
    [1, 2, MAX_JSON_DEPTH - 6, MAX_JSON_DEPTH - 4, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 250, 256]
).map(lambda levels: Lit(deep(levels)))
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from([0, 1, 2, 3, 10, CAP, CAP + 1, 100_000]),
)
_VALUES = st.one_of(_SCALARS, _ODD_LITERALS, _DEPTH_LEVELS)
_FIELDS = st.sampled_from(
    [
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "stream_options",
        "metadata",
        "tools",
        "tool_choice",
        "messages",
        "prompt",
        "input",
        "system",
        "temperature",
        "user",
    ]
)


@st.composite
def messages(draw: st.DrawFn) -> list[Any]:
    role = draw(st.sampled_from(["user", "assistant", "system", "tool", "bogus"]) | _VALUES)
    content = draw(st.sampled_from(["hi"]) | _VALUES)
    pairs = [("role", role), ("content", content)]
    if draw(st.booleans()):
        pairs.append((draw(st.sampled_from(["role", "content", "name"])), draw(_VALUES)))
    return [Obj(tuple(pairs))]


@st.composite
def bodies(draw: st.DrawFn, endpoint: str) -> bytes:
    """A body for `endpoint`: mostly well formed, with odd values, repeated keys (at the top and
    nested) and deep values added."""
    base = _base(endpoint, draw(st.sampled_from([*MODELS, "nope"])))
    pairs: list[tuple[str, Any]] = list(base.items())
    if "messages" in base and draw(st.booleans()):
        pairs = [(k, draw(messages()) if k == "messages" else v) for k, v in pairs]
    for _ in range(draw(st.integers(0, 4))):
        name = draw(_FIELDS)
        value: Any = draw(_VALUES)
        if name == "stream_options" and draw(st.booleans()):
            value = Obj((("include_usage", draw(_VALUES)),) * draw(st.integers(1, 2)))
        elif name == "tools" and draw(st.booleans()):
            function = Obj((("name", "f"), ("parameters", Obj((("x", value),)))))
            value = [Obj((("type", "function"), ("function", function)))]
        elif name == "stream" and draw(st.booleans()):
            value = True
        pairs.append((name, value))
    order = draw(st.permutations(range(len(pairs))))
    return encode(Obj(tuple(pairs[i] for i in order)))


PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("endpoint", list(PATHS))
async def test_no_client_input_gets_a_5xx(setup: Setup, http: httpx.Client, endpoint: str) -> None:
    """Generated bodies, with and without a key: a 4xx in the client's wire shape, or a body
    forwarded that a strict parser accepts and that keeps within the key's caps."""

    statuses: set[int] = set()

    @PROPERTY
    @given(raw=bodies(endpoint), keyed=st.booleans())
    def run(raw: bytes, keyed: bool) -> None:
        outcome = _post(http, setup, endpoint, raw, keyed=keyed)
        statuses.add(outcome.status)
        check(outcome, endpoint, keyed=keyed)

    await asyncio.to_thread(run)
    assert {200, 400} <= statuses  # the generated bodies reach answers and refusals alike


@pytest.mark.parametrize("endpoint", list(PATHS))
async def test_a_repeated_key_anywhere_is_never_forwarded(
    setup: Setup, http: httpx.Client, endpoint: str
) -> None:
    """Any well-formed body with one key repeated, at the top or nested, is refused."""

    @PROPERTY
    @given(data=st.data(), keyed=st.booleans())
    def run(data: st.DataObject, keyed: bool) -> None:
        body: Any = {**_base(endpoint, data.draw(st.sampled_from(MODELS))), "stream": False}
        body["metadata"] = {"a": {"b": [{"c": 1}]}}
        # Pick an object in the body and repeat one of its keys.
        objects = [
            ("top", body),
            ("metadata", body["metadata"]),
            ("deep", body["metadata"]["a"]["b"][0]),
        ]
        if "messages" in body:
            objects.append(("message", body["messages"][0]))
        where, target = data.draw(st.sampled_from(objects))
        key = data.draw(st.sampled_from(sorted(target)))
        copy = data.draw(_SCALARS)
        raw = encode(_with_repeat(body, target, key, copy))
        outcome = _post(http, setup, endpoint, raw, keyed=keyed)
        check(outcome, endpoint, keyed=keyed)
        assert outcome.status == 400, (where, key, outcome.text[:300])
        assert not outcome.forwarded

    await asyncio.to_thread(run)


def _with_repeat(node: Any, target: dict[str, Any], key: str, copy: Any) -> Any:
    """`node` as an encodable tree, `target`'s `key` written twice (first `copy`)."""
    if isinstance(node, dict):
        pairs = tuple((k, _with_repeat(v, target, key, copy)) for k, v in node.items())
        if node is target:
            pairs = ((key, copy), *pairs)
        return Obj(pairs)
    if isinstance(node, list):
        return [_with_repeat(item, target, key, copy) for item in node]
    return node
