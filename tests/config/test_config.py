"""Configuration: validation names the file, the field and the reason, and never a secret."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_settings

BASE = """
providers:
  openai: {type: openai, base_url: "https://api.example.com/v1", api_key: "${TEST_KEY}"}
  sim: {type: simulated}
models:
  - name: big
    deployments: [{provider: openai, model: gpt-x}]
    budget: {ttft_ms: 800, total_ms: 10000}
    fallbacks: [small]
  - name: small
    deployments: [{provider: sim, model: fast}]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text), environ=environ if environ is not None else {})
    return str(caught.value)


def test_valid_file_resolves_env_secrets(tmp_path: Path) -> None:
    """`${VAR}` is resolved from the environment and kept as a secret."""
    settings = load_settings(write(tmp_path, BASE), environ={"TEST_KEY": "sk-live-123"})
    key = settings.providers["openai"].api_key
    assert key is not None
    assert key.get_secret_value() == "sk-live-123"
    assert "sk-live-123" not in repr(settings)
    assert settings.model("big") is not None
    assert settings.latency.store == "memory"


def test_default_values_apply(tmp_path: Path) -> None:
    """`${VAR:-default}` falls back when the variable is unset or empty."""
    text = BASE.replace("${TEST_KEY}", "${TEST_KEY:-sk-default}")
    settings = load_settings(write(tmp_path, text), environ={"TEST_KEY": ""})
    key = settings.providers["openai"].api_key
    assert key is not None and key.get_secret_value() == "sk-default"


def test_missing_env_var_names_field(tmp_path: Path) -> None:
    """An unset variable without default is an error naming the file, field and variable."""
    message = error_for(tmp_path, BASE)
    assert "gateway.yaml" in message
    assert "providers.openai.api_key" in message
    assert "TEST_KEY" in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("budget: {ttft_ms: 800", "budget: {ttft_msec: 800"),
            "models[big].budget.ttft_msec: unknown key",
        ),
        (
            ("ttft_ms: 800", "ttft_ms: -5"),
            "models[big].budget.ttft_ms: Input should be greater than 0",
        ),
        (
            ("ttft_ms: 800, total_ms: 10000", "ttft_ms: 900, total_ms: 100"),
            "ttft_ms exceeds total_ms",
        ),
        (
            ("fallbacks: [small]", "fallbacks: [tiny]"),
            "models[big].fallbacks: unknown model 'tiny'",
        ),
        (("provider: sim, model: fast", "provider: simx, model: fast"), "unknown provider 'simx'"),
        (("type: openai,", "type: openaj,"), "providers.openai.type"),
        (
            ('base_url: "https://api.example.com/v1"', 'base_url: "ftp://x"'),
            "base_url must be an http",
        ),
        (
            ("  - name: small\n", "  - name: small\n    fallbacks: [big]\n"),
            "fallbacks form a cycle: big -> small -> big",
        ),
        (("  - name: small\n", "  - name: big\n"), "the name 'big' is used twice"),
        (("on_ttft", "on_ttft"), ""),
    ],
)
def test_invalid_configs_name_the_field(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    """Each mistake is reported with the field path (model names, not indexes) and the reason."""
    old, new = change
    if old == new:  # the unchanged base must be valid
        load_settings(write(tmp_path, BASE), environ={"TEST_KEY": "k"})
        return
    assert old in BASE
    message = error_for(tmp_path, BASE.replace(old, new), {"TEST_KEY": "k"})
    assert expected in message
    assert str(tmp_path / "gateway.yaml") in message


def test_secret_never_printed_in_errors(tmp_path: Path) -> None:
    """A validation error near a secret does not echo the secret's value."""
    text = BASE.replace('api_key: "${TEST_KEY}"', 'api_key: "${TEST_KEY}", bogus: 1')
    message = error_for(tmp_path, text, {"TEST_KEY": "sk-very-secret"})
    assert "providers.openai.bogus: unknown key" in message
    assert "sk-very-secret" not in message


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TAILGUARD_* variables override the file, nested with a double underscore."""
    monkeypatch.setenv("TAILGUARD_SERVER__PORT", "9123")
    monkeypatch.setenv("TAILGUARD_LATENCY__WINDOW_S", "120")
    settings = load_settings(write(tmp_path, BASE), environ={"TEST_KEY": "k"})
    assert settings.server.port == 9123
    assert settings.latency.window_s == 120


def test_redis_store_needs_url(tmp_path: Path) -> None:
    """Choosing the redis store without a URL is refused."""
    message = error_for(tmp_path, BASE + "latency: {store: redis}\n", {"TEST_KEY": "k"})
    assert "latency: Value error" not in message
    assert "redis_url is not set" in message


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    """A missing file and broken YAML are clear errors, not tracebacks."""
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_settings(write(tmp_path, "providers:\n  - : : [\n"))


def test_examples_are_valid() -> None:
    """Every shipped example config validates (with placeholder secrets)."""
    environ = {
        "OPENAI_API_KEY": "sk-test",
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "AZURE_OPENAI_API_KEY": "azure-test",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "GEMINI_API_KEY": "AIza-test",
        "GOOGLE_CLOUD_PROJECT": "my-project-123",
    }
    examples = sorted(Path("config/examples").glob("*.yaml"))
    assert len(examples) >= 4
    for path in [Path("config/gateway.yaml"), Path("config/compose-gateway.yaml"), *examples]:
        load_settings(path, environ=environ)


# --- the CLI -------------------------------------------------------------------------------------


def tailguard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_check_config_prints_models_and_masks_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tailguard check-config` lists models and deployments and never prints the key."""
    import os

    env = {**os.environ, "TEST_KEY": "sk-live-abcdef", "COLUMNS": "200"}
    result = tailguard("check-config", "--config", str(write(tmp_path, BASE)), env=env)
    assert result.returncode == 0, result.stderr
    assert "openai/gpt-x" in result.stdout
    assert "sim/fast" in result.stdout
    assert "set (hidden)" in result.stdout
    assert "sk-live-abcdef" not in result.stdout + result.stderr


def test_invalid_config_fails_before_serving(tmp_path: Path) -> None:
    """`serve` and `check-config` exit non-zero with the reason, before binding any port."""
    path = write(tmp_path, BASE.replace("ttft_ms: 800", "ttft_ms: 0"))
    import os

    env = {**os.environ, "TEST_KEY": "k", "COLUMNS": "200"}
    for command in ("check-config", "serve"):
        result = tailguard(command, "--config", str(path), env=env)
        assert result.returncode == 2
        assert "models[big].budget.ttft_ms" in result.stderr
        assert "Uvicorn running" not in result.stderr
