"""A GGUF file's tokenizer in tokenmill against llama.cpp's own (a maintainer check,
not a test: it runs llama-server). Every string is encoded without special tokens
by tokenmill.tokenizer.Tokenizer (transformers' conversion of the file's
vocabulary: for a SentencePiece file such as Gemma's, its scores-ordered merges,
byte fallback and add_space_prefix) and by llama-server's /tokenize on the same
file; the strings mix unicode, whitespace runs, digits and code.

  PYTHONPATH=. python benchmarks/gguf_tokenizer_check.py [FILE.gguf] [--llama-server PATH]

Without a file: Gemma 3 270M Q4_K_M (model.source.gemma3_270m_path, `make setup`).
Measured on that file: 354 strings, none differ.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import time
import urllib.request

from tokenmill import envs
from tokenmill.model.source import gemma3_270m_path
from tokenmill.tokenizer import Tokenizer

PIECES = ["hello", "world", " ", "  ", "   ", "\t", "\n", "\n\n", "123", "4567", "3.14159", "2024-01-02",
          "café", "naïve", "日本語", "中文字符", "한국어", "Привет", "😀", "🚀🚀", "x=(a+b)*c;", "def f(x):",
          "    return x", '{"k": [1, 2]}', "<div class='a'>", "__init__", "snake_case", "CamelCase", "ALLCAPS",
          "don't", "I'm", "\u00a0", "a\u200bb", "ﬁ", "Ⅻ", "½", "१२३", "٣٤٥", "ǅ", "e\u0301", "Å", "\r\n",
          "http://x.org/a?b=c", "#include <stdio.h>", "λx.x", "∑_{i=1}^n", "1,000,000", "$100", "50%", "...",
          "--", "—", "«»", "‘’"]


def strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return PIECES + ["".join(rng.choice(PIECES) for _ in range(rng.randint(2, 12))) for _ in range(count)]


def llama_tokens(port: int, text: str) -> list[int]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize",
                                     data=json.dumps({"content": text, "add_special": False}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return list(json.load(answer)["tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="a .gguf file (default: Gemma 3 270M Q4_K_M)")
    parser.add_argument("--llama-server", default=envs.llama_server() or shutil.which("llama-server"))
    parser.add_argument("--count", type=int, default=300, help="random strings besides the pieces")
    parser.add_argument("--port", type=int, default=18931)
    args = parser.parse_args()
    if not args.llama_server:
        parser.error("no llama-server: pass --llama-server (benchmarks/build_llama_cpp.sh builds one)")
    path = args.file or gemma3_270m_path()
    ours = Tokenizer.load(path)
    server = subprocess.Popen([args.llama_server, "-m", path, "--port", str(args.port), "-t", "1", "-c", "256"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        texts = strings(args.count)
        differ = [(t, mine, theirs) for t in texts
                  if (mine := ours.encode(t, add_special_tokens=False)) != (theirs := llama_tokens(args.port, t))]
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"{path}: {len(texts)} strings, {len(differ)} differ")
    for text, mine, theirs in differ[:10]:
        print(f"  {text!r}: tokenmill {mine[:12]} llama.cpp {theirs[:12]}")


if __name__ == "__main__":
    main()
