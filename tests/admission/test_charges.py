"""What a key is charged: a continued conversation pays for everything sent upstream (the stored
turns expanded, not its last message), and token counting pays a request against the key's rpm.

Real servers on loopback: the simulator as the upstream (a chat-only vLLM deployment, so a
Responses request is translated to chat and its `instructions` become a system message) and the
gateway, in the test's loop, with the limiter in memory.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest

from gateway.admission.auth import new_key
from tests.conftest import Upstream, gateway_settings, run_gateway
from tests.timing import scaled

KEY, KEY_HASH = new_key()
TURN_TOKENS: Final = 8_000  # what the stored turn wrote: the conversation the next turns carry
CONTINUATIONS: Final = 10


def settings(upstream: Upstream, writes: int, **key: Any) -> Any:
    return gateway_settings(
        {"up": {"type": "vllm", "base_url": upstream.base_url}},
        [{"name": "m", "deployments": [{"provider": "up", "model": f"m@output_tokens={writes}"}]}],
        auth={"keys": [{"name": "team", "sha256": KEY_HASH, **key}]},
    )


def bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=scaled(30)) as client:
        yield client


async def respond(http: httpx.AsyncClient, url: str, **body: Any) -> httpx.Response:
    return await http.post(url + "/v1/responses", json={"model": "m", **body}, headers=bearer())


def used(answer: httpx.Response) -> int:
    usage = answer.json()["usage"]
    return int(usage["input_tokens"]) + int(usage["output_tokens"])


# --- a continued conversation ---------------------------------------------------------------------


async def test_continuations_of_a_long_turn_are_admitted_as_the_tpm_allows(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """Ten concurrent `{"input": "and?", "previous_response_id": <an 8k-token turn>}` on a key
    with tpm 40,000: each is charged the whole conversation it sends upstream, so the turn and
    the continuations admitted use at most the tpm and one request more; the others get a 429
    in OpenAI's shape, naming the tokens limit. (Each used to be charged its last message:
    all ten were admitted, about 88,000 tokens in a minute.)"""
    tpm = 40_000
    async with run_gateway(settings(upstream, TURN_TOKENS, tpm=tpm)) as gw:
        first = await respond(http, gw.url, input="Tell me a long story.")
        assert first.status_code == 200, first.text[:300]
        answers = await asyncio.gather(
            *(
                respond(
                    http,
                    gw.url,
                    input="and?",
                    instructions="Answer briefly.",  # a system message once translated
                    previous_response_id=first.json()["id"],
                    max_output_tokens=16,
                )
                for _ in range(CONTINUATIONS)
            )
        )
    admitted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert admitted and refused
    assert all(used(a) > TURN_TOKENS for a in admitted)  # each carried the whole turn
    spent = [used(first), *(used(a) for a in admitted)]
    assert sum(spent) <= tpm + max(spent), spent
    for answer in refused:
        assert answer.status_code == 429
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        assert "(TPM)" in error["message"]
        assert int(answer.headers["retry-after"]) >= 1


async def test_a_continuation_larger_than_the_tpm_is_refused_for_what_it_sends(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """A turn that wrote 6,000 tokens, continued with `max_output_tokens: 3000` on a key with
    tpm 10,000: the continuation needs the conversation (the turn's text, counted again as
    input) and its output, more than the tpm, so it is refused for good
    (`x-should-retry: false`), and the tokens it is said to need are about what the upstream
    would count. (It used to be charged ~3,050 tokens, and admitted.)"""
    asked = 3_000
    async with run_gateway(settings(upstream, 6_000, tpm=10_000)) as gw:
        first = await respond(http, gw.url, input="Tell me a long story.")
        assert first.status_code == 200, first.text[:300]
        answer = await respond(
            http,
            gw.url,
            input="and?",
            previous_response_id=first.json()["id"],
            max_output_tokens=asked,
        )
    assert answer.status_code == 429, answer.text[:300]
    assert answer.headers["x-should-retry"] == "false"
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    found = re.search(r"needs about (\d+) tokens", error["message"])
    assert found is not None, error["message"]
    # The upstream counts the turn's text again as input (the simulator: 4 characters a token).
    text = first.json()["output"][0]["content"][0]["text"]
    assert used(first) + asked <= int(found[1])
    assert len(text) / 4 + asked <= int(found[1]) <= len(text) / 4 * 1.1 + asked + 100


async def test_a_key_at_its_rpm_is_refused_before_its_conversation_is_read(
    upstream: Upstream, http: httpx.AsyncClient
) -> None:
    """A key at its rpm: its next continuation is a 429 (`requests`, with a `retry-after`)
    before the store is read, so a refusal costs no expansion of a stored conversation: an id
    that does not exist is not even looked up. (A key owing tokens is refused there too.)"""
    async with run_gateway(settings(upstream, 5, rpm=1, tpm=100_000)) as gw:
        first = await respond(http, gw.url, input="Tell me a story.")
        assert first.status_code == 200, first.text[:300]
        answer = await respond(http, gw.url, input="and?", previous_response_id="resp_missing")
    assert answer.status_code == 429, answer.text[:300]
    assert answer.json()["error"]["type"] == "requests"
    assert int(answer.headers["retry-after"]) >= 1


# --- token counting -------------------------------------------------------------------------------


COUNT_PATHS: Final = {
    "openai": ("/v1/responses/input_tokens", {"model": "m", "input": "How many tokens?"}),
    "anthropic": (
        "/v1/messages/count_tokens",
        {"model": "m", "messages": [{"role": "user", "content": "How many tokens?"}]},
    ),
}


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_counting_is_charged_to_the_keys_rpm(
    upstream: Upstream, http: httpx.AsyncClient, wire: str
) -> None:
    """A count is a request against the key's rpm (and nothing against its tpm): on a key with
    rpm 3, the fourth count in a row is a 429 in the endpoint's wire, and an LLM request after
    them is refused too, the counts having used the minute's requests. (Counts used to be
    free: 40 in a row on an rpm-30 key were all answered, each forwarded upstream.)"""
    path, body = COUNT_PATHS[wire]
    async with run_gateway(settings(upstream, 5, rpm=3, tpm=1_000)) as gw:
        counts = [await http.post(gw.url + path, json=body, headers=bearer()) for _ in range(4)]
        chat = await http.post(
            gw.base_url + "/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers=bearer(),
        )
    assert [c.status_code for c in counts] == [200, 200, 200, 429], counts[-1].text
    refused = counts[-1].json()
    if wire == "anthropic":
        assert refused["type"] == "error"
        assert refused["error"]["type"] == "rate_limit_error"
        assert counts[0].headers["anthropic-ratelimit-requests-remaining"] == "2"
        assert "anthropic-ratelimit-tokens-remaining" not in counts[0].headers
    else:
        assert (refused["error"]["type"], refused["error"]["code"]) == (
            "requests",
            "rate_limit_exceeded",
        )
        assert counts[0].headers["x-ratelimit-remaining-requests"] == "2"
        assert "x-ratelimit-remaining-tokens" not in counts[0].headers
    assert "(RPM)" in str(refused)
    assert int(counts[-1].headers["retry-after"]) >= 1
    assert chat.status_code == 429
