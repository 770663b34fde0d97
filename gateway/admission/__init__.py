"""Admission: who may call (API keys), how much (rate limits, the gateway's concurrency), and
whether the body is one to route (its checks)."""
