"""Phi-3 / Phi-4's RoPE against transformers' own modules, and its config fields.

The engine-level checks (greedy tokens and logprobs against transformers under
every batching situation, GGUF files) run the tiny `phi3` and `phi4-mini`
configs of tests/hf_models.ARCHS; here: LongRoPE's tables row by row (the short
factors below the original context, the long ones from it on, both times the
attention factor), partial rotary's reordered rows giving HF's rotation, and
how a config.json in either transformers' format reads, or is refused.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from transformers.models.phi3 import modeling_phi3

from tokenmill.model.fused_checkpoint import rotary_row_order
from tokenmill.model.rope import RotaryEmbedding, apply_rotary_emb
from tokenmill.model.spec import spec_from_hf_config

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]


def phi4_mini_like(**overrides: Any) -> dict[str, Any]:
    """A config.json as Phi-4-mini's is written (transformers 4's format: top-level
    rope_theta, partial_rotary_factor and original_max_position_embeddings,
    rope_scaling with "type"), at a tiny size: heads of 16, 12 rotated."""
    return {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5, "sliding_window": 262144,
        "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        **overrides,
    }


def hf_config(cfg: dict[str, Any]) -> transformers.Phi3Config:
    return transformers.Phi3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})


def hf_cos_sin(cfg: dict[str, Any], positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin [positions, rotary] for a sequence of `positions`
    tokens in one forward (its LongRoPE set chosen by that length)."""
    config = hf_config(cfg)
    rotary = modeling_phi3.Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(positions)[None, :])
    return cos[0], sin[0]


def test_longrope_tables_are_transformers_row_by_row() -> None:
    """Below the original context (32) each row is transformers' for a sequence
    within it (short factors); from it on, transformers' for a longer one (long
    factors); both times the attention factor sqrt(1 + ln(256 / 32) / ln(32));
    the pass-through columns turn by angle 0, unscaled."""
    cfg = phi4_mini_like()
    spec = spec_from_hf_config(cfg)
    assert spec.rotary_dim == 12 and spec.rope_scaling is not None
    assert spec.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(8) / math.log(32))
    ours = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, 100, rotary_dim=spec.rotary_dim)
    short_cos, short_sin = hf_cos_sin(cfg, 32)
    long_cos, long_sin = hf_cos_sin(cfg, 100)
    assert not torch.equal(short_cos[1:], long_cos[1:32])  # (the two sets differ)
    assert torch.equal(ours.cos_cache[:32, :6], short_cos[:, :6])
    assert torch.equal(ours.sin_cache[:32, :6], short_sin[:, :6])
    assert torch.equal(ours.cos_cache[32:, :6], long_cos[32:, :6])
    assert torch.equal(ours.sin_cache[32:, :6], long_sin[32:, :6])
    assert torch.equal(ours.cos_cache[:, 6:], torch.ones(100, 2))
    assert torch.equal(ours.sin_cache[:, 6:], torch.zeros(100, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_on_reordered_rows_is_transformers_rotation(dtype: torch.dtype) -> None:
    """q and k with their rows in rotary_row_order, rotated over the whole head
    with the padded table, are transformers' apply_rotary_pos_emb of the rows in
    HF's order, bit for bit, once the order is undone (and so every score)."""
    cfg = phi4_mini_like()
    spec = spec_from_hf_config(cfg)
    assert spec.rotary_dim is not None
    heads, hd, tokens = 4, spec.head_dim, 40
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, hd, generator=gen).to(dtype)
    k = torch.randn(tokens, heads, hd, generator=gen).to(dtype)
    cos, sin = hf_cos_sin(cfg, tokens)  # (past 32: the long set, for all rows)
    hf_q, hf_k = modeling_phi3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                    cos[None].to(dtype), sin[None].to(dtype))
    order = rotary_row_order(1, hd, spec.rotary_dim)
    ours = RotaryEmbedding(hd, spec.rope_theta, {**spec.rope_scaling, "original_max_position_embeddings": 0},
                           tokens, rotary_dim=spec.rotary_dim)  # (every row long, as transformers' here)
    our_cos, our_sin = ours.cos_sin(torch.arange(tokens), dtype)
    undo = torch.argsort(order)
    our_q = apply_rotary_emb(q[..., order], our_cos, our_sin)[..., undo]
    our_k = apply_rotary_emb(k[..., order], our_cos, our_sin)[..., undo]
    assert torch.equal(our_q, hf_q[0].transpose(0, 1))
    assert torch.equal(our_k, hf_k[0].transpose(0, 1))


def test_rotary_row_order_pairs_each_rotated_pair_half_a_head_apart() -> None:
    order = rotary_row_order(2, 8, 4)  # per head: rotated 0..3 (pairs 0-2, 1-3), passed 4..7
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert rotary_row_order(1, 8, 8).tolist() == list(range(8))


def test_both_config_formats_give_one_spec() -> None:
    """transformers 4's config.json (Phi-4-mini's as published) and transformers 5's
    (what save_pretrained writes now) give the same spec."""
    old = spec_from_hf_config(phi4_mini_like())
    config = hf_config(phi4_mini_like())
    new = spec_from_hf_config({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert new == old
    assert old.sliding_window == 262144 and not old.attention_bias and old.tie_word_embeddings
    # Phi-3-mini-4k's kind: no rope_scaling, every dimension rotated.
    plain = spec_from_hf_config(phi4_mini_like(rope_scaling=None, partial_rotary_factor=1.0))
    assert plain.rope_scaling is None and plain.rotary_dim is None
    # "su" is LongRoPE's old name; a given attention_factor is taken as it is.
    su = spec_from_hf_config(phi4_mini_like(rope_scaling={"type": "su", "short_factor": SHORT,
                                                          "long_factor": LONG, "attention_factor": 1.5}))
    assert su.rope_scaling is not None and su.rope_scaling["attention_factor"] == 1.5
    # Phi3Config's defaults where a file leaves a field out.
    bare = {k: v for k, v in phi4_mini_like().items() if k not in ("rms_norm_eps", "original_max_position_embeddings")}
    spec = spec_from_hf_config(bare)
    assert spec.rms_norm_eps == hf_config(bare).rms_norm_eps == 1e-5
    assert spec.rope_scaling is not None and spec.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize(("overrides", "field"), [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type='linear'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": SHORT[:5], "long_factor": LONG}},
     "rope_scaling.short_factor must list 6 numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": [*LONG[:5], -1.0]}},
     "rope_scaling.long_factor=-1.0"),
    ({"partial_rotary_factor": 0.7}, "partial_rotary_factor=0.7 rotates 11"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor=0.0 is invalid"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
])
def test_a_config_it_cannot_run_is_refused_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("[", r"\[")):
        spec_from_hf_config(phi4_mini_like(**overrides), "phi/config.json")
