"""Grammar-constrained sampling: one matcher per request, one mask per step.

Each constrained request's state (request_state.py) holds an xgrammar
GrammarMatcher built from its compiled grammar (engine/structured.py). The
matcher sits where the request's sampled tokens are: it is advanced only when
the runner samples a token for the request, never from scheduled token ids, so
a request recomputed after preemption (its prompt and outputs prefilled again)
resumes its grammar exactly where it was, and a chunk in the middle of a prefill
(no row sampled) leaves it untouched.

Each step, for the rows that sample:

    matchers of the constrained rows ──fill──> bitmask [rows, ceil(vocab / 32)] int32
    logits [rows, vocab] ──apply (tokens whose bit is 0 -> -inf)──> the sampler

The mask is applied before the sampler, so every stage after it (logprobs,
penalties, temperature, top-k / top-p, greedy argmax) sees the masked logits, as
in vLLM. Stop (EOS) tokens are among the allowed ones only where the grammar may
end, so a constrained request stops exactly when its output is complete.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from tokenmill.backends.cpu.kernels import CpuOps

logger = logging.getLogger("tokenmill")


class RequestGrammar:
    """One request's place in its grammar. Every sample of n > 1 has its own.

    With `reasoning_end_token_id` (a reasoning model's `</think>`), the grammar
    waits: nothing is masked and no token advances it until that token has been
    sampled; the answer after it is held to the grammar (vLLM's rule)."""

    def __init__(self, compiled: xgr.CompiledGrammar, reasoning_end_token_id: int | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_rejected = 0
        self.reasoning_end_token_id = reasoning_end_token_id
        self.thinking = reasoning_end_token_id is not None

    @property
    def active(self) -> bool:
        """False while the model thinks, and once a stop token ended the grammar
        (after that nothing is masked: only ignore_eos keeps such a request going)."""
        return not self.thinking and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token. A token the mask allowed is always
        accepted; one it did not (every allowed token banned by another option,
        such as min_tokens holding EOS back) leaves the matcher where it was."""
        if self.thinking:
            self.thinking = token_id != self.reasoning_end_token_id
            return
        if self.active and not self.matcher.accept_token(token_id):
            self.num_rejected += 1
            if self.num_rejected == 1:
                logger.warning("a constrained request sampled token %d, which its grammar "
                               "does not allow (another option banned every allowed token)",
                               token_id)


# Rows per thread below which applying the masks stays on one thread.
MIN_ROWS_PER_THREAD = 8


class GrammarMask:
    """Fills the constrained rows' bitmasks and applies them to the logits.

    On the CPU the C++ extension applies them (a word at a time, over the cores);
    without it, xgrammar's kernel (a bit at a time, most of the cost: perf-notes)
    runs with the rows split over up to `num_threads` threads (it releases the
    GIL), as the forward's threads are idle then. The fill uses as many threads."""

    def __init__(self, vocab_size: int, num_threads: int | None = None, ops: CpuOps | None = None) -> None:
        self.vocab_size = vocab_size
        self.ops = ops  # the C++ kernels where the runner uses them, else None (xgrammar's kernel)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # grown on demand
        self.num_threads = max(1, min(num_threads or torch.get_num_threads(), 8))
        self._batch = xgr.BatchGrammarMatcher(max_threads=self.num_threads)
        self._pool = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="tokenmill-mask")
                      if self.num_threads > 1 else None)

    def fill(self, grammars: list[RequestGrammar | None]) -> list[int]:
        """Fill the bitmask rows of the grammars' rows; returns those rows."""
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for i, g in enumerate(grammars):
            if g is not None and g.active:
                rows.append(i)
                matchers.append(g.matcher)
        if not rows:
            return rows
        if self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, rows)
        return rows

    def apply_filled(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits` [rows, vocab] in place with what fill() left for `rows`."""
        if not rows:
            return
        bitmask = self._bitmask[: logits.shape[0]]
        if logits.device.type != "cpu":  # (filled on the CPU; xgrammar's GPU kernel applies it)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size, indices=rows)
            return
        ops = self.ops
        if (ops is not None and logits.dtype == torch.float32 and logits.is_contiguous()
                and logits.shape[1] == self.vocab_size):
            # A word at a time over the cores: 5-6x xgrammar's CPU kernel at B=64 (perf-notes).
            ops.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
            return

        def apply(chunk: list[int]) -> None:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=chunk)

        num_chunks = min(self.num_threads, len(rows) // MIN_ROWS_PER_THREAD)
        if self._pool is None or num_chunks <= 1:
            apply(rows)
            return
        size = -(-len(rows) // num_chunks)
        chunks = [rows[k : k + size] for k in range(0, len(rows), size)]
        others = [self._pool.submit(apply, chunk) for chunk in chunks[1:]]
        apply(chunks[0])
        for done in others:
            done.result()

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """fill() then apply_filled(), on this thread."""
        self.apply_filled(logits, self.fill(grammars))
