"""Structured outputs on a tiny random model with a byte-level tokenizer of its own.

Random weights emit garbage unless the grammar mask holds, so every output that
parses and validates here is the mask's doing. The big test runs 64 requests
with a schema each, together with unconstrained, regex, choice and grammar
requests, under a budget of 8 tokens a step and a KV pool small enough that
requests are preempted and recomputed (their matchers must resume where they
were), with n > 1 and seeded sampling among them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch
import transformers

from tests.hf_models import COMMON, TEST_DEVICE
from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import kernels
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.structured import GrammarCompiler
from tokenmill.model.source import default_model_path
from tokenmill.sampling_params import ParamError, StructuredOutputsParams
from tokenmill.server import build_app
from tokenmill.tokenizer import Tokenizer
from tokenmill.worker.grammar import GrammarMask, RequestGrammar

S = StructuredOutputsParams
TIMEOUT_S = 60.0
# Multi-byte tokens that cross JSON's punctuation, so the mask has to reason about
# tokens that close a string and open the next key at once.
MERGED_PIECES = ['{"', '":', '",', '"}', '":"', '},', '],', '["', '"]', "ab", "abc", "12", "00",
                 "tr", "true", "fa", "fal", "false", "nu", "null", " the"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer(directory: Path) -> int:
    """A byte-level BPE tokenizer: 3 specials, the 256 bytes, a few merges. Returns its size."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for c in sorted(b2u.values()):
        vocab[c] = len(vocab)
    merges: list[tuple[str, str]] = []
    for piece in MERGED_PIECES:
        p = "".join(b2u[b] for b in piece.encode())
        for k in range(len(p) - 1, 0, -1):
            if p not in vocab and p[:k] in vocab and p[k:] in vocab:
                merges.append((p[:k], p[k:]))
                vocab[p] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>",
                                              eos_token="</s>", pad_token="<pad>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(directory)
    return len(vocab)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("structured")
    vocab_size = build_tokenizer(directory)
    config = transformers.LlamaConfig(**{**COMMON, "vocab_size": vocab_size})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def make_llm(path: str, **kwargs: Any) -> LLM:
    kwargs = {"num_kv_blocks": 512, **kwargs}  # (a small pool: integrity checks are cheap)
    return LLM(path, dtype="float32", device=TEST_DEVICE, apply_process_settings=False,
               check_integrity=True, **kwargs)


# ---- schemas: each request its own ---------------------------------------------------

def random_field(rng: np.random.Generator, depth: int) -> dict[str, Any]:
    kinds = ["integer", "pattern", "length", "enum", "boolean", "array", "number"]
    if depth == 0:
        kinds.append("object")
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "integer":
        low = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(1, 900))}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-z]{1,6}(-[0-9]{2})?$"}
    if kind == "length":
        return {"type": "string", "minLength": 1, "maxLength": int(rng.integers(2, 9))}
    if kind == "enum":
        return {"enum": ["red", "green", "blue ü", "a\"b"][: int(rng.integers(2, 5))]}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1, "maxItems": 3}
    return random_schema(rng, depth + 1)


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict[str, Any]:
    names = ["id", "name", "tags", "size", "ok", "color", "inner", "x"]
    chosen = rng.choice(len(names), size=int(rng.integers(1, 5)), replace=False)
    properties = {names[int(i)]: random_field(rng, depth) for i in chosen}
    required = [n for n in properties if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def prompt(rng: np.random.Generator) -> dict[str, Any]:
    return {"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(4, 12))).tolist()}


REGEXES = [r"[a-z]{2,5}-\d{2,3}", r"(yes|no)\.", r"#[0-9a-f]{6}"]
CHOICES = ["alpha", "beta", "gamma ü", "del\"ta"]
GRAMMAR = 'root ::= "(" [0-9] [0-9]? ("," [a-c])? ")"'


def test_64_schemas_at_once_under_chunking_and_preemption(model_path: str) -> None:
    rng = np.random.default_rng(7)
    schemas = [random_schema(rng) for _ in range(64)]
    requests: list[tuple[dict[str, Any], SamplingParams]] = []
    for k, schema in enumerate(schemas):
        sampled = k % 3 == 0
        requests.append((prompt(rng), SamplingParams(
            temperature=1.0 if sampled else 0.0, seed=k if sampled else None,
            n=2 if k % 9 == 0 else 1, max_tokens=300,
            structured_outputs=S(json=schema if k % 2 else json.dumps(schema),
                                 disable_any_whitespace=True),
        )))
    plain = [(prompt(rng), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
             for _ in range(12)]
    others = [(prompt(rng), SamplingParams(temperature=0, max_tokens=40,
                                           structured_outputs=S(regex=r)))
              for r in REGEXES]
    others += [(prompt(rng), SamplingParams(temperature=0.8, seed=5, max_tokens=40,
                                            structured_outputs=S(choice=CHOICES)))
               for _ in range(3)]
    others.append((prompt(rng), SamplingParams(temperature=0, max_tokens=40,
                                               structured_outputs=S(grammar=GRAMMAR))))
    # Interleaved, so constrained and unconstrained rows share steps.
    everything = [*requests, *others]
    order = [*plain, *everything]
    mixed_order = [order[i] for i in rng.permutation(len(order))]

    llm = make_llm(model_path, max_num_batched_tokens=8, num_kv_blocks=48, block_size=4)
    outs = llm.generate([p for p, _ in mixed_order], [sp for _, sp in mixed_order], use_tqdm=False)
    assert llm.last_generate_stats.num_preemptions > 0
    by_prompt = {json.dumps(p): out for (p, _), out in zip(mixed_order, outs, strict=True)}

    for (p, params), schema in zip(requests, schemas, strict=True):
        out = by_prompt[json.dumps(p)]
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (sample.text, schema)
            # (strict=False: xgrammar 0.2.9 lets a string with maxLength hold raw control
            # characters, which strict JSON parsers refuse; the schema is still checked.)
            jsonschema.validate(json.loads(sample.text, strict=False), schema)
    for (p, _), regex in zip(others[:3], REGEXES, strict=True):
        text = by_prompt[json.dumps(p)].outputs[0].text
        assert re.fullmatch(regex, text), (regex, text)
    for p, _ in others[3:6]:
        assert by_prompt[json.dumps(p)].outputs[0].text in CHOICES
    text = by_prompt[json.dumps(others[6][0])].outputs[0].text
    assert re.fullmatch(r"\(\d\d?(,[a-c])?\)", text), text

    # The unconstrained greedy requests: the same tokens as without the others.
    alone = llm.generate([p for p, _ in plain], [sp for _, sp in plain], use_tqdm=False)
    for (p, _), out in zip(plain, alone, strict=True):
        assert by_prompt[json.dumps(p)].outputs[0].token_ids == out.outputs[0].token_ids

    # A seeded constrained request: the same tokens alone as in the crowd.
    for p, params in [requests[3], requests[9], others[4]]:
        single = llm.generate([p], params, use_tqdm=False)[0]
        assert [s.token_ids for s in single.outputs] == [
            s.token_ids for s in by_prompt[json.dumps(p)].outputs
        ]


def test_bad_constraints_are_refused_and_the_others_finish(model_path: str) -> None:
    llm = make_llm(model_path, max_num_batched_tokens=16)
    engine = llm.engine
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    good = SamplingParams(temperature=0, max_tokens=50,
                          structured_outputs=S(json=schema, disable_any_whitespace=True))
    for i in range(3):
        engine.add_request(f"good{i}", {"prompt_token_ids": [5 + i, 6, 7]}, good)
    engine.step()
    bad = [
        (S(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
        (S(json="{not json"), "not valid JSON"),
        (S(regex="a(b"), "parenthesis"),
        (S(grammar="root ::= undefined_rule"), "undefined_rule"),
    ]
    for constraint, words in bad:
        with pytest.raises(ParamError, match=re.escape(words)) as info:
            engine.add_request("bad", {"prompt_token_ids": [9]},
                               SamplingParams(structured_outputs=constraint))
        assert info.value.param == "structured_outputs"
    with pytest.raises(ParamError, match="exactly one"):
        S(regex="a", choice=["b"])
    done: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    assert sorted(done) == ["good0", "good1", "good2"]
    for text in done.values():
        jsonschema.validate(json.loads(text), schema)


def test_the_default_models_vocabulary_compiles_and_matches_non_ascii_json() -> None:
    """xgrammar reads the GGUF tokenizer's byte-level vocabulary: a JSON text with
    non-ASCII characters, as that tokenizer splits it, is accepted token by token."""
    tokenizer = Tokenizer.load(default_model_path())
    eos = tokenizer.eos_token_id
    assert eos is not None
    compiler = GrammarCompiler(tokenizer, 49152, (eos,))
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "city": {"enum": ["Zürich", "東京"]}},
              "required": ["name", "city"]}
    compiled = compiler.compile(S(json=schema)).result(timeout=60)
    assert compiler.compile(S(json=json.dumps(schema))).done()  # the cache: same key
    grammar = RequestGrammar(compiled)
    text = json.dumps({"name": "Zoë ñ", "city": "東京"}, ensure_ascii=False)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.active
        grammar.accept(token_id)
    assert grammar.num_rejected == 0
    grammar.accept(eos)
    assert grammar.num_rejected == 0 and not grammar.active
    compiler.shutdown()


# ---- the server ---------------------------------------------------------------------

class Person(pydantic.BaseModel):
    color: str = pydantic.Field(pattern="^(red|green)$")
    size: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def server(model_path: str) -> Iterator[ServerThread]:
    llm = make_llm(model_path)
    engine = AsyncEngine(llm.engine)
    thread = ServerThread(build_app(engine, ServerConfig(served_model_name="m"))).start()
    try:
        yield thread
    finally:
        thread.stop()
        engine.shutdown()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_server_response_format_and_vllm_fields(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT_S,
                           max_retries=0)
    chat = [{"role": "user", "content": "Reply in JSON."}]
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    answer = client.chat.completions.create(model="m", messages=chat, temperature=0,  # type: ignore[arg-type]
                                            max_tokens=400, response_format=response_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
    stream = client.chat.completions.create(model="m", messages=chat, temperature=0,  # type: ignore[arg-type]
                                            max_tokens=400, response_format=response_format,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == answer.choices[0].message.content

    parsed = client.chat.completions.parse(model="m", messages=chat, temperature=0,  # type: ignore[arg-type]
                                           max_tokens=400, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.color in ("red", "green")

    obj = client.completions.create(model="m", prompt="JSON:", temperature=0, max_tokens=400,
                                    extra_body={"response_format": {"type": "json_object"},
                                                "seed": 1})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:  # (a random model may write a long object) at least it is one
        assert obj.choices[0].text.lstrip().startswith("{")

    for extra, check in [
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_regex": REGEXES[0]}, lambda t: re.fullmatch(REGEXES[0], t)),
        ({"structured_outputs": {"regex": REGEXES[2]}}, lambda t: re.fullmatch(REGEXES[2], t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         lambda t: t == json.dumps(json.loads(t))  # json.dumps' separators, nothing more
         and jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(\d\d?(,[a-c])?\)", t)),
    ]:
        out = client.completions.create(model="m", prompt="x", temperature=0, max_tokens=400,
                                        extra_body=extra)
        assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), (
            extra, out.choices[0].text)
        chunks = client.completions.create(model="m", prompt="x", temperature=0, max_tokens=400,
                                           extra_body=extra, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text

    # Masked tokens have -inf logprobs in the engine; JSON has no -inf, so an
    # answer floors them at -9999 as vLLM does (it was a 500 before).
    few = client.chat.completions.create(model="m", messages=chat, temperature=0,  # type: ignore[arg-type]
                                         max_tokens=5, logprobs=True, top_logprobs=5,
                                         extra_body={"guided_choice": ["A"]})
    assert few.choices[0].message.content == "A"
    tops = [t.logprob for c in few.choices[0].logprobs.content for t in c.top_logprobs]  # type: ignore[union-attr]
    assert min(tops) == -9999.0 and len(tops) == 5 * len(few.choices[0].logprobs.content)  # type: ignore[union-attr]
    legacy = client.completions.create(model="m", prompt="x", temperature=0, max_tokens=5,
                                       logprobs=5, extra_body={"guided_choice": ["A"]})
    assert legacy.choices[0].text == "A"
    assert min(v for d in legacy.choices[0].logprobs.top_logprobs for v in d.values()) == -9999.0  # type: ignore[union-attr]

    bad = httpx.post(server.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"], bad.text


def test_masks_split_over_threads_match_the_bits() -> None:
    """The apply split by rows over threads masks exactly the tokens whose bit is 0,
    on the rows asked for and no others."""
    vocab, num_rows = 1000, 64
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (num_rows, -(-vocab // 32)), dtype=torch.int32,
                          generator=generator)
    words[::3, ::2] = 0  # whole words masked and whole words allowed, as most masks are
    words[1::3, 1::2] = -1
    rows = sorted({*range(0, num_rows, 2), 63})  # 33 rows: 4 chunks of 8 or more
    logits = torch.randn(num_rows, vocab, generator=generator)
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, words, 32]
    expected = logits.clone()
    masked = bits.reshape(num_rows, -1)[:, :vocab] == 0
    for r in rows:
        expected[r, masked[r]] = float("-inf")
    # xgrammar's kernel (split over threads), and the C++ kernel where it is built.
    for cpp, num_threads in ((False, 1), (False, 4), (True, 2)):
        if cpp and kernels.load() is None:
            continue
        mask = GrammarMask(vocab, num_threads, ops=kernels.load() if cpp else None)
        mask._bitmask = words.clone()
        got = logits.clone()
        mask.apply_filled(got, rows)
        assert torch.equal(got, expected), (cpp, num_threads)
