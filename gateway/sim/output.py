"""What one choice generates: reasoning tokens, then an answer in text, JSON or tool calls.

Drawn once, before any time passes, from the request's RNG (the engine's, or the choice's own
under a request `seed`), so a choice's output is a function of the seed and the request. The
timeline then paces its tokens: reasoning first, then the answer's, one decode step each.

- Text is the pseudo-text (`gateway.sim.text`) of the drawn natural length. A stop sequence ends
  it where it first occurs (`finish_reason: stop`, the sequence itself left out unless
  `include_stop_str_in_output`); the tokens after the cut are generated but not shown.
- JSON content (`response_format`) is a value drawn from the schema, four characters a token.
- Tool calls: a name token, then the arguments' JSON (drawn from the function's `parameters`)
  four characters a token; `finish_reason: tool_calls`.
- `max_tokens` caps reasoning and answer together (`finish_reason: length`): JSON or arguments
  cut there are incomplete, as a real model's are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Final

import orjson

from gateway.sim import schema
from gateway.sim.options import Generation, Tool
from gateway.sim.text import TOKENS
from gateway.sim.tokens import pieces

__all__ = ["Output", "TokenLogprob", "ToolCall", "compose", "prompt_logprobs"]

_WORDS: Final = len(TOKENS)


@dataclass(slots=True)
class ToolCall:
    """One call: its id, the function's name, and the arguments one token each."""

    id: str
    name: str
    fragments: list[str]

    @property
    def arguments(self) -> str:
        return "".join(self.fragments)


@dataclass(slots=True)
class TokenLogprob:
    """One shown token's log probability, and the likeliest tokens in its place (it first)."""

    token: str
    logprob: float | None  # None: the first prompt token of an echo
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Output:
    """A choice's tokens, as generated and as shown."""

    reasoning: list[str]
    content: list[str] | None  # per content token; "" for a token a stop sequence hid
    tool_calls: list[ToolCall]
    tokens: int  # completion tokens, reasoning included
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # per shown content token, when asked for
    echo: str = ""  # completions: the prompt, shown before the answer
    echo_logprobs: list[TokenLogprob] = field(default_factory=list)

    def text(self) -> str | None:
        return None if self.content is None else "".join(self.content)


def compose(
    generation: Generation,
    rng: random.Random,
    *,
    reasoning_tokens: int | tuple[int, int],
    natural: int,
    offset: int,
    max_tokens: int | None,
    tool_call_rate: float,
    most_calls: int,
) -> Output:
    """Draw one choice: `natural` tokens of text from word `offset` unless JSON or tool calls
    are asked for. Raises `schema.SchemaError` for a schema that fails only on this draw."""
    left = max_tokens
    reasoning: list[str] = []
    wanted = (
        rng.randint(*reasoning_tokens)
        if isinstance(reasoning_tokens, tuple)
        else (reasoning_tokens)
    )
    if wanted:
        start = rng.randrange(_WORDS)
        take = wanted if left is None else min(wanted, left)
        reasoning = [TOKENS[(start + i) % _WORDS] for i in range(take)]
        if left is not None:
            left -= take
            if left <= 0:
                return Output(reasoning, None, [], take, "length")
    tools = _tools(generation, rng, tool_call_rate, most_calls)
    if tools:
        return _tool_calls(tools, rng, reasoning, left)
    if generation.json_schema is not None:
        answer = pieces(orjson.dumps(schema.generate(generation.json_schema, rng)).decode())
        floor = 0
    else:
        length = natural
        if generation.min_tokens:
            length = max(length, generation.min_tokens - len(reasoning))
        if generation.ignore_eos and left is not None:
            length = left
        answer = [TOKENS[(offset + i) % _WORDS] for i in range(length)]
        floor = max(0, generation.min_tokens - len(reasoning))
    finish = "stop"
    if left is not None and len(answer) > left:
        answer, finish = answer[:left], "length"
    if generation.stop:
        cut = _cut(answer, generation.stop, include=generation.include_stop, floor=floor)
        if cut is not None:
            answer, finish = cut, "stop"
    output = Output(reasoning, answer, [], len(reasoning) + len(answer), finish)
    if generation.logprobs is not None:
        output.logprobs = [_logprob(p, generation.logprobs, rng) for p in answer if p]
    return output


def prompt_logprobs(prompt: str, top: int, rng: random.Random) -> list[TokenLogprob]:
    """An echoed prompt's tokens with log probabilities (none for the first, as OpenAI's)."""
    entries = [_logprob(p, top, rng) for p in pieces(prompt) if p]
    if entries:
        entries[0] = TokenLogprob(entries[0].token, None, [])
    return entries


def _tools(generation: Generation, rng: random.Random, rate: float, most: int) -> list[Tool]:
    """The tools this choice calls, in order (none: it answers in text)."""
    tools = generation.tools
    if not tools or generation.tool_choice == "none":
        return []
    if generation.forced is not None:
        return [next(t for t in tools if t.name == generation.forced)]
    if generation.tool_choice == "auto":
        if generation.after_tool_result:  # answer the tool's result: an agent loop ends
            return []
        if rate <= 0 or (rate < 1 and rng.random() >= rate):
            return []
    count = rng.randint(1, most) if generation.parallel and most > 1 else 1
    return [tools[0] if len(tools) == 1 else rng.choice(tools) for _ in range(count)]


def _tool_calls(
    tools: list[Tool], rng: random.Random, reasoning: list[str], left: int | None
) -> Output:
    calls: list[ToolCall] = []
    used = 0
    finish = "tool_calls"
    for tool in tools:
        if left is not None and used >= left:
            finish = "length"
            break
        call_id = f"call_{rng.getrandbits(96):024x}"
        fragments = pieces(orjson.dumps(schema.generate(tool.parameters, rng)).decode())
        used += 1  # the name
        if left is not None and len(fragments) > left - used:
            fragments, finish = fragments[: left - used], "length"
        used += len(fragments)
        calls.append(ToolCall(call_id, tool.name, fragments))
        if finish == "length":
            break
    return Output(reasoning, None, calls, len(reasoning) + used, finish)


def _cut(
    answer: list[str], stops: tuple[str, ...], *, include: bool, floor: int
) -> list[str] | None:
    """The answer ended by its first stop sequence (None: none occurs). Tokens after the one
    that completes it are not generated; those between the cut and it stay, hidden (empty)."""
    text = "".join(answer)
    start = sum(len(p) for p in answer[:floor])  # min_tokens: no stop before it
    found = [(at, stop) for stop in stops if (at := text.find(stop, start)) >= 0]
    if not found:
        return None
    at, stop = min(found, key=lambda pair: (pair[0], -len(pair[1])))
    shown = at + len(stop) if include else at
    complete = at + len(stop)
    out: list[str] = []
    position = 0
    for piece in answer:
        if position >= complete:
            break
        out.append(piece[: max(0, shown - position)])
        position += len(piece)
    return out


def _logprob(token: str, top: int, rng: random.Random) -> TokenLogprob:
    logprob = -round(rng.expovariate(8.0) + 0.0001, 4)
    alternatives: list[tuple[str, float]] = []
    if top:
        alternatives.append((token, logprob))
        below = logprob
        for index in rng.sample(range(_WORDS), min(top, _WORDS)):
            if len(alternatives) == top:
                break
            if TOKENS[index] == token:
                continue
            below = round(below - rng.expovariate(1.0) - 0.01, 4)
            alternatives.append((TOKENS[index], below))
    return TokenLogprob(token, logprob, alternatives)
