"""`tokenmill bench lora` (lora-A) end to end on a tiny model: the adapters it
writes from model_info's shapes load, every run is timed in its order, and the
ratios are of the rows it reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tests.test_bench_sizes import TINY
from tokenmill import default_model_path
from tokenmill.bench import lora, random_model


def test_bench_lora_on_a_tiny_model(tmp_path: Path) -> None:
    # A tiny Llama with the default model's tokenizer (throughput-A's ids are in its vocabulary).
    path = str(random_model.write_random_model(TINY, tmp_path / "base", Path(default_model_path())))
    out = tmp_path / "lora.json"
    args = argparse.Namespace(model=path, cap=8, quantizations="none", peers="", num_adapters=2, rank=4,
                              max_num_seqs=16, repeats=2, vllm_venv=None, output=str(out))
    assert lora.main_lora(args) == 0
    result = json.loads(out.read_text())
    runs = ["base requests", "adapters"] + ["one stream, base", "one stream, adapter 0"] * lora.ONE_STREAM_PAIRS
    assert [r["name"] for r in result["rows"]] == ["tokenmill none: base engine"] + [
        f"tokenmill none: {name}" for name in runs] * 2
    assert [r["generated_tokens"] for r in result["rows"][3:5]] == [lora.ONE_STREAM_TOKENS] * 2
    ratio = result["ratios"]["tokenmill none"]
    assert ratio["adapters / base requests"] == round(
        lora.best(result["rows"], "tokenmill none: adapters")
        / lora.best(result["rows"], "tokenmill none: base requests"), 3)
    assert ratio["adapters / base engine"] == round(
        lora.best(result["rows"], "tokenmill none: adapters")
        / lora.best(result["rows"], "tokenmill none: base engine"), 3)
    # one stream: the median of the pairs, each adapter run against the base run just before it
    one = [r["generated_tok_s"] for r in result["rows"] if "one stream" in r["name"]]
    pairs = sorted(a / b for b, a in zip(one[0::2], one[1::2], strict=True))
    assert len(pairs) == 2 * lora.ONE_STREAM_PAIRS
    assert ratio["one stream, adapter / base"] == round((pairs[len(pairs) // 2 - 1] + pairs[len(pairs) // 2]) / 2, 3)
    assert ratio["one stream pairs, quartiles"][0] <= ratio["one stream, adapter / base"] <= ratio[
        "one stream pairs, quartiles"][2]
    assert "| tokenmill none | " in lora.format_table(result["rows"], ["tokenmill none"])
