"""One prefill step: R prompts of P tokens through the default model (bf16), min of 3.
A 3rd argument profiles; a 4th runs attention the old way (per-request SDPA).

    PYTHONPATH=. .venv/bin/python scripts/prefill_step.py 16 128
"""
import sys, time, torch
from tokenmill import LLM
from tokenmill.model.attention_metadata import AttentionMetadata
R = int(sys.argv[1]); P = int(sys.argv[2]); prof = len(sys.argv) > 3
llm = LLM(None, dtype="bfloat16", max_num_seqs=256, skip_tokenizer_init=True)
runner = llm.engine.runner; model = runner.model; bs = runner.block_size
nb = -(-P // bs)
bt = torch.arange(R * nb).reshape(R, nb)
pos = torch.arange(P).repeat(R)
req = torch.arange(R).repeat_interleave(P)
slot = bt[req, pos // bs] * bs + pos % bs
meta = AttentionMetadata(num_decodes=0, query_start_loc=[i * P for i in range(R + 1)], seq_lens=[P] * R,
    max_decode_seq_len=0, slot_mapping=slot, block_tables=bt, decode_seq_lens=torch.zeros(0, dtype=torch.int64), block_size=bs, token_req=(req if len(sys.argv) < 5 else None), token_seq_lens=pos + 1)
ids = torch.randint(100, 40000, (R * P,))
rows = torch.tensor([(i + 1) * P - 1 for i in range(R)])
def step():
    h = model(ids, pos, runner.kv_caches, meta)
    return model.compute_logits(h[rows])
with torch.inference_mode():
    step()
    ts = []
    for _ in range(3):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    dt = min(ts)
    print(f"R={R} P={P}: step {dt*1e3:.0f} ms, {R*P*212e6/dt/1e9:.0f} GFLOP/s layers-equivalent")
    if prof:
        from torch.profiler import profile
        with profile() as p:
            step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
