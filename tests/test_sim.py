"""`tokenmill simulate`: the simulator runs core's real scheduler, is deterministic,
and static vs continuous comes out of it with nothing measured but a cost model."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.contracts import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.static_scheduler import StaticBatchScheduler
from tokenmill.sim.cost_model import CostModel, ModelShape, StepShape, fit, from_roofline
from tokenmill.sim.plan import evaluate, plan
from tokenmill.sim.report import rate_report, throughput_row
from tokenmill.sim.simulator import EngineSettings, SimRequest, simulate
from tokenmill.sim.workloads import load_requests, serve_b_requests, throughput_a_requests

# SmolLM2-135M's shape; the step prices below are made up, not measured.
MODEL = ModelShape(num_params=134_515_008, num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, hidden_size=576, vocab_size=49152, element_bytes=2,
                   max_model_len=8192)
COST = CostModel(kind="fitted", model=MODEL, knot_values_s=[0.006, 0.008, 0.012, 0.03, 0.1, 0.4],
                 per_sampled_row_s=1e-4, per_kv_byte_s=1e-11, per_prefill_pair_s=2e-8)


class Recording(Scheduler):
    """The production scheduler, recording what the simulator asks of it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.calls: list[tuple[str, int]] = []

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        self.calls.append(("schedule", out.num_scheduled_tokens))
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.calls.append(("update", len(runner_output.req_ids)))
        return super().update_from_output(scheduler_output, runner_output)


def test_the_simulator_drives_the_real_scheduler() -> None:
    made: list[Recording] = []

    def factory(sc: SchedulerConfig, cc: CacheConfig, num_blocks: int, max_len: int,
                num_spec: int) -> Scheduler:
        made.append(Recording(sc, cc, num_blocks, max_len, num_spec))
        return made[-1]

    requests = serve_b_requests(4.0, num_requests=16)
    result = simulate(requests, EngineSettings(max_num_batched_tokens=160), COST,
                      scheduler_factory=factory, check_integrity=True)
    (sched,) = made
    schedules = [n for name, n in sched.calls if name == "schedule"]
    updates = [n for name, n in sched.calls if name == "update"]
    # One schedule() then one update_from_output() per simulated step, in that order.
    assert [name for name, _ in sched.calls] == ["schedule", "update"] * len(result.steps)
    assert schedules == [s.num_tokens for s in result.steps]
    assert sum(schedules) == result.num_computed_tokens
    # Every sampled token the scheduler took came out as a request's token.
    assert sum(updates) == result.num_output_tokens == sum(r.output_len for r in requests)
    assert not sched.has_unfinished_requests()
    for trace, req in zip(result.requests, requests, strict=True):
        assert len(trace.token_times_s) == req.output_len and trace.finish_reason == "length"
        assert trace.token_times_s[0] > req.arrival_s


def test_static_and_continuous_compute_what_the_real_engine_computes() -> None:
    """Tokens computed and mean batch are the scheduler's alone: these are the
    numbers `tokenmill bench throughput` measured (BENCHMARKS.md, throughput-A)."""
    static = simulate(throughput_a_requests(512), EngineSettings("static", max_num_seqs=32), COST,
                      scheduler_factory=lambda *a: StaticBatchScheduler(*a[:4]))
    continuous = simulate(throughput_a_requests(512), EngineSettings("fcfs", max_num_seqs=32), COST)
    assert static.num_computed_tokens == 73564 and continuous.num_computed_tokens == 32973
    assert round(static.mean_batch_size, 1) == 32.0 and round(continuous.mean_batch_size, 1) == 22.2
    s_row = throughput_row(static, "static", 512, "bfloat16")
    c_row = throughput_row(continuous, "continuous", 512, "bfloat16")
    assert s_row.generated_tokens == c_row.generated_tokens == 16717
    # Only the cost model went in, and continuous batching wins by far at CAP 512.
    assert c_row.generated_tok_s > 1.8 * s_row.generated_tok_s


def test_a_simulated_run_is_deterministic() -> None:
    def once() -> str:
        result = simulate(serve_b_requests(2.0, num_requests=24),
                          EngineSettings(max_num_seqs=8, max_num_batched_tokens=64,
                                         num_kv_blocks=40), COST)
        return json.dumps(rate_report(result, 2.0).__dict__, sort_keys=True)

    first = once()
    assert once() == first
    assert "nan" not in first.lower()


def test_a_small_kv_pool_preempts_and_still_finishes_everyone() -> None:
    requests = [SimRequest(0.0, list(range(100, 164)), 64) for _ in range(12)]
    result = simulate(requests, EngineSettings(max_num_seqs=12, num_kv_blocks=30), COST,
                      check_integrity=True)
    assert result.num_preemptions > 0
    assert all(len(r.token_times_s) == 64 for r in result.requests)
    assert max(s.kv_cache_usage for s in result.steps) > 0.9


def test_reserved_kv_comes_with_the_real_kv_manager() -> None:
    # 512 blocks (8,192 tokens) for 32 seats: at CAP 512 the mean reservation
    # (prompt 128 + ~130) exceeds a seat's share, so reserving runs fewer at a
    # time than paging does, and never preempts. The policy is core's own.
    requests = throughput_a_requests(512)
    paged, reserved = (
        simulate(requests, EngineSettings(max_num_seqs=32, num_kv_blocks=512,
                                          kv_allocation=allocation), COST, check_integrity=True)
        for allocation in ("paged", "reserved"))
    assert paged.num_output_tokens == reserved.num_output_tokens == 16717
    assert reserved.num_preemptions == 0 < paged.num_preemptions
    assert reserved.mean_batch_size < paged.mean_batch_size - 3
    # Reserving the cap, prompt 128 + 512 = 640 tokens each: 12 run at a time.
    capped = simulate(requests, EngineSettings(max_num_seqs=32, num_kv_blocks=512,
                                               kv_allocation="reserved",
                                               kv_reserve_output_tokens=512),
                      COST, check_integrity=True)
    assert max(s.num_running for s in capped.steps) == 12
    assert capped.num_output_tokens == 16717 and capped.num_preemptions == 0
    # Through the CLI's settings: the bench's configuration names carry the option.
    from tokenmill.sim.cli import settings_for

    args = argparse.Namespace(max_num_seqs=None, max_num_batched_tokens=None, block_size=16,
                              num_kv_blocks=512, kv_cache_memory_bytes=4 << 30,
                              num_speculative_tokens=0, draft_acceptance_rate=0.5, reserve="cap")
    assert settings_for(args, True, "static+reserved").kv_allocation == "reserved"
    assert settings_for(args, True, "static+reserved", 1536).kv_reserve_output_tokens == 1536
    assert settings_for(args, True, "continuous", 1536).kv_reserve_output_tokens is None
    assert settings_for(args, True, "static+reserved").scheduling_policy == "static"
    assert settings_for(args, True, "continuous").kv_allocation == "paged"


def test_eos_ends_a_request_where_it_does_not_ignore_eos() -> None:
    requests = [SimRequest(0.0, [5] * 20, 7, ignore_eos=False, max_tokens=50),
                SimRequest(0.0, [6] * 20, 50, ignore_eos=False, max_tokens=9)]
    result = simulate(requests, EngineSettings(), COST)
    assert [len(r.token_times_s) for r in result.requests] == [7, 9]
    assert [r.finish_reason for r in result.requests] == ["stop", "length"]


def test_speculative_decoding_goes_through_the_scheduler() -> None:
    requests = serve_b_requests(1.0, num_requests=6)
    plain = simulate(requests, EngineSettings(), COST)
    runs = {rate: simulate(requests, EngineSettings(num_speculative_tokens=3,
                                                    draft_acceptance_rate=rate), COST,
                           check_integrity=True) for rate in (0.0, 0.7, 1.0)}
    for result in runs.values():
        assert [len(r.token_times_s) for r in result.requests] == [r.output_len for r in requests]
    # Every draft accepted: up to 4 tokens a step; none: as many steps (give or take
    # how arrivals fall), each computing 3 rejected drafts per request.
    assert len(runs[1.0].steps) < 0.4 * len(plain.steps)
    assert abs(len(runs[0.0].steps) - len(plain.steps)) < 0.05 * len(plain.steps)
    assert runs[0.0].num_computed_tokens > 2.5 * plain.num_computed_tokens - 6 * 128 * 2.5
    assert len(runs[1.0].steps) < len(runs[0.7].steps) < len(runs[0.0].steps)


def test_fit_recovers_a_known_cost_model() -> None:
    rng = random.Random(0)
    shapes = []
    for _ in range(200):
        n = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
        rows = rng.randint(1, min(n, 128))
        shapes.append(StepShape(n, rows, rows, rows * rng.randint(10, 600),
                                (n - rows) * rng.randint(10, 600)))
    fitted = fit(shapes, [COST.step_s(s) for s in shapes], MODEL)
    assert fitted.knot_values_s == pytest.approx(COST.knot_values_s, rel=1e-6)
    assert fitted.per_kv_byte_s == pytest.approx(COST.per_kv_byte_s, rel=1e-6)
    assert fitted.per_prefill_pair_s == pytest.approx(COST.per_prefill_pair_s, rel=1e-6)
    assert fitted.provenance["p90_rel_error"] < 1e-6


def test_roofline_model_is_memory_bound_small_and_compute_bound_large() -> None:
    roof = from_roofline(MODEL, bandwidth_gb_s=100.0, matmul_gflop_s=1000.0)
    one = roof.step_s(StepShape(1, 1, 1, 100))
    weights_s = MODEL.num_params * MODEL.element_bytes / 100e9
    assert one == pytest.approx(weights_s, rel=0.05)
    big = roof.step_s(StepShape(2048, 16, 16, 0, 2048 * 64))
    assert big > 5 * one
    # Twice the matmul rate halves a compute-bound step, and does nothing to a memory-bound one.
    fast = from_roofline(MODEL, bandwidth_gb_s=100.0, matmul_gflop_s=2000.0)
    assert fast.step_s(StepShape(2048, 16, 16, 0, 2048 * 64)) < 0.6 * big
    assert fast.step_s(StepShape(1, 1, 1, 100)) == pytest.approx(one)


def test_plan_adds_replicas_only_when_the_load_needs_them() -> None:
    base = EngineSettings()
    low, _ = plan(serve_b_requests(1.0, 48), COST, 1.0, 500.0, 15.0, base,
                  seqs=(32,), budgets=(160, 512))
    high, tried = plan(serve_b_requests(12.0, 48), COST, 12.0, 500.0, 15.0, base,
                       max_replicas=4, seqs=(32,), budgets=(160, 512))
    assert low is not None and low.replicas == 1
    assert high is not None and high.replicas > 1
    assert any(c.replicas == high.replicas - 1 and not c.meets_slo for c in tried)
    # The recommendation holds when simulated again.
    ttft, tpot, _ = evaluate(serve_b_requests(12.0, 48), COST,
                             EngineSettings(max_num_seqs=high.max_num_seqs,
                                            max_num_batched_tokens=high.max_num_batched_tokens),
                             high.replicas, 12.0)
    assert ttft["p99"] <= 500.0 and tpot["p99"] <= 15.0


def test_requests_from_json_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_time": 10.5, "prompt_tokens": 30, "output_tokens": 4}\n'
                    '{"arrival_time": 11.0, "prompt_token_ids": [7, 8, 9], "output_tokens": 2}\n')
    reqs = load_requests(path)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5]
    assert len(reqs[0].prompt_token_ids) == 30 and reqs[1].prompt_token_ids == [7, 8, 9]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"arrival_s": 0, "prompt_tokens": 3}]')
    with pytest.raises(ValueError, match="output_tokens"):
        load_requests(bad)


def test_cli_simulate_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    assert main(["simulate", "--workload", "serve-B", "--rates", "2", "--num-requests", "16",
                 "--cost-model", str(cost), "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "sim-serve.json").read_text())
    assert report["reports"][0]["num_ok"] == 16
    assert (tmp_path / "sim-serve.png").stat().st_size > 0
    assert (tmp_path / "sim-timeline-continuous-rate2.png").exists()
    assert main(["simulate", "plan", "--rate", "2", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50",
                 "--seqs", "32", "--budgets", "160", "--num-requests", "32",
                 "--cost-model", str(cost), "--output-dir", str(tmp_path)]) == 0
    assert "Cheapest: 1 replica(s)" in capsys.readouterr().out
    assert main(["simulate", "--cost-model", str(tmp_path / "none.json")]) == 2
    # Predictions beside a bench JSON: here the simulation's own rows, so every error is 0.
    assert main(["simulate", "--caps", "32", "--cost-model", str(cost),
                 "--output-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sim-throughput-bfloat16.json").read_text())["rows"]
    (tmp_path / "measured.json").write_text(json.dumps(rows))
    capsys.readouterr()
    assert main(["simulate", "--caps", "32", "--cost-model", str(cost), "--output-dir",
                 str(tmp_path), "--compare", str(tmp_path / "measured.json")]) == 0
    table = capsys.readouterr().out.split("| policy | cap | measured")[1]
    assert "| static | 32 |" in table and "+0.0%" in table and "1.00x / 1.00x" in table


def test_compare_with_a_study_takes_its_ratios_against_naive_static(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `bench study`'s JSON (rows under "rows"), measured = the simulation's own rows
    # with naive static made 2x slower: every ratio is against static+reserved.
    cost = tmp_path / "cost.json"
    COST.save(cost)
    args = ["simulate", "--caps", "32", "--policies", "static+reserved,static,continuous+reserved,"
            "continuous", "--num-kv-blocks", "512", "--cost-model", str(cost),
            "--output-dir", str(tmp_path)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "| vs static+reserved |" in table and "| static+reserved | 32 | bfloat16 |" in table
    rows = json.loads((tmp_path / "sim-throughput-bfloat16.json").read_text())["rows"]
    predicted = {r["policy"]: r["generated_tok_s"] for r in rows}
    for r in rows:
        assert r["ratio_vs_static"] == pytest.approx(
            r["generated_tok_s"] / predicted["static+reserved"])
    for r in rows:
        if r["policy"] == "static+reserved":
            r["generated_tok_s"] /= 2
    (tmp_path / "study.json").write_text(json.dumps({"budget": {}, "rows": rows}))
    assert main([*args, "--compare", str(tmp_path / "study.json")]) == 0
    out = capsys.readouterr().out
    compare = out.split("| policy | cap | measured")[1]
    assert "measured / predicted vs static+reserved |" in compare
    continuous = predicted["continuous"] / predicted["static+reserved"]
    assert f"| continuous | 32 | {predicted['continuous']:.1f} | {predicted['continuous']:.1f} | " \
           f"+0.0% | {2 * continuous:.2f}x / {continuous:.2f}x |" in compare
    decomposition = out.split("The seed's decomposition, measured / predicted:")[1]
    memory = predicted["continuous"] / predicted["continuous+reserved"]
    assert f"| {memory:.2f}x / {memory:.2f}x | {2 * continuous:.2f}x / {continuous:.2f}x |" \
        in decomposition


def test_the_simulator_needs_no_torch() -> None:
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, Block())
        from tokenmill.sim.cost_model import CostModel, ModelShape
        from tokenmill.sim.simulator import EngineSettings, simulate
        from tokenmill.sim.workloads import serve_b_requests
        m = ModelShape(1000, 2, 2, 1, 8, 16, 100, 2, 512)
        cm = CostModel(kind="fitted", model=m, knot_values_s=[1e-3] * 6)
        r = simulate(serve_b_requests(1.0, 4), EngineSettings(), cm)
        assert r.num_output_tokens > 0 and "torch" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_calibrate_times_every_step_of_the_real_engine(tmp_path: Path) -> None:
    from tests.hf_models import TEST_DEVICE, build_hf_model, save_hf_model
    from tokenmill import LLM
    from tokenmill.sim.calibrate import run_scenarios

    path = save_hf_model(build_hf_model("llama"), tmp_path / "llama")
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
              enable_prefix_caching=False, num_kv_blocks=64, block_size=16)
    shapes, seconds = run_scenarios(llm, ((1, 40, 1, 0), (4, 16, 6, 0), (6, 20, 5, 1)), rounds=1)
    assert len(shapes) == len(seconds) and all(s > 0 for s in seconds)
    assert shapes[0] == StepShape(num_tokens=40, num_rows=1, num_sampled_rows=1,
                                  num_kv_reads=0, num_prefill_pairs=40 * 41 // 2,
                                  num_output_rows=1)
    # 16 prompt tokens + 1 each; every row gives out its token.
    assert shapes[2] == StepShape(4, 4, 4, num_kv_reads=4 * 17, num_output_rows=4)
    # 4 prompts of 16 in one step, then 5 decode steps of 4 rows.
    assert [(s.num_tokens, s.num_rows) for s in shapes[1:7]] == [(64, 4)] + [(4, 4)] * 5
    cm = fit(shapes, seconds, ModelShape.from_model_info(llm.model_info()))
    assert all(cm.step_s(s) > 0 for s in shapes)
