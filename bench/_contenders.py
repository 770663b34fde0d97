"""The processes of the field comparison: Tailguard with every feature on, LiteLLM, nginx, and
what they need (a throwaway Redis, an OTLP sink), each started by the `Stack` and found ready.
Portkey, the Node contender, is in `bench/_portkey.py`.

LiteLLM runs from its own virtualenv (`bench/.venvs/litellm`, made with `python -m venv` and
`pip install LITELLM_REQUIREMENT`), never from the project's; a virtualenv holding another
version is made anew, so a run always measures the pinned release. nginx is the system's.
Either one missing is reported by `Found(None, ...)` and a reason, so the run goes on without it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench._harness import ROOT, VENV_BIN
from gateway.tools.stack import Stack, serve

LITELLM_VENV: Final = ROOT / "bench" / ".venvs" / "litellm"
# The newest release whose `proxy` extra installs here: 1.108.8 to 1.110.2 pin companion
# packages (`litellm-enterprise`, `litellm-proxy-extras`, `litellm-proxy`) that have no
# matching release on the registry.
LITELLM_REQUIREMENT: Final = "litellm[proxy]==1.108.7"
LITELLM_VERSION: Final = LITELLM_REQUIREMENT.rpartition("==")[2]
# One key for every path: Tailguard checks its sha256, LiteLLM takes it as its master key (which
# must start with `sk-`), nginx and the upstream ignore it.
API_KEY: Final = "sk-tailguard-bench-3f9c2a7e51d04b86"
AUTH_HEADERS: Final = {"authorization": f"Bearer {API_KEY}"}
ADMIN_KEY: Final = "sk-tailguard-bench-admin-8d2e61b0c4f7"  # reads /admin/latency and /metrics
ADMIN_HEADERS: Final = {"authorization": f"Bearer {ADMIN_KEY}"}
FALLBACK_MODEL: Final = "bench-fallback"

# LiteLLM's production checklist (docs.litellm.ai/docs/proxy/prod): no database, a master key,
# no spend or error logs, no debug logging, JSON logs, uvloop (its default), one worker per
# process; the model cost map is read from the package rather than fetched at start.
LITELLM_ENV: Final = {
    "LITELLM_LOG": "ERROR",
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
LITELLM_GENERAL_SETTINGS: Final = {
    "master_key": API_KEY,
    "disable_spend_logs": True,
    "disable_error_logs": True,
    "proxy_batch_write_at": 60,
}
LITELLM_SETTINGS: Final = {"set_verbose": False, "json_logs": True, "request_timeout": 600}
# Variables that would give LiteLLM a database or callbacks we did not ask for.
_LITELLM_UNSET: Final = ("DATABASE_URL", "DIRECT_URL", "DATABASE_HOST", "STORE_MODEL_IN_DB")


@dataclass(frozen=True, slots=True)
class Found:
    """A contender that can run here, or why it cannot (`path` None)."""

    path: Path | None
    version: str | None
    reason: str = ""


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


# --- finding and installing ----------------------------------------------------------------------


def find_nginx() -> Found:
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
    )
    if nginx is None:
        return Found(None, None, "nginx not found (Debian: apt-get install -y nginx)")
    try:
        out = _run([nginx, "-v"], 10)
    except (OSError, subprocess.SubprocessError) as exc:
        return Found(None, None, f"{nginx} -v failed: {exc}")
    text = (out.stderr or out.stdout).strip()  # "nginx version: nginx/1.22.1"
    return Found(Path(nginx), text.rpartition("/")[2] or text)


def _litellm_version(python: Path) -> str | None:
    """The LiteLLM version installed in its virtualenv; None when there is none (or it is
    broken)."""
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    try:
        out = _run([str(python), "-c", code], 60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def find_litellm(install: bool) -> Found:
    """LiteLLM at `LITELLM_VERSION` in its own virtualenv; made anew (venv + pip) when it is
    missing or holds another version, if `install` is set."""
    binary = LITELLM_VENV / "bin" / "litellm"
    python = LITELLM_VENV / "bin" / "python"
    installed = _litellm_version(python) if python.exists() else None
    if installed != LITELLM_VERSION or not binary.exists():
        held = f" (it holds {installed})" if installed else ""
        if not install:
            return Found(None, None, f"LiteLLM {LITELLM_VERSION} not in {LITELLM_VENV}{held}")
        why = "first use" if installed is None else f"replacing {installed}"
        print(f"installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} ({why})...", flush=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(LITELLM_VENV)],
            [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
            [str(python), "-m", "pip", "install", "-q", LITELLM_REQUIREMENT],
        ]
        for step in steps:
            try:
                done = _run(step, 1800)
            except (OSError, subprocess.SubprocessError) as exc:
                return Found(None, None, f"installing LiteLLM failed: {exc}")
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                return Found(None, None, "installing LiteLLM failed: " + " / ".join(tail))
        installed = _litellm_version(python)
        if installed != LITELLM_VERSION or not binary.exists():
            return Found(None, None, f"pip left LiteLLM {installed} in {LITELLM_VENV}")
    return Found(binary, installed)


def tool_versions() -> dict[str, str]:
    """Versions of what the Tailguard path runs on, for the results."""
    code = (
        "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
        "('tailguard', 'uvicorn', 'uvloop', 'httptools', 'aiohttp', 'redis', "
        "'opentelemetry-sdk')}))"
    )
    versions: dict[str, str] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        versions |= json.loads(_run([sys.executable, "-c", code], 60).stdout)
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        line = _run(["redis-server", "--version"], 10).stdout.split()
        versions["redis-server"] = next(w[2:] for w in line if w.startswith("v="))
    return versions


# --- starting ------------------------------------------------------------------------------------


def wait_redis(port: int, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and child.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


def start_redis(stack: Stack, port: int, log_name: str = "redis.log") -> subprocess.Popen[bytes]:
    """A throwaway redis-server (no persistence): the run's key space is all its own."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server not found: the Redis latency store needs one")
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no"]
    child = stack.start("redis", command, log_name)
    wait_redis(port, child)
    return child


def start_otlp_sink(stack: Stack, port: int) -> subprocess.Popen[bytes]:
    script = str(Path(__file__).with_name("_otlp_sink.py"))
    command = [sys.executable, script, str(port)]
    return stack.start_ready("otlp", command, "otlp.log", f"http://127.0.0.1:{port}/health")


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 5) -> bytes:
    """GET on a fresh connection (so a multi-worker server may hand it to any worker)."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body: bytes = response.read()
    return body


def otlp_stats(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as response:
        stats: dict[str, int] = json.loads(response.read())
    return stats


# --- why requests failed -------------------------------------------------------------------------

# An exception's name and message as Node stack traces and Python tracebacks print them.
_ERROR_NAME: Final = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b(?::[ \t]*([^\n]*))?")
_STATUS: Final = re.compile(r"^status (\d{3})\b")  # the load generator's error samples
_LOG_READ_LIMIT: Final = 1 << 20  # a window of failures can log megabytes of stack traces
REASON_CHARS: Final = 60


def log_size(path: Path) -> int:
    """Where the next window's log lines start."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_errors(path: Path, offset: int, limit: int = 3) -> list[str]:
    """The exceptions a process logged after `offset` (`TypeError: immutable`), most frequent
    first."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            text = file.read(_LOG_READ_LIMIT).decode(errors="replace")
    except OSError:
        return []
    found = Counter(
        f"{name}: {message.strip()[:REASON_CHARS]}".rstrip(": ")
        for name, message in _ERROR_NAME.findall(text)
    )
    return [reason for reason, _ in found.most_common(limit)]


def failure_cause(samples: Sequence[str], logged: Sequence[str]) -> tuple[int | None, str]:
    """(the most frequent HTTP status, a short reason) of failed requests: the exception the
    process logged meanwhile if any, else the message of the first error body."""
    statuses = Counter(int(m.group(1)) for sample in samples if (m := _STATUS.match(sample)))
    status = statuses.most_common(1)[0][0] if statuses else None
    if logged:
        return status, logged[0]
    if not samples:
        return status, ""
    sample = samples[0]
    head, _, body = sample.partition(": ")
    if not _STATUS.match(head):
        return status, sample[:REASON_CHARS]  # not an HTTP error: a timeout, a reset, a bad body
    with contextlib.suppress(ValueError, SyntaxError, TypeError):
        message = _body_message(json.loads(ast.literal_eval(body)))  # printed as b'...'
        if message is not None:
            return status, message[:REASON_CHARS]
    return status, body[:REASON_CHARS]


def _body_message(document: object) -> str | None:
    """`message` or `error.message` (or a bare `error` string) of a JSON error body."""
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    message = document.get("message") or (
        error.get("message") if isinstance(error, dict) else error
    )
    return message if isinstance(message, str) and message else None


def tailguard_config(
    port: int, upstream_port: int, redis_port: int, models: tuple[str, ...]
) -> dict[str, Any]:
    """Every feature on: budgets with a fallback (the planner runs on every request), the Redis
    latency store, the access log, and an API key (sent by every request) with rate limits
    checked in the same Redis."""
    budget = {"ttft_ms": 2000, "total_ms": 30000}
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": True},
        # A window longer than the run: /admin/latency then counts every request of it.
        "latency": {
            "store": "redis",
            "redis_url": f"redis://127.0.0.1:{redis_port}/0",
            "window_s": 3600,
            "slice_s": 60,
        },
        "providers": {"up": {"type": "vllm", "base_url": f"http://127.0.0.1:{upstream_port}/v1"}},
        "models": [
            {
                "name": name,
                "deployments": [{"provider": "up", "model": name}],
                "budget": budget,
                "fallbacks": [FALLBACK_MODEL],
            }
            for name in models
        ]
        + [{"name": FALLBACK_MODEL, "deployments": [{"provider": "up", "model": models[0]}]}],
        "auth": {
            # Limits far above any load here: every request is checked and charged in Redis
            # (one Lua round trip) and none is refused.
            "keys": [
                {
                    "name": "bench",
                    "sha256": sha256_hex(API_KEY),
                    "rpm": 100_000_000,
                    "tpm": 10_000_000_000,
                }
            ],
            "admin_keys": [{"name": "bench-admin", "sha256": sha256_hex(ADMIN_KEY)}],
            "rate_limits": {"store": "redis"},
        },
    }


def tailguard_env(otlp_port: int) -> dict[str, str]:
    """The bench's environment plus an OTLP/HTTP endpoint: traces on, exported to the sink."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{otlp_port}"
    env["OTEL_SERVICE_NAME"] = "tailguard-bench"
    return env


def start_tailguard(
    stack: Stack,
    *,
    port: int,
    upstream_port: int,
    redis_port: int,
    otlp_port: int,
    models: tuple[str, ...],
    workers: int = 1,
    role: str = "gateway",
    name: str = "tailguard",
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Tailguard with every feature on, unless `config` or `env` (replacing them) say else."""
    if config is None:
        config = tailguard_config(port, upstream_port, redis_port, models)
    # A directory of its own: the gateway watches its config's directory for changes, and the
    # logs written next to it would wake that watch all the time.
    path = stack.logs / f"{name}-config" / "gateway.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    return serve(
        stack,
        port,
        path,
        workers=workers,
        env=tailguard_env(otlp_port) if env is None else env,
        role=role,
        log_name=f"{name}.log",
    )


def feature_variants(
    port: int, upstream_port: int, redis_port: int, otlp_port: int, models: tuple[str, ...]
) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(label, config, environment) of Tailguard with its features taken away one at a time."""
    full = tailguard_config(port, upstream_port, redis_port, models)
    traced = tailguard_env(otlp_port)
    untraced = {k: v for k, v in traced.items() if not k.startswith("OTEL_")}
    unsampled = traced | {"OTEL_TRACES_SAMPLER": "parentbased_always_off"}
    quiet = json.loads(json.dumps(full))
    quiet["server"]["access_log"] = False
    plain = {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "providers": full["providers"],
        "models": [{"name": m, "deployments": [{"provider": "up", "model": m}]} for m in models],
    }
    return [
        ("every feature on", full, traced),
        ("tracing on, no span sampled", full, unsampled),
        ("no tracing", full, untraced),
        ("no tracing, no access log", quiet, untraced),
        ("none: no auth, budgets, fallbacks, Redis store", plain, untraced),
    ]


def start_litellm(
    stack: Stack, binary: Path, port: int, upstream_port: int, models: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    config = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {
                    "model": f"openai/{name}",
                    "api_base": f"http://127.0.0.1:{upstream_port}/v1",
                    "api_key": "unused",
                },
            }
            for name in models
        ],
        "general_settings": LITELLM_GENERAL_SETTINGS,
        "litellm_settings": LITELLM_SETTINGS,
    }
    path = stack.logs / "litellm.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if k not in _LITELLM_UNSET}
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")} | LITELLM_ENV
    command = [str(binary), "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--num_workers", "1"]
    return stack.start_ready(
        "litellm", command, "litellm.log", f"http://127.0.0.1:{port}/health/liveliness", env
    )


NGINX_CONF: Final = """\
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream llm {{
        server 127.0.0.1:{upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /nginx-health {{ return 200 "ok"; }}
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(
    stack: Stack, binary: Path, port: int, upstream_port: int
) -> subprocess.Popen[bytes]:
    """nginx as the practical floor: one worker process, keep-alive upstream, no buffering."""
    tmp = stack.logs / "nginx"
    tmp.mkdir(exist_ok=True)
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, upstream=upstream_port))
    command = [str(binary), "-p", str(tmp), "-e", str(tmp / "nginx-error.log"), "-c", str(conf)]
    command += ["-g", "daemon off;"]
    return stack.start_ready("nginx", command, "nginx.log", f"http://127.0.0.1:{port}/nginx-health")


def start_reference(stack: Stack, port: int, upstream_port: int) -> subprocess.Popen[bytes]:
    script = str(Path(__file__).with_name("_refproxy.py"))
    command = [sys.executable, script, str(port), f"http://127.0.0.1:{upstream_port}/v1"]
    return stack.start_ready("reference", command, "ref.log", f"http://127.0.0.1:{port}/healthz")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (uvicorn's and nginx's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue.extend(children.get(current, ()))
    return found


def start_upstream(
    stack: Stack, port: int, tokens: int, paced_model: str, paced_tps: float
) -> subprocess.Popen[bytes]:
    """`tailguard sim`: every model answers `tokens` tokens at once, `paced_model` decodes at
    `paced_tps` tokens/s (one network read per event, as from a real model)."""
    profiles = stack.logs / "sim.yaml"
    profiles.write_text(
        f"default: {{output_tokens: {tokens}}}\n"
        f"profiles: {{{paced_model}: {{output_tokens: {tokens}, tokens_per_s: {paced_tps:g}}}}}\n"
    )
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", "1"]
    command += ["--profile", str(profiles)]
    return stack.start_ready("upstream", command, "upstream.log", f"http://127.0.0.1:{port}/health")
