"""The files `bench sizes` runs on: a random-weight model of each shape (random_model.py)
and its GGUFs, made with llama.cpp's own tools from the llama.cpp source that
`benchmarks/build_llama_cpp.sh` builds (DEST, default /work/llama.cpp-build):

- BF16 and Q8_0: the sdist's `convert_hf_to_gguf.py`, with its `gguf-py` and the
  converter's extra dependency (sentencepiece, in DEST/convert-deps) on PYTHONPATH
  only for that subprocess, never in tokenmill's environment;
- Q4_K_M: `llama-quantize` from the BF16 file, as a llama.cpp user makes one.

Layout under the models directory: `<shape>/` (the HF directory) and
`<shape>.BF16.gguf`, `<shape>.Q8_0.gguf`, `<shape>.Q4_K_M.gguf`. Each file is
written under a `.part` name and renamed when complete, so a present file is whole.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenmill import envs
from tokenmill.bench.random_model import (
    BF16_BYTES,
    DONE_NAME,
    SMOLLM2_VOCAB,
    Shape,
    write_random_model,
)

LLAMA_CPP_ENV = envs.LLAMA_CPP
DEFAULT_LLAMA_CPP = Path("/work/llama.cpp-build")
FORMATS = ("bf16", "q8_0", "q4_k_m")
GGUF_TYPES = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
# Bytes a weight, to check the disk before writing (Q8_0: 34 bytes a 32; Q4_K_M: ~4.9 bits).
BYTES_PER_WEIGHT = {"bf16": 2.0, "q8_0": 34 / 32, "q4_k_m": 0.62}
DISK_MARGIN_BYTES = 4 << 30  # left free for everyone else on the disk


@dataclass(frozen=True)
class LlamaCpp:
    """llama.cpp's tools, as build_llama_cpp.sh lays them out under DEST."""

    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "bin" / "llama-quantize"

    @property
    def bench(self) -> Path:
        return self.root / "bin" / "llama-bench"

    @property
    def source(self) -> Path:
        found = sorted((self.root / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
        if not found:
            raise FileNotFoundError(f"no llama.cpp source under {self.root / 'src'}; "
                                    "run benchmarks/build_llama_cpp.sh")
        return found[-1]

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def converter_env(self) -> dict[str, str]:
        """PYTHONPATH for the converter only: the sdist's gguf-py and the converter's deps."""
        paths = [str(self.source / "gguf-py"), str(self.root / "convert-deps")]
        return {"PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

    def require(self, *tools: Path) -> None:
        for tool in tools:
            if not tool.is_file():
                raise FileNotFoundError(f"{tool} not found: run `flock /tmp/tokenmill-heavy.lock "
                                        f"benchmarks/build_llama_cpp.sh {self.root}` first")


def find_llama_cpp(given: str | None) -> LlamaCpp:
    return LlamaCpp(Path(given or envs.llama_cpp() or DEFAULT_LLAMA_CPP))


def model_dir(models_dir: Path, shape: Shape) -> Path:
    return Path(models_dir) / shape.name


def gguf_path(models_dir: Path, shape: Shape, fmt: str) -> Path:
    return Path(models_dir) / f"{shape.name}.{GGUF_TYPES[fmt]}.gguf"


def check_disk(path: Path, need_bytes: float, what: str) -> None:
    free = shutil.disk_usage(path).free
    if free - need_bytes < DISK_MARGIN_BYTES:
        raise OSError(f"{what} needs {need_bytes / 2**30:.1f} GiB and {path} has {free / 2**30:.1f} GiB free "
                      f"(keeping {DISK_MARGIN_BYTES >> 30} GiB spare); free some disk or pick fewer formats")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print(f"   $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=True,
                   env={**os.environ, **(env or {})})


def make_files(shape: Shape, formats: list[str], models_dir: Path, llama_cpp: LlamaCpp,
               tokenizer_gguf: Path, seed: int = 0) -> dict[str, Path]:
    """The HF directory and the GGUFs `formats` need (made when missing); returns
    {"dir": ..., fmt: gguf path}. Q4_K_M is quantized from the BF16 GGUF, so it makes that too."""
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    params = shape.num_params(shape.vocab_size or SMOLLM2_VOCAB)
    hf = model_dir(models_dir, shape)
    wanted = [f for f in FORMATS if f in formats or (f == "bf16" and "q4_k_m" in formats)]
    missing = [f for f in wanted if not gguf_path(models_dir, shape, f).exists()]
    # The tools first: a missing one fails before gigabytes are written.
    if "q4_k_m" in missing:
        llama_cpp.require(llama_cpp.quantize)
    if set(missing) - {"q4_k_m"}:
        llama_cpp.require(llama_cpp.converter)
    if not (hf / DONE_NAME).exists():
        check_disk(models_dir, params * BF16_BYTES, f"{hf}")
    write_random_model(shape, hf, tokenizer_gguf, seed)
    files = {"dir": hf}
    for fmt in wanted:
        dst = files[fmt] = gguf_path(models_dir, shape, fmt)
        if fmt not in missing:
            continue
        check_disk(models_dir, params * BYTES_PER_WEIGHT[fmt], f"{dst}")
        part = dst.with_name(dst.name + ".part")
        if fmt == "q4_k_m":
            _run([str(llama_cpp.quantize), str(files["bf16"]), str(part), GGUF_TYPES[fmt]])
        else:
            _run([sys.executable, str(llama_cpp.converter), str(hf), "--outtype", fmt,
                  "--outfile", str(part)], llama_cpp.converter_env())
        part.rename(dst)
    return files
