"""Frozen configuration objects.

User options live in ModelConfig / CacheConfig / SchedulerConfig; values found
at run time (the model's shape, the number of KV blocks, EOS ids) are returned
by their producer (ModelSpec from the loader, the block count from the runner)
and passed on, never written back here. Invalid values raise ValueError with a
message that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("q8_0", "gguf")  # ModelConfig.quantization's values besides None
# ModelConfig.runner (vLLM's --runner): "auto" serves generation and pooling
# requests alike (one forward serves both); "generate" or "pooling" only one kind.
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # PoolerConfig.pooling_type (vLLM's names)
# A cross-encoder's activation on its logits (PoolerConfig.activation): "sigmoid"
# (one label), "softmax" (several), or "identity" (the logits as they are).
CLASSIFIER_ACTIVATIONS = ("sigmoid", "softmax", "identity")
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
# How a request gets KV memory: block by block ("paged"), or its whole prompt +
# max_tokens at admission ("reserved", the systems before paging; CacheConfig).
KV_ALLOCATIONS = ("paged", "reserved")

# How the KV cache stores K and V (CacheConfig.cache_dtype, `--kv-cache-dtype`):
# the model's dtype ("auto"), vLLM's fp8 names, or llama.cpp's q8_0 (model/kv_format.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "q8_0")

# Tokens per step: one default offline (LLM, `tokenmill generate`) and a smaller
# one for `tokenmill serve` on the CPU (engine/arg_utils.py), as vLLM has one for
# its LLM class and one for its server. A CPU step costs about the same per token
# from ~128 tokens up while every prompt in it waits for all the others, so a
# small budget gets first tokens out sooner (docs/perf-notes.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_SERVE_MAX_NUM_BATCHED_TOKENS = 160

# The server's request body limit: a 128k-token prompt is about 0.5 MiB of text.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how. `model` is a Hugging Face directory, a .gguf file,
    a hub id, or None for the default model (SmolLM2-135M-Instruct, GGUF).
    With `skip_tokenizer_init` no tokenizer is loaded: prompts and outputs are
    token ids only (vLLM's option)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    # Sampling defaults: "auto" (the model's generation config), "vllm" (none) or
    # a folder with a generation_config.json (vLLM's --generation-config).
    generation_config: str = "auto"
    # Weights kept quantized (model/quantization.py): None (the weights in dtype),
    # "q8_0" (GGUF's Q8_0 blocks; other weights quantized to it at load), or "gguf"
    # (a GGUF file's own blocks, other types as Q8_0). vLLM's `quantization` option;
    # EngineArgs.resolve_quantization picks it when the user leaves it unset.
    quantization: str | None = None
    runner: str = "auto"  # RUNNERS: which kinds of request the engine serves
    # vLLM's hf_overrides, of which tokenmill reads a yes/no reranker's (HF_OVERRIDE_KEYS).
    hf_overrides: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        check_hf_overrides(self.hf_overrides)
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} is not supported; use one of {RUNNERS}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported; use one of "
                             f"{(None, *QUANTIZATIONS)} (None: the weights in the model's dtype)")
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU only, "
                             f"not device={self.device!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu' or 'cuda'")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype='float16' runs on CUDA only; on the CPU use 'bfloat16', "
                             "'float32' or 'auto' (a float16 checkpoint then runs in bfloat16)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


# The hf_overrides that make a causal LM a yes/no reranker, as vLLM loads
# Qwen3-Reranker: its score is sigmoid(logit[yes] - logit[no]) at the last token.
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")


def check_hf_overrides(overrides: Mapping[str, Any] | None) -> None:
    """ValueError naming what tokenmill does not read in vLLM's hf_overrides."""
    if overrides is None:
        return
    unknown = sorted(set(overrides) - set(HF_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides keys {unknown} are not supported; tokenmill reads "
                         f"{list(HF_OVERRIDE_KEYS)} (a yes/no reranker, as vLLM loads Qwen3-Reranker)")
    tokens = overrides.get("classifier_from_token")
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
        raise ValueError('hf_overrides needs "classifier_from_token": ["no", "yes"] (the two '
                         f"tokens whose logits score, the positive last), got {tokens!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling request turns the last hidden states (after the final norm)
    into one vector: read at load from sentence-transformers' modules.json and
    1_Pooling/config.json where the model has them, else a decoder's default
    (the last token, normalised: Qwen3-Embedding's recipe, vLLM's for a decoder).
    Matryoshka: the HF config's is_matryoshka / matryoshka_dimensions, as vLLM."""

    pooling_type: str = "LAST"  # POOLING_TYPES: the last token, the mean of all, the first
    normalize: bool = True  # the default where a request leaves PoolingParams.normalize unset
    is_matryoshka: bool = False  # a request may ask for fewer dimensions
    matryoshka_dimensions: tuple[int, ...] | None = None  # only these, where given
    # A yes/no reranker (hf_overrides' classifier_from_token): the (negative,
    # positive) token ids; a request's one value is sigmoid(logit[pos] - logit[neg])
    # at its last token, read from those two rows of the head.
    classifier_token_ids: tuple[int, int] | None = None
    # Its prompt for a (query, document) pair: "qwen3_reranker" (hf_overrides'
    # is_original_qwen3_reranker: server/scores.py's template), or None (the two concatenated).
    score_template: str | None = None
    # A cross-encoder (BertForSequenceClassification, XLMRobertaForSequenceClassification):
    # its classifier's outputs (CLS pooled, then the model's head), and the activation
    # on them (CLASSIFIER_ACTIVATIONS, vLLM's rule: model/pooler_config.py); 0: none.
    num_labels: int = 0
    activation: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r} is not supported; use one of "
                             f"{POOLING_TYPES}")
        if self.activation not in CLASSIFIER_ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not supported; use one of "
                             f"{CLASSIFIER_ACTIVATIONS}")

    @property
    def needs_every_row(self) -> bool:
        """MEAN and CLS read rows before the last: such requests take no prefix hits."""
        return self.pooling_type != "LAST"


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a loaded model (Llama family), as read from its checkpoint.

    Produced by tokenmill.model.loader; everything downstream reads it, nothing
    writes it."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # the window of every layer, or of the sliding layers
    # HF rope_scaling / rope_parameters without rope_theta, e.g. {"rope_type": "llama3", ...}
    rope_scaling: Mapping[str, Any] | None = None
    # Phi-4-mini: RoPE rotates only the first rotary_dim of each head (None: all of it).
    # The loader reorders q/k rows so the rotated pairs and the pass-through pairs each
    # sit head_dim / 2 apart; the pass-through ones then turn by angle 0 (model/rope.py).
    rotary_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / 3 (spec_gemma.py); the defaults are the Llama layer.
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + w), in float32 before the cast
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (4 a layer)
    scale_embeddings: bool = False  # the embedding's rows times sqrt(hidden_size), in the dtype
    query_pre_attn_scalar: float | None = None  # attention scale = its ** -0.5 (None: head_dim's)
    # Per layer "sliding_attention" or "full_attention" (None: every layer slides
    # where sliding_window is set, as Mistral's).
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # the sliding layers' RoPE base (None: rope_theta's RoPE)
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) before the softmax
    final_logit_softcapping: float | None = None  # the same on the logits
    # Mixture of experts (Qwen3-MoE, Mixtral: model/spec_moe.py); 0 experts: every MLP dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: each token's MLP is the weighted sum of its router's top k experts
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top k weights renormalised to sum to 1 (Mixtral's always are)
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (Qwen3-MoE's mlp_only_layers)
    # gpt-oss (model/spec_moe.py): its router and experts carry biases; the router's
    # top k logits, softmaxed (not the top k of the softmax); its experts' SwiGLU
    # clamped: gate <= limit, |up| <= limit, out = gate * sigmoid(alpha * gate) * (up + 1).
    moe_bias: bool = False
    moe_topk_then_softmax: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    norm_in_float32: bool = False  # RMSNorms scale by w in float32, then cast (gpt-oss; Gemma's are too)
    # Encoders (BERT, XLM-R: model/spec_bert.py, model/bert.py); the defaults are the decoder.
    # encoder_only: every token attends to its whole prompt (no causal mask), so a
    # prompt runs in one step, keeps no K/V and generates nothing (pooling only).
    # Its LayerNorms' epsilon is rms_norm_eps; hidden_act "gelu" (exact).
    encoder_only: bool = False
    type_vocab_size: int = 0  # token type (segment) embeddings: 2 for BERT's pairs
    # XLM-R: its padding_idx; positions count from padding_idx + 1 (None: from 0)
    position_offset: int | None = None
    num_labels: int = 0  # a *ForSequenceClassification's classifier outputs (0: no classifier)
    # A checkpoint saved without its LM head (Qwen3Model, LlamaModel: Qwen3-Embedding):
    # it pools only; its head is tied to the embedding so the plan builds unchanged.
    headless: bool = False

    def layer_window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates with the sliding layers' base (local_rope_theta)."""
        return self.local_rope_theta is not None and self.layer_types is not None and (
            self.layer_types[layer] == "sliding_attention")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


# The disk tier's default bound (kv_offload_bytes), when kv_offload_dir is set.
DEFAULT_KV_OFFLOAD_BYTES = 16 << 30


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. Its size comes from `kv_cache_memory_bytes` (default:
    a share of free RAM) or from an explicit `num_blocks_override`.

    `kv_allocation` (tokenmill's own; vLLM has only paging): "paged" gives a
    request blocks as its tokens need them; "reserved" admits a request only
    when its whole prompt + max_tokens fits and holds that space until it
    finishes, as systems before paging did (for the batching study).
    `kv_reserve_output_tokens` (reserved only): the output every request
    reserves, whatever its max_tokens says (the larger of the two); None: its
    own max_tokens (core/kv_reservation.py).

    `kv_offload_dir` (off: None): the prefix cache's second tier, a directory
    of full blocks (written as computed), loaded back for a later prefix once
    evicted from RAM (this engine's, a restarted one's, another's on the host
    naming it), at most
    `kv_offload_bytes` of files in it, least recently used removed first
    (core/kv_disk.py).

    `cache_dtype` (vLLM's; `--kv-cache-dtype`): how K and V are stored, one of
    KV_CACHE_DTYPES; 8-bit formats hold 1.9-2x the tokens in the same memory."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_allocation: str = "paged"
    kv_reserve_output_tokens: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_bytes: int = DEFAULT_KV_OFFLOAD_BYTES
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(
                f"num_kv_blocks (num_blocks_override) must be >= 1, got {self.num_blocks_override}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"kv_allocation={self.kv_allocation!r} is not supported; use one of {KV_ALLOCATIONS}"
            )
        if self.kv_reserve_output_tokens is not None:
            if self.kv_reserve_output_tokens < 1:
                raise ValueError("kv_reserve_output_tokens must be >= 1, got "
                                 f"{self.kv_reserve_output_tokens}")
            if self.kv_allocation != "reserved":
                raise ValueError("kv_reserve_output_tokens applies to kv_allocation='reserved' "
                                 f"only (got kv_allocation={self.kv_allocation!r}); drop it or "
                                 "pass kv_allocation='reserved'")
        if self.kv_offload_bytes < 1:
            raise ValueError(f"kv_offload_bytes must be positive, got {self.kv_offload_bytes}")
        if self.kv_offload_dir is not None:
            if not self.kv_offload_dir:
                raise ValueError("kv_offload_dir is empty; name a directory, or leave it unset")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir is the prefix cache's second tier; it needs "
                                 "prefix caching on (drop --no-enable-prefix-caching)")


@dataclass(frozen=True)
class SchedulerConfig:
    """The one token-budget rule: per step at most `max_num_batched_tokens`
    tokens across at most `max_num_seqs` running requests.
    `disable_hybrid_kv_cache_manager` (vLLM's): one block table for every layer,
    so layers with a sliding window keep every block (core/kv_layout.py)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    policy: str = "fcfs"
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.policy!r} is not supported; use one of {SCHEDULING_POLICIES}"
            )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (`enable_lora`), vLLM's options: at most `max_loras` distinct
    adapters in one step (the scheduler's limit), ranks up to `max_lora_rank`,
    `max_cpu_loras` adapters kept loaded (None: max_loras), the least recently
    used idle one dropped beyond that."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}): a step's adapters are all loaded")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (vLLM's names): the model split over
    `tensor_parallel_size` ranks, processes on `nnodes` machines that meet at
    `master_addr:master_port` (torchrun's rendezvous flags). This process is
    node 0 and rank 0 (the scheduler's); each other node runs `tokenmill worker`
    with its `node_rank`. `master_port` None: a free port (one machine only)."""

    tensor_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    # How ranks 1..N-1 start (vLLM's name): "mp", processes this one spawns (and
    # `tokenmill worker` on other nodes); "ray", Ray actors in this process's
    # placement group's other bundles (`tokenmill serve-ray` gives each replica one).
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes != 1:
            raise ValueError("distributed_executor_backend='ray' places the ranks through a Ray "
                             "placement group: leave nnodes at 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must be >= 1 and divide tensor_parallel_size="
                             f"{self.tensor_parallel_size} (each node runs as many ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs --master-port (the other nodes' workers meet there)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queued_requests: int | None = None
    # Run a chat_template sent in a request (vLLM's --trust-request-chat-template);
    # off: such a request is refused, since a template is code the server runs.
    trust_request_chat_template: bool = False
    # A request body past this is a 413, counted as it streams in (server/limits.py).
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # /tokenize and /detokenize without the API key (vLLM leaves them open);
    # off: --api-key covers them as it covers /v1.
    allow_unauthenticated_tokenize: bool = False
    # /v1/responses kept for previous_response_id and GET (least recently used
    # dropped first; 0: none kept), so memory stays bounded.
    max_stored_responses: int = 1000
    # The metric names' prefix; "vllm:" lets a vLLM Grafana dashboard read them.
    metrics_prefix: str = "tokenmill:"
    # The chat template's text in place of the model's (vLLM's --chat-template).
    chat_template: str | None = None
    # Tool calling with tool_choice "auto": the model's calls read out of its text
    # by this parser (vLLM's --enable-auto-tool-choice --tool-call-parser NAME).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # A reasoning model's <think>...</think> split out as reasoning_content
    # (vLLM's --reasoning-parser: qwen3, deepseek_r1; server/reasoning.py).
    reasoning_parser: str | None = None
    # `serve --dashboard`: the live view at /dashboard (server/dashboard.py).
    dashboard: bool = False
    # LoRA adapters served by name (vLLM's --lora-modules name=path; needs the
    # engine's enable_lora), listed in /v1/models with the base model as parent.
    lora_modules: tuple[tuple[str, str], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be >= 1 (or unset: no limit), got {self.max_queued_requests}"
            )
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if not re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?", self.metrics_prefix):
            raise ValueError(f"metrics_prefix must be a Prometheus name prefix (letters, digits, "
                             f"'_' and ':'; e.g. 'vllm:'), got {self.metrics_prefix!r}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Speculation is off while more than this many requests run (vLLM's
# disable_by_batch_size): a bigger step is compute-bound and verifying drafts
# stops paying; measured on the editing passages, bf16, the gain fell from
# 3.4x at 1 to 1.05x at 32 (docs/perf-notes.md).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, named as vLLM's `speculative_config`: `method`
    "ngram" (prompt lookup: the last n tokens, prompt_lookup_min <= n <=
    prompt_lookup_max, matched earlier in the prompt and output) or
    "draft_model" (`model`: a smaller model with the target's vocabulary, in
    any format tokenmill loads); `num_speculative_tokens` drafts per step."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported; use "
                             f"one of {SPECULATIVE_METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, "
                             f"got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model'; "
                                 "'ngram' needs no model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: both 5 when neither is given, else the one given for both.
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model' "
                             "(a smaller model with the same tokenizer)")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict / `--speculative-config` JSON (an unknown key is an error naming it)."""
        if not isinstance(options, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(options).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        options = dict(options)
        if options.get("method") is None:
            options["method"] = "draft_model" if options.get("model") else "ngram"
        return cls(**options)
