"""tokenmill on Ray Serve: one local Ray cluster (2 CPUs) for the module, an app of
two replicas of a tiny random Llama (with a small byte-level tokenizer), driven
over HTTP through Ray Serve's proxy: the openai client, prefix-aware routing (seen
in the replicas' own prefix-cache counters) and a replica killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
import torch
import transformers
from ray import serve

from tests.hf_models import COMMON
from tests.server_harness import HOST, free_port
from tests.test_structured_outputs import build_tokenizer
from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.serve_ray.app import RayServeOptions, build_ray_app
from tokenmill.serve_ray.ingress import REPLICAS_PATH, routing_text
from tokenmill.serve_ray.router import PrefixIndex, prefix_hashes

TIMEOUT_S = 60.0
BLOCK_SIZE = 16


# ---- the routing decision, without a cluster -------------------------------------------

def test_prefix_index_prefers_the_holder_within_the_imbalance_bound() -> None:
    index = PrefixIndex()
    index.set_replicas(["a", "b", "c"])
    shared = prefix_hashes("x" * 64 * 8 + "question one")
    assert len(shared) == 8
    index.insert("b", shared)
    other = prefix_hashes("x" * 64 * 3 + "y" * 64 * 5)  # shares 3 blocks with `shared`
    assert index.match("b", other) == 3 and index.match("a", other) == 0
    # The holder wins while it is within the bound...
    assert index.rank({"a": 0, "b": 4, "c": 1}, shared, max_imbalance=4)[0] == "b"
    # ... and is passed over (ranked last, least loaded first) once it is beyond it.
    assert index.rank({"a": 0, "b": 5, "c": 1}, shared, max_imbalance=4) == ["a", "c", "b"]
    # No match: the least loaded, then the replica holding the fewest blocks.
    fresh = prefix_hashes("z" * 64 * 4)
    assert index.rank({"a": 1, "b": 0, "c": 0}, fresh, 4) == ["c", "b", "a"]
    index.set_replicas(["a", "c"])  # b went away: what it held is forgotten
    assert index.match("b", shared) == 0


def test_prefix_index_is_bounded_lru() -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    first, second = prefix_hashes("p" * 64 * 3), prefix_hashes("q" * 64 * 3)
    index.insert("a", first)
    index.insert("a", second)
    assert len(index.blocks["a"]) == 4
    assert index.match("a", second) == 3 and index.match("a", first) == 0  # the oldest went


def test_routing_text_follows_the_prompt() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text(json.dumps(chat).encode()) == "<system>Be brief.\n<user>Hi\n"
    assert routing_text(b'{"prompt": [1, 2, 3], "max_tokens": 4}') == "1,2,3,"
    assert routing_text(b'{"prompt": "Once upon"}') == "Once upon"
    assert routing_text(b'{"input": "hello"}') == "hello"
    assert routing_text(b"not json") == "" and routing_text(b"[1]") == ""


# ---- the app on a Ray cluster -----------------------------------------------------------

@dataclass
class RayApp:
    url: str
    model: str

    def replicas(self) -> list[dict[str, Any]]:
        response = httpx.get(self.url + REPLICAS_PATH, timeout=TIMEOUT_S)
        response.raise_for_status()
        replicas: list[dict[str, Any]] = response.json()["replicas"]
        return sorted(replicas, key=lambda r: r["replica_id"])

    def wait_for_replicas(self, n: int, without_pid: int | None = None,
                          timeout_s: float = 90.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.replicas()
            if len(found) == n and all(r["pid"] != without_pid for r in found):
                return found
            assert time.monotonic() < deadline, f"replicas now: {found}"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayApp]:
    directory: Path = tmp_path_factory.mktemp("serve_ray_model")
    vocab_size = build_tokenizer(directory)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**COMMON, "vocab_size": vocab_size}), dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    # The replicas (Ray's worker processes) import tokenmill as this process does.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        port = free_port()
        serve.start(http_options={"host": HOST, "port": port})
        engine_args = EngineArgs(model=str(directory), dtype="float32", block_size=BLOCK_SIZE,
                                 num_kv_blocks=256, max_num_seqs=32).with_serve_defaults()
        app = build_ray_app(engine_args, ServerConfig(),
                            RayServeOptions(num_replicas=2, num_cpus_per_replica=1))
        serve.run(app, name="tokenmill", route_prefix="/", blocking=False)
        url = f"http://{HOST}:{port}"
        models = httpx.get(url + "/v1/models", timeout=TIMEOUT_S).json()
        ray_app = RayApp(url, models["data"][0]["id"])
        ray_app.wait_for_replicas(2)
        yield ray_app
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_the_openai_client(ray_app: RayApp) -> None:
    client = openai.OpenAI(base_url=ray_app.url + "/v1", api_key="unused",
                           timeout=TIMEOUT_S, max_retries=0)
    messages: Any = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat.completions.create(model=ray_app.model, messages=messages,
                                           max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=ray_app.model, messages=messages,
                                                max_tokens=12, temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    # Greedy on the same weights: either replica gives the same answer, streamed or not.
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    completion = client.completions.create(model=ray_app.model, prompt="Once upon a time",
                                           max_tokens=6, temperature=0)
    assert completion.choices[0].text and completion.usage is not None
    # The routes are the server's: its errors too.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=ray_app.model, prompt="x", max_tokens=-1)


def test_requests_sharing_a_prefix_land_on_one_replica(ray_app: RayApp) -> None:
    prefix_len, suffix_len, repeats = 4 * BLOCK_SIZE, 8, 4
    prefixes = {"A": list(range(10, 10 + prefix_len)), "B": list(range(100, 100 + prefix_len))}
    before = ray_app.replicas()
    # An order that round-robin would split across the replicas.
    order = ["A", "A", "B", "B", "A", "B", "A", "B"]
    seen = {"A": 0, "B": 0}
    for group in order:
        seen[group] += 1
        suffix = [200 + 10 * seen[group] + k for k in range(suffix_len)]
        response = httpx.post(ray_app.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": ray_app.model, "prompt": prefixes[group] + suffix, "max_tokens": 1})
        assert response.status_code == 200, response.text
    after = ray_app.replicas()
    assert [r["replica_id"] for r in before] == [r["replica_id"] for r in after]
    hits = [a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before, strict=True)]
    # Each group on one replica: its 3 repeats each find the prefix's 4 blocks cached;
    # a group split over the replicas would find fewer. The groups on different
    # replicas: the load is spread.
    assert hits == [(repeats - 1) * prefix_len] * 2, (hits, before, after)


def test_a_replica_killed_during_16_streams(ray_app: RayApp) -> None:
    victim = ray_app.replicas()[0]

    async def one(client: httpx.AsyncClient, i: int, started: asyncio.Event,
                  counter: list[int]) -> str:
        body = {"model": ray_app.model, "prompt": [5 + i, 7, 9, 11], "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:  # (not started: refused whole, in OpenAI's shape)
                error = json.loads(await response.aread())["error"]
                assert response.status_code == 503 and error["code"] == "replica_unavailable"
                return "refused"
            events: list[Any] = []
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    counter[0] += 1
                    if counter[0] == 16:
                        started.set()
                events.append(line[6:])
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if "error" in last:
                assert last["error"]["code"] == "replica_unavailable", last
                return "error"
            assert last["choices"][0]["finish_reason"] == "length", last
            return "complete"

    async def run() -> list[str]:
        started = asyncio.Event()
        counter = [0]
        async with httpx.AsyncClient(base_url=ray_app.url, timeout=TIMEOUT_S) as client:
            tasks = [asyncio.create_task(one(client, i, started, counter)) for i in range(16)]
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)

    endings = asyncio.run(run())
    # Every stream ended (none hangs); the killed replica's streams with an error
    # event, the other's complete.
    assert "error" in endings and "complete" in endings, endings
    # Ray Serve brings a replica back, and the app serves again.
    ray_app.wait_for_replicas(2, without_pid=victim["pid"])
    response = httpx.post(ray_app.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": ray_app.model, "prompt": "Once more", "max_tokens": 4})
    assert response.status_code == 200, response.text
