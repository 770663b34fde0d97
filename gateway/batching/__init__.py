"""Batching: micro-batches of bulk embeddings and completions requests, and the admission gate
that lets bulk chat traffic use a deployment's idle capacity without hurting interactive users."""

from gateway.batching.gate import BulkGate
from gateway.batching.provider import BATCHED_ENDPOINTS, BatchingProvider
from gateway.batching.queue import BatchQueue, Item

__all__ = ["BATCHED_ENDPOINTS", "BatchQueue", "BatchingProvider", "BulkGate", "Item"]
