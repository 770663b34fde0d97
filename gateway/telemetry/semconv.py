"""Every telemetry name the gateway emits, in one place.

The OpenTelemetry GenAI semantic conventions are still being renamed between releases; when they
move, this file is the only one to change. Metric names are the Prometheus spellings of the
OpenTelemetry ones (dots become underscores, the unit is appended).
"""

from __future__ import annotations

from typing import Final

# --- GenAI span attributes (gen-ai-spans) --------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
# Of the input tokens, those read from the upstream's prompt cache and those written to it.
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: Final = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"  # only when content capture is enabled
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"

# --- general attributes --------------------------------------------------------------------------
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
ERROR_TYPE: Final = "error.type"
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
HTTP_ROUTE: Final = "http.route"
URL_PATH: Final = "url.path"

# --- the gateway's own attributes ----------------------------------------------------------------
TG_REQUEST_ID: Final = "tailguard.request.id"
TG_MODEL: Final = "tailguard.model"  # the model name the client asked for
TG_DEPLOYMENT: Final = "tailguard.deployment"
TG_ROUTE: Final = "tailguard.route"
TG_AFFINITY: Final = "tailguard.affinity"  # cache-aware routing: hit, bounded, queue, miss
TG_KEY: Final = "tailguard.key.name"  # the gateway key's configured name, never the key
TG_ATTEMPTS: Final = "tailguard.attempts"
TG_ATTEMPT_OUTCOME: Final = "tailguard.attempt.outcome"  # won, error:429, ttft_deadline, ...
TG_ATTEMPT_HEDGE: Final = "tailguard.attempt.hedge"
TG_BUDGET_TTFT_MS: Final = "tailguard.budget.ttft_ms"
TG_BUDGET_TOTAL_MS: Final = "tailguard.budget.total_ms"
TG_TTFT_MS: Final = "tailguard.ttft_ms"
TG_OVERHEAD_MS: Final = "tailguard.overhead_ms"
# The upstream's own measure of an attempt's processing (Bedrock's `metrics.latencyMs`).
TG_UPSTREAM_LATENCY_MS: Final = "tailguard.upstream.latency_ms"
# Whether the request met each budget it had (absent: it had none, or was not judged).
TG_SLO_TTFT_MET: Final = "tailguard.slo.ttft_met"
TG_SLO_TOTAL_MET: Final = "tailguard.slo.total_met"
TG_SLO_TPOT_MET: Final = "tailguard.slo.tpot_met"
# Whether its TTFT or total exceeded its deployment's current p99 (absent: no trusted p99).
TG_SLOW: Final = "tailguard.slow"

# Operation names (gen_ai.operation.name) per gateway endpoint.
OPERATIONS: Final = {
    "chat": "chat",
    "messages": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}

# --- metrics -------------------------------------------------------------------------------------
# GenAI client metrics (per upstream attempt) and the server metric (per client request).
CLIENT_OPERATION_DURATION: Final = "gen_ai_client_operation_duration_seconds"
CLIENT_TOKEN_USAGE: Final = "gen_ai_client_token_usage"
CLIENT_TIME_TO_FIRST_CHUNK: Final = "gen_ai_client_operation_time_to_first_chunk_seconds"
CLIENT_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai_client_operation_time_per_output_chunk_seconds"
SERVER_REQUEST_DURATION: Final = "gen_ai_server_request_duration_seconds"
# Label names: the attribute names with dots as underscores.
L_OPERATION: Final = "gen_ai_operation_name"
L_PROVIDER: Final = "gen_ai_provider_name"
L_REQUEST_MODEL: Final = "gen_ai_request_model"
L_TOKEN_TYPE: Final = "gen_ai_token_type"
L_ERROR_TYPE: Final = "error_type"

# Bucket advice of the GenAI conventions.
DURATION_BUCKETS: Final = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TOKEN_BUCKETS: Final = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
OVERHEAD_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip

# The gateway's own metrics.
REQUESTS: Final = "tailguard_requests"  # counter: model, deployment, route, status
ATTEMPTS: Final = "tailguard_attempts"  # counter: deployment, outcome
FALLBACKS: Final = "tailguard_fallbacks"  # counter: model, reason
FALLBACK_SERVED: Final = "tailguard_fallback_served"  # counter: model, fallback, route
HEDGES: Final = "tailguard_hedges"  # counter: model, result (started, won, denied)
COOLDOWNS: Final = "tailguard_cooldowns"  # counter: deployment (times its breaker opened)
RETRY_BUDGET_EXHAUSTED: Final = "tailguard_retry_budget_exhausted"
RATE_LIMITED: Final = "tailguard_rate_limited"  # counter: key, limit (requests | tokens)
RATE_LIMIT_STORE_ERRORS: Final = "tailguard_rate_limit_store_errors"  # counter
RATE_LIMIT_STORE_OUTAGES: Final = "tailguard_rate_limit_store_outages"  # counter: breaker opened
RATE_LIMIT_DEGRADED: Final = "tailguard_rate_limit_degraded"  # gauge: 1 while limits skip Redis
CONCURRENCY_REFUSED: Final = "tailguard_concurrency_refused"  # counter: cap (gateway | key)
REQUESTS_IN_FLIGHT: Final = "tailguard_requests_in_flight"  # gauge: LLM requests admitted
OVERHEAD: Final = "tailguard_overhead_seconds"  # histogram: model
STAGE_DURATION: Final = "tailguard_stage_duration_seconds"  # histogram: model, stage
# The stages of a request, as in its `server-timing` header (`decode`: first to last token).
STAGES: Final = ("overhead", "queue", "connect", "ttft", "decode", "total")
# From the gateway's own sub-millisecond stages to a long generation, 1-2-5 then doubling; a
# bucket of its own for zero (no wait in the queue), so that a quantile of zeros reads zero.
STAGE_BUCKETS: Final = (
    0.0, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
    1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
BATCH_SIZE: Final = "tailguard_batch_size"  # histogram: deployment, endpoint (inputs)
BATCH_WAIT: Final = "tailguard_batch_wait_seconds"  # histogram: deployment, endpoint
BATCH_QUEUE: Final = "tailguard_batch_queue_depth"  # gauge: deployment (inputs waiting)
BATCH_REJECTED: Final = "tailguard_batch_rejected"  # counter: deployment
BULK_LIMIT: Final = "tailguard_bulk_concurrency_limit"  # gauge: deployment
BULK_WAITING: Final = "tailguard_bulk_waiting"  # gauge: deployment
BULK_REJECTED: Final = "tailguard_bulk_rejected"  # counter
BATCH_SIZE_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SPANS_DROPPED: Final = "tailguard_trace_spans_dropped"  # counter: the export queue was full
TRACES: Final = "tailguard_traces"  # counter: decision (exported | dropped), reason
# Why the tail sampler kept a trace, in the order it asks (dropped: `rest`).
TRACE_KEEP_REASONS: Final = (
    "error", "cut", "hedge", "fallback", "slo_miss", "slow", "sampled_parent", "share",
)  # fmt: skip
SLO_REQUESTS: Final = "tailguard_slo_requests"  # counter: model, deployment, slo, result
WASTED_ATTEMPTS: Final = "tailguard_wasted_attempts"  # counter: model, deployment
WASTED_PROMPT_TOKENS: Final = "tailguard_wasted_prompt_tokens"  # counter: model, deployment
# Prompt tokens of committed requests as the upstream reported them (counters: model,
# deployment): all of them, and of those, the ones read from and written to its prompt cache.
INPUT_TOKENS: Final = "tailguard_input_tokens"
CACHED_INPUT_TOKENS: Final = "tailguard_cached_input_tokens"
CACHE_WRITE_INPUT_TOKENS: Final = "tailguard_cache_write_input_tokens"
EXTRA_LOAD: Final = "tailguard_extra_load_ratio"  # gauge: model (rescues / client requests)
