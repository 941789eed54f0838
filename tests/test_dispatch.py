"""dispatch.choose_path as a table: the step's shape and the plan's facts in,
the path out (the paths' numbers are compared in test_model_numerics.py); and
the options the plan is built with."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.backends.cpu.dispatch import Path, PathFacts, Route, choose_path
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.model.attention_metadata import AttentionMetadata

_NONE = torch.empty(0, dtype=torch.int64)


def _meta(query_lens: list[int], seq_len: int = 300, per_token: bool = True) -> AttentionMetadata:
    """A step of requests with these query lengths (decodes first), every context seq_len."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        num_decodes=sum(q == 1 for q in query_lens), query_start_loc=starts, seq_lens=[seq_len] * len(query_lens),
        max_decode_seq_len=seq_len, slot_mapping=_NONE, block_tables=_NONE, decode_seq_lens=_NONE, block_size=16,
        token_seq_ids=_NONE if per_token else None, token_seq_lens=_NONE if per_token else None)


FACTS = PathFacts(has_layers=True, shard=False, tp_layer_loop=True, row_cost=460.0, split_min_rows=16.0)
SHARD = dataclasses.replace(FACTS, shard=True)
DECODES = _meta([1] * 64)
MIXED = _meta([1] * 4 + [32])

# (case, metadata, facts, profiling, all_rows, threads, shm_group) -> path
CASES = [
    ("decodes that divide well: split", DECODES, FACTS, False, True, 2, False, Path.SPLIT),
    ("decodes, some rows not sampled: loop", DECODES, FACTS, False, False, 2, False, Path.LOOP),
    ("decodes, one thread: loop", DECODES, FACTS, False, True, 1, False, Path.LOOP),
    ("few decodes a thread: loop", _meta([1] * 8), FACTS, False, True, 2, False, Path.LOOP),
    ("decodes of a model with experts (E / top_k = 16 times the rows a thread): loop", DECODES,
     dataclasses.replace(FACTS, split_min_rows=16.0 * 16), False, True, 2, False, Path.LOOP),
    ("a prefill chunk, token metadata: loop", MIXED, FACTS, False, True, 2, False, Path.LOOP),
    ("a prefill, per-request metadata: python", _meta([1, 32], per_token=False), FACTS, False, True, 2,
     False, Path.PYTHON),
    ("decodes, per-request metadata: split", _meta([1] * 64, per_token=False), FACTS, False, True, 2, False,
     Path.SPLIT),
    ("under the profiler: python", DECODES, FACTS, True, True, 2, False, Path.PYTHON),
    ("a long prefill: loop (every row count runs from the packed weights)", _meta([1] * 4 + [5000]), FACTS,
     False, True, 2, False, Path.LOOP),
    ("no layers: python", DECODES, dataclasses.replace(FACTS, has_layers=False), False, True, 2, False,
     Path.PYTHON),
    ("a shard over shared memory: its C++ loop", DECODES, SHARD, False, True, 2, True, Path.TP_LOOP),
    ("a shard's prefill over shared memory", MIXED, SHARD, False, False, 2, True, Path.TP_LOOP),
    ("a shard over gloo: python", DECODES, SHARD, False, True, 2, False, Path.PYTHON),
    ("a shard with tp_layer_loop off: python", DECODES, dataclasses.replace(SHARD, tp_layer_loop=False),
     False, True, 2, True, Path.PYTHON),
    ("a shard under the profiler: python", DECODES, SHARD, True, True, 2, True, Path.PYTHON),
]


@pytest.mark.parametrize(("meta", "facts", "profiling", "all_rows", "threads", "shm_group", "path"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_choose_path(meta: AttentionMetadata, facts: PathFacts, profiling: bool, all_rows: bool, threads: int,
                     shm_group: bool, path: Path) -> None:
    route = choose_path(meta, facts, profiling=profiling, all_rows=all_rows, threads=threads,
                        shm_group=shm_group)
    assert route.path is path
    assert (route.split_bounds is not None) == (path is Path.SPLIT)


def test_split_carries_each_threads_rows() -> None:
    route = choose_path(DECODES, FACTS, profiling=False, all_rows=True, threads=2, shm_group=False)
    assert route == Route(Path.SPLIT, [0, 32, 64])
    lopsided = dataclasses.replace(DECODES, seq_lens=[200000] + [300] * 63)  # one request outweighs the rest
    assert choose_path(lopsided, FACTS, profiling=False, all_rows=True, threads=2,
                       shm_group=False).path is Path.LOOP


def test_the_kv_prefetch_option_comes_from_its_variable_and_refuses_other_modes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TOKENMILL_KV_PREFETCH", raising=False)
    assert CpuBackendOptions.from_env().kv_prefetch == "auto"
    monkeypatch.setenv("TOKENMILL_KV_PREFETCH", "off")
    assert CpuBackendOptions.from_env().kv_prefetch == "off"
    monkeypatch.setenv("TOKENMILL_KV_PREFETCH", "sometimes")
    with pytest.raises(ValueError, match=r"auto, off, on.*TOKENMILL_KV_PREFETCH"):
        CpuBackendOptions.from_env()


def test_lora_rows_take_the_paths_of_base_rows() -> None:
    """A step with LoRA rows takes the path a step without them would (the
    layer loop, or the split stack's threads each on their own rows, add the
    deltas after each projection); the Python loop where no C++ path serves
    (the profiler, several attention calls) and on a tensor-parallel shard."""
    for meta in (DECODES, MIXED):
        for all_rows in (True, False):
            base = choose_path(meta, FACTS, profiling=False, all_rows=all_rows, threads=2, shm_group=False)
            assert choose_path(meta, FACTS, profiling=False, all_rows=all_rows, threads=2, shm_group=False,
                               lora=True) == base
    assert choose_path(DECODES, FACTS, profiling=False, all_rows=True, threads=2, shm_group=False,
                       lora=True).path is Path.SPLIT
    assert choose_path(DECODES, dataclasses.replace(FACTS, shard=True, tp_layer_loop=True), profiling=False,
                       all_rows=True, threads=2, shm_group=True, lora=True).path is Path.PYTHON
    assert choose_path(DECODES, FACTS, profiling=True, all_rows=True, threads=2, shm_group=False,
                       lora=True).path is Path.PYTHON
    assert choose_path(_meta([1, 32], per_token=False), FACTS, profiling=False, all_rows=True, threads=2,
                       shm_group=False, lora=True).path is Path.PYTHON
