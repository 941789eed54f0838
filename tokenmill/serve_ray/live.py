"""Which replicas of a deployment are alive, as the routers of this process see
them: the router records them (Ray tells it), the ingress reads them to address
each replica by id (its stats, its /metrics, a stored response's owner).

Ray builds the router inside the handle it routes for, so the ingress holds no
reference to it; this registry is the one object both reach, by importing this
module (a module travels by reference where Ray ships a class by value)."""

from __future__ import annotations

import threading


class LiveReplicas:
    """Deployment name -> its live replicas' full ids (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_deployment: dict[str, list[str]] = {}

    def get(self, deployment: str) -> list[str]:
        with self._lock:
            return list(self._by_deployment.get(deployment, []))

    def record(self, deployment: str, replicas: list[str]) -> None:
        with self._lock:
            self._by_deployment[deployment] = sorted(replicas)

    def forget(self, deployment: str, replica: str) -> None:
        with self._lock:
            live = self._by_deployment.get(deployment)
            if live is not None and replica in live:
                live.remove(replica)


REGISTRY = LiveReplicas()
