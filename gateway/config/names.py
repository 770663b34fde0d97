"""Which configured model a requested name means: its own name, else the first alias that
matches it, in config order (`ModelSpec.aliases`)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Final

from gateway.config.specs import ModelSpec

_CACHED_NAMES: Final = 4096
"""Pattern matches remembered: the names agents send are few, but any client may send any."""


class ModelNames:
    """Resolves requested model names. Exact names and exact aliases are one dict lookup; a name
    matched by a pattern is matched once, then remembered (up to `_CACHED_NAMES` names)."""

    __slots__ = ("_cache", "_exact", "_patterns")

    def __init__(self, models: Iterable[ModelSpec]) -> None:
        models = tuple(models)
        self._exact: dict[str, ModelSpec] = {}
        self._patterns: list[tuple[re.Pattern[str], ModelSpec]] = []
        for model in models:
            for alias in model.aliases:
                if any(c in alias for c in "*?["):
                    self._patterns.append((re.compile(fnmatch.translate(alias)), model))
                else:
                    self._exact.setdefault(alias, model)
        for model in models:  # a configured name wins over any alias
            self._exact[model.name] = model
        self._cache: dict[str, ModelSpec | None] = {}

    def lookup(self, name: str) -> ModelSpec | None:
        """The model `name` means; None when it names none."""
        spec = self._exact.get(name)
        if spec is not None or not self._patterns:
            return spec
        try:
            return self._cache[name]
        except KeyError:
            pass
        spec = next((m for pattern, m in self._patterns if pattern.match(name)), None)
        if len(self._cache) >= _CACHED_NAMES:
            self._cache.clear()  # a client sending ever new names: start over, stay bounded
        self._cache[name] = spec
        return spec
