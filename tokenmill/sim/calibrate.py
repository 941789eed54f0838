"""`tokenmill simulate calibrate`: time real engine steps here and fit a cost model.

The real engine (LLM's LLMEngine, the default model unless --model) runs small
synthetic scenarios, none of them a bench workload: prefills of 16 to 2048
tokens, decode batches of 1 to 128 rows at short and long contexts, and a
staggered one where prefills join running decodes (mixed steps). Each
`step()` (schedule, forward, sampling, the scheduler's update, detokenizing:
what a step costs the engine loop) is timed with its shape read off the
SchedulerOutput, and cost_model.fit() fits the piecewise-linear model to them.

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
    (4, 128, 1, 0), (12, 128, 1, 0), (3, 200, 1, 0),
    (1, 64, 24, 0), (2, 64, 24, 0), (4, 64, 24, 0), (8, 64, 24, 0), (16, 64, 24, 0),
    (32, 64, 24, 0), (64, 64, 24, 0), (128, 64, 16, 0),
    (4, 768, 16, 0), (16, 768, 16, 0), (48, 512, 12, 0),
    (40, 96, 40, 1), (24, 300, 30, 2),
)


def run_scenarios(llm: Any, scenarios: tuple[tuple[int, int, int, int], ...],
                  rounds: int) -> tuple[list[StepShape], list[float]]:
    """Time every step of every scenario, `rounds` times over."""
    from tokenmill import SamplingParams

    engine = llm.engine
    vocab = llm.model_info()["vocab_size"]
    shapes: list[StepShape] = []
    seconds: list[float] = []
    for r in range(rounds):
        for k, (num, prompt_len, out_len, per_step) in enumerate(scenarios):
            prompts = [[3 + (r * 7919 + k * 104729 + i * 131 + j * 17) % (vocab - 3)
                        for j in range(prompt_len)] for i in range(num)]
            params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
            pending = list(prompts)
            while pending or engine.has_unfinished_requests():
                for _ in range(per_step or len(pending)):
                    if pending:
                        engine.add_request(engine.new_request_id(),
                                           {"prompt_token_ids": pending.pop(0)}, params)
                start = time.perf_counter()
                step = engine.schedule()
                engine.execute(step)
                elapsed = time.perf_counter() - start
                if step.scheduler_output.scheduled:
                    shapes.append(StepShape.of(step.scheduler_output))
                    seconds.append(elapsed)
    return shapes, seconds


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--rounds", type=int, default=2, help="times each scenario runs")
    p.add_argument("--output", default="sim-cost-model.json")
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

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)
    return ModelShape.from_model_info(llm.model_info()), llm


def main_calibrate(args: argparse.Namespace) -> int:
    provenance: dict[str, Any] = {
        "command": "tokenmill simulate calibrate " + " ".join(sys.argv[3:]),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.from_roofline:
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
        run_scenarios(llm, SCENARIOS[:3] + SCENARIOS[8:10], 1)  # warm-up, not kept
        shapes, seconds = run_scenarios(llm, SCENARIOS, args.rounds)
        provenance["dtype"] = args.dtype
        samples = Path(args.output).with_suffix(".samples.json")
        samples.write_text(json.dumps({"model": asdict(shape), "provenance": provenance,
                                       "shapes": [asdict(s) for s in shapes],
                                       "seconds": seconds}) + "\n")
        cm = fit(shapes, seconds, shape, provenance=provenance)
    cm.save(args.output)
    print(json.dumps(cm.to_json(), indent=2))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
