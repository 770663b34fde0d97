"""Prompt-size bands, and what counts as a prompt's size when the upstream cached part of it."""

from __future__ import annotations

import orjson
import pytest

from gateway.latency.prompt_size import band_label, band_of, fit_line, uncached_bytes
from gateway.models import SSEEvent
from gateway.providers.decode import (
    AnthropicStreamDecoder,
    decode_anthropic_body,
    decode_openai_body,
)
from gateway.scrubbing import Scrubber


def test_bands_double_in_size() -> None:
    """Under 2 KiB is band 0; then each band doubles; the last holds everything from 128 KiB."""
    assert [band_of(n) for n in (0, 2047, 2048, 4095, 4096, 64 << 10, 10**9)] == [
        0,
        0,
        1,
        1,
        2,
        6,
        7,
    ]
    assert [band_label(b) for b in (0, 3, 7)] == ["<2 KiB", "8-16 KiB", ">=128 KiB"]


def test_a_fit_needs_two_sizes_and_never_slopes_down() -> None:
    assert fit_line([(1.0, 5.0)]) is None
    assert fit_line([(1.0, 5.0), (1.0, 7.0)]) is None
    assert fit_line([(0.0, 10.0), (10.0, 30.0)]) == pytest.approx((10.0, 2.0))
    assert fit_line([(0.0, 30.0), (10.0, 10.0)]) == pytest.approx((20.0, 0.0))


def test_cached_prompt_tokens_cost_no_prefill() -> None:
    """An observation counts at the share of its body the upstream had to prefill."""
    assert uncached_bytes(64_000, 16_000, 12_000) == 16_000
    assert uncached_bytes(64_000, 16_000, None) == 64_000
    assert uncached_bytes(64_000, None, 500) == 64_000
    assert uncached_bytes(64_000, 100, 10**6) == 0  # a count over the prompt is capped


def test_cached_tokens_are_read_from_both_wires() -> None:
    """OpenAI's `prompt_tokens_details.cached_tokens` and Anthropic's cache reads, in bodies and
    streams."""
    openai = {
        "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 900,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 768},
        },
    }
    usage = decode_openai_body(orjson.dumps(openai), scrub=Scrubber.GENERIC).usage
    assert usage is not None and (usage.input_tokens, usage.cached_tokens) == (900, 768)
    anthropic = {
        "type": "message",
        "content": [{"type": "text", "text": "hi"}],
        "usage": {"input_tokens": 100, "cache_read_input_tokens": 800, "output_tokens": 5},
    }
    usage = decode_anthropic_body(orjson.dumps(anthropic), scrub=Scrubber.GENERIC).usage
    assert usage is not None and (usage.input_tokens, usage.cached_tokens) == (900, 800)
    decoder = AnthropicStreamDecoder(scrub=Scrubber.GENERIC)
    start = {"type": "message_start", "message": {"usage": anthropic["usage"]}}
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 5},
    }
    for event in (start, delta):
        data = orjson.dumps(event)
        chunk = decoder.decode(SSEEvent(event=str(event["type"]), data=data, raw=data))
    assert chunk.usage is not None and chunk.usage.cached_tokens == 800
