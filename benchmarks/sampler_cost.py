"""Per-step sampling cost of a batch with mixed options (greedy, temperature, top-k/p, min-p, penalties, bias, seeds, logprobs) beside all-greedy and all-plain: OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/sampler_cost.py [--batch 256] [--device cpu]."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.request_state import CachedRequestState
from tokenmill.worker.sampler import Sampler

VOCAB = 49152
EOS = (2,)


def mixed_params(i: int) -> SamplingParams:
    kind = i % 8
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=i),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.1, logprobs=5),
        SamplingParams(temperature=1.0, logit_bias={17: 5.0, 42: -100.0}, min_tokens=100, max_tokens=None,
                       seed=i, logprobs=1),
    ][kind]


def make_states(batch: int, params_fn: object, device: torch.device,
                prompt_len: int, output_len: int) -> list[CachedRequestState]:
    g = torch.Generator().manual_seed(0)
    states = []
    for i in range(batch):
        params = params_fn(i)  # type: ignore[operator]
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist()
        state = CachedRequestState.create(str(i), prompt, params, VOCAB, device)
        for t in torch.randint(3, VOCAB, (output_len,), generator=g).tolist():
            state.append_output(t)
        states.append(state)
    return states


def time_steps(sampler: Sampler, states: list[CachedRequestState], device: torch.device,
               steps: int) -> float:
    """Median seconds per step (logits generation excluded)."""
    times = []
    for step in range(steps + 2):
        logits = torch.randn(len(states), VOCAB, device=device) * 3
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler(logits, states, EOS)  # returns Python lists: includes the device sync
        elapsed = time.perf_counter() - start
        if step >= 2:  # warm-up
            times.append(elapsed)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split(":")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sampler = Sampler(device)
    print(f"batch {args.batch}, vocab {VOCAB}, device {device}, torch threads "
          f"{torch.get_num_threads()}")
    cases = {
        "all greedy": lambda i: SamplingParams(temperature=0.0),
        "all temperature 0.8": lambda i: SamplingParams(temperature=0.8),
        "mixed options": mixed_params,
    }
    with torch.inference_mode():
        for name, fn in cases.items():
            states = make_states(args.batch, fn, device, args.prompt_len, args.output_len)
            seconds = time_steps(sampler, states, device, args.steps)
            print(f"{name:>22}: {seconds * 1e3:8.2f} ms/step "
                  f"({seconds * 1e6 / args.batch:7.1f} us/request)")


if __name__ == "__main__":
    main()
