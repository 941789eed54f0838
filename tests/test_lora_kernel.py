"""The CPU plan's LoRA kernel (csrc lora_delta) against LoRABatch.add_delta,
the reference's torch recipe: the same deltas within float32's rounding (bf16:
within one rounding of the output; bf16 adapter weights: against the recipe on
the same rounded weights), fused parts without their zeros, adapters on their
own rows only, and a row's bits independent of the other rows of the step and
of the number of threads."""

from __future__ import annotations

import pytest
import torch

from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.plan import lora_weights
from tokenmill.model.lora import PROJECTIONS, LoRAAdapter, LoRABatch, LoRAWeights

IN, OUT, LAYERS = 48, 80, 2


@pytest.fixture(scope="module")
def ops() -> kernels.CpuOps:
    module = kernels.load()
    if module is None:
        pytest.skip("the C++ kernels are not built here")
    return module


def adapter(seed: int, rank: int, lora_int_id: int, split: int | None = None) -> LoRAAdapter:
    """Random weights on o_proj's slot (IN -> OUT) of every layer; the others
    unadapted. `split`: two parts (outputs [0, split) with ranks [0, rank) and
    the rest with ranks [rank, rank + 3)), B block-diagonal, as a fused qkv."""
    gen = torch.Generator().manual_seed(seed)
    total = rank if split is None else rank + 3
    parts = ((0, OUT, 0, rank),) if split is None else ((0, split, 0, rank), (split, OUT, rank, total))
    layers = []
    for _ in range(LAYERS):
        b = torch.zeros(OUT, total)
        for lo, hi, r0, r1 in parts:
            b[lo:hi, r0:r1] = torch.randn(hi - lo, r1 - r0, generator=gen)
        layers.append({"o_proj": LoRAWeights(a=torch.randn(total, IN, generator=gen), b=b,
                                             scale=torch.rand(total, generator=gen) + 0.5, parts=parts)})
    return LoRAAdapter(lora_int_id, f"a{seed}", total, tuple(layers))


def rounded(a: LoRAAdapter) -> LoRAAdapter:
    """`a` with A and B rounded to bf16 (what lora_weights keeps for a bf16 model)."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()
    return LoRAAdapter(a.lora_int_id, a.lora_name, a.rank, tuple(
        {k: LoRAWeights(a=r(w.a), b=r(w.b), scale=w.scale, parts=w.parts) for k, w in layer.items()}
        for layer in a.layers))


def cpp(ops: kernels.CpuOps, a: LoRAAdapter, dtype: torch.dtype = torch.float32) -> kernels.CppLoraAdapterWeights:
    return lora_weights(ops, a, dtype)


@pytest.mark.parametrize(("dtype", "weights"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("split", [None, 24])
def test_the_kernel_is_add_delta(ops: kernels.CpuOps, dtype: torch.dtype, weights: torch.dtype,
                                 split: int | None) -> None:
    torch.manual_seed(0)
    first, second = adapter(1, 4, 1, split), adapter(2, 16, 2, split)
    x, out = torch.randn(11, IN).to(dtype), torch.randn(11, OUT).to(dtype)
    rows = [torch.tensor([0, 3, 4, 9, 6, 7]), torch.tensor([1, 2, 10])]  # rows 5 and 8: the base model's
    refs = (first, second) if weights == torch.float32 else (rounded(first), rounded(second))
    ref = LoRABatch([(rows[0], refs[0]), (rows[1], refs[1])]).add_delta(out.clone(), x, 1, "o_proj")
    ours = out.clone()
    ops.lora_delta(ours, x, [cpp(ops, first, weights), cpp(ops, second, weights)], rows, 1,
                   PROJECTIONS.index("o_proj"))
    assert torch.equal(ours[[5, 8]], out[[5, 8]])
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    else:  # the same float32 sum, in another order, rounded once: at most an ulp apart
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
    # An unadapted projection adds nothing.
    untouched = out.clone()
    ops.lora_delta(untouched, x, [cpp(ops, first, weights)], rows[:1], 1, PROJECTIONS.index("qkv_proj"))
    assert torch.equal(untouched, out)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_other_rows(ops: kernels.CpuOps, weights: torch.dtype) -> None:
    torch.manual_seed(1)
    packed = cpp(ops, adapter(3, 16, 1, split=40), weights)
    x, out = torch.randn(64, IN).to(torch.bfloat16), torch.randn(64, OUT).to(torch.bfloat16)
    together = out.clone()
    ops.lora_delta(together, x, [packed], [torch.arange(64)], 0, PROJECTIONS.index("o_proj"))
    for r in (0, 17, 63):
        alone = out[r:r + 1].clone()
        ops.lora_delta(alone, x[r:r + 1], [packed], [torch.tensor([0])], 0, PROJECTIONS.index("o_proj"))
        assert torch.equal(alone[0], together[r])
    threads = torch.get_num_threads()
    try:  # one thread does every tile: the same bits
        torch.set_num_threads(1)
        single = out.clone()
        ops.lora_delta(single, x, [packed], [torch.arange(64)], 0, PROJECTIONS.index("o_proj"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, together)


def test_bad_rows_are_refused(ops: kernels.CpuOps) -> None:
    weights = cpp(ops, adapter(4, 2, 1))
    x, out = torch.randn(3, IN), torch.randn(3, OUT)
    with pytest.raises(RuntimeError, match="row 3 of a step of 3 rows"):
        ops.lora_delta(out, x, [weights], [torch.tensor([3])], 0, PROJECTIONS.index("o_proj"))
    with pytest.raises(RuntimeError, match="one row index tensor per adapter"):
        ops.lora_delta(out, x, [weights], [], 0, PROJECTIONS.index("o_proj"))
