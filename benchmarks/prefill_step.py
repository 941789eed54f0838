"""One bf16 prefill step of the default model: R prompts of P tokens (min of 3): PYTHONPATH=. .venv/bin/python benchmarks/prefill_step.py 16 128 [profile]."""

from __future__ import annotations

import sys
import time

import torch

from tokenmill import LLM
from tokenmill.model.attention_metadata import AttentionMetadata


def main() -> None:
    reqs, plen, prof = int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3
    llm = LLM(None, dtype="bfloat16", quantization="none", max_num_seqs=256, skip_tokenizer_init=True)
    runner = llm.engine.runner
    model = runner.forward  # the forward the runner chose (the CPU plan here)
    bs = runner.block_size
    nb = -(-plen // bs)
    bt = torch.arange(reqs * nb).reshape(reqs, nb)
    pos = torch.arange(plen).repeat(reqs)
    req = torch.arange(reqs).repeat_interleave(plen)
    slot = bt[req, pos // bs] * bs + pos % bs
    meta = AttentionMetadata(num_decodes=0, query_start_loc=[i * plen for i in range(reqs + 1)],
                             seq_lens=[plen] * reqs, max_decode_seq_len=0, slot_mapping=slot,
                             block_tables=bt, decode_seq_lens=torch.zeros(0, dtype=torch.int64),
                             block_size=bs, token_seq_ids=req, token_seq_lens=pos + 1)
    ids = torch.randint(100, 40000, (reqs * plen,))
    rows = torch.tensor([(i + 1) * plen - 1 for i in range(reqs)])

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, runner.kv_caches, meta)[rows])

    with torch.inference_mode():
        step()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        dt = min(times)
        # 212 MFLOP a token: the default model's decoder layers (2 x parameters).
        print(f"R={reqs} P={plen}: step {dt * 1e3:.0f} ms, "
              f"{reqs * plen * 212e6 / dt / 1e9:.0f} GFLOP/s layers-equivalent")
        if prof:
            from torch.profiler import profile

            with profile() as p:
                step()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
