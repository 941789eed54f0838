"""`tokenmill bench study`'s arithmetic and commands (no timing: the runs are the bench's)."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.bench import study
from tokenmill.bench.throughput import ThroughputRow
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
    # From CAP 512 on, 32 mean reservations exceed the budget: memory-bound.
    assert "CAP 32: mean reservation 157 tokens, 32 of them 5,023" in text
    assert "CAP 512: mean reservation 259 tokens, 32 of them 8,275; the longest 640" in text
    assert "CAP 1536: mean reservation 259 tokens, 32 of them 8,302; the longest 704" in text


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
    args = argparse.Namespace(dtype="bfloat16", num_kv_blocks=512, max_num_seqs=32, model=None)
    cmd = study.serve_command(args, "static+reserved", 8123)
    assert cmd[cmd.index("serve") - 2:cmd.index("serve")] == ["-m", "tokenmill.cli"]
    serve_args = build_parser().parse_args(cmd[cmd.index("serve"):])
    engine = EngineArgs.from_cli_args(serve_args)
    assert (engine.scheduling_policy, engine.kv_allocation, engine.num_kv_blocks,
            engine.max_num_seqs, engine.enable_prefix_caching) == ("static", "reserved", 512, 32,
                                                                    False)
    paged = EngineArgs.from_cli_args(build_parser().parse_args(
        study.serve_command(args, "continuous", 8123)[3:]))
    assert (paged.scheduling_policy, paged.kv_allocation) == ("fcfs", "paged")


def test_bench_study_parses_and_refuses_an_unknown_configuration() -> None:
    args = build_parser().parse_args(["bench", "study", "--configs", "static,turbo"])
    with pytest.raises(ValueError, match="unknown \\['turbo'\\]"):
        study.main_study(args)
    args = build_parser().parse_args(["bench", "study"])
    assert args.caps == "32,128,512,1536" and args.configs.split(",") == list(study.CONFIGS)
