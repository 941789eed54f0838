"""The prefix cache's second tier (kv_offload_dir, issue 54): full blocks go
to files as computed and come back, once a small KV pool has evicted them, for
a later request with the same prefix, in the same engine and in a new one on
the same directory (a restart), with greedy tokens equal to a cold run's (float32: transformers';
bfloat16: our engine's own cold run, the same bits); bad files (corrupt,
truncated, another model's) cost only misses; two writing processes never
show a reader half a block; the directory keeps its byte bound, least
recently used removed first; /metrics counts it all."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_models import VOCAB_SIZE, build_hf_model, hf_greedy, save_hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_disk import SUFFIX, BlockFiles, decode_block, encode_block

BLOCK = 4
PREFIX_TOKENS = 40  # 10 blocks
# 24 blocks of 4 tokens: one prompt at a time fits, the next one evicts it.
POOL: dict[str, Any] = {"block_size": BLOCK, "num_kv_blocks": 24, "max_num_seqs": 1}
MAX_TOKENS = 8


def _prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts of a distinct 40-token prefix and a 3-token tail each."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_SIZE, size=PREFIX_TOKENS + 3).tolist() for _ in range(count)]


def _llm(path: str, dtype: str, offload: Path | None, **options: Any) -> LLM:
    extra = {} if offload is None else {"kv_offload_dir": str(offload)}
    return LLM(path, dtype=dtype, device="cpu", skip_tokenizer_init=True, check_integrity=True,
               apply_process_settings=False, **POOL, **extra, **options)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt in its own generate call, in order (so each evicts the one before)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
            for p in prompts]


def _block_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX))


def _end_clean(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    scheduler.check_integrity()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    assert not scheduler.requests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = build_hf_model("llama")
    other = build_hf_model("llama", seed=1)  # the same shapes, other weights: another fingerprint
    return {"model": model, "path": save_hf_model(model, tmp_path_factory.mktemp("tiny")),
            "other": save_hf_model(other, tmp_path_factory.mktemp("other"))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_evicted_prefix_loads_from_disk_and_after_a_restart(tiny: dict[str, Any], dtype: str,
                                                            tmp_path: Path) -> None:
    prompts = _prompts(54, 4)
    fillers = _prompts(55, 2)  # other prefixes, to evict the last prompt's blocks too
    if dtype == "float32":
        cold = [hf_greedy(tiny["model"], p, MAX_TOKENS)[0] for p in prompts]
    else:  # bf16: transformers rounds otherwise; the reference is our engine without the tier
        cold = _greedy(_llm(tiny["path"], dtype, None), prompts)

    directory = tmp_path / "kv"
    llm = _llm(tiny["path"], dtype, directory)
    assert _greedy(llm, prompts + fillers)[:4] == cold
    stats = llm.engine.stats().kv_offload
    assert stats is not None and stats.hits == 0 and stats.transfers.num_stored_blocks >= 4 * 10
    # Each prompt again: its blocks were evicted (the pool holds one prompt), so they load.
    assert _greedy(llm, prompts) == cold
    stats = llm.engine.stats().kv_offload
    assert stats is not None
    assert stats.hits == 4 * PREFIX_TOKENS and stats.transfers.num_loaded_blocks == 4 * 10
    assert stats.transfers.num_failed_loads == 0 and stats.transfers.bytes_loaded > 0
    _end_clean(llm)

    # A restart: a new engine on the same directory loads what the first one wrote.
    restarted = _llm(tiny["path"], dtype, directory)
    outputs = restarted.generate([{"prompt_token_ids": p} for p in prompts[:1]],
                                 SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                 use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == cold[0]
    assert outputs[0].num_cached_tokens == PREFIX_TOKENS
    assert _greedy(restarted, prompts[1:]) == cold[1:]
    stats = restarted.engine.stats().kv_offload
    assert stats is not None and stats.hits == 4 * PREFIX_TOKENS == stats.queries
    _end_clean(restarted)


def test_bad_files_change_nothing_but_the_miss_count(tiny: dict[str, Any], tmp_path: Path) -> None:
    """20 prefixes of 10 blocks on disk; in a copy, 100 of their 200 files made
    bad: 34 corrupt (a byte flipped), 33 truncated, 33 another model's files
    under our names (the same tokens, another fingerprint inside); the other
    model's own files lie beside them too. A new engine on each copy gives the
    same tokens; on the bad one, 100 loads fail and the hits are fewer."""
    prompts = _prompts(7, 20)
    flush = _prompts(8, 2)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _greedy(_llm(tiny["path"], "float32", ours), prompts + flush)
    _greedy(_llm(tiny["other"], "float32", theirs), prompts + flush)
    clean, bad = tmp_path / "clean", tmp_path / "bad"
    shutil.copytree(ours, clean)
    shutil.copytree(ours, bad)
    their_files = {p.name.split("-", 1)[1]: p for p in _block_files(theirs)}
    our_fp = _block_files(ours)[0].name.split("-", 1)[0]
    assert our_fp != next(iter(their_files.values())).name.split("-", 1)[0]

    # Five bad files in each prompt's chain of ten (the first block among them, for some).
    llm = _llm(tiny["path"], "float32", None)
    rng = random.Random(0)
    damaged = 0
    for i, prompt in enumerate(prompts):
        request_hashes = _chain_hashes(llm, prompt)
        for j, position in enumerate(sorted(rng.sample(range(10), 5))):
            path = bad / f"{our_fp}-{request_hashes[position] & 0xFFFF_FFFF_FFFF_FFFF:016x}{SUFFIX}"
            data = bytearray(path.read_bytes())
            kind = (5 * i + j) % 3
            if kind == 0:  # corrupt: one payload byte flipped
                data[len(data) // 2] ^= 0x40
                path.write_bytes(bytes(data))
            elif kind == 1:  # truncated
                path.write_bytes(bytes(data[: len(data) - 1 - rng.randrange(len(data) // 2)]))
            else:  # another model's block of the same tokens, under our name
                shutil.copy(their_files[path.name.split("-", 1)[1]], path)
            damaged += 1
    assert damaged == 100
    for path in their_files.values():  # and their own files, under their names
        shutil.copy(path, bad / path.name)

    cold = [hf_greedy(tiny["model"], p, MAX_TOKENS)[0] for p in prompts]
    runs = {}
    for name, directory in (("clean", clean), ("bad", bad)):
        engine = _llm(tiny["path"], "float32", directory)
        assert _greedy(engine, prompts) == cold, name
        _end_clean(engine)
        runs[name] = engine.engine.stats().kv_offload
    assert runs["clean"] is not None and runs["bad"] is not None
    assert runs["clean"].transfers.num_failed_loads == 0
    assert runs["clean"].hits == 20 * PREFIX_TOKENS == runs["clean"].queries
    assert runs["bad"].transfers.num_failed_loads == 100
    assert runs["bad"].queries == runs["clean"].queries
    assert runs["bad"].hits < runs["clean"].hits  # the misses: queries - hits
    assert not any(p.name.endswith(".tmp") for p in bad.iterdir())


def _chain_hashes(llm: LLM, prompt: list[int]) -> list[int]:
    from tokenmill.core.kv_cache_manager import update_block_hashes
    from tokenmill.core.request import Request

    request = Request("x", prompt, SamplingParams())
    update_block_hashes(request, BLOCK)
    return request.block_hashes


def test_abort_while_loading_leaves_the_pool_whole(tiny: dict[str, Any], tmp_path: Path) -> None:
    """A request whose blocks are loading is aborted at the step boundary: its
    loads land as cache entries, held blocks go back, nothing leaks."""
    prompts = _prompts(9, 2)
    directory = tmp_path / "kv"
    _greedy(_llm(tiny["path"], "float32", directory), prompts + _prompts(10, 2))
    llm = _llm(tiny["path"], "float32", directory)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompts[0]},
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    step = engine.schedule()
    assert len(step.scheduler_output.kv_loads) == 10 and not step.scheduler_output.scheduled
    engine.execute(step)
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # (the schedule after the load lets go of its blocks)
    _end_clean(llm)
    assert len(engine.scheduler.kv.pool.cached) == 10  # the loaded blocks stay cached


def test_byte_bound_removes_the_least_recently_used(tmp_path: Path) -> None:
    files = BlockFiles(str(tmp_path), "ab" * 16, max_bytes=10**9)
    payload = bytes(1000)
    for h in range(8):
        files.write(h, h - 1, [h] * 4, payload)
        os.utime(files.path(h), ns=(10**9 * (100 + h),) * 2)  # (mtime order = write order)
    size = os.path.getsize(files.path(0))
    assert files.read(0, -1, [0] * 4, 1000) is not None  # a use: block 0 is now the newest
    files.max_bytes = 5 * size
    scan = files.enforce_bound()
    assert scan.total_bytes <= 5 * size and scan.num_removed == 3
    left = {h for h in range(8) if os.path.exists(files.path(h))}
    assert left == {0, 4, 5, 6, 7}  # 1, 2, 3: the least recently used


def test_engine_keeps_the_byte_bound(tiny: dict[str, Any], tmp_path: Path) -> None:
    """Six prompts of 12 full blocks each, written through as computed, into a
    bound of 30 files: the bound holds, the first prompts' files are the ones
    removed, and the tokens stay transformers'."""
    directory = tmp_path / "kv"
    prompts = _prompts(11, 6)
    _greedy(_llm(tiny["path"], "float32", directory), prompts[:1])
    one = os.path.getsize(_block_files(directory)[0])
    shutil.rmtree(directory)
    bound = 30 * one
    llm = _llm(tiny["path"], "float32", directory, kv_offload_bytes=bound)
    cold = [hf_greedy(tiny["model"], p, MAX_TOKENS)[0] for p in prompts]
    assert _greedy(llm, prompts) == cold
    files = _block_files(directory)
    assert sum(p.stat().st_size for p in files) <= bound and len(files) == 30
    stats = llm.engine.stats().kv_offload
    assert stats is not None and stats.transfers.num_files_removed >= 6 * 12 - 30
    suffixes = {p.name.split("-", 1)[1] for p in files}

    def on_disk(prompt: list[int]) -> int:
        return sum(f"{h & 0xFFFF_FFFF_FFFF_FFFF:016x}{SUFFIX}" in suffixes for h in _chain_hashes(llm, prompt))

    assert [on_disk(p) for p in prompts[:2]] == [0, 0]  # the least recently used went
    assert on_disk(prompts[-1]) == on_disk(prompts[-2]) == 10  # (their prompts' 10 full blocks)


WRITER = """
import os, sys, time
from tokenmill.core.kv_disk import BlockFiles
directory, writer, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
files = BlockFiles(directory, "cd" * 16, max_bytes=40 * (1 << 20))
end = time.monotonic() + seconds
while time.monotonic() < end:
    for h in range(16):
        try:
            os.unlink(files.path(h))  # (so the write is a real one, racing the other writer)
        except OSError:
            pass
        files.write(h, 7, [h, writer], bytes([writer + 1]) * (1 << 20))
        files.after_writes()
"""


def test_concurrent_writers_never_show_half_a_block(tmp_path: Path) -> None:
    """Two processes rewrite the same 16 blocks of 1 MiB (each its own content)
    for 3 s while this one reads them: every file read whole decodes and is one
    writer's block, never a mixture or a torn write."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(w), "3"], env=env)
               for w in (0, 1)]
    fp = "cd" * 16
    reads = {0: 0, 1: 0}
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        for h in range(16):
            path = tmp_path / f"{fp}-{h:016x}{SUFFIX}"
            try:
                data = path.read_bytes()
            except OSError:
                continue  # (between a writer's unlink and its rename)
            for w in (0, 1):
                payload = decode_block(data, fp, h, 7, [h, w], 1 << 20)
                if payload is not None:
                    assert bytes(payload[:1]) == bytes(payload[-1:]) == bytes([w + 1])
                    reads[w] += 1
                    break
            else:
                raise AssertionError(f"block {h}: {len(data)} bytes that are neither writer's block")
    for process in writers:
        assert process.wait(timeout=30) == 0
    assert reads[0] > 10 and reads[1] > 10, reads


def test_encoding_round_trip_and_every_check() -> None:
    fp = "0f" * 16
    data = b"".join(encode_block(fp, -5, 3, [1, 2, 3, 4], b"kv!" * 10))
    assert bytes(decode_block(data, fp, -5, 3, [1, 2, 3, 4], 30) or b"") == b"kv!" * 10
    assert decode_block(data, "1f" * 16, -5, 3, [1, 2, 3, 4], 30) is None  # another engine's
    assert decode_block(data, fp, -5, 4, [1, 2, 3, 4], 30) is None  # another parent
    assert decode_block(data, fp, -5, 3, [1, 2, 3, 5], 30) is None  # other tokens (a collision)
    assert decode_block(data[:-1], fp, -5, 3, [1, 2, 3, 4], 30) is None  # truncated
    flipped = bytearray(data)
    flipped[-10] ^= 1
    assert decode_block(flipped, fp, -5, 3, [1, 2, 3, 4], 30) is None  # corrupt


def test_blocks_that_accepted_drafts_fill_are_written_too(tiny: dict[str, Any], tmp_path: Path) -> None:
    """With n-gram speculation, a block completed by accepted drafts is registered
    after the step; the next step's stores write it, so every full block of the
    sequence (the last token's K/V is never computed) has its file, except one
    that the final step's drafts completed (no step comes after it: at most one
    here, 3 drafts + 1 token in blocks of 4). Without the next step's stores: 14 of 17."""
    directory = tmp_path / "kv"
    llm = _llm(tiny["path"], "float32", directory,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompt = [5, 6, 7, 8, 9] * 6
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    spec = llm.engine.stats().spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0
    full_blocks = (len(prompt) + len(out.outputs[0].token_ids) - 1) // BLOCK
    assert full_blocks - 1 <= len(_block_files(directory)) <= full_blocks
    _end_clean(llm)


def test_bad_options_are_refused(tiny: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs prefix caching on"):
        _llm(tiny["path"], "float32", tmp_path, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_bytes must be positive"):
        _llm(tiny["path"], "float32", tmp_path, kv_offload_bytes=0)
    with pytest.raises(ValueError, match="scheduling_policy='static'"):
        _llm(tiny["path"], "float32", tmp_path, scheduling_policy="static")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot be used"):
        _llm(tiny["path"], "float32", blocker / "kv")


def test_metrics_count_hits_misses_bytes_and_time(tmp_path: Path) -> None:
    """/metrics (the default model): vLLM's external_prefix_cache_* counters and
    kv_offload_total_bytes / _time by direction, as the engine counted them."""
    from tests.server_harness import ServerThread
    from tokenmill.config import ServerConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server import build_app

    # 8 blocks of 16: the middle prompt (~113 tokens) evicts the first one whole.
    llm = LLM(dtype="float32", num_kv_blocks=8, max_num_seqs=1, kv_offload_dir=str(tmp_path),
              apply_process_settings=False)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig())).start()
    shared = "The quick brown fox jumps over the lazy dog near the river bank at dawn. " * 3
    try:
        for prompt in (shared + "First,", "Count to three, then to ten, slowly and one by one, " * 8,
                       shared + "Second,"):
            r = httpx.post(server.url + "/v1/completions",
                           json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics", timeout=60).text
    finally:
        server.stop()
        engine.shutdown()
    samples = {(s.name, s.labels.get("transfer_type")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    stats = engine.stats().kv_offload
    assert stats is not None and stats.hits > 0
    assert samples["tokenmill:external_prefix_cache_hits_total", None] == stats.hits
    assert samples["tokenmill:external_prefix_cache_queries_total", None] == stats.queries
    t = stats.transfers
    assert samples["tokenmill:kv_offload_total_bytes_total", "disk_to_cpu"] == t.bytes_loaded > 0
    assert samples["tokenmill:kv_offload_total_bytes_total", "cpu_to_disk"] == t.bytes_stored > 0
    assert samples["tokenmill:kv_offload_total_time_total", "disk_to_cpu"] == pytest.approx(t.load_s)
    assert samples["tokenmill:kv_offload_failed_loads_total", None] == 0
