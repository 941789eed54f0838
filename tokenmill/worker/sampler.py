"""Turn logits into tokens, for the whole batch at once.

Greedy rows (temperature 0) take the argmax of the raw logits. Sampled rows
are scaled by their temperature, filtered by top-k / top-p / min-p, and drawn
with the exponential-race trick (argmax of p / q, q ~ Exp(1)), which equals a
categorical draw and lets each seeded request use its own generator, so its
tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests' own

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    def __call__(
        self,
        logits: torch.Tensor,  # [num_rows, vocab] float32
        params: list[SamplingParams],
        request_ids: list[str],
    ) -> tuple[list[int], list[float], list[dict[int, float] | None]]:
        logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab], raw distribution
        greedy_ids = logits.argmax(dim=-1)  # [num_rows]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        token_ids = greedy_ids
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            drawn = self._sample(logits[rows], [params[i] for i in sampled_rows],
                                 [request_ids[i] for i in sampled_rows])
            token_ids = greedy_ids.clone()
            token_ids[rows] = drawn
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [num_rows]

        top: list[dict[int, float] | None] = [None] * len(params)
        max_top = max((p.logprobs or 0) for p in params)
        if max_top > 0:
            top_vals, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top]
            vals, ids = top_vals.tolist(), top_ids.tolist()
            for i, p in enumerate(params):
                if p.logprobs:
                    top[i] = dict(zip(ids[i][: p.logprobs], vals[i][: p.logprobs], strict=True))
        return token_ids.tolist(), chosen.tolist(), top

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]
    ) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        x = logits / temperature[:, None]  # [rows, vocab]
        vocab = x.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_x, sorted_idx = x.sort(dim=-1, descending=True)  # [rows, vocab]
            ks = torch.tensor(top_k, device=device)
            mask = torch.arange(vocab, device=device)[None, :] >= ks[:, None]
            probs = torch.softmax(sorted_x.masked_fill(mask, float("-inf")), dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            cum_before = probs.cumsum(dim=-1) - probs
            mask |= cum_before >= torch.tensor(top_p, device=device)[:, None]
            sorted_x = sorted_x.masked_fill(mask, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(1, sorted_idx, sorted_x)
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        q = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            q[unseeded] = torch.empty(
                (len(unseeded), vocab), device=device
            ).exponential_(generator=self.default_generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                q[i].exponential_(generator=self._generator(request_ids[i], p.seed))
        return (probs / q).argmax(dim=-1)
