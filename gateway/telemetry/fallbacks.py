"""What was served by another candidate than the first one planned (`tailguard_fallbacks_total`),
and what fallback models served instead of the model asked for (`tailguard_fallback_served_total`).

Both keep their counter's own values beside it: `/admin/latency` (and the dashboard, `stats` and
`report` through it) reads those, so the page and a scrape never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter

from gateway.telemetry import semconv as sc

FALLBACK_REASONS: Final = ("budget", "budget_unattainable", "ttft_failover", "error_fallback")
"""Why an answer came from another candidate than the first planned: the route that reached it
(a hedge that won is counted by `tailguard_hedges_total{result="won"}` instead)."""


class Fallbacks:
    """Answers served by a candidate other than the first one the request's plan was made from
    (another deployment of the model, or a fallback model's), by the model asked for and why."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            sc.FALLBACKS,
            "Requests answered by a candidate other than the first one planned (another "
            "deployment or a fallback model), by the model asked for and why: budget, "
            "budget_unattainable (moved for latency), ttft_failover (a late first token), "
            "error_fallback (after errors). A hedge that won is counted by "
            "tailguard_hedges_total instead.",
            ["model", "reason"],
            registry=registry,
        )
        self._children: dict[tuple[str, str], Any] = {}
        self.counts: dict[tuple[str, str], int] = {}  # (model, reason) -> requests since start

    def count(self, model: str, route: str) -> None:
        """One answer to a request of `model` from a candidate other than the first planned,
        reached by `route`. A `primary` route there is a lead skipped at the race because its
        breaker opened after the plan was made: an error fallback."""
        reason = "error_fallback" if route == "primary" else route
        key = (model, reason)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.counter.labels(*key)
        child.inc()
        self.counts[key] = self.counts.get(key, 0) + 1

    def by_model(self) -> dict[str, dict[str, int]]:
        """{model: {reason: answers since start}}, for the models with any."""
        found: dict[str, dict[str, int]] = {}
        for (model, reason), n in sorted(self.counts.items()):
            found.setdefault(model, {})[reason] = n
        return found


class FallbackServed:
    """What fallback models serve instead of the model asked for, and why (the route)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            sc.FALLBACK_SERVED,
            "Requests served by a fallback model instead of the model asked for, by the "
            "fallback model and the route that reached it: budget or budget_unattainable "
            "(for latency), hedge or ttft_failover (a rescue), error_fallback (after errors).",
            ["model", "fallback", "route"],
            registry=registry,
        )
        self._children: dict[tuple[str, str, str], Any] = {}
        # (model, fallback, route) -> requests since start: the counter's own values, which
        # `/admin/latency` (and the dashboard, `stats` and `report` through it) reads.
        self.counts: dict[tuple[str, str, str], int] = {}

    def count(self, model: str, fallback: str, route: str) -> None:
        """One request of `model` served by the fallback model `fallback`, reached by `route`."""
        key = (model, fallback, route)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.counter.labels(*key)
        child.inc()
        self.counts[key] = self.counts.get(key, 0) + 1

    def by_model(self, requests: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Per model with `requests` (client requests since start, every outcome) or anything
        served by a fallback: the requests, how many a fallback model served and their share,
        and those by route and by fallback model."""
        found: dict[str, dict[str, Any]] = {
            model: {"requests": n, "served": 0, "routes": {}, "fallbacks": {}}
            for model, n in requests.items()
        }
        for (model, fallback, route), n in self.counts.items():
            entry = found.setdefault(
                model, {"requests": 0, "served": 0, "routes": {}, "fallbacks": {}}
            )
            entry["served"] += n
            entry["routes"][route] = entry["routes"].get(route, 0) + n
            entry["fallbacks"][fallback] = entry["fallbacks"].get(fallback, 0) + n
        for entry in found.values():
            total = entry["requests"]
            entry["share"] = round(entry["served"] / total, 4) if total else None
        return found
