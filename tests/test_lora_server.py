"""LoRA adapters through the server: --lora-modules' adapters in /v1/models
with their parent, chosen by `model` with the official openai client and
with LiteLLM,
loaded and unloaded at run time (TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING)
while streams run, and bad adapters refused with a 400 while the server keeps
serving. The oracle is offline LLM.generate on the same engine."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.hf_models import build_hf_model, save_hf_model
from tests.server_harness import ServerThread
from tests.test_lora import make_peft
from tokenmill import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
PROMPTS = ["hello there", "the quick brown fox", "lora adapters"]
MAX_TOKENS = 12


def byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer of the tiny models' 256 ids (no merges), so the
    server can take text; ids 1 and 2 are BOS and EOS."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) if b in printable else chr(256 + sum(c not in printable for c in range(b)))
             for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=chars[1], eos_token=chars[2]).save_pretrained(directory)


def bad_adapters(root: Path, good: Path) -> dict[str, tuple[str, str]]:
    """Each way an adapter can be wrong: (its path, a phrase its error says)."""
    cases: dict[str, tuple[str, str]] = {}
    config = json.loads((good / "adapter_config.json").read_text())

    def write(name: str, tensors: dict[str, torch.Tensor], **overrides: Any) -> Path:
        path = root / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({**config, **overrides}))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return path

    prefix = "base_model.model.model.layers.0."
    cases["shape"] = (str(write("shape", {
        prefix + "self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
        prefix + "self_attn.q_proj.lora_B.weight": torch.randn(64, 4)})), "trained for another model")
    cases["rank"] = (str(write("rank", {
        prefix + "self_attn.q_proj.lora_A.weight": torch.randn(32, 64),
        prefix + "self_attn.q_proj.lora_B.weight": torch.randn(64, 32)}, r=32)), "max_lora_rank")
    cases["missing"] = (str(root / "no-such-adapter"), "is not a directory")
    cases["module"] = (str(write("module", {
        prefix + "mlp.fc1.lora_A.weight": torch.randn(4, 64),
        prefix + "mlp.fc1.lora_B.weight": torch.randn(128, 4)}, target_modules=["q_proj"])),
        "which this model lacks")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(json.dumps(config))
    data = (good / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["corrupt"] = (str(corrupt), "could not be read as safetensors")
    return cases


@dataclass
class Served:
    engine: AsyncEngine
    server: ServerThread
    base_name: str
    expected: dict[str | None, list[str]]  # adapter name (None: base) -> texts of PROMPTS
    adapters: dict[str, str]  # name -> path
    bad: dict[str, tuple[str, str]]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused",
                             timeout=TIMEOUT_S, max_retries=0)

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.server.url + route, json=body, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The tiny Llama with a byte tokenizer, and adapters a, b, c (by name: path)."""
    root = Path(tmp_path_factory.mktemp("lora-server"))
    base = build_hf_model("llama")
    save_hf_model(base, root / "base")
    byte_tokenizer(root / "base")
    adapters = {}
    for k, name in enumerate(["a", "b", "c"]):
        make_peft(base, k).save_pretrained(root / name)
        adapters[name] = str(root / name)
    return root, adapters


def test_structured_outputs_with_an_adapter(files: tuple[Path, dict[str, str]]) -> None:
    """A choice constraint holds on an adapter's rows too."""
    root, adapters = files
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, num_kv_blocks=64)
    choices = ["yes please", "no thanks"]
    params = SamplingParams(temperature=0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, adapters["a"]))
    assert all(o.outputs[0].text in choices for o in outputs), [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def served(files: tuple[Path, dict[str, str]]) -> Iterator[Served]:
    root, adapters = files
    path = str(root / "base")
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3,
              num_kv_blocks=256)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected: dict[str | None, list[str]] = {}
    for i, name in enumerate([None, "a", "b", "c"]):
        # a and b under the ids the server gives --lora-modules (1, 2); c under
        # another, unloaded again: the server loads it at run time.
        lora = None if name is None else LoRARequest(name, i if name != "c" else 99, adapters[name])
        expected[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False,
                                                                   lora_request=lora)]
    assert llm.engine.remove_lora(99)
    assert len({tuple(texts) for texts in expected.values()}) == 4  # every adapter changes them
    engine = AsyncEngine(llm.engine)
    saved = os.environ.get("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        app = build_app(engine, ServerConfig(lora_modules=(("a", adapters["a"]), ("b", adapters["b"]))))
    finally:
        if saved is None:
            del os.environ["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"] = saved
    server = ServerThread(app).start()
    try:
        yield Served(engine, server, llm.engine.facts.model_name, expected, adapters,
                     bad_adapters(root, Path(adapters["a"])))
    finally:
        server.stop()
        engine.shutdown()


def completions(served: Served, model: str) -> list[str]:
    out = served.client().completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_models_lists_the_adapters_with_their_parent(served: Served) -> None:
    cards = {m.id: m for m in served.client().models.list().data}
    assert {served.base_name, "a", "b"} <= set(cards)
    for name in ("a", "b"):
        extra = cards[name].model_extra
        assert extra is not None
        assert extra["parent"] == served.base_name and extra["root"] == served.adapters[name]


def test_the_openai_client_selects_adapters_by_model(served: Served) -> None:
    assert completions(served, served.base_name) == served.expected[None]
    assert completions(served, "a") == served.expected["a"]
    assert completions(served, "b") == served.expected["b"]


def test_litellm_selects_an_adapter_by_name(served: Served) -> None:
    """LiteLLM's OpenAI-compatible text completion, an adapter's name as the model."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (its price list from the package, not the net)
    import litellm

    for name in (None, "a", "b"):
        model = served.base_name if name is None else name
        out = litellm.text_completion(model=f"text-completion-openai/{model}", prompt=PROMPTS[0],
                                      api_base=served.server.url + "/v1", api_key="unused",
                                      max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == served.expected[name][0], name


def test_load_and_unload_while_a_stream_runs(served: Served) -> None:
    """A stream on adapter a runs through b's unload and c's load, and gives
    a's text; c then serves, and b's new requests get a 404 in OpenAI's shape."""
    stream = served.client().completions.create(model="a", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
    text = ""
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text if chunk.choices else ""
        if i == 1:
            assert served.post("/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
            loaded = served.post("/v1/load_lora_adapter", {"lora_name": "c",
                                                          "lora_path": served.adapters["c"]})
            assert loaded.status_code == 200, loaded.text
    assert text == served.expected["a"][0]
    assert completions(served, "c") == served.expected["c"]
    with pytest.raises(openai.NotFoundError) as e:
        completions(served, "b")
    error = e.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "NotFoundError" and error["param"] == "model"
    models = {m.id for m in served.client().models.list().data}
    assert "c" in models and "b" not in models
    # b again, under a new id: it serves as before.
    assert served.post("/v1/load_lora_adapter", {"lora_name": "b",
                                                "lora_path": served.adapters["b"]}).status_code == 200
    assert completions(served, "b") == served.expected["b"]


@pytest.mark.parametrize("case", ["shape", "rank", "missing", "module", "corrupt"])
def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(served: Served, case: str) -> None:
    path, phrase = served.bad[case]
    response = served.post("/v1/load_lora_adapter", {"lora_name": f"bad-{case}", "lora_path": path})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and phrase in error["message"], error
    assert f"bad-{case}" not in {m.id for m in served.client().models.list().data}
    assert completions(served, "a") == served.expected["a"]


def test_a_name_in_use_is_a_400(served: Served) -> None:
    response = served.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": served.adapters["a"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora_name"
