"""bench/bulk.py's scenario: the simulated server, the gateway's config, the requests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gateway.tools.load import Request
from gateway.tools.stack import metric_samples

DEPLOYMENT: Final = "gpu/shared"
EMBED_MODEL: Final = "embed"
CHAT_MODEL: Final = "chat"
# One simulated server: embeddings and chat share its 4 slots (same model name, same max_batch).
SIM_PROFILE: Final[Mapping[str, float | int]] = {
    "max_batch": 4,
    "embed_base_ms": 20,
    "embed_ms_per_input": 0.2,
    "embedding_dims": 16,
    "prefill_base_ms": 60,
    "prefill_ms_per_token": 0.2,
    "tokens_per_s": 100,  # 10 ms a token
    "output_tokens": 16,
}
BATCHING: Final[Mapping[str, int]] = {
    "max_batch_size": 64,
    "max_wait_ms": 10,
    "max_inflight": 4,
    "max_queue": 4096,
}
# The simulator embeds a whole call on one batch slot: a full micro-batch is one slot-equivalent.
BULK: Final[Mapping[str, int]] = {"embedding_inputs_per_slot": BATCHING["max_batch_size"]}
METRICS_INTERVAL_S: Final = 0.25  # how often the gateway reads the server's /metrics
BULK_PRIORITY: Final = 10  # vLLM `priority` of bulk requests in the priority mode (lower first)
TTFT_BUDGET_MS: Final = 250
CHAT_TOKENS: Final = 16
BULK_EMBED_CLIENTS: Final = 64
BULK_EMBED_INPUTS: Final = 8
BULK_CHAT_CLIENTS: Final = 16
# The what-if: bulk capped statically instead of steered.
CAPPED_BULK: Final[Mapping[str, int]] = {
    "initial_concurrency": 1,
    "min_concurrency": 1,
    "max_concurrency": 1,
}
CAPPED_INFLIGHT: Final = 1


@dataclass(frozen=True, slots=True)
class ServerMode:
    """How the simulated server orders its queue and preempts, and whether the gateway marks
    bulk."""

    name: str
    policy: str  # the simulator's scheduling_policy
    bulk_priority: int | None  # the provider's bulk_priority
    preemption: str = "kv_cache"  # the simulator's priority_preemption

    def profile(self) -> dict[str, Any]:
        return {
            **SIM_PROFILE,
            "scheduling_policy": self.policy,
            "priority_preemption": self.preemption,
        }


MODES: Final = (
    ServerMode("fifo", "fcfs", None),
    # vLLM V1 as released: priority orders the queue; no preemption at a full batch.
    ServerMode("priority", "priority", BULK_PRIORITY),
    # As vLLM's open pull requests would have it: a better request preempts at a full batch.
    ServerMode("priority-preempt", "priority", BULK_PRIORITY, "max_num_seqs"),
)


def gateway_config(
    sim_port: int,
    mode: ServerMode,
    *,
    bulk: Mapping[str, int] | None = None,
    inflight: int | None = None,
) -> dict[str, Any]:
    batching = dict(BATCHING)
    if inflight is not None:
        batching["max_inflight"] = inflight
    provider, model = DEPLOYMENT.split("/")
    deployment = {"provider": provider, "model": model}
    upstream: dict[str, Any] = {
        "type": "vllm",  # its /metrics are read: the gate steers on the server's load
        "base_url": f"http://127.0.0.1:{sim_port}/v1",
        "metrics_interval_s": METRICS_INTERVAL_S,
    }
    if mode.bulk_priority is not None:
        upstream["bulk_priority"] = mode.bulk_priority
    return {
        "server": {"host": "127.0.0.1", "access_log": False, "reload_on_change": False},
        "latency": {"store": "memory"},
        "providers": {provider: upstream},
        "routing": {"bulk": {**BULK, **(bulk or {})}},
        "models": [
            {"name": EMBED_MODEL, "deployments": [deployment], "batching": batching},
            {
                "name": CHAT_MODEL,
                "deployments": [deployment],
                "budget": {"ttft_ms": TTFT_BUDGET_MS},
                "on_ttft_miss": "none",
            },
        ],
    }


@dataclass(frozen=True, slots=True)
class BulkMix:
    name: str
    embed_clients: int
    chat_clients: int


FULL_MIX: Final = BulkMix("chat", 0, BULK_CHAT_CLIENTS)  # part B's batch job: bulk chat


def embed_request(inputs: int, *, bulk: bool) -> Request:
    text = "a document to index"
    request = Request.embeddings(EMBED_MODEL, text, bulk=bulk)
    if inputs == 1:
        return request
    body = json.dumps({"model": EMBED_MODEL, "input": [f"{text} {i}" for i in range(inputs)]})
    return Request(
        request.path, body.encode(), headers=request.headers, expect="embeddings", inputs=inputs
    )


def interactive_request() -> Request:
    return Request.chat(CHAT_MODEL, stream=True, max_tokens=CHAT_TOKENS, text="Hello there")


def bulk_chat_request() -> Request:
    return Request.chat(CHAT_MODEL, stream=False, bulk=True, max_tokens=CHAT_TOKENS)


def batch_totals(port: int) -> tuple[float, float]:
    """(inputs, upstream calls) the gateway has batched for the deployment so far."""
    label = f'deployment="{DEPLOYMENT}"'
    sums = metric_samples(port, "tailguard_batch_size_sum")
    counts = metric_samples(port, "tailguard_batch_size_count")
    return (
        sum(v for k, v in sums.items() if label in k),
        sum(v for k, v in counts.items() if label in k),
    )


def bulk_loads(mix: BulkMix) -> list[dict[str, Any]]:
    loads = []
    if mix.embed_clients:
        r = embed_request(BULK_EMBED_INPUTS, bulk=True)
        loads.append(
            {
                "name": "bulk embeddings",
                "path": r.path,
                "body": r.body.decode(),
                "headers": dict(r.headers),
                "inputs": r.inputs,
                "expect": r.expect,
                "concurrency": mix.embed_clients,
            }
        )
    if mix.chat_clients:
        r = bulk_chat_request()
        loads.append(
            {
                "name": "bulk chat",
                "path": r.path,
                "body": r.body.decode(),
                "headers": dict(r.headers),
                "inputs": 1,
                "expect": r.expect,
                "concurrency": mix.chat_clients,
            }
        )
    return loads
