"""The short soak (issue 37, issue 39): `tokenmill bench soak` for about a minute
against `tokenmill serve` on a tiny random Llama (the default model's tokenizer,
so chat and stop strings work) with a KV pool small enough that requests are
preempted all the time, in bf16. It fails on a 5xx, a request without progress
for 30 s, a cut stream, a block left in use, the server's RSS growing past a
bound, or (issue 51, --check-greedy) a greedy answer under that load unlike the
same prompt's answer on the idle server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.hf_models import COMMON
from tokenmill.bench import soak
from tokenmill.cli import build_parser
from tokenmill.model.source import default_model_path

# Tiny as the other tests' models, with the default model's vocabulary (its tokenizer).
VOCAB_SIZE = 49152
# 2 layers x (K, V) x 2 KV heads x 16 dims x 2 bytes (bf16) = 256 bytes per token: 512 tokens.
KV_BYTES = 128 << 10
RSS_DRIFT_MIB = 48  # growth allowed from the middle of the soak to its end
RSS_GROWTH_MIB = 200  # and from before the first request to the end


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": VOCAB_SIZE})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("tiny-soak")
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def test_short_soak_under_kv_pressure(tiny_model: str, tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    greedy = 4
    args = build_parser().parse_args([
        "bench", "soak", "--minutes", "0.5", "--concurrency", "8", "--max-tokens", "48",
        "--model", tiny_model, "--kv-cache-memory-bytes", str(KV_BYTES),
        "--serve-args", f"--tokenizer {default_model_path()} --dtype bfloat16",
        "--stall-s", "30", "--drain-s", "60", "--seed", "37",
        "--check-greedy", str(greedy), "--greedy-max-tokens", "40",
        "--server-log", str(tmp_path / "serve.log"), "--output", str(output),
    ])
    assert args.func(args) == 0, output.read_text()
    report = json.loads(output.read_text())
    print(soak.SoakReport(**{k: v for k, v in report.items() if k != "ok"}).summary())

    assert report["num_5xx"] == 0 and report["num_4xx"] == 0, report["problems"]
    assert report["num_transport_errors"] == 0 and report["num_unfinished"] == 0
    assert report["num_stalled"] == 0 and report["num_cut_streams"] == 0, report["problems"]
    assert report["kv_back_to_zero"], report["kv_usage_end"]
    rss = report["rss_mib"]
    assert rss["end"] - rss["mid"] < RSS_DRIFT_MIB, rss
    assert rss["end"] - rss["start"] < RSS_GROWTH_MIB, rss
    # The soak did what it is for: mixed traffic, dropped streams, constant preemption.
    assert report["num_requests"] >= 20
    assert report["num_dropped_streams"] >= 1
    assert report["num_streams"] - report["num_dropped_streams"] >= 5
    assert report["num_preemptions"] > 0
    # The greedy prompts came back as the idle server answered them, again and again.
    assert report["num_greedy_mismatches"] == 0, report["greedy_mismatches"]
    assert report["num_greedy_rounds"] >= 2 and report["num_greedy_checked"] == greedy * report["num_greedy_rounds"]
