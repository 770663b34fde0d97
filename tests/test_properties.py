"""Properties of the SSE parser and of config loading, over generated inputs (Hypothesis).

Runs are derandomized: the same examples every time, so a failure reproduces as is.
"""

from __future__ import annotations

import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import sse
from gateway.config import ConfigError, Settings, build_settings, load_settings, resolve_env
from gateway.models import SSEEvent
from gateway.sse import SSEFramingError, SSEParser

PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CONFIG_PROPERTY = settings(PROPERTY, max_examples=100)  # each example builds a whole config


# --- SSE framing ---------------------------------------------------------------------------------

# Field values: any text without line breaks, multi-byte UTF-8 included.
_VALUE = st.text(
    st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n"), max_size=12
)
_LINE_ENDINGS = (b"\n", b"\r\n", b"\r")


@st.composite
def _sse_line(draw: st.DrawFn) -> tuple[bytes, str, str]:
    """One non-blank line: its bytes, the field it sets ('' for none) and the parsed value."""
    kind = draw(st.sampled_from(["data", "data", "event", "comment", "id", "retry"]))
    value = draw(_VALUE)
    spaced = draw(st.booleans())
    if kind == "comment":
        return b":" + value.encode(), "", ""
    if kind == "retry":
        return b"retry: " + str(draw(st.integers(0, 10_000))).encode(), "", ""
    if spaced:
        return f"{kind}: {value}".encode(), kind, value
    # Without a space after the colon the value is read as is, less one leading space.
    parsed = value[1:] if value.startswith(" ") else value
    return f"{kind}:{value}".encode(), kind, parsed


@st.composite
def sse_streams(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes, str | None]]]:
    """A valid stream with one line ending throughout, and the events it must parse into."""
    ending = draw(st.sampled_from(_LINE_ENDINGS))
    stream = b""
    expected: list[tuple[bytes, bytes, str | None]] = []
    for lines in draw(st.lists(st.lists(_sse_line(), min_size=1, max_size=4), max_size=6)):
        data: list[str] = []
        event: str | None = None
        for _, field, value in lines:
            if field == "data":
                data.append(value)
            elif field == "event":
                event = value
        raw = [line for line, _, _ in lines]
        stream += ending.join(raw) + ending + ending
        expected.append((b"\n".join(raw) + b"\n\n", "\n".join(data).encode(), event))
    return stream, expected


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(cut, len(data)) for cut in cuts})
    chunks, start = [], 0
    for point in points:
        chunks.append(data[start:point])  # empty chunks included: they must change nothing
        start = point
    chunks.append(data[start:])
    return chunks


def _parse(chunks: list[bytes]) -> tuple[list[tuple[bytes, bytes, str | None]], bytes]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
        assert len(parser.pending) <= sse.MAX_EVENT_BYTES
    return [(e.raw, e.data, e.event) for e in events], parser.pending


@PROPERTY
@given(stream=sse_streams(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_of_a_valid_stream_parses_the_same(
    stream: tuple[bytes, list[tuple[bytes, bytes, str | None]]], cuts: list[int]
) -> None:
    """However a valid stream is cut into chunks (inside a CRLF, a multi-byte character, a
    comment or an `event:` line), it parses into exactly its events, with nothing left over."""
    data, expected = stream
    whole, whole_pending = _parse([data])
    split, split_pending = _parse(_splits(data, cuts))
    byte_by_byte, _ = _parse([data[i : i + 1] for i in range(len(data))])
    assert whole == expected
    assert split == expected
    assert byte_by_byte == expected
    assert whole_pending == split_pending == b""


# Garbage, rich in the bytes the parser cares about.
_GARBAGE = st.lists(
    st.one_of(
        st.binary(max_size=24),
        st.sampled_from([b"\r", b"\n", b"\r\n", b"\n\n", b"data: ", b"data:", b"event: x", b":"]),
        st.sampled_from(["é", "€", "😀"]).map(str.encode),
    ),
    max_size=40,
)


@PROPERTY
@given(parts=_GARBAGE, cuts=st.lists(st.integers(0, 600), max_size=10))
def test_garbage_raises_only_framing_errors_and_stays_bounded(
    parts: list[bytes], cuts: list[int]
) -> None:
    """Arbitrary bytes in arbitrary chunks raise nothing but SSEFramingError, never hold more
    than the event bound pending, and parse the same however they are cut when accepted."""
    data = b"".join(parts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sse, "MAX_EVENT_BYTES", 48)  # a small bound, so garbage reaches it
        outcomes: list[tuple[list[tuple[bytes, bytes, str | None]], bytes] | None] = []
        for chunks in ([data], _splits(data, cuts)):
            try:
                outcomes.append(_parse(chunks))
            except SSEFramingError:
                outcomes.append(None)
    whole, split = outcomes
    if whole is not None and split is not None:
        assert whole == split


@PROPERTY
@given(stream=sse_streams(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_the_bound_is_per_event_not_per_chunk(
    stream: tuple[bytes, list[tuple[bytes, bytes, str | None]]], cuts: list[int]
) -> None:
    """A stream whose every event fits the bound is accepted whatever its total size or cuts."""
    data, expected = stream
    largest = max((len(raw) for raw, _, _ in expected), default=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sse, "MAX_EVENT_BYTES", largest)
        assert _parse(_splits(data, cuts))[0] == expected


def test_an_event_over_the_bound_is_refused() -> None:
    """An event that grows past MAX_EVENT_BYTES without ending raises SSEFramingError."""
    parser = SSEParser()
    small = b"data: x\n\n" * 1000
    assert len(parser.feed(small)) == 1000
    with pytest.raises(SSEFramingError):
        parser.feed(b"data: " + b"x" * sse.MAX_EVENT_BYTES)


def test_a_stream_of_lone_cr_endings_ends_its_last_event() -> None:
    """A CR at the end of a chunk ends the line (the SSE spec allows CR alone), so the last
    event of a CR-only stream is complete at once rather than waiting for bytes that never come;
    a following LF (the rest of a split CRLF) is dropped."""
    parser = SSEParser()
    assert [e.data for e in parser.feed(b"data: a\r\rdata: [DONE]\r\r")] == [b"a", b"[DONE]"]
    assert parser.pending == b""
    assert [e.data for e in parser.feed(b"data: b\r")] == []
    assert [e.data for e in parser.feed(b"\n\r")] == [b"b"]
    assert parser.feed(b"\n") == []
    assert parser.pending == b""


# --- config documents ----------------------------------------------------------------------------

_NAMES = st.builds(
    str.__add__,
    st.sampled_from(string.ascii_lowercase),
    st.text(string.ascii_lowercase + string.digits + "_-", max_size=7),
)
_SECRET = st.text(string.ascii_letters + string.digits, min_size=16, max_size=24).map(
    lambda s: "sk-secret-" + s
)
_POSITIVE = st.integers(1, 10**9)


@st.composite
def _provider(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["simulated", "openai", "vllm", "anthropic"]))
    if kind == "simulated":
        spec: dict[str, Any] = {"type": kind}
        if draw(st.booleans()):
            spec["seed"] = draw(st.integers(0, 2**31))
        return spec
    host = draw(st.sampled_from(["127.0.0.1", "api.example.com", "localhost"]))
    scheme = draw(st.sampled_from(["http", "https"]))
    spec = {"type": kind, "base_url": f"{scheme}://{host}:{draw(st.integers(1, 65535))}/v1"}
    spec["api_key"] = draw(_SECRET)
    if draw(st.booleans()):
        spec["headers"] = {"x-extra": draw(_SECRET)}
    if draw(st.booleans()):
        spec["connect_timeout_ms"] = draw(_POSITIVE)
    return spec


@st.composite
def _budget(draw: st.DrawFn) -> dict[str, int]:
    ttft, total = sorted(draw(st.lists(_POSITIVE, min_size=2, max_size=2)))
    return draw(st.sampled_from([{"ttft_ms": ttft, "total_ms": total}, {"ttft_ms": ttft}, {}]))


@st.composite
def valid_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A config document that must build: references resolve, fallbacks form no cycle."""
    providers = draw(st.dictionaries(_NAMES, _provider(), min_size=1, max_size=3))
    names = draw(st.lists(_NAMES, min_size=1, max_size=5, unique=True))
    models = []
    for index, name in enumerate(names):
        pairs = st.tuples(st.sampled_from(sorted(providers)), _NAMES)
        deployments = draw(st.lists(pairs, min_size=1, max_size=3, unique=True))
        model: dict[str, Any] = {
            "name": name,
            "deployments": [{"provider": p, "model": m} for p, m in deployments],
        }
        if draw(st.booleans()):
            model["budget"] = draw(_budget())
        if index:  # only earlier models: no cycle
            model["fallbacks"] = draw(st.lists(st.sampled_from(names[:index]), unique=True))
        if draw(st.booleans()):
            model["on_ttft_miss"] = draw(st.sampled_from(["failover", "hedge", "none"]))
            model["hedge_max_fraction"] = draw(st.floats(0, 1))
        if draw(st.booleans()):
            model["priority"] = "bulk"
            model["batching"] = {
                "max_batch_size": draw(st.integers(1, 4096)),
                "max_wait_ms": draw(st.integers(0, 60_000)),
                "max_inflight": draw(st.integers(1, 1024)),
                "max_queue": draw(_POSITIVE),
            }
        models.append(model)
    document: dict[str, Any] = {"providers": providers, "models": models}
    if draw(st.booleans()):
        key_names = draw(st.lists(_NAMES, min_size=1, max_size=4, unique=True))
        hashes = draw(
            st.lists(
                st.binary(min_size=32, max_size=32).map(bytes.hex),
                min_size=len(key_names),
                max_size=len(key_names),
                unique=True,
            )
        )
        keys = [
            {"name": n, "sha256": h, "models": draw(st.lists(st.sampled_from(names), unique=True))}
            for n, h in zip(key_names[1:], hashes[1:], strict=True)
        ]
        document["auth"] = {
            "keys": keys,
            "admin_keys": [{"name": key_names[0], "sha256": hashes[0]}],
        }
    if draw(st.booleans()):
        document["routing"] = {"cooldown": {"failures": draw(_POSITIVE), "base_s": 1, "max_s": 2}}
    return document


def _secrets(document: dict[str, Any]) -> list[str]:
    found = []
    for provider in document.get("providers", {}).values():
        if isinstance(provider, dict):
            for value in [provider.get("api_key"), *dict(provider.get("headers") or {}).values()]:
                if isinstance(value, str):
                    found.append(value)
    return found


@CONFIG_PROPERTY
@given(document=valid_documents())
def test_valid_documents_build(document: dict[str, Any]) -> None:
    """A document whose references resolve and whose fallbacks form no cycle always builds."""
    built = build_settings(document)
    assert [m.name for m in built.models] == [m["name"] for m in document["models"]]
    for model, spec in zip(built.models, document["models"], strict=True):
        assert list(model.fallbacks) == spec.get("fallbacks", [])
        assert [d.id for d in model.deployments] == [
            f"{d['provider']}/{d['model']}" for d in spec["deployments"]
        ]
    for name, provider in document["providers"].items():
        key = built.providers[name].api_key
        assert (key.get_secret_value() if key else None) == provider.get("api_key")


def _model_at(document: dict[str, Any], index: int) -> tuple[dict[str, Any], str]:
    model: dict[str, Any] = document["models"][index % len(document["models"])]
    return model, f"models[{model['name']}]"


_WRONG_TYPES = st.one_of(
    st.text(string.ascii_letters, min_size=1, max_size=6).map(lambda s: "x" + s),
    st.lists(st.integers(), min_size=1, max_size=2),
    st.dictionaries(st.just("a"), st.integers(), min_size=1),
)


@st.composite
def invalid_documents(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    """A valid document with one mistake, and what the error message must say about it."""
    document = draw(valid_documents())
    model, where = _model_at(document, draw(st.integers(0, 10)))
    provider = sorted(document["providers"])[0]
    mistake = draw(
        st.sampled_from(
            [
                "wrong_type",
                "negative_budget",
                "budget_order",
                "unknown_key",
                "cycle",
                "self_fallback",
                "unknown_provider",
                "unknown_fallback",
                "unknown_key_model",
                "provider_type",
            ]
        )
    )
    if mistake == "wrong_type":
        target, field, path = draw(
            st.sampled_from(
                [
                    ("budget", "ttft_ms", f"{where}.budget.ttft_ms"),
                    ("model", "hedge_max_fraction", f"{where}.hedge_max_fraction"),
                    ("server", "port", "server.port"),
                    ("provider", "connect_timeout_ms", f"providers.{provider}.connect_timeout_ms"),
                ]
            )
        )
        node = {
            "budget": model.setdefault("budget", {}),
            "model": model,
            "server": document.setdefault("server", {}),
            "provider": document["providers"][provider],
        }[target]
        node[field] = draw(_WRONG_TYPES)
        return document, [f"{path}:"]
    if mistake == "negative_budget":
        field = draw(st.sampled_from(["ttft_ms", "total_ms"]))
        model["budget"] = {field: draw(st.integers(-(10**9), 0))}
        return document, [f"{where}.budget.{field}: Input should be greater than 0"]
    if mistake == "budget_order":
        low, high = draw(st.lists(_POSITIVE, min_size=2, max_size=2, unique=True).map(sorted))
        model["budget"] = {"ttft_ms": high, "total_ms": low}
        return document, [f"{where}.budget: ttft_ms exceeds total_ms"]
    if mistake == "unknown_key":
        key = "zz" + draw(_NAMES)
        node, path = draw(
            st.sampled_from(
                [
                    (document, ""),
                    (document.setdefault("server", {}), "server"),
                    (document["providers"][provider], f"providers.{provider}"),
                    (model, where),
                    (model.setdefault("budget", {}), f"{where}.budget"),
                    (model["deployments"][0], f"{where}.deployments[0]"),
                ]
            )
        )
        node[key] = draw(st.one_of(st.integers(), st.text(max_size=5)))
        return document, [f"{path}.{key}: unknown key" if path else f"{key}: unknown key"]
    if mistake in ("cycle", "self_fallback"):
        names = [m["name"] for m in document["models"]]
        if mistake == "self_fallback" or len(names) < 2:
            model["fallbacks"] = [model["name"]]
            return document, [f"{where}: a model cannot be its own fallback"]
        loop = draw(st.lists(st.sampled_from(names), min_size=2, max_size=4, unique=True))
        for current, following in zip(loop, loop[1:] + loop[:1], strict=True):
            spec = next(m for m in document["models"] if m["name"] == current)
            # Only the loop's edges leave its models, so the loop is the one cycle to report
            # (kept fallbacks could close a shorter one first).
            spec["fallbacks"] = [following]
        return document, ["models: fallbacks form a cycle", *loop]
    if mistake == "unknown_provider":
        missing = "nope-" + draw(_NAMES)
        model["deployments"].append({"provider": missing, "model": "m"})
        return document, [f"{where}.deployments: unknown provider '{missing}'"]
    if mistake == "unknown_fallback":
        missing = "nope-" + draw(_NAMES)
        model["fallbacks"] = [missing]
        return document, [f"{where}.fallbacks: unknown model '{missing}'"]
    if mistake == "unknown_key_model":
        missing = "nope-" + draw(_NAMES)
        document["auth"] = {"keys": [{"name": "k1", "sha256": "a" * 64, "models": [missing]}]}
        return document, [f"auth.keys[k1].models: unknown model '{missing}'"]
    spec = document["providers"][provider]
    if spec["type"] == "simulated":
        spec["base_url"] = "http://127.0.0.1:1/v1"
        return document, [f"providers.{provider}: ", "takes no base_url"]
    del spec["base_url"]
    return document, [f"providers.{provider}: ", "base_url is required"]


@CONFIG_PROPERTY
@given(case=invalid_documents())
def test_invalid_documents_name_the_path(case: tuple[dict[str, Any], list[str]]) -> None:
    """One mistake anywhere raises ConfigError (never another exception) whose message names
    the offending path and reason, and never carries a secret's value."""
    document, expected = case
    with pytest.raises(ConfigError) as caught:
        build_settings(document, source="gateway.yaml")
    message = str(caught.value)
    assert message.startswith("gateway.yaml: ")
    for fragment in expected:
        assert fragment in message
    for secret in _secrets(document):
        assert secret not in message


# Any YAML-shaped value: scalars, lists and mappings with non-string keys too.
_YAML_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)
)
_YAML_VALUES = st.recursive(
    _YAML_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=3),
    ),
    max_leaves=12,
)
_SECTIONS = ["server", "latency", "providers", "models", "routing", "auth"]


@CONFIG_PROPERTY
@given(
    base=valid_documents(),
    section=st.sampled_from(_SECTIONS),
    value=_YAML_VALUES,
    secret=_SECRET,
)
def test_arbitrary_sections_fail_only_with_config_errors(
    base: dict[str, Any], section: str, value: Any, secret: str
) -> None:
    """Whatever shape a section of the file takes, building either succeeds or raises
    ConfigError; a secret elsewhere in the document never reaches the message."""
    document = {**base, section: value}
    providers = document["providers"] if isinstance(document["providers"], dict) else {}
    for spec in providers.values():
        if isinstance(spec, dict) and spec.get("type") != "simulated":
            spec["api_key"] = secret
            break
    else:
        document["latency"] = {"redis_url": f"redis://:{secret}@127.0.0.1:6379/0"}
    try:
        built = build_settings(document)
    except ConfigError as error:
        assert secret not in str(error)
    else:
        assert isinstance(built, Settings)


# --- ${VAR} resolution ---------------------------------------------------------------------------

_VAR_NAMES = st.builds(
    str.__add__,
    st.sampled_from(string.ascii_uppercase + "_"),
    st.text(string.ascii_uppercase + string.digits + "_", max_size=6),
)
_LITERAL = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="$"), max_size=6)


@st.composite
def templates(draw: st.DrawFn) -> tuple[str, dict[str, str], str | None]:
    """A string of literals and `${VAR}` / `${VAR:-default}` references, an environment, and
    what it must resolve to (None: a reference without default to a variable that is unset)."""
    environ = draw(
        st.dictionaries(_VAR_NAMES, st.text(max_size=6), max_size=4)  # values may hold "${X}"
    )
    text, expected = "", ""
    missing = False
    for _ in range(draw(st.integers(0, 4))):
        literal = draw(_LITERAL)
        name = draw(st.one_of(st.sampled_from(sorted(environ) or ["UNSET"]), _VAR_NAMES))
        default = draw(st.one_of(st.none(), st.text(st.characters(blacklist_characters="}"))))
        text += literal + (
            "${" + name + "}" if default is None else "${" + name + ":-" + default + "}"
        )
        expected += literal
        if environ.get(name):
            expected += environ[name]
        elif default is not None:
            expected += default
        else:
            missing = True
    tail = draw(_LITERAL)
    return text + tail, environ, None if missing else expected + tail


@PROPERTY
@given(template=templates(), path=st.lists(_NAMES, min_size=1, max_size=3))
def test_env_references_resolve(
    template: tuple[str, dict[str, str], str | None], path: list[str]
) -> None:
    """`${VAR}` takes the variable's value, `${VAR:-default}` the default when it is unset or
    empty, values are not expanded again, and the document's shape is kept; an unset variable
    without default is a ConfigError naming the path and the variable, not its value."""
    text, environ, expected = template
    document: Any = text
    for key in reversed(path):
        document = {key: [document, 7]}
    if expected is None:
        with pytest.raises(ConfigError) as caught:
            resolve_env(document, environ)
        where = "".join(f"{key}[0]." for key in path)[:-1]  # e.g. a[0].b[0]
        assert str(caught.value).startswith(f"{where}: environment variable ")
        for value in environ.values():
            if len(value) > 3:
                assert value not in str(caught.value)
        return
    resolved = resolve_env(document, environ)
    for key in path:
        assert resolved[key][1] == 7
        resolved = resolved[key][0]
    assert resolved == expected


_PLAIN = st.text(string.ascii_letters + string.digits + "-_.:/+=", min_size=12, max_size=24).map(
    lambda s: "sk-" + s
)


@PROPERTY
@given(secret=_PLAIN, default=_PLAIN, set_it=st.booleans())
def test_env_secrets_round_trip_through_a_file(secret: str, default: str, set_it: bool) -> None:
    """A key given as `${VAR:-default}` in a YAML file comes back exactly, as a secret."""
    document: dict[str, Any] = {
        "providers": {"up": {"type": "openai", "base_url": "http://127.0.0.1:1/v1"}},
        "models": [{"name": "m", "deployments": [{"provider": "up", "model": "x"}]}],
    }
    document["providers"]["up"]["api_key"] = "${TG_PROPERTY_KEY:-" + default + "}"
    environ = {"TG_PROPERTY_KEY": secret} if set_it else {}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "gateway.yaml"
        path.write_text(yaml.safe_dump(document))
        built = load_settings(path, environ=environ)
    key = built.providers["up"].api_key
    assert key is not None
    assert key.get_secret_value() == (secret if set_it else default)
    assert (secret if set_it else default) not in repr(built)
