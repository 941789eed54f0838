"""EngineArgs: the engine's options in one place, named as vLLM's.

`LLM`, `tokenmill generate` and `tokenmill serve` all build their configs
through it, so an option has one name, one default and one check everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.config import (
    CPU_SERVE_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_KV_OFFLOAD_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_ALLOCATIONS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    RUNNERS,
    SCHEDULING_POLICIES,
    SUPPORTED_DTYPES,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.engine.generation_config import check_generation_config


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory, .gguf file or hub id; None: the default model
    tokenizer: str | None = None  # default: the model's own
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 128
    # None: the entry point's default (offline: DEFAULT_MAX_NUM_BATCHED_TOKENS;
    # the server: see with_serve_defaults).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # vLLM's num_gpu_blocks_override
    enable_prefix_caching: bool = True
    # tokenmill's own (vLLM only pages): "paged", or "reserved" (config.CacheConfig).
    kv_allocation: str = "paged"
    kv_reserve_output_tokens: int | None = None  # reserved only (config.CacheConfig)
    # The prefix cache's second tier (config.CacheConfig): a directory, and its bound.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int = DEFAULT_KV_OFFLOAD_BYTES
    # vLLM's: how K and V are stored (config.KV_CACHE_DTYPES; model/kv_format.py).
    kv_cache_dtype: str = "auto"
    scheduling_policy: str = "fcfs"
    # vLLM's: windowed layers keep every block (one block table for all layers).
    disable_hybrid_kv_cache_manager: bool = False
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"  # "auto", "vllm" or a folder (engine/generation_config.py)
    # vLLM's speculative_config dict (config.SpeculativeConfig's fields); None: off.
    speculative_config: dict[str, Any] | None = None
    # Tensor parallelism (config.ParallelConfig; vLLM's names).
    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Weights kept quantized: None (auto, see resolve_quantization), "none" (the
    # weights in dtype; a GGUF file dequantized), "q8_0" or "gguf" (config.py).
    quantization: str | None = None
    distributed_executor_backend: str = "mp"  # "ray": ranks as Ray actors (serve-ray)
    # vLLM's --runner: "auto" serves generation and pooling (embedding) requests,
    # "generate" or "pooling" only that kind (config.RUNNERS).
    runner: str = "auto"
    # vLLM's hf_overrides; tokenmill reads a yes/no reranker's (config.HF_OVERRIDE_KEYS):
    # {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
    # ["no", "yes"], "is_original_qwen3_reranker": true} serves Qwen3-Reranker.
    hf_overrides: dict[str, Any] | None = None
    # LoRA adapters (vLLM's names; config.LoRAConfig): off unless enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def create_engine_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
        """The frozen configs an LLMEngine is built from (ValueError on a bad value)."""
        budget = self.max_num_batched_tokens
        check_generation_config(self.generation_config)
        return (
            ModelConfig(
                model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                device=self.device, max_model_len=self.max_model_len, seed=self.seed,
                skip_tokenizer_init=self.skip_tokenizer_init,
                generation_config=self.generation_config, quantization=self.resolve_quantization(),
                runner=self.runner, hf_overrides=self.hf_overrides,
            ),
            CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_blocks_override=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_allocation=self.kv_allocation,
                kv_reserve_output_tokens=self.kv_reserve_output_tokens,
                kv_offload_dir=self.kv_offload_dir,
                kv_offload_bytes=self.kv_offload_bytes,
                cache_dtype=self.kv_cache_dtype,
            ),
            SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS if budget is None else budget,
                policy=self.scheduling_policy,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            ),
        )

    def resolve_quantization(self) -> str | None:
        """ModelConfig.quantization from --quantization: "none" is None (the weights
        in dtype), and unset means a GGUF file holding quantized tensors runs its own
        blocks ("gguf"), as llama.cpp runs it, wherever quantized weights run (one
        CPU process); anything else runs its weights in dtype."""
        if self.quantization is not None:
            if self.quantization not in ("none", *QUANTIZATIONS):
                raise ValueError(f"quantization={self.quantization!r} is not supported; use one "
                                 f"of {('none', *QUANTIZATIONS)}, or leave it unset")
            return None if self.quantization == "none" else self.quantization
        if self.device != "cpu" or self.tensor_parallel_size > 1:
            return None
        from tokenmill.model.gguf_file import holds_quantized_tensors
        from tokenmill.model.source import resolve_model_source

        source = resolve_model_source(self.model)
        return "gguf" if source.kind == "gguf" and holds_quantized_tensors(source.path) else None

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding config, or None (ValueError naming a bad field)."""
        if self.speculative_config is None:
            return None
        if self.scheduling_policy == "static":
            raise ValueError("speculative_config cannot be used with scheduling_policy='static' "
                             "(the static-batching baseline); use 'fcfs' or 'priority'")
        return SpeculativeConfig.from_dict(self.speculative_config)
    def create_lora_config(self) -> LoRAConfig | None:
        """The LoRA config under enable_lora, else None (ValueError on a bad value)."""
        if not self.enable_lora:
            return None
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run on one process; drop --tensor-parallel-size "
                             "or --enable-lora")
        if self.scheduling_policy == "static":
            raise ValueError("LoRA adapters cannot be used with scheduling_policy='static' "
                             "(the static-batching baseline); use 'fcfs' or 'priority'")
        if self.kv_offload_dir is not None:
            # (Blocks are keyed by the adapter's id, which names another adapter after a restart.)
            raise ValueError("LoRA adapters cannot be used with kv_offload_dir yet (the disk tier "
                             "outlives the adapter ids its blocks are keyed by); drop one")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)

    def create_cpu_options(self) -> CpuBackendOptions:
        """The CPU backend's options, built here once per engine and passed down
        (runner, plan, the other tensor-parallel ranks): no engine arg sets them
        yet, the environment's switches do (envs.py)."""
        return CpuBackendOptions.from_env()

    def create_parallel_config(self) -> ParallelConfig:
        if self.quantization not in (None, "none") and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization={self.quantization!r} cannot be used with "
                             f"tensor_parallel_size={self.tensor_parallel_size} (one process only)")
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, master_addr=self.master_addr,
            master_port=self.master_port, nnodes=self.nnodes, node_rank=self.node_rank,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def with_serve_defaults(self) -> EngineArgs:
        """These options with the server's defaults where none was given: on the CPU
        a smaller token budget, for time to first token (config.py says why)."""
        if self.max_num_batched_tokens is not None:
            return self
        return dataclasses.replace(
            self, max_num_batched_tokens=serve_max_num_batched_tokens(self.device, self.max_num_seqs)
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The options as flags: `--max-num-seqs` for max_num_seqs, and so on."""
        parser.add_argument("--model", default=None,
                            help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
        parser.add_argument("--tokenizer", default=None, help="default: the model's own")
        parser.add_argument("--dtype", default="auto", choices=SUPPORTED_DTYPES)
        parser.add_argument("--device", default="cpu", help="cpu or cuda")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=128)
        parser.add_argument(
            "--max-num-batched-tokens", type=int, default=None,
            help=f"tokens per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}; `serve` on the CPU: "
                 f"{CPU_SERVE_MAX_NUM_BATCHED_TOKENS} or max_num_seqs if larger, for time to "
                 "first token)")
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        parser.add_argument("--num-kv-blocks", type=int, default=None,
                            help="KV cache blocks of every layer (default: sized from "
                                 "--kv-cache-memory-bytes); with layer groups (sliding windows) the "
                                 "same memory in blocks of a group each")
        parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                            action="store_false")
        parser.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
        parser.add_argument(
            "--kv-allocation", default="paged", choices=KV_ALLOCATIONS,
            help="paged: KV blocks as a request's tokens need them; reserved: a request is "
                 "admitted only when its whole prompt + max_tokens fits, and holds that "
                 "space until it finishes (the systems before paging, for `bench study`)")
        parser.add_argument(
            "--kv-reserve-output-tokens", type=int, default=None,
            help="with --kv-allocation reserved: the output tokens every request reserves "
                 "(its max_tokens where larger), as a server that cannot know an answer's "
                 "length reserves for the longest; default: each request's own max_tokens")
        parser.add_argument(
            "--kv-offload-dir", default=None,
            help="the prefix cache's second tier: full KV blocks are written here as computed "
                 "and loaded back for a later request with the same prefix once evicted from RAM "
                 "(this server's, a restarted one's, or another's on this host naming the "
                 "directory); off by default")
        parser.add_argument(
            "--kv-offload-bytes", type=int, default=DEFAULT_KV_OFFLOAD_BYTES,
            help="the most bytes of block files in --kv-offload-dir (every engine's), least "
                 f"recently used removed first (default: {DEFAULT_KV_OFFLOAD_BYTES >> 30} GiB)")
        parser.add_argument(
            "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
            help="how K and V are stored: auto (the model's dtype), fp8 / fp8_e4m3 / fp8_e5m2 "
                 "(one byte a value, unscaled, as vLLM's) or q8_0 (int8 with a float16 scale per 32 "
                 "values, as llama.cpp's -ctk/-ctv q8_0): about twice the tokens in the same memory")
        parser.add_argument(
            "--disable-hybrid-kv-cache-manager", action="store_true",
            help="layers with a sliding window keep every block, as full-attention layers do "
                 "(default: they give back the blocks their window has passed)")
        parser.add_argument("--skip-tokenizer-init", action="store_true",
                            help="no tokenizer: prompts and outputs are token ids")
        parser.add_argument(
            "--generation-config", default="auto",
            help="sampling defaults for what a request leaves unset: 'auto' (the model's "
                 "generation config), 'vllm' (none) or a folder with a generation_config.json")
        parser.add_argument(
            "--speculative-config", type=_json_object, default=None,
            help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                 '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", '
                 '"model": PATH, "num_speculative_tokens": 4}; "disable_by_batch_size": N turns '
                 'it off above N running requests')
        parser.add_argument(
            "--quantization", "-q", default=None, choices=("none", *QUANTIZATIONS),
            help="how the weights are kept: gguf (a GGUF file's own Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/"
                 "Q5_K/Q6_K blocks, other types as Q8_0), q8_0 (Q8_0 blocks, other weights "
                 "quantized to it at load), none (the weights in --dtype: a GGUF file "
                 "dequantized). Default: gguf for a GGUF file holding quantized tensors on one "
                 "CPU process, none otherwise")
        parser.add_argument(
            "--runner", default="auto", choices=RUNNERS,
            help="which requests the engine serves: auto (generation and pooling: embeddings "
                 "from the same forward), generate, or pooling (embeddings only)")
        parser.add_argument(
            "--hf-overrides", type=_json_object, default=None,
            help='vLLM\'s: a JSON object; a causal LM scoring with a yes/no token pair (a reranker '
                 'for /score and /rerank): \'{"architectures": ["Qwen3ForSequenceClassification"], '
                 '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'')
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (PEFT directories) beside the base model, "
                                 "batched in the same steps (the reference forward runs)")
        parser.add_argument("--max-loras", type=int, default=1,
                            help="distinct LoRA adapters in one step")
        parser.add_argument("--max-lora-rank", type=int, default=16,
                            help="the largest LoRA rank an adapter may have")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="LoRA adapters kept loaded (default: --max-loras); the least "
                                 "recently used idle one is dropped beyond it")
        add_parallel_args(parser)
        parser.add_argument("--node-rank", type=int, default=0,
                            help="this machine's place among --nnodes (0: the one that schedules)")
        parser.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                            help="how ranks 1..N-1 start: mp, processes (and `tokenmill worker`); "
                                 "ray, Ray actors in this process's placement group (serve-ray "
                                 "sets this for its replicas)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options parsed by a parser that add_cli_args filled."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag's value (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value
def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism's flags (vLLM's; the rendezvous ones as torchrun's)."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many processes (ranks; gloo on the CPU)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of node 0, where the ranks meet")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0 where the ranks meet (default: a free one; "
                             "needed with --nnodes > 1)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="machines the ranks run on (each other one runs `tokenmill worker`)")


def serve_max_num_batched_tokens(device: str, max_num_seqs: int) -> int:
    """The server's token budget when none is given, for this device: never below
    max_num_seqs, so every running request can decode in every step (as vLLM
    requires of any budget)."""
    if device != "cpu":
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(CPU_SERVE_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
