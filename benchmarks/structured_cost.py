"""The cost of structured outputs in a decode step: B rows each constrained by its own JSON schema vs the same step unconstrained, on the runner's forward (the C++ plan in bf16), alternating: PYTHONPATH=. .venv/bin/python benchmarks/structured_cost.py [--batch 64] [--ctx 264] [--steps 40]."""

# A step here is what ModelRunner.execute does for a decode-only batch: forward,
# logits, (the grammar masks: fill + apply), sampling, (each matcher advanced by
# its row's token). The matchers walk through a valid instance of their schema
# token by token (reset when it ends), so the masks are filled in every kind of
# grammar state (keys, strings, numbers, enums, between values).

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.worker.grammar import RequestGrammar
from tokenmill.worker.request_state import CachedRequestState


def schema_and_instance(i: int) -> tuple[dict, dict]:
    """A schema of its own for row i, and a valid instance of it."""
    colors = ["red", "green", "blue", "amber", "teal"][: 2 + i % 4]
    schema = {
        "type": "object",
        "properties": {
            f"id_{i}": {"type": "integer", "minimum": 0, "maximum": 10 * (i + 1)},
            "name": {"type": "string", "maxLength": 12 + i % 5},
            "color": {"enum": colors},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "size": {"type": "number"},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                        "code": {"type": "string",
                                                                 "pattern": "^[A-Z]{3}[0-9]{2}$"}},
                      "required": ["ok"]},
        },
        "required": [f"id_{i}", "name", "color"],
    }
    instance = {f"id_{i}": i, "name": f"item {i}", "color": colors[i % len(colors)],
                "tags": ["alpha", f"t{i}"], "size": 3.25 + i,
                "inner": {"ok": i % 2 == 0, "code": f"ABC{i % 100:02d}"}}
    return schema, instance


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split(":")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=264, help="context length of every row")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each kind")
    args = parser.parse_args()
    batch, ctx = args.batch, args.ctx

    llm = LLM(None, dtype="bfloat16", quantization="none", max_num_seqs=256, apply_process_settings=False)
    engine = llm.engine
    runner = engine.runner
    model = runner.forward
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    vocab = engine.spec.vocab_size

    # Paged metadata for B decode rows of context ctx (random K/V), as decode_step.py.
    bs = runner.block_size
    nb = -(-ctx // bs)
    assert batch * nb <= runner.num_blocks, (batch * nb, runner.num_blocks)
    bt = torch.arange(batch * nb).reshape(batch, nb)
    seq = torch.full((batch,), ctx, dtype=torch.int64)
    pos = seq - 1
    slot = bt[torch.arange(batch), pos // bs] * bs + pos % bs
    meta = AttentionMetadata(num_decodes=batch, query_start_loc=list(range(batch + 1)),
                             seq_lens=[ctx] * batch, max_decode_seq_len=ctx, slot_mapping=slot,
                             block_tables=bt, decode_seq_lens=seq, block_size=bs)
    ids = torch.randint(100, 40000, (batch,))
    for cache in runner.kv_caches:
        cache[:, : batch * nb].normal_()

    # Each row: its own compiled schema, a matcher, and the tokens of a valid instance.
    compiler = engine.grammar_compiler()
    grammars: list[RequestGrammar] = []
    walks: list[list[int]] = []
    start = time.perf_counter()
    for i in range(batch):
        schema, instance = schema_and_instance(i)
        compiled = compiler.compile(StructuredOutputsParams(json=schema)).result()
        grammars.append(RequestGrammar(compiled))
        walks.append([*tokenizer.encode(json.dumps(instance), add_special_tokens=False),
                      engine.eos_token_ids[0]])
    print(f"compiled {batch} schemas in {time.perf_counter() - start:.2f} s")
    params = SamplingParams(temperature=0, max_tokens=None)
    states = [CachedRequestState.create(str(i), [1], params, vocab, runner.device)
              for i in range(batch)]
    position = [0] * batch

    mask = runner.grammar_mask
    mask_thread = ThreadPoolExecutor(max_workers=1)

    def advance() -> None:
        """Each matcher advanced by its walk's next token (as append_output does)."""
        for i, g in enumerate(grammars):
            g.accept(walks[i][position[i]])
            position[i] += 1
            if position[i] == len(walks[i]):
                g.matcher.reset()
                position[i] = 0

    def step(mode: str) -> float:
        """mode: "plain" (no grammar), "serial" (fill after the forward), "overlap"
        (fill on a thread during the forward, as ModelRunner.execute does)."""
        t = time.perf_counter()
        constrained = mode != "plain"
        filled = mask_thread.submit(mask.fill, list(grammars)) if mode == "overlap" else None
        logits = model.compute_logits(model(ids, pos, runner.kv_caches, meta))
        if filled is not None:
            mask.apply_filled(logits, filled.result())
        elif constrained:
            mask.apply(logits, list(grammars))
        runner.sampler(logits, states, engine.eos_token_ids)
        if constrained:
            advance()
        return time.perf_counter() - t

    modes = ("plain", "serial", "overlap")
    times: dict[str, list[float]] = {m: [] for m in modes}
    with torch.inference_mode():
        for _ in range(3):
            for mode in modes:
                step(mode)
        for _ in range(args.steps):
            for mode in modes:
                times[mode].append(step(mode))
    rejected = sum(g.num_rejected for g in grammars)
    assert rejected == 0, f"{rejected} walk tokens rejected: the benchmark's masks are wrong"
    plain = statistics.median(times["plain"])
    print(f"B={batch} L={ctx} vocab={vocab}, {torch.get_num_threads()} threads, median of "
          f"{args.steps} steps of each kind, alternating")
    print(f"  unconstrained:                         {plain * 1e3:8.2f} ms/step")
    for mode, name in (("serial", "fill after the forward"), ("overlap", "fill during the forward")):
        masked = statistics.median(times[mode])
        print(f"  every row JSON schema, {name}: {masked * 1e3:8.2f} ms/step, "
              f"ratio {masked / plain:.3f} ({(masked / plain - 1) * 100:+.1f}%)")

    # The grammar work alone, outside the forward: fill + apply, and the accepts.
    logits = torch.randn(batch, vocab)
    fill = []
    apply = []
    accept = []
    for _ in range(args.steps):
        t = time.perf_counter()
        rows = mask.fill(list(grammars))
        fill.append(time.perf_counter() - t)
        t = time.perf_counter()
        mask.apply_filled(logits, rows)
        apply.append(time.perf_counter() - t)
        t = time.perf_counter()
        advance()
        accept.append(time.perf_counter() - t)
    print(f"  alone: mask fill {statistics.median(fill) * 1e3:.2f} ms, apply "
          f"{statistics.median(apply) * 1e3:.2f} ms, accepts {statistics.median(accept) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
