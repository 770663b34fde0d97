"""Credentials out of text that came from elsewhere: upstream error bodies and stream events,
upstream headers the gateway repeats, exception text.

A `Scrubber` belongs to one provider: it knows that provider's own secrets (its api key and the
values of its extra headers) in the forms an upstream may echo them (inside a longer string,
after `Bearer `, base64 as in Basic auth, percent- or JSON-escaped, in any letter case), and
also removes what merely looks like a credential (`sk-...`, `Bearer ...`, `api_key=...`). Each
adapter builds one and passes every upstream string through it where the bytes are decoded,
so nothing later (a client's error, a log line, a span, a stored response) sees the raw text.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import quote

import orjson

MASK = "***"
MARGIN_CHARS = 256
"""What `Scrubber.bounded` reads past its limit: a credential that starts before the cut is
masked whole, never left in part (the generic patterns' keys are far shorter)."""
MIN_SECRET_CHARS = 8
"""A configured value shorter than this is not searched for: masking every "on" or "1" in a
message (a header like `x-feature: on` is configured as a secret too) would garble it."""

_GENERIC = (
    (re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+"), r"\1 " + MASK),
    (re.compile(r"\b(sk|rk|pk)-[A-Za-z0-9_\-]{6,}"), r"\1-" + MASK),
    (
        re.compile(r"(?i)\b(api[_-]?key|key|token|access_token|secret|signature|sig)=[^&\s\"']+"),
        r"\1=" + MASK,
    ),
    (re.compile(r"(?i)(\"?(?:x-)?api-key\"?\s*[:=]\s*\"?)[^\s\"',;]+"), r"\1" + MASK),
    # Google: OAuth2 access tokens and API keys
    (re.compile(r"\bya29\.[A-Za-z0-9_\-.]{8,}"), "ya29." + MASK),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{20,}"), "AIza" + MASK),
)


def _base64_forms(secret: bytes) -> set[str]:
    """The base64 text that stands for `secret` wherever it sits in a longer encoded value
    (`user:key` in Basic auth): for each of the three alignments, the characters that depend
    on the secret's bytes alone."""
    forms: set[str] = set()
    for offset in range(3):
        encoded = base64.b64encode(bytes(offset) + secret).decode()
        start = 4 if offset else 0  # the first group mixes in the bytes before the secret
        end = len(encoded) - 4 if (offset + len(secret)) % 3 else len(encoded)
        for form in (encoded[start:end].rstrip("="), encoded if not offset else ""):
            if len(form) >= MIN_SECRET_CHARS:
                forms.add(form)
                forms.add(form.replace("+", "-").replace("/", "_"))  # the URL-safe alphabet
    return forms


def _basic_parts(value: str) -> set[str]:
    """`user:password` and the password, when `value` is a Basic credential."""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or not token:
        return set()
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return set()
    return {decoded, decoded.partition(":")[2]}


def forms_of(secret: str) -> set[str]:
    """Every form of `secret` a scrubber looks for (each at least MIN_SECRET_CHARS long)."""
    values = {secret, secret.strip()}
    scheme, _, token = secret.strip().partition(" ")
    if token and scheme.isalpha():  # "Bearer <token>", "Basic <base64>" as a header value
        values.add(token.strip())
    for value in list(values):
        values |= _basic_parts(value)
    forms: set[str] = set()
    for value in values:
        escaped = orjson.dumps(value).decode()[1:-1]
        forms |= {value, quote(value, safe=""), escaped, escaped.replace("/", "\\/")}
        forms |= _base64_forms(value.encode())
    return {form for form in forms if len(form) >= MIN_SECRET_CHARS}


@dataclass(frozen=True, slots=True)
class Scrubber:
    """Removes one provider's secrets and anything key-shaped from a string. Cheap to call:
    one regex pass per pattern, and only error text goes through it (never content)."""

    own: re.Pattern[str] | None = None
    margin: int = MARGIN_CHARS  # at least the longest form of its own secrets

    GENERIC: ClassVar[Scrubber]

    @classmethod
    def of(cls, secrets: Iterable[str]) -> Scrubber:
        forms: set[str] = set()
        for secret in secrets:
            if secret:
                forms |= forms_of(secret)
        if not forms:
            return cls.GENERIC
        # Longest first, so a form inside another (the token inside "Bearer <token>") never
        # leaves part of the longer one behind.
        alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
        margin = max(MARGIN_CHARS, max(len(f) for f in forms))
        return cls(re.compile(alternatives, re.IGNORECASE), margin)

    def __call__(self, text: str) -> str:
        if self.own is not None:
            text = self.own.sub(MASK, text)
        for pattern, replacement in _GENERIC:
            text = pattern.sub(replacement, text)
        return text

    def bounded(self, text: str, limit: int) -> str:
        """At most `limit` characters of `text`, scrubbed. Cut after the scrub, so that a
        secret across the cut is masked whole; only a margin past the limit is read, so a huge
        string costs no more than a short one."""
        return self(text[: limit + self.margin])[:limit]

    def optional(self, text: str | None, limit: int) -> str | None:
        return None if text is None else self.bounded(text, limit)

    def clean_or_none(self, text: str | None) -> str | None:
        """`text` if it carries nothing to scrub, else None: for a value that is repeated as a
        whole or not at all (an upstream's request id header)."""
        return text if text is None or self(text) == text else None


Scrubber.GENERIC = Scrubber()
