"""The simulated LLM upstream: an engine (`SimEngine`) and a standalone ASGI server around it."""

from __future__ import annotations

from gateway.sim.engine import SimConnectionReset, SimEngine, SimProfile, SimReply, SimStats
from gateway.sim.server import SimConfigError, create_sim_app, load_profiles, run_sim

__all__ = [
    "SimConfigError",
    "SimConnectionReset",
    "SimEngine",
    "SimProfile",
    "SimReply",
    "SimStats",
    "create_sim_app",
    "load_profiles",
    "run_sim",
]
