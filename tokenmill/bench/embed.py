"""embed-A: embedding throughput offline, tokenmill beside vLLM-CPU and
sentence-transformers on one model (docs/WORKLOADS.md "embed-A").

A retrieval pipeline's ingestion embeds many chunks at once, so what counts is
inputs a second with all of them submitted together. The model is a random-weight
BERT of bge-small-en-v1.5's shape (speed does not depend on the values) with a
WordPiece vocabulary of its size written here, CLS pooling and normalisation as
bge's sentence-transformers files say. Every engine gets the same token ids, so
tokenizing stays outside the timing, and each run is a fresh process.

    python -m tokenmill.bench.embed --one ENGINE --model DIR ...   # one run: a JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import vllm_peer
from tokenmill.bench.workloads import EMBED_SPECIALS, embed_a

# BAAI/bge-small-en-v1.5's config.json, the values that set its cost.
BGE_SMALL: dict[str, Any] = {
    "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 1536, "max_position_embeddings": 512, "type_vocab_size": 2,
    "hidden_act": "gelu", "layer_norm_eps": 1e-12,
}
DONE_NAME = ".random-model"  # written last: a directory without it is unfinished
ENGINES = ("tokenmill", "vllm-cpu", "sentence-transformers")
NUM_PROBES = 8  # the first inputs' embeddings, compared across engines
WARMUP = [[2, *range(10, 40), 3]] * 4  # 4 short inputs before the timing, as throughput-A warms up


@dataclass
class EmbedRow:
    engine: str
    dtype: str
    num_inputs: int
    num_tokens: int
    wall_s: float
    inputs_per_s: float
    tokens_per_s: float
    peak_rss_mib: float
    # How the engine batched (its resolved settings), and every repeat's inputs/s.
    settings: dict[str, Any] = field(default_factory=dict)
    # The largest |difference| of the probe embeddings from tokenmill's (None for tokenmill).
    max_abs_diff: float | None = None


def write_model(out_dir: Path, config: dict[str, Any] | None = None) -> Path:
    """The random bge-small-shaped BERT (or `config`'s), its vocabulary and
    sentence-transformers' pooling files in `out_dir` (float32 safetensors,
    ~130 MB at bge-small's shape); done once."""
    config = {**BGE_SMALL, **(config or {})}
    if (out_dir / DONE_NAME).exists():
        return out_dir
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(config["vocab_size"] - len(EMBED_SPECIALS))]
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate([*EMBED_SPECIALS, *words])},
                               do_lower_case=True, model_max_length=config["max_position_embeddings"]
                               ).save_pretrained(out_dir)
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**config)).eval().save_pretrained(out_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": config["max_position_embeddings"], "do_lower_case": True}))
    (out_dir / DONE_NAME).write_text(json.dumps(config) + "\n")
    return out_dir


def _result(wall: float, embeddings: list[list[float]], settings: dict[str, Any]) -> dict[str, Any]:
    return {"wall_s": wall, "num_outputs": len(embeddings),
            "probes": [list(map(float, e)) for e in embeddings[:NUM_PROBES]],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "settings": settings}


def run_tokenmill(model: str, dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                  apply_process_settings: bool = True) -> dict[str, Any]:
    """embed-A through `LLM.embed`, in this process (a benchmark's process takes
    tokenmill's thread settings; a test's keeps its own)."""
    from tokenmill import LLM

    llm = LLM(model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max_num_seqs, apply_process_settings=apply_process_settings)
    llm.embed([{"prompt_token_ids": p} for p in WARMUP], use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in embed_a()]
    start = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.last_generate_stats
    return _result(wall, [o.outputs.embedding for o in outputs], {
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
        "num_steps": stats.num_steps, "mean_batch_size": round(stats.mean_batch_size, 1)})


def run_sentence_transformers(model: str, dtype: str, batch_size: int) -> dict[str, Any]:
    """embed-A through sentence-transformers' `encode` on the same token ids (its
    model called on padded batches of `batch_size`, as `encode` runs them, in
    the input order; its modules pool and normalise)."""
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})

    def encode(inputs: list[list[int]]) -> list[list[float]]:
        out: list[list[float]] = []
        with torch.inference_mode():
            for i in range(0, len(inputs), batch_size):
                batch = inputs[i:i + batch_size]
                width = max(map(len, batch))
                ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
                mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
                features = st({"input_ids": ids, "attention_mask": mask,
                               "token_type_ids": torch.zeros_like(ids)})
                out += features["sentence_embedding"].float().tolist()
        return out

    encode(WARMUP)
    inputs = embed_a()
    start = time.perf_counter()
    embeddings = encode(inputs)
    wall = time.perf_counter() - start
    return _result(wall, embeddings, {"batch_size": batch_size, "torch_threads": torch.get_num_threads()})


def run_vllm(python: Path, model: Path, dtype: str, max_num_batched_tokens: int,
             max_num_seqs: int, env: dict[str, str]) -> dict[str, Any]:
    """embed-A through `vllm.LLM.embed`, in the vLLM venv's python (vllm_runner.py)."""
    spec = {"task": "embed", "model": str(model), "dtype": dtype, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "prompts": embed_a(),
            "warmup": WARMUP, "num_probes": NUM_PROBES}
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(vllm_peer.RUNNER), str(spec_path), str(result_path)]
        proc = subprocess.run(cmd, stdout=sys.stderr, env={**os.environ, **env}, check=False)
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"the vLLM embed run failed (exit {proc.returncode})")
        result: dict[str, Any] = json.loads(result_path.read_text())
    result["settings"] = {**result["settings"], "package": vllm_peer.VLLM_PACKAGE, "env": env}
    return result


def one_command(args: argparse.Namespace, engine: str, model: Path) -> list[str]:
    return [sys.executable, "-m", "tokenmill.bench.embed", "--one", engine, "--model", str(model),
            "--dtype", args.dtype, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--batch-size", str(args.batch_size)]


def run_engine(args: argparse.Namespace, engine: str, model: Path) -> dict[str, Any]:
    """One timed run of `engine` in a fresh process."""
    print(f"== embed-A, {engine}, {args.dtype}", file=sys.stderr, flush=True)
    if engine == "vllm-cpu":
        venv = Path(args.vllm_venv or vllm_peer.DEFAULT_VENV)
        return run_vllm(vllm_peer.ensure_vllm_env(venv), model, args.dtype,
                        args.max_num_batched_tokens, args.max_num_seqs, vllm_peer.vllm_env(venv))
    proc = subprocess.run(one_command(args, engine, model), stdout=subprocess.PIPE, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {engine} embed run failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def make_row(engine: str, dtype: str, tries: list[dict[str, Any]]) -> EmbedRow:
    """The fastest of an engine's runs, every run's inputs/s in its settings."""
    inputs = embed_a()
    best = min(tries, key=lambda t: t["wall_s"])
    if best["num_outputs"] != len(inputs):
        raise RuntimeError(f"{engine} returned {best['num_outputs']} embeddings for {len(inputs)} inputs")
    tokens = sum(map(len, inputs))
    settings = {**best["settings"], "runs_inputs_per_s": [round(len(inputs) / t["wall_s"], 2)
                                                          for t in tries]}
    return EmbedRow(engine, dtype, len(inputs), tokens, best["wall_s"], len(inputs) / best["wall_s"],
                    tokens / best["wall_s"], best["peak_rss_mib"], settings)


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ea, eb in zip(a, b, strict=True) for x, y in zip(ea, eb, strict=True))


def format_table(rows: list[EmbedRow]) -> str:
    base = next((r for r in rows if r.engine == "tokenmill"), None)
    lines = ["| engine | dtype | wall s | inputs/s | tokens/s | tokenmill vs it | peak RSS MiB | "
             "max abs diff vs tokenmill |", "|" + "---|" * 8]
    for r in rows:
        vs = f"{base.inputs_per_s / r.inputs_per_s:.2f}x" if base and r is not base else "-"
        diff = f"{r.max_abs_diff:.1e}" if r.max_abs_diff is not None else "-"
        lines.append(f"| {r.engine} | {r.dtype} | {r.wall_s:.1f} | {r.inputs_per_s:.2f} | "
                     f"{r.tokens_per_s:.0f} | {vs} | {r.peak_rss_mib:.0f} | {diff} |")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="float32 (default): on a CPU without AVX512-BF16 every engine is fastest in it")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokenmill's and vLLM's token budget a step (a whole input must fit)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' (its default)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each engine, interleaved; the fastest is reported")
    p.add_argument("--model-dir", default=None,
                   help="where the random model is written (default: bench-results/bge-small)")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--output", default=None, help="a JSON file for the rows")


def main_embed(args: argparse.Namespace) -> int:
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or args.repeats < 1:
        raise ValueError(f"--engines: unknown {unknown}; choose from {list(ENGINES)}"
                         if unknown else "--repeats must be at least 1")
    model = write_model(Path(args.model_dir or vllm_peer.REPO_ROOT / "bench-results" / "bge-small"))
    tries: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:
            tries[engine].append(run_engine(args, engine, model))
    rows = [make_row(e, args.dtype, tries[e]) for e in engines]
    if "tokenmill" in tries:
        ref = tries["tokenmill"][0]["probes"]
        for row in rows:
            if row.engine != "tokenmill":
                row.max_abs_diff = max_abs_diff(ref, tries[row.engine][0]["probes"])
    inputs = embed_a()
    print(f"\nembed-A: {len(inputs)} inputs, {sum(map(len, inputs))} tokens, bge-small-en-v1.5's shape "
          f"(random weights), {args.dtype}, best of {args.repeats}\n\n" + format_table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


def _main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--one", choices=[e for e in ENGINES if e != "vllm-cpu"], required=True)
    p.add_argument("--model", required=True)
    add_args(p)
    args = p.parse_args()
    if args.one == "tokenmill":
        result = run_tokenmill(args.model, args.dtype, args.max_num_batched_tokens, args.max_num_seqs)
    else:
        result = run_sentence_transformers(args.model, args.dtype, args.batch_size)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
