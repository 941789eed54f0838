"""`tokenmill bench all`: run the benchmark suite and write BENCHMARKS.md.

One command regenerates every table and plot in BENCHMARKS.md:
throughput-A for each policy and CAP (bf16, plus fp32 rows), the Hugging Face
peers, and serve-B against a tokenmill server this command starts itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench import serve as serve_bench
from tokenmill.bench import throughput
from tokenmill.bench.peers import PEERS
from tokenmill.bench.throughput import ThroughputRow


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return (f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB RAM, no GPU used; "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch threads")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_serve_against_tokenmill(args: argparse.Namespace, out: Path) -> list[serve_bench.RateReport]:
    """Start `tokenmill serve` on a free loopback port, run serve-B, stop it."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"`{shlex.join(cmd)}` exited with {server.returncode}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("the tokenmill server did not become healthy in 180 s")
        sargs = argparse.Namespace(
            base_url=base, model=None, rates=args.rates, num_requests=args.num_requests,
            workload="serve-B", slo_ttft_ms=None, slo_tpot_ms=None, api_key=None,
            label="tokenmill", output_dir=str(out))
        serve_bench.main_serve(sargs)
        data = json.loads((out / "serve-tokenmill.json").read_text())
        return [serve_bench.RateReport(**d) for d in data]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--caps", default="32,128,512")
    p.add_argument("--fp32-caps", default="32,128", help="caps for the fp32 rows ('' for none)")
    p.add_argument("--peer-caps", default="32,128", help="caps for the HF peers ('' for none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the markdown from the JSON already in --output-dir")
    p.add_argument("--output-dir", default="docs/bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")


def main_all(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "tokenmill " + shlex.join(a for a in sys.argv[1:] if a != "--report-only")

    def targs(dtype: str, caps: str) -> argparse.Namespace:
        return argparse.Namespace(model=args.model, caps=caps, policies=",".join(throughput.POLICIES),
                                  dtype=dtype, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  output_dir=str(out), workload="throughput-A")

    if not args.report_only:
        throughput.main_throughput(targs(args.dtype, args.caps))
    rows = [ThroughputRow(**d) for d in json.loads((out / f"throughput-{args.dtype}.json").read_text())]
    fp32_rows: list[ThroughputRow] = []
    if args.fp32_caps:
        if not args.report_only:
            throughput.main_throughput(targs("float32", args.fp32_caps))
        fp32_rows = [ThroughputRow(**d)
                     for d in json.loads((out / "throughput-float32.json").read_text())]
    peer_rows: list[ThroughputRow] = []
    if args.peer_caps:
        from tokenmill.bench import peers

        pargs = argparse.Namespace(model=args.model, caps=args.peer_caps, peers=",".join(PEERS),
                                   dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   output_dir=str(out))
        if not args.report_only:
            peers.main_peers(pargs)
        peer_rows = [ThroughputRow(**d)
                     for d in json.loads((out / f"peers-{args.dtype}.json").read_text())]
    serve_reports: list[serve_bench.RateReport] = []
    if args.report_only and (out / "serve-tokenmill.json").exists():
        serve_reports = [serve_bench.RateReport(**d)
                         for d in json.loads((out / "serve-tokenmill.json").read_text())]
    elif not args.skip_serve and not args.report_only:
        serve_reports = run_serve_against_tokenmill(args, out)

    md = [
        "# Benchmarks",
        "",
        f"Regenerated by one command: `{command.strip()}` (from the repository root, "
        "after `make setup`; `.venv/bin/tokenmill`). Workloads as defined in WORKLOADS.md.",
        "",
        f"- Written: {started} (each JSON file in the output folder carries its own results)",
        f"- Machine: {machine_description()}",
        f"- Model: {args.model or 'SmolLM2-135M-Instruct (the default GGUF, dequantized)'}; "
        f"max_num_seqs {args.max_num_seqs} for every policy, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}; each run in a fresh process, model load and a "
        "4-request warm-up excluded from the wall time.",
        "",
        f"## throughput-A ({args.dtype}): static vs continuous batching",
        "",
        "Ratios are generated tokens/s over `static` at the same CAP. `computed / delivered` "
        "counts tokens run through the model (static batching keeps computing finished members; "
        "recomputes after preemption count too) against prompt + generated tokens delivered.",
        "",
        throughput.format_table(rows),
        "",
        f"![throughput vs cap]({out.as_posix()}/throughput-{args.dtype}.png)",
        "",
    ]
    if fp32_rows:
        md += ["## throughput-A (float32)", "", throughput.format_table(fp32_rows), "",
               f"![throughput vs cap, fp32]({out.as_posix()}/throughput-float32.png)", ""]
    if peer_rows:
        md += ["## Peers: Hugging Face transformers on the same workload", "",
               "`hf-static`: `generate` on batches of max_num_seqs, each run to its longest member; "
               "`hf-continuous`: transformers' continuous batching manager. The ratio column is "
               "tokenmill continuous's generated tok/s over that row's.", "",
               throughput.format_table(peer_rows).replace("vs static", "tokenmill vs this"), ""]
    if serve_reports:
        md += ["## serve-B: latency under Poisson load (tokenmill's server)", "",
               f"{args.num_requests} streaming requests per rate; milliseconds.", "",
               serve_bench.format_table(serve_reports), "",
               f"![latency vs rate]({out.as_posix()}/serve-tokenmill.png)", ""]
    Path(args.markdown).write_text("\n".join(md))
    (out / "summary.json").write_text(json.dumps({
        "throughput": [asdict(r) for r in rows], "fp32": [asdict(r) for r in fp32_rows],
        "peers": [asdict(r) for r in peer_rows], "serve": [asdict(r) for r in serve_reports],
    }, indent=2))
    print(f"wrote {args.markdown}")
    return 0
