"""Per-request output state: detokenization, stop strings, logprobs, RequestOutput building.

Stop strings: the text is searched only where a match could newly end, cut
exactly where the match starts (or after it with include_stop_str_in_output),
and while a request runs the last len(longest stop) - 1 characters are held
back, so a stop string split over several tokens never leaks into a delta:

    text so far:  "Hello wor"  stop = "world"  -> shown: "Hello"  (held: " wor"... 4 chars)
    next token:   "ld!"        -> "Hello world!" matches at 6 -> final text "Hello "

Stop strings are looked for only once min_tokens tokens are out (as vLLM).
A request stopped by EOS or a stop token id does not show that token's text,
unless include_stop_str_in_output.

Requests with n > 1 arrive here as n children (see parallel_sampling.py) and
leave as one RequestOutput per step under the parent's id. This class keeps the
map between a parent and its children: everyone else asks it
(`core_request_ids`, `mark_scheduled`) rather than parsing the children's ids.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from tokenmill.core.contracts import EngineCoreOutput, TokenLogprobs
from tokenmill.engine.parallel_sampling import ParentRequest
from tokenmill.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class PoolingState:
    """A pooling request's: nothing to detokenize, one output at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    parent: ParentRequest | None = None
    index: int = 0  # which of the parent's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_text_len: int = 0  # for DELTA outputs: what earlier outputs already carried
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False


def _find_stop(text: str, new_len: int, params: SamplingParams) -> tuple[str, int] | None:
    """The stop string that ends earliest in the newest `new_len` characters, if any,
    and where the text must be cut."""
    best: tuple[str, int] | None = None
    for stop in params.stop:
        start = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if start < 0:
            continue
        end = start + len(stop) if params.include_stop_str_in_output else start
        if best is None or end < best[1]:
            best = (stop, end)
    return best


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.pooling: dict[str, PoolingState] = {}

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], arrival_time: float) -> None:
        self.pooling[request_id] = PoolingState(request_id, prompt, prompt_token_ids,
                                                RequestMetrics(arrival_time=arrival_time))

    def _pooled(self, core: EngineCoreOutput, now: float) -> PoolingRequestOutput | None:
        """A pooling request's one output: its vector (empty when aborted)."""
        state = self.pooling.pop(core.request_id, None)
        if state is None:
            return None
        state.metrics.finished_time = now
        state.metrics.num_preemptions = core.num_preemptions
        return PoolingRequestOutput(
            request_id=state.request_id, outputs=PoolingOutput(list(core.pooled or [])),
            prompt_token_ids=state.prompt_token_ids, finished=True,
            num_cached_tokens=core.num_cached_tokens, prompt=state.prompt, metrics=state.metrics,
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=arrival_time),
            parent=parent,
            index=index,
        )

    def add_parent_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        children: list[tuple[str, SamplingParams]],
    ) -> None:
        """A request with n > 1, run as `children` (their ids and options)."""
        parent = ParentRequest(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time=arrival_time),
            [child_id for child_id, _ in children],
        )
        for index, (child_id, child_params) in enumerate(children):
            self.add_request(child_id, prompt, prompt_token_ids, child_params, arrival_time,
                             parent=parent, index=index)
        self.parents[request_id] = parent

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents or request_id in self.pooling

    def mark_scheduled(self, core_request_id: str, now: float) -> str | None:
        """The request (a child: and its parent) ran at `now`. Returns the caller's id
        when this is its first time (for queue-time metrics), else None."""
        state: RequestState | PoolingState | None = self.states.get(core_request_id)
        if state is None:
            state = self.pooling.get(core_request_id)
            if state is None:
                return None
        first = state.metrics.first_scheduled_time is None
        if first:
            state.metrics.first_scheduled_time = now
        parent = state.parent if isinstance(state, RequestState) else None
        if parent is None:
            return state.request_id if first else None
        if parent.metrics.first_scheduled_time is None:
            parent.metrics.first_scheduled_time = now
            return parent.request_id
        return None

    def core_request_ids(self, request_id: str) -> list[str]:
        """The scheduler's ids for a request: its children's for n > 1."""
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent is not None else [request_id]

    def process(
        self, core_outputs: list[EngineCoreOutput], now: float | None = None
    ) -> tuple[list[EngineOutput], list[str]]:
        """Returns the outputs to hand out and the ids of requests a stop string
        finished (the scheduler must be told)."""
        now = time.monotonic() if now is None else now
        results: list[EngineOutput] = []
        stopped_by_string: list[str] = []
        touched_parents: dict[str, ParentRequest] = {}
        for core in core_outputs:
            if core.pooled is not None:
                pooled = self._pooled(core, now)
                if pooled is not None:
                    results.append(pooled)
                continue
            state = self.states.get(core.request_id)
            if state is None:
                continue
            if state.finish_reason is None and self._apply_each(state, core, now):
                stopped_by_string.append(core.request_id)
            if core.finished:
                # A stop string may have finished it earlier (static batching reports later).
                if state.finish_reason is None:
                    state.finish_reason = core.finish_reason
                    state.stop_reason = core.stop_reason
                state.metrics.finished_time = now
                state.metrics.num_preemptions = core.num_preemptions
                del self.states[core.request_id]
            elif core.request_id in stopped_by_string:
                state.metrics.finished_time = now
                del self.states[core.request_id]
            output = self._make_output(state)
            if output is None:
                continue
            if state.parent is None:
                results.append(output)
            else:
                state.parent.add_child_output(state.request_id, output, now)
                touched_parents[state.parent.request_id] = state.parent
        for parent in touched_parents.values():
            output = parent.make_output()
            if output is not None:
                results.append(output)
            if parent.finished:
                self.parents.pop(parent.request_id, None)
        return results, stopped_by_string

    def _apply_each(self, state: RequestState, core: EngineCoreOutput, now: float) -> bool:
        """_apply, a token at a time where stop strings apply to several new tokens
        (speculative decoding's accepted runs), so a stop string cuts the run at the
        token that completes it, as decoding one at a time would."""
        n = len(core.new_token_ids)
        if n <= 1 or not state.params.stop or state.detokenizer is None:
            return self._apply(state, core, now)
        for i in range(n):
            part = dataclasses.replace(
                core,
                new_token_ids=core.new_token_ids[i : i + 1],
                new_logprobs=core.new_logprobs[i : i + 1],
                new_top_logprobs=core.new_top_logprobs[i : i + 1],
                new_token_ranks=core.new_token_ranks[i : i + 1],
                prompt_logprobs=core.prompt_logprobs if i == 0 else None,
                finish_reason=core.finish_reason if i == n - 1 else None,
                stop_reason=core.stop_reason if i == n - 1 else None,
            )
            if self._apply(state, part, now):
                return True
        return False

    def _apply(self, state: RequestState, core: EngineCoreOutput, now: float) -> bool:
        """Fold in new tokens; True when a stop string finished the request."""
        params = state.params
        if core.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        state.num_cached_tokens = core.num_cached_tokens
        state.token_ids.extend(core.new_token_ids)
        if core.prompt_logprobs is not None and params.prompt_logprobs is not None:
            state.prompt_logprobs = [
                None, *(self._position(e, params.detokenize) for e in core.prompt_logprobs)
            ]
        ranks = core.new_token_ranks or [0] * len(core.new_token_ids)
        for token_id, lp, top, rank in zip(
            core.new_token_ids, core.new_logprobs, core.new_top_logprobs, ranks, strict=True
        ):
            state.cumulative_logprob += lp
            if params.logprobs is not None:
                state.logprobs.append(
                    self._position(TokenLogprobs(token_id, lp, rank, top or {}), params.detokenize)
                )
        if state.detokenizer is None:
            return False
        new_ids = core.new_token_ids
        if core.finish_reason == "stop" and not params.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # EOS or a stop token id: its text is not shown
        delta = state.detokenizer.add_tokens(new_ids, final=core.finished)
        state.text += delta
        if not delta or not params.stop or len(state.token_ids) <= params.min_tokens:
            return False
        match = _find_stop(state.text, len(delta), params)
        if match is None:
            return False
        stop, cut = match
        state.text = state.text[:cut]
        state.finish_reason = "stop"
        state.stop_reason = stop
        return True

    def _position(self, entry: TokenLogprobs, detokenize: bool) -> dict[int, Logprob]:
        """{token: Logprob} for one position: the actual token first, then the top-k."""
        def text(token_id: int) -> str | None:
            if self.tokenizer is None or not detokenize:
                return None
            return self.tokenizer.token_string(token_id)

        out = {entry.token_id: Logprob(entry.logprob, entry.rank or None, text(entry.token_id))}
        for rank, (token_id, lp) in enumerate(entry.top.items(), start=1):
            if token_id not in out:
                out[token_id] = Logprob(lp, rank, text(token_id))
        return out

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finish_reason is not None
        params = state.params
        kind = params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = len(state.text) if finished else len(state.text) - params.output_text_buffer_length
        visible = max(visible, state.sent_text_len)
        logprobs: SampleLogprobs | None = None
        prompt_logprobs = state.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            text = state.text[state.sent_text_len : visible]
            token_ids = state.token_ids[state.sent_tokens :]
            if params.logprobs is not None:
                logprobs = state.logprobs[state.sent_tokens :]
            if state.sent_prompt_logprobs:
                prompt_logprobs = None
            state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
            state.sent_text_len = visible
            state.sent_tokens = len(state.token_ids)
        else:
            text = state.text[:visible]
            token_ids = list(state.token_ids)
            if params.logprobs is not None:
                logprobs = list(state.logprobs)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            # As vLLM: only known when logprobs were asked for.
            cumulative_logprob=state.cumulative_logprob if params.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def abort(self, request_id: str) -> EngineOutput | None:
        """Finish a request (or all of a parent's samples) as aborted."""
        if request_id in self.pooling:
            aborted = EngineCoreOutput(request_id, [], [], [], finish_reason="abort", pooled=[])
            return self._pooled(aborted, time.monotonic())
        parent = self.parents.pop(request_id, None)
        if parent is None:
            state = self.states.pop(request_id, None)
            if state is None:
                return None
            state.finish_reason = "abort"
            state.metrics.finished_time = time.monotonic()
            return self._make_output(state)
        now = time.monotonic()
        for child_id in parent.child_ids:
            state = self.states.pop(child_id, None)
            if state is None:
                continue
            state.finish_reason = "abort"
            state.metrics.finished_time = now
            output = self._make_output(state)
            if output is not None:
                parent.add_child_output(child_id, output, now)
        return parent.make_output()
