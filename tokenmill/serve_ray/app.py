"""The Ray Serve application: one Ingress replica in front of N EngineReplica
replicas, each with its own engine, its share of the cores (Ray's num_cpus) and
as many engine threads, behind the prefix-aware router.

With tensor_parallel_size T > 1 each replica asks Ray Serve for a placement group
of T bundles (its share of the cores split over them); the replica runs in bundle
0 as rank 0 and starts ranks 1..T-1 as Ray actors in the others
(distributed_executor_backend="ray", distributed/launch.py's RayRanks)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application

from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.serve_ray.ingress import DEFAULT_MAX_ATTEMPTS, Ingress
from tokenmill.serve_ray.replica import EngineReplica
from tokenmill.serve_ray.router import DEFAULT_MAX_IMBALANCE, POLICIES

ENGINE_DEPLOYMENT = "TokenmillEngine"
INGRESS_DEPLOYMENT = "TokenmillIngress"
# Requests a replica takes at once; beyond, Ray Serve queues them in the router,
# where they can still go to another replica. The engine's own queue is behind it.
DEFAULT_MAX_ONGOING_REQUESTS = 256
ROUTER_CLASS = "tokenmill.serve_ray.router:PrefixAwareRouter"  # (imported where handles are)
# Ray's placement strategies for a replica's TP ranks: PACK (one node if it fits),
# STRICT_PACK (one node or nothing), SPREAD, STRICT_SPREAD (one rank per node).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayServeOptions:
    """How many replicas and how each runs (the `tokenmill serve-ray` flags)."""

    num_replicas: int = 1
    # Ray Serve's autoscaling (used when max_replicas is set): replicas between
    # min and max, aiming at `target_ongoing_requests` in flight per replica.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    num_cpus_per_replica: float | None = None  # None: the cores / the (max) replicas
    router: str = "prefix"
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    graceful_shutdown_timeout_s: float = 30.0  # running requests' time to finish on a scale-down
    # Where a replica's tensor-parallel ranks go (its placement group's strategy).
    placement_group_strategy: str = "PACK"
    extra_router_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.router not in POLICIES:
            raise ValueError(f"router must be one of {POLICIES}, got {self.router!r}")
        if self.max_replicas is not None:
            low = self.min_replicas if self.min_replicas is not None else 1
            if not 0 <= low <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                                 f"got {low} and {self.max_replicas}")
            if self.target_ongoing_requests <= 0:
                raise ValueError("target_ongoing_requests must be > 0")
        if self.num_cpus_per_replica is not None and self.num_cpus_per_replica <= 0:
            raise ValueError("num_cpus_per_replica must be > 0")
        if self.max_ongoing_requests < 1 or self.max_attempts < 1:
            raise ValueError("max_ongoing_requests and max_attempts must be at least 1")
        if self.placement_group_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_group_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_group_strategy!r}")

    def cpus_per_replica(self, total_cpus: float | None = None) -> float:
        if self.num_cpus_per_replica is not None:
            return self.num_cpus_per_replica
        total = total_cpus if total_cpus is not None else float(os.cpu_count() or 1)
        most = self.max_replicas if self.max_replicas is not None else self.num_replicas
        return max(1.0, float(int(total // most)))

    def scaling(self) -> dict[str, Any]:
        if self.max_replicas is None:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": {
            "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
        }}


def build_ray_app(
    engine_args: EngineArgs, server_config: ServerConfig, options: RayServeOptions,
    total_cpus: float | None = None,
) -> Application:
    """The application `serve.run` deploys. `total_cpus`: the cluster's CPUs that
    the replicas share (default: this machine's)."""
    engine_args.create_engine_configs()  # bad options fail here, not in every replica
    engine_args, placement = tensor_parallel_placement(engine_args, options)
    tp = engine_args.tensor_parallel_size
    # The replica's share of the cores, split evenly over its ranks (one bundle each).
    cpus = options.cpus_per_replica(total_cpus) / tp
    threads = max(1, int(cpus))
    if placement:
        placement["placement_group_bundles"] = [{"CPU": cpus} for _ in range(tp)]
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        max_ongoing_requests=options.max_ongoing_requests,
        **placement,
        ray_actor_options={
            "num_cpus": cpus,  # (rank 0's: the first bundle's)
            # OpenMP sizes its pool from this before torch can be told (replica.py sets both).
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        request_router_config={
            "request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"policy": options.router,
                                      "max_imbalance": options.max_imbalance,
                                      **options.extra_router_kwargs},
        },
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        **options.scaling(),
    )(EngineReplica).bind(engine_args, server_config, threads)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        # The proxy's requests: many streams at once, each mostly waiting.
        max_ongoing_requests=max(1000, 4 * options.max_ongoing_requests),
        ray_actor_options={"num_cpus": 0},
    )(Ingress).bind(engine, server_config.max_request_body_bytes, server_config.api_key, options.max_attempts)
    return ingress


def tensor_parallel_placement(
    engine_args: EngineArgs, options: RayServeOptions,
) -> tuple[EngineArgs, dict[str, Any]]:
    """The replicas' engine args and the deployment's placement options: with TP > 1,
    ranks as Ray actors in a placement group per replica (its bundles: filled in by
    the caller, from the cores)."""
    parallel = engine_args.create_parallel_config()
    if parallel.tensor_parallel_size == 1:
        return engine_args, {}
    if parallel.nnodes != 1 or parallel.node_rank != 0 or parallel.master_port is not None:
        raise ValueError("serve-ray places a replica's tensor-parallel ranks through a Ray placement "
                         "group (--placement-group-strategy); --nnodes, --node-rank and --master-port "
                         "are for `tokenmill serve` and `tokenmill worker`")
    engine_args = dataclasses.replace(engine_args, distributed_executor_backend="ray")
    return engine_args, {"placement_group_strategy": options.placement_group_strategy}
