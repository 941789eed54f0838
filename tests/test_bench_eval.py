"""`tokenmill bench eval`'s pieces that run without lm_eval: the task shipped in
the repository, the lm_eval command lines, and reading and comparing lm_eval's
output files (fakes written in the layout lm_eval 0.4.13 writes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from tokenmill.bench import eval as eval_bench
from tokenmill.cli import build_parser


def test_the_task_is_in_the_repository_and_well_formed() -> None:
    config = yaml.safe_load((eval_bench.TASK_DIR / f"{eval_bench.TASK}.yaml").read_text())
    assert config["task"] == eval_bench.TASK
    assert config["output_type"] == "multiple_choice"
    data = eval_bench.TASK_DIR / config["dataset_kwargs"]["data_files"][config["test_split"]]
    docs = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    assert len(docs) >= 50
    assert len({d["question"] for d in docs}) == len(docs)
    for d in docs:
        assert set(d) == {"question", "choices", "answer"}
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        assert 0 <= d["answer"] < 4
    # Answers spread over the positions: a model that prefers one position scores ~25%.
    counts = [sum(d["answer"] == k for d in docs) for k in range(4)]
    assert max(counts) - min(counts) <= 2, counts


def test_lmeval_command_lines(tmp_path: Path) -> None:
    args = eval_bench.local_completions_args("http://127.0.0.1:9", tmp_path / "tok")
    cmd = eval_bench.lmeval_command(Path("/venv/bin/python"), "local-completions", args,
                                    tmp_path / "out", 8, 5)
    assert cmd[:4] == ["/venv/bin/python", "-m", "lm_eval", "--model"]
    model_args = dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))
    assert model_args["base_url"] == "http://127.0.0.1:9/v1/completions"
    assert model_args["model"] == eval_bench.SERVED_NAME
    assert model_args["tokenizer"] == str(tmp_path / "tok")
    assert model_args["tokenized_requests"] == "True"
    assert cmd[cmd.index("--tasks") + 1] == eval_bench.TASK
    assert cmd[cmd.index("--include_path") + 1] == str(eval_bench.TASK_DIR)
    assert cmd[cmd.index("--limit") + 1] == "5" and "--log_samples" in cmd
    hf = eval_bench.lmeval_command(Path("p"), "hf", eval_bench.hf_args(tmp_path), tmp_path, 8, None)
    assert "--limit" not in hf
    assert hf[hf.index("--model_args") + 1] == f"pretrained={tmp_path},dtype=float32"
    serve = eval_bench.serve_command(1234, None, "float32")
    assert serve[serve.index("--served-model-name") + 1] == eval_bench.SERVED_NAME
    assert "--model" not in serve and serve[serve.index("--port") + 1] == "1234"


def write_fake_run(out: Path, model_folder: str, acc: float, loglikelihoods: list[list[float]]) -> None:
    folder = out / model_folder
    folder.mkdir(parents=True)
    task = eval_bench.TASK
    (folder / "results_2026-01-01T00-00-00.json").write_text(json.dumps({"results": {task: {
        "name": task, "alias": task, "sample_len": len(loglikelihoods),
        "acc,none": acc, "acc_stderr,none": 0.1, "acc_norm,none": acc / 2,
    }}}))
    with (folder / f"samples_{task}_2026-01-01T00-00-00.jsonl").open("w") as f:
        for doc_id, lls in enumerate(loglikelihoods):
            f.write(json.dumps({
                "doc_id": doc_id,
                "resps": [[[str(ll), "False"]] for ll in lls],
                "filtered_resps": [[str(ll), "False"] for ll in lls],
            }) + "\n")


def test_read_and_compare_runs(tmp_path: Path) -> None:
    write_fake_run(tmp_path / "a", "tokenmill-eval", 0.5, [[-1.0, -2.0], [-3.0, -4.0]])
    write_fake_run(tmp_path / "b", "__some__path", 0.5, [[-1.0, -2.00003], [-3.0, -4.0]])
    a = eval_bench.read_run(tmp_path / "a", "a")
    b = eval_bench.read_run(tmp_path / "b", "b")
    assert a.metrics == {"sample_len": 2.0, "acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.25}
    assert a.loglikelihoods == {(0, 0): -1.0, (0, 1): -2.0, (1, 0): -3.0, (1, 1): -4.0}
    diff = eval_bench.compare(a, b)
    assert diff["num_choices"] == 4
    assert diff["max_abs_diff"] == pytest.approx(3e-5)
    table = eval_bench.format_table([a, b], diff)
    assert "| a | 0.5000 | 0.2500 |" in table and "max |diff| 3.00e-05" in table
    write_fake_run(tmp_path / "c", "m", 0.5, [[-1.0, -2.0]])
    with pytest.raises(RuntimeError, match="different choices"):
        eval_bench.compare(a, eval_bench.read_run(tmp_path / "c", "c"))
    with pytest.raises(RuntimeError, match="no results"):
        eval_bench.read_run(tmp_path / "empty", "empty")


def test_the_command_is_wired_and_checks_its_models(tmp_path: Path) -> None:
    args = build_parser().parse_args(["bench", "eval", "--limit", "3", "--models", "hf"])
    assert args.func is eval_bench.main_eval and args.limit == 3
    bad = argparse.Namespace(**{**vars(args), "models": "vllm", "output_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="--models"):
        eval_bench.main_eval(bad)
