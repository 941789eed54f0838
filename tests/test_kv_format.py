"""8-bit KV caches (`--kv-cache-dtype`, model/kv_format.py, csrc/kv_format.h):
the formats' rounding bounds, the C++ write path's bits against the torch one,
the attention kernels against the dequantized reference, and an engine that
serves from them (capacity, prefix caching, preemption, greedy tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_models import build_hf_model, save_hf_model
from tests.test_cpu_kernels import decode_case
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.attention import CpuAttentionBackend
from tokenmill.config import CacheConfig, ModelSpec
from tokenmill.model.attention import TorchAttentionBackend
from tokenmill.model.kv_format import format_of, kv_cache_format
from tokenmill.worker import cache_sizing
from tokenmill.worker.kv_offload import fingerprint

FORMATS = ["q8_0", "fp8_e4m3", "fp8_e5m2"]


def encoded_cache(plain: torch.Tensor, name: str) -> torch.Tensor:
    """A plain cache [2, blocks, bs, kv_heads, head_dim] stored as `name`."""
    fmt = kv_cache_format(name)
    return fmt.encode(plain)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_bounds(name: str) -> None:
    """q8_0: within half a step (d / 2, d = max|x| / 127) of each value; fp8:
    within half a unit in the last place (3 or 2 mantissa bits), saturated at the
    largest finite value."""
    fmt = kv_cache_format(name)
    gen = torch.Generator().manual_seed(0)
    # Rows of magnitudes 0.05 to 100 (K/V's range; below ~0.01 a q8_0 scale d is a float16
    # subnormal and loses relative precision, as llama.cpp's does).
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-1.3, 2, 64)[:, None]
    back = fmt.decode(fmt.encode(x), torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    if name == "q8_0":
        d = x.reshape(64, 4, 32).abs().amax(-1, keepdim=True) / 127
        err = (back - x).reshape(64, 4, 32).abs()
        # Half a step, plus d's own rounding to float16 (2^-11 relative) times |q| <= 127.
        assert (err <= d * (0.5 + 127 * 2**-11) + 1e-12).all()
        assert err.mean() < (d * 0.26).mean()
        assert fmt.encode(x).dtype == torch.uint8 and fmt.encode(x).shape == (64, 4 * 34)
        assert fmt.decode(fmt.encode(torch.zeros(2, 32)), torch.float32).abs().sum() == 0
    else:
        mantissa = 3 if name == "fp8_e4m3" else 2
        limit = torch.finfo(fmt.storage).max  # type: ignore[arg-type]
        small = x.abs() < limit
        rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[small & (x.abs() > 2**-6)]
        assert rel.max() <= 2.0 ** -(mantissa + 1) * 1.0001
        big = torch.tensor([1e6, -1e6])
        assert fmt.decode(fmt.encode(big), torch.float32).tolist() == [limit, -limit]


def test_names_and_sizes() -> None:
    assert kv_cache_format("fp8") == kv_cache_format("fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported; use one of"):
        kv_cache_format("int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        CacheConfig(cache_dtype="fp4")
    with pytest.raises(ValueError, match="head_dim is 16; use 'fp8' or 'auto'"):
        kv_cache_format("q8_0").check(16)
    # Bytes per token: q8_0 34 / 64 of bfloat16's, fp8 half (the issue's 0.53x and 0.5x).
    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=2048, intermediate_size=64,
                     num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=1e4, max_position_embeddings=512)  # Llama-3.2-1B's KV heads
    bf16 = cache_sizing.bytes_per_block(spec, torch.bfloat16, 16)
    assert bf16 == 16 * 8 * 64 * 2 * 2 * 16  # 32 KiB a token
    assert cache_sizing.bytes_per_block(spec, torch.bfloat16, 16, cache_dtype="q8_0") * 64 == bf16 * 34
    assert cache_sizing.bytes_per_block(spec, torch.bfloat16, 16, cache_dtype="fp8") * 2 == bf16


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_writes_the_torch_bits(name: str, dtype: torch.dtype) -> None:
    """rope_qkv_cache (the plan's write) stores what write_kv_cache (the torch
    reference's) stores, bit for bit: the same rounding of the same K/V."""
    ops = kernels.fused_ops(torch.empty(1, dtype=dtype))
    if ops is None:
        pytest.skip(f"C++ kernels could not be built here: {kernels._failed}")
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 9
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    positions = torch.arange(tokens)
    angles = torch.randn(64, head_dim // 2, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    slots = torch.randperm(8 * 4, generator=gen)[:tokens]
    fmt = kv_cache_format(name)
    plain = torch.zeros(2, 8, 4, kv_heads, head_dim, dtype=dtype)
    stored = torch.zeros(fmt.shape(8, 4, kv_heads, head_dim), dtype=torch.uint8).view(fmt.storage)  # type: ignore[arg-type]
    none = torch.empty(0, dtype=dtype)
    ops.rope_qkv_cache(qkv.clone(), heads, kv_heads, head_dim, positions, cos, sin, plain, slots, none, none, 1e-6)
    ops.rope_qkv_cache(qkv.clone(), heads, kv_heads, head_dim, positions, cos, sin, stored, slots, none, none, 1e-6)
    assert format_of(stored) == fmt
    assert torch.equal(stored.view(torch.uint8), fmt.encode(plain).view(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("sliding_window", [None, 7])
# 96: the plain C++ loop; 32, 64, 128: the AVX-512 kernel reading the stored format.
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_kernel_reads_the_stored_format(name: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                        sliding_window: int | None, head_dim: int) -> None:
    """The kernel on an 8-bit cache computes what the torch reference computes on
    the cache's decoded values (float32 arithmetic in both): within float32
    rounding, and within the output's rounding in bfloat16."""
    if kernels.paged_attention_kernel() is None:
        pytest.skip(f"C++ kernels could not be built here: {kernels._failed}")
    q, plain, meta = decode_case(dtype, num_heads, num_kv_heads, sliding_window, head_dim)
    cache = encoded_cache(plain, name)
    sink = torch.linspace(-2.0, 3.0, num_heads) if head_dim == 64 else None
    softcap = 1.5 if head_dim == 32 else None
    ours = CpuAttentionBackend()._decode(q, cache, meta, 0.25, sliding_window, softcap, sink)
    ref = TorchAttentionBackend()._decode(q, cache, meta, 0.25, sliding_window, softcap, sink)
    assert ours.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
    # ... and close to attention on the unquantized cache (the format's own error).
    exact = TorchAttentionBackend()._decode(q.float(), plain.float(), meta, 0.25, sliding_window, softcap, sink)
    # (Random unit K/V, scores of std ~1.4: the values' relative error, 2^-9 for q8_0's
    # steps, 2^-4 and 2^-3 for e4m3's and e5m2's mantissas, moves outputs of ~1 by this much on average.)
    assert (ours.float() - exact).abs().mean() < {"q8_0": 0.015, "fp8_e4m3": 0.06, "fp8_e5m2": 0.12}[name]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = build_hf_model("llama", head_dim=32)  # q8_0 blocks of 32: one per head
    return save_hf_model(model, tmp_path_factory.mktemp("kv8") / "llama")


# 40 tokens each (two full blocks of 16 to hit in the prefix cache), two sharing their first 20.
PROMPTS = [[1] + [(7 * i + 3) % 120 + 3 for i in range(39)], [1] + [(5 * i + 1) % 110 + 3 for i in range(39)],
           [1] + [(7 * i + 3) % 120 + 3 for i in range(19)] + [(11 * i) % 90 + 3 for i in range(20)]]


def greedy(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name", ["q8_0", "fp8"])
def test_engine_serves_from_an_8bit_cache(llama_dir: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool holds 64 / 34 (q8_0) or 2x (fp8) the bf16 blocks in the same
    memory; the plan (C++ kernels) and the torch reference give the same greedy
    tokens from it; a pool small enough to preempt, and prefix-cache hits,
    change nothing."""
    budget = 1 << 20
    auto = LLM(llama_dir, skip_tokenizer_init=True, dtype="bfloat16", kv_cache_memory_bytes=budget)
    small_kv = LLM(llama_dir, skip_tokenizer_init=True, dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype=name)
    spec = auto.engine.spec
    plain_block = cache_sizing.bytes_per_block(spec, torch.bfloat16, 16)
    block = cache_sizing.bytes_per_block(spec, torch.bfloat16, 16, cache_dtype=name)
    assert block * 64 == plain_block * (34 if name == "q8_0" else 32)
    assert auto.engine.runner.num_blocks == budget // plain_block
    assert small_kv.engine.runner.num_blocks == budget // block
    assert small_kv.engine.runner.kv_cache_bytes() <= budget
    assert small_kv.engine.facts.cache.cache_dtype == kv_cache_format(name).name
    assert auto.engine.facts.cache.cache_dtype == "bfloat16"
    assert format_of(small_kv.engine.runner.kv_caches[0]) == kv_cache_format(name)
    # Greedy tokens, in float32 (the plan and the reference round alike there).
    ours = LLM(llama_dir, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256, kv_cache_dtype=name)
    tokens = greedy(ours)
    computed = ours.last_generate_stats.num_computed_tokens
    assert greedy(ours) == tokens  # the second time from the prefix cache
    assert ours.last_generate_stats.num_computed_tokens < computed
    small = LLM(llama_dir, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=20, block_size=4, max_num_batched_tokens=16,
                kv_cache_dtype=name)
    assert greedy(small) == tokens
    assert small.last_generate_stats.num_preemptions > 0
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    reference = LLM(llama_dir, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256, kv_cache_dtype=name)
    assert greedy(reference) == tokens
    # The 8-bit cache's own error against float32 KV: q8_0 (steps of max / 127 in 32)
    # keeps this random model's 24 greedy tokens; fp8 (3 mantissa bits) its first few
    # (here 5, 24 and 9). The real model's numbers: docs/perf-notes.md "8-bit KV".
    exact = greedy(LLM(llama_dir, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256))
    if name == "q8_0":
        assert tokens == exact
    else:
        assert [t[:4] for t in tokens] == [t[:4] for t in exact]


def test_fingerprint_names_the_format(llama_dir: str) -> None:
    """A block file of one format is a miss for another (the disk tier's key)."""
    spec = LLM(llama_dir, skip_tokenizer_init=True, num_kv_blocks=8).engine.spec
    prints = {name: fingerprint(llama_dir, spec, torch.bfloat16, 16, None, "plan", name)
              for name in ("auto", "q8_0", "fp8", "fp8_e5m2")}
    assert prints["fp8"] != prints["q8_0"] != prints["auto"] != prints["fp8_e5m2"]
    assert fingerprint(llama_dir, spec, torch.bfloat16, 16, None, "plan") == prints["auto"]


def test_q8_0_refuses_a_head_it_cannot_block(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama"), tmp_path / "m")  # head_dim 16
    with pytest.raises(ValueError, match="kv_cache_dtype='q8_0' stores blocks of 32"):
        LLM(path, skip_tokenizer_init=True, kv_cache_dtype="q8_0", num_kv_blocks=8)
