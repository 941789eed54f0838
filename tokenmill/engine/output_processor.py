"""Per-request output state: detokenization, stop strings, RequestOutput building.

Stop strings: the text is searched only where a match could newly end, cut
exactly where the match starts (or after it with include_stop_str_in_output),
and while a request runs the last len(longest stop) - 1 characters are held
back, so a stop string split over several tokens never leaks into a delta.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.core.contracts import EngineCoreOutput
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_text_len: int = 0  # for DELTA outputs: what earlier outputs already carried
    sent_tokens: int = 0

    @property
    def stop_buffer_len(self) -> int:
        if not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.params.stop) - 1


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

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        self.states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detok,
            metrics=RequestMetrics(arrival_time=arrival_time),
        )

    def process(
        self, core_outputs: list[EngineCoreOutput], now: float | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out and the ids of requests a stop string
        finished (the scheduler must be told)."""
        now = time.monotonic() if now is None else now
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            if state.finish_reason is None and self._apply(state, core, now):
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
            if output is not None:
                results.append(output)
        return results, stopped_by_string

    def _apply(self, state: RequestState, core: EngineCoreOutput, now: float) -> bool:
        """Fold in new tokens; True when a stop string finished the request."""
        if core.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        state.num_cached_tokens = core.num_cached_tokens
        state.token_ids.extend(core.new_token_ids)
        for token_id, lp, top in zip(
            core.new_token_ids, core.new_logprobs, core.new_top_logprobs, strict=True
        ):
            state.cumulative_logprob += lp
            if state.params.logprobs is not None:
                entry = {token_id: lp}
                if top:
                    entry.update(top)
                state.logprobs.append(entry)
        if state.detokenizer is None:
            return False
        delta = state.detokenizer.add_tokens(core.new_token_ids, final=core.finished)
        state.text += delta
        if not delta or not state.params.stop:
            return False
        match = _find_stop(state.text, len(delta), state.params)
        if match is None:
            return False
        stop, cut = match
        state.text = state.text[:cut]
        state.finish_reason = "stop"
        state.stop_reason = stop
        return True

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finish_reason is not None
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = len(state.text) if finished else len(state.text) - state.stop_buffer_len
        visible = max(visible, state.sent_text_len)
        if kind is RequestOutputKind.DELTA:
            text = state.text[state.sent_text_len : visible]
            token_ids = state.token_ids[state.sent_tokens :]
            logprobs = state.logprobs[state.sent_tokens :] if state.params.logprobs is not None else None
            state.sent_text_len = visible
            state.sent_tokens = len(state.token_ids)
        else:
            text = state.text[:visible]
            token_ids = list(state.token_ids)
            logprobs = list(state.logprobs) if state.params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
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
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.finish_reason = "abort"
        state.metrics.finished_time = time.monotonic()
        return self._make_output(state)
