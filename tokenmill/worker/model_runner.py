"""Runs one step: SchedulerOutput in, sampled tokens out.

It owns the KV cache tensors and each request's sampling state (history,
generator: see request_state.py), builds the ragged batch (decodes first,
then prefill chunks; no padding), runs the model, computes logits only for
the rows that sample (and the prompt rows of requests that asked for
prompt_logprobs), and samples. A pooling request's rows go to the pooler
(worker/pooler.py) instead: no logits, no sampling; its vector comes back in
ModelRunnerOutput.pooled in the step its prompt ends.

Speculative decoding: a request with drafts schedules its new token and the
drafts (k + 1 rows); each row is sampled, and the drafts are accepted while they
equal what the target sampled at the row before (verify_drafts). For attention
each of those rows is a decode of its own (contexts L + 1, ..., L + k + 1 over
the request's blocks, every K/V of the step written before any row attends):
the rows then take the decode kernels, which round exactly as decoding one
token a step does, so greedy output is the same bits with and without
speculation in bfloat16 too (a prefill-like chunk of them took the prefill
attention, whose float32 sums run in another order). A draft model
(`Drafter`, worker/drafter.py) fills its drafts in before the forward.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import xgrammar as xgr

from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.attention import CpuAttentionBackend
from tokenmill.backends.cpu.memory import mapped_zeros
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.backends.cpu.plan import CpuPlan, unsupported
from tokenmill.config import LoRAConfig, ModelSpec, PoolerConfig
from tokenmill.core.contracts import (
    DRAFT_PLACEHOLDER,
    KVTransferStats,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.kv_layout import KVLayout, one_group
from tokenmill.model.attention import TorchAttentionBackend
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.bert import EncoderModel
from tokenmill.model.kv_format import FP8_DTYPES, kv_cache_format
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.lora import LoRABatch
from tokenmill.worker.drafter import Drafter, speculative_row_states, verify_drafts
from tokenmill.worker.grammar import GrammarMask, RequestGrammar
from tokenmill.worker.kv_offload import KVOffloader
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.pooler import Pooler
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.step_timer import StepPhase, StepTimer

logger = logging.getLogger("tokenmill")

# Prompt logprobs are computed this many positions at a time ([rows, vocab] floats).
PROMPT_LOGPROBS_CHUNK = 256


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor (masked-out cache slots must hold finite values).
    On the CPU an anonymous map on huge pages, every page faulted in now: the
    attention kernel reads the cache in long streams, slower on 4 KiB pages,
    and a page first touched inside a step stalls that step; vLLM and
    llama.cpp fill their caches at start too (docs/perf-notes.md)."""
    if dtype in FP8_DTYPES:  # (zeros are zeros in any 8-bit format)
        return zeros(shape, torch.uint8, device).view(dtype)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return mapped_zeros(shape, dtype, populate=True)


def kv_cache_tensors(kv_cache_dtype: str, count: int, num_blocks: int, block_size: int, spec: ModelSpec,
                     dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed KV cache tensors of `spec`'s heads (a rank's or the whole
    model's), stored as `kv_cache_dtype` says (model/kv_format.py)."""
    fmt = kv_cache_format(kv_cache_dtype)
    fmt.check(spec.head_dim)
    shape = fmt.shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [zeros(shape, fmt.storage_dtype(dtype), device) for _ in range(count)]


class ModelForward(Protocol):
    """What the runner calls: LlamaForCausalLM (the reference) or a CpuPlan built from it."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, output_rows: torch.Tensor | None = None,
                 lora: LoRABatch | None = None) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def pick_forward(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device,
                 options: CpuBackendOptions, release: bool = True) -> tuple[ModelForward, str]:
    """The CPU plan where it serves `model`, else the reference model (with the
    C++ paged attention where the kernels exist on the CPU); and a line saying
    which and why. `options`: the CPU backend's (EngineArgs.create_cpu_options);
    `release`: the plan keeps the only copy of each weight (the model's own are
    dropped as it packs them; tests that run the reference on the same model
    after pass False)."""
    if device.type != "cpu":
        return model, f"reference torch model ({device.type})"
    name = str(dtype).removeprefix("torch.")
    reason = unsupported(model, dtype, options)
    plan = CpuPlan.build(model, dtype, options, release) if reason is None else None
    if plan is not None:
        return plan, f"CPU backend (C++ kernels, {name})"
    model.set_batch_invariant(options.batch_invariant)
    if options.cpp_kernels and kernels.load() is not None:
        model.set_attention_backend(CpuAttentionBackend(batch_invariant=options.batch_invariant))
        return model, f"reference torch model with C++ paged attention ({reason})"
    model.set_attention_backend(TorchAttentionBackend(batch_invariant=options.batch_invariant))
    return model, f"reference torch model ({reason})"


def chosen_forward(model: LlamaForCausalLM | EncoderModel, dtype: torch.dtype, device: torch.device,
                   options: CpuBackendOptions) -> ModelForward:
    """pick_forward's choice, with its reason logged. An encoder runs its own
    reference forward: the CPU plan and the C++ paged attention serve causal
    decoders over a KV cache, and an encoder attends both ways and keeps none."""
    if isinstance(model, EncoderModel):
        logger.info("forward: reference torch encoder (%s: bidirectional attention, no KV cache; "
                    "the CPU plan serves decoders only)", model.spec.architecture)
        return model
    forward, how = pick_forward(model, dtype, device, options)
    logger.info("forward: %s", how)
    return forward


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM | EncoderModel,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cpu_options: CpuBackendOptions,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        forward: ModelForward | None = None,
        drafter: Drafter | None = None,
        pooler_config: PoolerConfig | None = None,
        classifier_head: torch.Tensor | None = None,
        kv_offload: BlockFiles | None = None,
        lora_config: LoRAConfig | None = None,
        kv_layout: KVLayout | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """`cpu_options`: the CPU backend's (EngineArgs.create_cpu_options, built
        once). `forward`: what runs the model (default: pick_forward's choice for
        `model`); the engine passes its own where it wraps that choice (tensor
        parallelism). `drafter`: speculative decoding with a draft model.
        `pooler_config`: how pooling requests pool (default: the last token);
        `classifier_head`: a yes/no reranker's two head rows (model.head_rows,
        taken before the CPU plan packs the head). An encoder (EncoderModel) keeps
        no KV cache, and its forward takes each request's token types. `kv_offload`:
        the disk tier's files (the scheduler's SchedulerOutput says which blocks move).
        `lora_config`: LoRA adapters may run (enable_lora); they live here, in `loras`.
        `kv_layout`: the cache's layer groups (core/kv_layout.py; None: one group).
        `kv_cache_dtype`: how the cache stores K/V (model/kv_format.py)."""
        self.model = model
        self.encoder = model if isinstance(model, EncoderModel) else None
        self.drafter = drafter
        self.cpu_options = cpu_options
        ops = kernels.load() if self.cpu_options.cpp_kernels and device.type == "cpu" else None
        # Chosen once: the CPU plan or the reference model, for every step.
        self.forward = forward if forward is not None else chosen_forward(model, dtype, device, self.cpu_options)
        self.loras = LoRAManager(spec, lora_config, device) if lora_config is not None else None
        self.timer = StepTimer()  # the engine times its own parts of a step on it too
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        # A tensor per slot of the layout, [2 (K, V), num_blocks, block_size, num_kv_heads,
        # entry] (kv_format.py), and kv_caches[i] the one layer i writes (one tensor a layer: one group).
        self.layout = kv_layout or one_group(spec.num_layers)
        self.kv_slots = [] if self.encoder is not None else kv_cache_tensors(
            kv_cache_dtype, self.layout.slots, num_blocks, block_size, spec, dtype, device)
        self.kv_caches = [] if self.encoder is not None else [
            self.kv_slots[self.layout.place(i)[1]] for i in range(spec.num_layers)]
        self._layer_groups = (None if len(self.layout.groups) == 1 else
                              tuple(self.layout.place(i)[0] for i in range(spec.num_layers)))
        self.offloader = KVOffloader(self.kv_caches, kv_offload) if kv_offload is not None else None
        self.sampler = Sampler(device, seed, ops=ops)
        # EOS ids found at load time: masked until a request reaches min_tokens.
        self.eos_token_ids = tuple(eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        # Structured outputs: grammars handed over by the engine before the request's
        # first step (it stays unscheduled until then), and the batched mask.
        self.pending_grammars: dict[str, RequestGrammar] = {}
        self.grammar_mask = GrammarMask(spec.vocab_size, ops=ops)
        self.pooler = Pooler(pooler_config or PoolerConfig(), classifier_head, spec.final_logit_softcapping,
                             self.encoder.classify if self.encoder is not None and spec.num_labels else None)

    def add_grammar(self, request_id: str, compiled: xgr.CompiledGrammar,
                    reasoning_end_token_id: int | None = None) -> None:
        """The compiled grammar of a request not scheduled yet: its own matcher
        (waiting for `reasoning_end_token_id` first, where given)."""
        self.pending_grammars[request_id] = RequestGrammar(compiled, reasoning_end_token_id)

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_slots)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
            self.pending_grammars.pop(request_id, None)
            self.pooler.forget(request_id)
        offloader = self.offloader
        if offloader is None or not (scheduler_output.kv_loads or scheduler_output.kv_stores):
            return self._execute(scheduler_output)
        # The disk tier: loads before the forward, stores of what it computed after.
        transfers = KVTransferStats()
        with self.timer.phase(StepPhase.PREPARE_INPUTS):
            loaded = offloader.load(scheduler_output.kv_loads, transfers)
        out = self._execute(scheduler_output)
        with self.timer.phase(StepPhase.UPDATE):
            offloader.store(scheduler_output.kv_stores, transfers)
        out.kv_loaded_block_ids, out.kv_transfers = loaded, transfers
        return out

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], runs=[])
        # Decodes first (a request verifying drafts is decodes too, one a row):
        # the attention backend handles them as one batch.
        reqs = sorted(scheduler_output.scheduled, key=lambda r: r.num_tokens != 1 + r.num_draft_tokens)
        # Each generation request's sampling state, by its place in reqs (pooling
        # requests have none: the pooler keeps theirs).
        states = {j: self._state(r) for j, r in enumerate(reqs) if r.pooling_params is None}
        if self.drafter is not None:
            for request_id in scheduler_output.preempted_req_ids:
                self.drafter.forget(request_id)
            for request_id in scheduler_output.finished_req_ids:
                self.drafter.forget(request_id)
            to_draft = [(reqs[j], s) for j, s in states.items()
                        if reqs[j].num_draft_tokens and reqs[j].token_ids[-1] == DRAFT_PLACEHOLDER]
            if to_draft:
                with self.timer.phase(StepPhase.FORWARD):
                    self.drafter.propose([r for r, _ in to_draft],
                                         [[*s.prompt_token_ids, *s.output_token_ids]
                                          for _, s in to_draft])
        with self.timer.phase(StepPhase.PREPARE_INPUTS):
            input_ids, positions, meta, starts = self._prepare_inputs(reqs)
        sample = [j for j, r in enumerate(reqs) if r.do_sample]
        # The rows whose last hidden states are read, ascending: each sampled
        # request's sampled rows (its last, and one before each of its drafts),
        # each pooling request's pooled rows (worker/pooler.py); where each is in it.
        row_list: list[int] = []
        sample_at: list[int] = []
        pool_at: dict[int, tuple[int, int]] = {}  # j -> its rows' slice of row_list
        for j, r in enumerate(reqs):
            if r.do_sample:
                rows_j = list(range(starts[j + 1] - 1 - r.num_draft_tokens, starts[j + 1]))
                sample_at.extend(range(len(row_list), len(row_list) + len(rows_j)))
            elif r.pooling_params is not None:
                rows_j = self.pooler.rows(r, starts[j])
                pool_at[j] = (len(row_list), len(row_list) + len(rows_j))
            else:
                continue
            row_list.extend(rows_j)
        # A request that wants its prompt's logprobs reads every row of its chunk.
        wants_prompt_logprobs = [
            j for j, state in states.items()
            if reqs[j].sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_sent
        ]
        all_rows = bool(wants_prompt_logprobs) or len(row_list) == input_ids.shape[0]  # (decodes)
        # (Made only where used: each small torch op costs a cold-cache step ~10 us.)
        rows = None if all_rows and not wants_prompt_logprobs else torch.tensor(
            row_list, dtype=torch.int64, device=self.device)
        # Each LoRA adapter's rows (model/lora.py adds its delta to every projection).
        lora = self.loras.batch([r.lora_int_id for r in reqs], starts) if self.loras is not None else None
        with self.timer.phase(StepPhase.FORWARD):
            if self.encoder is not None:
                hidden = self.encoder(input_ids, positions, self.kv_caches, meta,
                                      output_rows=None if all_rows else rows,
                                      token_type_ids=self._token_types(reqs))
            else:
                hidden = self.forward(input_ids, positions, self.kv_caches, meta,
                                      output_rows=None if all_rows else rows, lora=lora)

        for j in wants_prompt_logprobs:
            self._gather_prompt_logprobs(reqs[j], states[j], hidden, starts[j])
        if wants_prompt_logprobs:
            assert rows is not None
            hidden = hidden[rows]
        # (Else with all rows, row_list is 0..n-1: the hidden states are its rows, in order.)
        pooled: dict[str, list[float]] = {}
        for j, (lo, hi) in pool_at.items():
            vector = self.pooler.add(reqs[j], hidden[lo:hi])
            if vector is not None:
                pooled[reqs[j].request_id] = vector
        if not sample:
            return ModelRunnerOutput(req_ids=[], runs=[], pooled=pooled)
        if len(sample_at) != hidden.shape[0]:  # (pooled rows among them)
            hidden = hidden[torch.tensor(sample_at, dtype=torch.int64, device=self.device)]
        with self.timer.phase(StepPhase.HEAD, label=False):  # (compute_logits labels itself)
            logits = self.forward.compute_logits(hidden)  # [num_sampled, vocab] float32
        sample_states = [states[j] for j in sample]
        num_drafts = [reqs[j].num_draft_tokens for j in sample]
        row_states = sample_states
        if any(num_drafts):
            row_states = [row for j in sample for row in speculative_row_states(
                states[j], reqs[j].token_ids[len(reqs[j].token_ids) - reqs[j].num_draft_tokens :])]
            # A seeded request's generator goes back to here and on by one draw per token
            # it keeps, so its tokens are those of decoding one at a time.
            rewind = {k: g.get_state() for k, state in enumerate(sample_states)
                      if num_drafts[k] and (g := state.generator) is not None
                      and not state.params.greedy}
        with self.timer.phase(StepPhase.SAMPLE):
            # Grammar masks first: everything the sampler does sees the masked logits.
            self.grammar_mask.apply(logits, [s.grammar for s in row_states])
            out = self.sampler(logits, row_states, self.eos_token_ids)
        if any(num_drafts):
            runs = verify_drafts(out.rows(), [reqs[j] for j in sample])
            for k, saved in rewind.items():
                generator = sample_states[k].generator
                assert generator is not None
                generator.set_state(saved)
                torch.rand(len(runs[k]), device=self.device, generator=generator)
            for state, run in zip(sample_states, runs, strict=True):
                for token in run:
                    state.append_output(token[0])
        else:
            runs = [[token] for token in out.rows()]
            for state, token_id in zip(sample_states, out.token_ids, strict=True):
                state.append_output(token_id)
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        for j in wants_prompt_logprobs:
            state = states[j]
            if reqs[j].do_sample:  # (its prefill ends: the whole prompt's are gathered)
                prompt_logprobs[state.request_id], state.prompt_logprobs_sent = (
                    state.prompt_logprobs, True)
                state.prompt_logprobs = []
        return ModelRunnerOutput(
            req_ids=[s.request_id for s in sample_states], runs=runs,
            prompt_logprobs=prompt_logprobs, pooled=pooled,
        )

    def _token_types(self, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
        """An encoder's token types for the step's tokens, in `reqs`' order (each
        request's whole prompt: Request.whole_prompt); None where all are 0."""
        if all(r.token_type_ids is None for r in reqs):
            return None
        types: list[int] = []
        for r in reqs:
            assert r.num_computed_tokens == 0, f"{r.request_id}: an encoder's prompt ran in chunks"
            types.extend(r.token_type_ids if r.token_type_ids is not None else [0] * r.num_tokens)
        return torch.tensor(types, dtype=torch.int64, device=self.device)

    def _state(self, r: ScheduledRequest) -> CachedRequestState:
        state = self.requests.get(r.request_id)
        if state is None:
            assert r.prompt_token_ids is not None, f"{r.request_id}: first scheduled without prompt"
            state = CachedRequestState.create(
                r.request_id, r.prompt_token_ids, r.sampling_params, self.spec.vocab_size,
                self.device, r.bad_words_token_ids,
            )
            state.grammar = self.pending_grammars.pop(r.request_id, None)
            assert (state.grammar is None) == (r.sampling_params.structured_outputs is None), (
                f"{r.request_id}: scheduled before its grammar was compiled"
            )
            self.requests[r.request_id] = state
        return state

    def _gather_prompt_logprobs(
        self, r: ScheduledRequest, state: CachedRequestState, hidden: torch.Tensor, first_row: int
    ) -> None:
        """Logprobs of prompt tokens 1.. from this chunk's rows (row at position p
        predicts prompt token p + 1). Positions already gathered (before a
        preemption) are skipped, so nothing is reported twice."""
        start = r.num_computed_tokens
        begin = max(start, len(state.prompt_logprobs))
        end = min(start + r.num_tokens, state.num_prompt_tokens - 1)
        assert begin == len(state.prompt_logprobs) or begin >= end, "prompt logprobs gap"
        k = r.sampling_params.prompt_logprobs or 0
        for lo in range(begin, end, PROMPT_LOGPROBS_CHUNK):
            hi = min(lo + PROMPT_LOGPROBS_CHUNK, end)
            rows = hidden[first_row + lo - start : first_row + hi - start]
            logprobs = torch.log_softmax(self.forward.compute_logits(rows), dim=-1)  # [n, vocab]
            targets = torch.tensor(state.prompt_token_ids[lo + 1 : hi + 1], device=self.device)
            chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
            ranks = (logprobs >= chosen).sum(dim=-1).tolist()
            top_vals: list[list[float]] = [[] for _ in range(hi - lo)]
            top_ids: list[list[int]] = [[] for _ in range(hi - lo)]
            if k:
                vals_t, ids_t = logprobs.topk(k, dim=-1)  # [n, k]
                top_vals, top_ids = vals_t.tolist(), ids_t.tolist()
            for i, (lp, rank, vals, ids) in enumerate(
                zip(chosen[:, 0].tolist(), ranks, top_vals, top_ids, strict=True)
            ):
                state.prompt_logprobs.append(
                    TokenLogprobs(
                        token_id=state.prompt_token_ids[lo + i + 1],
                        logprob=lp,
                        rank=int(rank),
                        top=dict(zip(ids, vals, strict=True)),
                    )
                )

    def _prepare_inputs(
        self, reqs: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Token ids, positions, the attention metadata, and each request's first
        row (num_reqs + 1 entries: the rows are the requests' tokens in order).

        The metadata's sequences are the requests, except that a request
        verifying k drafts is k + 1 decode sequences, one a row, each over the
        request's block table row (repeated) with context L + 1, ..., L + k + 1:
        each row then attends as a decode does (the decode kernels, which
        give a row the same bits whatever else is in the step), never as a
        prefill chunk, whose attention sums in another order."""
        if all(len(r.token_ids) == 1 for r in reqs):
            return self._prepare_decodes(reqs)
        return self._prepare_any(reqs)

    def _tables(self, reqs: list[ScheduledRequest], width: int) -> list[list[list[int]]]:
        """Each KV layer group's block tables [group][request][width], padded with 0."""
        out = []
        for g in range(len(self.layout.groups)):
            rows = []
            for r in reqs:
                ids = (r.block_ids if g == 0 else r.group_block_ids[g - 1])[:width]
                rows.append(ids + [0] * (width - len(ids)))
            out.append(rows)
        return out

    def _groups(self, block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> dict[str, Any]:
        """AttentionMetadata's group fields: none with one group."""
        if self._layer_groups is None:
            return {}
        return {"group_block_tables": block_tables, "group_slot_mapping": slot_mapping,
                "layer_groups": self._layer_groups}

    def _prepare_any(
        self, reqs: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """_prepare_inputs for any step."""
        bs = self.block_size
        starts = [0]
        token_ids: list[int] = []
        for r in reqs:
            token_ids.extend(r.token_ids)
            starts.append(starts[-1] + r.num_tokens)
        # Attention sequences: seq_req[i] is sequence i's request.
        seq_req: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for j, r in enumerate(reqs):
            per_row = r.num_draft_tokens > 0
            for i in range(r.num_tokens if per_row else 1):
                q_len = 1 if per_row else r.num_tokens
                seq_req.append(j)
                query_start_loc.append(query_start_loc[-1] + q_len)
                seq_lens.append(r.num_computed_tokens + (i + 1 if per_row else r.num_tokens))
        expanded = len(seq_req) > len(reqs)
        # The leading sequences of one query each are the decodes (the runner
        # sorts them first; where a caller does not, the rest attend as prefills).
        num_decodes = next((i for i in range(len(seq_lens))
                            if query_start_loc[i + 1] - query_start_loc[i] != 1), len(seq_lens))
        max_num_blocks = max(-(-s // bs) for s in seq_lens)
        req_tables = torch.tensor(self._tables(reqs, max_num_blocks), dtype=torch.int64)
        # [groups, num_reqs, max_num_blocks]

        # Per token: which request, and its position in that request.
        query_lens = torch.tensor([r.num_tokens for r in reqs])
        req_index = torch.repeat_interleave(torch.arange(len(reqs)), query_lens)  # [num_tokens]
        first_token = torch.tensor(starts[:-1])
        positions = (torch.arange(len(token_ids)) - first_token[req_index]
                     + torch.tensor([r.num_computed_tokens for r in reqs])[req_index])
        slot_mapping = req_tables[:, req_index, positions // bs] * bs + positions % bs  # [groups, tokens]
        if expanded:  # a table row per sequence, and each token's sequence
            block_tables = req_tables[:, torch.tensor(seq_req)]
            token_seq = torch.repeat_interleave(torch.arange(len(seq_req)),
                                                torch.diff(torch.tensor(query_start_loc)))
        else:
            block_tables, token_seq = req_tables, req_index
        block_tables, slot_mapping = block_tables.to(self.device), slot_mapping.to(self.device)

        decode_seq_lens = seq_lens[:num_decodes]
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            max_decode_seq_len=max(decode_seq_lens, default=0),
            slot_mapping=slot_mapping[0],
            block_tables=block_tables[0],
            decode_seq_lens=torch.tensor(decode_seq_lens, dtype=torch.int64, device=self.device),
            block_size=bs,
            token_seq_ids=token_seq.to(self.device),
            token_seq_lens=(positions + 1).to(self.device),
            seq_req=seq_req if expanded else None,
            **self._groups(block_tables, slot_mapping),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta, starts

    def _prepare_decodes(
        self, reqs: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """_prepare_inputs for a step of decodes only (one token each, no drafts):
        the same metadata, built from Python ints with one tensor made per field.
        A small decode step's Python runs with cold caches (the forward streams
        the weights through L3) and while serving each torch op can hand the GIL
        to the event loop: the general path's ~20 ops cost 0.3-0.9 ms a step."""
        bs = self.block_size
        n = len(reqs)
        positions = [r.num_computed_tokens for r in reqs]
        seq_lens = [p + 1 for p in positions]
        width = max(-(-s // bs) for s in seq_lens)
        by_group = self._tables(reqs, width)
        slots_by_group = [[table[p // bs] * bs + p % bs for table, p in zip(tables, positions, strict=True)]
                          for tables in by_group]
        device = self.device
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        tables, slots = by_group[0], slots_by_group[0]
        groups = {} if len(by_group) == 1 else self._groups(
            torch.tensor(by_group, dtype=torch.int64, device=device),
            torch.tensor(slots_by_group, dtype=torch.int64, device=device))
        meta = AttentionMetadata(
            num_decodes=n,
            query_start_loc=list(range(n + 1)),
            seq_lens=seq_lens,
            max_decode_seq_len=max(seq_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
            decode_seq_lens=lens,
            block_size=bs,
            token_seq_ids=torch.arange(n, device=device),
            token_seq_lens=lens,  # (a decode's context is its position + 1; read only)
            seq_req=None,
            **groups,
        )
        input_ids = torch.tensor([r.token_ids[0] for r in reqs], dtype=torch.int64, device=device)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=device), meta, list(range(n + 1))
