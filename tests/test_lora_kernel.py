"""The CPU plan's LoRA kernel (csrc lora_delta) against LoRABatch.add_delta,
the reference's torch recipe: the same deltas within float32's rounding (bf16:
within one rounding of the output), adapters on their own rows only, and a
row's bits independent of the other rows of the step."""

from __future__ import annotations

import pytest
import torch

from tokenmill.backends.cpu import kernels
from tokenmill.model.lora import PROJECTIONS, LoRAAdapter, LoRABatch, LoRAWeights

IN, OUT, LAYERS = 48, 80, 2


@pytest.fixture(scope="module")
def ops() -> kernels.CpuOps:
    module = kernels.load()
    if module is None:
        pytest.skip("the C++ kernels are not built here")
    return module


def adapter(seed: int, rank: int, lora_int_id: int) -> LoRAAdapter:
    """Random weights on o_proj's slot (IN -> OUT) of every layer; the others unadapted."""
    gen = torch.Generator().manual_seed(seed)
    layers = tuple({"o_proj": LoRAWeights(a=torch.randn(rank, IN, generator=gen),
                                          b=torch.randn(OUT, rank, generator=gen),
                                          scale=torch.rand(rank, generator=gen) + 0.5)}
                   for _ in range(LAYERS))
    return LoRAAdapter(lora_int_id, f"a{seed}", rank, layers)


def cpp(ops: kernels.CpuOps, a: LoRAAdapter) -> kernels.CppLoraAdapterWeights:
    empty = torch.empty(0)
    parts = [layer.get(name) for layer in a.layers for name in PROJECTIONS]
    return ops.LoraAdapterWeights(a=[empty if w is None else w.a for w in parts],
                                  b=[empty if w is None else w.b for w in parts],
                                  scale=[empty if w is None else w.scale for w in parts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_add_delta(ops: kernels.CpuOps, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    first, second = adapter(1, 4, 1), adapter(2, 16, 2)
    x, out = torch.randn(11, IN).to(dtype), torch.randn(11, OUT).to(dtype)
    rows = [torch.tensor([0, 3, 4, 9]), torch.tensor([1, 2, 10])]  # rows 5-8: the base model's
    ref = LoRABatch([(rows[0], first), (rows[1], second)]).add_delta(out.clone(), x, 1, "o_proj")
    ours = out.clone()
    ops.lora_delta(ours, x, [cpp(ops, first), cpp(ops, second)], rows, 1, PROJECTIONS.index("o_proj"))
    assert torch.equal(ours[5:9], out[5:9])
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:  # the same float32 sum, in another order, rounded once: at most an ulp apart
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    # An unadapted projection adds nothing.
    untouched = out.clone()
    ops.lora_delta(untouched, x, [cpp(ops, first)], rows[:1], 1, PROJECTIONS.index("qkv_proj"))
    assert torch.equal(untouched, out)


def test_a_row_does_not_depend_on_the_other_rows(ops: kernels.CpuOps) -> None:
    torch.manual_seed(1)
    weights = cpp(ops, adapter(3, 16, 1))
    x, out = torch.randn(64, IN).to(torch.bfloat16), torch.randn(64, OUT).to(torch.bfloat16)
    together = out.clone()
    ops.lora_delta(together, x, [weights], [torch.arange(64)], 0, PROJECTIONS.index("o_proj"))
    for r in (0, 17, 63):
        alone = out[r:r + 1].clone()
        ops.lora_delta(alone, x[r:r + 1], [weights], [torch.tensor([0])], 0, PROJECTIONS.index("o_proj"))
        assert torch.equal(alone[0], together[r])


def test_bad_rows_are_refused(ops: kernels.CpuOps) -> None:
    weights = cpp(ops, adapter(4, 2, 1))
    x, out = torch.randn(3, IN), torch.randn(3, OUT)
    with pytest.raises(RuntimeError, match="row 3 of a step of 3 rows"):
        ops.lora_delta(out, x, [weights], [torch.tensor([3])], 0, PROJECTIONS.index("o_proj"))
    with pytest.raises(RuntimeError, match="one row index tensor per adapter"):
        ops.lora_delta(out, x, [weights], [], 0, PROJECTIONS.index("o_proj"))
