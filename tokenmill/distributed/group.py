"""The ranks of one tensor-parallel group and what crosses the wire between them.

Two process groups over one TCP store on node 0 (`master_addr:master_port`):

- `commands` (gloo, CPU): rank 0 broadcasts each command to the other ranks as
  pickled plain data (Python values; tensors as raw bytes), in one broadcast
  of a fixed-size buffer where it fits (a decode step's does), a second for
  the rest. A worker waits here between steps for as long as the server
  idles, so its timeout is long. (Over shared memory, see below, from the
  command after "load" on.)
- `tensors` (gloo on the CPU, nccl on CUDA): the all-reduces inside a step and
  the logits' gather. Ranks run in lockstep there, so its timeout is short
  (TOKENMILL_TP_TIMEOUT_S, default 120 s): a stuck rank stops the group.
  Where every rank is on one machine, the all-reduces, the gather and the
  commands go through shared memory instead (shm.py), chosen when the group
  opens.

A rank that dies closes its sockets: the others' next operation fails at once
(gloo: "Connection closed by peer"), never a hang. Pickled commands are trusted
(as torch.distributed's broadcast_object_list): the ranks are one deployment.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import GatherOptions, PrefixStore, ProcessGroupGloo, TCPStore

from tokenmill import envs
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.distributed import shm
from tokenmill.distributed.shm import ShmAllReduce

logger = logging.getLogger("tokenmill")

# How long ranks wait for each other to start (loading a model included) and
# for a collective inside a step.
IDLE_TIMEOUT = timedelta(days=365)  # a worker between steps: the server may idle for long
# A command's first broadcast: its length and up to this many bytes less 8 of it
# (a decode step's inputs fit); a longer one sends the rest in a second.
COMMAND_HEAD = 4096
_TENSOR = "__tokenmill_tensor__"


def _to_wire(value: Any) -> Any:
    """Tensors (in tuples, lists, dicts) as (tag, dtype, shape, bytes): pickling
    a torch tensor costs ~30 us and ~500 bytes of framing; this, a memcpy."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return (_TENSOR, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(value, tuple):
        return tuple(_to_wire(v) for v in value)
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value: Any) -> Any:
    if isinstance(value, tuple):
        if len(value) == 4 and value[0] == _TENSOR:
            _, dtype_name, shape, raw = value
            dtype = getattr(torch, dtype_name)
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        return tuple(_from_wire(v) for v in value)
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_wire(v) for k, v in value.items()}
    return value


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
        self.step_timeout_s = envs.tp_timeout_s()  # a step's collectives wait at most this long
        self.store = TCPStore(master_addr, master_port, size, rank == 0,
                              timeout=timedelta(seconds=envs.tp_init_timeout_s()), wait_for_workers=False)
        self.port = int(self.store.port)
        self.commands: Any = None
        self.tensors: Any = None
        self.shm: ShmAllReduce | None = None  # the all-reduce over shared memory, where chosen
        self.failed: str | None = None
        self.reducer = GroupAllReduce(self)

    def connect(self) -> None:
        """Join the commands group: rank 0 first waits until every rank has
        reached its store (failing early if a watched rank exits meanwhile)."""
        self.store.set(f"arrived/{self.rank}", "1")
        if self.rank == 0:
            keys = [f"arrived/{r}" for r in range(self.size)]
            init_timeout_s = envs.tp_init_timeout_s()
            deadline = time.monotonic() + init_timeout_s
            while not self.store.check(keys):
                gone = self._alive()
                if gone is not None:
                    raise TensorParallelError(f"tensor-parallel group could not start: {gone}")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel group could not start: not every rank of {self.size} "
                        f"reached the store within {init_timeout_s:.0f} s (are the other nodes' "
                        "`tokenmill worker`s running with the same --master-addr/--master-port?)")
                time.sleep(0.05)
        self.commands = ProcessGroupGloo(PrefixStore("commands", self.store), self.rank, self.size,
                                         IDLE_TIMEOUT)

    def open_tensors(self, device: torch.device, cpu_options: CpuBackendOptions) -> None:
        """Join the group of the step's collectives, for tensors on `device`
        (every rank calls it once, after the commands group), over shared
        memory where `cpu_options` (rank 0's) and the machine allow."""
        self.device = device
        store = PrefixStore("tensors", self.store)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.step_timeout_s)
            self.tensors = ProcessGroupNCCL(store, self.rank, self.size, options)
        else:
            self.tensors = ProcessGroupGloo(store, self.rank, self.size,
                                            timedelta(seconds=self.step_timeout_s))
            self._open_shm(cpu_options)

    def _open_shm(self, cpu_options: CpuBackendOptions) -> None:
        """All-reduce through shared memory where every rank is on this machine
        and maps the region; else (or where any rank could not) gloo. Every rank
        decides the same: the hosts are compared from the store, then voted on."""
        ops = shm.ops_for_shm(cpu_options)
        store = self.store
        store.set(f"shm/host/{self.rank}", shm.host_key() if ops is not None else f"off/{self.rank}")
        hosts = {store.get(f"shm/host/{r}") for r in range(self.size)}
        if ops is None or len(hosts) != 1:
            logger.info("tensor parallel rank %d: all-reduce over gloo (%s)", self.rank,
                        "ranks on more than one machine" if ops is not None else
                        "shared memory switched off or no C++ kernels on a rank")
            return
        store.set(f"shm/pid/{self.rank}", str(os.getpid()))
        pids = [int(store.get(f"shm/pid/{r}")) for r in range(self.size)]
        path, why = "", ""
        if self.rank == 0:
            path = shm.new_path()
            try:
                self.shm = ShmAllReduce(ops, path, True, self.rank, self.size, pids, self.step_timeout_s)
            except OSError as e:
                path, why = "", str(e)
            store.set("shm/path", path)
        else:
            path = store.get("shm/path").decode()
            try:
                if path:
                    self.shm = ShmAllReduce(ops, path, False, self.rank, self.size, pids, self.step_timeout_s)
            except OSError as e:
                why = str(e)
        vote = torch.tensor([1 if self.shm is not None else 0], dtype=torch.int64)
        self._wait(self.tensors.allreduce([vote]))
        if self.rank == 0 and path:
            os.unlink(path)  # (every rank has it mapped or gave up: nothing left behind)
        if int(vote.item()) != self.size:
            if self.shm is not None:
                self.shm.close()
                self.shm = None
            logger.info("tensor parallel rank %d: all-reduce over gloo (shared memory: %s)", self.rank,
                        why or "another rank could not map it")
            return
        logger.info("tensor parallel rank %d: all-reduce over shared memory", self.rank)

    def barrier(self) -> None:
        """Every rank here (over the commands group: no step timeout, for loads)."""
        self._wait(self.commands.allreduce([torch.zeros(1)]))

    def _wait(self, work: Any) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            work.wait()
        except RuntimeError as e:
            raise self.stopped(e) from e

    def stopped(self, e: BaseException) -> TensorParallelError:
        """After a collective failed with `e`: the group is stopped for good;
        the error names the rank that is gone where this process watches it."""
        if self.failed is None:
            gone = self._alive()
            for _ in range(20):  # a rank that closed its sockets may take a moment to exit
                if gone is not None:
                    break
                time.sleep(0.05)
                gone = self._alive()
            self.failed = (f"the tensor-parallel group stopped: {gone or 'another rank failed'} "
                           f"({str(e).splitlines()[0][:300]})")
        return TensorParallelError(self.failed)

    # ---- commands (rank 0 -> the others) ---------------------------------------------

    def send(self, command: Any) -> None:
        """Rank 0: `command` (plain data) to every other rank."""
        data = pickle.dumps(_to_wire(command), protocol=pickle.HIGHEST_PROTOCOL)
        if self.shm is not None:
            self._shm_call(self.shm.send, data)
            return
        fits = COMMAND_HEAD - 8
        head = bytearray(COMMAND_HEAD)
        head[:8] = len(data).to_bytes(8, "little")
        head[8 : 8 + min(len(data), fits)] = data[:fits]
        self._wait(self.commands.broadcast(torch.frombuffer(head, dtype=torch.uint8), 0))
        if len(data) > fits:
            self._wait(self.commands.broadcast(torch.frombuffer(bytearray(data[fits:]), dtype=torch.uint8), 0))

    def receive(self) -> Any:
        """The other ranks: the next command rank 0 sends."""
        if self.shm is not None:
            return _from_wire(pickle.loads(self._shm_call(self.shm.receive)))
        head = torch.empty(COMMAND_HEAD, dtype=torch.uint8)
        self._wait(self.commands.broadcast(head, 0))
        raw = head.numpy().tobytes()
        length, fits = int.from_bytes(raw[:8], "little"), COMMAND_HEAD - 8
        data = raw[8 : 8 + min(length, fits)]
        if length > fits:
            rest = torch.empty(length - fits, dtype=torch.uint8)
            self._wait(self.commands.broadcast(rest, 0))
            data += rest.numpy().tobytes()
        return _from_wire(pickle.loads(data))

    # ---- inside a step ----------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (each rank gets the same bits)."""
        if self.shm is None:
            self._wait(self.tensors.allreduce([t]))
            return
        self._shm_call(self.shm, t)

    def _shm_call(self, f: Callable[..., Any], *args: Any) -> Any:
        """f(*args) over shared memory: a failure (a peer gone or stuck) stops the group."""
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            return f(*args)
        except RuntimeError as e:
            raise self.stopped(e) from e

    def gather_columns(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank r's [rows, widths[r]] side by side on rank 0 ([rows, sum(widths)]);
        None on the others. (Padded to the widest: a gather takes equal shapes.)"""
        if self.shm is not None and local.dtype == torch.float32 and max(widths) <= shm.SLOT_FLOATS:
            gathered: torch.Tensor | None = self._shm_call(self.shm.gather, local, widths)
            return gathered
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
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self.store = None  # type: ignore[assignment]


class GroupAllReduce:
    """The all-reduce a shard's row-parallel layers get (model/parallel.py
    AllReduce): `native`, the shared-memory group the C++ layer loop can
    all-reduce with itself (None over gloo), and `stopped(e)`, the error a
    failure inside that loop becomes."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def __call__(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t)

    @property
    def native(self) -> Any:
        shared = self.group.shm
        return None if shared is None or self.group.failed is not None else shared.native

    def stopped(self, e: BaseException) -> TensorParallelError:
        return self.group.stopped(e)
