"""How a Bedrock request is authenticated: SigV4 with the standard AWS credential chain, through
botocore's own credential providers and signer, or a Bedrock API key sent as a bearer token.

The chain (environment, shared profile and config files, web identity, container and instance
metadata) may do network I/O, so it runs off the event loop, once; temporary credentials are
refreshed off the loop too, when botocore says they are due (its advisory window before expiry).
After the upstream refuses the credentials, the chain is resolved afresh on the next request.
"""

from __future__ import annotations

import asyncio

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, ReadOnlyCredentials, RefreshableCredentials
from botocore.exceptions import BotoCoreError
from botocore.session import Session

from gateway.scrubbing import Scrubber

SERVICE = "bedrock"  # the signing name of bedrock-runtime


class CredentialsError(Exception):
    """No usable AWS credentials; the message names no secret."""


class SigV4Signer:
    """Signs requests with the credentials the AWS chain resolves (`profile`: a shared-config
    profile, else the chain's default order)."""

    def __init__(self, region: str, profile: str | None, configured: list[str]) -> None:
        self.region = region
        self._configured = configured  # other secrets its scrubber must know (extra headers)
        self._profile = profile
        self._credentials: Credentials | None = None
        self._frozen: ReadOnlyCredentials | None = None
        self._stale = False
        self._lock = asyncio.Lock()
        # Grows the credentials' secrets once they are known.
        self.scrub = Scrubber.of(configured)

    def invalidate(self) -> None:
        """The upstream refused the credentials: resolve the chain again next time."""
        self._stale = True

    async def sign(self, url: str, body: bytes, headers: dict[str, str]) -> dict[str, str]:
        """`headers` plus `X-Amz-Date`, `Authorization` (and `X-Amz-Security-Token`)."""
        frozen = await self._current()
        request = AWSRequest(method="POST", url=url, data=body, headers=headers)
        SigV4Auth(frozen, SERVICE, self.region).add_auth(request)
        return dict(request.headers.items())

    async def _current(self) -> ReadOnlyCredentials:
        if self._frozen is not None and not self._due():
            return self._frozen
        async with self._lock:
            if self._frozen is None or self._due():
                self._frozen = await asyncio.to_thread(self._resolve)
                self._stale = False
                frozen = self._frozen
                found = [frozen.secret_key or "", frozen.token or "", frozen.access_key or ""]
                self.scrub = Scrubber.of([*self._configured, *found])
            return self._frozen

    def _due(self) -> bool:
        credentials = self._credentials
        if self._stale or credentials is None:
            return True
        return isinstance(credentials, RefreshableCredentials) and credentials.refresh_needed()

    def _resolve(self) -> ReadOnlyCredentials:
        """In a worker thread: the chain (when not resolved yet, or refused), then the current
        values (refreshing temporary credentials when due)."""
        try:
            if self._credentials is None or self._stale:
                session = Session(profile=self._profile)
                self._credentials = session.get_credentials()
            if self._credentials is None:
                raise CredentialsError(
                    "no AWS credentials found (environment, shared profile"
                    + (f" {self._profile!r}" if self._profile else "")
                    + ", web identity, container or instance metadata)"
                )
            frozen = self._credentials.get_frozen_credentials()
        except BotoCoreError as exc:
            # botocore's messages name profiles and files, never secrets; scrubbed anyway.
            text = Scrubber.GENERIC.bounded(str(exc), 300)
            raise CredentialsError(f"AWS credentials could not be loaded: {text}") from None
        if not frozen.access_key or not frozen.secret_key:
            raise CredentialsError("the AWS credential chain returned incomplete credentials")
        return frozen
