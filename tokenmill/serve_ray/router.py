"""Prefix-aware routing: a Ray Serve request router that sends a request to the
replica whose prefix cache most likely holds its prompt's beginning.

The ingress passes each request's routing text (its messages or prompt, flattened:
ingress.routing_text) as the `routing_text` keyword. The router cuts that text into
blocks of BLOCK_CHARS characters and chain-hashes them (hash i stands for the first
i+1 blocks, as the engine's KV block hashes stand for token prefixes), and remembers,
per replica, the hashes of the prompts it sent there (LRU, bounded). A request goes
to the replica matching the most leading blocks; load (requests this router has in
flight on each replica, counting those chosen but not yet sent) breaks ties, and bounds the choice: a replica more than
`max_imbalance` requests above the least loaded one is not chosen for its prefix.
A request matching nothing goes to the least loaded replica, then the one holding
the fewest blocks (so new prefixes spread out).

Like Ray Serve LLM's PrefixCacheAffinityRouter this guesses the replicas' caches from
what it routed rather than asking them (a cache lookup per request per replica would
cost a round trip); unlike it, the state lives in the router itself, not in a shared
actor: exact with one ingress replica; with several, each learns the same affinity
from its own share of the traffic. PrefixIndex is the decision, kept apart from Ray
so it is tested without a cluster.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tokenmill.serve_ray import live

BLOCK_CHARS = 64  # about 16 tokens of English: one KV block at the default block size
MAX_BLOCKS_PER_REPLICA = 100_000  # remembered hashes per replica (LRU): ~6 MB of text
DEFAULT_MAX_IMBALANCE = 8  # requests in flight above the least loaded replica
POLICIES = ("prefix", "round_robin")
TENTATIVE_S = 10.0  # a choice not routed by then (cancelled, say) stops counting as load

ROUTING_TEXT = "routing_text"  # the keyword the ingress passes the routing text as
TARGET_REPLICA = "target_replica"  # keyword: a call for one replica (its stats)
HTTP_METHOD = "http"  # the replica method that serves requests (counted as load)
# Added by a replica to each answer's headers: which replica served it (the ingress
# learns /v1/responses' owners from it, and takes it off before the client sees it).
REPLICA_HEADER = b"x-tokenmill-replica"

MAX_RESPONSE_OWNERS = 100_000  # response ids remembered (LRU): ~10 MB


class ResponseOwners:
    """/v1/responses' stored responses live on the replica that created them: which
    replica that was, per response id (learned as the answers pass the ingress;
    LRU-bounded, as each replica's store is)."""

    def __init__(self, max_entries: int = MAX_RESPONSE_OWNERS) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.owners: OrderedDict[str, str] = OrderedDict()

    def learn(self, response_id: str, replica: str) -> None:
        self.owners[response_id] = replica
        self.owners.move_to_end(response_id)
        while len(self.owners) > self.max_entries:
            self.owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        replica = self.owners.get(response_id)
        if replica is not None:
            self.owners.move_to_end(response_id)
        return replica


def prefix_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained hashes of the text's whole blocks: two texts share hash i exactly
    when they share their first (i + 1) * block_chars characters (collisions aside).
    A trailing partial block is left out, as the KV cache only shares whole blocks."""
    hashes: list[int] = []
    h = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[start:start + block_chars]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """Per replica, the block hashes of the prompts routed there (LRU)."""

    def __init__(self, max_blocks_per_replica: int = MAX_BLOCKS_PER_REPLICA) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError("max_blocks_per_replica must be at least 1")
        self.max_blocks = max_blocks_per_replica
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def set_replicas(self, replicas: Sequence[str]) -> None:
        """Keep what is known of these replicas; forget the others."""
        self.blocks = {r: self.blocks.get(r, OrderedDict()) for r in replicas}

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt this replica holds."""
        held = self.blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def insert(self, replica: str, hashes: Sequence[int]) -> None:
        held = self.blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def rank(self, loads: dict[str, int], hashes: Sequence[int], max_imbalance: int) -> list[str]:
        """Replicas best first: among those within `max_imbalance` of the least
        loaded, the longest prefix match, then the lower load, then the fewest
        blocks held; the overloaded ones after them, least loaded first."""
        if not loads:
            return []
        floor = min(loads.values())
        within = [r for r in loads if loads[r] <= floor + max_imbalance]
        beyond = sorted((r for r in loads if loads[r] > floor + max_imbalance), key=loads.__getitem__)
        within.sort(key=lambda r: (-self.match(r, hashes), loads[r], len(self.blocks.get(r, ()))))
        return within + beyond


class InFlight:
    """Requests this router has in flight per replica, keyed by (internal request
    id, replica): calls made within one ingress request share the id (the /metrics
    fan-out calls each replica in turn), so the id alone could credit one call's
    completion to another replica and leave a load counted forever."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}
        self.loads: dict[str, int] = {}

    def set_replicas(self, replicas: Sequence[str]) -> None:
        self.loads = {r: self.loads.get(r, 0) for r in replicas}

    def forget(self, replica: str) -> None:
        self.loads.pop(replica, None)
        self.calls = {k: n for k, n in self.calls.items() if k[1] != replica}

    def routed(self, request_id: str, replica: str) -> None:
        self.calls[(request_id, replica)] = self.calls.get((request_id, replica), 0) + 1
        self.loads[replica] = self.loads.get(replica, 0) + 1

    def completed(self, request_id: str, replica: str) -> None:
        key = (request_id, replica)
        n = self.calls.pop(key, 0)
        if n == 0:
            return  # (not counted: not an HTTP call, or its replica was forgotten)
        if n > 1:
            self.calls[key] = n - 1
        if replica in self.loads:
            self.loads[replica] = max(0, self.loads[replica] - 1)


class PrefixAwareRouter(RequestRouter):
    """The Ray Serve side of PrefixIndex (see the module docstring).
    `policy="round_robin"` routes in turn instead (the benchmark's baseline)."""

    def initialize_state(self, **kwargs: Any) -> None:
        policy = kwargs.pop("policy", "prefix")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.block_chars = int(kwargs.pop("block_chars", BLOCK_CHARS))
        self.max_imbalance = int(kwargs.pop("max_imbalance", DEFAULT_MAX_IMBALANCE))
        self.index = PrefixIndex(int(kwargs.pop("max_blocks_per_replica", MAX_BLOCKS_PER_REPLICA)))
        if kwargs:
            raise ValueError(f"unknown request_router_kwargs: {sorted(kwargs)}")
        self.in_flight = InFlight()
        # Chosen but not yet routed (internal request id -> (replica, when)): counted
        # as load, so a burst of requests ranked before any is routed spreads out.
        self.tentative: dict[str, tuple[str, float]] = {}
        self.turn = itertools.count()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = [r.replica_id.to_full_id_str() for r in replicas]
        self.index.set_replicas(ids)
        self.in_flight.set_replicas(ids)
        live.REGISTRY.record(self._deployment_id.name, ids)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dead = replica_id.to_full_id_str()
        self.index.blocks.pop(dead, None)
        self.in_flight.forget(dead)
        live.REGISTRY.forget(self._deployment_id.name, dead)

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None:
            return []
        text = pending_request.kwargs.get(ROUTING_TEXT)
        return prefix_hashes(text, self.block_chars) if isinstance(text, str) else []

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        target = pending_request.kwargs.get(TARGET_REPLICA) if pending_request else None
        if target is not None:
            # A replica gone meanwhile: any other answers (the ingress drops that
            # answer by its replica id) rather than the call waiting for it forever.
            return [[by_id[target]]] if target in by_id else [list(by_id.values())]
        if not by_id:
            return []
        if self.policy == "round_robin":
            ids = sorted(by_id)
            start = next(self.turn) % len(ids)
            return [[by_id[r]] for r in ids[start:] + ids[:start]]
        now = time.monotonic()
        self.tentative = {k: v for k, v in self.tentative.items() if now - v[1] < TENTATIVE_S}
        counts = pending_request is not None and pending_request.metadata.call_method == HTTP_METHOD
        request_id = pending_request.metadata.internal_request_id if pending_request else ""
        loads = {r: self.in_flight.loads.get(r, 0) for r in by_id}
        for other, (replica, _) in self.tentative.items():
            if replica in loads and other != request_id:  # (chosen again: the last choice is void)
                loads[replica] += 1
        hashes = self._hashes(pending_request)
        ranked = self.index.rank(loads, hashes, self.max_imbalance)
        if counts:
            self.tentative[request_id] = (ranked[0], now)
            # Held from now on: the next request of a burst sharing it follows it.
            self.index.insert(ranked[0], hashes)
        return [[by_id[r]] for r in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        if pending_request.metadata.call_method != HTTP_METHOD:
            return
        replica = replica_id.to_full_id_str()
        self.tentative.pop(pending_request.metadata.internal_request_id, None)
        self.in_flight.routed(pending_request.metadata.internal_request_id, replica)
        hashes = self._hashes(pending_request)
        if hashes:
            self.index.insert(replica, hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.in_flight.completed(internal_request_id, replica_id.to_full_id_str())
