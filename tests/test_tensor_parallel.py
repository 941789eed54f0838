"""Tensor parallelism over gloo: TP=2 gives TP=1's greedy tokens and logprobs
(32 mixed prompts, chunked prefill and preemption forced) on a tiny Llama split
unevenly (3 KV heads, an odd vocabulary), a tiny Qwen3 (q/k norms) and a tiny
Phi-4-mini (partial rotary, LongRoPE), all on the CPU plan; a rank that dies stops the group with
an error naming it, never a hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.hf_models import COMMON, build_hf_model, save_hf_model
from tests.test_correctness import MAX_TOKENS, PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.config import ModelSpec, ParallelConfig
from tokenmill.distributed.group import TensorParallelError
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.model.parallel import ShardLayout, split_range, vocab_widths

# Chunked prefill (8 tokens a step) and a KV pool small enough to preempt.
PRESSURE: dict[str, Any] = {"max_num_batched_tokens": 8, "num_kv_blocks": 24, "block_size": 4}


def uneven_llama(directory: Path) -> str:
    """A Llama whose split over 2 ranks is uneven everywhere: 3 KV heads (2 + 1),
    an MLP of 9 tiles of 16 (4 + 5), a vocabulary of 255 (127 + 128)."""
    config = transformers.LlamaConfig(**{
        **COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3,
        "intermediate_size": 144, "vocab_size": 255,
    })
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return save_hf_model(model, directory)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "llama-uneven": uneven_llama(Path(tmp_path_factory.mktemp("llama"))),
        "qwen3": save_hf_model(build_hf_model("qwen3"), Path(tmp_path_factory.mktemp("qwen3"))),
        "phi4-mini": save_hf_model(build_hf_model("phi4-mini"), Path(tmp_path_factory.mktemp("phi4"))),
        "gemma3": save_hf_model(build_hf_model("gemma3"), Path(tmp_path_factory.mktemp("gemma3"))),
        "gemma2": save_hf_model(build_hf_model("gemma2"), Path(tmp_path_factory.mktemp("gemma2"))),
    }


def run(path: str, tp: int) -> tuple[list[Any], int]:
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, check_integrity=True,
              apply_process_settings=False, tensor_parallel_size=tp, **PRESSURE)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
                  for n in MAX_TOKENS]
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        scheduler = llm.engine.scheduler
        assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
        return outputs, scheduler.num_preemptions
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["llama-uneven", "qwen3", "phi4-mini", "gemma3", "gemma2"])
def test_tp2_gives_tp1s_greedy_tokens_and_logprobs(model_paths: dict[str, str], arch: str) -> None:
    single, single_preempted = run(model_paths[arch], 1)
    split, split_preempted = run(model_paths[arch], 2)
    assert single_preempted > 0 and split_preempted == single_preempted
    for i, (one, two) in enumerate(zip(single, split, strict=True)):
        a, b = one.outputs[0], two.outputs[0]
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert a.logprobs is not None and b.logprobs is not None
        ours = [entry[t].logprob for entry, t in zip(b.logprobs, b.token_ids, strict=True)]
        ref = [entry[t].logprob for entry, t in zip(a.logprobs, a.token_ids, strict=True)]
        np.testing.assert_allclose(ours, ref, atol=1e-4, err_msg=f"prompt {i}")


def test_a_dead_rank_stops_the_group_with_an_error_naming_it(model_paths: dict[str, str]) -> None:
    llm = LLM(model_paths["llama-uneven"], dtype="float32", skip_tokenizer_init=True,
              apply_process_settings=False, tensor_parallel_size=2, num_kv_blocks=64)
    tp = llm.engine.tp
    assert tp is not None
    assert tp.group.shm is not None  # (one machine: the all-reduce over shared memory sees the death)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)) == 1
        pid = tp.ranks.procs[1].pid
        os.kill(pid, signal.SIGKILL)
        errors: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
            except BaseException as e:
                errors.append(e)

        start = time.monotonic()
        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(30.0)
        assert not thread.is_alive(), "generate hung after a rank died"
        assert time.monotonic() - start < 30.0
        assert len(errors) == 1 and isinstance(errors[0], TensorParallelError), errors
        assert f"rank 1 (pid {pid}) was killed by signal 9" in str(errors[0])
        # The group stays stopped: the next step fails at once, with the same reason.
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert torch.get_num_threads() == tp._threads_before


def test_a_second_node_joins_through_tokenmill_worker(model_paths: dict[str, str]) -> None:
    """Two "machines" on this one: node 0 is the engine (rank 0), node 1 runs
    `tokenmill worker` (rank 1), meeting at --master-addr/--master-port. Node 1
    has shared memory switched off, as another machine cannot share it: the
    whole group all-reduces over gloo."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "worker", "--node-rank", "1", *flags],
                             env=dict(os.environ, TOKENMILL_TP_SHM="0"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        llm = LLM(model_paths["llama-uneven"], dtype="float32", skip_tokenizer_init=True,
                  apply_process_settings=False, num_kv_blocks=64, tensor_parallel_size=2, nnodes=2,
                  master_port=port)
        try:
            assert llm.engine.tp is not None and not llm.engine.tp.ranks.procs  # (none of its own)
            assert llm.engine.tp.group.shm is None  # (gloo)
            split = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()
        assert node1.wait(30) == 0  # (rank 0's "stop" ends the node's ranks cleanly)
    finally:
        if node1.poll() is None:
            node1.kill()
    single = LLM(model_paths["llama-uneven"], dtype="float32", skip_tokenizer_init=True,
                 apply_process_settings=False, num_kv_blocks=64)
    assert split == [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]


def test_the_split_keeps_kv_groups_whole_and_covers_everything() -> None:
    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=8192)
    layouts = [ShardLayout.of(spec, r, 2) for r in range(2)]  # the default model (SmolLM2-135M)
    assert [lay.kv_heads for lay in layouts] == [(0, 1), (1, 3)]
    assert [lay.heads for lay in layouts] == [(0, 3), (3, 9)]
    assert [lay.intermediate for lay in layouts] == [(0, 768), (768, 1536)]
    assert vocab_widths(spec, 2) == [24576, 24576]
    assert split_range(10, 2, 3, unit=16) == (6, 10)  # (10 is no whole number of 16s: units of 1)
    with pytest.raises(ValueError, match="at most 3"):
        ShardLayout.of(spec, 0, 4)


def test_parallel_options_are_checked_and_reach_the_config() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "10.0.0.1",
         "--master-port", "29500"]))
    config = args.create_parallel_config()
    assert (config.tensor_parallel_size, config.nnodes, config.ranks_per_node) == (4, 2, 2)
    assert (config.master_addr, config.master_port, config.node_rank) == ("10.0.0.1", 29500, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="divide"):
        ParallelConfig(tensor_parallel_size=3, nnodes=2, master_port=1)
    with pytest.raises(ValueError, match="master-port"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1)


def _reduce_both_ways(rank: int, port: int, queue: Any) -> None:
    """One rank of a 2-rank group: the same tensors summed (and gathered) over
    shared memory and over gloo (float32; bf16 and odd lengths; one past a
    slot: chunks), and commands over shared memory."""
    from tokenmill.distributed import shm
    from tokenmill.distributed.group import RankGroup

    torch.set_num_threads(1)
    group = RankGroup(rank, 2, "127.0.0.1", port)
    group.connect()
    group.open_tensors(torch.device("cpu"), CpuBackendOptions())
    assert group.shm is not None, "ranks on one machine: shared memory"
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own partial sums
    out = []
    for n, dtype in ((1, torch.float32), (576 * 3, torch.float32), (shm.SLOT_FLOATS + 77, torch.float32),
                     (1001, torch.bfloat16)):
        part = (torch.randn(n, generator=gen) * 100).to(dtype)
        mine = part.clone()
        group.all_reduce(mine)  # shared memory
        theirs = part.clone() if dtype == torch.float32 else part.float()
        group._wait(group.tensors.allreduce([theirs]))  # gloo
        out.append((mine, theirs.to(dtype)))
    # The logits' gather: uneven widths; rows past a slot go in chunks.
    for rows, widths in ((5, [127, 128]), (3, [shm.SLOT_FLOATS // 2 + 1, shm.SLOT_FLOATS // 2])):
        local = torch.randn(rows, widths[rank], generator=gen)
        shared = group.gather_columns(local, widths)
        kept, group.shm = group.shm, None
        gloo = group.gather_columns(local, widths)
        group.shm = kept
        if rank == 0:
            assert shared is not None and gloo is not None
            out.append((shared, gloo))
        else:
            assert shared is None and gloo is None
    # Rank 0's commands: one past a slot (chunks), then a small one.
    big = torch.arange(shm.SLOT_FLOATS + 1000, dtype=torch.float32)
    if rank == 0:
        group.send(("forward", big, 7))
        group.send(("stop",))
    else:
        command = group.receive()
        assert command[0] == "forward" and torch.equal(command[1], big) and command[2] == 7
        assert group.receive() == ("stop",)
    # As bits in numpy arrays: a torch tensor crosses a Queue as a file
    # descriptor, which is gone once this process exits.
    queue.put((rank, [tuple(t.float().numpy().view(np.uint32).copy() for t in pair) for pair in out]))
    group.barrier()
    group.close()


def test_the_shared_memory_collectives_give_gloos_bits_on_every_rank() -> None:
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reduce_both_ways, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    sums, gathers = results[0][:4], results[0][4:]
    for (mine0, gloo0), (mine1, gloo1) in zip(sums, results[1], strict=True):
        assert np.array_equal(mine0, mine1)  # every rank the same bits
        assert np.array_equal(mine0, gloo0) and np.array_equal(gloo0, gloo1)  # gloo's (2 ranks: a + b)
    assert len(gathers) == 2
    for shared, gloo in gathers:
        assert shared.shape == gloo.shape and np.array_equal(shared, gloo)


_QUIET_RUN = """
import sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", skip_tokenizer_init=True, apply_process_settings=False,
          num_kv_blocks=64, tensor_parallel_size=2)
out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
print("triton" in sys.modules, [m for m in sys.modules if m.startswith("torch._dynamo")][:1])
"""


def test_a_cpu_run_imports_no_triton_and_exits_quietly(model_paths: dict[str, str]) -> None:
    """A CPU generation with tensor parallelism (rank 0 here, rank 1 its child)
    never imports triton (it came in through torch._dynamo, which arange on the
    meta device of a shard's skeleton imports), so exiting prints no nanobind
    "leaked" lines."""
    done = subprocess.run([sys.executable, "-c", _QUIET_RUN, model_paths["llama-uneven"]], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False []", done.stdout
    assert "leaked" not in done.stderr, done.stderr[-2000:]
