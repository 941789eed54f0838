"""A rank other than 0: its shard of the model, driven by rank 0's commands.

`python -m tokenmill.distributed.worker --rank R ...` (launch.py starts it).
It joins the group, loads the model rank 0 names and keeps its own shard
(model/parallel.py) on rank 0's CPU backend options (sent with the model's
config: one process builds them), allocates a KV cache for its own heads with rank 0's
block count, then serves commands until "stop":

    ("forward", input_ids, positions, attention metadata, output_rows)
    ("logits", hidden)  -> its share of the vocabulary, gathered on rank 0
    ("logits",)         -> the same for the last forward's output (its own copy)

It never schedules nor samples. Any error ends the process with a line naming
the rank; its closed sockets then stop the other ranks' next collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import torch

from tokenmill.distributed.group import RankGroup, TensorParallelError
from tokenmill.distributed.tensor_parallel import meta_from_wire
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.parallel import ShardLayout, shard_model, vocab_widths
from tokenmill.model.source import resolve_model_source
from tokenmill.worker.model_runner import ModelForward, kv_cache_tensors, pick_forward

logger = logging.getLogger("tokenmill")


def serve_rank(group: RankGroup, local_rank: int) -> None:
    kind, model_config, cpu_options = group.receive()  # (rank 0's CPU options)
    assert kind == "load", kind
    device = torch.device(model_config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        model_config = dataclasses.replace(model_config, device=str(device))
    group.open_tensors(device, cpu_options)
    whole, spec = load_model(model_config, resolve_model_source(model_config.model))
    if not isinstance(whole, LlamaForCausalLM):  # (rank 0 refuses it too, naming the flag)
        raise ValueError(f"{spec.architecture} (an encoder) runs on one process, not tensor-parallel")
    dtype = next(whole.parameters()).dtype
    model = shard_model(whole, ShardLayout.of(spec, group.rank, group.size), group.reducer)
    del whole
    widths = vocab_widths(spec, group.size)
    forward, how = pick_forward(model, dtype, device, cpu_options)
    logger.info("rank %d: forward: %s", group.rank, how)
    kind, num_blocks, block_size, layer_slots, kv_cache_dtype = group.receive()
    assert kind == "cache" and len(layer_slots) == model.spec.num_layers, kind
    slots = kv_cache_tensors(kv_cache_dtype, max(layer_slots, default=-1) + 1, num_blocks, block_size,
                             model.spec, dtype, device)
    kv_caches = [slots[s] for s in layer_slots]  # (rank 0's layout: its layer groups)
    group.barrier()
    with torch.inference_mode():
        serve_commands(group, forward, kv_caches, widths, device)


def serve_commands(group: RankGroup, forward: ModelForward, kv_caches: list[torch.Tensor],
                   widths: list[int], device: torch.device) -> None:
    last: torch.Tensor | None = None  # the last forward's output
    while True:
        command = group.receive()
        if command[0] == "forward":
            _, input_ids, positions, meta, output_rows = command
            last = None
            last = forward(input_ids.to(device), positions.to(device), kv_caches,
                           meta_from_wire(meta, device),
                           None if output_rows is None else output_rows.to(device))
        elif command[0] == "logits":
            hidden = command[1].to(device) if len(command) > 1 else last
            assert hidden is not None, "logits of the last forward before any forward"
            group.gather_columns(forward.compute_logits(hidden), widths)
        elif command[0] == "stop":
            return
        else:
            raise ValueError(f"unknown command {command[0]!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s rank{args.rank}: %(message)s")
    torch.set_num_threads(args.threads)
    try:
        group = RankGroup(args.rank, args.world_size, args.master_addr, args.master_port)
        group.connect()
        serve_rank(group, args.local_rank)
    except TensorParallelError as e:
        print(f"tokenmill tensor-parallel rank {args.rank}: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        logger.exception("rank %d failed", args.rank)
        print(f"tokenmill tensor-parallel rank {args.rank} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without C++ teardown: once the peers have closed their sockets, a
    # gloo/thread destructor at exit can abort the process ("terminate called").
    os._exit(code)
