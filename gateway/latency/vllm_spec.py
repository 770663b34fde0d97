"""Speculative decoding as a vLLM server counts it, and its rates over a scrape interval.

V1 counts drafts (one per sequence per step), draft tokens, accepted tokens and accepted tokens
per draft position; V0 had the token counters too, an emitted-token counter, and two gauges (the
acceptance rate and the system efficiency). The rates come from the counters' differences
between two scrapes: acceptance = accepted / draft tokens, accepted per draft (tokens per step is
one more: the target's own token), and per position the share of drafts accepted up to it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpecCounters", "SpecRates", "ratio", "spec_rates"]


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """Speculative decoding's series on one page, cumulative (None: not exported)."""

    drafts: float | None = None  # V1 only: draft proposals, one per sequence per step
    draft_tokens: float | None = None
    accepted: float | None = None
    emitted: float | None = None  # V0 only
    per_position: tuple[float, ...] = ()  # accepted at draft position 0, 1, ...
    acceptance_gauge: float | None = None  # V0's `draft_acceptance_rate`
    efficiency_gauge: float | None = None  # V0's `efficiency`


@dataclass(frozen=True, slots=True)
class SpecRates:
    """Speculative decoding over the latest scrape interval (None: unknown)."""

    acceptance: float | None  # accepted / draft tokens
    accepted_per_draft: float | None  # mean accepted tokens per draft
    per_position: tuple[float, ...]  # share of drafts accepted up to each position
    efficiency: float | None  # V0's gauge, as the server reports it

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens one target step yields: its own, plus the accepted draft tokens."""
        per_draft = self.accepted_per_draft
        return None if per_draft is None else 1.0 + per_draft


def spec_rates(now: SpecCounters, before: SpecCounters | None) -> SpecRates:
    """Speculative decoding's rates between two scrapes (the counters' differences), or since
    the start when there is no scrape before or a counter went down (a restart). V0's gauge
    stands in for the acceptance when the server exports no token counters."""
    pairs = [
        (now.drafts, before.drafts if before else None),
        (now.draft_tokens, before.draft_tokens if before else None),
        (now.accepted, before.accepted if before else None),
        *zip(now.per_position, before.per_position if before else (), strict=False),
    ]
    reset = before is None or any(b is not None and n is not None and n < b for n, b in pairs)
    old = SpecCounters() if reset or before is None else before

    def delta(n: float | None, b: float | None) -> float | None:
        return None if n is None else n - (b or 0.0)

    drafts = delta(now.drafts, old.drafts)
    tokens = delta(now.draft_tokens, old.draft_tokens)
    accepted = delta(now.accepted, old.accepted)
    acceptance = ratio(accepted, tokens)
    per_position: tuple[float, ...] = ()
    if drafts:
        earlier = old.per_position
        per_position = tuple(
            min(1.0, (n - (earlier[i] if i < len(earlier) else 0.0)) / drafts)
            for i, n in enumerate(now.per_position)
        )
    if now.accepted is None or now.draft_tokens is None:
        acceptance = now.acceptance_gauge
    return SpecRates(
        acceptance=acceptance,
        accepted_per_draft=None if accepted is None or not drafts else accepted / drafts,
        per_position=per_position,
        efficiency=now.efficiency_gauge,
    )


def ratio(part: float | None, whole: float | None) -> float | None:
    """part / whole in [0, 1]; None when either is unknown or nothing was counted."""
    if part is None or not whole:
        return None
    return min(1.0, part / whole)
