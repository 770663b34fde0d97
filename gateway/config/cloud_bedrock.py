"""The checks of a `type: bedrock` provider's keys (AWS Bedrock's Converse API)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from gateway.config.specs import ProviderSpec

# us-east-1, eu-central-2, ap-southeast-4, us-gov-west-1, cn-north-1, ...
_REGION: Final = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$")
BEDROCK_KEYS: Final = ("region", "aws_profile", "performance_latency")


def default_endpoint(region: str) -> str:
    """Bedrock's runtime endpoint in `region` (what `base_url` overrides)."""
    return f"https://bedrock-runtime.{region}.amazonaws.com"


def shown_base_url(spec: ProviderSpec) -> str | None:
    """The URL a provider is reached at, implied ones included (for check-config)."""
    if spec.type == "bedrock" and spec.base_url is None and spec.region is not None:
        return default_endpoint(spec.region)
    return spec.base_url


def check_bedrock(spec: ProviderSpec) -> None:
    """Raises ValueError explaining what is wrong with a bedrock provider's keys."""
    if spec.region is None:
        raise ValueError(
            "region is required for a provider of type 'bedrock' (the AWS region the models "
            "run in, e.g. us-east-1; it is part of the endpoint and of the SigV4 signature)"
        )
    if not _REGION.match(spec.region):
        raise ValueError(
            f"region {spec.region!r} is not an AWS region name (like us-east-1 or eu-west-3)"
        )
    if spec.base_url is not None:
        parts = urlsplit(spec.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "base_url must be an http:// or https:// URL with a host (for bedrock it is "
                f"optional: the default is {default_endpoint(spec.region)})"
            )
        if parts.query or parts.fragment:
            raise ValueError("base_url must not carry a query or fragment")
        if parts.path.rstrip("/").endswith(("/converse", "/converse-stream")) or "/model/" in (
            parts.path
        ):
            raise ValueError(
                "base_url is the endpoint alone (like https://bedrock-runtime.us-east-1."
                "amazonaws.com): the gateway adds /model/{model}/converse itself"
            )
    if spec.api_key is not None and spec.aws_profile is not None:
        raise ValueError(
            "api_key (a Bedrock API key, sent as a bearer token) and aws_profile (SigV4 with "
            "that profile's credentials) are two ways to authenticate: set one"
        )
    if spec.responses != "translate":
        raise ValueError("responses: native is for providers of type openai")
    if spec.profiles or spec.default_profile is not None or spec.seed is not None:
        raise ValueError("profiles, default_profile and seed apply to simulated providers only")


def refuse_bedrock_keys(spec: ProviderSpec) -> None:
    """Raises ValueError when a provider of another type sets a bedrock-only key."""
    for key in BEDROCK_KEYS:
        if getattr(spec, key) is not None:
            raise ValueError(f"{key} is for providers of type bedrock")
