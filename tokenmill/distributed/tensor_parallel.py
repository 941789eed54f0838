"""Rank 0's side of tensor parallelism: the engine's process.

Rank 0 runs everything a single process does (scheduler, sampler, detokenizer)
with its own shard of the model; the other ranks run their shards only. For
each forward the runner calls, rank 0 first sends the model's inputs (token
ids, positions, the attention metadata: what the SchedulerOutput implies) to
the other ranks, then all run their shards in lockstep (an all-reduce after
each o_proj and down_proj); for the logits it sends the rows' last hidden
states, and gathers every rank's share of the vocabulary.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from typing import Any

import torch

from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.config import CacheConfig, ModelConfig, ParallelConfig
from tokenmill.distributed.group import RankGroup, TensorParallelError
from tokenmill.distributed.launch import RankProcesses, RayRanks
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.lora import LoRABatch
from tokenmill.model.parallel import ShardLayout, shard_model, vocab_widths
from tokenmill.worker.cache_sizing import default_kv_cache_bytes
from tokenmill.worker.model_runner import ModelForward

logger = logging.getLogger("tokenmill")


def _cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


def meta_to_wire(meta: AttentionMetadata) -> dict[str, Any]:
    return {f.name: _cpu(getattr(meta, f.name)) for f in dataclasses.fields(meta) if f.init}


def meta_from_wire(fields: dict[str, Any], device: torch.device) -> AttentionMetadata:
    moved: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                             for k, v in fields.items()}
    return AttentionMetadata(**moved)


class TensorParallel:
    """Starts the group (rank 0 here, node 0's other ranks as child processes,
    other nodes' ranks by `tokenmill worker`), shards the model, and makes the
    forward that drives the other ranks. One per engine; `shutdown()` ends it."""

    def __init__(self, config: ParallelConfig, model_config: ModelConfig, cpu_options: CpuBackendOptions) -> None:
        if config.node_rank != 0:
            raise ValueError(f"node_rank={config.node_rank}: the engine runs on node 0; "
                             "the other nodes run `tokenmill worker`")
        self.size = config.tensor_parallel_size
        self.device = torch.device(model_config.device)
        per_node = config.ranks_per_node
        self.ranks_per_node = per_node
        self._lock = threading.Lock()  # a shutdown never interleaves with a step's messages
        # Node 0's other ranks: child processes, or Ray actors in this process's placement group.
        self.ranks: RankProcesses | RayRanks = RankProcesses({}) if config.distributed_executor_backend == "mp" else RayRanks()
        self.threads = self.ranks.threads(per_node)
        master_addr = self.ranks.master_addr(config.master_addr)
        self.group = RankGroup(0, self.size, master_addr, config.master_port or 0,
                               alive=self.ranks.gone)
        self.ranks.start(range(1, per_node), self.size, master_addr, self.group.port, self.threads)
        self._closed = False
        atexit.register(self.shutdown)
        try:
            self.group.connect()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # The others load the model while this process does, with this process's CPU options.
            self.group.send(("load", model_config, cpu_options))
            self.group.open_tensors(self.device, cpu_options)
        except BaseException:
            self.shutdown()
            raise
        self._threads_before = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        logger.info("tensor parallel: %d ranks (%d on this node, %d threads each), port %d",
                    self.size, per_node, self.threads, self.group.port)
        self.widths: list[int] = []

    def shard(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """Rank 0's shard of the loaded model (the whole one can then be dropped)."""
        self.widths = vocab_widths(model.spec, self.size)
        return shard_model(model, ShardLayout.of(model.spec, 0, self.size), self.group.reducer)

    def cache_config(self, cache_config: CacheConfig) -> CacheConfig:
        """The KV budget per rank: the default budget shared by the ranks on
        this machine (an explicit size or block count stands as given)."""
        if cache_config.kv_cache_memory_bytes is not None or cache_config.num_blocks_override:
            return cache_config
        share = default_kv_cache_bytes(self.device) // self.ranks_per_node
        return dataclasses.replace(cache_config, kv_cache_memory_bytes=share)

    def start(self, num_blocks: int, block_size: int, layer_slots: list[int], kv_cache_dtype: str) -> None:
        """The other ranks allocate their KV caches (`num_blocks` of their own
        heads: the scheduler's block ids are every rank's; layer i's K/V in
        tensor `layer_slots[i]`, core/kv_layout.py; stored as `kv_cache_dtype`);
        returns when all are ready."""
        self.group.send(("cache", num_blocks, block_size, layer_slots, kv_cache_dtype))
        self.group.barrier()

    def driver(self, local: ModelForward) -> ModelForward:
        return DriverForward(local, self)

    def rank_locations(self) -> tuple[tuple[int, int, str], ...]:
        """(rank, pid, node IP) of each rank started through Ray; () for child processes."""
        if not isinstance(self.ranks, RayRanks):
            return ()
        return tuple((rank, pid, node) for rank, (pid, node) in sorted(self.ranks.where.items()))

    def failure(self) -> str | None:
        """Why the group stopped (a failed collective, a rank gone), or None."""
        return self.group.failed or self.ranks.gone()

    def shutdown(self) -> None:
        """Tell the other ranks to stop, wait for node 0's (then kill what is
        left), and restore the thread count."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._lock.acquire(timeout=5.0):
            try:
                if self.group.commands is not None and self.group.failed is None:
                    self.group.send(("stop",))
            except TensorParallelError:
                pass
            finally:
                self._lock.release()
        self.ranks.wait(10.0)
        self.group.close()
        if self.device.type == "cpu" and hasattr(self, "_threads_before"):
            torch.set_num_threads(self._threads_before)

    def fail(self) -> None:
        """After a failed collective: stop node 0's ranks (they may wait forever
        for a command that will not come) and drop the group."""
        self.ranks.kill()
        self.group.close()


class DriverForward:
    """The runner's forward on rank 0: each call goes to every rank first.
    Serves ModelForward's two calls."""

    def __init__(self, local: ModelForward, tp: TensorParallel) -> None:
        self.local = local
        self.tp = tp
        self.last: torch.Tensor | None = None  # the last forward's output

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, output_rows: torch.Tensor | None = None,
                 lora: LoRABatch | None = None) -> torch.Tensor:
        assert lora is None, "LoRA adapters run on one process (EngineArgs refuses them with TP)"
        with self._guard():
            self.last = None
            self.tp.group.send(("forward", input_ids.cpu(), positions.cpu(), meta_to_wire(meta),
                                None if output_rows is None else output_rows.cpu()))
            self.last = self.local(input_ids, positions, kv_caches, meta, output_rows)
            return self.last

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' logits over the whole vocabulary: every rank's share, gathered here.
        The last forward's output itself (a step's sampled rows, as usual) is
        not sent: every rank holds the same bits of it (the residual stream is
        replicated, the all-reduces give every rank the same sums)."""
        with self._guard():
            self.tp.group.send(("logits",) if hidden is self.last else ("logits", hidden.cpu()))
            logits = self.tp.group.gather_columns(self.local.compute_logits(hidden), self.tp.widths)
            assert logits is not None  # (rank 0)
            return logits

    def _guard(self) -> _Guard:
        return _Guard(self.tp)


class _Guard:
    """Holds the group's lock over one call; a failure stops the group for good."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def __enter__(self) -> None:
        self.tp._lock.acquire()
        if self.tp._closed or self.tp.group.failed is not None:
            self.tp._lock.release()
            raise TensorParallelError(self.tp.group.failed or "the tensor-parallel group was shut down")

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: object) -> None:
        try:
            if isinstance(value, TensorParallelError):
                logger.error("%s", value)
                self.tp.fail()
        finally:
            self.tp._lock.release()
