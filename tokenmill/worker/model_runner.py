"""Runs one step: SchedulerOutput in, sampled tokens out.

It owns the KV cache tensors and the sampler's per-request generators, builds
the ragged batch (decodes first, then prefill chunks; no padding), runs the
model, computes logits only for the rows that sample, and samples.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tokenmill.config import ModelSpec
from tokenmill.core.contracts import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.worker.sampler import Sampler


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it comes from calloc (via numpy), whose
    large blocks are fresh pages the OS zero-fills on first touch: a 4 GiB KV cache
    costs nothing until used, where torch.zeros would spend seconds writing it.
    (Zeros matter: masked-out cache slots must hold finite values.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        # One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
        shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [zeros(shape, dtype, device) for _ in range(spec.num_layers)]
        self.sampler = Sampler(device, seed)

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.drop(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        # Decodes first: the attention backend handles them as one batch.
        reqs = sorted(scheduler_output.scheduled, key=lambda r: r.num_tokens != 1)
        input_ids, positions, meta = self._prepare_inputs(reqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden]

        sample_reqs = [r for r in reqs if r.do_sample]
        if not sample_reqs:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        last_rows = [meta.query_start_loc[j + 1] - 1 for j, r in enumerate(reqs) if r.do_sample]
        rows = torch.tensor(last_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] float32
        req_ids = [r.request_id for r in sample_reqs]
        token_ids, logprobs, top = self.sampler(
            logits, [r.sampling_params for r in sample_reqs], req_ids
        )
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=token_ids, logprobs=logprobs, top_logprobs=top
        )

    def _prepare_inputs(
        self, reqs: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        num_decodes = sum(1 for r in reqs if r.num_tokens == 1)
        query_start_loc = [0]
        seq_lens = []
        token_ids: list[int] = []
        for r in reqs:
            token_ids.extend(r.token_ids)
            query_start_loc.append(query_start_loc[-1] + r.num_tokens)
            seq_lens.append(r.num_computed_tokens + r.num_tokens)
        max_num_blocks = max(-(-s // bs) for s in seq_lens)
        block_tables = torch.tensor(
            [r.block_ids[:max_num_blocks] + [0] * (max_num_blocks - len(r.block_ids[:max_num_blocks]))
             for r in reqs],
            dtype=torch.int64,
        )  # [num_reqs, max_num_blocks]

        # Per token: which request, and its position in that request.
        query_lens = torch.tensor([r.num_tokens for r in reqs])
        req_index = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)  # [num_tokens]
        starts = torch.tensor([r.num_computed_tokens for r in reqs])
        first_token = torch.tensor(query_start_loc[:-1])
        positions = torch.arange(len(token_ids)) - first_token[req_index] + starts[req_index]
        slot_mapping = block_tables[req_index, positions // bs] * bs + positions % bs

        decode_seq_lens = seq_lens[:num_decodes]
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            max_decode_seq_len=max(decode_seq_lens, default=0),
            slot_mapping=slot_mapping.to(self.device),
            block_tables=block_tables.to(self.device),
            decode_seq_lens=torch.tensor(decode_seq_lens, dtype=torch.int64, device=self.device),
            block_size=bs,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta
