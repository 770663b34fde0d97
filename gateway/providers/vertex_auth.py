"""OAuth2 access tokens for Vertex AI, through `google-auth`: a service-account file's
credentials, else Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's
user credentials, the metadata server of GCE/GKE/Cloud Run).

google-auth is synchronous (its token requests go over `requests`), so loading credentials and
refreshing them run in a worker thread (`asyncio.to_thread`), one refresh at a time. A token is
cached until the last quarter of its life (at most five minutes before its expiry); then a
refresh starts in the background while the token serves on, and only a token in its last eighth
(at most 30 s) is waited for, so requests do not pay for the token endpoint's round trip. While
refreshes fail and the old token is still valid, it goes on serving. Without a valid token the
request fails with a `ProviderError` of this deployment (it fails over), its text scrubbed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any, Final

import google.auth
import google.auth.transport.requests
import requests
from google.oauth2 import service_account

from gateway.errors import ProviderError
from gateway.scrubbing import Scrubber

log = logging.getLogger(__name__)

SCOPES: Final = ("https://www.googleapis.com/auth/cloud-platform",)
MAX_EARLY_S: Final = 300.0  # a token is refreshed at most this long before it expires
MAX_WAIT_S: Final = 30.0  # ... and waited for once it has less than this left


class TokenSource:
    """The current access token of one provider's Google credentials."""

    def __init__(self, credentials_file: str | None) -> None:
        self._file = credentials_file
        self._credentials: Any = None  # google-auth has no common type with `refresh`
        self._session = requests.Session()
        self._refreshing: asyncio.Task[None] | None = None  # one refresh at a time
        self._failure: str | None = None  # why the last refresh failed (scrubbed)
        self.token: str | None = None
        self._refresh_at = 0.0  # monotonic: when the token is due for a refresh
        self._wait_at = 0.0  # monotonic: from when requests wait for the refresh
        self._expires_at = 0.0  # monotonic: when it stops working
        self.refreshes = 0

    async def get(self, deployment: str) -> str:
        """A token valid for a while yet. Once one is due, a refresh starts in the background
        and the current token serves on; only a token about to expire (or none) is waited for."""
        now = time.monotonic()
        if self.token is not None and now < self._refresh_at:
            return self.token
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh_now())
        if self.token is not None and now < self._wait_at:
            return self.token
        await asyncio.shield(self._refreshing)  # a leaving request does not cancel it for others
        if self.token is not None and time.monotonic() < self._expires_at:
            return self.token
        raise ProviderError(
            f"could not get a Google access token: {self._failure or 'no token'}",
            deployment=deployment,
            kind="auth",
        )

    async def _refresh_now(self) -> None:
        try:
            token, expiry = await asyncio.to_thread(self._refresh)
        except Exception as exc:  # any failure of the credential chain: told, never raised here
            self._failure = f"({type(exc).__name__}) {Scrubber.GENERIC.bounded(str(exc), 300)}"
            now = time.monotonic()
            if self.token is not None and now < self._expires_at:
                log.warning("vertex token refresh failed, the current token serves on")
                self._refresh_at = now + min(5.0, (self._expires_at - now) / 2)
            return
        self._failure = None
        self._set(token, expiry)

    def expire(self, token: str) -> bool:
        """The upstream refused `token`: the next `get` waits for a new one (unless a newer one
        has replaced it meanwhile). Returns whether one more try is worth it."""
        if token == self.token:
            self._refresh_at = self._wait_at = self._expires_at = 0.0
        return True

    def _set(self, token: str, expiry: datetime.datetime | None) -> None:
        now = time.monotonic()
        if expiry is None:  # google-auth knows no expiry: assume Google's usual hour
            life = 3600.0
        else:
            utc = expiry.replace(tzinfo=datetime.UTC) if expiry.tzinfo is None else expiry
            life = max(0.0, (utc - datetime.datetime.now(datetime.UTC)).total_seconds())
        self.token = token
        self.refreshes += 1
        self._expires_at = now + life
        self._refresh_at = now + life - min(MAX_EARLY_S, life / 4)
        self._wait_at = now + life - min(MAX_WAIT_S, life / 8)

    def _refresh(self) -> tuple[str, datetime.datetime | None]:
        """In a worker thread: load the credentials once, then fetch a new token."""
        if self._credentials is None:
            if self._file:
                self._credentials = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
                    self._file, scopes=SCOPES
                )
            else:
                self._credentials, _ = google.auth.default(scopes=SCOPES)
        request = google.auth.transport.requests.Request(self._session)
        self._credentials.refresh(request)
        token = self._credentials.token
        if not isinstance(token, str) or not token:
            raise ValueError("the token endpoint returned no token")
        expiry = self._credentials.expiry
        return token, expiry if isinstance(expiry, datetime.datetime) else None

    def close(self) -> None:
        self._session.close()
