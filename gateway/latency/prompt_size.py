"""Prompt-size bands: how the latency statistics tell long prompts from short ones.

Prefill time grows with the prompt, so one deployment's TTFT is really a family of
distributions, one per prompt size. The gateway measures size by what it already holds, the
request body's bytes (about four per token in English text; no tokenizer on the hot path), and
groups requests into bands that double in size: band 0 holds bodies under 2 KiB (~500 tokens),
band `b` bodies of 2^b to 2^(b+1) KiB, and the last band everything from 128 KiB (~32k tokens).
An observation whose upstream reported prompt-cache reads counts at its uncached size: cached
tokens are not prefilled, so they would make a long prompt look fast for its length.
"""

from __future__ import annotations

from collections.abc import Sequence

BANDS = 8
_FIRST_KIB = 2


def band_of(prompt_bytes: int) -> int:
    """The band of a request body of `prompt_bytes` bytes."""
    kib = prompt_bytes >> 10
    if kib < _FIRST_KIB:
        return 0
    return min(BANDS - 1, kib.bit_length() - 1)


def band_label(band: int) -> str:
    """A human reading of a band's range, e.g. `4-8 KiB`."""
    if band <= 0:
        return f"<{_FIRST_KIB} KiB"
    if band >= BANDS - 1:
        return f">={1 << band} KiB"
    return f"{1 << band}-{1 << (band + 1)} KiB"


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares `y = base + slope * x` through (prompt bytes, latency) points, with the
    slope held at zero or above (a longer prompt never prefills faster); None with fewer than
    two distinct sizes."""
    n = len(points)
    if n < 2:
        return None
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread <= 0:
        return None
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
    return max(0.0, mean_y - slope * mean_x), slope


def uncached_bytes(prompt_bytes: int, input_tokens: int | None, cached: int | None) -> int:
    """The share of a body's bytes the upstream had to prefill: all of them, less the share of
    its prompt tokens it reported reading from its prompt cache (which cost no prefill)."""
    if not input_tokens or not cached or cached <= 0:
        return prompt_bytes
    return round(prompt_bytes * max(0, input_tokens - min(cached, input_tokens)) / input_tokens)
