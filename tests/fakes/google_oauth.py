"""A fake of Google's OAuth2 token endpoint for service accounts, and the service account itself.

`make_service_account(path, token_uri)` writes a service-account JSON key file with a fresh RSA
key (as the Cloud console would hand one out), pointing its `token_uri` at the fake. The fake
takes the JWT-bearer grant (RFC 7523) google-auth sends: `grant_type=urn:ietf:params:oauth:
grant-type:jwt-bearer&assertion=<JWT>`; it verifies the assertion's RS256 signature with the
account's public key and its claims (`iss` the account's email, `aud` Google's token endpoint, a
`cloud-platform` scope, a current `iat`/`exp`), then issues an access token living `lifetime_s`.
A bad assertion gets Google's `400 {"error": "invalid_grant", ...}`.

`valid(token)` says whether a token was issued here and has not expired (or been revoked): the
Vertex fake asks it for every request's bearer token.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from tests.fakes.asgi import Watched, incoming

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
# What google-auth signs as `aud`, whichever token_uri the file names: Google's own endpoint.
GOOGLE_TOKEN_AUDIENCE = "https://oauth2.googleapis.com/token"


@dataclass
class ServiceAccount:
    path: Path
    email: str
    token_uri: str
    public_key: rsa.RSAPublicKey
    private_key_pem: str  # what must never leave the gateway


def make_service_account(path: Path, token_uri: str) -> ServiceAccount:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    email = "tailguard-test@my-project-123.iam.gserviceaccount.com"
    info = {
        "type": "service_account",
        "project_id": "my-project-123",
        "private_key_id": secrets.token_hex(20),
        "private_key": pem,
        "client_email": email,
        "client_id": "1234567890",
        "auth_uri": "https://accounts.google.com/o/oauth2/auth",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))
    return ServiceAccount(path, email, token_uri, key.public_key(), pem)


def _b64(data: str) -> bytes:
    return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))


@dataclass
class TokenEndpoint(Watched):
    """The fake token endpoint as an ASGI app (any path; POST only)."""

    account: ServiceAccount | None = None  # set once the account exists (it names our URL)
    lifetime_s: float = 3600.0
    issued: list[str] = field(default_factory=list)
    rejected: int = 0
    refuse: bool = False  # refuse every assertion (as for a deleted key), however good
    _expiry: dict[str, float] = field(default_factory=dict)

    def valid(self, token: str) -> bool:
        return time.monotonic() < self._expiry.get(token, 0.0)

    def revoke(self, token: str) -> None:
        self._expiry[token] = 0.0

    def _check(self, assertion: str) -> str | None:
        """What is wrong with the assertion; None when it is good."""
        assert self.account is not None
        try:
            head, claims, signature = assertion.split(".")
            header = json.loads(_b64(head))
            payload = json.loads(_b64(claims))
        except ValueError:
            return "malformed assertion"
        if header.get("alg") != "RS256":
            return "assertion must be RS256"
        try:
            self.account.public_key.verify(
                _b64(signature), f"{head}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256()
            )
        except InvalidSignature:
            return "Invalid JWT Signature."
        now = time.time()
        if payload.get("iss") != self.account.email:
            return "Invalid issuer"
        if payload.get("aud") != GOOGLE_TOKEN_AUDIENCE:
            return "Invalid audience"
        if CLOUD_PLATFORM not in str(payload.get("scope", "")).split():
            return "Invalid scope"
        if not payload.get("iat", 0) - 300 <= now <= payload.get("exp", 0):
            return "Invalid JWT: Token must be a short-lived token and in a reasonable timeframe"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = await incoming(scope, receive, send)
        if received is None:
            return
        raw = received[0]
        form = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
        problem = "unsupported grant_type" if form.get("grant_type") != JWT_BEARER else None
        problem = problem or self._check(form.get("assertion", ""))
        if self.refuse:
            problem = "Invalid grant: account not found"
        if problem is not None:
            self.rejected += 1
            status = 400
            body: dict[str, Any] = {"error": "invalid_grant", "error_description": problem}
        else:
            token = "ya29.fake-" + secrets.token_urlsafe(24)
            self._expiry[token] = time.monotonic() + self.lifetime_s
            self.issued.append(token)
            status = 200
            body = {"access_token": token, "expires_in": self.lifetime_s, "token_type": "Bearer"}
        await self.notify()
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": data})
