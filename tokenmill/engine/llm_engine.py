"""LLMEngine: the only place where the scheduler, the model runner and the
tokenizer meet. One call to `step()` is one iteration of continuous batching:
schedule, run the model, update requests, detokenize; it returns the outputs
and what the step did together (StepResult)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.backends.cpu.memory import free_heap_bytes, trim_heap
from tokenmill.backends.cpu.options import CpuBackendOptions
from tokenmill.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ModelSpec,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tokenmill.core.contracts import DRAFT_PLACEHOLDER, SchedulerOutput
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.kv_layout import KVLayout, make_kv_layout
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import SchedulerStats
from tokenmill.core.static_scheduler import make_scheduler
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.client import CacheFacts, EngineFacts, PromptType
from tokenmill.engine.generation_config import default_sampling_params
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.parallel_sampling import fan_out
from tokenmill.engine.structured import GrammarCompiler
from tokenmill.model.bert import EncoderModel
from tokenmill.model.kv_format import kv_cache_format
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.pooler_config import cross_encoder_pooler_config, read_pooler_config
from tokenmill.model.source import ModelSource, resolve_model_source
from tokenmill.outputs import EngineOutput
from tokenmill.sampling_params import (
    LoRARequest,
    ParamError,
    PoolingParams,
    SamplingParams,
    is_integer,
)
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.tokenizer import Tokenizer
from tokenmill.worker.cache_sizing import num_kv_blocks
from tokenmill.worker.kv_offload import fingerprint
from tokenmill.worker.model_runner import ModelRunner, chosen_forward
from tokenmill.worker.step_timer import StepPhase

if TYPE_CHECKING:
    from tokenmill.distributed.tensor_parallel import TensorParallel

logger = logging.getLogger("tokenmill")
# Free heap bytes after loading above which the engine gives them back (trim_heap).
TRIM_AFTER_LOAD_BYTES = 256 << 20


@dataclass
class StepStats:
    """What one step did."""

    num_scheduled_tokens: int
    num_scheduled_reqs: int
    num_preempted: int
    # Callers' request ids (a parent's for n > 1) scheduled for the first time in
    # this step, for queue-time metrics.
    first_scheduled_req_ids: tuple[str, ...] = ()
    # Seconds in each part of the step (worker/step_timer.py).
    phase_s: dict[StepPhase, float] = dataclasses.field(default_factory=dict)
    # KV blocks once the step was scheduled: holding tokens, and those plus the
    # ones promised to running requests (kv_allocation="reserved"; else equal).
    num_kv_blocks_used: int = 0
    num_kv_blocks_held: int = 0


@dataclass
class StepResult:
    outputs: list[EngineOutput]
    stats: StepStats


@dataclass(frozen=True)
class ScheduledStep:
    """What `schedule()` chose, for `execute()` to run."""

    scheduler_output: SchedulerOutput
    first_scheduled_req_ids: tuple[str, ...]
    num_kv_blocks_used: int = 0
    num_kv_blocks_held: int = 0


class LLMEngine:
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, check_integrity: bool = False) -> LLMEngine:
        return cls(*engine_args.create_engine_configs(), check_integrity=check_integrity,
                   speculative_config=engine_args.create_speculative_config(),
                   parallel_config=engine_args.create_parallel_config(),
                   cpu_options=engine_args.create_cpu_options(),
                   lora_config=engine_args.create_lora_config())

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        check_integrity: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        *,
        cpu_options: CpuBackendOptions,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.lora_config = lora_config  # LoRA adapters (enable_lora): they live in the runner
        self.cpu_options = cpu_options  # (EngineArgs.create_cpu_options: built once, passed down)
        self.speculative_config = speculative_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.check_integrity = check_integrity
        if model_config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        self.device = torch.device(model_config.device)
        torch.manual_seed(model_config.seed)

        self.source: ModelSource = resolve_model_source(model_config.model)
        # Tensor parallelism: the other ranks start (and load) while this one loads.
        self.parallel_config = parallel_config or ParallelConfig()
        self.tp: TensorParallel | None = None
        if self.parallel_config.tensor_parallel_size > 1:
            from tokenmill.distributed.tensor_parallel import TensorParallel

            self.tp = TensorParallel(self.parallel_config, model_config, cpu_options)
        try:
            model, spec = load_model(model_config, self.source)
            self._init_rest(model, spec)
        except BaseException:
            self.shutdown()
            raise

    def _init_rest(self, model: LlamaForCausalLM | EncoderModel, spec: ModelSpec) -> None:
        model_config, cache_config = self.model_config, self.cache_config
        scheduler_config = self.scheduler_config
        self.spec: ModelSpec = spec
        # Which requests it serves (config.RUNNERS): an encoder, or a checkpoint
        # saved without its LM head, pools only.
        self.serves = self._serves(spec)
        self.dtype: torch.dtype = next(model.parameters()).dtype
        # What a request leaves unset takes these (vLLM's get_diff_sampling_param).
        self.default_sampling_params: dict[str, Any] = default_sampling_params(
            self.source, model_config.generation_config)
        # Without a tokenizer (vLLM's skip_tokenizer_init) prompts must be token ids
        # and outputs carry token ids only.
        self.tokenizer: Tokenizer | None = None
        if not model_config.skip_tokenizer_init:
            self.tokenizer = Tokenizer.load(model_config.tokenizer or self.source.path)
        eos = set(spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))

        max_model_len = model_config.max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} is longer than the model's "
                f"{spec.max_position_embeddings} positions; lower it"
            )
        layout = None
        if isinstance(model, EncoderModel):
            scheduler_config, cache_config, num_blocks = self._encoder_configs(max_model_len)
        else:
            if self.tp is not None:  # this rank's shard: its heads, its share of the vocabulary
                model = self.tp.shard(model)
                cache_config = self.tp.cache_config(cache_config)
            layout = self._kv_layout(spec)
            # (model.spec: the shard's heads, for the KV cache; the vocabulary whole.)
            num_blocks = num_kv_blocks(model.spec, self.dtype, cache_config, self.device, layout)
            if self.tp is not None:
                self.tp.start(num_blocks, cache_config.block_size,
                              [layout.place(i)[1] for i in range(spec.num_layers)], cache_config.cache_dtype)
        # How pooling requests pool (model/pooler_config.py); none are served with
        # runner="generate", whose model directory is then not read for it.
        if spec.num_labels:
            self.pooler_config = cross_encoder_pooler_config(self.source.path, spec.num_labels)
        elif self.serves != "generate":
            self.pooler_config = read_pooler_config(self.source.path,
                                                    "CLS" if spec.encoder_only else "LAST")
        else:
            self.pooler_config = PoolerConfig()
        if model_config.hf_overrides is not None:
            self.pooler_config = self._reranker_config(model_config.hf_overrides)
        # A yes/no reranker's two head rows, read before the CPU plan packs the head.
        ids = self.pooler_config.classifier_token_ids
        classifier_head = None
        if ids is not None:
            assert isinstance(model, LlamaForCausalLM)  # (_serves refused hf_overrides for an encoder)
            classifier_head = model.head_rows(ids)
        forward = chosen_forward(model, self.dtype, self.device, self.cpu_options)
        # Loading's and packing's freed temporaries, which fragmentation keeps in glibc's
        # heap, go back before the KV cache is allocated beside them: the peak RSS and the
        # RSS after load (a 1B Q4_K_M GGUF: ~780 MiB; docs/perf-notes.md). Only where there
        # is that much: a trim also drops the free pages the process keeps for reuse.
        if (free_heap_bytes() or 0) >= TRIM_AFTER_LOAD_BYTES:
            trim_heap()
        disk = self._kv_offload(model.spec, type(forward).__name__)
        if self.tp is not None:  # every forward goes to the other ranks too
            forward = self.tp.driver(forward)
        speculative_config = self.speculative_config
        drafter = None
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert speculative_config.model is not None
            drafter = DraftModelProposer(
                speculative_config.model, spec, num_blocks, cache_config.block_size, self.dtype,
                self.device, self.cpu_options, cache_config.cache_dtype)
        if self.lora_config is not None and spec.num_experts:
            raise ValueError(f"LoRA adapters are not supported on {spec.architecture} (a mixture of experts) "
                             "yet; drop --enable-lora")
        self.runner = ModelRunner(
            model, model.spec, num_blocks, cache_config.block_size, self.dtype, self.device, self.cpu_options,
            seed=model_config.seed, eos_token_ids=self.eos_token_ids, forward=forward,
            drafter=drafter, pooler_config=self.pooler_config, classifier_head=classifier_head,
            kv_offload=disk,
            lora_config=self.lora_config,
            kv_layout=layout,
            kv_cache_dtype=cache_config.cache_dtype,
        )
        num_spec_tokens = speculative_config.num_speculative_tokens if speculative_config else 0
        self.scheduler = make_scheduler(scheduler_config, cache_config, num_blocks, max_model_len,
                                        num_spec_tokens, disk,
                                        self.lora_config.max_loras if self.lora_config else 0, layout)
        # Adapters removed while requests still ran on them: dropped once idle.
        self._retired_loras: set[int] = set()
        self.ngram: NgramProposer | None = None
        if speculative_config is not None and speculative_config.method == "ngram":
            assert speculative_config.prompt_lookup_min and speculative_config.prompt_lookup_max
            self.ngram = NgramProposer(speculative_config.prompt_lookup_min,
                                       speculative_config.prompt_lookup_max)
        self.max_model_len = self.scheduler.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._scheduled_step: ScheduledStep | None = None  # scheduled, not executed yet
        # Structured outputs: the compiler (built with the first constrained request),
        # the requests whose grammar is still compiling, and those whose compile failed.
        self._grammar_compiler: GrammarCompiler | None = None
        self._compiling: dict[str, tuple[Request, str, Future[Any]]] = {}
        self._failed_compiles: dict[str, str] = {}  # caller's request id -> why
        self.facts = self._facts(num_blocks)

    def _kv_layout(self, spec: ModelSpec) -> KVLayout:
        """The KV cache's layer groups (core/kv_layout.py): windowed layers give back
        the blocks their window has passed where the cache is paged and nothing
        else reads it whole: not with the disk tier (its files hold every layer of
        a block), reservations or static batching (the study's baselines) or a
        draft model (its layers read the first group's table), nor when
        disable_hybrid_kv_cache_manager asks for one table. Tensor-parallel
        ranks allocate rank 0's layout (TensorParallel.start)."""
        windows = [spec.layer_window(i) for i in range(spec.num_layers)]
        cache, sched = self.cache_config, self.scheduler_config
        free = not (sched.disable_hybrid_kv_cache_manager or cache.kv_allocation != "paged"
                    or cache.kv_offload_dir is not None or sched.policy == "static"
                    or (self.speculative_config is not None
                        and self.speculative_config.method == "draft_model"))
        return make_kv_layout(windows, free)

    def _serves(self, spec: ModelSpec) -> str:
        """The runner this engine serves as (config.RUNNERS): the asked one, except
        that a model that cannot generate serves as "pooling" (and refuses
        "generate"); what an encoder cannot be served with, refused."""
        config = self.model_config
        if not (spec.encoder_only or spec.headless):
            return config.runner
        kind = (f"{spec.architecture} is an encoder-only model" if spec.encoder_only else
                f"{self.source.name} was saved without its LM head ({spec.architecture} layers)")
        if config.runner == "generate":
            raise ValueError(f"runner='generate' cannot serve this model: {kind}, it pools "
                             "(embeddings, scores) and generates nothing; use --runner pooling or auto")
        if spec.encoder_only:
            refused = [(self.tp is not None, "--tensor-parallel-size"),
                       (self.speculative_config is not None, "--speculative-config"),
                       (config.hf_overrides is not None, "--hf-overrides"),
                       (self.scheduler_config.policy == "static", "--scheduling-policy static")]
            for on, flag in refused:
                if on:
                    raise ValueError(f"{flag} is not supported for {spec.architecture} (an encoder); "
                                     "drop it")
        return "pooling"

    def _encoder_configs(self, max_model_len: int) -> tuple[SchedulerConfig, CacheConfig, int]:
        """An encoder's scheduling: each prompt runs whole in one step (Request.
        whole_prompt: bidirectional attention needs all of it), so the token budget
        is raised to max_model_len where it is smaller (vLLM's default without
        chunked prefill; ARCHITECTURE.md §1 says why not an error), and nothing is cached (no prefix caching: a
        cached block's K/V would depend on the tokens after it). Its blocks hold
        no memory: they count a step's tokens, a step's worth of them."""
        config, cache = self.scheduler_config, self.cache_config
        budget = max(config.max_num_batched_tokens, max_model_len)
        if budget != config.max_num_batched_tokens:
            logger.info("encoder: max_num_batched_tokens %d -> %d (max_model_len: a prompt runs "
                        "whole in one step)", config.max_num_batched_tokens, budget)
        num_blocks = -(-budget // cache.block_size) + config.max_num_seqs
        return (dataclasses.replace(config, max_num_batched_tokens=budget),
                dataclasses.replace(cache, enable_prefix_caching=False), num_blocks)

    def _kv_offload(self, spec: ModelSpec, forward_kind: str) -> BlockFiles | None:
        """The disk tier's files under this engine's fingerprint, or None (off)."""
        cache_config = self.cache_config
        if cache_config.kv_offload_dir is None:
            return None
        if spec.encoder_only:
            raise ValueError(f"kv_offload_dir holds KV cache blocks, and {spec.architecture} (an "
                             "encoder) keeps none; drop it")
        if self.tp is not None:
            raise ValueError("kv_offload_dir runs on one process (each tensor-parallel rank holds "
                             "its own heads' K/V); drop it or --tensor-parallel-size")
        options = self.cpu_options
        forward = (f"{forward_kind} {self.device.type} cpp_kernels={options.cpp_kernels} "
                   f"batch_invariant={options.batch_invariant}")
        fp = fingerprint(self.source.path, spec, self.dtype, cache_config.block_size,
                         self.model_config.quantization, forward, cache_config.cache_dtype)
        try:
            return BlockFiles(cache_config.kv_offload_dir, fp, cache_config.kv_offload_bytes)
        except OSError as e:
            raise ValueError(f"kv_offload_dir {cache_config.kv_offload_dir!r} cannot be used: {e}; "
                             "name a directory this process can create and write") from e

    def _reranker_config(self, overrides: Mapping[str, Any]) -> PoolerConfig:
        """The pooler of a yes/no reranker (config.check_hf_overrides checked the
        keys): each classifier_from_token must be one token of the vocabulary."""
        if self.serves == "generate":
            raise ValueError("hf_overrides' classifier_from_token makes a reranker (pooling); "
                             "it cannot be served with runner='generate'")
        if self.tp is not None:
            raise ValueError("a yes/no reranker runs on one process; drop --tensor-parallel-size")
        if self.tokenizer is None:
            raise ValueError("a yes/no reranker needs its tokenizer to find classifier_from_token's "
                             "ids; drop skip_tokenizer_init")
        ids = []
        for token in overrides["classifier_from_token"]:
            found = self.tokenizer.encode(token, add_special_tokens=False)
            if len(found) != 1:
                raise ValueError(f"hf_overrides' classifier_from_token {token!r} is {len(found)} "
                                 "tokens of this tokenizer; each must be exactly one")
            ids.append(found[0])
        return dataclasses.replace(
            self.pooler_config, pooling_type="LAST", normalize=False, is_matryoshka=False,
            matryoshka_dimensions=None, classifier_token_ids=(ids[0], ids[1]),
            score_template="qwen3_reranker" if overrides.get("is_original_qwen3_reranker") else None)

    def _stored_kv_dtype(self, dtype: str) -> str:
        """How the KV cache stores K/V: the model's dtype, or the 8-bit format asked."""
        fmt = kv_cache_format(self.cache_config.cache_dtype)
        return fmt.name if fmt.quantized else dtype

    def _facts(self, num_blocks: int) -> EngineFacts:
        """What a front end may know (engine/client.py), fixed from here on."""
        dtype = str(self.dtype).removeprefix("torch.")
        return EngineFacts(
            model_name=self.source.name,
            model_path=self.source.path,
            max_model_len=self.max_model_len,
            vocab_size=self.spec.vocab_size,
            dtype=dtype,
            default_sampling_params=MappingProxyType(dict(self.default_sampling_params)),
            cache=CacheFacts(
                block_size=self.cache_config.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=self.cache_config.enable_prefix_caching,
                kv_cache_memory_bytes=self.cache_config.kv_cache_memory_bytes,
                cache_dtype=self._stored_kv_dtype(dtype),
            ),
            tensor_parallel_ranks=self.tp.rank_locations() if self.tp is not None else (),
            runner=self.serves,
            hidden_size=self.spec.hidden_size,
            pooler=self.pooler_config,
        )

    # ---- requests ---------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this engine was started with skip_tokenizer_init; send "
                    "{'prompt_token_ids': [...]} instead of text"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            raw = prompt["prompt_token_ids"]
            try:
                ok = not isinstance(raw, str | bytes) and all(is_integer(t) for t in raw)
            except TypeError:  # not iterable
                ok = False
            if not ok:
                raise ParamError(
                    f"prompt_token_ids must be a list of integers, got {raw!r:.80}", "prompt"
                )
            ids = [int(t) for t in raw]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise ParamError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})",
                    "prompt",
                )
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.tokenize_prompt(prompt["prompt"])
        raise ParamError(
            "a prompt is a string or a dict with 'prompt_token_ids' (or 'prompt'); "
            f"got {type(prompt).__name__}",
            "prompt",
        )

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises ValueError (with what to do) if it can never run.
        With params.n > 1 it runs as n child requests (see parallel_sampling.py).
        With PoolingParams it is a pooling request: its prompt runs, and its one
        output is a PoolingRequestOutput with the pooled hidden state.
        `lora_request`: the LoRA adapter it runs with, loaded now if it is not
        (a LoRAError, a ValueError, if it cannot be served)."""
        if lora_request is not None and isinstance(params, PoolingParams):
            raise ParamError("pooling requests run on the base model; drop the LoRA adapter",
                             "model")
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, arrival_time, priority)
            return
        if self.serves == "pooling":
            if self.spec.encoder_only or self.spec.headless:
                raise ValueError(
                    f"model {self.source.name!r} ({self.spec.architecture}"
                    f"{', an encoder-only model' if self.spec.encoder_only else ', saved without its LM head'}) "
                    "serves pooling only (--runner pooling: /v1/embeddings, /score, /rerank); "
                    "it cannot generate: use a generative model for completions and chat")
            raise ValueError("this engine runs with runner='pooling' (embeddings only) and "
                             "generates nothing; start it with runner 'auto' or 'generate'")
        self._check_priority(priority)
        priority = int(priority)
        text, prompt_ids = self.tokenize_prompt(prompt)
        params, bad_words_token_ids = self.resolve_params(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if lora_request is not None:
            self.add_lora(lora_request)

        grammar = None
        if params.structured_outputs is not None:
            # A constraint that cannot be parsed raises here (a 400); compiling
            # it runs in the background while the request waits.
            grammar = self.grammar_compiler().compile(params.structured_outputs)

        def request(core_id: str, core_params: SamplingParams) -> Request:
            req = Request(
                request_id=core_id,
                prompt_token_ids=prompt_ids,
                sampling_params=core_params,
                bad_words_token_ids=bad_words_token_ids,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                priority=priority,
                lora_request=lora_request,
            )
            if grammar is not None:
                req.grammar_ready = False
                self._compiling[core_id] = (req, request_id, grammar)
            return req

        if params.n == 1:
            self.scheduler.add_request(request(request_id, params))
            self.output_processor.add_request(request_id, text, prompt_ids, params, arrival)
            return
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        children = fan_out(request_id, params)
        for child_id, child_params in children:
            # The children share one prompt: if the first is admitted, all are.
            self.scheduler.add_request(request(child_id, child_params))
        self.output_processor.add_parent_request(
            request_id, text, prompt_ids, params, arrival, children
        )

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (or mark a loaded one most recently used); ValueError
        (model/lora.py's LoRAError) saying why one cannot be served."""
        if self.runner.loras is None:
            raise ParamError("this engine was started without LoRA adapters; start it with "
                             "enable_lora=True (--enable-lora)", "model")
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        self.runner.loras.load(lora_request, in_use)
        self._retired_loras.discard(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter: now if no unfinished request runs on it, else once
        the last one ends (those finish on it). False if it is not loaded."""
        if self.runner.loras is None or lora_int_id not in self.runner.loras.adapters:
            return False
        self._retired_loras.add(lora_int_id)
        self._drop_retired_loras()
        return True

    def list_loras(self) -> set[int]:
        """The ids of the loaded adapters (retired ones still finishing excluded)."""
        if self.runner.loras is None:
            return set()
        return set(self.runner.loras.adapters) - self._retired_loras

    def _drop_retired_loras(self) -> None:
        assert self.runner.loras is not None
        in_use = {r.lora_int_id for r in self.scheduler.requests.values()}
        for lora_int_id in self._retired_loras - in_use:
            self.runner.loras.remove(lora_int_id)
            self._retired_loras.discard(lora_int_id)

    def _check_priority(self, priority: int) -> None:
        if not is_integer(priority):
            raise ParamError(f"priority must be an integer, got {priority!r}", "priority")
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise ParamError(
                f"priority {priority} needs scheduling_policy='priority' (this engine's is "
                f"{self.scheduler.config.policy!r}); start the engine with it, or leave priority at 0",
                "priority",
            )

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: float | None, priority: int) -> None:
        """A pooling request: prefill only, through the same scheduler; finished
        (its blocks freed) in the step its last prompt token runs."""
        if self.serves == "generate":
            raise ValueError("this engine runs with runner='generate'; pooling (embedding) "
                             "requests need runner 'auto' or 'pooling'")
        self._check_priority(priority)
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_ids = self.tokenize_prompt(prompt)
        token_types = self._token_types(prompt, len(prompt_ids))
        params = self.resolve_pooling_params(params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        encoder = self.spec.encoder_only
        self.scheduler.add_request(Request(
            request_id=request_id, prompt_token_ids=prompt_ids,
            sampling_params=SamplingParams(max_tokens=1), arrival_time=arrival,
            priority=int(priority), pooling_params=params,
            pool_every_row=self.pooler_config.needs_every_row or encoder,
            whole_prompt=encoder, token_type_ids=token_types,
        ))
        self.output_processor.add_pooling_request(request_id, text, prompt_ids, arrival)

    def _token_types(self, prompt: PromptType, num_tokens: int) -> list[int] | None:
        """A prompt's `token_type_ids` (vLLM's TokensPrompt field: a text pair's
        segment ids), checked: an encoder's, one per token, each below its
        type_vocab_size."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        limit = self.spec.type_vocab_size
        if not self.spec.encoder_only:
            raise ParamError(f"token_type_ids are for encoder models (BERT); {self.spec.architecture} "
                             "has none: drop them", "token_type_ids")
        if (isinstance(types, str | bytes) or not all(is_integer(t) for t in types)
                or len(types) != num_tokens or not all(0 <= t < limit for t in types)):
            raise ParamError(f"token_type_ids must be {num_tokens} integers (one per prompt token) in "
                             f"[0, {limit}), got {types!r:.80}", "token_type_ids")
        return [int(t) for t in types]

    def resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """Our own copy, checked against the model: `dimensions` only where it was
        trained for Matryoshka truncation (vLLM's rule), and at most its width."""
        params = dataclasses.replace(params)
        dims, config = params.dimensions, self.pooler_config
        if dims is None:
            return params
        if not config.is_matryoshka:
            raise ParamError(
                f"model {self.source.name!r} does not support Matryoshka representation "
                "(its config.json has no is_matryoshka or matryoshka_dimensions); changing the "
                "output dimensions would give poor embeddings: leave dimensions unset",
                "dimensions")
        if config.matryoshka_dimensions and dims not in config.matryoshka_dimensions:
            raise ParamError(f"model {self.source.name!r} supports only dimensions in "
                             f"{list(config.matryoshka_dimensions)}, got {dims}", "dimensions")
        if dims > self.spec.hidden_size:
            raise ParamError(f"dimensions must be at most the model's embedding size "
                             f"{self.spec.hidden_size}, got {dims}", "dimensions")
        return params

    def resolve_params(self, params: SamplingParams) -> tuple[SamplingParams, list[list[int]]]:
        """Our own copy of the request's options, checked against the model's
        vocabulary and tokenizer (ParamError naming the field otherwise), and its
        bad words as token id sequences (what the sampler bans)."""
        params = dataclasses.replace(params)
        vocab = self.spec.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = list(getattr(params, name) or [])
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ParamError(
                    f"{name} holds token ids {bad[:5]} outside the vocabulary [0, {vocab})", name
                )
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ParamError(
                "stop strings and bad_words need a tokenizer (this engine has "
                "skip_tokenizer_init); use stop_token_ids / logit_bias instead",
                "stop" if params.stop else "bad_words",
            )
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ParamError("structured_outputs needs a tokenizer (this engine has "
                             "skip_tokenizer_init)", "structured_outputs")
        bad_words_token_ids: list[list[int]] = []
        if params.bad_words and self.tokenizer is not None:
            bad_words_token_ids = self.tokenizer.bad_words_token_ids(params.bad_words)
        return params, bad_words_token_ids

    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            assert self.tokenizer is not None
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.spec.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def _collect_grammars(self) -> None:
        """Hand every finished compile to the runner and let its request be
        scheduled; when nothing else can run, wait (briefly) for one."""
        if not self._compiling:
            return
        if not any(r.grammar_ready for r in self.scheduler.requests.values()):
            wait([f for _, _, f in self._compiling.values()], timeout=0.05,
                 return_when=FIRST_COMPLETED)
        for core_id, (request, request_id, future) in list(self._compiling.items()):
            if core_id not in self.scheduler.requests:  # aborted meanwhile
                del self._compiling[core_id]
            elif future.done():
                del self._compiling[core_id]
                error = future.exception()
                if error is not None:
                    logger.error("request %s: its grammar failed to compile: %s", request_id, error)
                    self._failed_compiles[request_id] = str(error)
                    continue
                constraint = request.sampling_params.structured_outputs
                assert constraint is not None
                self.runner.add_grammar(core_id, future.result(), constraint.reasoning_end_token_id)
                request.grammar_ready = True

    def abort_request(self, request_ids: Sequence[str]) -> list[EngineOutput]:
        """Abort requests (between steps); their blocks are freed at once."""
        core_ids = [c for r in request_ids for c in self.output_processor.core_request_ids(r)]
        self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
        outputs = []
        for request_id in request_ids:
            out = self.output_processor.abort(request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    # ---- one iteration ----------------------------------------------------------

    def step(self) -> StepResult:
        return self.execute(self.schedule())

    # step() in two halves, so that AsyncEngine can publish the scheduler's state
    # between them (a long step then shows its requests as running). Every
    # schedule() must be followed by exactly one execute() of what it returned.

    def schedule(self) -> ScheduledStep:
        assert self._scheduled_step is None, "execute() the last schedule() first"
        # Each part's wall time goes to StepStats.phase_s, and its label to torch.profiler
        # (`tokenmill bench throughput --profile` reports both).
        with self.runner.timer.phase(StepPhase.SCHEDULE):
            self._collect_grammars()
            if self.speculative_config is not None:
                self._propose_drafts(self.speculative_config)
            scheduler_output = self.scheduler.schedule()
            now = time.monotonic()
            first_scheduled = []
            for scheduled in scheduler_output.scheduled:
                if scheduled.prompt_token_ids is not None:  # admitted in this step
                    request_id = self.output_processor.mark_scheduled(scheduled.request_id, now)
                    if request_id is not None:
                        first_scheduled.append(request_id)
            kv = self.scheduler.kv
            used = kv.num_blocks - kv.pool.num_free_blocks
        self._scheduled_step = ScheduledStep(scheduler_output, tuple(first_scheduled),
                                             used, used + kv.num_reserved_blocks)
        return self._scheduled_step

    def _propose_drafts(self, spec: SpeculativeConfig) -> None:
        """Drafts for the running requests that decode next, unless more than
        disable_by_batch_size requests run (a big step gains nothing from them).
        Requests whose sampling looks at counts of its own output (penalties) or
        a grammar's state decode one token at a time."""
        running = self.scheduler.running
        if len(running) > spec.disable_by_batch_size:
            return
        k = spec.num_speculative_tokens
        for request in running:
            params = request.sampling_params
            if (request.num_tokens - request.num_computed_tokens != 1 or params.has_penalties
                    or params.structured_outputs is not None or request.pooling_params is not None):
                continue
            drafts = (self.ngram.propose(request.all_token_ids, k) if self.ngram is not None
                      else [DRAFT_PLACEHOLDER] * k)
            self.scheduler.set_drafts(request.request_id, drafts)

    def execute(self, step: ScheduledStep) -> StepResult:
        assert step is self._scheduled_step, "execute() runs what the last schedule() returned"
        self._scheduled_step = None
        timer = self.runner.timer
        scheduler_output = step.scheduler_output
        runner_output = self.runner.execute(scheduler_output)
        with timer.phase(StepPhase.UPDATE):
            core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        with timer.phase(StepPhase.DETOKENIZE):
            outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self._retired_loras:
            self._drop_retired_loras()
        if self._failed_compiles:  # (rare: a grammar that parsed but did not compile)
            outputs.extend(self.abort_request(list(self._failed_compiles)))
            self._failed_compiles.clear()
        stats = StepStats(
            num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
            num_scheduled_reqs=len(scheduler_output.scheduled),
            num_preempted=len(scheduler_output.preempted_req_ids),
            first_scheduled_req_ids=step.first_scheduled_req_ids,
            phase_s=timer.take(),
            num_kv_blocks_used=step.num_kv_blocks_used,
            num_kv_blocks_held=step.num_kv_blocks_held,
        )
        if self.check_integrity:
            self.scheduler.check_integrity()
        return StepResult(outputs, stats)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def parallel_failure(self) -> str | None:
        """Why the tensor-parallel group stopped (a rank gone), or None."""
        return self.tp.failure() if self.tp is not None else None

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (a no-op otherwise; idempotent)."""
        if self.tp is not None:
            self.tp.shutdown()
