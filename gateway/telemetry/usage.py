"""Prompt tokens of committed requests, and the part the upstream's prompt cache served.

Counted in memory on the request path (a dict update); `PromptTokensCollector` exposes the
counts at scrape time and `/admin/latency` reads each deployment's totals.
"""

from __future__ import annotations

from typing import Any

from gateway.models import Usage


class PromptTokens:
    """Each committed request's prompt tokens as its upstream reported them, by the model asked
    for and the deployment that served: all of them, and of those the ones read from and written
    to the upstream's prompt cache (None while the upstream never reported that count), since
    start on this replica."""

    def __init__(self) -> None:
        # (model, deployment) -> [prompt, read from the cache, written to it]
        self.counts: dict[tuple[str, str], list[int | None]] = {}

    def count(self, model: str, deployment: str, usage: Usage) -> None:
        """One committed request's usage; nothing when the upstream reported no prompt count."""
        prompt = usage.input_tokens
        if prompt is None:
            return
        counts = self.counts.get((model, deployment))
        if counts is None:
            counts = self.counts[(model, deployment)] = [0, None, None]
        counts[0] = (counts[0] or 0) + prompt
        if usage.cached_tokens is not None:
            counts[1] = (counts[1] or 0) + usage.cached_tokens
        if usage.cache_write_tokens is not None:
            counts[2] = (counts[2] or 0) + usage.cache_write_tokens

    def by_deployment(self) -> dict[str, dict[str, Any]]:
        """Per deployment, all models together: the prompt tokens counted, those read from and
        written to the upstream's cache (None: never reported), and the share read from it
        (`cached_share`: cached / prompt tokens, None when either is unknown)."""
        totals: dict[str, list[int | None]] = {}
        for (_, deployment), counts in self.counts.items():
            total = totals.setdefault(deployment, [0, None, None])
            for i, value in enumerate(counts):
                if value is not None:
                    total[i] = (total[i] or 0) + value
        view: dict[str, dict[str, Any]] = {}
        for deployment, (prompt, cached, written) in sorted(totals.items()):
            share = round(cached / prompt, 4) if prompt and cached is not None else None
            view[deployment] = {
                "input_tokens": prompt,
                "cached_tokens": cached,
                "cache_write_tokens": written,
                "cached_share": share,
            }
        return view
