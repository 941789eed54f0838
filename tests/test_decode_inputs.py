"""The runner's inputs for a decode-only step (ModelRunner._prepare_decodes, its
fast path) are the general path's, field by field."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.core.contracts import ScheduledRequest
from tokenmill.core.kv_layout import KVLayout, make_kv_layout, one_group
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner


def _runner(block_size: int, layout: KVLayout) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # (_prepare_* read these only)
    runner.block_size, runner.device, runner.layout = block_size, torch.device("cpu"), layout
    runner._layer_groups = (None if len(layout.groups) == 1 else
                            tuple(layout.place(i)[0] for i in range(layout.num_layers)))
    return runner


def _same(a: object, b: object) -> None:
    if isinstance(a, list) and a and isinstance(a[0], AttentionMetadata):
        return  # (the per-group views, built from the fields compared)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b, (a, b)


# One group, and three (a full-attention group and two windowed: core/kv_layout.py).
LAYOUTS = [one_group(2), make_kv_layout([None, 8, 8, None, 8, 8], free_windows=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["one-group", "three-groups"])
def test_decode_fast_path_gives_the_general_paths_inputs(layout: KVLayout) -> None:
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        runner = _runner(block_size, layout)
        for _ in range(50):
            reqs = []
            for i in range(rng.randint(1, 6)):
                position = rng.randint(0, 70)
                need = position // block_size + 1
                blocks = rng.sample(range(1, 500), need + rng.randint(0, 3))  # (a table may run ahead)
                others = [rng.sample(range(1, 500), len(blocks)) for _ in layout.groups[1:]]
                reqs.append(ScheduledRequest(request_id=str(i), token_ids=[rng.randint(0, 999)],
                                             num_computed_tokens=position, block_ids=blocks,
                                             sampling_params=SamplingParams(), do_sample=True,
                                             group_block_ids=others))
            fast = runner._prepare_inputs(reqs)
            general = runner._prepare_any(reqs)
            for x, y in zip(fast[:2], general[:2], strict=True):
                _same(x, y)
            _same(fast[3], general[3])
            for name in fast[2].__dataclass_fields__:
                _same(getattr(fast[2], name), getattr(general[2], name))
            if len(layout.groups) > 1:  # each group's own tables and slots
                meta = fast[2]
                for layer in range(layout.num_layers):
                    group = layout.place(layer)[0]
                    tables = meta.for_layer(layer).block_tables
                    for row, r in enumerate(reqs):
                        ids = r.block_ids if group == 0 else r.group_block_ids[group - 1]
                        assert tables[row, :len(ids)].tolist() == ids[:tables.shape[1]]
                        p = r.num_computed_tokens
                        assert meta.for_layer(layer).slot_mapping[row] == ids[p // block_size] * block_size + p % block_size
