"""The checks of a `gemini` or `vertex` provider's keys, with messages that say what to write."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gateway.config.specs import ProviderSpec

GEMINI_API: Final = "https://generativelanguage.googleapis.com"

_LOCATION: Final = re.compile(r"^(global|[a-z]+(-[a-z0-9]+)+)$")
# Project ids are 6-30 lowercase letters, digits and hyphens; older ones may be domain-scoped.
_PROJECT: Final = re.compile(r"^([a-z][a-z0-9.\-]*:)?[a-z][a-z0-9\-]{4,28}[a-z0-9]$")


def google_base_url(spec: ProviderSpec) -> str | None:
    """Where a gemini or vertex provider without `base_url` sends its requests (None for the
    other types): the Gemini API, or Vertex's regional (or global) endpoint."""
    if spec.type == "gemini":
        return GEMINI_API
    if spec.type == "vertex":
        if spec.location in (None, "global"):
            return "https://aiplatform.googleapis.com"
        return f"https://{spec.location}-aiplatform.googleapis.com"
    return None


def check_google(spec: ProviderSpec) -> None:
    """Raises ValueError naming the key and what it should hold."""
    vertex_keys = [
        key for key in ("project", "location", "credentials_file") if getattr(spec, key) is not None
    ]
    if spec.publisher != "google":
        vertex_keys.append("publisher")
    if spec.type != "vertex":
        if vertex_keys:
            verb = "is" if len(vertex_keys) == 1 else "are"
            raise ValueError(f"{' and '.join(vertex_keys)} {verb} for providers of type vertex")
        if spec.type == "gemini" and spec.api_key is None:
            raise ValueError(
                "a gemini provider needs api_key: the Gemini API key, sent as x-goog-api-key "
                "(write api_key: ${GEMINI_API_KEY})"
            )
        return
    if spec.api_key is not None:
        raise ValueError(
            "a vertex provider takes no api_key: it authenticates with OAuth2, from "
            "credentials_file (a service-account JSON key) or Application Default Credentials"
        )
    if not spec.project:
        raise ValueError("a vertex provider needs project: the Google Cloud project id")
    if not _PROJECT.match(spec.project):
        raise ValueError(
            f"project {spec.project!r} is not a Google Cloud project id (6 to 30 lowercase "
            "letters, digits and hyphens, e.g. my-project-123)"
        )
    if not spec.location:
        raise ValueError(
            "a vertex provider needs location: a region such as us-central1, or global"
        )
    if not _LOCATION.match(spec.location):
        raise ValueError(
            f"location {spec.location!r} is not a Vertex AI location (a region such as "
            "us-central1 or europe-west4, or global)"
        )
    if spec.credentials_file is not None and not Path(spec.credentials_file).is_file():
        raise ValueError(
            f"credentials_file {spec.credentials_file!r} is not a file (a service-account JSON "
            "key; leave it out to use Application Default Credentials)"
        )
