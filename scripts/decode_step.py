"""One decode step of the default model (bf16) at batch B, context L: model.forward +
compute_logits on synthetic paged metadata, min of 10. Add a 3rd argument for a torch.profiler table.

    PYTHONPATH=. .venv/bin/python scripts/decode_step.py 128 264 [profile]
"""
import sys, time, torch
from tokenmill import LLM
from tokenmill.model.attention_metadata import AttentionMetadata
B = int(sys.argv[1]); L = int(sys.argv[2]); prof = len(sys.argv) > 3
import os
llm = LLM(None, dtype="bfloat16", max_num_seqs=256, skip_tokenizer_init=True, block_size=int(os.environ.get("BS", "16")))
runner = llm.engine.runner
model = runner.model
bs = runner.block_size
nb = -(-L // bs)
assert B * nb <= runner.num_blocks, (B*nb, runner.num_blocks)
bt = (torch.randperm(B * nb, generator=torch.Generator().manual_seed(0)) if os.environ.get("SCATTER") == "1" else torch.arange(B * nb)).reshape(B, nb)  # SCATTER=1: blocks as after churn
seq = torch.full((B,), L, dtype=torch.int64)
pos = seq - 1
slot = bt[torch.arange(B), pos // bs] * bs + pos % bs
meta = AttentionMetadata(num_decodes=B, query_start_loc=list(range(B + 1)), seq_lens=[L] * B,
    max_decode_seq_len=L, slot_mapping=slot, block_tables=bt, decode_seq_lens=seq, block_size=bs)
ids = torch.randint(100, 40000, (B,))
# fill caches with random data
for c in runner.kv_caches:
    c[:, : B * nb].normal_()
def step():
    h = model(ids, pos, runner.kv_caches, meta)
    return model.compute_logits(h)
with torch.inference_mode():
    for _ in range(3): step()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    dt = min(ts)
    print(f"B={B} L={L}: step {dt*1e3:.1f} ms")
    if prof:
        from torch.profiler import profile
        with profile() as p:
            for _ in range(5): step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
