"""The roofline report: its arithmetic on known numbers, the JSON round trip
that `bench all --report-only` relies on, and the ceilings measured for real."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench import roofline


def test_table_and_json_round_trip(tmp_path: Path) -> None:
    ceilings = roofline.Ceilings(bandwidth_gb_s=40.0, copy_bandwidth_gb_s=36.0,
                                 matmul_gflop_s={64: 270.0, 128: 320.0})
    rows = [roofline.RooflineRow(batch=128, context=264, dtype="bfloat16", step_ms=170.0,
                                 roofline_ms=113.0, ratio=170.0 / 113.0, bound="compute",
                                 bytes_mb=1050.0, gflop=36.2, no_overlap_ms=136.0,
                                 no_overlap_ratio=170.0 / 136.0)]
    path = tmp_path / "roofline-bfloat16.json"
    path.write_text(json.dumps({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}))
    loaded_ceilings, loaded_rows = roofline.load_results(path)  # JSON turns int keys to str
    assert loaded_ceilings == ceilings and loaded_rows == rows
    table = roofline.format_table(loaded_ceilings, loaded_rows)
    assert "read bandwidth 40.0 GB/s" in table and "batch 128: 320" in table
    assert ("| 128 | 264 | bfloat16 | 170.0 | 113.0 | 1.50x | compute | 1050 | 36.2 | "
            "136.0 (1.20x roofline) | 1.25x |") in table
    # A file from before the no-overlap bound was reported: its rows still load and print.
    old = asdict(rows[0])
    del old["no_overlap_ms"], old["no_overlap_ratio"]
    path.write_text(json.dumps({"ceilings": asdict(ceilings), "rows": [old]}))
    table = roofline.format_table(*roofline.load_results(path))
    assert "| 1050 | 36.2 | - | - |" in table


def test_no_overlap_bound() -> None:
    # Projections then attention, each at its ceiling: 1 GB of weights at 10 GB/s (0.1 s)
    # under 2 TFLOP at 10 TFLOP/s (0.2 s), then 3 GB of K/V at 10 GB/s (0.3 s) over
    # 0.1 TFLOP (0.01 s): 0.5 s, where the roofline, max(4 GB / 10, 2.1 T / 10 T), is 0.4 s.
    s = roofline.no_overlap_s(1e9, 3e9, 2e12, 1e11, 10.0, 10_000.0)
    assert abs(s - 0.5) < 1e-12
    # Memory-bound projections (a batch of one): the weights' time, not the FLOPs'.
    assert abs(roofline.no_overlap_s(1e9, 0.0, 1e9, 0.0, 10.0, 10_000.0) - 0.1) < 1e-12
    # The same numbers as a row: a step of 0.6 s is 1.5x the roofline, 1.2x the bound.
    row = roofline.make_row(128, 264, "float32", 0.6, 1e9, 3e9, 2e12, 1e11, 10.0, 10_000.0)
    assert row.bound == "memory" and abs(row.roofline_ms - 400.0) < 1e-9
    assert abs(row.ratio - 1.5) < 1e-12 and abs(row.no_overlap_ms - 500.0) < 1e-9
    assert abs(row.no_overlap_ratio - 1.2) < 1e-12
    assert row.bytes_mb == 4000.0 and abs(row.gflop - 2100.0) < 1e-9


def test_measured_ceilings_are_plausible() -> None:
    small = 1 << 24  # 16 MiB: fast, still a real measurement
    read = roofline.measure_read_bandwidth(small, repeats=2)
    copy = roofline.measure_bandwidth(small, repeats=2)
    assert 0.5 < read < 2000 and 0.5 < copy < 2000  # GB/s
    import torch

    from tokenmill.backends.cpu import kernels

    for dtype in (torch.float32, torch.bfloat16):
        rate = kernels.best_matmul_rate([(64, 128)], 8, dtype, repeats=3)
        # a lower bound only of "measured something": on a loaded machine a 131 kFLOP call took 16 ms
        assert 0.0 < rate < 1e5  # GFLOP/s
