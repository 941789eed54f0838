"""`tokenmill serve-ray`: start (or join) a Ray cluster, deploy the app, serve
until SIGINT or SIGTERM, then take the app down."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import ray
from ray import serve

from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.serve_ray.app import RayServeOptions, build_ray_app

logger = logging.getLogger("tokenmill")
APP_NAME = "tokenmill"


def run_serve_ray(
    engine_args: EngineArgs, server_config: ServerConfig, options: RayServeOptions,
    ray_address: str | None = None,
) -> int:
    """`ray_address` None: a local cluster of this machine's cores; "auto" or an
    address: an existing cluster (`ray start --head` on one machine, `ray start
    --address ...` on the others), whose CPUs the replicas then share."""
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()

    def on_signal(sig: int, _: FrameType | None) -> None:
        logger.info("%s: taking the app down", signal.Signals(sig).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        total_cpus = float(ray.cluster_resources().get("CPU", 1.0))
        app = build_ray_app(engine_args, server_config, options, total_cpus)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving on http://%s:%d (Ray Serve, %s replicas, %g CPUs each)",
                    server_config.host, server_config.port,
                    options.scaling().get("num_replicas", "autoscaled"),
                    options.cpus_per_replica(total_cpus))
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
