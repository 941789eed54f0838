"""The mixture-of-experts MLP as one C++ op (csrc/moe.cpp, ops.moe_mlp) against
transformers' rule (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock), in every kind
of weight format: bfloat16, float32, Q8_0, Q4_0, Q4_K, Q6_K and a gate_up of parts.

Two oracles:
- `moe_reference`, the rule in torch, with the router and each expert's MLP run by
  the packed kernels on that expert's rows: the op must give its bits exactly, in
  every format and dtype (routing, grouping, the order and rounding of the sum);
- the same rule in float64 on the float (or dequantized) weights, on the rows whose
  top-k choice is not a near tie: float32 within 1e-5 of each row's largest value
  (the float path computes on the dequantized weights; measured 1.4e-6 at most),
  bfloat16 each row's RMS error within `_BF16_RMS` of its RMS (a chain of bf16
  roundings of 2^-9 each, and for the block formats x quantized to int8 per block
  before each GEMM, each GEMM's own bound tested in test_quantization_kquants.py).
And batch invariance: each row alone, or any few rows, gives the bits it gives
in a batch of 37.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.test_quantization_kquants import _gguf_values, _random_blocks
from tokenmill.backends.cpu import formats, kernels
from tokenmill.backends.cpu.kernels import CppPackedWeight, CpuOps
from tokenmill.model.quantization import KQUANT_FORMATS, dequantize_q8_0, quantize_q8_0

pytestmark = pytest.mark.skipif(kernels.packed_gemm_ops(torch.empty(1, 2)) is None,
                                reason="no C++ GEMM on this machine")

E, UNPICKED = 8, 3  # experts; one no row chooses (its router row far below the others)
ROWS = 37
# bf16 against float64: a row's RMS error over its RMS (measured at most 0.009 dense,
# 0.025 in the block formats: Q6_K's random scales the widest).
_BF16_RMS = {"dense": 0.02, "block": 0.04}
_FORMATS = ["float32", "bfloat16", "q8_0", "q4_0", "q4_k", "q6_k", "parts"]


def _ops() -> CpuOps:
    ops = kernels.load()
    assert ops is not None
    return ops


def _weight(fmt: str, rows: int, k: int, seed: int, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
    """A random [rows, k] weight in `fmt`: (the source formats.pack takes, its float32 values)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("float32", "bfloat16"):
        w = (torch.randn(rows, k, generator=g) / k ** 0.5).to(dtype)
        return w, w.float()
    if fmt == "q8_0":
        q, d = quantize_q8_0(torch.randn(rows, k, generator=g) / k ** 0.5)
        return (q, d), dequantize_q8_0(q, d)
    if fmt == "parts":  # a GGUF gate_up: its first half Q4_K rows, its second Q6_K
        halves = [_weight(name, rows // 2, k, seed + i, dtype) for i, name in enumerate(("q4_k", "q6_k"))]
        return [("q4_k", halves[0][0]), ("q6_k", halves[1][0])], torch.cat([halves[0][1], halves[1][1]])
    kq = KQUANT_FORMATS[fmt.upper()]
    blocks = _random_blocks(kq, rows, k, seed=seed)
    return blocks, _gguf_values(kq, blocks)


class Case:
    """A router over E experts and each expert's gate_up and down in one format, packed
    as the plan packs them (formats.pack), with x of ROWS rows."""

    def __init__(self, fmt: str, dtype: torch.dtype, hidden: int, inter: int, seed: int = 0,
                 experts: int = E) -> None:
        ops = self.ops = _ops()
        self.fmt, self.dtype = fmt, dtype
        down_fmt = "q6_k" if fmt == "parts" else fmt  # (parts are a gate_up's)
        g = torch.Generator().manual_seed(seed)
        # x leans positive and the unpicked expert's router row is negative: its logits far below.
        self.x = (torch.randn(ROWS, hidden, generator=g) * 0.5 + 1.0).to(dtype)
        router_fmt = fmt if fmt in ("float32", "bfloat16") else "q8_0"  # (a block format's: Q8_0)
        router_src, self.router_values = _weight(router_fmt, experts, hidden, seed + 1, dtype)
        if router_fmt == "q8_0":
            q, d = router_src
            q[UNPICKED] = -q[UNPICKED].abs()
            router_src, self.router_values = (q, d), dequantize_q8_0(q, d)
        else:
            router_src[UNPICKED] = -router_src[UNPICKED].abs() - 0.5
            self.router_values = router_src.float()
        self.router = formats.pack(ops, router_fmt, router_src)
        self.gate_up: list[CppPackedWeight] = []
        self.down: list[CppPackedWeight] = []
        self.gate_up_values: list[torch.Tensor] = []
        self.down_values: list[torch.Tensor] = []
        for e in range(experts):
            src, values = _weight(fmt, 2 * inter, hidden, seed + 10 + 2 * e, dtype)
            self.gate_up.append(formats.pack(ops, formats.PARTS if fmt == "parts" else fmt, src))
            self.gate_up_values.append(values)
            src, values = _weight(down_fmt, hidden, inter, seed + 11 + 2 * e, dtype)
            self.down.append(formats.pack(ops, down_fmt, src))
            self.down_values.append(values)

    def op(self, x: torch.Tensor, top_k: int, norm: bool) -> torch.Tensor:
        return self.ops.moe_mlp(x, self.router, self.gate_up, self.down, top_k, norm)

    def kernels_reference(self, x: torch.Tensor, top_k: int, norm: bool) -> torch.Tensor:
        """The rule with the router and each expert's MLP on the packed kernels."""
        ops = self.ops

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            act = ops.silu_and_mul(ops.packed_gemm(rows, self.gate_up[e], False))
            return ops.packed_gemm(act, self.down[e], False)

        return moe_reference(x, ops.packed_gemm(x, self.router, False), mlp, top_k, norm)

    def float64_reference(self, x: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule in float64 on the weights' values, and each row's top-k margin
        (the k-th probability less the next: how near a tie its choice is)."""
        x64 = x.double()

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(rows, self.gate_up_values[e].double()).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_values[e].double())

        logits = F.linear(x64, self.router_values.double())
        probs = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True).values
        margin = probs[:, top_k - 1] - probs[:, top_k]
        return moe_reference(x64, logits, mlp, top_k, norm), margin


def moe_reference(x: torch.Tensor, logits: torch.Tensor, mlp: Callable[[int, torch.Tensor], torch.Tensor],
                  top_k: int, norm: bool) -> torch.Tensor:
    """transformers' sparse MoE block (Qwen3-MoE, Mixtral) on router logits in x's
    dtype: softmax in float32 (float64 for a float64 x), torch.topk (its ties),
    renormalised where `norm`, to x's dtype; each expert that any row chose, in
    increasing id, added to its rows by index_add_ in x's dtype."""
    probs = torch.softmax(logits.to(torch.float64 if x.dtype == torch.float64 else torch.float32), -1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        w /= w.sum(-1, keepdim=True)
    w = w.to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(probs.shape[1]):
        token, slot = torch.where(ids == e)
        if token.numel():
            out.index_add_(0, token, (mlp(e, x[token].contiguous()) * w[token, slot, None]).to(x.dtype))
    return out


def _sizes(fmt: str) -> tuple[int, int]:
    """(hidden, inter): the k-quants' rows are super-blocks of 256 inputs."""
    return (64, 32) if fmt in ("float32", "bfloat16", "q8_0", "q4_0") else (256, 256)


# (format, x's dtype): a dense weight in the model's dtype, a block format under both.
_CASES = [("float32", "float32"), ("bfloat16", "bfloat16"),
          *((f, d) for f in _FORMATS[2:] for d in ("float32", "bfloat16"))]


@pytest.fixture(scope="module", params=_CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def case(request: pytest.FixtureRequest) -> Case:
    fmt, dtype_name = request.param
    dtype = getattr(torch, dtype_name)
    hidden, inter = _sizes(fmt)
    return Case(fmt, dtype, hidden, inter, seed=_FORMATS.index(fmt))


@pytest.mark.parametrize(("top_k", "norm"), [(2, True), (3, False), (3, True)])
def test_the_op_is_the_rule_on_the_kernels(case: Case, top_k: int, norm: bool) -> None:
    """The op's bits are the rule's with each GEMM on the same kernel, at 1, 5 and
    37 rows; the unpicked expert is never chosen."""
    for rows in (1, 5, ROWS):
        x = case.x[:rows]
        ref = case.kernels_reference(x, top_k, norm)
        out = case.op(x, top_k, norm)
        assert out.dtype == case.dtype and out.shape == x.shape
        assert torch.equal(out, ref), f"{rows} rows: max diff {(out.double() - ref.double()).abs().max().item()}"
    logits = case.ops.packed_gemm(case.x, case.router, False).float()
    assert not bool((logits.topk(top_k, -1).indices == UNPICKED).any())


@pytest.mark.parametrize(("top_k", "norm"), [(2, True), (3, False)])
def test_the_op_is_near_the_float64_rule(case: Case, top_k: int, norm: bool) -> None:
    """Against the rule in float64 on the weights' values (the module docstring's
    bounds), on the rows whose choice is clear (a margin of 1e-2: most rows)."""
    out = case.op(case.x, top_k, norm).double()
    ref, margin = case.float64_reference(case.x, top_k, norm)
    clear = margin > 1e-2
    assert int(clear.sum()) >= ROWS * 2 // 3
    if case.dtype == torch.float32:
        err = (out - ref).abs().amax(-1) / ref.abs().amax(-1)
        bound = 1e-5
    else:
        err = (out - ref).pow(2).mean(-1).sqrt() / ref.pow(2).mean(-1).sqrt()
        bound = _BF16_RMS["dense" if case.fmt == "bfloat16" else "block"]
    assert float(err[clear].max()) <= bound, f"max error {float(err[clear].max()):.3g}"


@pytest.mark.parametrize("top_k", [2, 3])
def test_a_row_gives_its_bits_whatever_the_batch(case: Case, top_k: int) -> None:
    """Batch invariance: each row alone, and rows 5-11 together, give the bits
    they give among all 37 (other rows share their experts or not)."""
    full = case.op(case.x, top_k, True)
    for r in range(ROWS):
        assert torch.equal(case.op(case.x[r:r + 1], top_k, True), full[r:r + 1]), f"row {r}"
    assert torch.equal(case.op(case.x[5:12], top_k, True), full[5:12])


def test_an_expert_no_row_chooses_is_not_run() -> None:
    """The unpicked expert's weights are NaN: nothing of them reaches the result."""
    case = Case("bfloat16", torch.bfloat16, 64, 32)
    ops = case.ops
    nan = torch.full((64, 64), float("nan"), dtype=torch.bfloat16)
    gate_up = list(case.gate_up)
    gate_up[UNPICKED] = formats.pack(ops, "bfloat16", nan)
    out = ops.moe_mlp(case.x, case.router, gate_up, case.down, 2, True)
    assert not bool(out.isnan().any())
    assert torch.equal(out, case.op(case.x, 2, True))


def test_gate_and_up_of_part_blocks() -> None:
    """An intermediate size that is not a multiple of 16 (gate and up not whole
    blocks of 16 outputs): SiLU·up apart from the GEMM, the same rule."""
    for dtype in (torch.float32, torch.bfloat16):
        case = Case(str(dtype).removeprefix("torch."), dtype, 64, 24)
        for rows in (1, ROWS):
            x = case.x[:rows]
            assert torch.equal(case.op(x, 2, False), case.kernels_reference(x, 2, False))


def test_all_experts_chosen_and_ties() -> None:
    """top_k = E (every expert every row, no gather); and routers whose rows repeat,
    so that logits tie exactly (bf16 logits tie often): the experts torch.topk picks,
    the same bits alone and in the batch."""
    case = Case("float32", torch.float32, 64, 32)
    x = case.x[:5]
    assert torch.equal(case.op(x, E, False), case.kernels_reference(x, E, False))
    for dtype in (torch.float32, torch.bfloat16):
        case = Case(str(dtype).removeprefix("torch."), dtype, 64, 32, seed=4)
        router = torch.randn(E, 64, generator=torch.Generator().manual_seed(1)) / 8
        router[[2, 5, 6]] = router[1].clone()  # four experts of the same logit
        router[7] = router[0].clone()
        case.router = formats.pack(case.ops, case.fmt, router.to(dtype))
        for top_k in (2, 3, 5):
            full = case.op(case.x, top_k, True)
            assert torch.equal(full, case.kernels_reference(case.x, top_k, True))
            for r in range(0, ROWS, 6):
                assert torch.equal(case.op(case.x[r:r + 1], top_k, True), full[r:r + 1])


def test_many_experts_top_8() -> None:
    """Qwen3-MoE's kind: 64 experts, top 8 renormalised, bf16 logits (ties at the
    8th place happen): the rule's bits, each row's alone and in the batch."""
    case = Case("bfloat16", torch.bfloat16, 64, 32, seed=7, experts=64)
    full = case.op(case.x, 8, True)
    assert torch.equal(full, case.kernels_reference(case.x, 8, True))
    for r in range(ROWS):
        assert torch.equal(case.op(case.x[r:r + 1], 8, True), full[r:r + 1]), f"row {r}"


def test_bad_arguments_are_refused() -> None:
    case = Case("float32", torch.float32, 64, 32)
    ops = case.ops
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_mlp(case.x, case.router, case.gate_up, case.down, E + 1, True)
    with pytest.raises(RuntimeError, match="a gate_up and a down weight per expert"):
        ops.moe_mlp(case.x, case.router, case.gate_up, case.down[:-1], 2, True)
    with pytest.raises(RuntimeError, match="router"):
        ops.moe_mlp(case.x, case.router, case.gate_up[:-1], case.down[:-1], 2, True)
    with pytest.raises(RuntimeError, match="expert 0"):
        ops.moe_mlp(case.x, case.router, [case.down[0], *case.gate_up[1:]], case.down, 2, True)


def test_a_layer_holds_a_dense_mlp_or_experts() -> None:
    """LayerWeights (csrc/layer_stack.h) takes gate_up and down, or a router and
    experts (checked as moe_mlp checks them), never both or neither."""
    case = Case("float32", torch.float32, 64, 32)
    ops = case.ops
    attn = formats.pack(ops, "float32", torch.randn(64, 64))
    common: dict[str, Any] = dict(norm1=torch.ones(64), qkv=attn, o=attn, norm2=torch.ones(64),
                                  q_norm=torch.empty(0), k_norm=torch.empty(0), sliding_window=0, scale=1.0,
                                  attn_out_norm=torch.empty(0), mlp_out_norm=torch.empty(0), cos=torch.empty(0),
                                  sin=torch.empty(0), logit_softcap=0.0)
    sparse = ops.LayerWeights(**common, router=case.router, experts_gate_up=case.gate_up,
                              experts_down=case.down, top_k=2, norm_topk_prob=True)
    assert sparse.num_experts == E
    assert ops.LayerWeights(**common, gate_up=case.gate_up[0], down=case.down[0]).num_experts == 0
    with pytest.raises(RuntimeError, match="gate_up and down, or a router and experts"):
        ops.LayerWeights(**common)
    with pytest.raises(RuntimeError, match="gate_up and down, or a router and experts"):
        ops.LayerWeights(**common, gate_up=case.gate_up[0], down=case.down[0], router=case.router,
                         experts_gate_up=case.gate_up, experts_down=case.down, top_k=2)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.LayerWeights(**common, router=case.router, experts_gate_up=case.gate_up, experts_down=case.down)
