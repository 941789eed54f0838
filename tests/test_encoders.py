"""Encoder-only models (BERT, XLM-RoBERTa) and their cross-encoders, float32.

Tiny random models from transformers configs. BERT has a real WordPiece
tokenizer (a vocabulary written here), so sentence-transformers loads the same
directory and is the oracle for embeddings (CLS and mean pooling, normalised
by its Normalize module); XLM-R runs on token ids against transformers' base
model and the same pooling recipe. Every prompt is compared twice: all 32
together (one step of many prompts) and each alone. Cross-encoders: scores
equal transformers' *ForSequenceClassification logits, through sigmoid as
vLLM scores a one-label model (the raw logits with use_activation=False), the
pair tokenized as the tokenizer's text pair (token types 0 then 1; XLM-R's
SentencePiece tokenizer joins it as <s> A </s></s> B </s>, no types). Through
the server: /v1/embeddings, /rerank, a prompt past the context and a
generation request (each a 400 saying what to do).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers

from tests.server_harness import ServerThread
from tokenmill import LLM, PoolingParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

ATOL = 1e-5
NUM_TEXTS = 32
MAX_POSITIONS = 64
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(250)]
BERT_COMMON: dict[str, Any] = {
    "vocab_size": len(SPECIALS) + len(WORDS), "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": MAX_POSITIONS,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}


def texts(seed: int, n: int = NUM_TEXTS) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 40)))) for _ in range(n)]


def spread_norms(model: torch.nn.Module) -> None:
    """LayerNorms start at (1, 0): spread them, so a swapped or lost one shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)


def save_bert(path: Path, cls: str = "BertModel", **overrides: Any) -> tuple[str, Any]:
    """A tiny random BERT and its WordPiece tokenizer in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    # (The vocabulary as a dict: transformers 5 takes a vocab.txt path as `vocab`, and
    # ignores `vocab_file`, leaving every word [UNK].)
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(SPECIALS + WORDS)},
                                           do_lower_case=True, model_max_length=MAX_POSITIONS)
    assert tokenizer.unk_token_id not in tokenizer(" ".join(WORDS))["input_ids"]
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = getattr(transformers, cls)(transformers.BertConfig(**{**BERT_COMMON, **overrides})).eval()
    spread_norms(model)
    model.save_pretrained(path)
    return str(path), model


def save_xlm_roberta(path: Path, cls: str = "XLMRobertaModel", **overrides: Any) -> tuple[str, Any]:
    torch.manual_seed(1)
    config = transformers.XLMRobertaConfig(**{**BERT_COMMON, "max_position_embeddings": MAX_POSITIONS + 2,
                                              "type_vocab_size": 1, "pad_token_id": 1,
                                              "layer_norm_eps": 1e-5, **overrides})
    model = getattr(transformers, cls)(config).eval()
    spread_norms(model)
    model.save_pretrained(path)
    return str(path), model


def write_sentence_transformers(path: str, pooling: str) -> None:
    """modules.json, 1_Pooling and 2_Normalize as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    Path(path, "modules.json").write_text(json.dumps(modules))
    Path(path, "1_Pooling").mkdir()
    Path(path, "2_Normalize").mkdir()
    Path(path, "1_Pooling", "config.json").write_text(json.dumps({
        "word_embedding_dimension": BERT_COMMON["hidden_size"],
        "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
    }))
    Path(path, "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_POSITIONS,
                                                                   "do_lower_case": False}))


def engine_llm(path: str, **kwargs: Any) -> LLM:
    return LLM(model=path, dtype="float32", apply_process_settings=False, **kwargs)


def embeddings(llm: LLM, prompts: list[Any], **params: Any) -> np.ndarray:
    """All prompts together, then each alone: both, stacked [2, n, hidden]."""
    together = [o.outputs.embedding for o in llm.embed(prompts, PoolingParams(**params), use_tqdm=False)]
    alone = [llm.embed([p], PoolingParams(**params), use_tqdm=False)[0].outputs.embedding for p in prompts]
    return np.array([together, alone])


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_bert_embeddings_equal_sentence_transformers(tmp_path: Path, pooling: str) -> None:
    from sentence_transformers import SentenceTransformer

    path, _ = save_bert(tmp_path / "bert")
    write_sentence_transformers(path, pooling)
    batch = texts(0)
    expected = SentenceTransformer(path, device="cpu").encode(batch, batch_size=NUM_TEXTS,
                                                              convert_to_numpy=True)
    ours = embeddings(engine_llm(path), batch)
    np.testing.assert_allclose(ours, np.stack([expected, expected]), atol=ATOL, rtol=0)


@torch.inference_mode()
def hf_pooled(model: Any, prompt: list[int], pooling: str) -> np.ndarray:
    hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[0] if pooling == "cls" else hidden.mean(dim=0)
    return np.asarray(torch.nn.functional.normalize(vector.float(), dim=0).numpy())


def id_prompts(seed: int, vocab: int, max_len: int = 60) -> list[list[int]]:
    """Token-id prompts: <s>/[CLS] (id 0 / 2) first, never the padding id 1."""
    rng = np.random.default_rng(seed)
    return [[0, *rng.integers(3, vocab, size=int(rng.integers(1, max_len))).tolist()]
            for _ in range(NUM_TEXTS)]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_xlm_roberta_embeddings_equal_transformers(tmp_path: Path, pooling: str) -> None:
    path, hf = save_xlm_roberta(tmp_path / "xlmr")
    write_sentence_transformers(path, pooling)
    prompts = id_prompts(2, BERT_COMMON["vocab_size"])
    expected = np.array([hf_pooled(hf, p, pooling) for p in prompts])
    llm = engine_llm(path, skip_tokenizer_init=True)
    assert llm.engine.max_model_len == MAX_POSITIONS  # (514-style tables: padding_idx + 1 rows unused)
    ours = embeddings(llm, [{"prompt_token_ids": p} for p in prompts])
    np.testing.assert_allclose(ours, np.stack([expected, expected]), atol=ATOL, rtol=0)


def test_encoder_prompts_run_whole_past_the_token_budget(tmp_path: Path) -> None:
    """A budget smaller than a prompt is raised to max_model_len (a prompt never
    runs in chunks: bidirectional attention needs all of it); without
    sentence-transformers files an encoder pools CLS, normalised (vLLM's)."""
    path, hf = save_bert(tmp_path / "bert")
    prompts = id_prompts(3, BERT_COMMON["vocab_size"])
    llm = engine_llm(path, max_num_batched_tokens=8, max_num_seqs=4)
    assert llm.engine.scheduler.config.max_num_batched_tokens == MAX_POSITIONS
    ours = embeddings(llm, [{"prompt_token_ids": p} for p in prompts])
    expected = np.array([hf_pooled(hf, p, "cls") for p in prompts])
    np.testing.assert_allclose(ours, np.stack([expected, expected]), atol=ATOL, rtol=0)


def test_bert_in_bfloat16_is_transformers_in_bfloat16(tmp_path: Path) -> None:
    """bf16 runs the same module (no plan for encoders): within bf16's rounding of
    transformers' own bf16 forward, the vectors normalised."""
    path, hf = save_bert(tmp_path / "bert")
    prompts = id_prompts(10, BERT_COMMON["vocab_size"])[:8]
    hf = hf.to(torch.bfloat16)
    expected = np.array([hf_pooled(hf, p, "cls") for p in prompts], dtype=np.float32)
    llm = LLM(model=path, dtype="bfloat16", apply_process_settings=False)
    ours = embeddings(llm, [{"prompt_token_ids": p} for p in prompts])
    np.testing.assert_allclose(ours, np.stack([expected, expected]), atol=2e-2, rtol=0)


@torch.inference_mode()
def hf_logits(model: Any, **inputs: Any) -> np.ndarray:
    return np.asarray(model(**{k: torch.tensor([v]) for k, v in inputs.items()}).logits[0].numpy())


def test_bert_cross_encoder_scores_equal_transformers(tmp_path: Path) -> None:
    path, hf = save_bert(tmp_path / "ce", "BertForSequenceClassification", num_labels=1)
    llm = engine_llm(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    queries, documents = texts(4, 8), texts(5, 8)
    logits = []
    for q, d in zip(queries, documents, strict=True):
        enc = tokenizer(q, d)
        assert set(enc["token_type_ids"]) == {0, 1}  # (a pair: both segments)
        logits.append(hf_logits(hf, **enc)[0])
    scores = [o.outputs.score for o in llm.score(queries, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-np.array(logits))), atol=ATOL, rtol=0)
    raw = llm.score(queries, documents, use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose([o.outputs.score for o in raw], logits, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed(["w1 w2"], use_tqdm=False)


def test_xlm_roberta_cross_encoder_logits_equal_transformers(tmp_path: Path) -> None:
    path, hf = save_xlm_roberta(tmp_path / "ce", "XLMRobertaForSequenceClassification", num_labels=3)
    llm = engine_llm(path, skip_tokenizer_init=True)
    prompts = id_prompts(6, BERT_COMMON["vocab_size"])[:8]
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False),
                      use_tqdm=False)
    expected = np.array([hf_logits(hf, input_ids=p) for p in prompts])
    np.testing.assert_allclose([o.outputs.data for o in outs], expected, atol=ATOL, rtol=0)
    probs = llm.encode([{"prompt_token_ids": prompts[0]}], use_tqdm=False)[0].outputs.data
    np.testing.assert_allclose(probs, torch.softmax(torch.tensor(expected[0]), -1).numpy(), atol=ATOL)


def save_sentencepiece_tokenizer(path: str) -> Any:
    """XLM-R's tokenizer layout on the test's words: a SentencePiece Unigram model
    (Metaspace pieces), <s> <pad> </s> <unk> first and <mask> last, and XLM-R's
    pair template <s> A </s></s> B </s>, as transformers converts xlm-roberta's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [(t, 0.0) for t in ("<s>", "<pad>", "</s>", "<unk>")]
    pieces += [(f"\u2581{w}", -1.0 - 0.01 * i) for i, w in enumerate(WORDS)] + [("<mask>", 0.0)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=3))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tokenizer = transformers.XLMRobertaTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
        unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", model_max_length=MAX_POSITIONS)
    tokenizer.save_pretrained(path)
    return tokenizer


def test_xlm_roberta_reranker_scores_text_pairs_through_its_tokenizer(tmp_path: Path) -> None:
    """bge-reranker's layout: an XLM-R cross-encoder of one label, text pairs joined
    by its SentencePiece tokenizer (no token types), scores = transformers' logits
    through sigmoid."""
    path, hf = save_xlm_roberta(tmp_path / "rr", "XLMRobertaForSequenceClassification", num_labels=1)
    tokenizer = save_sentencepiece_tokenizer(path)
    llm = engine_llm(path)
    # (pairs within the 64 positions: a query of at most 12 words, a document of at most 40)
    queries, documents = [" ".join(t.split()[:12]) for t in texts(7, 8)], texts(8, 8)
    logits = []
    for q, d in zip(queries, documents, strict=True):
        enc = tokenizer(q, d)
        assert "token_type_ids" not in enc and [2, 2] in [enc["input_ids"][i:i + 2]
                                                           for i in range(len(enc["input_ids"]))]
        assert 3 not in enc["input_ids"]  # every word a piece: no <unk>
        logits.append(hf_logits(hf, input_ids=enc["input_ids"])[0])
    scores = [o.outputs.score for o in llm.score(queries, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-np.array(logits))), atol=ATOL, rtol=0)


def test_encoder_refusals(tmp_path: Path) -> None:
    path, _ = save_bert(tmp_path / "bert")
    with pytest.raises(ValueError, match=r"encoder-only.*--runner pooling"):
        engine_llm(path, runner="generate")
    llm = engine_llm(path)
    with pytest.raises(ValueError, match=r"encoder-only model.*cannot generate"):
        llm.generate(["w1 w2"], use_tqdm=False)
    with pytest.raises(ValueError, match="token_type_ids must be 2 integers"):
        llm.embed([{"prompt_token_ids": [2, 3], "token_type_ids": [0, 2]}], use_tqdm=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any, Any, Any]]:
    """Two servers: a BERT embedding model (mean pooling, sentence-transformers'
    files) and a BERT cross-encoder; their URLs, and the oracles."""
    from sentence_transformers import SentenceTransformer

    base = tmp_path_factory.mktemp("encoders")
    embed_path, _ = save_bert(base / "embed")
    write_sentence_transformers(embed_path, "mean")
    ce_path, ce_hf = save_bert(base / "ce", "BertForSequenceClassification", num_labels=1)
    servers, engines = [], []
    try:
        for path, name in ((embed_path, "tiny-bert"), (ce_path, "tiny-ce")):
            engine = AsyncEngine(engine_llm(path).engine)
            engines.append(engine)
            servers.append(ServerThread(build_app(engine, ServerConfig(served_model_name=name))).start())
        yield (servers[0].url, servers[1].url, SentenceTransformer(embed_path, device="cpu"), ce_hf,
               transformers.AutoTokenizer.from_pretrained(ce_path))
    finally:
        for server in servers:
            server.stop()
        for engine in engines:
            engine.shutdown()


def test_server_embeddings_and_errors(served: tuple[str, str, Any, Any, Any]) -> None:
    url, _, st, _, _ = served
    batch = texts(7)
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/embeddings", json={"model": "tiny-bert", "input": batch})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        np.testing.assert_allclose(got, st.encode(batch, convert_to_numpy=True), atol=ATOL, rtol=0)
        long = " ".join(["w7"] * (MAX_POSITIONS + 10))
        r = client.post("/v1/embeddings", json={"model": "tiny-bert", "input": [long]})
        assert r.status_code == 400 and "maximum context length is 64" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "tiny-bert", "prompt": "w1", "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "encoder-only" in r.json()["error"]["message"]
        assert "--runner pooling" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"model": "tiny-bert", "input": ["w3 w4"]})
        assert r.status_code == 200  # (still serving)


def test_server_rerank_with_a_cross_encoder(served: tuple[str, str, Any, Any, Any]) -> None:
    _, url, _, hf, tokenizer = served
    query, documents = "w1 w2 w3", texts(8, 6)
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/rerank", json={"model": "tiny-ce", "query": query, "documents": documents})
        assert r.status_code == 200, r.text
        got = {res["index"]: res["relevance_score"] for res in r.json()["results"]}
        r = client.post("/score", json={"model": "tiny-ce", "text_1": query, "text_2": documents,
                                        "use_activation": False})
        assert r.status_code == 200, r.text
        raw = [d["score"] for d in r.json()["data"]]
        long = " ".join(["w9"] * MAX_POSITIONS)
        r = client.post("/rerank", json={"model": "tiny-ce", "query": query, "documents": [long]})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        r = client.post("/v1/embeddings", json={"model": "tiny-ce", "input": "w1"})
        assert r.status_code == 400 and "/rerank" in r.json()["error"]["message"]
    logits = np.array([hf_logits(hf, **tokenizer(query, d))[0] for d in documents])
    np.testing.assert_allclose([got[i] for i in range(len(documents))], 1 / (1 + np.exp(-logits)),
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(raw, logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ["Qwen3Model", "Qwen3ForCausalLM"])
def test_checkpoint_without_head_pools(tmp_path: Path, architecture: str) -> None:
    """A decoder saved without its LM head (names without "model."): as a
    Qwen3Model, or as Qwen3-Embedding ships it (config.json says Qwen3ForCausalLM).
    It pools (the last token, normalised) as transformers' base model; it does not
    generate, and says so."""
    from tests.hf_models import build_hf_model, hf_embedding

    hf = build_hf_model("qwen3", tie_word_embeddings=False)
    path = tmp_path / "qwen3-headless"
    hf.model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    llm = engine_llm(str(path), skip_tokenizer_init=True)
    assert llm.engine.spec.headless
    prompts = id_prompts(9, 256)
    expected = np.array([hf_embedding(hf, p, "last", normalize=True) for p in prompts])
    ours = embeddings(llm, [{"prompt_token_ids": p} for p in prompts])
    np.testing.assert_allclose(ours, np.stack([expected, expected]), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="saved without its LM head"):
        llm.generate([{"prompt_token_ids": [3, 4]}], use_tqdm=False)
