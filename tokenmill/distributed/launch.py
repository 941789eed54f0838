"""Starting rank processes on this machine, and watching them.

A rank is `python -m tokenmill.distributed.worker --rank R ...` (worker.py),
started by rank 0 for the ranks of node 0 and by `tokenmill worker` on every
other node; each gets its share of this machine's cores (OMP_NUM_THREADS and
torch's thread count), the environment otherwise inherited (the OpenMP wait
policy `tokenmill serve` set included).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def thread_share(ranks_on_this_node: int) -> int:
    """Each rank's threads: this machine's cores split evenly (at least one)."""
    return max(1, available_cpus() // ranks_on_this_node)


def spawn_rank(rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int,
               threads: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tokenmill.distributed.worker", "--rank", str(rank),
           "--world-size", str(world_size), "--local-rank", str(local_rank),
           "--master-addr", master_addr, "--master-port", str(master_port),
           "--threads", str(threads)]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))


class RankProcesses:
    """The rank processes this process started; `gone()` says which one has exited."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        self.procs = procs  # rank -> process

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
