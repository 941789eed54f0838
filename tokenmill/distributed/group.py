"""The ranks of one tensor-parallel group and what crosses the wire between them.

Two process groups over one TCP store on node 0 (`master_addr:master_port`):

- `commands` (gloo, CPU): rank 0 broadcasts each command to the other ranks as
  pickled plain data (Python values and CPU tensors). A worker waits here
  between steps for as long as the server idles, so its timeout is long.
- `tensors` (gloo on the CPU, nccl on CUDA): the all-reduces inside a step and
  the logits' gather. Ranks run in lockstep there, so its timeout is short
  (TOKENMILL_TP_TIMEOUT_S, default 120 s): a stuck rank stops the group.

A rank that dies closes its sockets: the others' next operation fails at once
(gloo: "Connection closed by peer"), never a hang. Pickled commands are trusted
(as torch.distributed's broadcast_object_list): the ranks are one deployment.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import GatherOptions, PrefixStore, ProcessGroupGloo, TCPStore

# How long ranks wait for each other to start (loading a model included) and
# for a collective inside a step.
INIT_TIMEOUT_S = float(os.environ.get("TOKENMILL_TP_INIT_TIMEOUT_S", "600"))
STEP_TIMEOUT_S = float(os.environ.get("TOKENMILL_TP_TIMEOUT_S", "120"))
IDLE_TIMEOUT = timedelta(days=365)  # a worker between steps: the server may idle for long


class TensorParallelError(RuntimeError):
    """The tensor-parallel group stopped (a rank died or timed out); the engine
    cannot run another step."""


class RankGroup:
    """This process's place in the group: `rank` of `size`. Rank 0 (node 0)
    hosts the store; `master_port` 0 there picks a free port (`self.port`)."""

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int,
                 alive: Callable[[], str | None] = lambda: None) -> None:
        self.rank, self.size = rank, size
        self.device = torch.device("cpu")  # the step's tensors' (open_tensors)
        self._alive = alive  # the reason a rank this process watches is gone, or None
        self.store = TCPStore(master_addr, master_port, size, rank == 0,
                              timeout=timedelta(seconds=INIT_TIMEOUT_S), wait_for_workers=False)
        self.port = int(self.store.port)
        self.commands: Any = None
        self.tensors: Any = None
        self.failed: str | None = None

    def connect(self) -> None:
        """Join the commands group: rank 0 first waits until every rank has
        reached its store (failing early if a watched rank exits meanwhile)."""
        self.store.set(f"arrived/{self.rank}", "1")
        if self.rank == 0:
            keys = [f"arrived/{r}" for r in range(self.size)]
            deadline = time.monotonic() + INIT_TIMEOUT_S
            while not self.store.check(keys):
                gone = self._alive()
                if gone is not None:
                    raise TensorParallelError(f"tensor-parallel group could not start: {gone}")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel group could not start: not every rank of {self.size} "
                        f"reached the store within {INIT_TIMEOUT_S:.0f} s (are the other nodes' "
                        "`tokenmill worker`s running with the same --master-addr/--master-port?)")
                time.sleep(0.05)
        self.commands = ProcessGroupGloo(PrefixStore("commands", self.store), self.rank, self.size,
                                         IDLE_TIMEOUT)

    def open_tensors(self, device: torch.device) -> None:
        """Join the group of the step's collectives, for tensors on `device`
        (every rank calls it once, after the commands group)."""
        self.device = device
        store = PrefixStore("tensors", self.store)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=STEP_TIMEOUT_S)
            self.tensors = ProcessGroupNCCL(store, self.rank, self.size, options)
        else:
            self.tensors = ProcessGroupGloo(store, self.rank, self.size,
                                            timedelta(seconds=STEP_TIMEOUT_S))

    def barrier(self) -> None:
        """Every rank here (over the commands group: no step timeout, for loads)."""
        self._wait(self.commands.allreduce([torch.zeros(1)]))

    def _wait(self, work: Any) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            work.wait()
        except RuntimeError as e:
            gone = self._alive()
            for _ in range(20):  # a rank that closed its sockets may take a moment to exit
                if gone is not None:
                    break
                time.sleep(0.05)
                gone = self._alive()
            self.failed = (f"the tensor-parallel group stopped: {gone or 'another rank failed'} "
                           f"({str(e).splitlines()[0][:300]})")
            raise TensorParallelError(self.failed) from e

    # ---- commands (rank 0 -> the others) ---------------------------------------------

    def send(self, command: Any) -> None:
        """Rank 0: `command` (plain data) to every other rank."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait(self.commands.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0))
        self._wait(self.commands.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0))

    def receive(self) -> Any:
        """The other ranks: the next command rank 0 sends."""
        length = torch.empty(1, dtype=torch.int64)
        self._wait(self.commands.broadcast(length, 0))
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._wait(self.commands.broadcast(data, 0))
        return pickle.loads(data.numpy().tobytes())

    # ---- inside a step ----------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (each rank gets the same bits)."""
        self._wait(self.tensors.allreduce([t]))

    def gather_columns(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank r's [rows, widths[r]] side by side on rank 0 ([rows, sum(widths)]);
        None on the others. (Padded to the widest: a gather takes equal shapes.)"""
        width = max(widths)
        padded = F.pad(local, (0, width - local.shape[1])) if local.shape[1] < width else local
        padded = padded.contiguous()
        opts = GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self._wait(self.tensors.gather([], [padded], opts))
            return None
        parts = [torch.empty_like(padded) for _ in widths]
        self._wait(self.tensors.gather([parts], [padded], opts))
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)

    def close(self) -> None:
        """Drop the process groups and the store (their sockets close)."""
        self.commands = self.tensors = None
        self.store = None  # type: ignore[assignment]
