"""`tailguard check-config`: the resolved routing table with no secret in it (`--explain`), and
config problems a newcomer can act on (also from `serve`), and the auth line of both."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gateway.cli import app
from gateway.config import Settings, load_settings
from gateway.models import Call
from gateway.providers import open_providers
from gateway.routing import candidates, fallback_chain
from gateway.upstream import Provider

CONFIGS = sorted([Path("config/gateway.yaml"), *Path("config/examples").glob("*.yaml")])

SECRETS = {
    "OPENAI_API_KEY": "sk-test-SECRET-123",
    "ANTHROPIC_API_KEY": "sk-ant-SECRET-456",
    "VLLM_API_KEY": "vllm-SECRET-789",
    "AZURE_OPENAI_API_KEY": "azure-SECRET-321",
    "REDIS_URL": "redis://:redis-SECRET-000@10.0.0.5:6379/0",
    "GEMINI_API_KEY": "AIza-test-SECRET-321",
    "GOOGLE_CLOUD_PROJECT": "my-project-123",
}


def secret_values() -> list[str]:
    return [
        "sk-test-SECRET-123",
        "sk-ant-SECRET-456",
        "vllm-SECRET-789",
        "redis-SECRET-000",
        "azure-SECRET-321",
        "AIza-test-SECRET-321",
    ]


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real CLI in this process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(app, ["check-config", *args], env={**SECRETS, **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def report(config: Path | str, env: dict[str, str] | None = None) -> dict[str, Any]:
    code, out, err = run("--config", str(config), "--json", env=env)
    assert code == 0, err
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def order(config: Path | str, model: str) -> list[tuple[str, str]]:
    """(deployment, the model name it serves under) of each candidate, in order."""
    return [(c["deployment"], c["model"]) for c in report(config)["models"][model]["candidates"]]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


# --- the routing table --------------------------------------------------------------------------


def test_fallbacks_are_expanded_in_routing_order() -> None:
    """A model's deployments in file order, then its fallbacks', then theirs (each deployment
    once), each under the model name it serves."""
    assert order("config/examples/mixed.yaml", "chat-large") == [
        ("openai/gpt-4.1", "chat-large"),
        ("local/meta-llama/Llama-3.1-8B-Instruct", "chat-large"),
        ("anthropic/claude-sonnet-4-5", "claude"),
        ("openai/gpt-4.1-mini", "chat-fast"),
        ("anthropic/claude-haiku-4-5", "chat-fast"),
    ]
    assert order("config/examples/local-vllm.yaml", "llama-8b") == [
        ("gpu0/meta-llama/Llama-3.1-8B-Instruct", "llama-8b"),
        ("gpu1/meta-llama/Llama-3.1-8B-Instruct", "llama-8b"),
        ("openai/gpt-4.1-mini", "hosted"),
    ]


DEDUP = """
providers:
  oa: {type: openai, base_url: "https://api.example.com/v1", api_key: "${OPENAI_API_KEY}"}
  an: {type: anthropic, base_url: "https://api.anthropic.example", api_key: "${ANTHROPIC_API_KEY}"}
models:
  - name: a
    deployments: [{provider: oa, model: m1, weight: 3}, {provider: an, model: m2}]
    fallbacks: [b, c]
    budget: {ttft_ms: 700, total_ms: 9000}
    on_ttft_miss: hedge
    hedge_max_fraction: 0.2
  - name: b
    deployments: [{provider: an, model: m2}, {provider: oa, model: m3, prior: {ttft_ms: 400}}]
    fallbacks: [d]
  - name: c
    deployments: [{provider: oa, model: m1}, {provider: oa, model: m4}]
  - name: d
    deployments: [{provider: an, model: m5}]
    priority: bulk
"""


def test_duplicates_are_dropped_and_endpoints_follow_the_router(tmp_path: Path) -> None:
    """Transitive fallbacks, breadth first; a deployment already listed is not listed again;
    each candidate's endpoints are those the router would send it, and for every endpoint the
    list is exactly the router's own (`candidates`), up to its weighted draw within a model."""
    path = write(tmp_path, DEDUP)
    explained = report(path)["models"]["a"]
    assert explained["chain"] == ["a", "b", "c", "d"]
    rows = explained["candidates"]
    assert [(c["deployment"], c["model"]) for c in rows] == [
        ("oa/m1", "a"),
        ("an/m2", "a"),
        ("oa/m3", "b"),
        ("oa/m4", "c"),
        ("an/m5", "d"),
    ]
    assert [c["lead_share"] for c in rows] == [0.75, 0.25, 1.0, 1.0, 1.0]
    assert rows[2]["prior"] == {"ttft_ms": 400.0, "tpot_ms": None}
    anthropic = ["chat", "messages"]
    assert [c["endpoints"] for c in rows if c["deployment"].startswith("an/")] == [anthropic] * 2
    assert explained["unserved_endpoints"] == []

    settings = load_settings(path, environ=SECRETS)
    spec = settings.model("a")
    assert spec is not None
    chain = fallback_chain(spec, settings)
    providers = stand_ins(settings)
    for endpoint in ("chat", "messages", "completions", "embeddings"):
        call = Call(endpoint=endpoint, model="a", body={}, raw=b"", stream=False)
        for seed in range(20):
            routed = candidates(chain, providers, call, random.Random(seed))
            listed = [c for c in rows if endpoint in c["endpoints"]]
            # the same set, in the same model groups, in the same group order
            assert sorted(c.id for c in routed) == sorted(c["deployment"] for c in listed)
            assert [c.model for c in routed] == [c["model"] for c in listed]


def stand_ins(settings: Settings) -> dict[str, Provider]:
    """Providers as `serve` builds them (their HTTP pools never connect)."""

    async def build() -> dict[str, Provider]:
        async with AsyncExitStack() as stack:
            return await open_providers(settings, stack)

    return asyncio.run(build())


def test_budgets_policies_and_settings_are_shown(tmp_path: Path) -> None:
    """The text report names budgets, TTFT-miss policy, hedge cap, priority, batching, priors,
    the routing guards and the latency store."""
    code, out, err = run("--config", str(write(tmp_path, DEDUP)), "--explain")
    assert code == 0, err
    lines = out.splitlines()
    a = next(line for line in lines if line.split()[:1] == ["a"] and "700 ms" in line)
    assert "700 ms / 9000 ms" in a
    assert a.split()[7:] == ["hedge", "0.2", "-", "b", "->", "c", "->", "d"]
    assert any(line.split()[:2] == ["d", "bulk"] for line in lines)
    assert "3 (75%)" in out
    assert "ttft 400 ms" in out
    assert out.count("none for completions, embeddings") == 1  # d only: on Anthropic alone
    positions = [out.index(d) for d in ("oa/m1", "an/m2", "oa/m3", "oa/m4", "an/m5")]
    assert positions == sorted(positions)
    assert "cooldown after 3 failures in a row, 5 s doubling to 60 s" in out
    assert "retry budget 20% of active requests (at least 3)" in out
    assert "latency store: memory; window 60 s in 5 s slices, trusted from 20 samples" in out
    assert out.rstrip().endswith("OK")

    code, out, err = run("--config", "config/examples/openai.yaml", "--explain")
    assert code == 0, err
    assert "size 64, wait 20 ms, inflight 4, queue 4096" in out
    assert "2000 ms / 60000 ms" in out


def test_anthropic_only_models_say_what_they_cannot_serve() -> None:
    """Anthropic has no completions or embeddings: an alias served only there says so."""
    explained = report("config/examples/anthropic.yaml")["models"]["claude-fast"]
    assert explained["unserved_endpoints"] == ["completions", "embeddings"]
    assert explained["budget"] == {"ttft_ms": 1000, "total_ms": 60000}
    assert explained["candidates"][0]["prior"] == {"ttft_ms": 900.0, "tpot_ms": 15.0}
    code, out, _ = run("--config", "config/examples/anthropic.yaml", "--explain")
    assert code == 0
    assert "none for completions, embeddings" in out


# --- secrets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("mode", [[], ["--explain"], ["--json"]], ids=["plain", "explain", "json"])
def test_no_secret_is_ever_printed(config: Path, mode: list[str]) -> None:
    """Keys show as set / not set, the Redis URL's password is masked; no value leaks."""
    code, out, err = run("--config", str(config), *mode)
    assert code == 0, err
    for secret in secret_values():
        assert secret not in out + err
    if mode and "api_key: ${OPENAI_API_KEY}" in config.read_text():
        assert '"api_key": "set"' in out if mode == ["--json"] else " set " in out


@pytest.mark.parametrize(
    ("url", "shown", "topology"),
    [
        (
            "redis://user:redis-SECRET-000@10.0.0.5:6379/0",
            "redis://user:***@10.0.0.5:6379/0",
            {"topology": "standalone", "nodes": [], "service": None},
        ),
        (
            "redis+sentinel://:redis-SECRET-000@s1,s2:26380/mymaster/2"
            "?sentinel_password=redis-SECRET-000",
            "redis+sentinel://***@s1,s2:26380/mymaster/2?sentinel_password=***",
            {"topology": "sentinel", "nodes": ["s1:26379", "s2:26380"], "service": "mymaster"},
        ),
        (
            "redis+cluster://:redis-SECRET-000@c1:7000,c2:7001",
            "redis+cluster://***@c1:7000,c2:7001",
            {"topology": "cluster", "nodes": ["c1:7000", "c2:7001"], "service": None},
        ),
        (
            "rediss://:redis-SECRET-000@h:6380/0?password=redis-SECRET-000&ssl_cert_reqs=none",
            "rediss://***@h:6380/0?password=***&ssl_cert_reqs=none",
            {"topology": "standalone", "nodes": [], "service": None},
        ),
    ],
    ids=["standalone", "sentinel", "cluster", "query-password"],
)
def test_redis_url_is_shown_masked_with_its_topology(
    url: str, shown: str, topology: dict[str, Any]
) -> None:
    explained = report("config/examples/mixed.yaml", env={"REDIS_URL": url})["latency"]
    assert explained["redis"] == {"url": shown, **topology}
    assert (explained["store"], explained["window_s"], explained["slice_s"]) == ("redis", 60, 5)
    code, out, _ = run(
        "--config", "config/examples/mixed.yaml", "--explain", env={"REDIS_URL": url}
    )
    assert code == 0
    assert shown in out
    assert "redis-SECRET-000" not in out


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+cluster://:redis-SECRET-000@c1:7000/3", "database 0 only"),
        ("redis+sentinel://:redis-SECRET-000@s1:26379", "name the master"),
        ("memcached://:redis-SECRET-000@h:11211", "unsupported scheme"),
    ],
)
def test_an_unusable_redis_url_fails_the_check(url: str, reason: str) -> None:
    """The gateway could not start with it: exit 2, the reason, never the password."""
    for mode in ([], ["--explain"], ["--json"]):
        code, out, err = run(
            "--config", "config/examples/mixed.yaml", *mode, env={"REDIS_URL": url}
        )
        assert code == 2
        assert "latency.redis_url" in err and reason in err
        assert "redis-SECRET-000" not in out + err


def test_provider_credentials_and_header_values_stay_hidden(tmp_path: Path) -> None:
    """User info in a base URL is masked (also with an unencoded '/' in the password), extra
    header values are never shown (only their names), keys show as set / not set."""
    path = write(
        tmp_path,
        """
providers:
  up: {type: vllm, base_url: "https://me:base/SECRET@llm.example.com/v1",
       headers: {x-org: "org-SECRET-1"}}
  open: {type: openai, base_url: "https://tok-SECRET-2@api.example.com/v1"}
models:
  - name: m
    deployments: [{provider: up, model: x}, {provider: open, model: y}]
""",
    )
    explained = report(path)["providers"]
    assert explained["up"]["base_url"] == "https://me:***@llm.example.com/v1"
    assert explained["open"]["base_url"] == "https://***@api.example.com/v1"
    assert (explained["up"]["headers"], explained["up"]["api_key"]) == (["x-org"], "not set")
    for mode in ([], ["--explain"], ["--json"]):
        code, out, err = run("--config", str(path), *mode)
        assert code == 0, err
        for secret in ("SECRET",):
            assert secret not in out + err


# --- the installed command ----------------------------------------------------------------------


def test_the_installed_command_explains() -> None:
    """`tailguard check-config --explain` as a user runs it."""
    script = Path(sys.executable).with_name("tailguard")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]
    result = subprocess.run(
        [*command, "check-config", "--explain", "--config", "config/gateway.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "chat-large (fallback)" not in result.stdout
    assert "chat-fast (fallback)" in result.stdout
    assert "800 ms / 20000 ms" in result.stdout


# --- problems a newcomer can act on --------------------------------------------------------------

SIM_ONLY = """\
providers:
  sim: {type: simulated}
models:
  - name: chat-fast
    deployments: [{provider: sim, model: fast}]
"""


def problems(config: Path, env: dict[str, str] | None = None) -> str:
    """check-config on a config that must fail: its stderr, all on one line per problem."""
    code, out, err = run("--config", str(config), env=env)
    assert code == 2, out
    assert "Traceback" not in err
    assert err.startswith("error: ")
    return err


def test_a_yaml_error_gives_the_parsers_reason_and_position(tmp_path: Path) -> None:
    """A YAML syntax error is `file:line:column: reason` (PyYAML's problem and problem_mark),
    with a hint for the usual slip, and never the offending line (it may hold a secret)."""
    path = write(tmp_path, SIM_ONLY + "server:\n  host: 127.0.0.1\n  port: 8080: sk-SECRET-1\n")
    err = problems(path)
    assert err.splitlines()[0] == f"error: {path}:8:13: mapping values are not allowed here"
    assert "the file is not valid YAML at line 8, column 13" in err
    assert "hint: a value that contains ': ' must be quoted" in err
    assert "SECRET" not in err

    path = write(tmp_path, SIM_ONLY.replace("  sim: {type", "\tsim: {type"))
    err = problems(path)
    assert err.splitlines()[0].startswith(f"error: {path}:2:1: found character '\\t'")
    assert "YAML indents with spaces" in err


def test_all_unset_environment_variables_are_reported_at_once(tmp_path: Path) -> None:
    """Three `${VAR}` references to unset variables give one error listing all three, each with
    the line it is used on and its key, plus how to set them; a variable with a default, or one
    that is set, is not listed."""
    text = """\
latency:
  store: redis
  redis_url: ${TG_TEST_REDIS_URL}
providers:
  sim: {type: simulated}
  openai: {type: openai, base_url: "https://api.example.com/v1", api_key: "${TG_TEST_OPENAI}"}
  anthropic:
    type: anthropic
    base_url: ${TG_TEST_ANTHROPIC_URL:-https://api.anthropic.com}
    api_key: ${TG_TEST_ANTHROPIC}
  vllm: {type: vllm, base_url: "http://127.0.0.1:8000/v1", api_key: "${TG_TEST_SET}"}
models:
  - name: chat-fast
    deployments: [{provider: sim, model: fast}]
"""
    path = write(tmp_path, text)
    err = problems(path, env={"TG_TEST_SET": "vllm-key"})
    lines = err.splitlines()
    assert lines[0] == f"error: {path}: invalid configuration (3 problems)"
    assert lines[1:4] == [
        f"  {path}:3: latency.redis_url: environment variable TG_TEST_REDIS_URL is not set",
        f"  {path}:6: providers.openai.api_key: environment variable TG_TEST_OPENAI is not set",
        f"  {path}:10: providers.anthropic.api_key: environment variable TG_TEST_ANTHROPIC is "
        "not set",
    ]
    assert lines[4].startswith(
        "  hint: set them in the environment (export TG_TEST_REDIS_URL=... TG_TEST_OPENAI=... "
        "TG_TEST_ANTHROPIC=...)"
    )
    assert len(lines) == 5
    assert "vllm-key" not in err


def test_validation_errors_list_every_path_with_its_line(tmp_path: Path) -> None:
    """Every invalid key at once, in the file's order: the file and line, the path (models by
    name), the reason; an unknown key suggests the one it is close to; broken references
    between sections are each listed on the line that holds them."""
    text = """\
providers:
  sim: {type: simulated}
models:
  - name: chat-fast
    deployments:
      - {provider: sim, model: fast}
      - {provider: nope, model: fast}
    fallbacks: [chat-slow, missing]
  - name: chat-slow
    deployments: [{provider: sim, model: slow}]
    budget: {ttft_msec: 800}
"""
    path = write(tmp_path, text)
    lines = problems(path).splitlines()
    assert lines == [
        f"error: {path}:11: models[chat-slow].budget.ttft_msec: unknown key "
        "(did you mean 'ttft_ms'?)",
    ]
    path = write(tmp_path, text.replace("ttft_msec", "ttft_ms"))
    lines = problems(path).splitlines()
    assert lines == [
        f"error: {path}: invalid configuration (2 problems)",
        f"  {path}:7: models[chat-fast].deployments: unknown provider 'nope' (configured: sim)",
        f"  {path}:8: models[chat-fast].fallbacks: unknown model 'missing' (models: chat-fast, "
        "chat-slow)",
    ]
    path = write(
        tmp_path, text.replace("ttft_msec: 800", "ttft_ms: 0").replace("sim, model: s", "x")
    )
    lines = problems(path).splitlines()
    assert lines[0] == f"error: {path}: invalid configuration (2 problems)"
    assert lines[1].startswith(f"  {path}:10: models[chat-slow].deployments[0].")
    assert (
        lines[2] == f"  {path}:11: models[chat-slow].budget.ttft_ms: Input should be greater than 0"
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"TAILGUARD_SERVER__PORT": "abc"},
            "error: TAILGUARD_SERVER__PORT=abc: Input should be a valid integer, unable to parse "
            "string as an integer",
        ),
        (
            {"TAILGUARD_AUTH__KEYS": "team-a"},
            "error: TAILGUARD_AUTH__KEYS: not valid JSON (this setting is a list: give it as a "
            "JSON array, '[...]')",
        ),
        (
            {"TAILGUARD_PROVIDERS": '{"sim": {"type": "simulted"}}'},
            "error: TAILGUARD_PROVIDERS: providers.sim.type: Input should be 'openai', 'vllm', "
            "'anthropic', 'azure', 'bedrock', 'gemini', 'vertex' or 'simulated'",
        ),
        (
            {"TAILGUARD_PROVIDERS__SIM__API_KEYY": "sk-SECRET-9"},
            "error: TAILGUARD_PROVIDERS__SIM__API_KEYY: unknown key (did you mean 'api_key'?)",
        ),
    ],
    ids=["bad-value", "not-json", "json-section", "unknown-key"],
)
def test_an_environment_override_is_named(
    tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    """A problem a `TAILGUARD_*` variable causes names the variable (with its value when that
    cannot be a secret), not the file, which is fine."""
    path = write(tmp_path, SIM_ONLY)
    err = problems(path, env=env)
    assert err.splitlines() == [expected]
    assert str(path) not in err and "SECRET" not in err


def test_overrides_and_file_problems_are_listed_together(tmp_path: Path) -> None:
    """The file's problems (with their lines) and the environment's (by variable) in one
    message; a section that fails because of an override says which variable is set in it."""
    path = write(tmp_path, SIM_ONLY + "latency:\n  window_s: 1\n")
    err = problems(path, env={"TAILGUARD_SERVER__WORKERS": "0"})
    assert err.splitlines() == [
        f"error: {path}: invalid configuration (2 problems)",
        f"  {path}:7: latency.window_s: Input should be greater than or equal to 5",
        "  TAILGUARD_SERVER__WORKERS=0: Input should be greater than or equal to 1",
    ]
    path = write(tmp_path, SIM_ONLY)
    err = problems(path, env={"TAILGUARD_LATENCY__STORE": "redis"})
    assert err.splitlines() == [
        f"error: {path}: latency: store is 'redis' but redis_url is not set (with "
        "TAILGUARD_LATENCY__STORE set in the environment)"
    ]


KEY_HASHES = [hashlib.sha256(f"key-{i}".encode()).hexdigest() for i in range(3)]


@pytest.mark.parametrize(
    ("extra", "env", "expected"),
    [
        ("", {}, "auth off (loopback only)"),
        (
            "server: {host: 0.0.0.0, allow_unauthenticated: true}\n",
            {},
            "auth off — allow_unauthenticated (anyone who reaches 0.0.0.0 may call models)",
        ),
        (
            "server: {host: 127.0.0.1, allow_unauthenticated: true}\n",
            {},
            "auth off (loopback only)",
        ),
        (
            f"auth:\n  keys:\n    - {{name: a, sha256: {KEY_HASHES[0]}, rpm: 60}}\n"
            f"    - {{name: b, sha256: {KEY_HASHES[1]}}}\n"
            f"  admin_keys: [{{name: ops, sha256: {KEY_HASHES[2]}}}]\n",
            {},
            "auth on: 2 client keys, 1 admin key; rate limits on for 1 key (memory)",
        ),
        (
            f"auth:\n  keys: [{{name: a, sha256: {KEY_HASHES[0]}, tpm: 1000}}]\n"
            "latency: {store: redis, redis_url: 'redis://127.0.0.1:6379/0'}\n",
            {},
            "auth on: 1 client key, 0 admin keys; rate limits on for 1 key (redis)",
        ),
        (
            f"auth: {{admin_keys: [{{name: ops, sha256: {KEY_HASHES[2]}}}]}}\n",
            {},
            "auth on: 0 client keys (no key may call models), 1 admin key; rate limits off",
        ),
    ],
    ids=["no-keys", "allow-unauthenticated", "allowed-but-loopback", "keys", "redis", "admin"],
)
def test_the_auth_line_says_what_the_config_does(
    tmp_path: Path, extra: str, env: dict[str, str], expected: str
) -> None:
    """check-config's summary and --explain state who may call: the keys and rate limits, or
    with no keys, loopback only or `allow_unauthenticated`, as the config really has it."""
    path = write(tmp_path, SIM_ONLY + extra)
    code, out, err = run("--config", str(path), env=env)
    assert code == 0, err
    assert expected in out.splitlines()
    code, out, err = run("--config", str(path), "--explain", env=env)
    assert code == 0, err
    (server,) = [line for line in out.splitlines() if "worker(s); " in line]
    assert server.endswith(f"worker(s); {expected}")


def test_no_keys_beyond_loopback_fails_the_check(tmp_path: Path) -> None:
    """What `serve` refuses (no keys on a non-loopback interface, without
    allow_unauthenticated), check-config refuses too, with the way out."""
    err = problems(write(tmp_path, SIM_ONLY + "server: {host: 0.0.0.0}\n"))
    assert (
        "server.host: no API keys are configured, so the gateway only listens on loopback, " in err
    )
    assert "not on 0.0.0.0" in err and "allow_unauthenticated" in err


# --- serve ---------------------------------------------------------------------------------------


def tailguard_command() -> list[str]:
    script = Path(sys.executable).with_name("tailguard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without TAILGUARD_* variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TAILGUARD_")}
    return {**env, **extra}


def serve_summary(config: Path, *args: str) -> list[str]:
    """The start-up summary `tailguard serve` prints before it binds (on stderr), read up to
    its `config:` line; the server, on an ephemeral port, is then stopped."""
    with subprocess.Popen(
        [*tailguard_command(), "serve", "--config", str(config), "--port", "0", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    ) as process:
        watchdog = threading.Timer(60, process.kill)
        watchdog.start()
        try:
            assert process.stderr is not None
            lines = []
            for line in process.stderr:
                lines.append(line.rstrip("\n"))
                if line.startswith("config:"):
                    break
            return lines
        finally:
            watchdog.cancel()
            process.terminate()


def test_serve_prints_the_real_auth_setting(tmp_path: Path) -> None:
    """`serve`'s start-up summary has the same auth line as check-config: keys and rate limits,
    loopback only, or allow_unauthenticated (from the file or the flags)."""
    keys = (
        f"auth:\n  keys:\n    - {{name: a, sha256: {KEY_HASHES[0]}, rpm: 60}}\n"
        f"  admin_keys: [{{name: ops, sha256: {KEY_HASHES[2]}}}]\n"
    )
    path = write(tmp_path, SIM_ONLY + keys)
    lines = serve_summary(path)
    assert lines[0].startswith("Tailguard on http://127.0.0.1:0  (1 worker;")
    assert lines[1:] == [
        "auth on: 1 client key, 1 admin key; rate limits on for 1 key (memory)",
        f"config: {path}",
    ]
    path = write(tmp_path, SIM_ONLY)
    assert serve_summary(path)[1:] == ["auth off (loopback only)", f"config: {path}"]
    lines = serve_summary(path, "--host", "0.0.0.0", "--allow-unauthenticated")
    assert lines[1:] == [
        "auth off — allow_unauthenticated (anyone who reaches 0.0.0.0 may call models)",
        f"config: {path}",
    ]


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        (SIM_ONLY + "server:\n  port: 8080: x\n", {}, ":7:13: mapping values are not allowed here"),
        (SIM_ONLY, {"TAILGUARD_AUTH__KEYS": "team-a"}, "TAILGUARD_AUTH__KEYS: not valid JSON"),
        (
            SIM_ONLY + "latency: {store: redis, redis_url: 'redis+cluster://:SECRET@c1:7000/3'}\n",
            {},
            "latency.redis_url: Redis URL: a Redis Cluster has database 0 only",
        ),
    ],
    ids=["yaml", "override", "redis-url"],
)
def test_serve_with_a_bad_config_exits_with_the_same_message(
    tmp_path: Path, text: str, env: dict[str, str], expected: str
) -> None:
    """`serve` prints exactly what check-config prints and exits 2 before binding a port: no
    traceback, also for a bad override or a Redis URL the store could not use."""
    path = write(tmp_path, text)
    results = [
        subprocess.run(
            [*tailguard_command(), command, "--config", str(path), *extra],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(**env),
        )
        for command, extra in (("serve", ["--port", "0"]), ("check-config", []))
    ]
    served, checked = results
    assert (served.returncode, checked.returncode) == (2, 2)
    assert served.stderr == checked.stderr
    assert expected in served.stderr
    assert "Traceback" not in served.stderr and "SECRET" not in served.stderr
    assert "Uvicorn running" not in served.stderr
