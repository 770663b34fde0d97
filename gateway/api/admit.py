"""Admission: who is asking, whether they may, and what exactly they ask for.

A request is authenticated once (`authenticate`), its body read and parsed, held to its key's
caps and charged to its key's rate limits (`admit`, which hands back an `Admitted` ticket); then
its model, headers and budget are settled and it is routed (`resolve`). Every refusal here is a
`GatewayError`, answered before any upstream is tried.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, replace

import orjson
from starlette.types import Receive, Scope

from gateway.admission.auth import KeyRing, Principal
from gateway.admission.ratelimit import RateLimiter, Verdict
from gateway.admission.validate import OUTPUT_LENGTH_FIELDS, off_loop, parse_call
from gateway.api.conversation import expand_conversation, owner_of
from gateway.batching import BATCHED_ENDPOINTS
from gateway.config import ModelNames, ModelSpec
from gateway.errors import (
    BodyTooLargeError,
    InvalidRequestError,
    PermissionDeniedError,
    RequestTimeoutError,
    UnknownModelError,
    quote,
)
from gateway.models import Call, Endpoint
from gateway.providers.request import AGENT_HEADERS
from gateway.routing import Decision, budget_for, decide
from gateway.runtime import Runtime, Services

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
"""A request id the gateway honours, or echoes from an upstream."""
TRACEPARENT = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")

TTFT_BUDGET_HEADER = "x-tailguard-ttft-budget-ms"
TOTAL_BUDGET_HEADER = "x-tailguard-total-budget-ms"
# The Gateway API Inference Extension's (llm-d's) names: a TTFT budget, and a per-token target.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
PRIORITY_HEADER = "x-tailguard-priority"
_MAX_BUDGET_MS = 3_600_000
_AGENT_HEADERS = frozenset(name.encode() for name in AGENT_HEADERS)


def authenticate(
    keyring: KeyRing, path: str, headers: list[tuple[bytes, bytes]], *, anthropic: bool = False
) -> Principal:
    """The key behind a request: a client key under `/v1/` (`anthropic`: as Anthropic's API
    takes it, for `/v1/messages`), an admin key elsewhere. Raises AuthenticationError or
    PermissionDeniedError."""
    if path.startswith("/v1/"):
        return keyring.client(headers, anthropic=anthropic)
    return keyring.admin(headers)


@dataclass(slots=True)
class Admitted:
    """The key a request was admitted under: its rate-limit state and token charge."""

    principal: Principal
    verdict: Verdict | None
    prompt_estimate: int  # prompt tokens, as estimated at admission
    charged: int  # all the tokens charged at admission: the prompt and every output token asked
    limiter: RateLimiter  # where the charge is settled once the usage is known


async def admit(
    runtime: Runtime,
    principal: Principal | None,
    scope: Scope,
    receive: Receive,
    endpoint: Endpoint,
) -> tuple[Call, Admitted | None]:
    """Read and parse the body; with a key, hold the call to the key's caps; expand a stored
    conversation; then charge the key for what will be sent upstream (the whole conversation,
    not its last message).

    Raises a GatewayError (the request is refused), or ClientGoneError."""
    server = runtime.services.settings.server
    raw = await read_body(scope, receive, server.max_body_bytes, server.read_timeout_s)
    call = await off_loop(len(raw), parse_call, endpoint, raw)
    if principal is not None:
        call = _check_key(principal, call, runtime.services.names)
    limited = principal is not None and principal.rate_limited
    limiter = runtime.limiter
    counted: Verdict | None = None  # the request, charged before its conversation is read
    known = 0  # prompt tokens known from the stored conversation's usage
    if endpoint == "responses" and (
        call.body.get("previous_response_id") or call.body.get("conversation")
    ):
        if limited:
            assert principal is not None
            # A key at its rpm, or owing tokens, is refused before the store is read and the
            # conversation expanded: a refusal stays cheap. Its tokens are charged below.
            counted = await limiter.take(principal, 0, call.wire)
        asked = len(call.raw)
        store = runtime.services.responses
        call, history = await expand_conversation(store, call, owner_of(principal))
        if history:
            known = history + asked // 4
    if principal is None:
        return call, None
    verdict = None
    prompt = charged = 0
    if limited:
        prompt, charged = limiter.estimate(
            principal, call, runtime.services.latency, known_prompt=known
        )
        if counted is None:
            verdict = await limiter.take(principal, charged, call.wire)
        else:
            tokens = await limiter.take(principal, charged, call.wire, requests=False)
            verdict = replace(tokens, requests=counted.requests)
    return call, Admitted(principal, verdict, prompt, charged, limiter)


def model_of(services: Services, call: Call, principal: Principal | None) -> tuple[ModelSpec, Call]:
    """The configured model `call` names (by its name or an alias), and the call as it goes on:
    with the name to answer with, when the model answers with the name asked for. Raises
    UnknownModelError listing the models the key may use."""
    spec = services.names.lookup(call.model)
    if spec is None:
        raise UnknownModelError(
            f"The model {quote(call.model)} does not exist. Available models: "
            f"{', '.join(visible_models(services, principal))}.",
            param="model",
        )
    if spec.answer_model == "requested":
        call = replace(call, answer_model=call.model)
    return spec, call


def resolve(
    services: Services,
    call: Call,
    spec: ModelSpec,
    scope: Scope,
    *,
    request_id: str,
    arrived: float,
) -> Decision:
    """Route an admitted call with what its headers ask for (budgets, priority). No await from
    here to the proxy's start, so the request keeps the services it reads now to its end.
    Raises InvalidRequestError naming a header that is not valid, and what `decide` raises."""
    headers = read_headers(scope, request_id)
    asked_ttft, asked_total = headers.ttft_budget_ms, headers.total_budget_ms
    if asked_ttft and asked_total and asked_ttft > asked_total:
        raise InvalidRequestError(
            f"The TTFT budget ({asked_ttft} ms) exceeds the total budget ({asked_total} ms).",
            param=headers.ttft_header,
            code="invalid_header",
        )
    # A budget header overrides the model's configured budget.
    budget = budget_for(
        spec,
        call,
        arrived=arrived,
        ttft_ms=asked_ttft,
        total_ms=asked_total,
        tpot_ms=headers.tpot_budget_ms,
        may_hedge=not headers.client_retry,
    )
    priority = headers.priority or spec.priority
    if priority != call.priority:
        call = replace(call, priority=priority)
    bulk = call.priority == "bulk" and not call.stream and call.endpoint in BATCHED_ENDPOINTS
    batchers = services.batchers if bulk else None
    return decide(services, call, spec, budget, headers=headers.forward, batchers=batchers)


def check_model(principal: Principal | None, model: str, names: ModelNames) -> None:
    """Whether the key may use `model` (an alias counts as the model it names): raises
    PermissionDeniedError when it may not. A model unknown to everyone passes: the lookup's 404
    says so, without listing other keys' models."""
    allowed = principal.models if principal is not None else None
    if principal is None or allowed is None or model in allowed:
        return
    spec = names.lookup(model)
    if spec is not None and spec.name not in allowed:
        raise PermissionDeniedError(
            f"The key '{principal.name}' may not use the model '{model}'.",
            param="model",
            code="model_not_allowed",
        )


def _check_key(principal: Principal, call: Call, names: ModelNames) -> Call:
    """What a key may ask for: its models (an alias counts as the model it names), and its caps
    on `n` and `max_tokens`. Returns the call as admitted: with the key's cap as its max_tokens
    when it sets none."""
    check_model(principal, call.model, names)
    if principal.max_n is not None:
        # `best_of` (completions) generates that many on the server, returned or not.
        for param in ("n", "best_of"):
            value = call.n if param == "n" else call.body.get(param)
            if isinstance(value, int) and value > principal.max_n:
                raise InvalidRequestError(
                    f"Invalid '{param}': {value} is over this key's limit of {principal.max_n}.",
                    param=param,
                    code="key_limit_exceeded",
                )
    cap = principal.max_tokens
    fields = OUTPUT_LENGTH_FIELDS[call.endpoint]
    if cap is None or not fields:
        return call
    # Every field that sets the output length is held to the cap, whichever the upstream reads.
    for param in fields:
        value = call.body.get(param)
        if value is None:
            continue
        if value > cap or value < 1:  # 0: vLLM reads `max_completion_tokens or ...`: no limit
            raise InvalidRequestError(
                f"Invalid '{param}': {value} is outside this key's limit of 1 to {cap}.",
                param=param,
                code="key_limit_exceeded",
            )
    if call.max_tokens is not None:
        return call
    # Without a cap of its own the request could run to the model's limit: it gets the key's.
    body = {**call.body, fields[0]: cap}
    return replace(call, body=body, raw=orjson.dumps(body), max_tokens=cap)


def visible_models(services: Services, principal: Principal | None) -> list[str]:
    allowed = principal.models if principal is not None else None
    return [name for name in services.models if allowed is None or name in allowed]


# --- the body ------------------------------------------------------------------------------------


class ClientGoneError(Exception):
    """The client disconnected while its request was being read."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, refusing it as soon as it is known to exceed `limit` bytes, or when it
    has not all arrived within `timeout_s` (a client trickling its body holds a slot)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and (len(value) > 15 or int(value) > limit):
                raise BodyTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
            break
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_parts(receive, limit)
    except TimeoutError:
        raise RequestTimeoutError(
            f"The request body did not arrive within {timeout_s:g} s."
        ) from None


async def _read_parts(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise BodyTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
            parts.append(part)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


# --- the headers ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestHeaders:
    """What the gateway reads from a request's headers, in one pass."""

    forward: dict[str, str]  # sent upstream as-is
    ttft_budget_ms: int | None = None
    ttft_header: str = TTFT_BUDGET_HEADER  # the header the TTFT budget came from, for errors
    total_budget_ms: int | None = None
    tpot_budget_ms: int | None = None  # x-slo-tpot-ms: the mean time per token after the first
    client_retry: bool = False  # the client SDK says this is its own retry: do not hedge it
    priority: str | None = None  # x-tailguard-priority: interactive | bulk


def read_headers(scope: Scope, request_id: str) -> RequestHeaders:
    """Raises InvalidRequestError naming a budget header whose value is not a positive integer.
    `x-slo-ttft-ms` is read as the TTFT budget unless `x-tailguard-ttft-budget-ms` is sent too."""
    found = RequestHeaders({"x-request-id": request_id})
    slo_ttft_ms = None
    for name, value in scope["headers"]:
        if name == b"traceparent":
            traceparent = value.decode("latin-1")
            if TRACEPARENT.match(traceparent):
                found.forward["traceparent"] = traceparent
        elif name == b"anthropic-beta":
            # Feature flags of Anthropic's API: only ever sent to Anthropic upstreams.
            found.forward["anthropic-beta"] = value.decode("latin-1")
        elif name in _AGENT_HEADERS or name.startswith(b"x-codex-"):
            # A coding agent's session headers: only ever sent to native Responses upstreams
            # (see `gateway.providers.request.is_agent_header`).
            found.forward[name.decode("latin-1")] = value.decode("latin-1")
        elif name == b"x-tailguard-ttft-budget-ms":
            found.ttft_budget_ms = _budget(TTFT_BUDGET_HEADER, value)
        elif name == b"x-tailguard-total-budget-ms":
            found.total_budget_ms = _budget(TOTAL_BUDGET_HEADER, value)
        elif name == b"x-slo-ttft-ms":
            slo_ttft_ms = _budget(SLO_TTFT_HEADER, value)
        elif name == b"x-slo-tpot-ms":
            found.tpot_budget_ms = _budget(SLO_TPOT_HEADER, value)
        elif name == b"x-stainless-retry-count":
            found.client_retry = value.strip() not in (b"", b"0")
        elif name == b"x-tailguard-priority":
            priority = value.decode("latin-1").strip().lower()
            if priority not in ("interactive", "bulk"):
                raise InvalidRequestError(
                    f"Invalid '{PRIORITY_HEADER}': expected 'interactive' or 'bulk', got "
                    f"{priority[:40]!r}.",
                    param=PRIORITY_HEADER,
                    code="invalid_header",
                )
            found.priority = priority
    if found.ttft_budget_ms is None and slo_ttft_ms is not None:
        found.ttft_budget_ms, found.ttft_header = slo_ttft_ms, SLO_TTFT_HEADER
    return found


def _budget(header: str, value: bytes) -> int:
    text = value.decode("latin-1").strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 7) or not (
        0 < int(text) <= _MAX_BUDGET_MS
    ):
        raise InvalidRequestError(
            f"Invalid '{header}': expected a whole number of milliseconds between 1 and "
            f"{_MAX_BUDGET_MS}, got {text[:40]!r}.",
            param=header,
            code="invalid_header",
        )
    return int(text)
