"""Request bodies read and checked: every parameter honoured, accepted as a hint, or refused.

Each endpoint has an allow-list. A parameter the simulator honours changes what it generates
(`n`, `stop`, `logprobs`, `tools`, `response_format`, `seed`, vLLM's `priority`, ...); a hint
(`temperature`, `user`, `service_tier`, ...) is accepted and has nothing to change in a
simulation; anything else is refused with a 400 naming it, code `unsupported_parameter`, and
so is a value the simulator cannot honour (audio output, a tool schema it cannot satisfy). A
request is checked completely, in a fixed order, before anything is drawn or waited for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from gateway.sim.options import (
    MAX_TOP_LOGPROBS,
    UNSUPPORTED,
    Generation,
    flag,
    is_int,
    read_chat_logprobs,
    read_response_format,
    read_stops,
    read_tool_choice,
    read_tools,
    refuse_set,
)
from gateway.sim.profile import SimProfile
from gateway.sim.tokens import text_tokens
from gateway.sim.wire import BadRequestError

__all__ = [
    "ChatRequest",
    "CompletionsRequest",
    "EmbeddingsRequest",
    "chat_prompt",
    "prompt_pieces",
    "read_chat",
    "read_completions",
    "read_embeddings",
    "read_tokenize",
]

_MAX_N: Final = 128  # OpenAI's limit
_NONE: Final[frozenset[str]] = frozenset()

# Accepted and without effect on a simulation: sampling, routing and bookkeeping hints.
_HINTS: Final = frozenset(
    {
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "top_k",
        "min_p",
        "repetition_penalty",
    }
)
_CHAT_KEYS: Final = _HINTS | {
    "model",
    "priority",  # vLLM's priority scheduling: the gateway sends it for bulk requests
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "modalities",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "reasoning_effort",
    "verbosity",
    "prediction",
}
# OpenAI parameters the simulator cannot honour: accepted only when null.
_CHAT_REFUSED: Final = frozenset(
    {"audio", "functions", "function_call", "web_search_options", "moderation"}
)
_COMPLETIONS_KEYS: Final = _HINTS | {
    "model",
    "priority",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
}
_EMBEDDINGS_KEYS: Final = frozenset(
    {"model", "input", "encoding_format", "dimensions", "user", "priority"}
)
_TOKENIZE_KEYS: Final = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "tools",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_strs",
    }
)
# The checked requests are built once per request and never changed; they are not frozen
# because a frozen dataclass takes about four times as long to build.


@dataclass(slots=True)
class ChatRequest:
    """A chat completions request, checked."""

    messages: object  # as sent: under a seed, their JSON is what the text is a function of
    prompt: str  # the rendering the tokenizer reads (`gateway.sim.tokens`)
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None
    n: int
    generation: Generation = field(default_factory=Generation)
    priority: int = 0


@dataclass(slots=True)
class CompletionsRequest:
    """A completions request, checked: one or more prompts, `per_prompt` choices each."""

    prompts: list[tuple[bytes, int]]  # (key, tokens) per prompt; the key identifies its text
    texts: list[str | list[int]]  # each prompt as sent: text, or token ids
    max_tokens: int | None
    stream: bool
    include_usage: bool
    seed: int | None
    per_prompt: int  # `n`: choices per prompt
    generation: Generation = field(default_factory=Generation)
    priority: int = 0


@dataclass(slots=True)
class EmbeddingsRequest:
    """An embeddings request, checked."""

    inputs: list[tuple[bytes, int]]  # (key, tokens) per input
    base64: bool
    dims: int
    priority: int = 0


def check_keys(
    request: dict[str, Any], allowed: frozenset[str], path: str, *, null: frozenset[str] = _NONE
) -> None:
    """Refuse the parameters the endpoint neither honours nor accepts as hints, naming them
    (those in `null` are accepted when null)."""
    unknown = [
        key
        for key in request
        if key not in allowed and (key not in null or request[key] is not None)
    ]
    if unknown:
        names = ", ".join(f"'{key}'" for key in unknown)
        raise BadRequestError(
            f"Unsupported parameter{'s' if len(unknown) > 1 else ''} {names} on {path}: the "
            f"simulator refuses what it cannot honour. It accepts: {', '.join(sorted(allowed))}.",
            unknown[0],
            code=UNSUPPORTED,
        )


def read_chat(request: dict[str, Any], profile: SimProfile) -> ChatRequest:
    refuse_set(request, _CHAT_REFUSED)
    check_keys(request, _CHAT_KEYS, "/v1/chat/completions", null=_CHAT_REFUSED)
    messages = request.get("messages")
    tools = read_tools(request.get("tools"))
    prompt = chat_prompt(messages, request.get("tools"))
    prompt_tokens = text_tokens(len(prompt))
    _check_context(profile.max_input_tokens, (prompt_tokens,), "messages")
    max_tokens = _max_tokens(request)
    stream = _stream_flag(request)
    usage = _include_usage(request)
    seed = _seed(request)
    n = _n(request)
    priority = _priority(request, profile)
    generation = Generation(tools=tools)
    read_stops(request, generation)
    read_chat_logprobs(request, generation)
    read_tool_choice(request, generation)
    assert isinstance(messages, list)  # chat_prompt checked it
    last = messages[-1]
    generation.after_tool_result = isinstance(last, dict) and last.get("role") in (
        "tool",
        "function",
    )
    read_response_format(request, generation)
    modalities = request.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise BadRequestError(
            "'modalities' other than [\"text\"] is not supported by the simulator",
            "modalities",
            code=UNSUPPORTED,
        )
    return ChatRequest(
        messages, prompt, prompt_tokens, max_tokens, stream, usage, seed, n, generation, priority
    )


def read_completions(request: dict[str, Any], profile: SimProfile) -> CompletionsRequest:
    check_keys(request, _COMPLETIONS_KEYS, "/v1/completions")
    raw = request.get("prompt")
    prompts = prompt_pieces(raw, "prompt")
    _check_context(profile.max_input_tokens, [t for _, t in prompts], "prompt")
    max_tokens = _max_tokens(request)
    stream = _stream_flag(request)
    usage = _include_usage(request)
    seed = _seed(request)
    per_prompt = _n(request)
    priority = _priority(request, profile)
    generation = Generation()
    read_stops(request, generation)
    logprobs = request.get("logprobs")
    if logprobs is not None:
        if not is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequestError(
                f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs"
            )
        generation.logprobs = logprobs
    generation.echo = flag(request, "echo")
    best_of = request.get("best_of")
    if best_of is not None and best_of != per_prompt:
        raise BadRequestError(
            "'best_of' other than n is not supported by the simulator (it returns every "
            "sequence it generates)",
            "best_of",
            code=UNSUPPORTED,
        )
    if request.get("suffix"):
        raise BadRequestError(
            "'suffix' is not supported by the simulator", "suffix", code=UNSUPPORTED
        )
    texts: list[str | list[int]]
    if isinstance(raw, str):
        texts = [raw]
    else:  # _pieces checked it: strings, token ids, or token arrays
        assert isinstance(raw, list)
        texts = [list(raw)] if all(is_int(t) for t in raw) else list(raw)
    if generation.echo and not all(isinstance(t, str) for t in texts):
        raise BadRequestError(
            "'echo' needs text prompts: the simulator cannot detokenize token ids",
            "echo",
            code=UNSUPPORTED,
        )
    return CompletionsRequest(
        prompts, texts, max_tokens, stream, usage, seed, per_prompt, generation, priority
    )


def read_embeddings(request: dict[str, Any], profile: SimProfile) -> EmbeddingsRequest:
    check_keys(request, _EMBEDDINGS_KEYS, "/v1/embeddings")
    inputs = prompt_pieces(request.get("input"), "input")
    _check_context(profile.max_input_tokens, [t for _, t in inputs], "input")
    encoding = request.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise BadRequestError("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = request.get("dimensions") or profile.embedding_dims
    if not is_int(dims) or not 1 <= dims <= 65536:
        raise BadRequestError("'dimensions' must be an integer in [1, 65536]", "dimensions")
    return EmbeddingsRequest(inputs, encoding == "base64", dims, _priority(request, profile))


def read_tokenize(request: dict[str, Any], *, strict: bool = True) -> str | list[int]:
    """The prompt of a `/tokenize` body (vLLM's: `messages` or `prompt`), as the tokenizer reads
    it. `strict`: refuse keys vLLM's endpoint does not take (the in-process count reads a whole
    chat or completions body, and ignores the rest)."""
    if strict:
        check_keys(request, _TOKENIZE_KEYS, "/tokenize")
    if request.get("messages") is not None:
        tools = request.get("tools")
        return chat_prompt(request["messages"], tools if isinstance(tools, list) else None)
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt)
    raise BadRequestError(
        "'messages' (an array of messages) or 'prompt' (a string or token ids) is required",
        "messages" if "messages" in request else "prompt",
    )


def chat_prompt(messages: object, tools: object) -> str:
    """The rendering the tokenizer reads: tool definitions, then each message's text."""
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty array of messages", "messages")
    parts: list[str] = [orjson.dumps(tools).decode()] if isinstance(tools, list) and tools else []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(text := part.get("text"), str):
                    parts.append(text)
        elif content is not None:
            raise BadRequestError("a message's 'content' must be a string or an array", "messages")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise BadRequestError(f"'messages[{i}].tool_calls' must be an array", "messages")
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise BadRequestError(
                    f"each of 'messages[{i}].tool_calls' must have a 'function' object",
                    "messages",
                )
            for key in ("name", "arguments"):
                if isinstance(value := function.get(key), str):
                    parts.append(value)
    return "".join(parts)


def prompt_pieces(value: object, param: str) -> list[tuple[bytes, int]]:
    """Prompts or embedding inputs as (key, tokens): a string, strings, token array(s).

    The key identifies the text (it hashes embedding vectors and seeded completions): a string's
    UTF-8 bytes, or a NUL byte and the JSON of a token array.
    """
    if isinstance(value, str):
        return [(value.encode(), text_tokens(len(value)))]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v.encode(), text_tokens(len(v))) for v in value]
        if all(isinstance(v, int) for v in value):
            return [(b"\x00" + orjson.dumps(value), len(value))]
        if all(isinstance(v, list) and v and all(isinstance(t, int) for t in v) for v in value):
            return [(b"\x00" + orjson.dumps(v), len(v)) for v in value]
    raise BadRequestError(
        f"'{param}' must be a string, an array of strings or an array of token arrays", param
    )


def _check_context(limit: int | None, tokens: Sequence[int], param: str) -> None:
    """Reject the whole request when any one input is longer than the profile's limit."""
    if limit is None:
        return
    for i, count in enumerate(tokens):
        if count > limit:
            where = f"{param} {i}" if len(tokens) > 1 else f"the {param}"
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens, however you requested "
                f"{count} tokens ({count} in {where}). Please reduce the length of the {param}.",
                param,
                code="context_length_exceeded",
            )


def _priority(request: dict[str, Any], profile: SimProfile) -> int:
    """vLLM's `priority` (lower is served first); non-zero needs priority scheduling."""
    priority = request.get("priority")
    if priority is None:
        return 0
    if not is_int(priority):
        raise BadRequestError("'priority' must be an integer", "priority")
    if priority and profile.scheduling_policy != "priority":
        # vLLM's words (a 400 there too).
        raise BadRequestError(
            f"Got priority {priority} but Priority scheduling is not enabled.", "priority"
        )
    return priority


def _seed(request: dict[str, Any]) -> int | None:
    seed = request.get("seed")
    if seed is None:
        return None
    if not is_int(seed):
        raise BadRequestError("'seed' must be an integer", "seed")
    return seed


def _n(request: dict[str, Any]) -> int:
    n = request.get("n")
    if n is None:
        return 1
    if not is_int(n) or not 1 <= n <= _MAX_N:
        raise BadRequestError(f"'n' must be an integer in [1, {_MAX_N}]", "n")
    return n


def _max_tokens(request: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise BadRequestError(f"'{name}' must be an integer >= 1", name)
        return value
    return None


def _include_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequestError("'stream_options' must be an object", "stream_options")
    return options.get("include_usage") is True


def _stream_flag(request: dict[str, Any]) -> bool:
    stream = request.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be a boolean", "stream")
    return stream
