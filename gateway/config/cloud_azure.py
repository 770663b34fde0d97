"""The checks of an Azure OpenAI provider's keys (`type: azure`), kept beside the schema that
calls them so that `tailguard check-config` can say what is wrong and what to write instead."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.config.specs import ProviderSpec

_DATED: Final = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
_KEYS: Final = ("api_version", "azure_ad_token", "azure_ad_token_file", "content_filter_failover")


def azure_keys_set(spec: ProviderSpec) -> bool:
    """Whether any key meant for Azure only is set."""
    return any(_set(spec, key) for key in _KEYS)


def _set(spec: ProviderSpec, key: str) -> bool:
    value = getattr(spec, key)
    return value is not None and value is not False


def _filled(secret: object) -> bool:
    get = getattr(secret, "get_secret_value", None)
    return bool(get() if get is not None else secret)


def check_azure(spec: ProviderSpec) -> None:
    """Raise ValueError naming the key when an Azure provider's settings cannot work, or when a
    key meant for Azure is set on another type."""
    if spec.type != "azure":
        key = next(key for key in _KEYS if _set(spec, key))
        raise ValueError(f"{key} is for providers of type azure (this one is {spec.type!r})")
    version = spec.api_version
    if version is None:
        raise ValueError(
            "api_version is required for a provider of type 'azure': 'v1' (the /openai/v1/ "
            "paths) or a dated version such as '2024-10-21' (the "
            "/openai/deployments/{deployment}/ paths)"
        )
    if version != "v1" and not _DATED.match(version):
        raise ValueError(
            f"api_version {version!r} is neither 'v1' nor a date such as '2024-10-21' "
            "(a preview version: '2025-04-01-preview')"
        )
    given = [
        name
        for name, value in (
            ("api_key", spec.api_key),
            ("azure_ad_token", spec.azure_ad_token),
            ("azure_ad_token_file", spec.azure_ad_token_file),
        )
        if value is not None and _filled(value)
    ]
    if not given:
        raise ValueError(
            "a provider of type 'azure' needs a credential: api_key (sent as api-key), or an "
            "Entra ID token in azure_ad_token (use ${VAR}) or azure_ad_token_file"
        )
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are alternatives: set only one of them")
    if spec.base_url is not None:
        path = urlsplit(spec.base_url).path.rstrip("/")
        if path.endswith(("/openai", "/openai/v1")) or "/openai/deployments" in path:
            raise ValueError(
                "base_url of an azure provider is the resource's root, such as "
                f"https://<resource>.openai.azure.com, without {path[path.index('/openai') :]!r}: "
                "the gateway adds the /openai/... path itself, as api_version says"
            )
