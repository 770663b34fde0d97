"""Whether a vLLM priority server preempts bulk for interactive requests: learned from what it does.

`bulk_priority` says the server runs `--scheduling-policy priority`, and so orders its queue by
priority; it does not say the server frees a slot for a better request. vLLM V1 preempts by
priority only when KV-cache blocks run out: when every slot (`max_num_seqs`) is taken, an
interactive request waits at the head of the queue until a bulk sequence ends
(vllm-project/vllm issue #40004; pull requests #45558, #45561 and #54530 would change that).
The gate starts trusting the server to preempt, and watches:

- A *strike*: an interactive first token came late (the gate's own test of lateness), or a
  scrape shows requests waiting while an interactive one has waited for its first token longer
  than an unloaded server takes and the preemption counter has not risen since the scrape
  before; in both cases with bulk in flight on the deployment and the latest scrape showing
  every learned slot running with the KV cache below `kv_full`: the server had the room to
  preempt for it and did not. `DISTRUST_AFTER` strikes and the gate stops trusting it: bulk
  then leaves `reserve_slots` free, as on a first-come-first-served server, and the gate
  preempts its own bulk work for interactive requests that would wait for a slot.
- Trust comes back when `vllm:num_preemptions_total` rises between two scrapes while interactive
  requests are in flight and the KV cache is not full: the server preempted for them (a vLLM
  that preempts at `max_num_seqs`), not for KV room.
"""

from __future__ import annotations

from dataclasses import dataclass

DISTRUST_AFTER = 2  # strikes before the gate stops trusting the server to preempt


@dataclass(slots=True)
class ServerKind:
    """What the gate believes of one priority server: does it preempt bulk at a full batch?"""

    preempts: bool = True
    strikes: int = 0
    counter: float | None = None  # vllm:num_preemptions_total at the last scrape read

    def scraped(self, preemptions: float | None, *, interactive: bool, kv_free: bool) -> bool:
        """A new scrape: a rise of the preemption counter with interactive requests in flight
        and KV room to spare means the server preempted for them. True when it rose."""
        before, self.counter = self.counter, preemptions
        if before is None or preemptions is None or preemptions <= before:
            return False
        if interactive and kv_free:
            self.preempts, self.strikes = True, 0
        return True

    def late(self, *, bulk_in_flight: bool, slots_full: bool, kv_free: bool) -> bool:
        """An interactive first token came late; True when that made the gate stop trusting
        the server (the strike that reached `DISTRUST_AFTER`)."""
        if not (self.preempts and bulk_in_flight and slots_full and kv_free):
            return False
        self.strikes += 1
        if self.strikes < DISTRUST_AFTER:
            return False
        self.preempts, self.strikes = False, 0
        return True
