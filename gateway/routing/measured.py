"""What vLLM servers measured of themselves, attached to the candidates served by them.

A nominal TPOT prior is a figure an operator wrote down once; a server decoding under load, or
speculating (several tokens per step when its drafts are accepted), runs at its own pace. The
pace it reports (`ServerState.recent_tpot_s`) goes on the candidate, where total-budget planning
prefers it to the prior, after the window's own trusted p99.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from gateway.latency.vllm import ServerState
from gateway.routing.plan import Candidate


def with_measured_tpot(
    found: Sequence[Candidate], servers: Mapping[str, ServerState]
) -> list[Candidate]:
    """`found`, each vLLM candidate whose server measured its TPOT carrying that figure."""
    out = []
    for candidate in found:
        server = servers.get(candidate.deployment.provider)
        tpot_s = server.recent_tpot_s() if server is not None else None
        out.append(candidate if tpot_s is None else replace(candidate, measured_tpot_s=tpot_s))
    return out
