"""AsyncEngine: LLMEngine's step loop in a background thread, for asyncio callers.

    event loop (server)                      engine thread
    -------------------                      -------------
    add_request() --- _Add ----> inbox ----> drain at a step boundary:
      awaits acceptance <-- ACCEPTED/error --   engine.add_request()
    abort()  ------- _Abort ---> inbox ----> engine.abort_request()
                                              engine.schedule()
    stats() <------------------------------- scheduler state published
                                              engine.execute()
    async for out in stream <-- deltas ------ call_soon_threadsafe(stream.push)

The event loop never waits on the engine: commands go through a thread-safe
queue and outputs come back through `loop.call_soon_threadsafe`, so /health
answers while a long prefill runs (torch releases the GIL inside its kernels).
A thread and not a process: outputs need no pickling, and on a 2-core machine
a second process would only add copies while competing for the same cores.

A step that raises fails the requests in flight (their streams raise
EngineError), frees their blocks, and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenmill.core.contracts import SchedulerOutput
from tokenmill.core.scheduler import SchedulerStats
from tokenmill.engine.client import EngineFacts, PromptType
from tokenmill.engine.iteration_stats import FinishedRequestStats, IterationStats
from tokenmill.engine.live_view import LiveView, take_snapshot
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from tokenmill.sampling_params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger("tokenmill")

StatLogger = Callable[[IterationStats], None]
T = TypeVar("T", RequestOutput, PoolingRequestOutput)


class EngineError(RuntimeError):
    """The engine failed while running a request (an internal fault, not the
    caller's): the request was aborted; the engine keeps serving others."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or broken beyond recovery)."""


_ACCEPTED = object()  # first item on a stream once engine.add_request() accepted the request
_Item = object  # a RequestOutput (PoolingRequestOutput), an exception to raise, or _ACCEPTED


class _Stream:
    """One request's outputs, written by the engine thread, read by the event
    loop (one reader): a deque and the reader's future while it waits. Not an
    asyncio.Queue: its bookkeeping runs on the event loop for every token, and
    on 2 cores the loop's CPU a token is the step's (docs/perf-notes.md)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.items: collections.deque[_Item] = collections.deque()
        self.waiter: asyncio.Future[_Item] | None = None

    def put(self, item: _Item) -> None:  # engine thread
        # The event loop may be gone (server shutting down); nobody is listening then.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item: _Item) -> None:  # event loop
        waiter = self.waiter
        if waiter is not None and not waiter.done():  # (done: its reader was cancelled)
            self.waiter = None
            waiter.set_result(item)
        else:
            self.items.append(item)

    async def get(self) -> _Item:  # event loop
        if self.items:
            return self.items.popleft()
        self.waiter = self.loop.create_future()
        try:
            return await self.waiter
        finally:
            self.waiter = None


def _put_all(items: list[tuple[_Stream, _Item]]) -> None:  # event loop
    for stream, item in items:
        stream.push(item)


def _deliver(items: list[tuple[_Stream, _Item]]) -> None:  # engine thread
    """A step's outputs to their event loops: one hand-off per loop a step, not
    one per request (each hand-off is a wake-up and a callback on the loop)."""
    if len(items) == 1:
        items[0][0].put(items[0][1])
        return
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Item]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, batch)


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    arrival_time: float
    stream: _Stream
    lora_request: LoRARequest | None = None


@dataclass
class _LoRA:
    """Load (a LoRARequest) or unload (an id) an adapter at a step boundary."""

    what: LoRARequest | int
    done: Future[bool]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Fail:
    error: BaseException


@dataclass
class _Tracker:
    """Per-request timing, for IterationStats (engine thread only)."""

    arrival_time: float
    num_prompt_tokens: int = 0
    n: int = 1
    max_tokens: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


@dataclass
class _Loop:
    streams: dict[str, _Stream] = field(default_factory=dict)
    trackers: dict[str, _Tracker] = field(default_factory=dict)


class AsyncEngine:
    """`engine` is an LLMEngine, or a function that builds one: then it is built
    on the engine thread itself (as `tokenmill serve` does), so that thread is
    the only one that ever runs OpenMP parallel regions: GNU OpenMP keeps a
    worker pool per thread that starts regions, and two pools on few cores
    make every region wait for a worker to wake (docs/perf-notes.md)."""

    def __init__(
        self, engine: LLMEngine | Callable[[], LLMEngine], idle_poll_s: float = 0.5
    ) -> None:
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.Queue[_Add | _Abort | _Fail | _Stop | _LoRA] = queue.Queue()
        self._lock = threading.Lock()
        self._num_pending = 0  # adds in the inbox, not yet in the scheduler
        self._stat_loggers: list[StatLogger] = []
        # The dashboard's feed (engine/live_view.py): snapshots only while subscribed.
        self.live_view = LiveView()
        self._dead_reason: str | None = None
        self._state = _Loop()  # engine thread only
        built = threading.Event()
        failure: list[BaseException] = []

        def build_and_run() -> None:
            try:
                self.engine = engine if isinstance(engine, LLMEngine) else engine()
                self._stats: SchedulerStats = self.engine.stats()
            except BaseException as e:  # raised again by the constructor
                failure.append(e)
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=build_and_run, name="tokenmill-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]

    # ---- information (any thread) ---------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self.engine.facts

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead_reason is None and self._thread.is_alive()

    def check_health(self) -> None:
        """Raise RuntimeError saying why when this engine cannot serve."""
        if not self.is_running:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        failed = self.engine.parallel_failure()
        if failed:
            raise RuntimeError(f"the tensor-parallel group stopped: {failed}")

    def stats(self) -> SchedulerStats:
        """The scheduler's state as of the last step boundary."""
        return self._stats

    def num_waiting_requests(self) -> int:
        """Requests not running yet: in the inbox or in the scheduler's waiting queue."""
        with self._lock:
            return self._num_pending + self._stats.num_waiting

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Called in the engine thread after every iteration; must be quick."""
        self._stat_loggers.append(stat_logger)

    # ---- tokenizer (pure functions of the tokenizer; safe from the event loop) -------

    def _tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this engine runs without a tokenizer; send token ids")
        return self.engine.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        return self._tokenizer().apply_chat_template(
            messages, add_generation_prompt, chat_template, tools, chat_template_kwargs
        )

    def chat_template_source(
        self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None
    ) -> str | None:
        return self._tokenizer().chat_template_source(chat_template, tools)

    # ---- requests (event loop) ----------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request (on `lora_request`'s adapter, where given); returns
        its stream of RequestOutput deltas once the engine has taken it. Raises ValueError (the caller's fault, with what to
        do) if the engine refuses it, EngineDeadError if the loop is down.

        Closing the stream before it finishes (or cancelling its consumer)
        aborts the request once the stream has been iterated; a stream never
        iterated must be aborted with abort(request_id) (an async generator that
        has not started runs nothing when closed). Its blocks are freed at the
        next step boundary."""
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = await self._submit(request_id, prompt, params, priority, lora_request)
        return self._iterate(stream, RequestOutput)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter on the engine thread (ValueError saying why one
        cannot be served)."""
        return await self._lora_command(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (its running requests finish on it); False if not loaded."""
        return await self._lora_command(lora_int_id)

    async def _lora_command(self, what: LoRARequest | int) -> bool:
        if not self.is_running:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        done: Future[bool] = Future()
        self._inbox.put(_LoRA(what, done))
        return await asyncio.wrap_future(done)

    async def add_pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (an embedding): as add_request, but its stream
        yields one PoolingRequestOutput, when its prompt has run."""
        stream = await self._submit(request_id, prompt, params, priority)
        return self._iterate(stream, PoolingRequestOutput)

    async def _submit(self, request_id: str, prompt: PromptType,
                      params: SamplingParams | PoolingParams, priority: int,
                      lora_request: LoRARequest | None = None) -> _Stream:
        """Hand a request to the engine thread; its stream once it is accepted."""
        if not self.is_running:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        stream = _Stream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._num_pending += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, time.monotonic(), stream,
                             lora_request))
        try:
            first = await stream.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            raise first
        assert first is _ACCEPTED, first
        return stream

    async def _iterate(self, stream: _Stream, kind: type[T]) -> AsyncGenerator[T, None]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                assert isinstance(item, RequestOutput | PoolingRequestOutput)
                # An aborted pooling request has no vector to give (shutdown): it ends so.
                if not isinstance(item, kind) or (
                        isinstance(item, PoolingRequestOutput) and not item.outputs.data):
                    finished = True
                    raise EngineDeadError("the request was aborted")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); it applies at the next step boundary."""
        self._inbox.put(_Abort(request_id))

    def fail_requests(self, error: BaseException) -> None:
        """Abort every request in flight and end its stream with `error` (any
        thread); it applies at the next step boundary."""
        self._inbox.put(_Fail(error))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what runs and stop the loop."""
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout_s)
        if self._dead_reason is None:
            self._dead_reason = "the engine was shut down"

    # ---- the loop (engine thread) ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._iteration():
                    break
        except BaseException as e:  # a bug in the loop itself: never die silently
            logger.exception("the engine loop crashed")
            self._dead_reason = f"the engine loop crashed ({type(e).__name__})"
            self._fail_all(EngineDeadError("the engine loop crashed; restart the server"))
            return
        self._abort_all()
        self._dead_reason = "the engine was shut down"

    def _drain(self) -> list[_Add | _Abort | _Fail | _Stop | _LoRA]:
        commands: list[_Add | _Abort | _Fail | _Stop | _LoRA] = []
        if not self.engine.has_unfinished_requests():
            try:  # idle: sleep until a command comes
                commands.append(self._inbox.get(timeout=self.idle_poll_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _iteration(self) -> bool:
        """One step boundary and one step; False once told to stop."""
        commands = self._drain()
        num_adds = 0
        stop = False
        stats = IterationStats(scheduler_stats=self._stats)
        for command in commands:
            if isinstance(command, _Add):
                num_adds += 1
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, stats)
            elif isinstance(command, _Fail):
                self._fail_all(command.error)
            elif isinstance(command, _LoRA):
                self._lora(command)
            else:
                stop = True
        if commands:  # (else nothing changed since the last step's stats)
            self._stats = self.engine.stats()
        with self._lock:
            self._num_pending -= num_adds
        if stop:
            return False
        if self.engine.has_unfinished_requests():
            self._step(stats)
        elif self.live_view.watched:
            self._watch(None)  # idle: the view shows an empty batch
        stats.scheduler_stats = self._stats = self.engine.stats()
        self._log(stats)
        return True

    def _lora(self, command: _LoRA) -> None:
        try:
            what = command.what
            done = (self.engine.remove_lora(what) if isinstance(what, int)
                    else self.engine.add_lora(what))
        except Exception as e:  # (a ValueError for a bad adapter: the caller's to report)
            command.done.set_exception(e)
        else:
            command.done.set_result(done)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params,
                arrival_time=command.arrival_time, priority=command.priority,
                lora_request=command.lora_request,
            )
        except ValueError as e:
            command.stream.put(e)
            return
        except Exception:
            logger.exception("adding request %s failed", command.request_id)
            command.stream.put(EngineError("internal error while adding the request"))
            return
        state = self._state
        state.streams[command.request_id] = command.stream
        num_prompt = 0
        prompt = command.prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            num_prompt = len(prompt["prompt_token_ids"])
        params = command.params
        state.trackers[command.request_id] = _Tracker(command.arrival_time, num_prompt) if isinstance(
            params, PoolingParams) else _Tracker(command.arrival_time, num_prompt, n=params.n,
                                                 max_tokens=params.max_tokens)
        command.stream.put(_ACCEPTED)

    def _abort(self, request_id: str, stats: IterationStats) -> None:
        stream = self._state.streams.pop(request_id, None)
        tracker = self._state.trackers.pop(request_id, None)
        if stream is None:
            return  # finished already, or never accepted
        outputs = self.engine.abort_request([request_id])
        for out in outputs:
            stream.put(out)
        if not outputs:
            stream.put(_aborted_output(request_id))
        if tracker is not None:
            stats.finished.append(_finished(tracker, "abort", time.monotonic()))

    def _step(self, stats: IterationStats) -> None:
        state = self._state
        start = time.monotonic()
        try:
            scheduled = self.engine.schedule()
            # Published before the model runs: a long step shows its requests as running.
            self._stats = self.engine.stats()
            if self.live_view.watched:  # (unwatched, this read is all the view costs)
                self._watch(scheduled.scheduler_output)
            result = self.engine.execute(scheduled)
        except Exception:
            logger.exception(
                "an engine step failed; failing the %d requests in flight", len(state.streams)
            )
            self._fail_all(EngineError("internal error in the engine; the request was aborted"))
            return
        now = time.monotonic()
        deliveries: list[tuple[_Stream, _Item]] = []
        stats.num_scheduled_tokens = result.stats.num_scheduled_tokens
        for request_id in result.stats.first_scheduled_req_ids:
            tracker = state.trackers.get(request_id)
            if tracker is not None and tracker.first_scheduled_time is None:
                tracker.first_scheduled_time = start
                stats.queue_times_s.append(start - tracker.arrival_time)
        for out in result.outputs:
            stream = state.streams.get(out.request_id)
            tracker = state.trackers.get(out.request_id)
            if stream is None or tracker is None:
                continue
            if isinstance(out, PoolingRequestOutput):
                self._pooled(out, tracker, stats, now)
                deliveries.append((stream, out))
                continue
            num_new = sum(len(c.token_ids) for c in out.outputs)
            if num_new:
                if tracker.last_token_time is None:
                    stats.time_to_first_tokens_s.append(now - tracker.arrival_time)
                    tracker.first_token_time = now
                    tracker.num_prompt_tokens = len(out.prompt_token_ids)
                    tracker.num_cached_tokens = out.num_cached_tokens
                    stats.num_prompt_tokens += tracker.num_prompt_tokens
                    stats.num_cached_prompt_tokens += out.num_cached_tokens
                else:
                    stats.inter_token_latencies_s.append(now - tracker.last_token_time)
                tracker.last_token_time = now
                tracker.num_generation_tokens += num_new
                stats.num_generation_tokens += num_new
            if out.finished:
                reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
                stats.finished.append(_finished(tracker, reason, now))
                del state.streams[out.request_id], state.trackers[out.request_id]
            deliveries.append((stream, out))
        if deliveries:
            _deliver(deliveries)
        if self.live_view.watched:
            self.live_view.note_step(
                scheduled.scheduler_output, now - start, len(stats.finished),
                stats.time_to_first_tokens_s, stats.inter_token_latencies_s,
            )

    def _pooled(self, out: PoolingRequestOutput, tracker: _Tracker, stats: IterationStats,
                now: float) -> None:
        """A pooling request is done: its prompt counts, it generated nothing."""
        stats.num_prompt_tokens += len(out.prompt_token_ids)
        stats.num_cached_prompt_tokens += out.num_cached_tokens
        tracker.num_prompt_tokens = len(out.prompt_token_ids)
        tracker.num_cached_tokens = out.num_cached_tokens
        stats.finished.append(_finished(tracker, "stop", now))
        del self._state.streams[out.request_id], self._state.trackers[out.request_id]

    def _watch(self, scheduler_output: SchedulerOutput | None) -> None:
        """Feed the live view (only called while someone watches): preemptions
        always, a snapshot of the step about to run when one is due. A fault here
        is logged and never fails the step."""
        live = self.live_view
        now = time.monotonic()
        try:
            if scheduler_output is not None and scheduler_output.preempted_req_ids:
                live.note_preemptions(scheduler_output.preempted_req_ids, now)
            if live.due(now):
                live.publish(take_snapshot(self.engine.scheduler, scheduler_output, now,
                                           self.engine.facts.cache.cache_dtype), now)
        except Exception:
            logger.exception("the live view's snapshot failed")

    def _fail_all(self, error: BaseException) -> None:
        state = self._state
        request_ids = list(state.streams)
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("could not abort the failed requests; the engine is broken")
            self._dead_reason = "the engine could not recover from an internal error"
        for request_id in request_ids:
            state.streams.pop(request_id).put(error)
            state.trackers.pop(request_id, None)
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _abort_all(self) -> None:
        stats = IterationStats(scheduler_stats=self._stats)
        for request_id in list(self._state.streams):
            self._abort(request_id, stats)
        # Commands that came after the stop: refuse the adds.
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                command.stream.put(EngineDeadError("the engine is shutting down"))
            elif isinstance(command, _LoRA):
                command.done.set_exception(EngineDeadError("the engine is shutting down"))
        self._stats = self.engine.stats()

    def _log(self, stats: IterationStats) -> None:
        for stat_logger in self._stat_loggers:
            try:
                stat_logger(stats)
            except Exception:
                logger.exception("a stat logger failed")


def _finished(tracker: _Tracker, reason: str, now: float) -> FinishedRequestStats:
    scheduled, first, last = tracker.first_scheduled_time, tracker.first_token_time, tracker.last_token_time
    decode_s = last - first if first is not None and last is not None else 0.0
    return FinishedRequestStats(
        finish_reason=reason,
        e2e_latency_s=now - tracker.arrival_time,
        num_prompt_tokens=tracker.num_prompt_tokens,
        num_generation_tokens=tracker.num_generation_tokens,
        num_cached_tokens=tracker.num_cached_tokens,
        prefill_time_s=first - scheduled if first is not None and scheduled is not None else 0.0,
        decode_time_s=decode_s,
        inference_time_s=last - scheduled if last is not None and scheduled is not None else 0.0,
        mean_time_per_output_token_s=(
            decode_s / (tracker.num_generation_tokens - 1) if tracker.num_generation_tokens > 1 else 0.0
        ),
        n=tracker.n,
        max_tokens=tracker.max_tokens,
    )


def _aborted_output(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
        finished=True,
    )
