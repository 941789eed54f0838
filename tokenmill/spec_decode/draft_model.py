"""Draft-model proposer (vLLM's method "draft_model"): a smaller model with the
target's vocabulary drafts k tokens greedily, inside the runner's step.

It has its own KV pool (its own ModelRunner: the draft's layers and heads)
driven by the target's block bookkeeping: the same block ids and slots, so
the scheduler's allocation of 1 + k slots for a request covers the draft's
writes too (positions p .. p + k - 1 for the new token at p and the first
k - 1 drafts). The draft's K/V are computed lazily: per request it remembers
which tokens its KV holds; at each step it recomputes from the first position
where those differ from the request's tokens (rejected drafts) or that a
preemption freed, as one ragged chunk over all requests, then decodes k - 1
more. Its drafts are its argmax: a one-hot draft distribution, which the
target's verification (worker/drafter.py) keeps exact.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.config import ModelConfig, ModelSpec
from tokenmill.core.contracts import ScheduledRequest
from tokenmill.model.loader import load_model
from tokenmill.model.source import resolve_model_source
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, model: str, target_spec: ModelSpec, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, cpu_options: CpuBackendOptions,
                 kv_cache_dtype: str = "auto") -> None:
        name = str(dtype).removeprefix("torch.")
        config = ModelConfig(model=model, dtype=name, device=device.type)
        draft, spec = load_model(config, resolve_model_source(model))
        if spec.encoder_only or spec.headless:
            raise ValueError(f"speculative_config.model {model!r} ({spec.architecture}) cannot "
                             "generate; a draft must be a causal LM")
        if spec.vocab_size != target_spec.vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {spec.vocab_size} "
                             f"tokens, the target {target_spec.vocab_size}; the draft must share "
                             "the target's tokenizer")
        self.runner = ModelRunner(draft, spec, num_blocks, block_size, dtype, device, cpu_options,
                                  kv_cache_dtype=kv_cache_dtype)
        # Per request: the tokens whose K/V the draft's pool holds, positions 0.. in order.
        self.written: dict[str, list[int]] = {}

    def forget(self, request_id: str) -> None:
        self.written.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest], histories: list[list[int]]) -> None:
        """Fill each request's drafts (the last num_draft_tokens of its token_ids);
        `histories`: each request's tokens up to and including its new one."""
        runner = self.runner
        chunks = []
        for r, history in zip(reqs, histories, strict=True):
            p = r.num_computed_tokens  # the new token's position; positions < p are computed
            written = self.written.get(r.request_id, [])
            valid = 0
            limit = min(len(written), p)
            while valid < limit and written[valid] == history[valid]:
                valid += 1
            chunks.append(dataclasses.replace(
                r, token_ids=history[valid : p + 1], num_computed_tokens=valid,
                sampling_params=_GREEDY, num_draft_tokens=0, do_sample=True))
        drafts: list[list[int]] = [[] for _ in reqs]
        active = list(range(len(reqs)))  # requests still drafting
        while active:
            input_ids, positions, meta, starts = runner._prepare_inputs([chunks[j] for j in active])
            rows = torch.tensor([end - 1 for end in starts[1:]], dtype=torch.int64,
                                device=runner.device)
            hidden = runner.forward(input_ids, positions, runner.kv_caches, meta, output_rows=rows)
            tokens = runner.forward.compute_logits(hidden).argmax(dim=-1).tolist()
            still = []
            for j, token in zip(active, tokens, strict=True):
                drafts[j].append(token)
                c = chunks[j]
                chunks[j] = dataclasses.replace(
                    c, token_ids=[token], num_computed_tokens=c.num_computed_tokens + len(c.token_ids))
                if len(drafts[j]) < reqs[j].num_draft_tokens:
                    still.append(j)
            active = still
        for r, history, d in zip(reqs, histories, drafts, strict=True):
            r.token_ids[len(r.token_ids) - len(d) :] = d
            # K/V written now: the new token at p and every draft but the last.
            self.written[r.request_id] = history[: r.num_computed_tokens + 1] + d[:-1]
