"""`tokenmill simulate calibrate`: time real engine steps here and fit a cost model.

The real engine (LLM's LLMEngine, the default model unless --model) runs small
synthetic scenarios, none of them a bench workload: prefills of 16 to 2048
tokens, decode batches of 1 to 128 rows at a short context and of 4 to 32 at
512 to 1024 tokens (attention's cost per K/V byte depends on the rows), and a
staggered one where prefills join running decodes (mixed steps), and static
batches of uneven lengths on a second engine (rows that sample without giving
out a token: what a token's detokenizing and output cost apart). Each
`step()` (schedule, forward, sampling, the scheduler's update, detokenizing:
what a step costs the engine loop) is timed with its shape read off the
SchedulerOutput, and cost_model.fit() fits the piecewise-linear model to them.

`--serve` then measures what the server adds (cost_model.py's serve_* terms):
it starts `tokenmill serve`, sends B concurrent streaming requests at once for
a few B (none of them a bench workload), and compares the client's median
inter-token latency and first-token time with the simulator's for the same
requests offline; the differences are fitted as a per-step overhead plus a
per-row one, and a fixed delay before a request reaches the engine.

`--from-roofline` instead derives a model for another machine from its read
bandwidth and matmul rate (the ceilings `tokenmill bench roofline` measures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.sim.cost_model import CostModel, ModelShape, StepShape, fit, from_roofline

# (requests, prompt tokens, output tokens, requests added per step; 0: all at once)
SCENARIOS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 0), (1, 64, 1, 0), (1, 256, 1, 0), (1, 1024, 1, 0), (1, 2048, 1, 0),
    (4, 128, 1, 0), (12, 128, 1, 0), (16, 128, 1, 0), (3, 200, 1, 0),
    (1, 64, 24, 0), (2, 64, 24, 0), (4, 64, 24, 0), (8, 64, 24, 0), (16, 64, 24, 0),
    (32, 64, 24, 0), (64, 64, 24, 0), (128, 64, 16, 0),
    (4, 768, 16, 0), (16, 768, 16, 0), (32, 512, 16, 0), (8, 1024, 16, 0),
    (40, 96, 40, 1), (24, 300, 30, 2),
)
# On a static-batching engine (max_num_seqs 32), output lengths 1 + (37 i) % N: batches
# of 32 as the bench's, where most rows are padding by the end.
STATIC_SCENARIOS: tuple[tuple[int, int, int, int], ...] = (
    (16, 64, 48, 0), (16, 256, 32, 0), (32, 128, 96, 0))


def run_scenarios(llm: Any, scenarios: tuple[tuple[int, int, int, int], ...],
                  rounds: int, uneven: bool = False) -> tuple[list[StepShape], list[float]]:
    """Time every step of every scenario, `rounds` times over (`uneven`: request i
    of a scenario of N output tokens asks for 1 + (37 i) % N)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    vocab = llm.model_info()["vocab_size"]
    shapes: list[StepShape] = []
    seconds: list[float] = []
    for r in range(rounds):
        for k, (num, prompt_len, out_len, per_step) in enumerate(scenarios):
            prompts = [[3 + (r * 7919 + k * 104729 + i * 131 + j * 17) % (vocab - 3)
                        for j in range(prompt_len)] for i in range(num)]
            lens = [1 + (37 * i) % out_len if uneven else out_len for i in range(num)]
            pending = list(zip(prompts, lens, strict=True))
            while pending or engine.has_unfinished_requests():
                for _ in range(per_step or len(pending)):
                    if pending:
                        prompt, n = pending.pop(0)
                        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                        engine.add_request(engine.new_request_id(),
                                           {"prompt_token_ids": prompt}, params)
                start = time.perf_counter()
                step = engine.schedule()
                result = engine.execute(step)
                elapsed = time.perf_counter() - start
                if step.scheduler_output.scheduled:
                    num_outputs = sum(1 for o in result.outputs
                                      if o.outputs and o.outputs[0].token_ids)
                    shapes.append(StepShape.of(step.scheduler_output, num_outputs))
                    seconds.append(elapsed)
    return shapes, seconds


SERVE_BATCHES = (1, 4, 16, 48)  # concurrent requests of the --serve probe
SERVE_PROMPT_TOKENS, SERVE_OUTPUT_TOKENS = 64, 48


def serve_probe(args: argparse.Namespace, cm: CostModel) -> CostModel:
    """Add the serve_* terms to a fitted model, measured against `tokenmill serve`."""
    import asyncio
    import statistics

    import numpy as np

    from tokenmill.bench import serve as serve_bench
    from tokenmill.sim.cost_model import nnls
    from tokenmill.sim.report import request_results
    from tokenmill.sim.simulator import EngineSettings, SimRequest, simulate

    port = serve_bench.free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--dtype", args.dtype, "--quantization", args.quantization, "--no-enable-prefix-caching"]
    if args.model:
        cmd += ["--model", args.model]
    measured: dict[int, list[Any]] = {}
    server = serve_bench.spawn_server(cmd, dict(os.environ), None)
    try:
        serve_bench.wait_healthy(server, base_url, 180.0, "tokenmill serve", "")
        model = serve_bench._first_model(base_url, None)
        for num in (1, *SERVE_BATCHES):  # (the first: a warm-up)
            prompts = [[3 + (num * 7919 + i * 131 + j * 17) % 40000
                        for j in range(SERVE_PROMPT_TOKENS)] for i in range(num)]
            results, _ = asyncio.run(serve_bench.run_rate(
                base_url, model, prompts, [SERVE_OUTPUT_TOKENS] * num, float("inf")))
            if not all(r.ok for r in results):
                raise RuntimeError(f"the --serve probe's requests failed: {results[0].error}")
            measured[num] = results
    finally:
        server.terminate()
        server.wait(timeout=30)

    def offline(num: int, model_: CostModel, serving: bool) -> list[Any]:
        prompts = [[3 + (num * 7919 + i * 131 + j * 17) % 40000
                    for j in range(SERVE_PROMPT_TOKENS)] for i in range(num)]
        reqs = [SimRequest(0.0, p, SERVE_OUTPUT_TOKENS) for p in prompts]
        settings = EngineSettings(max_num_seqs=128, max_num_batched_tokens=160, serving=serving)
        return request_results(simulate(reqs, settings, model_))

    def itl(results: list[Any]) -> float:
        return statistics.median(x for r in results for x in r.itl_s)

    gaps = {n: itl(measured[n]) - itl(offline(n, cm, False)) for n in SERVE_BATCHES}
    a = np.array([[1.0, float(n)] for n in SERVE_BATCHES])
    coef = nnls(a, np.array([gaps[n] for n in SERVE_BATCHES]))
    cm.serve_step_overhead_s, cm.serve_per_row_s = float(coef[0]), float(coef[1])
    ttft = statistics.median(r.ttft_s for r in measured[1])
    predicted = offline(1, cm, True)[0].ttft_s
    cm.serve_arrival_delay_s = max(ttft - predicted, 0.0)
    cm.provenance["serve"] = {
        "command": "tokenmill simulate calibrate " + " ".join(sys.argv[3:]),
        "batches": list(SERVE_BATCHES),
        "measured_itl_ms": {n: itl(measured[n]) * 1e3 for n in SERVE_BATCHES},
        "offline_itl_ms": {n: (itl(measured[n]) - gaps[n]) * 1e3 for n in SERVE_BATCHES},
        "measured_ttft_ms_b1": ttft * 1e3,
    }
    return cm


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--quantization", default="none",
                   help="the weights' format, as LLM takes it (default none: the bench's throughput "
                        "and serve runs dequantize the default GGUF; `gguf` for its own blocks)")
    p.add_argument("--rounds", type=int, default=2, help="times each scenario runs")
    p.add_argument("--output", default="sim-cost-model.json")
    p.add_argument("--serve", action="store_true",
                   help="measure what `tokenmill serve` adds to the fitted model at --output "
                        "(run after calibrating)")
    p.add_argument("--from-samples", default=None,
                   help="refit from the timed steps a calibration saved (OUTPUT.samples.json)")
    p.add_argument("--from-roofline", action="store_true",
                   help="derive the model from ceilings instead of timing steps")
    p.add_argument("--bandwidth-gb-s", type=float, default=None, help="read bandwidth (roofline)")
    p.add_argument("--matmul-gflop-s", type=float, default=None, help="matmul rate (roofline)")
    p.add_argument("--roofline-json", default=None,
                   help="take both ceilings from a `bench roofline` JSON (its best matmul rate)")
    p.add_argument("--step-overhead-ms", type=float, default=0.0,
                   help="(roofline) fixed cost of a step outside the forward")
    p.add_argument("--base", default=None,
                   help="(roofline) a cost model JSON whose model shape to use, instead of "
                        "loading the model")


def _model_shape(args: argparse.Namespace) -> tuple[ModelShape, Any]:
    if args.base:
        return CostModel.load(args.base).model, None
    from tokenmill import LLM

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=256,
              max_num_batched_tokens=2048, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)
    return ModelShape.from_model_info(llm.model_info()), llm


def main_calibrate(args: argparse.Namespace) -> int:
    provenance: dict[str, Any] = {
        "command": "tokenmill simulate calibrate " + " ".join(sys.argv[3:]),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.serve:
        cm = serve_probe(args, CostModel.load(args.output))
    elif args.from_roofline:
        bandwidth, rate = args.bandwidth_gb_s, args.matmul_gflop_s
        if args.roofline_json:
            ceilings = json.loads(Path(args.roofline_json).read_text())["ceilings"]
            bandwidth = bandwidth or ceilings["bandwidth_gb_s"]
            rate = rate or max(ceilings["matmul_gflop_s"].values())
        if not bandwidth or not rate:
            raise ValueError("--from-roofline needs --bandwidth-gb-s and --matmul-gflop-s "
                             "(or --roofline-json)")
        shape, _ = _model_shape(args)
        cm = from_roofline(shape, bandwidth, rate, args.step_overhead_ms / 1e3, provenance)
    elif args.from_samples:
        data = json.loads(Path(args.from_samples).read_text())
        shapes = [StepShape(**s) for s in data["shapes"]]
        provenance = {**data["provenance"], "refit": provenance["command"]}
        cm = fit(shapes, data["seconds"], ModelShape(**data["model"]), provenance=provenance)
    else:
        shape, llm = _model_shape(args)
        if llm is None:
            raise ValueError("--base is for --from-roofline; calibrating loads the model itself")
        from tokenmill.bench.throughput import reference_engine, reference_speed, time_reference

        # The speed reference the study's runs time too (bench/throughput.py), around the
        # fit: where the machine's speed has moved since, the study scales by it.
        ref = reference_engine(args.model, args.dtype, args.quantization)
        before = time_reference(ref)
        run_scenarios(llm, SCENARIOS[:3] + SCENARIOS[9:11], 1)  # warm-up, not kept
        shapes, seconds = run_scenarios(llm, SCENARIOS, args.rounds)
        del llm
        from tokenmill import LLM

        static = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=32,
                     max_num_batched_tokens=2048,
                     enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
                     scheduling_policy="static")
        run_scenarios(static, STATIC_SCENARIOS[:1], 1, uneven=True)  # warm-up, not kept
        more = run_scenarios(static, STATIC_SCENARIOS, args.rounds, uneven=True)
        shapes, seconds = shapes + more[0], seconds + more[1]
        provenance["dtype"] = args.dtype
        provenance["reference_s"] = reference_speed(before, time_reference(ref))
        samples = Path(args.output).with_suffix(".samples.json")
        samples.write_text(json.dumps({"model": asdict(shape), "provenance": provenance,
                                       "shapes": [asdict(s) for s in shapes],
                                       "seconds": seconds}) + "\n")
        cm = fit(shapes, seconds, shape, provenance=provenance)
    cm.save(args.output)
    print(json.dumps(cm.to_json(), indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
