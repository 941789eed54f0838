"""The offline API, shaped as vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, cast

from tqdm import tqdm

from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine.process_settings import apply_process_settings as apply_settings
from tokenmill.engine.score_template import score_prompt
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.outputs import (
    EmbeddingRequestOutput,
    EngineOutput,
    GenerateStats,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.sampling_params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from tokenmill.tokenizer import ChatMessage, Tokenizer


class LLM:
    """`LLM(model, **engine_args)`: the keyword arguments are EngineArgs' fields
    (engine/arg_utils.py), e.g. dtype, max_num_seqs, kv_cache_memory_bytes.

    `apply_process_settings` (default True) freezes the garbage collector's heap
    and keeps freed memory in glibc's malloc once the model is loaded
    (engine/process_settings.py): right for a process that exists to run this
    LLM; pass False when the LLM is a guest in a larger program, since both
    change the whole process. `check_integrity` checks the KV cache's
    bookkeeping after every step (for tests)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        apply_process_settings: bool = True,
        check_integrity: bool = False,
        **engine_args: Any,
    ) -> None:
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(model=model, **engine_args), check_integrity=check_integrity
        )
        if apply_process_settings:
            apply_settings()
        self.last_generate_stats = GenerateStats()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLM:
        """`kwargs`: apply_process_settings, check_integrity."""
        return cls(**dataclasses.asdict(engine_args), **kwargs)

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this LLM was created with skip_tokenizer_init=True")
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (vLLM's):
        what `generate` and `chat` use when given none."""
        return SamplingParams(**self.engine.default_sampling_params)

    def model_info(self) -> dict[str, Any]:
        """The loaded model's shape and size, for reports and rooflines."""
        spec, source = self.engine.spec, self.engine.source
        return {
            "architecture": spec.architecture,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_layers": spec.num_layers,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size,
            "kv_bytes_per_token": spec.kv_bytes_per_token,  # per byte of element size
            "num_params": sum(p.numel() for p in self.engine.runner.model.parameters()),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "max_model_len": self.engine.max_model_len,
            "num_kv_blocks": self.engine.scheduler.kv.num_blocks,
            # a GGUF model's tensors as the file stores them (its own quantized blocks), else None
            "gguf_weight_bytes": (float(sum(t.data.nbytes for t in GGUFFile(source.path).tensors))
                                  if source.kind == "gguf" else None),
        }

    def matmul_rate(self, rows: int, repeats: int = 10) -> float:
        """GFLOP/s this machine reaches on the model's projection shapes (qkv, o,
        gate_up, down) at `rows` rows, weights in cache: the faster of torch's
        matmul and tokenmill's kernel. The compute ceiling of `bench roofline`."""
        from tokenmill.backends.cpu import kernels

        spec = self.engine.spec
        q_out, kv_out = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        shapes = [(spec.hidden_size, q_out + 2 * kv_out), (q_out, spec.hidden_size),
                  (spec.hidden_size, 2 * spec.intermediate_size), (spec.intermediate_size, spec.hidden_size)]
        return kernels.best_matmul_rate(shapes, rows, self.engine.dtype, repeats)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; results come
        back in input order. All prompts are checked before any is queued, so a
        bad one raises ValueError and nothing runs. `lora_request`: one LoRA
        adapter for every prompt, or one per prompt (None: the base model);
        the engine needs enable_lora=True."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        # Offline, only the final result is wanted (as vLLM's LLM does).
        params_list = [
            dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            for p in self._params_per_prompt(sampling_params, len(prompts))
        ]
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        outputs = self._run(self._add_all(prompts, params_list, priority, loras), use_tqdm)
        return [out for out in outputs if isinstance(out, RequestOutput)]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's last hidden states (the model's pooler: see
        model/pooler_config.py); the prompts run as any prefill does (batched by
        the scheduler, a long one in chunks); results in input order (vLLM's
        LLM.encode)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} pooling params for {len(prompts)} prompts")
        outputs = self._run(self._add_all(prompts, params_list, priority), use_tqdm)
        return [out for out in outputs if isinstance(out, PoolingRequestOutput)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding per prompt (vLLM's LLM.embed): `.outputs.embedding`."""
        if self.engine.pooler_config.classifier_token_ids is not None:
            raise ValueError("this model is loaded as a yes/no reranker (hf_overrides' "
                             "classifier_from_token): it scores pairs with LLM.score, it does "
                             "not embed")
        if self.engine.pooler_config.num_labels:
            raise ValueError(f"this model ({self.engine.spec.architecture}) is a cross-encoder: it "
                             "scores text pairs with LLM.score, it does not embed")
        return [EmbeddingRequestOutput.from_base(out)
                for out in self.encode(prompts, pooling_params, use_tqdm, priority)]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of text_1's and text_2's embeddings, pair by pair
        (vLLM's LLM.score with an embedding model): one text_1 against every
        text_2, or text_1[i] against text_2[i]. A text may be a prompt of
        token ids, as `generate` takes. With a yes/no reranker (hf_overrides)
        each pair runs as one prompt (engine/score_template.py; token ids
        concatenated) and scores sigmoid(logit[yes] - logit[no]) at its end."""
        firsts = [text_1] if isinstance(text_1, str | dict) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str | dict) else list(text_2)
        if not firsts or not seconds:
            raise ValueError("text_1 and text_2 must each hold at least one text")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}; give one "
                             "text_1, or as many as text_2")
        if self.engine.pooler_config.classifier_token_ids is not None:
            return self._classify_pairs(firsts, seconds, pooling_params, use_tqdm)
        if self.engine.pooler_config.num_labels:
            return self._cross_encode(firsts, seconds, pooling_params, use_tqdm)
        embedded = self.embed([*firsts, *seconds], pooling_params, use_tqdm)
        n = len(firsts)
        return [
            ScoringRequestOutput(
                request_id=f"{a.request_id}-{b.request_id}",
                outputs=ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids, finished=True)
            for a, b in zip(embedded[:n], embedded[n:], strict=True)
        ]

    def _cross_encode(self, firsts: list[PromptType], seconds: list[PromptType],
                      pooling_params: PoolingParams | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair, run as one prompt: the tokenizer's
        text pair (and its token types), then the classifier and its activation
        (vLLM's default: sigmoid of a one-label logit)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not all(isinstance(t, str) for t in (*firsts, *seconds)):
            raise ValueError("a cross-encoder scores text pairs, joined by its tokenizer; for token "
                             "ids, give LLM.encode the pair's prompt_token_ids and token_type_ids")
        if self.engine.pooler_config.num_labels != 1:
            raise ValueError(f"this cross-encoder has {self.engine.pooler_config.num_labels} labels; "
                             "a score is one value: use LLM.encode for its label scores")
        prompts: list[PromptType] = []
        for first, second in zip(firsts, seconds, strict=True):
            assert isinstance(first, str) and isinstance(second, str)
            ids, types = tokenizer.encode_pair(first, second)
            prompts.append({"prompt_token_ids": ids} if types is None else
                           {"prompt_token_ids": ids, "token_type_ids": types})
        return [
            ScoringRequestOutput(request_id=out.request_id, outputs=ScoringOutput(out.outputs.data[0]),
                                 prompt_token_ids=out.prompt_token_ids, finished=True)
            for out in self.encode(prompts, pooling_params, use_tqdm)
        ]

    def _classify_pairs(self, firsts: list[PromptType], seconds: list[PromptType],
                        pooling_params: PoolingParams | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        template = self.engine.pooler_config.score_template
        prompts: list[PromptType] = []
        for first, second in zip(firsts, seconds, strict=True):
            if isinstance(first, str) and isinstance(second, str):
                prompts.append(score_prompt(first, second, template))
            else:
                ids = [self.engine.tokenize_prompt(p)[1] for p in (first, second)]
                prompts.append({"prompt_token_ids": ids[0] + ids[1]})
        return [
            ScoringRequestOutput(request_id=out.request_id, outputs=ScoringOutput(out.outputs.data[0]),
                                 prompt_token_ids=out.prompt_token_ids, finished=True)
            for out in self.encode(prompts, pooling_params, use_tqdm)
        ]

    def _add_all(self, prompts: list[PromptType], params_list: Sequence[SamplingParams | PoolingParams],
                 priority: Sequence[int] | None,
                 loras: Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Queue every prompt, checked before any is queued, so a bad one raises
        ValueError and nothing runs; their request ids."""
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        engine = self.engine
        for i, prompt in enumerate(prompts):
            _, ids = engine.tokenize_prompt(prompt)
            if len(ids) > engine.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens, more than max_model_len="
                    f"{engine.max_model_len} (the model's context length, capped by what the "
                    "KV cache holds); shorten it, or raise max_model_len or kv_cache_memory_bytes"
                )
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = engine.new_request_id()
                engine.add_request(
                    request_id, prompt, params, priority=priority[i] if priority is not None else 0,
                    lora_request=loras[i] if loras is not None else None,
                )
                request_ids.append(request_id)
        except BaseException:
            # A later request was refused (its options, say): none of this call runs.
            engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them
        (`tools`, OpenAI's function tools, reach the template as its `tools`;
        `chat_template_kwargs` as variables, e.g. {"enable_thinking": False})."""
        conversations = cast(
            list[list[ChatMessage]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(conv, add_generation_prompt, chat_template, tools,
                                                 chat_template_kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[EngineOutput]:
        engine = self.engine
        pending = set(request_ids)
        final: dict[str, EngineOutput] = {}
        bar: Any = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                        dynamic_ncols=True)
        start = time.monotonic()
        num_in = num_out = 0
        stats = self.last_generate_stats = GenerateStats(num_kv_blocks=engine.scheduler.kv.num_blocks)
        try:
            while pending:
                result = engine.step()
                step = result.stats
                stats.num_steps += 1
                stats.num_computed_tokens += step.num_scheduled_tokens
                stats.num_scheduled_reqs += step.num_scheduled_reqs
                stats.num_preemptions += step.num_preempted
                stats.kv_blocks_used += step.num_kv_blocks_used
                stats.kv_blocks_held += step.num_kv_blocks_held
                for phase, seconds in step.phase_s.items():
                    stats.phase_s[phase.value] = stats.phase_s.get(phase.value, 0.0) + seconds
                for out in result.outputs:
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        final[out.request_id] = out
                        num_in += len(out.prompt_token_ids)
                        if isinstance(out, RequestOutput):
                            num_out += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = max(time.monotonic() - start, 1e-9)
                        bar.set_postfix_str(
                            f"input: {num_in / elapsed:.1f} toks/s, output: {num_out / elapsed:.1f} toks/s"
                        )
                        bar.update(1)
        finally:
            stats.wall_time_s = time.monotonic() - start
            bar.close()
            if pending:  # interrupted: leave no request behind in the engine
                engine.abort_request(sorted(pending))
        return [final[i] for i in request_ids]


def cosine_similarity(a: list[float], b: list[float]) -> float:
    """As torch's cosine_similarity (vLLM's score for embedding models)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / max(norm, 1e-8)


__all__ = ["LLM", "PoolingParams", "RequestOutputKind", "SamplingParams"]
