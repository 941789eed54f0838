"""throughput-A with LoRA adapters against the base model: PYTHONPATH=. .venv/bin/python benchmarks/lora_throughput.py [--cap 128] [out.json]."""

# Three engines on the default model in bf16 (`--quantization none`, as
# throughput-A runs), each timed on throughput-A at one CAP after a 4-request
# warm-up: the base model; enable_lora with every request on the base model
# (the cost of the option alone: the C++ paths still run); and 8 rank-16
# adapters on q, k, v, o, gate, up and down (random A and B, written in PEFT's
# format for the model's shapes), request i on adapter i % 8, max_loras 8.

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.workloads import throughput_a
from tokenmill.config import ModelSpec
from tokenmill.model.lora import projection_shapes

NUM_ADAPTERS = 8
RANK = 16
TARGETS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", "gate"),
           "up_proj": ("gate_up_proj", "up"), "down_proj": ("down_proj", None)}


def write_adapter(directory: Path, spec: ModelSpec, seed: int) -> None:
    """A random rank-16 PEFT adapter on every target, for `spec`'s shapes."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(spec)
    tensors = {}
    for layer in range(spec.num_layers):
        for target, (projection, shard) in TARGETS.items():
            in_features, rows = shapes[projection]
            lo, hi = rows[shard]
            module = "self_attn" if projection in ("qkv_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, in_features, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(hi - lo, RANK, generator=gen) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}))


def run(name: str, cap: int, loras: list[LoRARequest] | None, **engine: Any) -> dict[str, Any]:
    workload = throughput_a(cap)
    llm = LLM(dtype="bfloat16", quantization="none", max_num_seqs=128, **engine)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    per_request = None if loras is None else [loras[i % len(loras)] for i in range(len(params))]
    warm = [[7 + i] * 16 for i in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=8), use_tqdm=False,
                 lora_request=None if loras is None else loras[:4])
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False,
                           lora_request=per_request)
    wall_s = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = {"name": name, "cap": cap, "wall_s": round(wall_s, 2), "generated_tokens": generated,
           "generated_tok_s": round(generated / wall_s, 1),
           "total_tok_s": round((generated + workload.num_prompt_tokens) / wall_s, 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    args = sys.argv[1:]
    cap = 128
    if args[:1] == ["--cap"]:
        cap, args = int(args[1]), args[2:]
    rows = [run("base", cap, None), run("enable_lora, base requests", cap, None, enable_lora=True)]
    with tempfile.TemporaryDirectory() as tmp:
        spec = LLM(dtype="bfloat16", quantization="none", num_kv_blocks=16).engine.spec
        loras = []
        for k in range(NUM_ADAPTERS):
            write_adapter(Path(tmp) / f"a{k}", spec, k)
            loras.append(LoRARequest(f"a{k}", k + 1, str(Path(tmp) / f"a{k}")))
        rows.append(run(f"{NUM_ADAPTERS} rank-{RANK} adapters", cap, loras, enable_lora=True,
                        max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
    if args:
        Path(args[0]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
