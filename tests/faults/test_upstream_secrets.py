"""An upstream that echoes the credentials it received, in every string it can write.

The upstream (a raw HTTP server on loopback) puts the key it was sent, the whole `authorization`
header, the key in base64 and an extra header's Basic credential into error messages, codes,
params and types, into stream error events after the first token, into garbled events, and into
its `x-request-id` header. Through every client wire (chat completions, Messages, Responses),
streaming or not, on the native route and translated, none of it may reach what the client gets,
any log line or the access log, any exported span, or a stored response.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator
from typing import Any, Final

import orjson
import pytest

from tests.conftest import gateway_settings, run_gateway, serve
from tests.fakes.otlp_receiver import OTLPReceiver
from tests.faults.conftest import http_client
from tests.faults.wire import DONE, Exchange, RawUpstream, sse_finish, sse_token
from tests.timing import scaled

KEYS: Final = {  # provider → its api key; none has a shape the generic patterns know
    "oa": "plainTOKEN12345",  # OpenAI-compatible, Responses served natively
    "oc": "chatPLAIN24680x",  # OpenAI-compatible, Responses translated to chat
    "an": "anthroPLAIN13579",  # Anthropic
}
HEADER_PASSWORD: Final = "hdrPLAIN97531"
BASIC: Final = "Basic " + base64.b64encode(f"svc:{HEADER_PASSWORD}".encode()).decode()
SCENARIOS: Final = (
    "midstream",
    "failed",
    "disguised",
    "garbled",
    "rejected",
    "failing",
    "inband",
    "ok",
    "dirty",
)
"""What the upstream does (its model name): fail after the first token in each of its wire's
error shapes, send garbage, answer 400 or 500, fail before the first token, answer well (`ok`),
or answer well but with an `error` in the Response object (`dirty`, the same as `ok` elsewhere);
every answer carries the credentials in `x-request-id`."""
LOGGERS: Final = ("tailguard", "tailguard.access", "gateway")


def forbidden() -> list[str]:
    """Every form of a secret that must appear nowhere."""
    found = [HEADER_PASSWORD, BASIC.split()[1]]
    for key in KEYS.values():
        found += [key, base64.b64encode(key.encode()).decode()]
    return found


def leaks(text: str) -> list[str]:
    lowered = text.lower()
    return [secret for secret in forbidden() if secret.lower() in lowered]


# --- the echoing upstream ------------------------------------------------------------------------


def _headers_of(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in lines[1:] if ":" in line)
    return {name.strip().lower(): value.strip() for name, _, value in fields}


def _echo(headers: dict[str, str]) -> str:
    """What the upstream was sent, in the forms it might echo it."""
    key = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
    basic = headers.get("x-org-auth", "")
    decoded = base64.b64decode(basic.split()[1]).decode() if basic else ""
    encoded = base64.b64encode(key.encode()).decode()
    return f"{key} {headers.get('authorization', '')} {encoded} {basic} {decoded}".strip()


def _event(data: dict[str, Any], event: str | None = None) -> bytes:
    line = f"event: {event}\n".encode() if event else b""
    return line + b"data: " + orjson.dumps(data) + b"\n\n"


def _error_fields(echo: str) -> dict[str, Any]:
    return {"message": f"boom {echo}", "type": echo, "code": echo, "param": echo}


_RESPONSE: Final = {
    "id": "resp_upstream1",
    "object": "response",
    "created_at": 0,
    "model": "m",
    "status": "completed",
    "output": [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}],
        }
    ],
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
}


class Wire:
    """One upstream wire: its opening, a content event, its end and its error shapes."""

    def __init__(self, path: str) -> None:
        self.kind = (
            "messages"
            if path.endswith(("/messages", "/messages/count_tokens"))
            else "responses"
            if path.endswith(("/responses", "/responses/input_tokens"))
            else "chat"
        )

    def opening(self) -> list[bytes]:
        if self.kind == "messages":
            message = {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "m",
                "content": [],
                "usage": {"input_tokens": 1, "output_tokens": 0},
            }
            block = {"type": "text", "text": ""}
            return [
                _event({"type": "message_start", "message": message}, "message_start"),
                _event(
                    {"type": "content_block_start", "index": 0, "content_block": block},
                    "content_block_start",
                ),
            ]
        if self.kind == "responses":
            started = {**_RESPONSE, "status": "in_progress", "output": []}
            return [
                _event(
                    {"type": "response.created", "sequence_number": 0, "response": started},
                    "response.created",
                )
            ]
        return []

    def token(self) -> bytes:
        if self.kind == "messages":
            delta = {"type": "text_delta", "text": "hi"}
            return _event(
                {"type": "content_block_delta", "index": 0, "delta": delta}, "content_block_delta"
            )
        if self.kind == "responses":
            event = {
                "type": "response.output_text.delta",
                "sequence_number": 1,
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": "hi",
            }
            return _event(event, "response.output_text.delta")
        return sse_token("hi")

    def ending(self, echo: str = "") -> list[bytes]:
        if self.kind == "messages":
            usage = {"output_tokens": 1}
            return [
                _event({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                _event(
                    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage},
                    "message_delta",
                ),
                _event({"type": "message_stop"}, "message_stop"),
            ]
        if self.kind == "responses":
            response = {**_RESPONSE, "error": _error_fields(echo)} if echo else _RESPONSE
            event = {"type": "response.completed", "sequence_number": 2, "response": response}
            return [_event(event, "response.completed")]
        return [sse_finish(), DONE]

    def error_event(self, echo: str, shape: str = "midstream") -> bytes:
        """The wire's in-band error event: its usual shape (`midstream`), its other one
        (`failed`), or an `error` event whose data claims another type (`disguised`)."""
        fields = _error_fields(echo)
        if shape == "disguised":
            return _event(fields, "error")  # openai-python reads this event as an error
        if self.kind == "messages":
            error = {"type": "api_error", "message": fields["message"]}
            if shape == "failed":  # no `event:` line, only the object's type
                return _event({"type": "error", "error": error})
            return _event({"type": "error", "error": error}, "error")
        if self.kind == "responses":
            if shape == "failed":
                failed = {**_RESPONSE, "status": "failed", "output": [], "error": fields}
                event = {"type": "response.failed", "sequence_number": 2, "response": failed}
                return _event(event, "response.failed")
            return _event({**fields, "type": "error", "sequence_number": 2}, "error")
        if shape == "failed":
            return _event({**fields, "object": "error"})  # old vLLM's flat shape
        return _event({"error": fields})

    def error_body(self, echo: str) -> bytes:
        fields = _error_fields(echo)
        if self.kind == "messages":
            return orjson.dumps(
                {"type": "error", "error": {"type": "api_error", "message": fields["message"]}}
            )
        return orjson.dumps({"error": fields})

    def body(self, echo: str = "") -> bytes:
        if self.kind == "messages":
            return orjson.dumps(
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": "m",
                    "content": [{"type": "text", "text": "hi"}],
                    "stop_reason": "end_turn",
                    "usage": {"input_tokens": 1, "output_tokens": 1},
                }
            )
        if self.kind == "responses":
            return orjson.dumps({**_RESPONSE, "error": _error_fields(echo)} if echo else _RESPONSE)
        return orjson.dumps(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


async def echoing(exchange: Exchange) -> None:
    """Serve one request as its upstream model (the scenario) says, echoing the credentials."""
    request = orjson.loads(await exchange.read_request())
    headers = _headers_of(exchange.head)
    echo = _echo(headers)
    wire = Wire(exchange.head.split(b" ")[1].decode())
    scenario, stream = request["model"], bool(request.get("stream"))
    echoed = {"x-request-id": echo.split()[0], "request-id": echo.split()[0]}
    if scenario in ("rejected", "failing"):
        status = 400 if scenario == "rejected" else 500
        await exchange.respond(status, wire.error_body(echo), headers=echoed)
        return
    if not stream:
        if scenario in ("ok", "dirty"):
            dirt = echo if scenario == "dirty" else ""
            await exchange.respond(200, wire.body(dirt), headers=echoed)
        elif scenario == "garbled":
            await exchange.respond(200, f"not json {echo}".encode())
        else:  # an error inside a 200 answer
            await exchange.respond(200, wire.error_body(echo))
        return
    await exchange.start_stream()
    events = wire.opening()
    if scenario == "inband":  # before the first token
        events.append(wire.error_event(echo))
    elif scenario in ("ok", "dirty"):
        events += [wire.token(), *wire.ending(echo if scenario == "dirty" else "")]
    else:
        events.append(wire.token())
        if scenario == "garbled":
            events.append(f"data: not json {echo}\n\n".encode())
        else:
            events.append(wire.error_event(echo, scenario))
    for event in events:
        await exchange.chunk(event)
    await exchange.end_chunks()


# --- the gateway ---------------------------------------------------------------------------------


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """caplog, capturing the gateway's loggers at DEBUG and the access log (even after
    `configure_logging` stopped them propagating in this process)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "disabled", False)
        caplog.set_level(logging.DEBUG, logger=name)
    yield caplog


def settings(upstream: RawUpstream) -> Any:
    extra = {"headers": {"x-org-auth": BASIC}}
    providers = {
        "oa": {"type": "openai", "base_url": upstream.base_url, "api_key": KEYS["oa"]}
        | {"responses": "native"}
        | extra,
        "oc": {"type": "openai", "base_url": upstream.base_url, "api_key": KEYS["oc"]} | extra,
        "an": {"type": "anthropic", "base_url": upstream.url, "api_key": KEYS["an"]} | extra,
    }
    models = [
        {
            "name": f"{provider}-{scenario}",
            "deployments": [{"provider": provider, "model": scenario}],
        }
        for provider in KEYS
        for scenario in SCENARIOS
    ]
    return gateway_settings(
        providers,
        models,
        server={"access_log": True},
        routing={"cooldown": {"base_s": 1e-6, "max_s": 1e-6}},  # every request reaches it
    )


COUNTERS: Final = {  # client wire → its token-counting path (forwarded to the upstream's own)
    "messages": ("/v1/messages/count_tokens", ("an",)),
    "responses": ("/v1/responses/input_tokens", ("oa",)),
}
ROUTES: Final = {  # client wire → (path, the providers that serve it: native first)
    "chat": ("/v1/chat/completions", ("oa", "an")),
    "messages": ("/v1/messages", ("an", "oa")),
    "responses": ("/v1/responses", ("oa", "oc", "an")),
}


def body_for(wire: str, model: str, stream: bool) -> dict[str, Any]:
    if wire == "messages":
        messages = [{"role": "user", "content": "hi"}]
        return {"model": model, "max_tokens": 16, "messages": messages, "stream": stream}
    if wire == "responses":
        return {"model": model, "input": "hi", "stream": stream, "store": True}
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def response_ids(text: str) -> set[str]:
    """The Responses ids the client was shown (the gateway's, or the native upstream's)."""
    found = set()
    for piece in text.replace('"', " ").split():
        if piece.startswith("resp_"):
            found.add(piece.rstrip(",}"))
    return found


@pytest.mark.parametrize("wire", list(ROUTES))
async def test_no_upstream_credential_reaches_client_log_span_or_store(
    wire: str, logs: pytest.LogCaptureFixture
) -> None:
    """Every scenario, streamed and not, native and translated: the echoed credentials are in
    nothing the client gets (body, headers, stream events), no log line (access log included),
    no exported span, and no stored response; the upstream's words around them still arrive."""
    path, providers = ROUTES[wire]
    receiver = OTLPReceiver()
    seen: list[str] = []
    async with (
        RawUpstream(echoing) as upstream,
        serve(receiver) as collector,
        http_client(timeout=scaled(10)) as client,
    ):
        environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector, "TAILGUARD_TRACES_TAIL_RATIO": "1"}
        async with run_gateway(settings(upstream), environ=environ) as gw:
            for provider in providers:
                for scenario in SCENARIOS:
                    for stream in (True, False):
                        body = body_for(wire, f"{provider}-{scenario}", stream)
                        resp = await client.post(gw.url + path, json=body)
                        text = f"{resp.status_code} {dict(resp.headers)} {resp.text}"
                        case = f"{wire} via {provider}, {scenario}, stream={stream}: {text}"
                        assert not leaks(text), case
                        if scenario == "ok":
                            assert resp.status_code == 200, case
                        elif scenario not in ("garbled", "failing", "dirty"):
                            assert "boom" in text, case  # the upstream's words still arrive
                        seen.append(case)
                        for response_id in response_ids(resp.text):
                            stored = await client.get(f"{gw.url}/v1/responses/{response_id}")
                            assert not leaks(stored.text), (case, stored.text)
            counter, counted_by = COUNTERS.get(wire, ("", ()))
            for provider in counted_by:  # the upstream's counter fails, echoing the key
                for scenario in ("rejected", "failing"):
                    body = body_for(wire, f"{provider}-{scenario}", False)
                    del body["stream"]
                    resp = await client.post(gw.url + counter, json=body)
                    text = f"{resp.status_code} {dict(resp.headers)} {resp.text}"
                    assert not leaks(text), text  # an estimate, or the upstream's refusal
        # The gateway has stopped: every access line is written and every span exported.
    assert len(seen) == len(providers) * len(SCENARIOS) * 2
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    lines = [formatter.format(record) for record in logs.records]
    assert any('"status":' in line for line in lines)  # the access log was captured
    assert not [line for line in lines if leaks(line)]
    assert receiver.spans
    for span in receiver.spans:
        text = orjson.dumps(
            [span.name, span.attributes, span.events, span.status_message, span.resource]
        ).decode()
        assert not leaks(text), span
    for export in receiver.exports:
        assert not leaks(export.body.decode("latin-1"))
