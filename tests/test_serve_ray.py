"""tokenmill on Ray Serve: one local Ray cluster (4 logical CPUs on however many
cores) for the module, an app of two replicas of a tiny random Llama (with a small
byte-level tokenizer), driven over HTTP through Ray Serve's proxy: the openai
client, prefix-aware routing (seen in the replicas' own prefix-cache counters),
/metrics from every replica, /v1/responses kept on the replica that stored them,
and a replica killed mid-stream; beside it, under /tp, an app of one replica with
tensor parallelism 2 (rank 1 a Ray actor in the replica's placement group)."""

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
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tests.hf_models import COMMON
from tests.server_harness import HOST, free_port
from tests.test_structured_outputs import build_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.serve_ray.app import RayServeOptions, build_ray_app, tensor_parallel_placement
from tokenmill.serve_ray.ingress import (
    REPLICAS_PATH,
    merge_metrics,
    named_response,
    response_id_in,
    routing_text,
)
from tokenmill.serve_ray.router import InFlight, PrefixIndex, ResponseOwners, prefix_hashes

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


def test_in_flight_credits_each_completion_to_its_own_replica() -> None:
    loads = InFlight()
    loads.set_replicas(["a", "b"])
    # One ingress request fanning out to both replicas shares its id (/metrics):
    # the second call is routed before the first one's completion arrives.
    loads.routed("r1", "a")
    loads.routed("r1", "b")
    loads.completed("r1", "a")
    assert loads.loads == {"a": 0, "b": 1}
    loads.completed("r1", "b")
    loads.completed("r1", "b")  # (a second report of it changes nothing)
    assert loads.loads == {"a": 0, "b": 0} and not loads.calls
    loads.routed("r2", "a")
    loads.forget("a")  # died: its calls are forgotten with it
    loads.completed("r2", "a")
    assert loads.loads == {"b": 0} and not loads.calls


def test_routing_text_follows_the_prompt() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text(json.dumps(chat).encode()) == "<system>Be brief.\n<user>Hi\n"
    assert routing_text(b'{"prompt": [1, 2, 3], "max_tokens": 4}') == "1,2,3,"
    assert routing_text(b'{"prompt": "Once upon"}') == "Once upon"
    assert routing_text(b'{"input": "hello"}') == "hello"
    assert routing_text(b"not json") == "" and routing_text(b"[1]") == ""


def test_merge_metrics_labels_every_series_with_its_replica() -> None:
    def text(n: int) -> str:
        return (f"# HELP t:requests_total Requests.\n# TYPE t:requests_total counter\n"
                f't:requests_total{{model_name="m"}} {n}\n'
                "# HELP t:ttft TTFT.\n# TYPE t:ttft histogram\n"
                f't:ttft_bucket{{le="1.0"}} {n}\nt:ttft_bucket{{le="+Inf"}} {n}\n'
                f"t:ttft_count {n}\nt:ttft_sum {n / 2}\n"
                f"# HELP t:running Running.\n# TYPE t:running gauge\nt:running {n}\n")

    merged = merge_metrics([("r1", text(1)), ("r2", text(3))]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert {n: f.type for n, f in families.items()} == {
        "t:requests": "counter", "t:ttft": "histogram", "t:running": "gauge"}
    # Each family once (a second "# TYPE" line for it would not parse), every
    # sample from both replicas, labelled.
    assert merged.count("# TYPE t:ttft histogram") == 1
    values = {(s.name, s.labels["replica"], s.labels.get("le")): s.value
              for f in families.values() for s in f.samples}
    assert values[("t:requests_total", "r1", None)] == 1 and values[("t:requests_total", "r2", None)] == 3
    assert values[("t:ttft_bucket", "r2", "+Inf")] == 3 and values[("t:ttft_sum", "r1", None)] == 0.5
    assert values[("t:running", "r2", None)] == 3 and len(values) == 2 * 6


def test_response_owners_and_the_ids_requests_name() -> None:
    owners = ResponseOwners(max_entries=2)
    owners.learn("resp_a", "r1")
    owners.learn("resp_b", "r2")
    assert owners.owner("resp_a") == "r1"  # (now the most recent)
    owners.learn("resp_c", "r1")
    assert owners.owner("resp_b") is None and owners.owner("resp_a") == "r1"  # bounded, LRU
    body = json.dumps({"input": "hi", "previous_response_id": "resp_a"}).encode()
    assert named_response("POST", "/v1/responses", body) == ("resp_a", "previous_response_id")
    assert named_response("POST", "/v1/responses", b'{"input": "hi"}') is None
    assert named_response("GET", "/v1/responses/resp_b", b"") == ("resp_b", None)
    assert named_response("POST", "/v1/completions", body) is None
    assert response_id_in(b'{"id": "resp_x", "object": "response"}', event_stream=False) == "resp_x"
    created = {"type": "response.created", "response": {"id": "resp_y"}}
    event = f"event: response.created\ndata: {json.dumps(created)}\n\n".encode()
    assert response_id_in(event, event_stream=True) == "resp_y"
    assert response_id_in(b"data: [DONE]\n\n", event_stream=True) is None


def test_tensor_parallel_replicas_take_a_placement_group() -> None:
    args = EngineArgs(model="m", tensor_parallel_size=2)
    replica_args, placement = tensor_parallel_placement(
        args, RayServeOptions(placement_group_strategy="STRICT_SPREAD"))
    assert replica_args.distributed_executor_backend == "ray"
    assert placement == {"placement_group_strategy": "STRICT_SPREAD"}
    assert tensor_parallel_placement(EngineArgs(model="m"), RayServeOptions()) == (EngineArgs(model="m"), {})
    with pytest.raises(ValueError, match="--nnodes"):
        tensor_parallel_placement(EngineArgs(model="m", tensor_parallel_size=2, nnodes=2, master_port=29500),
                                  RayServeOptions())
    with pytest.raises(ValueError, match="placement_group_strategy"):
        RayServeOptions(placement_group_strategy="ANYWHERE")


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


@dataclass
class RayCluster:
    url: str
    model_dir: str


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    directory: Path = tmp_path_factory.mktemp("serve_ray_model")
    vocab_size = build_tokenizer(directory)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**COMMON, "vocab_size": vocab_size}), dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    # The replicas (Ray's worker processes) import tokenmill as this process does.
    # 4 logical CPUs: the two-replica app's 2 and the TP app's 2 bundles of 1.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    try:
        port = free_port()
        serve.start(http_options={"host": HOST, "port": port})
        yield RayCluster(f"http://{HOST}:{port}", str(directory))
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(cluster: RayCluster, name: str, route_prefix: str, options: RayServeOptions,
           **engine: Any) -> RayApp:
    engine_args = EngineArgs(model=cluster.model_dir, dtype="float32", block_size=BLOCK_SIZE,
                             num_kv_blocks=256, max_num_seqs=32, **engine).with_serve_defaults()
    serve.run(build_ray_app(engine_args, ServerConfig(), options), name=name,
              route_prefix=route_prefix, blocking=False)
    url = cluster.url + route_prefix.rstrip("/")
    models = httpx.get(url + "/v1/models", timeout=TIMEOUT_S).json()
    app = RayApp(url, models["data"][0]["id"])
    app.wait_for_replicas(options.num_replicas)
    return app


@pytest.fixture(scope="module")
def ray_app(ray_cluster: RayCluster) -> RayApp:
    return deploy(ray_cluster, "tokenmill", "/", RayServeOptions(num_replicas=2, num_cpus_per_replica=1))


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


def test_metrics_come_from_every_replica(ray_app: RayApp) -> None:
    replicas = ray_app.replicas()
    response = httpx.get(ray_app.url + "/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    labelled = {s.labels.get("replica") for f in families.values() for s in f.samples}
    assert labelled == {r["replica_id"] for r in replicas}  # every series labelled, every replica
    # Each replica's series are its own: they agree with its engine's counters.
    queries = {s.labels["replica"]: s.value
               for s in families["tokenmill:prefix_cache_queries"].samples if s.name.endswith("_total")}
    assert queries == {r["replica_id"]: r["prefix_cache_queries"] for r in replicas}


def test_responses_stay_on_the_replica_that_stored_them(ray_app: RayApp) -> None:
    client = openai.OpenAI(base_url=ray_app.url + "/v1", api_key="unused",
                           timeout=TIMEOUT_S, max_retries=0)

    def ask(text: str, previous: str | None = None) -> Any:
        return client.responses.create(model=ray_app.model, input=text, max_output_tokens=3,
                                       temperature=0, previous_response_id=previous)

    # Distinct inputs of several routing blocks: the router spreads them over the
    # replicas (the one holding fewer blocks next), as it spreads their follow-ups.
    first = [ask(f"{i} " + f"conversation number {i}. " * 8).id for i in range(6)]
    for _ in range(2):
        for i, rid in enumerate(first):
            follow = ask(f"and then {i} " + "go on please. " * 6, previous=rid)
            assert follow.previous_response_id == rid
    streamed = client.responses.create(model=ray_app.model, input="a streamed question " * 5,
                                       max_output_tokens=3, stream=True)
    streamed_id = next(e.response.id for e in streamed if e.type == "response.created")
    for rid in [*first, streamed_id]:
        got = httpx.get(f"{ray_app.url}/v1/responses/{rid}", timeout=TIMEOUT_S)
        assert got.status_code == 200 and got.json()["id"] == rid
        assert ask("one more " * 10, previous=rid).previous_response_id == rid
    # The replica that stored some of them goes away: those name it in a 404; the
    # others still work.
    victim = ray_app.replicas()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    ray_app.wait_for_replicas(2, without_pid=victim["pid"])
    outcomes = []
    for rid in first:
        try:
            ask("after the loss " * 5, previous=rid)
            outcomes.append("ok")
        except openai.NotFoundError as e:
            assert victim["replica_id"] in str(e) and "gone away" in str(e), e
            assert e.body["code"] == "response_not_found", e.body  # type: ignore[index]
            outcomes.append("gone")
    # (Six fresh prompts alternate between two equally loaded replicas.)
    assert sorted(set(outcomes)) == ["gone", "ok"], (outcomes, victim)


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


# ---- tensor parallelism inside a replica ---------------------------------------------

TP_PROMPTS = [[5, 7, 9, 11], list(range(20, 60)), [3] * 17, list(range(90, 70, -1))]


@pytest.fixture(scope="module")
def tp_app(ray_cluster: RayCluster) -> RayApp:
    return deploy(ray_cluster, "tokenmill-tp", "/tp",
                  RayServeOptions(num_replicas=1, num_cpus_per_replica=2), tensor_parallel_size=2)


def greedy(url: str, model: str, prompts: list[list[int]] = TP_PROMPTS) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
    texts = []
    for prompt in prompts:
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.usage is not None and completion.usage.completion_tokens == 12
        texts.append(completion.choices[0].text)
    return texts


def process_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_tensor_parallel_replica(tp_app: RayApp, ray_cluster: RayCluster) -> None:
    llm = LLM(ray_cluster.model_dir, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=256,
              apply_process_settings=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    expected = [o.outputs[0].text for o in outputs]
    del llm
    # Rank 1 is a Ray actor: another process, in the replica's placement group.
    (replica,) = tp_app.replicas()
    (rank1,) = replica["tensor_parallel_ranks"]
    assert rank1["rank"] == 1 and rank1["pid"] != replica["pid"]
    # TP=2 inside the replica gives TP=1's greedy tokens (float32).
    assert greedy(tp_app.url, tp_app.model) == expected

    # Rank 1 killed mid-stream: the stream ends with an error event, not a hang...
    events: list[str] = []
    with httpx.stream("POST", tp_app.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": tp_app.model, "prompt": TP_PROMPTS[0], "max_tokens": 300,
            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                if not events:
                    os.kill(rank1["pid"], signal.SIGKILL)
                events.append(line[6:])
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert len(events) < 300  # (it stopped early)
    # ... and Ray Serve replaces the replica (its health check sees the group
    # stopped), with a new rank 1; the old replica is gone, none of it left over.
    (again,) = tp_app.wait_for_replicas(1, without_pid=replica["pid"])
    assert process_gone(replica["pid"])
    assert greedy(tp_app.url, tp_app.model) == expected

    # The replica killed: its rank actor goes with it (no orphan), and it comes back.
    (rank1,) = again["tensor_parallel_ranks"]
    os.kill(again["pid"], signal.SIGKILL)
    assert process_gone(rank1["pid"]), "rank 1 outlived its replica"
    (third,) = tp_app.wait_for_replicas(1, without_pid=again["pid"])
    assert third["tensor_parallel_ranks"][0]["pid"] != rank1["pid"]
    assert greedy(tp_app.url, tp_app.model, TP_PROMPTS[:1]) == expected[:1]
