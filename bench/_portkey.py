"""Portkey's open-source gateway as a contender of the field comparison: found (installed with
npm on first use into `bench/.node/portkey`), started with the machine's `node`, found ready.

The package's `bin` is `build/start-server.js`: one Node process (the `@hono/node-server` HTTP
server) that takes `--port=N` and `--headless` (no console UI, no log stream) and answers
`GET /` with 200 once it listens. It listens on every interface (the script passes no host).
Portkey has no route table: each request names its provider and upstream in headers
(`x-portkey-provider`, `x-portkey-custom-host`), and `authorization` carries the upstream key.

Missing `node`/`npm` or a failed install is reported by `Found(None, ...)` and a reason, so the
run goes on without Portkey.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

from bench._contenders import AUTH_HEADERS, Found
from bench._harness import ROOT
from gateway.tools.stack import Stack

PORTKEY_VERSION: Final = "1.15.2"
PORTKEY_PACKAGE: Final = f"@portkey-ai/gateway@{PORTKEY_VERSION}"
PORTKEY_PREFIX: Final = ROOT / "bench" / ".node" / "portkey"
PORTKEY_ARGS: Final = ("--headless",)
# Production mode, as deployed; everything else it reads from the environment (an HTTP proxy for
# upstream calls, a Redis cache, cloud credentials) is left out so nothing but routing runs.
PORTKEY_ENV: Final = {"NODE_ENV": "production"}
_PORTKEY_UNSET: Final = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "REDIS_CONNECTION_STRING",
    "TRUSTED_CUSTOM_HOSTS",
    "NODE_OPTIONS",
)
_INSTALL_TIMEOUT_S: Final = 900.0


def _package_dir(name: str) -> Path:
    return PORTKEY_PREFIX / "node_modules" / name


def _package_json(name: str) -> dict[str, object] | None:
    with contextlib.suppress(OSError, ValueError):
        document = json.loads((_package_dir(name) / "package.json").read_text())
        if isinstance(document, dict):
            return document
    return None


def _installed_version(name: str) -> str | None:
    version = (_package_json(name) or {}).get("version")
    return version if isinstance(version, str) else None


def _start_script() -> Path | None:
    """The package's `bin` (a string, or a map of command names to scripts)."""
    document = _package_json("@portkey-ai/gateway") or {}
    binary = document.get("bin")
    if isinstance(binary, dict):
        binary = binary.get("gateway") or next(iter(binary.values()), None)
    if not isinstance(binary, str):
        return None
    script = _package_dir("@portkey-ai/gateway") / binary
    return script if script.is_file() else None


def find_portkey(install: bool) -> Found:
    """`@portkey-ai/gateway` at `PORTKEY_VERSION` under `PORTKEY_PREFIX`; installed with npm when
    it is missing or another version, if `install` is set. `path` is its start script."""
    if shutil.which("node") is None:
        return Found(None, None, "node not found (Debian: apt-get install -y nodejs npm)")
    held = _installed_version("@portkey-ai/gateway")
    if held != PORTKEY_VERSION:
        if not install:
            return Found(None, None, f"{PORTKEY_PACKAGE} not installed in {PORTKEY_PREFIX}")
        npm = shutil.which("npm")
        if npm is None:
            return Found(None, None, "npm not found (Debian: apt-get install -y npm)")
        why = "first use" if held is None else f"replacing {held}"
        print(f"installing {PORTKEY_PACKAGE} into {PORTKEY_PREFIX} ({why})...", flush=True)
        PORTKEY_PREFIX.mkdir(parents=True, exist_ok=True)
        command = [npm, "install", "--prefix", str(PORTKEY_PREFIX), "--no-audit", "--no-fund"]
        try:
            done = subprocess.run(
                [*command, PORTKEY_PACKAGE],
                capture_output=True,
                text=True,
                timeout=_INSTALL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return Found(None, None, f"installing Portkey failed: {exc}")
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return Found(None, None, "installing Portkey failed: " + " / ".join(tail))
        installed = _installed_version("@portkey-ai/gateway")
        if installed != PORTKEY_VERSION:
            return Found(None, None, f"npm installed Portkey {installed}, not {PORTKEY_VERSION}")
    script = _start_script()
    if script is None:
        return Found(None, None, f"no start script in {_package_dir('@portkey-ai/gateway')}")
    return Found(script, PORTKEY_VERSION)


def versions(found: Found) -> dict[str, str]:
    """Portkey's version, the `node` it runs on, and its HTTP server (npm resolves that one
    at install time, so it is not fixed by Portkey's version)."""
    found_versions = {"portkey": found.version or "?"}
    node = shutil.which("node")
    if node is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [node, "--version"], capture_output=True, text=True, timeout=10, check=False
            )
            found_versions["node"] = out.stdout.strip() or "?"
    server = _installed_version("@hono/node-server")
    if server is not None:
        found_versions["@hono/node-server"] = server
    return found_versions


def request_headers(upstream_port: int) -> dict[str, str]:
    """What every request to Portkey carries: the bench key (passed on to the upstream as its
    API key) and the routing Portkey reads from headers."""
    return AUTH_HEADERS | {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": f"http://127.0.0.1:{upstream_port}/v1",
    }


def start_portkey(stack: Stack, script: Path, port: int) -> subprocess.Popen[bytes]:
    """`node <start-server.js> --port=N --headless`, one process, once `GET /` answers."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node not found: Portkey cannot start")
    env = {k: v for k, v in os.environ.items() if k not in _PORTKEY_UNSET}
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")} | PORTKEY_ENV
    command = [node, str(script), f"--port={port}", *PORTKEY_ARGS]
    return stack.start_ready("portkey", command, "portkey.log", f"http://127.0.0.1:{port}/", env)
