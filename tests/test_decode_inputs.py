"""The runner's inputs for a decode-only step (ModelRunner._prepare_decodes, its
fast path) are the general path's, field by field."""

from __future__ import annotations

import random

import torch

from tokenmill.core.contracts import ScheduledRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner


def _runner(block_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # (_prepare_* read these two only)
    runner.block_size, runner.device = block_size, torch.device("cpu")
    return runner


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b, (a, b)


def test_decode_fast_path_gives_the_general_paths_inputs() -> None:
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        runner = _runner(block_size)
        for _ in range(50):
            reqs = []
            for i in range(rng.randint(1, 6)):
                position = rng.randint(0, 70)
                need = position // block_size + 1
                blocks = rng.sample(range(1, 500), need + rng.randint(0, 3))  # (a table may run ahead)
                reqs.append(ScheduledRequest(request_id=str(i), token_ids=[rng.randint(0, 999)],
                                             num_computed_tokens=position, block_ids=blocks,
                                             sampling_params=SamplingParams(), do_sample=True))
            fast = runner._prepare_inputs(reqs)
            general = runner._prepare_any(reqs)
            for x, y in zip(fast[:2], general[:2], strict=True):
                _same(x, y)
            _same(fast[3], general[3])
            for name in fast[2].__dataclass_fields__:
                _same(getattr(fast[2], name), getattr(general[2], name))
