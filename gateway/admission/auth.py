"""Who may call the gateway: client keys, admin keys and what each key may do.

Keys are configured as the hex SHA-256 of the key, never the key itself (`tailguard keys new`
prints both, once). A presented key is hashed and looked up by its digest; the final comparison
is constant-time. The lookup's timing can only say something about the digest of what was sent,
which does not help anyone find a key.

Nothing here logs, stores or echoes a presented key: errors say what was wrong, not what was sent.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

from gateway.config import AuthSpec, KeySpec, Settings
from gateway.errors import AuthenticationError, PermissionDeniedError

KEY_PREFIX = "tg-"


@dataclass(frozen=True, slots=True)
class Principal:
    """A caller the gateway knows, and its limits (None: unlimited)."""

    name: str
    admin: bool = False
    models: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_n: int | None = None
    max_tokens: int | None = None
    # Who owns what the key stores (responses): derived from the key's digest, so a replacement
    # key under the same name is someone else. Not the digest itself, and not reversible to it.
    identity: str = ""

    @classmethod
    def of(cls, spec: KeySpec) -> Principal:
        return cls(
            name=spec.name,
            identity=identity_of(bytes.fromhex(spec.sha256)),
            models=frozenset(spec.models) if spec.models is not None else None,
            rpm=spec.rpm,
            tpm=spec.tpm,
            max_concurrent=spec.max_concurrent,
            max_n=spec.max_n,
            max_tokens=spec.max_tokens,
        )

    @property
    def rate_limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None


def identity_of(digest: bytes) -> str:
    """A key's identity for what it owns: a hash of its SHA-256 digest, so stored state names
    the key without holding the digest that authenticates it."""
    return hashlib.sha256(b"tailguard-owner\0" + digest).hexdigest()[:32]


class KeyRing:
    """The configured keys, by digest. An empty ring means authentication is off."""

    def __init__(self, spec: AuthSpec | None) -> None:
        self._known: dict[bytes, tuple[bytes, Principal]] = {}
        if spec is None:
            return
        for key in spec.keys:
            digest = bytes.fromhex(key.sha256)
            self._known[digest] = (digest, Principal.of(key))
        for admin in spec.admin_keys:
            digest = bytes.fromhex(admin.sha256)
            admin_principal = Principal(name=admin.name, admin=True, identity=identity_of(digest))
            self._known[digest] = (digest, admin_principal)

    @property
    def enabled(self) -> bool:
        return bool(self._known)

    def identify(self, key: bytes) -> Principal | None:
        digest = hashlib.sha256(key).digest()
        found = self._known.get(digest)
        if found is None:
            return None
        known, principal = found
        return principal if hmac.compare_digest(known, digest) else None

    def client(self, headers: list[tuple[bytes, bytes]], *, anthropic: bool) -> Principal:
        """The client key behind an LLM request. Raises AuthenticationError or
        PermissionDeniedError (an admin key does not call models)."""
        principal = self._authenticate(headers, anthropic=anthropic, realm=False)
        if principal.admin:
            raise PermissionDeniedError(
                "This is an admin key: it can read the admin endpoints but not call models.",
                code="admin_key_not_allowed",
            )
        return principal

    def admin(self, headers: list[tuple[bytes, bytes]]) -> Principal:
        """The admin key behind a request to /admin/* or /dashboard."""
        principal = self._authenticate(headers, anthropic=False, realm=True)
        if not principal.admin:
            raise PermissionDeniedError(
                "This endpoint needs an admin key.", code="admin_key_required"
            )
        return principal

    def _authenticate(
        self, headers: list[tuple[bytes, bytes]], *, anthropic: bool, realm: bool
    ) -> Principal:
        key = presented_key(headers, anthropic=anthropic)
        if key is None:
            where = (
                "an 'x-api-key' header or 'Authorization: Bearer <key>'"
                if anthropic
                else "an 'Authorization: Bearer <key>' header"
            )
            raise AuthenticationError(
                f"You didn't provide an API key. Send your gateway key in {where}.",
                code="missing_api_key",
                realm=realm,
            )
        principal = self.identify(key)
        if principal is None:
            raise AuthenticationError("Incorrect API key provided.", realm=realm)
        return principal


def presented_key(headers: list[tuple[bytes, bytes]], *, anthropic: bool) -> bytes | None:
    """The key a request carries: `x-api-key` (Anthropic's SDKs), `Authorization: Bearer`, or
    the password of `Authorization: Basic` (what a browser sends for the dashboard)."""
    authorization: bytes | None = None
    for name, value in headers:
        if name == b"x-api-key" and anthropic:
            return value.strip() or None
        if name == b"authorization":
            authorization = value
    if authorization is None:
        return None
    scheme, _, credentials = authorization.strip().partition(b" ")
    scheme = scheme.lower()
    credentials = credentials.strip()
    if scheme == b"bearer":
        return credentials or None
    if scheme == b"basic":
        try:
            decoded = base64.b64decode(credentials, validate=True)
        except (binascii.Error, ValueError):
            return None
        _, _, password = decoded.partition(b":")
        return password or None
    return None


def new_key() -> tuple[str, str]:
    """A fresh random key (256 bits) and its SHA-256 hex digest."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposed_without_keys(settings: Settings) -> bool:
    """Whether `settings` would serve beyond loopback with no API keys and nothing allows it
    (`server.allow_unauthenticated`): refused at start-up, and refused on reload."""
    keys = settings.auth is not None and settings.auth.enabled
    server = settings.server
    return not keys and not is_loopback(server.host) and not server.allow_unauthenticated
