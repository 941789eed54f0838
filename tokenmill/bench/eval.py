"""`tokenmill bench eval`: lm-evaluation-harness against `tokenmill serve`, and
the same task through transformers beside it.

lm_eval scores multiple-choice tasks from log-likelihoods: through the server
its `local-completions` model sends `echo: true, logprobs: 1, max_tokens: 1`
with token-id prompts and sums the prompt logprobs of each choice's tokens;
its `hf` model runs transformers on the same weights. The task is
benchmarks/eval/tokenmill_mc (questions written for tokenmill, kept in the
repository: no hub data sets). The command reports both runs' accuracy and the
largest difference between their per-choice log-likelihoods.

lm_eval never enters tokenmill's environment: `ensure_lmeval_env` builds a
separate venv (default `<repo>/.venv-lmeval`, gitignored) and lm_eval runs as a
subprocess of its python. The default model is a GGUF file: it is converted once
into a Hugging Face directory (the vLLM peer's conversion), which gives lm_eval
its tokenizer and its `hf` model; tokenmill serves the GGUF itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.serve import free_port
from tokenmill.bench.vllm_peer import REPO_ROOT, ensure_venv, model_dir_for

LMEVAL_PACKAGE = "lm_eval[api,hf]==0.4.13"
STAMP_NAME = ".tokenmill-lmeval-stamp"
DEFAULT_VENV = REPO_ROOT / ".venv-lmeval"
TASK = "tokenmill_mc"
TASK_DIR = REPO_ROOT / "benchmarks" / "eval" / TASK
SERVED_NAME = "tokenmill-eval"
# Nothing is fetched: the task's data and the tokenizer are local.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list[str], what: str, **kwargs: Any) -> None:
    print(f"   $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): `{shlex.join(cmd)}`")


def ensure_lmeval_env(venv: Path = DEFAULT_VENV) -> Path:
    """Create and fill the lm_eval venv unless its stamp says it is done; returns its python."""
    return ensure_venv(venv, LMEVAL_PACKAGE, STAMP_NAME, "lm_eval")


# ---- the two lm_eval runs -----------------------------------------------------------------


def lmeval_command(python: Path, model: str, model_args: dict[str, Any], out_dir: Path,
                   batch_size: int, limit: int | None) -> list[str]:
    """`python -m lm_eval` on the repository's task, samples logged to out_dir."""
    cmd = [str(python), "-m", "lm_eval", "--model", model,
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", str(batch_size),
           "--output_path", str(out_dir), "--log_samples"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def local_completions_args(base_url: str, tokenizer_dir: Path) -> dict[str, Any]:
    """lm_eval's OpenAI-completions client against a tokenmill server: token-id
    prompts, tokenized by the model's own tokenizer (a local directory)."""
    return {"model": SERVED_NAME, "base_url": f"{base_url}/v1/completions",
            "tokenizer": str(tokenizer_dir), "tokenizer_backend": "huggingface",
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}


def hf_args(model_dir: Path) -> dict[str, Any]:
    return {"pretrained": str(model_dir), "dtype": "float32"}


@dataclass
class EvalRun:
    """One lm_eval run: the task's metrics, and each (doc, choice)'s log-likelihood."""

    label: str
    metrics: dict[str, float]
    loglikelihoods: dict[tuple[int, int], float] = field(default_factory=dict)


def _loglikelihood(resp: Any) -> float:
    """A choice's response as lm_eval logs it: [logprob, is_greedy] (maybe nested,
    maybe as strings)."""
    while isinstance(resp, list | tuple) and resp and isinstance(resp[0], list | tuple):
        resp = resp[0]
    return float(resp[0] if isinstance(resp, list | tuple) else resp)


def read_run(out_dir: Path, label: str) -> EvalRun:
    """The metrics and per-choice log-likelihoods lm_eval wrote under out_dir
    (results_*.json and samples_<task>_*.jsonl, in a folder named after the model)."""
    results = sorted(out_dir.rglob("results_*.json"))
    samples = sorted(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    if not results or not samples:
        raise RuntimeError(f"lm_eval wrote no results or samples for {TASK} under {out_dir}")
    task_metrics = json.loads(results[-1].read_text())["results"][TASK]
    metrics = {name.split(",")[0]: float(value) for name, value in task_metrics.items()
               if isinstance(value, int | float) and not isinstance(value, bool)}
    run = EvalRun(label, metrics)
    for line in samples[-1].read_text().splitlines():
        if not line.strip():
            continue
        sample = json.loads(line)
        for choice, resp in enumerate(sample["filtered_resps"]):
            run.loglikelihoods[(int(sample["doc_id"]), choice)] = _loglikelihood(resp)
    return run


def compare(a: EvalRun, b: EvalRun) -> dict[str, Any]:
    """How far two runs' per-choice log-likelihoods are apart."""
    if set(a.loglikelihoods) != set(b.loglikelihoods):
        raise RuntimeError(f"{a.label} and {b.label} scored different choices")
    diffs = [abs(a.loglikelihoods[k] - b.loglikelihoods[k]) for k in sorted(a.loglikelihoods)]
    return {"num_choices": len(diffs), "max_abs_diff": max(diffs, default=0.0),
            "mean_abs_diff": sum(diffs) / len(diffs) if diffs else 0.0}


def format_table(runs: list[EvalRun], diff: dict[str, Any] | None) -> str:
    lines = ["| lm_eval model | acc | acc_norm |", "|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.label} | {r.metrics.get('acc', float('nan')):.4f} "
                     f"| {r.metrics.get('acc_norm', float('nan')):.4f} |")
    if diff is not None:
        lines.append(f"\nper-choice log-likelihoods: {diff['num_choices']} compared, "
                     f"max |diff| {diff['max_abs_diff']:.2e}, mean {diff['mean_abs_diff']:.2e}")
    return "\n".join(lines)


# ---- the server ---------------------------------------------------------------------------


def serve_command(port: int, model: str | None, dtype: str) -> list[str]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--quantization", "none",
           "--served-model-name", SERVED_NAME]
    return cmd + (["--model", model] if model else [])


@contextlib.contextmanager
def running_server(cmd: list[str], base_url: str, log_path: Path,
                   startup_timeout_s: float = 300.0) -> Iterator[subprocess.Popen[bytes]]:
    """`cmd` as a subprocess until its /health answers; stopped (SIGTERM) on exit."""
    import httpx

    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"`{shlex.join(cmd)}` exited with {server.returncode}; "
                                   f"see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy in {startup_timeout_s:.0f} s; "
                                   f"see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# ---- the command --------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default GGUF)")
    p.add_argument("--dtype", default="float32", help="tokenmill's dtype (transformers runs float32)")
    p.add_argument("--models", default="local-completions,hf",
                   help="lm_eval model types to run: local-completions (through tokenmill) and/or hf")
    p.add_argument("--batch-size", type=int, default=8, help="lm_eval's --batch_size")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    p.add_argument("--venv", default=str(DEFAULT_VENV), help="the lm_eval venv (created on first use)")
    p.add_argument("--output-dir", default="docs/bench", help="where eval.json and the logs go")


def main_eval(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"local-completions", "hf"}
    if unknown or not models:
        raise ValueError(f"--models takes local-completions and/or hf, got {args.models!r}")
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    venv = Path(args.venv).resolve()
    python = ensure_lmeval_env(venv)
    model_dir = model_dir_for(args.model, venv)  # lm_eval's tokenizer, and its hf model
    env = {**os.environ, **OFFLINE_ENV}
    runs: list[EvalRun] = []
    for kind in models:
        run_dir = out / "lmeval" / kind  # (lm_eval's own files: gitignored under docs/bench)
        if kind == "local-completions":
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            with running_server(serve_command(port, args.model, args.dtype), base_url,
                                out / "eval-serve.log"):
                cmd = lmeval_command(python, kind, local_completions_args(base_url, model_dir),
                                     run_dir, args.batch_size, args.limit)
                # The task's data path is relative to its folder.
                _run(cmd, "lm_eval through tokenmill", cwd=TASK_DIR, env=env)
            label = f"local-completions (tokenmill serve, {args.dtype})"
        else:
            cmd = lmeval_command(python, kind, hf_args(model_dir), run_dir, args.batch_size,
                                 args.limit)
            _run([*cmd, "--device", "cpu"], "lm_eval on transformers", cwd=TASK_DIR, env=env)
            label = "hf (transformers, float32)"
        runs.append(read_run(run_dir, label))
    diff = compare(runs[0], runs[1]) if len(runs) == 2 else None
    shown_dir = model_dir.relative_to(REPO_ROOT) if model_dir.is_relative_to(REPO_ROOT) else model_dir
    report = {"task": TASK, "package": LMEVAL_PACKAGE, "model_dir": str(shown_dir),
              "runs": [{**asdict(r), "loglikelihoods": None} for r in runs], "comparison": diff}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(runs, diff))
    print(f"\nwrote {out / 'eval.json'}")
    return 0
