"""The attempt the race committed to, as the edge relays it.

`Committed` does every per-event job of a committed answer: the tally (tokens, usage, finish
reasons, TPOT), the total budget when it cuts (`on_total_miss: cut`), the stream idle timeout,
the translation into the client's wire, the cut event when the stream fails, the answer handed
to whoever keeps it (the Responses store), and the attempt's sample once it ends. The edge writes
the bytes it is given and says when the client left; it never reads a chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from gateway.errors import (
    GatewayError,
    ProviderError,
    ProviderTimeoutError,
    StreamInterruptedError,
    stream_error,
)
from gateway.latency import CANCELLED, TOTAL_DEADLINE
from gateway.routing.deadline import ran_out, stream_deadline
from gateway.routing.idle import IdleWatch
from gateway.routing.ledger import Ledger, Opened
from gateway.routing.plan import Budget

log = logging.getLogger("tailguard")

Keeper = Callable[[dict[str, Any]], bool]
"""Keeps a finished Responses answer (for `previous_response_id` and GET); False when it was to
be kept and was not."""


class Committed:
    """The committed attempt of one request: `body()` for a whole answer, `events()` for a
    stream. Its sample is recorded once the answer is done; `client_left` when it never is."""

    __slots__ = ("_budget", "_keeper", "_ledger", "failure", "opened", "stored")

    def __init__(
        self, opened: Opened, ledger: Ledger, budget: Budget, keeper: Keeper | None = None
    ) -> None:
        self.opened = opened
        self._ledger = ledger
        self._budget = budget
        self._keeper = keeper
        self.failure: GatewayError | None = None  # what cut the stream, once it is cut
        self.stored = True  # False: a Responses answer to be stored was not

    def body(self) -> bytes:
        """The whole answer (not streamed), kept first; its sample is recorded."""
        self._keep()
        self._ledger.ended()
        return b"".join(self.opened.head)

    async def events(self) -> AsyncGenerator[tuple[bytes, bool]]:
        """The stream in the client's wire, one block per network read: (bytes, more). The last
        block has `more` False: empty when the stream completed, the wire's error event when it
        was cut (`failure` says why). The sample is recorded once the last block is taken."""
        opened = self.opened
        tally, stream = opened.tally, opened.stream
        translate = opened.prepared.stream.feed
        deadline = stream_deadline(self._budget)
        failure: GatewayError | None = None
        finished, body, pending = opened.ended, b"".join(opened.head), opened.pending
        idle_s = opened.candidate.provider.limits.idle_s
        idle = IdleWatch(idle_s)  # no content for idle_s (keep-alives or not): the stream ends
        try:
            while True:
                out = [body] if body else []
                now = time.perf_counter()  # one clock read per network read, not per event
                tokens = tally.tokens
                for chunk in pending:
                    if chunk.error is not None:
                        failure = StreamInterruptedError(
                            f"{opened.candidate.id}: upstream error after the stream began: "
                            f"{chunk.error.message[:300]}"
                        )
                        break
                    tally.add(chunk, now)
                    out.append(translate(chunk))
                    if chunk.done:
                        finished = True
                        break
                if tally.tokens != tokens:
                    idle.progressed()
                if finished:
                    self._keep()  # before the last event: the next turn may follow at once
                data = b"".join(out)
                if data:
                    yield data, True
                if failure is not None or finished:
                    break
                body = b""
                try:
                    idle.reading()
                    if deadline is None:  # no budget to cut at: no timer on the per-read path
                        batch = await stream.read()
                    else:
                        async with asyncio.timeout_at(deadline):
                            batch = await stream.read()
                    idle.read()
                except asyncio.CancelledError:
                    if not idle.expired():
                        raise
                    failure = _went_idle(opened.candidate.id, idle_s)
                    break
                except TimeoutError:
                    failure = ran_out(self._budget, opened.candidate.id)
                    break
                if batch is None:
                    failure = StreamInterruptedError(
                        f"{opened.candidate.id}: the upstream ended the stream before it was "
                        "complete"
                    )
                    break
                pending = batch
        except ProviderError as error:
            failure = StreamInterruptedError(error.message)
        finally:
            idle.close()
        self.failure = failure
        if failure is None:
            yield b"", False
        else:
            tally.finish_reasons.append("error")
            yield self.cut(failure), False
        # Cut by its own total budget, a stream is slow, not broken: its total is censored and
        # what it observed (TTFT, the pace of its tokens) still counts.
        cut = isinstance(failure, ProviderTimeoutError) and failure.kind == TOTAL_DEADLINE
        why = TOTAL_DEADLINE if cut else failure.code if failure is not None else None
        self._ledger.ended(ok=failure is None, error=why, cut=cut)

    def cut(self, error: GatewayError) -> bytes:
        """The last bytes of a stream cut after it began, in the client's wire: the Responses
        API ends with its own `error` and `response.failed` events."""
        fail = self.opened.prepared.fail
        if fail is not None:
            return fail(error.code or error.type, error.message)
        return stream_error(error, self._ledger.call.wire)

    def client_left(self) -> None:
        """The client went away mid-stream: what the stream showed so far still counts."""
        self._ledger.ended(ok=False, error=CANCELLED, cut=True)

    def _keep(self) -> None:
        result = self.opened.prepared.result
        if self._keeper is not None and result is not None and result.response is not None:
            self.stored = self._keeper(result.response)


def _went_idle(deployment: str, idle_s: float) -> ProviderTimeoutError:
    return ProviderTimeoutError(  # its message names the deployment
        f"no content from the upstream for {round(idle_s * 1000)} ms (the stream idle timeout)",
        deployment=deployment,
        kind="stream_idle",
    )
