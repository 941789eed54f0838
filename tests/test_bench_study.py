"""`tokenmill bench study`'s arithmetic and commands (no timing: the runs are the bench's)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tokenmill.bench import peers, study, throughput
from tokenmill.bench.serve import RateReport
from tokenmill.bench.throughput import ThroughputRow
from tokenmill.bench.workloads import throughput_a
from tokenmill.cli import build_parser
from tokenmill.engine.arg_utils import EngineArgs


def row(policy: str, cap: int, tok_s: float) -> ThroughputRow:
    return ThroughputRow(policy=policy, cap=cap, dtype="bfloat16", num_requests=128,
                         prompt_tokens=16384, generated_tokens=1000, wall_s=1000 / tok_s,
                         generated_tok_s=tok_s, total_tok_s=tok_s, computed_tokens=1,
                         mean_batch_size=1.0, num_steps=1, num_preemptions=0, peak_rss_mib=1.0)


def test_the_budget_is_every_seat_at_the_mean_request() -> None:
    assert study.kv_budget_tokens(32) == 8192
    text = study.describe_budget(32, 16, 512)
    assert text.startswith("KV budget: 512 blocks of 16 = 8,192 tokens = max_num_seqs 32 x "
                           "(prompt 128 + mean output 128)")
    # Reserving for the cap (the default): every seat up to CAP 128, then fewer.
    assert "CAP 128: each request reserves prompt + CAP = 256 tokens (256 in blocks): 32 run " \
           "at once reserved, of 32 seats" in text
    assert "CAP 512: each request reserves prompt + CAP = 640 tokens (640 in blocks): 12 run" in text
    assert "CAP 1536: each request reserves prompt + CAP = 1664 tokens (1664 in blocks): 4 run" \
        in text
    # Reserving each drawn length: from CAP 512 on, 32 mean reservations exceed the budget.
    exact = study.describe_budget(32, 16, 512, reserve="exact")
    assert "CAP 32: mean reservation 157 tokens, 32 of them 5,023" in exact
    assert "CAP 512: mean reservation 259 tokens, 32 of them 8,275; the longest 640" in exact
    assert "CAP 1536: mean reservation 259 tokens, 32 of them 8,302; the longest 704" in exact


def test_each_reserving_configuration_reserves_the_cap_unless_told_exact() -> None:
    opts = throughput.engine_options("continuous+reserved", 512, "cap")
    assert (opts["kv_allocation"], opts["kv_reserve_output_tokens"]) == ("reserved", 512)
    assert "kv_reserve_output_tokens" not in throughput.engine_options(
        "continuous+reserved", 512, "exact")
    assert "kv_reserve_output_tokens" not in throughput.engine_options("continuous", 512, "cap")
    with pytest.raises(ValueError, match="choose from"):
        throughput.engine_options("continuous", 512, "max")
    # The one-run command carries it to the subprocess, whose parser takes it.
    args = argparse.Namespace(dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=2048,
                              model=None, num_kv_blocks=512, reserve="exact")
    cmd = throughput.one_run_command(args, "static+reserved", 1536)
    assert cmd[cmd.index("--reserve") + 1] == "exact"


def test_the_decomposition_is_the_seed_s() -> None:
    rows = [row("static+reserved", 512, 100), row("static", 512, 120),
            row("continuous+reserved", 512, 250), row("continuous", 512, 400),
            row("continuous+prefix", 512, 410), row("continuous", 32, 300)]
    (d512,) = [d for d in study.decomposition(rows) if d["cap"] == 512]
    assert d512 == {"cap": 512, "scheduling": 2.5, "memory": 1.6, "total": 4.0,
                    "static_memory": 1.2, "prefix_total": 4.1}
    assert d512["scheduling"] * d512["memory"] == pytest.approx(d512["total"])
    (d32,) = [d for d in study.decomposition(rows) if d["cap"] == 32]
    assert d32["total"] is None  # no naive-static row at CAP 32
    table = study.format_decomposition(study.decomposition(rows))
    assert "| 512 | 2.50x | 1.60x | 4.00x | 1.20x | 4.10x |" in table
    assert "| 32 | - | - | - | - | - |" in table


def test_each_latency_configuration_is_a_server_with_the_study_s_budget() -> None:
    args = argparse.Namespace(dtype="bfloat16", num_kv_blocks=512, max_num_seqs=32, model=None,
                              max_num_batched_tokens=2048, reserve="cap")
    cmd = study.serve_command(args, "static+reserved", 8123)
    assert cmd[cmd.index("serve") - 2:cmd.index("serve")] == ["-m", "tokenmill.cli"]
    serve_args = build_parser().parse_args(cmd[cmd.index("serve"):])
    engine = EngineArgs.from_cli_args(serve_args)
    assert (engine.scheduling_policy, engine.kv_allocation, engine.num_kv_blocks,
            engine.max_num_seqs, engine.max_num_batched_tokens,
            engine.enable_prefix_caching) == ("static", "reserved", 512, 32, 2048, False)
    assert engine.kv_reserve_output_tokens == 128  # serve-B's requests are CAP 128's
    paged = EngineArgs.from_cli_args(build_parser().parse_args(
        study.serve_command(args, "continuous", 8123)[3:]))
    assert (paged.scheduling_policy, paged.kv_allocation) == ("fcfs", "paged")
    assert paged.kv_reserve_output_tokens is None
    prefix = EngineArgs.from_cli_args(build_parser().parse_args(
        study.serve_command(args, "continuous+prefix", 8123)[3:]))
    assert prefix.enable_prefix_caching


def test_bench_study_parses_and_refuses_an_unknown_configuration() -> None:
    args = build_parser().parse_args(["bench", "study", "--configs", "static,turbo"])
    with pytest.raises(ValueError, match="unknown \\['turbo'\\]"):
        study.main_study(args)
    args = build_parser().parse_args(["bench", "study", "--latency-configs", "naive"])
    with pytest.raises(ValueError, match="unknown \\['naive'\\]"):
        study.main_study(args)
    args = build_parser().parse_args(["bench", "study"])
    assert args.caps == "32,128,512,1536" and args.configs.split(",") == list(study.CONFIGS)
    # Latency for every configuration, continuous+prefix included.
    assert args.latency_configs.split(",") == list(study.CONFIGS)


def report(rate: float, done_req_s: float, ttft_p50_ms: float = 100.0, n: int = 64,
           ok: int = 64) -> RateReport:
    q = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return RateReport(rate=rate, num_requests=n, num_ok=ok, duration_s=n / done_req_s,
                      request_throughput=done_req_s, output_throughput=1.0,
                      total_token_throughput=1.0, goodput=None,
                      ttft_ms={**q, "p50": ttft_p50_ms, "p99": 2 * ttft_p50_ms}, tpot_ms=q,
                      itl_ms=q, e2e_ms={**q, "p50": 3 * ttft_p50_ms, "p99": 4 * ttft_p50_ms},
                      errors=[])


def test_the_rates_rise_from_the_measured_capacity() -> None:
    rows = [row("continuous", 128, 100.0), row("continuous", 32, 100.0)]
    rows[0].wall_s = 32.0  # 128 requests in 32 s: 4 req/s
    assert study.capacity_req_s(rows, "continuous") == 4.0
    assert study.capacity_req_s(rows, "static") is None  # not run at CAP 128
    assert study.rate_ladder(4.0, 0.5, 64) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0]
    assert study.rate_ladder(4.0, 0.5, 5.5) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert study.rate_ladder(1 / 3, 0.5, 64)[:2] == [0.0833, 0.167]  # 3 significant digits
    # No capacity: doubling from the start rate, up to the cap.
    assert study.rate_ladder(None, 0.5, 8) == [0.5, 1.0, 2.0, 4.0, 8.0]
    # Below capacity, the arrivals span what 64 take at capacity (16 at least).
    assert [study.requests_at(r, 4.0, 64) for r in (1.0, 2.0, 3.0, 4.0, 8.0)] == [
        16, 32, 48, 64, 64]
    assert study.requests_at(0.1, 4.0, 64) == 16 and study.requests_at(0.1, 4.0, 8) == 8
    assert study.requests_at(0.1, None, 64) == 64


def test_saturation_is_where_done_requests_stop_rising_or_ttft_passes_the_limit() -> None:
    rising = [report(1, 0.95), report(2, 1.9), report(3, 2.8)]
    assert study.saturation(rising[:1], 20000, 0.05) is None
    assert study.saturation(rising, 20000, 0.05) is None
    assert study.saturation([*rising, report(4, 2.9)], 20000, 0.05) is None  # one slow rate
    assert study.saturation([*rising, report(4, 2.7), report(5, 3.5)], 20000, 0.05) is None
    flat = [*rising, report(4, 2.9), report(5, 2.85)]
    assert study.saturation(flat, 20000, 0.05) == (
        "2.90 and 2.85 req/s done at 4 and 5 req/s, under 1.05 x the 2.80 done at 3")
    assert study.saturation([*rising, report(4, 3.5, ttft_p50_ms=25000)], 20000, 0.05) == (
        "p50 TTFT 25000 ms at 4 req/s, over the limit of 20000 ms")
    assert study.saturation([report(1, 0.9, ok=60)], 20000, 0.05) == (
        "4 of 64 requests failed at 1 req/s")
    curve = study.LatencyCurve("static", 3.2, "saturated: " + study.saturation(flat, 2e4, 0.05),
                               flat)
    table = study.format_latency([curve])
    assert "| static | 4 | 64 | 2.90 | 100 / 200 | 300 / 400 | 64/64 |" in table
    assert "- static (capacity 3.20 req/s offline): saturated: 2.90 and 2.85 req/s done" in table


def test_the_latency_figure_has_a_line_a_configuration(tmp_path: Path) -> None:
    curves = [study.LatencyCurve("static", 3.0, "x", [report(1, 1.0), report(2, 1.5)]),
              study.LatencyCurve("continuous", None, "y", [report(0.5, 0.5)])]
    study.plot_latency(curves, tmp_path / "latency.png")
    assert (tmp_path / "latency.png").stat().st_size > 10_000


def test_hf_static_batches_fit_the_kv_budget() -> None:
    # 4 requests of prompt 128: batches of max_num_seqs, or as many as fit the
    # budget at prompt + their batch's longest output (its cache's real size).
    prompts, outputs = [128] * 4, [10, 300, 20, 30]
    assert peers.static_batches(prompts, outputs, 32) == [range(0, 4)]
    assert peers.static_batches(prompts, outputs, 2) == [range(0, 2), range(2, 4)]
    # 2 x (128 + 300) = 856 > 800: the long one starts a batch, 3 x 428 > 800 ends it.
    assert peers.static_batches(prompts, outputs, 32, 800) == [
        range(0, 1), range(1, 2), range(2, 4)]
    with pytest.raises(ValueError, match="request 1 needs 428 tokens of K/V, more than the "
                                         "budget of 400"):
        peers.static_batches(prompts, outputs, 32, 400)
    # The study's budget at CAP 1536: every batch fits 8,192 tokens.
    w = throughput_a(1536)
    batches = peers.static_batches([len(p) for p in w.prompts], w.output_lens, 32, 8192)
    assert sum(len(b) for b in batches) == 128
    assert all(len(b) * (128 + max(w.output_lens[b.start:b.stop])) <= 8192 for b in batches)
    assert max(len(b) for b in batches) <= 32 and min(len(b) for b in batches) < 32
    # Sized for the cap, as naive static reserves it: 8,192 // (128 + 1536) = 4 a batch.
    capped = peers.static_batches([len(p) for p in w.prompts], w.output_lens, 32, 8192, 1536)
    assert {len(b) for b in capped} == {4} and len(capped) == 32
    cmd = peers.hf_command(argparse.Namespace(dtype="bfloat16", max_num_seqs=32, model=None),
                           "hf-static", 1536, 8192, 1536)
    assert cmd[cmd.index("--kv-budget-tokens") + 1] == "8192"
    assert cmd[cmd.index("--reserve-output-tokens") + 1] == "1536"


def test_the_run_time_is_estimated_by_the_simulator(tmp_path: Path) -> None:
    from tokenmill.sim import study_estimate
    from tokenmill.sim.cost_model import CostModel, ModelShape

    shape = ModelShape(num_params=134_515_008, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, hidden_size=576, vocab_size=49152, element_bytes=2,
                       max_model_len=8192)
    CostModel(kind="fitted", model=shape, knot_values_s=[0.01, 0.01, 0.02, 0.08, 0.3, 1.2],
              per_sampled_row_s=3e-5).save(tmp_path / "cost.json")
    args = build_parser().parse_args(["bench", "study", "--caps", "32,128", "--cost-model",
                                      str(tmp_path / "cost.json"), "--peers", "hf-static",
                                      "--latency-configs", "continuous"])
    args.num_kv_blocks = 512
    guess = study_estimate.estimate(args)
    parts = guess.parts
    assert set(parts) == {"throughput", "peers", "latency"}
    # Every run's start is priced on top of its simulated wall time.
    assert parts["throughput"] > 10 * study_estimate.RUN_START_S
    assert parts["peers"] > 2 * study_estimate.HF_START_S
    assert parts["latency"] > study_estimate.SERVER_START_S
    assert "cost.json (bfloat16)" in guess.how
    # The same simulations predict every configuration's row, ratios against naive static.
    assert [(r.policy, r.cap) for r in guess.rows] == [
        (c, cap) for cap in (32, 128) for c in study.CONFIGS]
    assert parts["throughput"] == pytest.approx(
        sum(r.wall_s + study_estimate.RUN_START_S for r in guess.rows))
    (naive,) = [r for r in guess.rows if r.policy == study.NAIVE_STATIC and r.cap == 128]
    assert naive.ratio_vs_static == 1.0 and naive.generated_tokens > 0
    args.cost_model = str(tmp_path / "none.json")
    assert study_estimate.estimate(args).parts == {}


def test_the_prediction_table_puts_measured_beside_predicted() -> None:
    measured = [row("static+reserved", 512, 100.0), row("continuous", 512, 200.0),
                row("continuous", 1536, 180.0)]
    predicted = [row("static+reserved", 512, 110.0), row("continuous", 512, 190.0)]
    table = study.format_prediction(measured, predicted)
    assert table.splitlines()[0] == "| CAP | static+reserved | continuous |"
    assert "| 512 | 100.0 / 110.0 (+10%) | 200.0 / 190.0 (-5%) |" in table
    assert "| 1536 | - | 180.0 / - |" not in table and "| 1536 | - | - |" in table


def test_the_study_calibrates_the_simulator_in_its_own_sitting(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    args = build_parser().parse_args(["bench", "study", "--dtype", "float32", "--model", "m.gguf"])
    path = study.calibrate(args, tmp_path)
    assert path == str(tmp_path / "sim-cost-float32.json")
    (cmd,) = ran
    assert cmd[1:3] == ["-m", "tokenmill.cli"]
    calibrate_args = build_parser().parse_args(cmd[3:])
    assert (calibrate_args.dtype, calibrate_args.output, calibrate_args.model) == (
        "float32", path, "m.gguf")
    assert not calibrate_args.serve and calibrate_args.quantization == "none"


def test_predictions_are_put_at_each_run_s_speed() -> None:
    measured = [row("static+reserved", 512, 100.0), row("continuous", 512, 200.0),
                row("static", 512, 150.0)]
    measured[0].reference_s, measured[1].reference_s = 2.0, 1.0  # static: not timed
    predicted = [row("static+reserved", 512, 110.0), row("continuous", 512, 190.0),
                 row("static", 512, 140.0)]
    # Fitted at 1.0 s: the first run saw the machine at half its speed.
    scaled = study.at_run_speed(measured, predicted, reference_s=1.0)
    assert [(r.policy, r.generated_tok_s) for r in scaled] == [("static+reserved", 55.0),
                                                               ("continuous", 190.0)]
    assert scaled[0].wall_s == pytest.approx(2 * predicted[0].wall_s)
    assert scaled[1].ratio_vs_static == pytest.approx(190.0 / 55.0)
    assert predicted[0].generated_tok_s == 110.0  # the unscaled rows stay as they were
    assert study.at_run_speed(measured, predicted, reference_s=None) == []


def test_the_speed_reference_times_the_same_batch_on_any_model(tmp_path: Path) -> None:
    from tests.hf_models import build_hf_model, save_hf_model
    from tokenmill.bench.throughput import (
        REFERENCE_REPEATS,
        reference_engine,
        reference_speed,
        time_reference,
    )

    path = save_hf_model(build_hf_model("llama"), tmp_path / "llama")
    llm = reference_engine(path, "float32")
    times = time_reference(llm)
    assert len(times) == REFERENCE_REPEATS and min(times) > 0
    stats = llm.last_generate_stats
    assert stats.num_preemptions == 0 and stats.mean_batch_size > 8
    # A run's speed: the median of the runs before and after it, one slow side moving it little.
    assert reference_speed([1.0, 1.1, 1.0], [1.05, 3.0, 1.02]) == pytest.approx(1.035)
