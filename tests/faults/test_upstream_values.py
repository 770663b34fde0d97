"""Numbers and strings from outside: hostile values are clamped or ignored, never raised on, and
never become metric labels.

Every number an upstream supplies (`retry-after`, `retry-after-ms`, `content-length`, usage
counts, rate-limit headers, a vLLM server's `/metrics` values) is fed its worst: a request with a
fallback is served by the fallback, one without gets a clean 429/502/503, never a 500. Every
string an upstream or a client supplies (error codes and types, statuses, finish reasons, model
names, header values) leaves `/metrics` with the same series it had before.
"""

from __future__ import annotations

import ast
import asyncio
import email.utils
import math
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import httpx
import hypothesis
import orjson
import pytest
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import gateway
from gateway import numbers
from gateway.config import Settings
from gateway.latency.vllm import parse_metrics
from gateway.numbers import MAX_TOKENS
from tests.conftest import Gateway, Upstream, gateway_settings, run_gateway, serve
from tests.fakes.otlp_receiver import OTLPReceiver
from tests.faults.conftest import CHAT, http_client, settled
from tests.faults.wire import DONE, Exchange, RawUpstream
from tests.source import parse
from tests.timing import scaled

EXAMPLES: Final = hypothesis.settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # a failure names its case
    suppress_health_check=list(hypothesis.HealthCheck),
)
# A breaker that closes again at once, so that every example reaches the misbehaving upstream.
INSTANT_COOLDOWN: Final = {"routing": {"cooldown": {"base_s": 1e-6, "max_s": 1e-6}}}

HOSTILE_NUMBERS: Final = (
    "inf", "-inf", "+inf", "Infinity", "1e400", "-1e400", "nan", "NaN", "-1", "-0", "0",
    "99999999999999999999", "1" * 400, "1e3", "1_000", "0x10", "\u0663", "1.5.2", "soon", "",
    " ", "-", "1 2", "Fri, 31 Dec 9999 23:59:59 GMT", "Mon, 01 Jan 0001 00:00:00 GMT",
    "Thu, 01 Jan 1970 00:00:00 GMT", "Mon, 01 Jan 99999 00:00:00 GMT",
    "Mon, 32 Jan 2020 00:00:00 GMT", "Mon, 01 Jan 2020 25:61:61 GMT",
    "Mon, 01 Jan 2020 00:00:00 +9999", "Sunday, 06-Nov-94 08:49:37 GMT",
    "Sun Nov  6 08:49:37 1994", "Mon, 01 Jan 2020",
)  # fmt: skip
_HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
HEADER_VALUES = st.one_of(
    st.sampled_from(HOSTILE_NUMBERS),
    st.floats().map(repr),
    st.integers(-(10**40), 10**40).map(str),
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)).map(
        lambda when: email.utils.format_datetime(when.replace(tzinfo=UTC), usegmt=True)
    ),
    _HEADER_TEXT,
)
NUMBER_HEADERS: Final = (
    "retry-after",
    "retry-after-ms",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-remaining",
)


def completion(usage: bytes = b"null", finish: str = "stop") -> bytes:
    """A chat completion whose `usage` is the JSON text `usage`."""
    body = orjson.dumps(
        {
            "id": "chatcmpl-raw",
            "object": "chat.completion",
            "created": 0,
            "model": "raw",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hello"},
                    "finish_reason": finish,
                }
            ],
            "usage": "USAGE",
        }
    )
    return body.replace(b'"USAGE"', usage)


def stream_events(usage: bytes = b"null", finish: str = "stop") -> list[bytes]:
    """An OpenAI chat stream: one token, the finish, a usage chunk carrying `usage`, [DONE]."""

    def event(choices: list[dict[str, Any]], **more: Any) -> bytes:
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "raw"}
        return b"data: " + orjson.dumps({**chunk, "choices": choices, **more}) + b"\n\n"

    text = event([{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}])
    end = event([{"index": 0, "delta": {}, "finish_reason": finish}])
    tail = event([], usage="USAGE").replace(b'"USAGE"', usage)
    return [text, end, tail, DONE]


def anthropic_message(usage: bytes, stop: str = "end_turn") -> bytes:
    body = orjson.dumps(
        {
            "id": "msg_raw",
            "type": "message",
            "role": "assistant",
            "model": "raw",
            "content": [{"type": "text", "text": "hello"}],
            "stop_reason": stop,
            "usage": "USAGE",
        }
    )
    return body.replace(b'"USAGE"', usage)


def anthropic_events(usage: bytes, stop: str = "end_turn") -> list[bytes]:
    def event(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data}) + b"\n\n"

    message = {"id": "msg_raw", "type": "message", "role": "assistant", "model": "raw"}
    start = event("message_start", {"message": {**message, "content": [], "usage": "USAGE"}})
    return [
        start.replace(b'"USAGE"', usage),
        event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}),
        event("content_block_stop", {"index": 0}),
        event("message_delta", {"delta": {"stop_reason": stop}, "usage": "USAGE"}).replace(
            b'"USAGE"', usage
        ),
        event("message_stop", {}),
    ]


def head(status: int, headers: dict[str, str], *, content_type: str, length: str | None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"content-type: {content_type}", "connection: close"]
    if length is not None:
        lines.append(f"content-length: {length}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def send_stream(exchange: Exchange, status: int, events: list[bytes]) -> None:
    await exchange.send(
        head(status, {}, content_type="text/event-stream", length=None).replace(
            b"connection: close", b"connection: close\r\ntransfer-encoding: chunked"
        )
    )
    for data in events:
        await exchange.chunk(data)
    await exchange.end_chunks()


def wants_stream(body: bytes) -> bool:
    return bool(orjson.loads(body).get("stream"))


def settings_for(
    primary: str, *, fallback: str | None = None, anthropic: bool = False, **top: Any
) -> Settings:
    """`m` on the raw upstream, falling back to `b` on the simulator; `solo` on the raw upstream
    with no fallback; with `anthropic`, `anth` on the raw upstream speaking Anthropic's wire."""
    providers: dict[str, Any] = {"p": {"type": "openai", "base_url": primary + "/v1"}}
    models: list[dict[str, Any]] = [
        {"name": "m", "deployments": [{"provider": "p", "model": "bad"}]},
        {"name": "solo", "deployments": [{"provider": "p", "model": "alone"}]},
    ]
    if fallback is not None:
        providers["f"] = {"type": "openai", "base_url": fallback}
        models[0]["fallbacks"] = ["b"]
        models.append({"name": "b", "deployments": [{"provider": "f", "model": "ok"}]})
    if anthropic:
        providers["a"] = {"type": "anthropic", "base_url": primary, "api_key": "sk-ant-test"}
        models.append({"name": "anth", "deployments": [{"provider": "a", "model": "claude"}]})
    return gateway_settings(
        providers, models, **{"server": {"access_log": False}, **INSTANT_COOLDOWN, **top}
    )


def clean_refusal(response: httpx.Response, allowed: tuple[int, ...]) -> None:
    """A gateway error in the OpenAI shape with an expected status; a retry-after it sets is a
    small whole number of seconds."""
    assert response.status_code in allowed, response.text
    error = response.json()["error"]
    assert error["code"] != "internal_error", error
    wait = response.headers.get("retry-after")
    assert wait is None or (wait.isdigit() and 1 <= int(wait) <= 60), wait


# --- (a) hostile numbers in response headers ------------------------------------------------------


async def test_hostile_retry_after_and_rate_limit_headers(upstream: Upstream) -> None:
    """Whatever an upstream puts in `retry-after`, `retry-after-ms` or its rate-limit headers,
    on a 429, 5xx or 200: with a fallback the request is served (by the fallback when the
    upstream failed), without one the client gets the upstream's answer or a clean 429/502/503."""
    case: dict[str, Any] = {}

    async def script(exchange: Exchange) -> None:
        body = await exchange.read_request()
        status, headers = case["status"], case["headers"]
        if status == 200 and wants_stream(body):
            await exchange.send(head(200, headers, content_type="text/event-stream", length=None))
            for data in stream_events():
                await exchange.send(data)
            return
        answer = completion() if status == 200 else b'{"error": {"message": "no", "type": "x"}}'
        await exchange.send(
            head(status, headers, content_type="application/json", length=str(len(answer))) + answer
        )

    async with (
        RawUpstream(script) as up,
        run_gateway(settings_for(up.url, fallback=upstream.base_url)) as gw,
    ):

        @EXAMPLES
        @hypothesis.given(
            status=st.sampled_from([429, 429, 503, 529, 500, 200]),
            headers=st.dictionaries(st.sampled_from(NUMBER_HEADERS), HEADER_VALUES, min_size=1),
            stream=st.booleans(),
        )
        def check(status: int, headers: dict[str, str], stream: bool) -> None:
            case.update(status=status, headers=headers)
            seen = up.requests
            with httpx.Client(base_url=gw.base_url, timeout=scaled(10)) as http:
                served = http.post(
                    "/chat/completions", json={"model": "m", **CHAT, "stream": stream}
                )
                alone = http.post("/chat/completions", json={"model": "solo", **CHAT})
            assert up.requests == seen + 2  # both reached the upstream under test
            assert served.status_code == 200, served.text
            expected = "p/bad" if status == 200 else "f/ok"
            assert served.headers["x-tailguard-deployment"] == expected
            if status == 200:
                assert alone.status_code == 200
            else:
                clean_refusal(alone, (429, 502, 503))

        await asyncio.to_thread(check)
        await settled(up.url, upstream.url, at_most=1)


def _lying_length(
    declared: str, *, status: int = 200, stream: bool = False
) -> Callable[[Exchange], Any]:
    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        if stream:
            body = b"".join(stream_events())
            kind = "text/event-stream"
        else:
            body = completion() if status == 200 else b'{"error": {"message": "no"}}'
            kind = "application/json"
        await exchange.send(head(status, {}, content_type=kind, length=declared) + body)

    return script


CONTENT_LENGTHS: Final = {
    # name: the declared length (the body is ~200 bytes)
    "longer": "100000",
    "shorter": "10",
    "zero": "0",
    "negative": "-1",
    "huge": "99999999999999999999",
    "inf": "inf",
    "float": "1e3",
    "text": "soon",
    "empty": "",
    "twice": "10, 20",
}


@pytest.mark.parametrize("status", [200, 429, 500])
@pytest.mark.parametrize("declared", list(CONTENT_LENGTHS))
async def test_lying_content_length(upstream: Upstream, declared: str, status: int) -> None:
    """A `content-length` that lies about the body, or is no number at all: the request is
    served (by the fallback, unless the upstream's answer was whole), or a clean error."""
    length = CONTENT_LENGTHS[declared]
    async with RawUpstream(_lying_length(length, status=status)) as up:
        settings = settings_for(up.url, fallback=upstream.base_url)
        async with (
            run_gateway(settings) as gw,
            http_client(base_url=gw.base_url, timeout=scaled(10)) as http,
        ):
            for stream in (False, True):
                served = await http.post(
                    "/chat/completions", json={"model": "m", **CHAT, "stream": stream}
                )
                assert served.status_code == 200, served.text
                if status != 200:
                    assert served.headers["x-tailguard-deployment"] == "f/ok"
                alone = await http.post("/chat/completions", json={"model": "solo", **CHAT})
                if alone.status_code != 200:
                    clean_refusal(alone, (429, 502, 503))
            await settled(up.url, upstream.url, at_most=1)


# --- (a) hostile usage counts ---------------------------------------------------------------------

_COUNT_LITERALS = st.one_of(
    st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda f: orjson.dumps(f)),
    st.sampled_from([b"null", b"true", b"false", b'"12"', b'"lots"', b"[]", b"[5]", b"{}",
                     b"-1", b"9223372036854775807", b"18446744073709551616", b"1.0", b"-0"]),
)  # fmt: skip
_OPENAI_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_ANTHROPIC_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def _usage(fields: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """A usage object with hostile counts, or a usage that is no object at all."""
    objects = st.dictionaries(st.sampled_from(fields), _COUNT_LITERALS, min_size=1).map(
        lambda d: b"{" + b",".join(orjson.dumps(k) + b":" + v for k, v in d.items()) + b"}"
    )
    return st.one_of(objects, st.sampled_from([b'"lots"', b"[]", b"7", b"-7", b"true"]))


async def test_hostile_usage_counts_are_ignored() -> None:
    """Usage counts that are negative, fractional, strings, null, huge or not numbers at all (in
    OpenAI and Anthropic answers, streamed or not): the answer is served as it came, and the
    gateway's own accounting only ever holds counts in [0, MAX_TOKENS] or none."""
    case: dict[str, Any] = {}

    async def script(exchange: Exchange) -> None:
        body = await exchange.read_request()
        usage, stream = case["usage"], wants_stream(body)
        if b"/v1/messages" in exchange.head.split(b"\r\n")[0]:
            if stream:
                await send_stream(exchange, 200, anthropic_events(usage))
            else:
                await exchange.respond(200, anthropic_message(usage))
        elif stream:
            await send_stream(exchange, 200, stream_events(usage))
        else:
            await exchange.respond(200, completion(usage))

    async with RawUpstream(script) as up, run_gateway(settings_for(up.url, anthropic=True)) as gw:

        @EXAMPLES
        @hypothesis.given(
            wire=st.sampled_from(["openai", "anthropic"]),
            ingress=st.sampled_from(["/chat/completions", "/messages"]),
            stream=st.booleans(),
            data=st.data(),
        )
        def check(wire: str, ingress: str, stream: bool, data: st.DataObject) -> None:
            fields = _OPENAI_FIELDS if wire == "openai" else _ANTHROPIC_FIELDS
            case["usage"] = data.draw(_usage(fields))
            model = "solo" if wire == "openai" else "anth"
            with httpx.Client(base_url=gw.base_url, timeout=scaled(10)) as http:
                request = {"model": model, **CHAT, "stream": stream, "max_tokens": 5}
                response = http.post(ingress, json=request)
            assert response.status_code == 200, response.text
            if stream:
                assert "data: {" in response.text and '"error"' not in response.text
            else:
                assert response.json()["choices" if ingress == "/chat/completions" else "content"]

        await asyncio.to_thread(check)
        await settled(up.url)
        for samples in gw.recorder.samples.values():
            for sample in samples:
                for tokens in (sample.input_tokens, sample.output_tokens):
                    assert tokens is None or 0 <= tokens <= MAX_TOKENS, sample
        scrape = await metrics(gw)
    total = sum(
        s.value for s in scrape.samples if s.name == "gen_ai_client_token_usage_sum"
    )  # every observation is a count in range
    assert total >= 0


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400", b"NaN"])
async def test_usage_json_cannot_hold_is_a_clean_failover(
    upstream: Upstream, literal: bytes
) -> None:
    """A usage count no JSON parser can hold as a number makes the body unreadable: the fallback
    serves, and without one the client gets a clean 502."""

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        await exchange.respond(200, completion(b'{"prompt_tokens": ' + literal + b"}"))

    async with RawUpstream(script) as up:
        settings = settings_for(up.url, fallback=upstream.base_url)
        async with (
            run_gateway(settings) as gw,
            http_client(base_url=gw.base_url, timeout=scaled(10)) as http,
        ):
            served = await http.post("/chat/completions", json={"model": "m", **CHAT})
            alone = await http.post("/chat/completions", json={"model": "solo", **CHAT})
            await settled(up.url, upstream.url, at_most=1)
    assert served.status_code == 200 and served.headers["x-tailguard-deployment"] == "f/ok"
    clean_refusal(alone, (502,))


# --- (a) a vLLM server's /metrics -----------------------------------------------------------------

_SAMPLE_VALUES = st.one_of(
    st.sampled_from(["+Inf", "-Inf", "NaN", "1e400", "-1e400", "-1", "0", "1e308", "3"]),
    st.floats().map(repr),
)
_BOUNDS = st.one_of(
    st.sampled_from(["+Inf", "-Inf", "NaN", "1e400", "-1", "0.1", "0.5", "abc", ""]),
    st.floats().map(repr),
)


@st.composite
def vllm_pages(draw: st.DrawFn) -> str:
    """A vLLM page whose every value (and bucket bound) may be hostile."""

    def value() -> str:
        return draw(_SAMPLE_VALUES)

    lines = [
        f'vllm:num_requests_running{{model_name="m"}} {value()}',
        f'vllm:num_requests_waiting{{model_name="m"}} {value()}',
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {value()}',
    ]
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        lines.append(f"# TYPE {name} histogram")
        for _ in range(draw(st.integers(0, 4))):
            lines.append(f'{name}_bucket{{le="{draw(_BOUNDS)}",model_name="m"}} {value()}')
        lines.append(f'{name}_bucket{{le="+Inf",model_name="m"}} {value()}')
        lines.append(f'{name}_count{{model_name="m"}} {value()}')
        lines.append(f'{name}_sum{{model_name="m"}} {value()}')
    return "\n".join(lines) + "\n"


def _finite(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value >= 0)


@EXAMPLES
@hypothesis.given(page=vllm_pages(), earlier=vllm_pages())
def test_hostile_vllm_metrics_are_clamped_or_ignored(page: str, earlier: str) -> None:
    """Values like `+Inf`, `NaN`, `1e400` or `-1` on a vLLM page (and bucket bounds that are no
    numbers): the page is refused as a whole (ValueError) or read with every value finite and
    non-negative, the cache usage within [0, 1], and the quantiles finite."""
    try:
        load, before = parse_metrics(page), parse_metrics(earlier)
    except ValueError:
        return
    assert _finite(load.running) and _finite(load.waiting)
    assert load.kv_usage is None or 0 <= load.kv_usage <= 1
    for histogram in (load.ttft, load.tpot, load.ttft.since(before.ttft)):
        assert _finite(histogram.count) and _finite(histogram.total)
        for le, n in histogram.buckets:
            assert not math.isnan(le) and _finite(n)
        for q in (0.5, 0.99):
            assert _finite(histogram.quantile(q))


HOSTILE_PAGE: Final = """\
vllm:num_requests_running{model_name="bad"} NaN
vllm:num_requests_waiting{model_name="bad"} +Inf
vllm:kv_cache_usage_perc{model_name="bad"} 1e400
vllm:time_to_first_token_seconds_bucket{le="NaN",model_name="bad"} 3
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="bad"} NaN
vllm:time_to_first_token_seconds_count{model_name="bad"} +Inf
vllm:time_to_first_token_seconds_sum{model_name="bad"} -1
"""


async def test_a_hostile_vllm_page_breaks_neither_routing_nor_the_admin_view(
    client: httpx.AsyncClient,
) -> None:
    """A vLLM server whose `/metrics` says its queue is NaN and +Inf is of unknown load, not idle
    (nor infinitely busy): it is still routed to, and `/admin/latency` says why."""
    scrapes = [0]

    async def script(exchange: Exchange) -> None:
        await exchange.read_request()
        if exchange.head.startswith(b"GET /metrics"):
            await exchange.respond(200, HOSTILE_PAGE.encode(), content_type="text/plain")
            scrapes[0] += 1
        else:
            await exchange.respond(200, completion())

    async with RawUpstream(script) as up:
        settings = gateway_settings(
            {"v": {"type": "vllm", "base_url": up.base_url, "metrics_interval_s": 0.05}},
            [{"name": "m", "deployments": [{"provider": "v", "model": "bad"}]}],
            server={"access_log": False},
        )
        async with run_gateway(settings) as gw:
            await up.wait_for(lambda _: scrapes[0] >= 2)
            served = await client.post(
                gw.base_url + "/chat/completions", json={"model": "m", **CHAT}
            )
            view = await client.get(gw.url + "/admin/latency")
    assert served.status_code == 200, served.text
    assert view.status_code == 200, view.text
    vllm = view.json()["vllm"]["v"]
    assert vllm["state"] == "unknown" and vllm["running"] is None
    assert "NaN" in vllm["last_error"] or "nan" in vllm["last_error"]


# --- (b) label values from outside ----------------------------------------------------------------


class Scrape:
    def __init__(self, text: str) -> None:
        families = list(text_string_to_metric_families(text))
        self.samples = [s for f in families for s in f.samples]

    def series(self) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for s in self.samples}

    def labels(self, name: str) -> set[str]:
        return {s.labels[name] for s in self.samples if name in s.labels}


async def metrics(gw: Gateway) -> Scrape:
    async with http_client(timeout=scaled(10)) as http:
        response = await http.get(gw.url + "/metrics")
    assert response.status_code == 200
    return Scrape(response.text)


STATUSES: Final = (400, 401, 404, 409, 413, 418, 422, 429, 451, 499, 500, 503, 520, 529, 599)
LONG: Final = "x" * 5000


def _misbehaviour(i: int) -> tuple[int, bytes] | list[bytes]:
    """The upstream's answer to case `i`: distinct codes, types, statuses and finish reasons."""
    kind = i % 7
    if kind == 0:  # the request refused, with its own code
        return 400, orjson.dumps({"error": {"message": "no", "type": f"t{i}", "code": f"code_{i}"}})
    if kind == 1:  # an unusual status, with a code and type of its own
        status = STATUSES[(i // 7) % len(STATUSES)]
        return status, orjson.dumps({"error": {"message": "no", "type": f"t{i}", "code": f"c{i}"}})
    if kind == 2:  # an error inside a 200, with a status of its own
        status = STATUSES[(i // 7) % len(STATUSES)]
        error = {"message": "no", "type": f"t{i}", "code": f"in{i}{LONG}", "status": status}
        return 200, orjson.dumps({"error": error})
    if kind == 3:  # vLLM's int code: the status
        status = STATUSES[(i // 7) % len(STATUSES)]
        return 200, orjson.dumps({"object": "error", "message": f"no{i}", "code": status})
    if kind == 4:
        return 200, completion(finish=f"reason_{i}{LONG}")
    if kind == 5:
        return stream_events(finish=f"reason_{i}")
    return 400, orjson.dumps({"type": "error", "error": {"type": f"anthropic_{i}"}})


async def test_metric_series_stay_bounded_whatever_comes_from_outside() -> None:
    """After the upstream answered 10 cases of distinct error codes, types, statuses and finish
    reasons, and clients sent 10 unknown models and odd headers, `/metrics` has some number of
    series; 300 more distinct ones of each leave that number as it was, and every `error_type`
    is one of the documented values."""

    async def script(exchange: Exchange) -> None:
        body = orjson.loads(await exchange.read_request())
        answer = _misbehaviour(int(body["user"]))
        if isinstance(answer, list):
            await send_stream(exchange, 200, answer)
        else:
            await exchange.respond(answer[0], answer[1])

    async def traffic(http: httpx.AsyncClient, cases: range) -> None:
        gate = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with gate:
                stream = i % 7 == 5
                request = {"model": "solo", **CHAT, "user": str(i), "stream": stream}
                response = await http.post("/chat/completions", json=request)
                assert response.status_code != 500, response.text
                unknown = {"model": f"nope-{i}{LONG[: i % 300]}", **CHAT}
                odd = {
                    "x-tailguard-priority": f"p{i}",
                    "x-tailguard-ttft-budget-ms": f"{i}.5",
                    "x-request-id": f"r{i}",
                    "traceparent": f"00-{i}-junk",
                    "user-agent": f"agent/{i}",
                }
                for response in (
                    await http.post("/chat/completions", json=unknown, headers=odd),
                    await http.post("/messages", json={**unknown, "max_tokens": 5}),
                    await http.post("/chat/completions", json=request, headers=odd),
                ):
                    assert response.status_code in (400, 404), response.text

        await asyncio.gather(*(one(i) for i in cases))

    async with RawUpstream(script) as up:
        settings = settings_for(up.url)
        async with (
            run_gateway(settings) as gw,
            http_client(base_url=gw.base_url, timeout=scaled(10)) as http,
        ):
            await traffic(http, range(7 * len(STATUSES)))  # every kind with every status
            await settled(up.url)
            before = await metrics(gw)
            await traffic(http, range(7 * len(STATUSES), 7 * len(STATUSES) + 300))
            await settled(up.url)
            after = await metrics(gw)
    grown = {s for s in after.series() - before.series() if not _process(s[0])}
    assert not grown, sorted(grown)[:10]
    from gateway.telemetry.meters import ERROR_TYPES

    assert after.labels("error_type") <= ERROR_TYPES | {""}, after.labels("error_type")
    assert all(len(value) <= 64 for value in after.labels("gen_ai_request_model"))


def _process(name: str) -> bool:
    # The process's own gauges, and the in-flight gauge (one series per configured deployment,
    # there while an attempt is), may come and go between scrapes.
    return re.match(r"process_|python_|tailguard_upstream_inflight", name) is not None


# --- (a) strings that are not strings -------------------------------------------------------------


@pytest.mark.parametrize("reason", [b"5", b"{}", b"[]", b"true", b'"x"', b'"' + b"r" * 5000 + b'"'])
@pytest.mark.parametrize("ingress", ["/chat/completions", "/messages"])
async def test_finish_reasons_of_any_json_type(reason: bytes, ingress: str) -> None:
    """A finish reason that is a number, an object, a list or a very long string: the answer is
    still served, streamed or not, on either wire."""

    async def script(exchange: Exchange) -> None:
        body = await exchange.read_request()
        marked = b'"finish_reason":"MARK"'
        if wants_stream(body):
            events = [
                e.replace(marked, b'"finish_reason":' + reason)
                for e in stream_events(finish="MARK")
            ]
            await send_stream(exchange, 200, events)
        else:
            await exchange.respond(
                200, completion(finish="MARK").replace(marked, b'"finish_reason":' + reason)
            )

    async with RawUpstream(script) as up, run_gateway(settings_for(up.url)) as gw:
        async with http_client(base_url=gw.base_url, timeout=scaled(10)) as http:
            for stream in (False, True):
                request = {"model": "solo", **CHAT, "stream": stream, "max_tokens": 5}
                response = await http.post(ingress, json=request)
                assert response.status_code == 200, response.text
                assert '"error"' not in response.text, response.text
        await settled(up.url)


async def test_upstream_strings_in_spans_are_bounded() -> None:
    """An upstream's error code and finish reasons reach the trace, each cut to a bounded length,
    and at most 16 finish reasons however many events carried one."""
    reasons = [f"reason_{i}_{LONG}" for i in range(40)]

    async def script(exchange: Exchange) -> None:
        body = orjson.loads(await exchange.read_request())
        if body["user"] == "code":
            error = {"message": "no", "type": "invalid_request_error", "code": f"c{LONG}"}
            await exchange.respond(400, orjson.dumps({"error": error}))
            return
        # A stream whose every event says it finished (a finish reason each).
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "raw"}
        events = [
            b"data: "
            + orjson.dumps(
                {**chunk, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": r}]}
            )
            + b"\n\n"
            for r in reasons
        ]
        await send_stream(exchange, 200, [*events, DONE])

    receiver = OTLPReceiver()
    async with RawUpstream(script) as up, serve(receiver) as collector:
        # Every trace kept: the spans of the plain request are the ones checked.
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
        async with (
            run_gateway(settings_for(up.url), environ=environ) as gw,
            http_client(base_url=gw.base_url, timeout=scaled(10)) as http,
        ):
            refused = await http.post(
                "/chat/completions", json={"model": "solo", **CHAT, "user": "code"}
            )
            request = {"model": "solo", **CHAT, "user": "many", "stream": True}
            served = await http.post("/chat/completions", json=request)
        await settled(up.url)
    assert refused.status_code == 400 and len(refused.json()["error"]["code"]) <= 64
    assert served.status_code == 200
    attempts = receiver.of_kind("CLIENT")
    assert len(attempts) == 2, receiver.spans
    for span in receiver.spans:
        for value in span.attributes.values():
            for text in value if isinstance(value, list) else [value]:
                assert not isinstance(text, str) or len(text) <= 300, (span.name, text[:80])
    finished = [s.attributes for s in attempts if "gen_ai.response.finish_reasons" in s.attributes]
    assert len(finished) == 1 and len(finished[0]["gen_ai.response.finish_reasons"]) == 16


def _gateway_codes() -> set[str]:
    """Every error code, type and attempt-failure kind the gateway's source spells out: in
    `code=`/`kind=` arguments, class attributes `code`/`type` and `self._error_type`."""
    found: set[str] = set()

    def strings(value: ast.AST) -> set[str]:
        return {
            c.value
            for c in ast.walk(value)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }

    for path in Path(gateway.__file__).parent.rglob("*.py"):
        if "/sim/" in str(path):
            continue  # the simulator's own answers are an upstream's
        tree = parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg in ("code", "kind", "error_type"):
                found |= strings(node.value)
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
                if node.targets[0].attr in ("_error_type", "code"):
                    found |= strings(node.value)
            elif isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if not isinstance(statement, ast.Assign):
                        continue
                    target, value = statement.targets[0], statement.value
                    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                        for name, item in zip(target.elts, value.elts, strict=True):
                            if getattr(name, "id", "") in ("code", "type"):
                                found |= strings(item)
                    elif getattr(target, "id", "") in ("code", "type"):
                        found |= strings(value)
    return found


def test_the_error_vocabulary_holds_every_error_the_gateway_names() -> None:
    """Each error code, type and failure kind the gateway itself makes is its own `error_type`
    label (only outside values are folded into `upstream_other` or a status class)."""
    from gateway.errors import ProviderError
    from gateway.telemetry.meters import error_label

    made = _gateway_codes() | {cls.__name__ for cls in _subclasses(ProviderError)}
    made.discard("")
    wrong = {code: error_label(code) for code in made if error_label(code) != code}
    assert not wrong, wrong
    assert error_label("code_from_upstream") == "upstream_other"
    assert error_label("418") == "4xx" and error_label("429") == "429"
    assert error_label(None) == error_label("") == ""


def _subclasses(cls: type) -> set[type]:
    found: set[type] = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found | {cls}


@EXAMPLES
@hypothesis.given(
    seconds=st.none() | HEADER_VALUES | st.text(max_size=40),
    millis=st.none() | HEADER_VALUES | st.text(max_size=40),
    now=st.floats(0, 4e10),
)
def test_a_retry_after_is_a_bounded_wait_or_none(
    seconds: str | None, millis: str | None, now: float
) -> None:
    """Any pair of header values, any clock: the wait is None or within [0, a day]."""
    wait = numbers.retry_after_s(seconds, millis, now)
    assert wait is None or 0 <= wait <= numbers.MAX_WAIT_S


@EXAMPLES
@hypothesis.given(value=st.from_type(object) | st.integers() | st.floats())
def test_a_token_count_is_a_bounded_int_or_none(value: object) -> None:
    counted = numbers.count(value)
    assert counted is None or (type(counted) is int and 0 <= counted <= MAX_TOKENS)
