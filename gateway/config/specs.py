"""The configuration's schema: one frozen pydantic model per section of the YAML file.

Each field's docstring is its description in the generated configuration reference. Validation
that spans sections (references between models, providers and keys) is in `settings`.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from gateway.config.cloud_azure import azure_keys_set, check_azure
from gateway.config.cloud_bedrock import check_bedrock, refuse_bedrock_keys
from gateway.config.cloud_google import check_google
from gateway.sim.profile import SimProfile

DEFAULT_CONFIG_PATH = "config/gateway.yaml"
CONFIG_PATH_ENV = "TAILGUARD_CONFIG"
LOG_LEVEL_ENV = "TAILGUARD_LOG_LEVEL"  # how `serve --workers N` passes --log-level on
ACCESS_LOG_ENV = "TAILGUARD_ACCESS_LOG_FILE"  # ... and --access-log
HUMAN_LOG_ENV = "TAILGUARD_HUMAN_LOG"  # ... and whether its stdout is a terminal ("1")

ProviderType = Literal[
    "openai", "vllm", "anthropic", "azure", "bedrock", "gemini", "vertex", "simulated"
]
Priority = Literal["interactive", "bulk"]
OnTTFTMiss = Literal["failover", "hedge", "none"]
OnTotalMiss = Literal["finish", "cut"]
AnswerModel = Literal["upstream", "requested"]
UnsupportedTools = Literal["drop", "refuse"]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
# A model name as clients send it, or a glob pattern of such names (`*`, `?`, `[...]`).
_ALIAS = r"^[A-Za-z0-9*?\[][A-Za-z0-9_.:/@\-*?\[\]!]{0,255}$"


class ConfigError(Exception):
    """The configuration cannot be used; the message is safe to print (it holds no secret)."""


class _Spec(BaseModel):
    # Attribute docstrings are the field descriptions the configuration reference is built from.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ServerSpec(_Spec):
    """The HTTP server, and its limits against abusive clients."""

    host: str = "127.0.0.1"
    """Interface to bind. Without API keys, only a loopback address unless
    `allow_unauthenticated`."""
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    """Port to bind."""
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    """Worker processes."""
    max_body_bytes: Annotated[int, Field(gt=0)] = 10 * 1024 * 1024
    """Larger request bodies get a 413, refused from `content-length` or while counting."""
    max_count_values: Annotated[int, Field(gt=0)] = 100_000
    """A token-counting request (`/v1/messages/count_tokens`, `/v1/responses/input_tokens`)
    may hold at most this many JSON values, counted as its commas and colons before it is
    parsed (an upper bound: punctuation inside strings counts too); more gets a 413."""
    access_log: bool = True
    """One JSON line per LLM request: on stdout, or appended to the file `serve --access-log`
    names. On a terminal, `serve` shows a short line per request instead."""
    shutdown_grace_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    """How long streams may run on after SIGTERM."""
    reload_on_change: bool = True
    """Reload when the config file changes (SIGHUP always reloads)."""
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024 * 1024)] = 64 * 1024
    """Larger request headers get a 431 and a closed connection."""
    read_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A request's headers must arrive within this of its first byte (or of the connection),
    then its body within this of its headers; else 408."""
    keepalive_timeout_s: Annotated[
        float,
        Field(
            gt=0,
            le=3600,
            description="How long an idle keep-alive connection stays open, counted from the "
            "end of its last response (bytes that begin no request do not extend it).",
        ),
    ] = 5.0
    readiness_detail: Literal["admin", "public", "none"] = Field(
        "admin",
        description="Who sees /readyz's detail (providers, models, stores, config): `admin` "
        "(an admin key, when keys are configured), `public` (anyone) or `none`. The status "
        "itself is always open.",
    )
    max_concurrent: Annotated[int, Field(gt=0)] | None = 1000
    """LLM requests in flight per worker; beyond, a 503 (null: no cap)."""
    allow_unauthenticated: bool = False
    """Without auth keys, listen beyond loopback anyway (something in front authenticates)."""


class LatencySpec(_Spec):
    """The rolling latency statistics routing reads, and where they are shared."""

    store: Literal["memory", "redis"] = "memory"
    """`memory` (one process) or `redis` (shared by replicas)."""
    redis_url: SecretStr | None = None
    """Required for `store: redis`: `redis://`, `rediss://`, `unix://`, `redis+sentinel://` or
    `redis+cluster://`."""
    window_s: Annotated[int, Field(ge=5, le=3600)] = 60
    """The rolling window the percentiles cover (s)."""
    slice_s: Annotated[int, Field(ge=1, le=600)] = 5
    """The window is cut into slices of this length (s)."""
    min_samples: Annotated[int, Field(ge=1)] = 20
    """Below this a deployment's percentiles are not trusted."""

    @model_validator(mode="after")
    def _redis_needs_url(self) -> LatencySpec:
        if self.store == "redis" and not self.redis_url:
            raise ValueError("store is 'redis' but redis_url is not set")
        if self.slice_s > self.window_s:
            raise ValueError("slice_s must not exceed window_s")
        return self


class ProviderSpec(_Spec):
    """An upstream endpoint plus its credentials and limits."""

    type: ProviderType
    """`openai`, `vllm`, `anthropic`, `azure` (Azure OpenAI), `bedrock` (AWS Bedrock's Converse
    API), `gemini` (the Gemini API), `vertex` (Vertex AI) or `simulated` (in-process)."""
    base_url: str | None = None
    """OpenAI-compatible: include `/v1`; Anthropic: without; Azure: the resource's root,
    `https://<resource>.openai.azure.com`. Absent for `simulated`; optional for `bedrock`
    (default: `https://bedrock-runtime.{region}.amazonaws.com`), `gemini` and `vertex` (their
    Google endpoints)."""
    api_key: SecretStr | None = None
    """The upstream's credential (use `${VAR}`); Azure sends it as `api-key`; for `bedrock`, a
    Bedrock API key (sent as a bearer token instead of a SigV4 signature)."""
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="Extra headers sent upstream (values are secrets)."
    )
    connect_timeout_ms: Annotated[int, Field(gt=0)] = 5_000
    """Time allowed to connect to the upstream."""
    read_timeout_ms: Annotated[int, Field(gt=0)] = 600_000
    """Silence this long between two reads fails the attempt."""
    stream_idle_timeout_ms: Annotated[
        int,
        Field(
            gt=0,
            le=3_600_000,
            description="A streamed response that makes no content progress for this long "
            "is given up on, whatever else it sends (keep-alives, a trickle of bytes): before "
            "the first content token the attempt fails (failover, else 504), after it the "
            "stream ends with an error event. Counted from the attempt's start, then from "
            "each content token.",
        ),
    ] = 60_000
    max_precommit_events: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            description="Events (comments, keep-alives, empty or role-only chunks) an upstream "
            "may send before its first content token; one more fails the attempt.",
        ),
    ] = 1_000
    max_precommit_bytes: Annotated[
        int,
        Field(
            ge=1024,
            le=1024 * 1024 * 1024,
            description="Bytes of events an upstream may send before its first content token "
            "(the gateway holds them until it commits); more fail the attempt.",
        ),
    ] = 1024 * 1024
    max_connections: Annotated[int, Field(ge=1)] = 1_000
    """Connections to the upstream, at most."""
    max_keepalive_connections: Annotated[int, Field(ge=0)] = 100
    """Idle connections kept open for reuse."""
    responses: Literal["translate", "native"] = "translate"
    """How `/v1/responses` reaches this upstream: `translate` (to chat completions, or to Messages
    for anthropic) or `native` (openai and azure only: forwarded to its own `/responses`). The
    gateway keeps the conversation state either way."""
    anthropic_version: str = "2023-06-01"
    """`anthropic-version` header (anthropic only)."""
    bulk_priority: int | None = None
    """vllm only: the server runs `--scheduling-policy priority`; bulk requests are sent with
    this `priority` (vLLM serves lower values first; interactive ones keep the default 0). vLLM
    then serves a waiting interactive request before waiting bulk, but (V1, as released) it
    preempts a running sequence by priority only when KV-cache blocks run out: when every slot
    (`--max-num-seqs`) is taken by bulk, an interactive request waits until a bulk sequence ends
    (vllm-project/vllm issue #40004; pull requests #45558, #45561 and #54530 would preempt there
    too). The bulk gate relies on the server to preempt only while it sees it do so: after
    interactive first tokens came late behind bulk with every slot running and KV room free, it
    keeps slots free of bulk and preempts bulk itself, as without `bulk_priority`, until the
    server's `vllm:num_preemptions_total` rises for interactive requests
    (`tailguard_bulk_server_preempts`)."""
    metrics_url: str | None = None
    """vllm only: where its Prometheus metrics are read (default: `/metrics` beside `/v1`)."""
    metrics_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """vllm only: how often its metrics are read (s)."""
    profiles: dict[str, SimProfile] = Field(default_factory=dict)
    """simulated only: the simulated models by name (see the simulator profile fields)."""
    default_profile: SimProfile | None = None
    """simulated only: the profile of a model not named in `profiles`."""
    seed: int | None = None
    """simulated only: makes runs reproducible."""
    # azure only
    api_version: str | None = None
    """azure only: `v1` (the `/openai/v1/` paths, the deployment named in the body) or a dated
    version such as `2024-10-21` (`/openai/deployments/{deployment}/...?api-version=`). A
    deployment's `model` is the Azure deployment's name."""
    azure_ad_token: SecretStr | None = None
    """azure only: an Entra ID access token sent as `Authorization: Bearer` (use `${VAR}`),
    instead of `api_key`."""
    azure_ad_token_file: str | None = None
    """azure only: a file holding an Entra ID access token, read again whenever it changes
    (a token rotated on disk is used from the next request on), instead of `api_key`."""
    content_filter_failover: bool = False
    """azure only: a request refused by Azure's content filter (400, code `content_filter`) is
    tried on the model's other deployments instead of being answered with that refusal."""
    # bedrock only
    region: str | None = None
    """bedrock only (required): the AWS region, e.g. `us-east-1`; part of the endpoint and of
    the SigV4 signature. A deployment's `model` is the Bedrock model or inference profile id."""
    aws_profile: str | None = None
    """bedrock only: the shared config/credentials profile to sign with (default: the standard
    AWS credential chain: environment, `AWS_PROFILE`, web identity, container or instance
    metadata). Not with `api_key`."""
    performance_latency: Literal["standard", "optimized"] | None = None
    """bedrock only: `performanceConfig.latency` of every request: `optimized` asks for
    Bedrock's latency-optimized inference (on the models and regions that have it)."""
    # Google (gemini, vertex) only
    project: str | None = None
    """vertex only: the Google Cloud project id."""
    location: str | None = None
    """vertex only: the region (`us-central1`, `europe-west4`, ...) or `global`."""
    credentials_file: str | None = None
    """vertex only: a service-account JSON key file; absent, Application Default Credentials
    (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's login, the metadata server)."""
    publisher: Literal["google", "anthropic"] = "google"
    """vertex only: `google` (Gemini models, through the chat wire) or `anthropic` (Claude
    models, through the Messages wire)."""

    @model_validator(mode="after")
    def _check_kind(self) -> ProviderSpec:
        if self.bulk_priority is not None and self.type != "vllm":
            raise ValueError("bulk_priority is for providers of type vllm")
        if self.responses == "native" and self.type not in ("openai", "azure"):
            raise ValueError("responses: native is for providers of type openai or azure")
        if self.type == "azure" or azure_keys_set(self):
            check_azure(self)
        if self.metrics_url is not None and self.type != "vllm":
            raise ValueError("metrics_url is for providers of type vllm")
        check_google(self)
        if self.type == "bedrock":
            check_bedrock(self)
            return self
        refuse_bedrock_keys(self)
        if self.type == "simulated":
            if self.base_url is not None:
                raise ValueError("a simulated provider runs in-process and takes no base_url")
            return self
        if self.profiles or self.default_profile is not None or self.seed is not None:
            raise ValueError("profiles, default_profile and seed apply to simulated providers only")
        if self.base_url is None:
            if self.type in ("gemini", "vertex"):
                return self  # the cloud's own endpoint
            raise ValueError(f"base_url is required for a provider of type {self.type!r}")

        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL with a host")
        if parts.query or parts.fragment:
            raise ValueError("base_url must not carry a query or fragment")
        return self


class PriorSpec(_Spec):
    """What to assume about a deployment until its own statistics are trusted."""

    ttft_ms: Annotated[float, Field(gt=0)] | None = None
    """Expected p99 time to first token (ms)."""
    tpot_ms: Annotated[float, Field(gt=0)] | None = None
    """Expected p99 time per output token (ms)."""


class DeploymentSpec(_Spec):
    """One upstream model behind a model name; its id is `<provider>/<model>`."""

    provider: Annotated[str, Field(pattern=_NAME)]
    """A name under `providers`."""
    model: Annotated[str, Field(min_length=1)]
    """The model name sent upstream."""
    weight: Annotated[float, Field(gt=0)] = 1.0
    """Share of first picks among the model's deployments."""
    prior: PriorSpec | None = None
    """Expected p99s, used until the window trusts its own."""

    @property
    def id(self) -> str:
        return f"{self.provider}/{self.model}"


class BudgetSpec(_Spec):
    """How long a request may take, from its arrival (request headers override it)."""

    ttft_ms: Annotated[int, Field(gt=0)] | None = None
    """Time to the first content token (streams)."""
    total_ms: Annotated[int, Field(gt=0)] | None = None
    """Time to the complete answer."""

    @model_validator(mode="after")
    def _ordered(self) -> BudgetSpec:
        if self.ttft_ms is not None and self.total_ms is not None and self.ttft_ms > self.total_ms:
            raise ValueError("ttft_ms exceeds total_ms")
        return self


class BatchingSpec(_Spec):
    """Micro-batching of bulk embeddings and completions."""

    max_batch_size: Annotated[int, Field(ge=1, le=4096)] = 64
    """A batch leaves as soon as it holds this many inputs."""
    max_wait_ms: Annotated[int, Field(ge=0, le=60_000)] = 20
    """... or when its oldest request has waited this long."""
    max_inflight: Annotated[int, Field(ge=1, le=1024)] = 4
    """Batches per queue running at once."""
    max_queue: Annotated[int, Field(ge=1)] = 4096
    """Inputs waiting; beyond, a 503 with `retry-after`."""


class ModelSpec(_Spec):
    """A model name clients send, and how its requests are routed."""

    name: Annotated[str, Field(pattern=_NAME)]
    """What clients send as `model`."""
    aliases: tuple[Annotated[str, Field(pattern=_ALIAS)], ...] = ()
    """Other names clients may send for it: exact names, or glob patterns (`claude-*`,
    `gpt-5*`; `*` any characters, `?` one, `[...]` one of a set), as agents send names that
    change with every release. A configured model name always wins; otherwise the first model,
    in config order, with a matching alias serves the request. Metrics count it under this
    model's name; the access log and spans keep the name asked for."""
    answer_model: AnswerModel = "upstream"
    """The `model` field of the answer: `upstream` (what the upstream answered with, or the
    deployment's model when translated) or `requested` (the name the client sent, an alias
    included)."""
    deployments: Annotated[tuple[DeploymentSpec, ...], Field(min_length=1)]
    """Where it is served, in a weighted random order."""
    budget: BudgetSpec = BudgetSpec()
    """First-token and total budgets."""
    fallbacks: tuple[str, ...] = ()
    """Other model names, tried in order after this model's deployments."""
    on_ttft_miss: OnTTFTMiss = "failover"
    """What a missed first-token deadline does: `failover`, `hedge` or `none`."""
    hedge_max_fraction: Annotated[float, Field(ge=0, le=1)] = 0.05
    """Cap on latency rescues (hedges and deadline failovers together), as a share of the
    model's client requests over the window; over it, a slow attempt is waited for."""
    on_total_miss: OnTotalMiss = "finish"
    """What a committed stream still running when the total budget ends does: `finish` (it is
    delivered whole and counted as a miss, as a plain proxy would deliver it) or `cut` (it
    ends with an error event). Before the first token, the total budget always bounds the wait."""
    max_fallback_share: Annotated[float, Field(ge=0, le=1)] | None = None
    """Cap on the share of the model's requests routed to its fallback models for latency
    while one of its own deployments is available (not cooling down), counted in-process over
    its latest requests; over it, its own fastest deployment leads (fallbacks still rescue).
    Unset: no cap. Failovers after errors are not counted."""
    priority: Priority = "interactive"
    """`interactive` or `bulk` (the `x-tailguard-priority` header wins)."""
    batching: BatchingSpec | None = None
    """Micro-batch its bulk embeddings and completions."""
    unsupported_tools: UnsupportedTools = "drop"
    """What a Responses request's tools that a translated deployment cannot run (hosted tools:
    `web_search`, `file_search`, `local_shell`, `mcp`, ...; custom tools held to a grammar) do
    there: `drop` (the request goes on without them, and the answer's
    `x-tailguard-dropped-tools` header and the access log name them) or `refuse` (a 400 naming
    the tool; a fallback that would drop them is skipped). Native Responses deployments run
    them all."""

    @model_validator(mode="after")
    def _unique_deployments(self) -> ModelSpec:
        ids = [d.id for d in self.deployments]
        if len(set(ids)) != len(ids):
            raise ValueError("deployments repeat the same provider/model")
        if self.name in self.fallbacks:
            raise ValueError("a model cannot be its own fallback")
        if self.name in self.aliases:
            raise ValueError("a model's name cannot also be its alias")
        if len(set(self.aliases)) != len(self.aliases):
            raise ValueError("aliases repeat the same name")
        return self


class CooldownSpec(_Spec):
    """The per-deployment circuit breaker."""

    failures: Annotated[int, Field(ge=1)] = 3
    """Consecutive failures that open it."""
    base_s: Annotated[float, Field(gt=0)] = 5.0
    """First cooldown; doubles each time it reopens."""
    max_s: Annotated[float, Field(gt=0)] = 60.0
    """Cap, also on an upstream's `retry-after`."""
    probe_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """The longest a deployment waits for its next probe after failures: the doubling stops
    here, so a recovered deployment is back within this many seconds. (Only a `retry-after`
    keeps it out longer, up to `max_s`; with nowhere else to go, requests probe at once.)"""

    @model_validator(mode="after")
    def _ordered(self) -> CooldownSpec:
        if self.base_s > self.max_s:
            raise ValueError("base_s exceeds max_s")
        return self


class RetryBudgetSpec(_Spec):
    """Failovers in flight are capped at `percent` of active requests, but never below
    `min_concurrent` (Envoy's retry budget)."""

    percent: Annotated[float, Field(ge=0, le=100)] = 20.0
    """Failovers after errors in flight, as a percentage of the active requests."""
    min_concurrent: Annotated[int, Field(ge=0)] = 3
    """... but never fewer than this."""


class BulkSpec(_Spec):
    """Admission of bulk traffic per deployment (see gateway/batching/gate.py and docs/bulk.md).

    The limit is in slot-equivalents: one upstream sequence (a bulk chat of `n` choices weighs
    `n`; a micro-batch weighs what it asks of the server, see `embedding_inputs_per_slot`)."""

    initial_concurrency: Annotated[int, Field(ge=1)] = 4
    """Bulk slot-equivalents allowed at once per deployment, at start."""
    min_concurrency: Annotated[int, Field(ge=1)] = 1
    """The steered limit never falls below this (a vLLM server full of interactive requests
    still holds bulk back below it)."""
    max_concurrency: Annotated[int, Field(ge=1)] = 64
    """The limit never grows beyond this, nor beyond a vLLM server's learned batch slots."""
    backoff_at: Annotated[float, Field(gt=0, le=1)] = 0.8
    """An interactive first token later than this share of its budget halves the limit."""
    grow_below: Annotated[float, Field(gt=0, le=1)] = 0.5
    """While interactive first tokens stay under this share, the limit grows by one."""
    cooldown_s: Annotated[float, Field(ge=0)] = 0.5
    """At most one halving per this long (s)."""
    max_queue: Annotated[int, Field(ge=0)] = 4096
    """Bulk requests waiting; beyond, a 503."""
    backoff_over_unloaded: Annotated[float, Field(gt=1, le=100)] = 1.5
    """vLLM with known load: an interactive first token slower than this multiple of the
    unloaded TTFT (the fastest of the last minute) halves the limit, whatever the budget."""
    grow_under_unloaded: Annotated[float, Field(gt=1, le=100)] = 1.25
    """vLLM with known load: the limit grows only while first tokens stay under this multiple
    of the unloaded TTFT (and under `grow_below` of their budget)."""
    reserve_slots: Annotated[int, Field(ge=0, le=1024)] = 1
    """vLLM without `bulk_priority` (a first-come-first-served queue), or with it on a server
    seen not to preempt bulk for interactive requests: batch slots kept free of bulk for
    interactive arrivals, beyond those interactive requests in flight hold. Never the server's
    last slot."""
    kv_full: Annotated[float, Field(gt=0, le=1)] = 0.95
    """vLLM: KV-cache usage at or above this counts as a full server, like a non-empty queue."""
    embedding_inputs_per_slot: Annotated[int, Field(ge=1)] = 1
    """Embeddings inputs one slot-equivalent carries: a micro-batch of N inputs weighs N / this
    (at least 1). vLLM schedules each input of a list as a sequence of its own: 1. A server that
    embeds a whole call on one slot (the simulator) weighs a batch as one: its batch size."""
    preempt: bool = True
    """vLLM without `bulk_priority`, or with it on a server seen not to preempt bulk for
    interactive requests: an interactive request that would queue at the server (no slot left
    by the gateway's count, or a queue in the last scrape) preempts the youngest
    bulk work in flight there that has sent nothing yet; it runs again first when bulk is
    admitted again."""
    max_preemptions: Annotated[int, Field(ge=0, le=100)] = 3
    """How often one bulk request (or micro-batch) may be preempted; then it runs to its end."""

    @model_validator(mode="after")
    def _ordered(self) -> BulkSpec:
        if not self.min_concurrency <= self.initial_concurrency <= self.max_concurrency:
            raise ValueError("need min_concurrency <= initial_concurrency <= max_concurrency")
        if self.grow_below > self.backoff_at:
            raise ValueError("grow_below exceeds backoff_at")
        if self.grow_under_unloaded > self.backoff_over_unloaded:
            raise ValueError("grow_under_unloaded exceeds backoff_over_unloaded")
        return self


class AffinitySpec(_Spec):
    """Cache-aware routing between the vLLM servers of one model (see docs/vllm.md): a request
    prefers the server that recently served the same prompt prefix, while that server's load
    stays within `load_bound` of the mean."""

    enabled: bool = True
    """On for every model with more than one vLLM deployment whose load is read."""
    load_bound: Annotated[float, Field(ge=1, le=10)] = 1.5
    """A server takes a request for its cached prefix only while its load (this gateway's
    requests in flight to it plus its queue as its metrics say) stays within this many times
    the mean over the model's servers, plus `load_slack`; beyond, the queue decides."""
    load_slack: Annotated[float, Field(ge=0, le=1000)] = 2.0
    """Requests a server may take beyond `load_bound` times the mean, so that a quiet model's
    conversations (one or two in flight) are not spread for nothing."""
    max_entries: Annotated[int, Field(ge=16, le=10_000_000)] = 65_536
    """Prompt prefixes remembered (least recently used forgotten first); ~0.3 KB each."""
    ttl_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    """A prefix not seen for this long is forgotten (the server has likely evicted it)."""
    max_prefix_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    """Leading prompt text hashed per request; longer prompts are matched on this much."""


class RoutingSpec(_Spec):
    """The routing guards."""

    cooldown: CooldownSpec = CooldownSpec()
    """The circuit breaker per deployment."""
    retry_budget: RetryBudgetSpec = RetryBudgetSpec()
    """Failovers after errors in flight vs active requests."""
    bulk: BulkSpec = BulkSpec()
    """Admission of bulk chat per deployment."""
    affinity: AffinitySpec = AffinitySpec()
    """Cache-aware routing between a model's vLLM servers."""


_SHA256 = r"^[0-9a-f]{64}$"
_KEY_NAME = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$"


class KeySpec(_Spec):
    """A client key: only its SHA-256 is configured (`tailguard keys new` makes one)."""

    name: Annotated[str, Field(pattern=_KEY_NAME)]
    """Named in the access log, spans and metrics (never the key itself)."""
    sha256: Annotated[str, Field(pattern=_SHA256)]
    """The key's SHA-256, in lowercase hex."""
    models: tuple[str, ...] | None = None
    """The models it may use (absent: every model)."""
    rpm: Annotated[int, Field(gt=0)] | None = None
    """Requests per minute."""
    tpm: Annotated[int, Field(gt=0)] | None = None
    """Tokens per minute (prompt + output)."""
    max_concurrent: Annotated[int, Field(gt=0)] | None = None
    """Requests in flight, per worker; beyond, a 503."""
    max_n: Annotated[int, Field(gt=0)] | None = None
    """Cap on `n` (and completions' `best_of`)."""
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    """Cap on every output-length field; written into a request without one."""


class AdminKeySpec(_Spec):
    """A key for `/admin/*`, `/dashboard` and `/readyz`'s detail; it cannot call models."""

    name: Annotated[str, Field(pattern=_KEY_NAME)]
    """Named in logs (never the key itself)."""
    sha256: Annotated[str, Field(pattern=_SHA256)]
    """The key's SHA-256, in lowercase hex."""


class RateLimitSpec(_Spec):
    """Where the per-key rpm/tpm counters live, and what happens when that store fails."""

    store: Literal["auto", "memory", "redis"] = "auto"
    """`auto`: Redis when `latency.store` is; `memory`: per replica; `redis`."""
    redis_url: SecretStr | None = None
    """Default: `latency.redis_url`."""
    timeout_ms: Annotated[int, Field(gt=0, le=5000)] = 50
    """The one round trip's cap, counted in Redis's time: while this process's event loop is too
    busy to read the answer, the wait is extended (up to 10x, at most 1 s more)."""
    on_store_error: Literal["open", "closed"] = "open"
    """When the store fails: `open`, each replica enforces the limits on its own meanwhile;
    `closed`, refuse with 503."""
    default_output_tokens: Annotated[
        int,
        Field(
            gt=0,
            le=1_000_000,
            description="Output tokens charged at admission to a request that sets no "
            "max_tokens, on a key without a max_tokens cap, while its model has no observed "
            "outputs (then their mean is charged). The charge is settled with the real usage.",
        ),
    ] = 1024


class ResponsesSpec(_Spec):
    """The Responses API's stored responses (`GET /v1/responses/{id}`, `previous_response_id`),
    kept by the gateway so that a conversation can move between providers."""

    store: Literal["auto", "memory", "redis", "off"] = "auto"
    """`auto`: Redis when `latency.store` is (or `redis_url` is set here), else memory;
    `memory`: per replica; `redis`: shared by replicas, with a memory tier in front; `off`:
    nothing is stored."""
    redis_url: SecretStr | None = None
    """Default: `latency.redis_url`."""
    ttl_s: Annotated[int, Field(ge=60, le=366 * 86_400)] = 30 * 86_400
    """How long a response is kept after its creation (s)."""
    max_entries: Annotated[int, Field(ge=1)] = 10_000
    """Responses held in this process's memory; beyond, the least recently used go (with
    Redis they are still read from there)."""
    max_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024 * 1024
    """Bytes of responses held in this process's memory; beyond, the least recently used go."""
    max_bytes_per_response: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    """A response with its conversation larger than this is not stored: the answer carries
    `x-tailguard-stored: false` (non-streaming), and a read of its id names this limit."""
    redis_timeout_ms: Annotated[int, Field(gt=0, le=10_000)] = 250
    """A read from Redis waits this long at most; then the request gets a 503."""

    @model_validator(mode="after")
    def _ordered(self) -> ResponsesSpec:
        if self.max_bytes_per_response > self.max_bytes:
            raise ValueError("max_bytes_per_response exceeds max_bytes")
        return self


class AuthSpec(_Spec):
    """Gateway keys. Absent or empty: no keys, and then loopback only."""

    keys: tuple[KeySpec, ...] = ()
    """Client keys, for `/v1/*`."""
    admin_keys: tuple[AdminKeySpec, ...] = ()
    """Admin keys."""
    rate_limits: RateLimitSpec = RateLimitSpec()
    """Where the keys' rpm/tpm buckets live."""

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys)

    @model_validator(mode="after")
    def _unique(self) -> AuthSpec:
        names: set[str] = set()
        hashes: set[str] = set()
        every: list[KeySpec | AdminKeySpec] = [*self.keys, *self.admin_keys]
        for key in every:
            if key.name in names:
                raise ValueError(f"auth: the key name {key.name!r} is used twice")
            if key.sha256 in hashes:
                raise ValueError(f"auth: the key {key.name!r} has the same hash as another key")
            names.add(key.name)
            hashes.add(key.sha256)
        return self
