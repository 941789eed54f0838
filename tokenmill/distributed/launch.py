"""Starting rank processes on this machine, and watching them.

A rank is `python -m tokenmill.distributed.worker --rank R ...` (worker.py),
started by rank 0 for the ranks of node 0 and by `tokenmill worker` on every
other node; each gets its share of this machine's cores (OMP_NUM_THREADS and
torch's thread count), the environment otherwise inherited (the OpenMP wait
policy `tokenmill serve` set included).

With distributed_executor_backend="ray" (RayRanks), ranks 1..N-1 run in Ray
actors instead, one in each other bundle of rank 0's placement group, each the
same worker process as a child of its actor; rank 0 watches them through Ray.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tokenmill import envs


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def thread_share(ranks_on_this_node: int) -> int:
    """Each rank's threads: this machine's cores split evenly (at least one)."""
    return max(1, available_cpus() // ranks_on_this_node)


def spawn_rank(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
               threads: int, die_with_parent: bool = False) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill.distributed.worker", "--rank", str(rank),
           "--world-size", str(world_size), "--local-rank", str(local_rank),
           "--master-addr", master_addr, "--master-port", str(master_port),
           "--threads", str(threads)]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                            preexec_fn=_die_with_parent() if die_with_parent else None)


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: a function for the child (between fork and exec) that has it killed
    when its parent dies (PR_SET_PDEATHSIG), so a rank never outlives the Ray actor
    that holds its place. Resolved here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


class RankProcesses:
    """The rank processes this process started; `gone()` says which one has exited."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        self.procs = procs  # rank -> process

    # (RankProcesses and RayRanks: rank 0's launchers, TensorParallel's ranks.)
    def master_addr(self, configured: str) -> str:
        return configured

    def threads(self, ranks_on_this_node: int) -> int:
        return thread_share(ranks_on_this_node)

    def start(self, ranks: range, world_size: int, master_addr: str, port: int, threads: int) -> None:
        """Rank r of `ranks` as a child process (node 0: local rank = rank)."""
        self.procs.update({rank: spawn_rank(rank, world_size, rank, master_addr, port, threads)
                           for rank in ranks})

    def gone(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"rank {rank} (pid {proc.pid}) {how}"
        return None

    def wait(self, timeout_s: float) -> None:
        """Wait for every rank to exit; kill what still runs after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()


class RankActor:
    """A rank's place in a Ray placement group's bundle: the actor holds the
    bundle's CPUs and runs the rank as its child process, the very
    `python -m tokenmill.distributed.worker` that `tokenmill worker` starts (the
    child dies with the actor)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, rank: int, world_size: int, master_addr: str, port: int,
              threads: int) -> tuple[int, str]:
        """Starts the rank; its (pid, this node's IP)."""
        import ray

        self.proc = spawn_rank(rank, world_size, 0, master_addr, port, threads, die_with_parent=True)
        return self.proc.pid, str(ray.util.get_node_ip_address())

    def wait(self) -> int:
        """Until the rank exits: its exit code (negative: the signal that killed it)."""
        assert self.proc is not None
        return self.proc.wait()




class RayRanks:
    """Ranks 1..N-1 in Ray actors, rank r in bundle r of the placement group this
    process runs in (bundle 0 is this process's own: rank 0), as vLLM's Ray
    executor places its workers; each actor runs its rank as a child process. The rendezvous is this process's node IP and a
    free port, so a STRICT_SPREAD group spans machines. Each rank's threads: its
    bundle's CPUs.

    No orphans: the actors are this process's (not detached), and Ray kills an
    owner's actors when it dies; removing the placement group (Ray Serve does when
    it stops a replica) kills them too; a rank dies with its actor
    (PR_SET_PDEATHSIG), and exits by itself when rank 0's sockets close. A rank
    that dies ends its actor's `wait` call, which `gone()` sees, so a collective
    that fails names it."""

    def __init__(self) -> None:
        from ray.util import get_current_placement_group

        pg = get_current_placement_group()
        if pg is None:
            raise ValueError("distributed_executor_backend='ray' runs ranks in this process's Ray "
                             "placement group, and this process has none (`tokenmill serve-ray "
                             "--tensor-parallel-size N` gives each replica one)")
        self.pg = pg
        self.actors: dict[int, Any] = {}  # rank -> actor handle
        self.runs: dict[int, Any] = {}  # rank -> the ObjectRef of its actor's `wait` call
        self.where: dict[int, tuple[int, str]] = {}  # rank -> (pid, node IP)

    def bundle_cpus(self, index: int) -> float:
        return float(self.pg.bundle_specs[index].get("CPU", 1.0))

    def master_addr(self, configured: str) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def threads(self, ranks_on_this_node: int) -> int:
        return max(1, int(self.bundle_cpus(0)))

    def start(self, ranks: range, world_size: int, master_addr: str, port: int, threads: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tokenmill.distributed.group import TensorParallelError

        if len(self.pg.bundle_specs) < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs a placement group of as many "
                             f"bundles; this process's has {len(self.pg.bundle_specs)}")
        remote = ray.remote(RankActor)
        for rank in ranks:
            self.actors[rank] = remote.options(
                num_cpus=self.bundle_cpus(rank),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=rank),
            ).remote()
        for rank, actor in self.actors.items():
            rank_threads = max(1, int(self.bundle_cpus(rank)))
            try:
                self.where[rank] = ray.get(
                    actor.start.remote(rank, world_size, master_addr, port, rank_threads),
                    timeout=envs.tp_init_timeout_s())  # (a rank actor's start: process, imports, runtime env)
            except Exception as e:
                self.kill()
                raise TensorParallelError(f"tensor-parallel rank {rank} (a Ray actor in bundle "
                                          f"{rank}) could not start: {e}") from e
            self.runs[rank] = actor.wait.remote()

    def gone(self) -> str | None:
        import ray

        for rank, ref in self.runs.items():
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                code = ray.get(ref)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            except Exception as e:  # (RayActorError: the actor's process died, the rank with it)
                how = f"died with its Ray actor ({type(e).__name__})"
            pid, node = self.where.get(rank, (0, "?"))
            return f"rank {rank} (Ray actor, pid {pid} on {node}) {how}"
        return None

    def wait(self, timeout_s: float) -> None:
        """Wait for every rank to exit; then end the actors (their bundles free)."""
        import ray

        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        import ray

        for actor in self.actors.values():
            with contextlib.suppress(Exception):  # (gone already, or Ray is shutting down)
                ray.kill(actor, no_restart=True)


def run_node(world_size: int, nnodes: int, node_rank: int, master_addr: str,
             master_port: int) -> int:
    """`tokenmill worker`: node `node_rank`'s ranks, until they exit. One that
    fails stops the others here (and, through the closed sockets, the group)."""
    per_node = world_size // nnodes
    threads = thread_share(per_node)
    first = node_rank * per_node
    ranks = RankProcesses({
        rank: spawn_rank(rank, world_size, rank - first, master_addr, master_port, threads)
        for rank in range(first, first + per_node)
    })
    try:
        while True:
            gone = ranks.gone()
            if gone is not None:
                codes = [p.poll() for p in ranks.procs.values()]
                if all(c == 0 for c in codes):
                    return 0  # (every rank stopped cleanly: rank 0 shut down)
                if any(c not in (0, None) for c in codes):
                    print(f"tokenmill worker: {gone}; stopping this node's ranks", file=sys.stderr)
                    ranks.kill()
                    return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        ranks.kill()
        return 130
