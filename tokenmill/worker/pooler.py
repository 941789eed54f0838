"""Pooling: one vector per pooling request from the last hidden states (after
the final norm), as sentence-transformers pools them.

A pooling request's prompt may run in several chunks (chunked prefill), so the
pooler reads its rows a chunk at a time and keeps what it needs between steps:

    LAST  the last prompt row, in the chunk that ends the prompt
    CLS   the row at position 0, in the first chunk
    MEAN  every row: a float32 sum and a count, divided at the end

The state is reset when the request is (re)admitted: a preempted request runs
its prompt again from the start (MEAN and CLS take no prefix hits, so every row
is computed; LAST reads only the last). Then the vector is cut to the request's
`dimensions` (Matryoshka) and L2-normalised where asked.

A cross-encoder (PoolerConfig.num_labels: BERT / XLM-R *ForSequenceClassification)
pools CLS and runs that row through the model's classifier (`classify`), then
the config's activation (sigmoid for one label, as vLLM) unless the request's
use_activation is False.

A yes/no reranker (PoolerConfig.classifier_token_ids, vLLM's hf_overrides for
Qwen3-Reranker) pools its LAST row into one value instead: the 2-way softmax's
positive probability, sigmoid(logit[yes] - logit[no]), from the two head rows
alone (no vocabulary-wide GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import PoolerConfig
from tokenmill.core.contracts import ScheduledRequest


@dataclass
class _Partial:
    total: torch.Tensor | None = None  # MEAN: the rows' float32 sum [hidden]; CLS: the first row
    num_rows: int = 0


class Pooler:
    def __init__(self, config: PoolerConfig, classifier_head: torch.Tensor | None = None,
                 logit_softcap: float | None = None,
                 classify: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`classifier_head`: a yes/no reranker's [2, hidden] float32 head rows
        (negative, positive); `logit_softcap`: the model's final logit softcapping;
        `classify`: a cross-encoder's classifier, CLS row -> float32 logits."""
        if (config.classifier_token_ids is None) != (classifier_head is None):
            raise ValueError("a yes/no reranker's pooler needs its two head rows, and only it")
        if (config.num_labels > 0) != (classify is not None):
            raise ValueError("a cross-encoder's pooler needs its classifier, and only it")
        self.classify_row = classify
        self.config = config
        self.classifier_head = classifier_head
        self.logit_softcap = logit_softcap
        self.partial: dict[str, _Partial] = {}

    def rows(self, r: ScheduledRequest, first_row: int) -> list[int]:
        """The rows of this step's batch the pooling of `r` reads (ascending):
        `first_row` is its chunk's first row in the batch."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            return list(range(first_row, first_row + r.num_tokens))
        if kind == "CLS":
            return [first_row] if r.num_computed_tokens == 0 else []
        return [first_row + r.num_tokens - 1] if r.do_pool else []

    def add(self, r: ScheduledRequest, hidden: torch.Tensor) -> list[float] | None:
        """Take in `hidden` ([len(rows(r)), hidden_size]); the pooled vector once
        the chunk that ends the prompt is in, else None."""
        if r.prompt_token_ids is not None or r.request_id not in self.partial:  # (re)admitted
            self.partial[r.request_id] = _Partial()
        part = self.partial[r.request_id]
        kind = self.config.pooling_type
        if kind == "MEAN":
            chunk_sum = hidden.float().sum(dim=0)
            part.total = chunk_sum if part.total is None else part.total + chunk_sum
            part.num_rows += hidden.shape[0]
        elif kind == "CLS" and hidden.shape[0]:
            part.total = hidden[0].float()
        if not r.do_pool:
            return None
        del self.partial[r.request_id]
        if kind == "LAST":
            vector = hidden[-1].float()
            if self.classifier_head is not None:
                return [self.classify(vector)]
        else:
            assert part.total is not None, f"{r.request_id}: pooled before its rows ran"
            vector = part.total / part.num_rows if kind == "MEAN" else part.total
        if self.classify_row is not None:
            return self.scores(self.classify_row(vector), r)
        return self.finish(vector, r)

    def scores(self, logits: torch.Tensor, r: ScheduledRequest) -> list[float]:
        """A cross-encoder's logits through its activation, unless the request's
        use_activation is False."""
        assert r.pooling_params is not None
        activation = self.config.activation if r.pooling_params.use_activation is not False else "identity"
        if activation == "sigmoid":
            logits = torch.sigmoid(logits)
        elif activation == "softmax":
            logits = torch.softmax(logits, dim=-1)
        return logits.tolist()

    def classify(self, last: torch.Tensor) -> float:
        """sigmoid(logit[positive] - logit[negative]) of the last row: the yes/no
        softmax's positive probability."""
        assert self.classifier_head is not None
        logits = self.classifier_head @ last
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return float(torch.sigmoid(logits[1] - logits[0]))

    def finish(self, vector: torch.Tensor, r: ScheduledRequest) -> list[float]:
        """Matryoshka truncation, then normalisation (the request's, else the model's)."""
        params = r.pooling_params
        assert params is not None
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = params.normalize
        if normalize is None:  # (vLLM's use_activation is an embedding's normalisation)
            normalize = self.config.normalize if params.use_activation is None else params.use_activation
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    def forget(self, request_id: str) -> None:
        self.partial.pop(request_id, None)
