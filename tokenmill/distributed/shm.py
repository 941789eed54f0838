"""The all-reduce of ranks that share one machine, over shared memory.

A gloo all-reduce over loopback TCP costs ~1 ms on two busy cores, and a
decode step has two per layer; through a mapped file in /dev/shm it is a copy,
a flag and a sum (csrc/distributed.cpp shm_all_reduce, which the C++ layer
loop also calls between its kernels). The logits' gather (shm_gather) and
rank 0's commands (shm_send / shm_receive) go the same way. The group picks it by itself when every
rank reports the same host (hostname, boot id, pid namespace) and could map
the file; otherwise, or with TOKENMILL_TP_SHM=0 on any rank, gloo stays.

Every rank sums the slots in rank order, so all get the same bits (for two
ranks, the same as gloo's sum). A peer that dies is seen through /proc (its
pid), one that stalls by the step timeout (not a worker waiting for rank 0's
next command, which may come after hours): both raise, never hang.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from typing import Any

import torch

from tokenmill import envs
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.kernels import CppShmGroup, CpuOps
from tokenmill.backends.cpu.options import CpuBackendOptions

LINE = 64  # bytes of a rank's flag (its own cache line): csrc/distributed.cpp
SLOT_FLOATS = 1 << 18  # 1 MiB a slot (a prefill's [2048, 576] goes in 5 chunks)
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    """TOKENMILL_TP_SHM=0 keeps this rank (and so its group) on gloo."""
    return envs.tp_shm()


def host_key() -> str:
    """What ranks on one machine (and one pid namespace: the liveness check
    reads peers' /proc entries) have in common."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"{socket.gethostname()}|no-proc|{os.getpid()}"  # (unique: never shared)
    return f"{socket.gethostname()}|{boot}|{pidns}"


def region_bytes(size: int) -> int:
    return size * LINE + 2 * size * SLOT_FLOATS * 4


def new_path() -> str:
    return os.path.join(SHM_DIR, f"tokenmill-tp-{os.getpid()}-{secrets.token_hex(6)}")


class ShmAllReduce:
    """This rank's view of the group's region; calls sum a tensor over the ranks
    in place. `native` is the handle the C++ layer loop takes."""

    def __init__(self, ops: CpuOps, path: str, create: bool, rank: int, size: int, pids: list[int],
                 timeout_s: float) -> None:
        nbytes = region_bytes(size)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)  # (zero-filled: every flag starts at 0)
            elif os.fstat(fd).st_size != nbytes:
                raise OSError(f"{path}: {os.fstat(fd).st_size} bytes, not {nbytes}")
            self._map: Any = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.ops = ops
        region = torch.frombuffer(self._map, dtype=torch.uint8)
        self.native: CppShmGroup | None = ops.ShmGroup(
            region=region, rank=rank, size=size, capacity=SLOT_FLOATS, pids=pids, timeout_s=timeout_s)

    def __call__(self, t: torch.Tensor) -> None:
        assert self.native is not None, "the shared-memory group was closed"
        if t.dtype == torch.float32 and t.is_contiguous():
            self.ops.shm_all_reduce(self.native, t)
            return
        # Other dtypes: summed in float32, rounded once.
        wide = t.float().contiguous()
        self.ops.shm_all_reduce(self.native, wide)
        t.copy_(wide)

    def gather(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank r's float32 [rows, widths[r]] side by side on rank 0 ([rows,
        sum(widths)]); None on the others."""
        assert self.native is not None, "the shared-memory group was closed"
        root = self.native.rank == 0
        out = torch.empty(local.shape[0], sum(widths)) if root else torch.empty(0)
        self.ops.shm_gather(self.native, local.contiguous(), out, widths)
        return out if root else None

    def send(self, data: bytes) -> None:
        """Rank 0: a command's bytes to the other ranks."""
        assert self.native is not None, "the shared-memory group was closed"
        self.ops.shm_send(self.native, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> bytes:
        """The other ranks: the next bytes rank 0 sends (however long that takes)."""
        assert self.native is not None, "the shared-memory group was closed"
        return bytes(self.ops.shm_receive(self.native).numpy().tobytes())

    def close(self) -> None:
        """Drop the handle (the mapping goes with its last reference)."""
        self.native = None


def ops_for_shm(options: CpuBackendOptions) -> CpuOps | None:
    """The kernels the transport runs on, or None where shared memory is off
    (TOKENMILL_TP_SHM=0) or `options` (the caller's) switch the kernels off."""
    return kernels.load() if enabled() and options.cpp_kernels else None
