"""What one engine step costs, as a function of what the scheduler put in it.

A step is described by its shape (StepShape, read off a SchedulerOutput): the
tokens it computes, the rows that sample, and the K/V it reads. Two kinds of
model turn a shape into seconds:

- "fitted" (calibrate.py, timed on this machine through the real engine):
      t = PWL(num_tokens) + per_sampled_row_s * num_sampled_rows
          + per_output_row_s * rows that give out a token (detokenized, output built)
          + per_kv_byte_s * K/V bytes the decode rows read
          + per_prefill_pair_s * (query, key) pairs of the prefill chunks' attention
  PWL is piecewise linear between values at fixed knots (a CPU step costs
  about the same per token once the matmuls are wide enough, much more per
  token below that), extrapolated from its last segment; every value and
  coefficient is fitted non-negative, to relative error.
- "roofline" (what-if for another machine, from bench/roofline.py's two
  ceilings): projections then attention, each at max(bytes / bandwidth,
  FLOPs / matmul rate), plus the sampled rows' LM head, plus a fixed per-step
  overhead (the Python around the forward, taken from a fitted model if given).

Serving adds to that (`calibrate --serve`, measured against `tokenmill serve`):
the engine thread shares the cores and the GIL with the server's event loop,
which streams every token, so a served step costs `serve_step_overhead_s +
serve_per_row_s * rows` more than an offline one, and a request reaches the
engine `serve_arrival_delay_s` after it was sent (HTTP, parsing, the inbox).

No torch here, and numpy only to fit: the simulator runs where torch is not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.core.contracts import SchedulerOutput

DEFAULT_KNOTS = (1, 8, 32, 128, 512, 2048)


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # tokens computed (prefill chunks + decodes)
    num_rows: int  # requests in the step
    num_sampled_rows: int  # rows whose last token's logits are sampled (the LM head runs on them)
    num_kv_reads: int  # context tokens the decode (one-token) rows attend to
    # Prefill chunks (rows of more than one token): over their tokens, the
    # positions each attends to. Their attention is arithmetic on K/V read once
    # per chunk; a decode row's is a read of its whole context per token.
    num_prefill_pairs: int = 0
    # Rows whose request gave out tokens: the engine detokenizes them and builds
    # their outputs (a static batch's padding members sample but give out nothing).
    num_output_rows: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput, num_output_rows: int | None = None) -> StepShape:
        """The shape of `out`; `num_output_rows` (known after the step) defaults to
        the rows that sample."""
        reads = pairs = 0
        for s in out.scheduled:
            n, c = s.num_tokens, s.num_computed_tokens
            if n == 1:
                reads += c + 1
            else:
                pairs += n * c + n * (n + 1) // 2  # token i (1-based) attends to c + i positions
        return cls(num_tokens=out.num_scheduled_tokens, num_rows=len(out.scheduled),
                   # (a request verifying drafts samples each draft's row too)
                   num_sampled_rows=sum(1 + s.num_draft_tokens
                                        for s in out.scheduled if s.do_sample),
                   num_kv_reads=reads, num_prefill_pairs=pairs,
                   num_output_rows=(sum(1 for s in out.scheduled if s.do_sample)
                                    if num_output_rows is None else num_output_rows))


@dataclass(frozen=True)
class ModelShape:
    """What the cost of a step depends on in the model (from LLM.model_info())."""

    num_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    element_bytes: int  # 2 for bfloat16, 4 for float32
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> ModelShape:
        element = {"bfloat16": 2, "float16": 2, "float32": 4}[info["dtype"]]
        return cls(num_params=info["num_params"], num_layers=info["num_layers"],
                   num_heads=info["num_heads"], num_kv_heads=info["num_kv_heads"],
                   head_dim=info["head_dim"], hidden_size=info["hidden_size"],
                   vocab_size=info["vocab_size"], element_bytes=element,
                   max_model_len=info["max_model_len"])


@dataclass
class CostModel:
    kind: str  # "fitted" or "roofline"
    model: ModelShape
    # fitted
    knots: list[int] = field(default_factory=lambda: list(DEFAULT_KNOTS))
    knot_values_s: list[float] = field(default_factory=list)  # PWL(num_tokens) at each knot
    per_sampled_row_s: float = 0.0
    per_output_row_s: float = 0.0
    per_kv_byte_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    # roofline
    bandwidth_gb_s: float = 0.0
    matmul_gflop_s: float = 0.0
    overhead_s: float = 0.0  # per step, outside the forward
    # serving (calibrate --serve; zero until measured)
    serve_step_overhead_s: float = 0.0
    serve_per_row_s: float = 0.0
    serve_arrival_delay_s: float = 0.0
    # how it was made: machine, command, fit error over the calibration steps
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("fitted", "roofline"):
            raise ValueError(f"cost model kind must be 'fitted' or 'roofline', got {self.kind!r}")
        if self.kind == "fitted" and len(self.knot_values_s) != len(self.knots):
            raise ValueError("a fitted cost model needs one value per knot")
        if self.kind == "roofline" and (self.bandwidth_gb_s <= 0 or self.matmul_gflop_s <= 0):
            raise ValueError("a roofline cost model needs bandwidth_gb_s > 0 and matmul_gflop_s > 0")

    def step_s(self, shape: StepShape) -> float:
        if self.kind == "fitted":
            return (pwl(shape.num_tokens, self.knots, self.knot_values_s)
                    + self.per_sampled_row_s * shape.num_sampled_rows
                    + self.per_output_row_s * shape.num_output_rows
                    + self.per_kv_byte_s * shape.num_kv_reads * self.model.kv_bytes_per_token
                    + self.per_prefill_pair_s * shape.num_prefill_pairs)
        return self._roofline_s(shape)

    def serve_extra_s(self, shape: StepShape) -> float:
        """What serving adds to a step of this shape (module docstring)."""
        return self.serve_step_overhead_s + self.serve_per_row_s * shape.num_rows

    def _roofline_s(self, shape: StepShape) -> float:
        m = self.model
        bw, rate = self.bandwidth_gb_s * 1e9, self.matmul_gflop_s * 1e9
        head_params = m.vocab_size * m.hidden_size
        body_params = max(m.num_params - head_params, 0)  # (the embedding is a lookup)
        proj = max(body_params * m.element_bytes / bw, 2.0 * body_params * shape.num_tokens / rate)
        # (a prefill chunk reads its K/V once, small beside its arithmetic: left out)
        kv_bytes = shape.num_kv_reads * m.kv_bytes_per_token
        attn_flop = (4.0 * (shape.num_kv_reads + shape.num_prefill_pairs)
                     * m.num_heads * m.head_dim * m.num_layers)
        attn = max(kv_bytes / bw, attn_flop / rate)
        head = 0.0
        if shape.num_sampled_rows:
            head = max(head_params * m.element_bytes / bw,
                       2.0 * head_params * shape.num_sampled_rows / rate)
        return self.overhead_s + proj + attn + head

    # ---- files -----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        data = dict(data)
        data["model"] = ModelShape(**data["model"])
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"no cost model at {p}; make one with `tokenmill simulate calibrate --output {p}`")
        return cls.from_json(json.loads(p.read_text()))


def pwl(x: float, knots: Sequence[int], values: Sequence[float]) -> float:
    """Linear between (knots[i], values[i]); the end segments extended past the ends."""
    i = 1
    while i < len(knots) - 1 and x > knots[i]:
        i += 1
    x0, x1 = knots[i - 1], knots[i]
    y0, y1 = values[i - 1], values[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def pwl_basis(x: float, knots: Sequence[int]) -> list[float]:
    """The weights w with pwl(x, knots, v) == sum(w[i] * v[i]) for every v."""
    return [pwl(x, knots, [1.0 if j == i else 0.0 for j in range(len(knots))])
            for i in range(len(knots))]


def features(shape: StepShape, model: ModelShape, knots: Sequence[int]) -> list[float]:
    """One row of the fit: the PWL basis, sampled rows, K/V bytes read, prefill
    pairs, output rows."""
    return [*pwl_basis(shape.num_tokens, knots), float(shape.num_sampled_rows),
            float(shape.num_kv_reads * model.kv_bytes_per_token), float(shape.num_prefill_pairs),
            float(shape.num_output_rows)]


def fit(shapes: Sequence[StepShape], seconds: Sequence[float], model: ModelShape,
        knots: Sequence[int] = DEFAULT_KNOTS, provenance: dict[str, Any] | None = None) -> CostModel:
    """Fit a "fitted" CostModel to timed steps: non-negative least squares on the
    relative error (every row divided by its time, so a 5 ms step counts as much
    as a 500 ms one)."""
    import numpy as np

    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit needs one time per step shape, and at least one")
    a = np.array([features(s, model, knots) for s in shapes], dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls((a / scale) / t[:, None], np.ones_like(t)) / scale
    k = len(knots)
    cm = CostModel(kind="fitted", model=model, knots=list(knots),
                   knot_values_s=[float(v) for v in coef[:k]],
                   per_sampled_row_s=float(coef[k]), per_kv_byte_s=float(coef[k + 1]),
                   per_prefill_pair_s=float(coef[k + 2]), per_output_row_s=float(coef[k + 3]),
                   provenance=dict(provenance or {}))
    errors = np.abs(np.array([cm.step_s(s) for s in shapes]) / t - 1.0)
    cm.provenance.update(num_steps=len(shapes), median_rel_error=float(np.median(errors)),
                         p90_rel_error=float(np.percentile(errors, 90)))
    return cm


def nnls(a: Any, b: Any, max_iter: int = 500) -> Any:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set method)."""
    import numpy as np

    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= 1e-12:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def from_roofline(model: ModelShape, bandwidth_gb_s: float, matmul_gflop_s: float,
                  overhead_s: float = 0.0, provenance: dict[str, Any] | None = None) -> CostModel:
    """The cost model of a machine with these ceilings (bench/roofline.py measures them)."""
    return CostModel(kind="roofline", model=model, knots=[], knot_values_s=[],
                     bandwidth_gb_s=bandwidth_gb_s, matmul_gflop_s=matmul_gflop_s,
                     overhead_s=overhead_s, provenance=dict(provenance or {}))
