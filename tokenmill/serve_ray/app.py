"""The Ray Serve application: one Ingress replica in front of N EngineReplica
replicas, each with its own engine, its share of the cores (Ray's num_cpus) and
as many engine threads, behind the prefix-aware router."""

from __future__ import annotations

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
    cpus = options.cpus_per_replica(total_cpus)
    threads = max(1, int(cpus))
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT,
        max_ongoing_requests=options.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": cpus,
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
