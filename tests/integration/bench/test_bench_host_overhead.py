"""bench/cpu/bench_host_overhead.py end to end at its quick shape: its counting worker (a
one-process torchrun of the benchmark module) and the tables it writes."""

from __future__ import annotations

import json

import pytest

from bench.cpu import bench_host_overhead as bench
from moe_rl_testing.host_overhead import SETTINGS


@pytest.mark.slow
def test_the_quick_benchmark_writes_its_tables(tmp_path):
    bench.main(quick=True, results_dir=tmp_path)  # (its own process, as `python -m bench.cpu.bench_host_overhead --quick`)
    data = json.loads((tmp_path / "host_overhead.json").read_text())
    assert set(data["current"]["results"]) == set(SETTINGS) and data["baseline"] is None
    table = (tmp_path / "host_overhead.md").read_text()
    assert "| project syncs / mb | 0 | 0 | 0 | 0 | 0 |" in table
