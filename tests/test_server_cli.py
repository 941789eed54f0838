"""`tokenmill serve` as a process: it starts on the default model, answers the
openai client, and on SIGTERM lets a running stream finish, then exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.server_harness import start_server

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_serve_answers_and_shuts_down_gracefully_on_sigterm(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--served-model-name", "smol")
    process, url, log_path = server.process, server.url, server.log_path
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0,
        )
        assert "Paris" in (answer.choices[0].message.content or "")

        # A stream is running when SIGTERM comes: it finishes, then the process exits 0.
        stream = client.completions.create(
            model="smol", prompt="Once upon a time", max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        process.send_signal(signal.SIGTERM)
        rest = list(chunks)
        texts = [c.choices[0].text for c in [first, *rest] if c.choices]
        assert rest[-1].choices[0].finish_reason == "length"
        assert len(texts) >= 2
        assert process.wait(timeout=60) == 0, log_path.read_text()
        assert "shut down after SIGTERM" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_serve_help_lists_the_server_options() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--help"], capture_output=True,
        text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    for option in ("--host", "--port", "--api-key", "--served-model-name",
                   "--max-queued-requests", "--max-num-seqs", "--dtype", "--trust-request-chat-template"):
        assert option in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "99999"], "port must be in"),
    (["--max-queued-requests", "-1"], "max_queued_requests must be >= 1"),
    (["--dtype", "float16"], "float16"),
])
def test_serve_refuses_bad_options_before_loading_the_model(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", *args], capture_output=True,
        text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_takes_the_cpu_serving_budget_unless_given_one() -> None:
    from tokenmill.cli import build_parser, serve_engine_args
    from tokenmill.config import CPU_SERVE_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_BATCHED_TOKENS
    from tokenmill.engine.arg_utils import EngineArgs

    def serve(*argv: str) -> int:
        engine_args = serve_engine_args(build_parser().parse_args(["serve", *argv]))
        return engine_args.create_engine_configs()[2].max_num_batched_tokens

    assert serve() == CPU_SERVE_MAX_NUM_BATCHED_TOKENS == 160
    assert serve("--device", "cuda") == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert serve("--max-num-batched-tokens", "4096") == 4096
    # Never below max_num_seqs: every running request can decode in every step.
    assert serve("--max-num-seqs", "256") == 256
    assert serve_engine_args(build_parser().parse_args(["serve", "some-model"])).model == "some-model"
    # Offline (`tokenmill generate`, LLM) keeps the throughput default.
    generate = EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hello"]))
    assert generate.create_engine_configs()[2].max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
