"""One bf16 decode step of the default model at batch B, context L (forward + logits, min of 10): PYTHONPATH=. .venv/bin/python benchmarks/decode_step.py 128 264 [profile]."""

# Synthetic paged metadata, random K/V. BS=16 sets the block size; SCATTER=1
# scatters each request's blocks as after churn (default: in order).

from __future__ import annotations

import os
import sys
import time

import torch

from tokenmill import LLM
from tokenmill.model.attention_metadata import AttentionMetadata


def main() -> None:
    batch, ctx, prof = int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3
    llm = LLM(None, dtype="bfloat16", quantization="none", max_num_seqs=256, skip_tokenizer_init=True,
              block_size=int(os.environ.get("BS", "16")))
    runner = llm.engine.runner
    model = runner.forward  # the forward the runner chose (the CPU plan here)
    bs = runner.block_size
    nb = -(-ctx // bs)
    assert batch * nb <= runner.num_blocks, (batch * nb, runner.num_blocks)
    if os.environ.get("SCATTER") == "1":
        order = torch.randperm(batch * nb, generator=torch.Generator().manual_seed(0))
    else:
        order = torch.arange(batch * nb)
    bt = order.reshape(batch, nb)
    seq = torch.full((batch,), ctx, dtype=torch.int64)
    pos = seq - 1
    slot = bt[torch.arange(batch), pos // bs] * bs + pos % bs
    meta = AttentionMetadata(num_decodes=batch, query_start_loc=list(range(batch + 1)),
                             seq_lens=[ctx] * batch, max_decode_seq_len=ctx, slot_mapping=slot,
                             block_tables=bt, decode_seq_lens=seq, block_size=bs)
    ids = torch.randint(100, 40000, (batch,))
    for cache in runner.kv_caches:
        cache[:, : batch * nb].normal_()

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, runner.kv_caches, meta))

    with torch.inference_mode():
        for _ in range(3):
            step()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print(f"B={batch} L={ctx}: step {min(times) * 1e3:.1f} ms")
        if prof:
            from torch.profiler import profile

            with profile() as p:
                for _ in range(5):
                    step()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
