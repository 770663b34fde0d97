"""The spill benchmark's scenario: the simulated servers' profiles, the gateway's config per mode,
the local server's capacity and the options a run takes (see bench/spill.py)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench._harness import (
    VENV_BIN,
)
from gateway.tools.stack import Stack

MODES: Final = ("round_robin", "tailguard")
STEPS_PCT: Final = (20, 40, 60, 80, 100, 120, 150, 200)
WARMUP_PCT: Final = 20

MODEL: Final = "chat"
HOSTED_MODEL: Final = "chat-hosted"
LOCAL_DEPLOYMENT: Final = "local/llama"  # <provider>/<model>, as x-tailguard-deployment names it
HOSTED_DEPLOYMENT: Final = "hosted/remote"
TTFT_BUDGET_MS: Final = 600
HOSTED_PRIOR_TTFT_MS: Final = 450  # what an operator would write for a ~400 ms hosted model
METRICS_INTERVAL_S: Final = 0.5
MAX_TOKENS: Final = 32
LOCAL_SHARE_TARGET: Final = 0.90
LOCAL_SHARE_BELOW_PCT: Final = 80
OVERLOAD_SHARE_TARGET: Final = 0.40  # past capacity the local server still serves its part
OVERLOAD_FROM_PCT: Final = 150
PROMPT: Final = (
    "Explain in two sentences why a queue in front of a GPU makes time to first token grow."
)

LOCAL_PROFILE: Final[dict[str, Any]] = {
    "max_batch": 16,
    "prefill_base_ms": 40,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.2,
    "tokens_per_s": 40,
    "batch_slowdown": 0.25,
    "output_tokens": MAX_TOKENS,
}
HOSTED_PROFILE: Final[dict[str, Any]] = {
    "max_batch": 4096,
    "prefill_base_ms": 400,
    "ttft_tail": "lognormal",
    "ttft_sigma": 0.05,
    "tokens_per_s": 100,
    "output_tokens": MAX_TOKENS,
}

REQUEST_TIMEOUT_S: Final = 120.0
KEEPALIVE_S: Final = 2.0  # below uvicorn's 5 s idle timeout
QUEUE_SAMPLE_S: Final = 0.25
NOISY_LAG_MS: Final = 10.0
MAX_ERROR_SAMPLES: Final = 5


def local_capacity_rps(profile: dict[str, Any] = LOCAL_PROFILE) -> float:
    """Requests per second the local server completes with every slot busy: `max_batch` over
    one request's time at a full batch (prefill, then n - 1 decode steps slowed by
    `batch_slowdown`)."""
    step_s = (1 + float(profile["batch_slowdown"])) / float(profile["tokens_per_s"])
    request_s = float(profile["prefill_base_ms"]) / 1000 + (MAX_TOKENS - 1) * step_s
    return float(profile["max_batch"]) / request_s


def start_sim(
    stack: Stack, name: str, port: int, profile: dict[str, Any], seed: int
) -> subprocess.Popen[bytes]:
    """`tailguard sim` with `profile` as `--set` overrides of its default profile."""
    command = [str(VENV_BIN / "tailguard"), "sim", "--port", str(port), "--seed", str(seed)]
    for key, value in profile.items():
        command += ["--set", f"{key}={value}"]
    return stack.start_ready("upstream", command, f"{name}.log", f"http://127.0.0.1:{port}/health")


def gateway_config(mode: str, port: int, local_port: int, hosted_port: int) -> dict[str, Any]:
    local_provider, local_model = LOCAL_DEPLOYMENT.split("/")
    hosted_provider, hosted_model = HOSTED_DEPLOYMENT.split("/")
    hosted = {"type": "openai", "base_url": f"http://127.0.0.1:{hosted_port}/v1"}
    local: dict[str, Any] = {"base_url": f"http://127.0.0.1:{local_port}/v1"}
    if mode == "round_robin":
        local["type"] = "openai"  # no metrics: the order is the weighted draw alone
        models: list[dict[str, Any]] = [
            {
                "name": MODEL,
                "deployments": [
                    {"provider": local_provider, "model": local_model, "weight": 1},
                    {"provider": hosted_provider, "model": hosted_model, "weight": 1},
                ],
            }
        ]
    else:
        local.update(type="vllm", metrics_interval_s=METRICS_INTERVAL_S)
        models = [
            {
                "name": MODEL,
                "deployments": [{"provider": local_provider, "model": local_model}],
                "budget": {"ttft_ms": TTFT_BUDGET_MS},
                "fallbacks": [HOSTED_MODEL],
            },
            {
                "name": HOSTED_MODEL,
                # The fallback sees only what spills, so its statistics take a while to be
                # trusted; until then the first-token deadline is planned on this prior.
                "deployments": [
                    {
                        "provider": hosted_provider,
                        "model": hosted_model,
                        "prior": {"ttft_ms": HOSTED_PRIOR_TTFT_MS},
                    }
                ],
            },
        ]
    return {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "latency": {"store": "memory"},
        "providers": {local_provider: local, hosted_provider: hosted},
        "models": models,
    }


@dataclass(slots=True)
class Options:
    modes: list[str]
    step_s: float
    warmup_s: float
    steps_pct: tuple[int, ...]
    seed: int
    json_path: Path
    keep_logs: bool
    parts: tuple[str, ...] = ("ramp", "burst")
