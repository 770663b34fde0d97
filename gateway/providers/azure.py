"""Azure OpenAI (`type: azure`): the OpenAI chat wire, with Azure's paths, auth and quirks.

- Paths: `api_version: v1` sends to `/openai/v1/chat/completions` (the deployment's name is the
  body's `model`, which the gateway sets anyway); a dated version sends to
  `/openai/deployments/{deployment}/chat/completions?api-version=...`.
- Auth: `api_key` as the `api-key` header, or an Entra ID token as `Authorization: Bearer`,
  either fixed (`azure_ad_token`) or read from a file that is read again whenever it changes
  (`azure_ad_token_file`: a token rotated on disk is used from the next request on).
- Streams: Azure's chunks that carry nothing but content-filter results (the first one, with
  empty `choices` and `prompt_filter_results`, and any later one whose choices hold only
  `content_filter_results`) are dropped here: they never reach a client and never count as
  content. The `content_filter` finish reason is relayed; the translators turn it into each
  client wire's content-filter answer.
- Errors: a 400 with code `content_filter` is a `ContentFilteredError`, final unless the provider
  sets `content_filter_failover`. A 429's `retry-after-ms` drives the cooldown like any 429's
  `retry-after` (`gateway.errors.parse_retry_after`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final
from urllib.parse import quote

from gateway.config import ProviderSpec
from gateway.errors import ContentFilteredError, ProviderError, ProviderRejectedError
from gateway.models import Chunk, Endpoint, UpstreamRequest
from gateway.providers.http import CountRequest, Session
from gateway.providers.openai import PATHS as _PATHS
from gateway.providers.openai import OpenAIProvider
from gateway.scrubbing import Scrubber
from gateway.upstream import TokenQuery, UpstreamStream

log = logging.getLogger(__name__)

_FILTER_KEYS: Final = frozenset({"content_filter_results", "content_filter_offsets"})
_IDLE_CHOICE_KEYS: Final = _FILTER_KEYS | {"index", "finish_reason", "logprobs", "delta"}


class TokenFile:
    """An Entra ID token kept in a file (a workload identity's projected token, a sidecar's
    output): read again whenever the file's identity, size or modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.token: str | None = None
        self._failing = False  # the last look at the file failed

    def current(self, deployment: str) -> str:
        """The token now in the file (the previous one while the file cannot be read or is
        empty, as in the middle of a rewrite). One `stat` per request, a read per change."""
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if stamp != self._stamp:
                with open(self.path, encoding="utf-8") as file:
                    token = file.read().strip()
                if token:
                    self.token, self._stamp = token, stamp
        except (OSError, UnicodeDecodeError) as exc:
            if self.token is None:
                raise ProviderError(
                    f"cannot read azure_ad_token_file ({type(exc).__name__})",
                    deployment=deployment,
                    kind="credentials",
                ) from None
            if not self._failing:  # once per failure, not once per request
                log.warning(
                    "azure_ad_token_file %s unreadable (%s): the last token read stays in use",
                    self.path,
                    type(exc).__name__,
                )
            self._failing = True
        else:
            self._failing = False
        if self.token is None:
            raise ProviderError(
                "azure_ad_token_file is empty", deployment=deployment, kind="credentials"
            )
        return self.token


class AzureProvider(OpenAIProvider):
    """An Azure OpenAI resource: its deployments are the gateway deployments' `model`s. Azure
    offers no token counter (its Responses API has no `input_tokens`)."""

    system = "azure.ai.openai"

    def __init__(self, name: str, spec: ProviderSpec, session: Session) -> None:
        super().__init__(name, spec, session)
        assert spec.base_url is not None and spec.api_version is not None  # checked by the config
        root = spec.base_url.rstrip("/") + "/openai"
        version = spec.api_version
        self._v1 = version == "v1"
        self._base = root + "/v1" if self._v1 else root + "/deployments/"
        self._query = "" if self._v1 else "?api-version=" + quote(version, safe="")
        self._urls = dict.fromkeys(_PATHS, "")  # what `supports` reads; urls are per deployment
        if spec.responses == "native":
            # The Responses API takes the deployment in the body on either shape.
            self._urls["responses"] = (
                root + "/v1/responses" if self._v1 else root + "/responses" + self._query
            )
        self._by_deployment: dict[tuple[str, Endpoint], str] = {}
        self._failover = spec.content_filter_failover
        self._file = TokenFile(spec.azure_ad_token_file) if spec.azure_ad_token_file else None
        if spec.azure_ad_token_file:
            self.credential = "azure_ad_token_file (its Entra ID token)"
        elif spec.azure_ad_token is not None:
            self.credential = "azure_ad_token"
        self._secrets = [v.get_secret_value() for v in spec.headers.values()]
        for secret in (spec.api_key, spec.azure_ad_token):
            if secret is not None:
                self._secrets.append(secret.get_secret_value())
        self._tokens: list[str] = []  # the file's latest tokens, masked in what upstreams write
        self.scrub = Scrubber.of(self._secrets)

    def _auth_headers(self, spec: ProviderSpec, key: str | None) -> dict[str, str]:
        if key:
            return {"api-key": key}
        if spec.azure_ad_token is not None:
            return {"authorization": f"Bearer {spec.azure_ad_token.get_secret_value()}"}
        return {}  # a token file: its token is added per request

    def _count_request(self, upstream_model: str, query: TokenQuery) -> CountRequest | None:
        return None

    def _url(self, deployment: str, endpoint: Endpoint) -> str:
        url = self._by_deployment.get((deployment, endpoint))
        if url is None:
            if endpoint == "responses":
                url = self._urls[endpoint]
            elif self._v1:
                url = self._base + _PATHS[endpoint]
            else:
                # The gateway's deployment id is `<provider>/<model>`: the model is Azure's name.
                name = quote(deployment.partition("/")[2], safe="")
                url = self._base + name + _PATHS[endpoint] + self._query
            self._by_deployment[(deployment, endpoint)] = url
        return url

    def _target(self, deployment: str, request: UpstreamRequest) -> tuple[str, dict[str, str]]:
        url, headers = self._url(deployment, request.endpoint), request.headers
        base = self._stream_headers if request.stream else self.body_headers
        if self._file is not None:
            token = self._file.current(deployment)
            if token not in self._tokens:
                self._rotated(token)
            base = base | {"authorization": f"Bearer {token}"}
        return url, base | headers if headers else base

    def _rotated(self, token: str) -> None:
        """A new token from the file: the scrubber masks it, and the one before it (requests
        sent with that may still answer)."""
        self._tokens = [*self._tokens[-1:], token]
        self.scrub = Scrubber.of([*self._secrets, *self._tokens])

    async def open(self, deployment: str, request: UpstreamRequest) -> UpstreamStream:
        try:
            stream = await super().open(deployment, request)
        except ProviderRejectedError as error:
            if error.code != "content_filter":
                raise
            raise ContentFilteredError(
                error.message[len(deployment) + 2 :],  # without the "<deployment>: " it gained
                deployment=deployment,
                failover=self._failover,
                param=error.param,
            ) from None
        if not stream.streaming or request.endpoint == "responses":
            return stream
        return FilteredStream(stream)


class FilteredStream:
    """An Azure chat stream without its events that carry nothing but filter results."""

    __slots__ = ("_inner", "status", "streaming", "upstream_request_id")

    def __init__(self, inner: UpstreamStream) -> None:
        self._inner = inner
        self.status = inner.status
        self.streaming = inner.streaming
        self.upstream_request_id = inner.upstream_request_id

    async def read(self) -> list[Chunk] | None:
        batch = await self._inner.read()
        if batch is None:
            return None
        for index, chunk in enumerate(batch):
            if chunk.data is not None and filter_results_only(chunk.data, chunk):
                batch[index] = Chunk(raw=b"")  # still an event before a first token: bounded
        return batch

    async def aclose(self) -> None:
        await self._inner.aclose()


def filter_results_only(data: dict[str, Any], chunk: Chunk) -> bool:
    """Whether a chat stream event carries nothing but Azure's content-filter results: empty
    `choices` (the first event's `prompt_filter_results`, or nothing) without usage, or choices
    that hold only `content_filter_results` / `content_filter_offsets` and no finish."""
    if chunk.usage is not None or chunk.error is not None or chunk.content:
        return False
    choices = data.get("choices")
    if not isinstance(choices, list):
        return False
    if not choices:
        return not data.get("usage")
    filtered = False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") or choice.get("delta"):
            return False
        if choice.get("logprobs"):
            return False
        if not choice.keys() <= _IDLE_CHOICE_KEYS:
            return False
        filtered = filtered or not _FILTER_KEYS.isdisjoint(choice)
    return filtered
