"""OAuth2 access tokens for Vertex AI, through `google-auth`: a service-account file's
credentials, else Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's
user credentials, the metadata server of GCE/GKE/Cloud Run).

google-auth is synchronous (its token requests go over `requests`), so loading credentials and
refreshing them run in a worker thread (`asyncio.to_thread`), one refresh at a time. A token is
used until it nears its expiry (the last quarter of its life, at most five minutes), then
refreshed before the request that needs it is sent; while a refresh fails and the old token is
still valid, the old token goes on serving. A refresh's failure is a `ProviderError` of this
deployment (it fails over), its text scrubbed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any, Final

import google.auth
import google.auth.exceptions
import google.auth.transport.requests
import requests
from google.oauth2 import service_account

from gateway.errors import ProviderError
from gateway.scrubbing import Scrubber

log = logging.getLogger(__name__)

SCOPES: Final = ("https://www.googleapis.com/auth/cloud-platform",)
MAX_EARLY_S: Final = 300.0  # a token is refreshed at most this long before it expires
_FAILURES: Final = (
    google.auth.exceptions.GoogleAuthError,
    requests.RequestException,
    OSError,
    ValueError,
)


class TokenSource:
    """The current access token of one provider's Google credentials."""

    def __init__(self, credentials_file: str | None) -> None:
        self._file = credentials_file
        self._credentials: Any = None  # google-auth has no common type with `refresh`
        self._session = requests.Session()
        self._lock = asyncio.Lock()
        self.token: str | None = None
        self._refresh_at = 0.0  # monotonic: when the token is due for a refresh
        self._expires_at = 0.0  # monotonic: when it stops working
        self.refreshes = 0

    async def get(self, deployment: str) -> str:
        """A token valid for a while yet; refreshed first when due."""
        if self.token is not None and time.monotonic() < self._refresh_at:
            return self.token
        async with self._lock:
            now = time.monotonic()
            if self.token is not None and now < self._refresh_at:
                return self.token  # refreshed while this request waited
            try:
                token, expiry = await asyncio.to_thread(self._refresh)
            except _FAILURES as exc:
                if self.token is not None and now < self._expires_at:
                    log.warning("vertex token refresh failed, the current token serves on")
                    self._refresh_at = now + min(5.0, self._expires_at - now)
                    return self.token
                text = Scrubber.GENERIC.bounded(str(exc), 300)
                raise ProviderError(
                    f"could not get a Google access token ({type(exc).__name__}): {text}",
                    deployment=deployment,
                    kind="auth",
                ) from None
            self._set(token, expiry)
            return token

    def expire(self, token: str) -> bool:
        """The upstream refused `token`: the next `get` refreshes it (unless a newer one has
        replaced it meanwhile). Returns whether one more try is worth it."""
        if token == self.token:
            self._refresh_at = 0.0
        return self.token is not None

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
