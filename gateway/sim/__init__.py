"""The simulated LLM upstream: an engine (`engine.SimEngine`) and an ASGI server around it.

Rooms: `profile` (the schema of a simulated model; a leaf the gateway's config imports), `wire`
(bodies parsed, replies and errors), `request` and `options` (each endpoint's parameters:
honoured, accepted as hints, or refused), `planner` (model resolution and every random draw),
`output` (what a choice generates: reasoning, text, JSON, tool calls, log probabilities),
`schema`, `values` and `pattern` (values drawn from a JSON schema), `tokens` (the tokenizer),
`prefix` (the prefix cache), `scheduler` (the batch slots, by arrival or by priority, and the
engine's counters), `timeline` (where simulated time passes), `decode` (sequences run step by
step: preemption, speculation), `speculative` (speculative decoding's arithmetic), `writer`
(bodies and SSE frames), `text` (the pseudo-text), `metrics` (vLLM's `/metrics` page), `engine`
(the endpoints) and `server` (the ASGI app). This file imports none of them: importing the
profile schema must not load the simulator.
"""
