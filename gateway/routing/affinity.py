"""Cache-aware routing: a prompt goes to the vLLM server that recently served its prefix.

vLLM keeps the KV of what it prefilled (automatic prefix caching: 16-token blocks keyed by a
hash chain), so a server that saw a conversation's earlier turns prefills only the new ones. The
gateway keeps its own account of which server was sent which prompt prefix: a chain of hashes
cut at message boundaries (the tools and system prompt first, as they lead the prompt; a
completion's prompt in fixed blocks), remembered per server in a bounded table (least recently
used forgotten first, and anything older than a TTL). The longest prefix a server holds is what
it would not prefill again.

Among a model's vLLM servers whose load is read, the lead is then the one with the lowest
predicted TTFT less the prefill its cached prefix saves: the prefix's size times the prefill
time per byte read off the deployment's TTFT-vs-prompt-size line, times the share of predicted
hits the server's own prefix-cache counters confirm. A server holding the prefix is preferred
only while its load (this gateway's requests in flight to it plus the queue its metrics show)
stays within `load_bound` times the mean, plus `load_slack` (consistent hashing with bounded
loads), so one hot prefix cannot pin it: past the bound it gets no credit and is tried after
the others.

Nothing here awaits or parses: the chain hashes strings the body already holds (Python's
own hash, randomised per process, so no client can aim collisions at the table), at most
`max_prefix_bytes` of them.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol

import orjson

from gateway.config import AffinitySpec
from gateway.latency import TargetStats
from gateway.latency.prompt_size import fit_line
from gateway.latency.vllm import ServerLoad
from gateway.models import Call
from gateway.routing.plan import Candidate, Plan

Outcome = Literal["hit", "bounded", "queue", "miss"]
"""hit: the lead holds the longest prefix of the prompt any server holds; bounded: a server
holding a longer one than the lead was over the load bound; queue: one holds a longer one, but
the lead's shorter queue outweighs the prefill it saves; miss: none holds any prefix of it."""
OUTCOMES: Final[tuple[Outcome, ...]] = ("hit", "bounded", "queue", "miss")

MAX_LEVELS: Final = 256  # message boundaries hashed per prompt
TEXT_BLOCK: Final = 4096  # a prompt sent as one string is cut every this many characters
TOKEN_BLOCK: Final = 1024  # ... and one sent as token ids every this many ids
MAX_HOLDERS: Final = 4  # servers remembered per prefix (a hot one spreads past the bound)
CALIBRATION_WEIGHT: Final = 0.3  # of each new scrape interval in the confirmed hit share
MIN_EXPECTED: Final = 0.05  # predicted hit share below which an interval confirms nothing


@dataclass(frozen=True, slots=True)
class Chain:
    """A prompt's prefixes: `hashes[i]` covers its pieces up to i, `sizes[i]` their characters
    (level 0 is the tools and system prompt when there are any, else the first piece)."""

    hashes: tuple[int, ...]
    sizes: tuple[int, ...]


class _Builder:
    __slots__ = ("hashes", "left", "running", "size", "sizes")

    def __init__(self, seed: str, max_bytes: int) -> None:
        self.running = hash(seed)
        self.left = max_bytes
        self.size = 0
        self.hashes: list[int] = []
        self.sizes: list[int] = []

    def full(self) -> bool:
        return self.left <= 0 or len(self.hashes) >= MAX_LEVELS

    def text(self, label: str, text: str, *, level: bool = True) -> bool:
        """Fold a text into the chain (a level ends after it unless `level` is False); False
        once a cap is reached. The string's own hash: no copy, no encoding."""
        if self.full():
            return False
        if len(text) > self.left:
            text = text[: self.left]
        return self._fold((label, text), len(text), level)

    def json(self, value: Any, *, level: bool = True) -> bool:
        """Fold anything else as its JSON: a content array, tool calls, tool definitions."""
        if self.full():
            return False
        data = orjson.dumps(value)
        if len(data) > self.left:
            data = data[: self.left]
        return self._fold(data, len(data), level)

    def tokens(self, ids: tuple[int, ...]) -> bool:
        if self.full():
            return False
        return self._fold(ids, len(ids) * 4, True)  # ~4 bytes of text a token

    def _fold(self, piece: object, size: int, level: bool) -> bool:
        self.running = hash((self.running, piece))
        self.size += size
        self.left -= size
        if level:
            self.end()
        return True

    def end(self) -> None:
        if self.size and (not self.sizes or self.sizes[-1] != self.size):
            self.hashes.append(self.running)
            self.sizes.append(self.size)

    def blocks(self, prompt: str) -> None:
        for start in range(0, len(prompt), TEXT_BLOCK):
            if not self.text("", prompt[start : start + TEXT_BLOCK]):
                return

    def chain(self) -> Chain | None:
        return Chain(tuple(self.hashes), tuple(self.sizes)) if self.hashes else None


def prefix_chain(call: Call, max_bytes: int) -> Chain | None:
    """The chain of `call`'s prompt (None: nothing to match, e.g. embeddings or a batch)."""
    try:
        return _chain(call, max_bytes)
    except (TypeError, ValueError):  # an odd body (orjson refuses it): no affinity, no error
        return None


def _chain(call: Call, max_bytes: int) -> Chain | None:
    body, endpoint = call.body, call.endpoint
    build = _Builder(endpoint, max_bytes)
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            build.blocks(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            for start in range(0, len(prompt), TOKEN_BLOCK):
                if not build.tokens(tuple(prompt[start : start + TOKEN_BLOCK])):
                    break
        return build.chain()
    if endpoint == "embeddings":
        return None
    # The head, which leads the rendered prompt: tools, then the system prompt.
    for name in ("tools", "instructions", "system"):
        value = body.get(name)
        if isinstance(value, str) and value:
            build.text(name, value, level=False)
        elif value:
            build.json(value, level=False)
    items = body.get("input" if endpoint == "responses" else "messages")
    if isinstance(items, str):
        build.end()
        build.blocks(items)
        return build.chain()
    if not isinstance(items, list):
        return build.chain()
    index = 0
    while index < len(items) and _is_system(items[index]):
        _message(build, items[index], level=False)
        index += 1
    build.end()
    for item in items[index:]:
        if not _message(build, item):
            break
    return build.chain()


def _is_system(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") in ("system", "developer")


def _message(build: _Builder, item: Any, *, level: bool = True) -> bool:
    """A message's role and text when that is all it holds (the common case costs no
    serialisation), else all of it as JSON."""
    if isinstance(item, dict) and len(item) == 2:
        role, content = item.get("role"), item.get("content")
        if isinstance(role, str) and isinstance(content, str):
            return build.text(role, content, level=level)
    return build.json(item, level=level)


@dataclass(slots=True)
class _Entry:
    seen: float
    holders: tuple[str, ...]  # most recent first


class PrefixTable:
    """Which servers were sent which prompt prefixes: at most `max_entries` prefixes (least
    recently used forgotten first), each with at most `MAX_HOLDERS` servers, none older than
    `ttl_s`. Memory is bounded whatever clients send."""

    __slots__ = ("_entries", "max_entries", "ttl_s")

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[int, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, chain: Chain, wanted: Collection[str], now: float) -> dict[str, int]:
        """Per server of `wanted` holding a prefix of `chain`: the characters of its longest.
        Walks from the longest prefix down to the first one held, then looks at the head
        (a shared system prompt) too."""
        entries, hashes, sizes = self._entries, chain.hashes, chain.sizes
        found: dict[str, int] = {}
        level = len(hashes) - 1
        while level >= 0:
            entry = entries.get(hashes[level])
            if entry is not None and now - entry.seen <= self.ttl_s:
                for holder in entry.holders:
                    if holder in wanted and holder not in found:
                        found[holder] = sizes[level]
                if found:
                    level = 0 if level > 0 else -1
                    continue
            level -= 1
        return found

    def remember(self, chain: Chain, holder: str, now: float) -> None:
        """`holder` was sent the prompt of `chain`: it now holds its head and all of it."""
        entries = self._entries
        last = len(chain.hashes) - 1
        for level in (0, last) if last > 0 else (0,):
            key = chain.hashes[level]
            entry = entries.get(key)
            if entry is None:
                entries[key] = _Entry(now, (holder,))
            else:
                entry.seen = now
                if entry.holders[0] != holder:
                    others = [h for h in entry.holders if h != holder]
                    entry.holders = (holder, *others[: MAX_HOLDERS - 1])
                entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        # Forget a few expired prefixes at the old end, so a quiet table shrinks too.
        for _ in range(2):
            oldest = next(iter(entries.values()), None)
            if oldest is None or now - oldest.seen <= self.ttl_s:
                break
            entries.popitem(last=False)


class Server(Protocol):
    """What steering reads of a vLLM server (`gateway.latency.vllm.ServerState`)."""

    def current(self) -> ServerLoad | None: ...
    def prefix_hit_rate(self) -> float | None: ...


@dataclass(slots=True)
class _Calibration:
    """How far a server's measured prefix-cache hits bear out what this gateway predicted."""

    share: float = 1.0  # confirmed share of the predicted hits
    sent: float = 0.0  # prompt bytes sent since the scrape `of`
    predicted: float = 0.0  # of which predicted to hit
    of: ServerLoad | None = None

    def update(self, server: Server) -> float:
        load = server.current()
        if load is None or load is self.of:
            return self.share
        rate = server.prefix_hit_rate()
        expected = self.predicted / self.sent if self.sent else 0.0
        if rate is not None and expected >= MIN_EXPECTED:
            confirmed = min(1.0, rate / expected)
            self.share += CALIBRATION_WEIGHT * (confirmed - self.share)
        self.of, self.sent, self.predicted = load, 0.0, 0.0
        return self.share


@dataclass(slots=True)
class Steering:
    """One call's affinity: the candidates in the order it left them, and what it knew. Its
    `settle` remembers where the call went and says why (a Plan's `affinity`)."""

    found: list[Candidate]
    affinity: Affinity | None = None
    chain: Chain | None = None
    members: Collection[str] = ()  # the servers steered between
    held: Mapping[str, int] = field(default_factory=dict)  # server -> characters it holds
    over: frozenset[str] = frozenset()  # holders beyond the load bound
    model: str = ""
    now: float = 0.0
    prompt_bytes: int = 0

    def settle(self, chosen: Plan) -> Plan:
        affinity = self.affinity
        if affinity is None or self.chain is None or not chosen.candidates:
            return chosen
        lead = chosen.candidates[0].id
        held = self.held
        mine = held.get(lead, 0)
        outcome: Outcome
        if not held:
            outcome = "miss"
        elif mine == max(held.values()):
            outcome = "hit"  # it holds the longest prefix any server holds
        elif any(held[d] > mine for d in self.over):
            outcome = "bounded"  # one holding more was over the load bound
        else:
            outcome = "queue"
        if lead in self.members:
            affinity.table.remember(self.chain, lead, self.now)
            calibration = affinity.calibration(lead)
            calibration.sent += self.prompt_bytes
            calibration.predicted += self.held.get(lead, 0)
        key = (self.model, outcome)
        affinity.counts[key] = affinity.counts.get(key, 0) + 1
        return replace(chosen, affinity=outcome)


class Affinity:
    """The prefix table and its counters, for one gateway process (kept across reloads while
    `routing.affinity` is unchanged)."""

    def __init__(self, spec: AffinitySpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.table = PrefixTable(spec.max_entries, spec.ttl_s)
        self.counts: dict[tuple[str, str], int] = {}  # (model, outcome) -> decisions
        self._calibrations: dict[str, _Calibration] = {}
        self._slopes: dict[str, tuple[TargetStats, float | None]] = {}
        self._clock = clock

    def calibration(self, deployment: str) -> _Calibration:
        found = self._calibrations.get(deployment)
        if found is None:
            found = self._calibrations[deployment] = _Calibration()
        return found

    def steer(
        self,
        found: list[Candidate],
        call: Call,
        servers: Mapping[str, Server],
        inflight: Callable[[str], int],
    ) -> Steering:
        """Put the server that should serve `call` first among the leading model's vLLM
        deployments (see the module's docstring); the rest keep their order."""
        if not self.spec.enabled or not servers or len(found) < 2:
            return Steering(found)
        model = found[0].model
        run: list[tuple[str, Candidate]] = []  # the leading model's candidates, with their ids
        group: list[tuple[str, Candidate]] = []  # ... of which vLLM servers with a known load
        loads: dict[str, float] = {}
        for candidate in found:
            if candidate.model != model:
                break
            cid = candidate.id
            run.append((cid, candidate))
            server = servers.get(candidate.deployment.provider)
            load = server.current() if server is not None else None
            if load is not None:
                group.append((cid, candidate))
                loads[cid] = inflight(cid) + load.waiting
        if len(group) < 2:
            return Steering(found)
        chain = prefix_chain(call, self.spec.max_prefix_bytes)
        if chain is None:
            return Steering(found)
        now = self._clock()
        held = self.table.lookup(chain, loads, now)
        steering = Steering(
            found, self, chain, loads.keys(), held, model=model, now=now, prompt_bytes=len(call.raw)
        )
        if not held:
            return steering
        # Consistent hashing with bounded loads: a server takes one more while it stays within
        # the bound of the mean, counting this request.
        spec = self.spec
        cap = spec.load_bound * (sum(loads.values()) + 1) / len(loads) + spec.load_slack
        over = steering.over = frozenset(d for d in held if loads[d] + 1 > cap)
        best = self._best(group, held, over, servers, loads, chain.sizes[0])
        lead = [] if best is None else [best]
        lead += [c for cid, c in run if c is not best and cid not in over]
        lead += [c for cid, c in run if cid in over]
        steering.found = lead + found[len(run) :]
        return steering

    def _best(
        self,
        group: Sequence[tuple[str, Candidate]],
        held: Mapping[str, int],
        over: Collection[str],
        servers: Mapping[str, Server],
        loads: Mapping[str, float],
        head: int,
    ) -> Candidate | None:
        """The fastest of `group` once each holder within the bound is credited the prefill
        its prefix saves; None when no holder is within the bound. Without the figures to weigh
        (no prediction, no prompt-size line yet) the holder with the longest prefix wins, the
        least loaded of those holding as much. `head`: the characters of the prompt's head."""
        within = [(cid, c) for cid, c in group if cid in held and cid not in over]
        if not within:
            return None
        longest = min(within, key=lambda pair: (-held[pair[0]], loads[pair[0]]))[1]
        if max(held.values()) <= head:
            # Only the head is held (a shared system prompt): the conversation is new to every
            # server, so it starts where the load is least and the servers' shares stay even
            # (the head is soon held by all). Predictions learned from what each server
            # happened to hold, or the head alone, would pin every new one to the same server.
            return min(group, key=lambda pair: loads[pair[0]])[1]
        if any(c.predicted_ttft_s is None for _, c in group):
            return longest
        best, best_score = None, math.inf
        credited = {cid for cid, _ in within}
        for cid, candidate in group:
            score = candidate.predicted_ttft_s
            assert score is not None
            if cid in credited:
                slope = self._slope(cid, candidate.stats)
                if slope is None:
                    return longest
                server = servers[candidate.deployment.provider]
                share = self.calibration(cid).update(server)
                score -= slope * held[cid] * share
            if score < best_score:
                best, best_score = candidate, score
        return best

    def _slope(self, deployment: str, stats: TargetStats | None) -> float | None:
        """Prefill seconds per prompt byte: the slope of the deployment's median TTFT against
        the uncached prompt size, through its trusted prompt bands (once per snapshot)."""
        if stats is None:
            return None
        cached = self._slopes.get(deployment)
        if cached is not None and cached[0] is stats:
            return cached[1]
        points = [
            (band.mean_bytes, band.ttft.p50)
            for band in stats.bands.values()
            if band.ttft.trusted and band.ttft.p50 is not None and not math.isinf(band.ttft.p50)
        ]
        line = fit_line(points)
        slope = line[1] / 1000.0 if line is not None else None
        self._slopes[deployment] = (stats, slope)
        return slope
