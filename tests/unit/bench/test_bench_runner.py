"""`make bench` and `make bench-smoke`'s runner: a GPU-only benchmark skips with one line on a
machine without CUDA, any other failure (an exception or a SystemExit) is reported and fails
the run, and a smoke run writes its results into a temporary directory, never over
bench/results/; a smoke run's independent children start together (`at_once`)."""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest
import torch

from bench import run_all
from moe_rl_testing.bench_common import RESULTS_DIR, RESULTS_ENV, at_once, write_results


def _module(monkeypatch, name: str, main, **attrs) -> None:
    mod = types.ModuleType(f"bench.cpu.bench_{name}")
    mod.main = main
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    found = run_all.modules()
    monkeypatch.setattr(run_all, "modules", lambda: {**found, name: mod.__name__})


def test_the_runner_finds_the_cpu_benchmarks_then_the_device_ones():
    found = run_all.modules()
    assert found["objectives"] == "bench.cpu.bench_objectives" and found["gpu"] == "bench.device.bench_gpu"
    names = list(found)
    assert names.index("vs_eager") < names.index("gpu")  # (every CPU one before the first device one)
    assert not {"run_all", "common", "long_tail_base", "tool_demo", "math_verify_compare"} & set(names)


def test_a_result_file_names_the_machine_the_versions_and_the_date(tmp_path):
    from importlib import metadata

    md = write_results("fake_header", {"x": 1}, "| a |\n", results_dir=tmp_path).read_text()
    lines = md.splitlines()
    assert lines[0] == "# fake_header" and lines[2].startswith(f"Machine: {os.cpu_count()} CPUs, ")
    assert f"torch {metadata.version('torch')}" in lines[3] and lines[3].startswith("Versions: moe_rl ")
    assert f"megatron-core {metadata.version('megatron-core')}" in lines[3]
    assert lines[4].startswith("Date: 20") and lines[6] == "| a |"


def test_a_gpu_benchmark_skips_in_one_line_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    _module(monkeypatch, "fake_gpu", lambda quick=False: ran.append(quick), NEEDS_CUDA=True)
    assert run_all._run_one("fake_gpu", quick=True) and ran == []
    assert "== bench fake_gpu skipped: needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("error", [RuntimeError("boom"), SystemExit("needs something")])
def test_a_failing_benchmark_is_reported_and_the_others_still_run(monkeypatch, capsys, error):
    def fail(quick=False):
        raise error

    _module(monkeypatch, "fake_fail", fail)
    assert not run_all._run_one("fake_fail", quick=True)
    assert f"!! bench fake_fail failed: {type(error).__name__}" in capsys.readouterr().err


def test_a_smoke_run_writes_into_a_temporary_directory(monkeypatch, tmp_path):
    written = []
    _module(monkeypatch, "fake_ok", lambda quick=False: written.append(write_results("fake_ok", {}, "| a |")))
    monkeypatch.setattr(run_all, "available", lambda: ["fake_ok"])
    monkeypatch.setattr(sys, "argv", ["run_all", "--quick", "fake_ok"])
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert run_all.main() == 0
    assert len(written) == 1 and written[0].parent != RESULTS_DIR and not written[0].exists()  # (the temp dir is gone)
    monkeypatch.setattr(sys, "argv", ["run_all", "--quick", "--results", str(tmp_path), "fake_ok"])
    assert run_all.main() == 0 and (tmp_path / "fake_ok.md").read_text().startswith("# fake_ok")
    assert os.environ.get(RESULTS_ENV) is None  # (the runner leaves the environment as it found it)


def test_at_once_runs_the_calls_together_and_in_turn_when_disabled():
    # Together: each call waits at a barrier for the other (in turn, the first would time out).
    both = threading.Barrier(2, timeout=60)
    assert at_once({"a": lambda: both.wait() * 0 + 1, "b": lambda: both.wait() * 0 + 2}) == {"a": 1, "b": 2}
    order: list[str] = []
    got = at_once({"b": lambda: order.append("b") or threading.get_ident(),
                   "a": lambda: order.append("a") or threading.get_ident()}, enabled=False)
    assert order == ["b", "a"] and list(got) == ["b", "a"] and set(got.values()) == {threading.get_ident()}


def test_at_once_raises_a_calls_exception_after_the_others_finish():
    done: list[str] = []

    def fail():
        raise RuntimeError("child failed")

    with pytest.raises(RuntimeError, match="child failed"):
        at_once({"fail": fail, "ok": lambda: done.append("ok")})
    assert done == ["ok"]
