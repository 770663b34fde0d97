"""A provider's `Scrubber`: its own secrets in every form an upstream may echo them, and the
generic key shapes, removed from text; everything else left alone."""

from __future__ import annotations

import base64
import json
from urllib.parse import quote

import pytest

from gateway.providers.decode import decode_openai_body, openai_error
from gateway.providers.openai import OpenAIProvider
from gateway.scrubbing import MIN_SECRET_CHARS, Scrubber
from tests.conftest import gateway_settings

KEY = "plainTOKEN12345/+x"  # no generic shape; "/" and "+" change its escaped forms
SCRUB = Scrubber.of([KEY])


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "echoed",
    [
        KEY,
        f"prefix{KEY}suffix",  # inside a longer string
        f"Bearer {KEY}",
        KEY.upper(),
        quote(KEY, safe=""),  # percent-encoded
        json.dumps(KEY)[1:-1].replace("/", "\\/"),  # JSON-escaped ("\/" is legal JSON)
        b64(KEY),
        b64(f"user:{KEY}"),  # Basic auth with the key as the password
        b64(f"ab:{KEY}"),  # ... at each of base64's three alignments
        b64(f"abc:{KEY}"),
        base64.urlsafe_b64encode(f"u:{KEY}".encode()).decode(),
        b64(f"user:{KEY}").rstrip("="),
    ],
)
def test_every_form_of_a_provider_secret_is_masked(echoed: str) -> None:
    """The key, however the upstream spelled it, is masked: neither it (in any case), nor the
    start of its base64, nor the echoed form itself survives."""
    text = SCRUB(f"boom {echoed} end")
    assert text.startswith("boom ") and text.endswith(" end")
    assert "***" in text
    for fragment in (KEY, KEY.upper(), b64(KEY)[:MIN_SECRET_CHARS]):
        assert fragment not in text, text
    assert echoed not in text


def test_a_json_escaped_secret_is_masked() -> None:
    """A key with characters JSON escapes (a quote, a backslash) is found in its escaped form."""
    key = 'quote"and\\slash-1234'
    escaped = json.dumps(key)[1:-1]
    assert escaped != key
    assert "***" in Scrubber.of([key])(f"echo {escaped}") and escaped not in Scrubber.of([key])(
        f"echo {escaped}"
    )


def test_a_basic_header_value_is_masked_in_every_part() -> None:
    """An extra header configured as `Basic <base64>`: its token, `user:password` and the
    password alone are all masked."""
    value = "Basic " + b64("svc:hdrPLAIN97531")
    scrub = Scrubber.of([value])
    for echoed in (value, b64("svc:hdrPLAIN97531"), "svc:hdrPLAIN97531", "hdrPLAIN97531"):
        assert "hdrPLAIN97531" not in scrub(f"x {echoed} y")
        assert echoed not in scrub(f"x {echoed} y")


def test_generic_shapes_are_masked_without_configured_secrets() -> None:
    """`sk-...`, `Bearer ...`, `api_key=...` and `"x-api-key": ...` go even when the provider
    has no secret configured; ordinary words stay."""
    text = Scrubber.GENERIC(
        'sk-live-abcdef123 Bearer tok.en api_key=q1w2e3 "x-api-key": "zzz999" a basic word'
    )
    for secret in ("abcdef123", "tok.en", "q1w2e3", "zzz999"):
        assert secret not in text
    assert text.endswith("a basic word")


def test_short_values_are_not_searched_for() -> None:
    """A configured header value shorter than MIN_SECRET_CHARS (`on`, `1`) does not garble
    every message that happens to contain it."""
    assert Scrubber.of(["on", "1"])("connection reset on read 1") == "connection reset on read 1"


def test_a_secret_across_a_cut_is_masked_whole() -> None:
    """Text is cut after it is scrubbed: a key that a length limit would split leaves no part
    of itself, in a bounded string and in a decoded error's long param."""
    text = SCRUB.bounded("x" * 95 + KEY + "y" * 10_000, 100)
    assert len(text) == 100 and KEY[:5] not in text
    body = json.dumps({"error": {"message": "m", "param": "p" * 120 + KEY}}).encode()
    error = openai_error(body, scrub=SCRUB)
    assert error is not None and error.param is not None
    assert KEY[:8] not in error.param and len(error.param) <= 128


def test_a_request_id_is_kept_whole_or_dropped() -> None:
    """An upstream's request id holding a secret is not repeated at all, not half-masked."""
    assert SCRUB.clean_or_none("req_abc123") == "req_abc123"
    assert SCRUB.clean_or_none(KEY) is None
    assert SCRUB.clean_or_none(None) is None


def test_every_field_of_a_decoded_error_is_scrubbed() -> None:
    """message, type, code and param of an upstream error pass the provider's scrubber where
    the body is decoded, in a status body and in a 200 body alike."""
    body = json.dumps(
        {"error": {"message": f"m {KEY}", "type": f"t {KEY}", "code": KEY, "param": KEY}}
    ).encode()
    error = openai_error(body, scrub=SCRUB)
    chunk = decode_openai_body(body, scrub=SCRUB)
    assert error is not None and chunk.error == error
    assert KEY not in repr(error)


def test_an_http_provider_scrubs_its_key_and_header_values() -> None:
    """The provider's scrubber knows its api key and every extra header value."""
    settings = gateway_settings(
        {
            "p": {
                "type": "openai",
                "base_url": "http://127.0.0.1:9/v1",
                "api_key": "plainTOKEN12345",
                "headers": {"x-org": "orgPLAIN24680"},
            }
        },
        [{"name": "m", "deployments": [{"provider": "p", "model": "x"}]}],
    )
    provider = OpenAIProvider("p", settings.providers["p"], session=None)  # type: ignore[arg-type]
    assert provider.scrub("plainTOKEN12345 orgPLAIN24680") == "*** ***"
