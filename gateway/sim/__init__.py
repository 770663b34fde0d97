"""The simulated LLM upstream: an engine (`engine.SimEngine`) and an ASGI server around it.

Rooms: `profile` (the schema of a simulated model; a leaf the gateway's config imports), `wire`
(request parsing, replies and errors), `planner` (model resolution and every random draw),
`scheduler` (the batch slots and the engine's counters), `writer` (bodies and SSE frames),
`text` (the pseudo-text), `metrics` (vLLM's `/metrics` page), `engine` (generation) and
`server` (the ASGI app). This file imports none of them: importing the profile schema must not
load the simulator.
"""
