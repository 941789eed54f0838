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
                                 bytes_mb=1050.0, gflop=36.2)]
    path = tmp_path / "roofline-bfloat16.json"
    path.write_text(json.dumps({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}))
    loaded_ceilings, loaded_rows = roofline.load_results(path)  # JSON turns int keys to str
    assert loaded_ceilings == ceilings and loaded_rows == rows
    table = roofline.format_table(loaded_ceilings, loaded_rows)
    assert "read bandwidth 40.0 GB/s" in table and "batch 128: 320" in table
    assert "| 128 | 264 | bfloat16 | 170.0 | 113.0 | 1.50x | compute | 1050 | 36.2 |" in table


def test_measured_ceilings_are_plausible() -> None:
    small = 1 << 24  # 16 MiB: fast, still a real measurement
    read = roofline.measure_read_bandwidth(small, repeats=2)
    copy = roofline.measure_bandwidth(small, repeats=2)
    assert 0.5 < read < 2000 and 0.5 < copy < 2000  # GB/s
    import torch

    from tokenmill.model import cpu_kernels

    for dtype in (torch.float32, torch.bfloat16):
        rate = cpu_kernels.best_matmul_rate([(64, 128)], 8, dtype, repeats=2)
        assert 0.01 < rate < 1e5  # GFLOP/s
