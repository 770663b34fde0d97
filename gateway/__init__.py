"""Tailguard: a latency-aware LLM API gateway."""

__version__ = "0.1.0"
