"""Where tests, benchmarks and their shared helpers live (tests/README.md, bench/README.md), read
from the files with `ast` (nothing imported): every test module in a tier folder under a unique
name; unit modules start no torchrun; no sys.path edits; `moe_rl` never imports
`moe_rl_testing`, which imports neither tests/ nor bench/; bench/ never imports tests/, and
tests/ imports bench/ only to test it; every benchmark `make bench` runs takes `quick`, a
device one says it needs CUDA, and bench/README.md names every benchmark file."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from moe_rl_testing import ROOT

TESTS, BENCH, SHARED = ROOT / "tests", ROOT / "bench", ROOT / "moe_rl_testing"
TIERS = ("unit", "integration")
SYS_PATH_EDITS = {
    # the worker counts another checkout's learner (`--baseline-tree`): that tree's moe_rl first
    "bench/cpu/bench_host_overhead.py",
    # runs `python tools/SCRIPT.py` lines in one process: the script's folder first, as python does
    "moe_rl_testing/workers/doc_commands_worker.py",
    # the child script it starts imports a reward module the test writes to its tmp folder
    "tests/integration/tasks/test_reward_timeout.py",
}
UNIT_FORBIDDEN = ("moe_rl_testing.dist_helpers", "moe_rl_testing.async_runs", "moe_rl_testing.plan_jobs",
                  "moe_rl_testing.in_process")
"""What starts torchrun worlds, whole runs or programs: integration tests' helpers."""


def py_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_test_module_is_in_a_tier_under_a_unique_name():
    modules = [p for p in py_files(TESTS) if p.name.startswith("test_")]
    outside = [rel(p) for p in modules if p.relative_to(TESTS).parts[0] not in TIERS]
    assert not outside, f"{outside}: move each into tests/unit/ or tests/integration/ (tests/README.md, 'Where a test goes')"
    names = Counter(p.name for p in modules)
    assert not [n for n, k in names.items() if k > 1], "test module names must be unique across tests/"
    assert len(modules) > 80  # (the walk sees the suite)


def test_only_tests_and_conftest_live_in_tests():
    helpers = [rel(p) for p in py_files(TESTS) if not p.name.startswith("test_")
               and p.name not in ("conftest.py", "__init__.py")]
    assert not helpers, f"{helpers}: helpers go to moe_rl_testing/ (tests/README.md, 'Helpers')"
    folders = {p.parent for p in py_files(TESTS)}
    missing = [rel(f) for f in folders if not (f / "__init__.py").is_file()]
    assert not missing, f"{missing}: add an empty __init__.py"


def test_unit_modules_start_no_torchrun_and_no_program():
    for path in py_files(TESTS / "unit"):
        if path == Path(__file__):
            continue
        names = imported(path)
        bad = [m for m in UNIT_FORBIDDEN if m in names or any(n.startswith(m + ".") for n in names)]
        assert not bad, f"{rel(path)} imports {bad}: it belongs in tests/integration/"
        text = path.read_text()
        assert "mark.multiproc" not in text and "torch.distributed.run" not in text, \
            f"{rel(path)} launches torchrun: it belongs in tests/integration/"


def test_nothing_edits_sys_path():
    pattern = re.compile(r"\bsys\.path\.(insert|append|extend)\(|\bsys\.path\s*=")
    edits = {rel(p) for folder in (TESTS, BENCH, SHARED) for p in py_files(folder)
             if pattern.search(p.read_text())} - {rel(Path(__file__))}
    assert edits == SYS_PATH_EDITS, f"sys.path edited in {sorted(edits - SYS_PATH_EDITS)}: import from moe_rl_testing"


def test_tests_and_benchmarks_share_helpers_only_through_moe_rl_testing():
    def reaches(path: Path, top: str) -> bool:
        return any(n == top or n.startswith(top + ".") for n in imported(path))

    package = [rel(p) for p in py_files(ROOT / "moe_rl") if reaches(p, "moe_rl_testing")]
    assert not package, f"{package}: the package never imports its test helpers"
    shared = [rel(p) for p in py_files(SHARED) if reaches(p, "tests") or reaches(p, "bench")]
    assert not shared, f"{shared}: moe_rl_testing imports neither tests/ nor bench/"
    bench = [rel(p) for p in py_files(BENCH) if reaches(p, "tests")]
    assert not bench, f"{bench}: a benchmark imports helpers from moe_rl_testing, not from tests/"
    tests = [rel(p) for p in py_files(TESTS) if reaches(p, "bench") and p.parent.name != "bench"]
    assert not tests, f"{tests}: only tests/<tier>/bench/ (the benchmarks' own tests) import bench"


def test_setup_installs_the_shared_package():
    assert '"moe_rl_testing", "moe_rl_testing.*"' in (ROOT / "setup.py").read_text()


def test_every_benchmark_takes_quick_and_a_device_one_needs_cuda():
    for kind in ("cpu", "device"):
        for path in sorted((BENCH / kind).glob("bench_*.py")):
            tree = ast.parse(path.read_text())
            main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
            assert main is not None and "quick" in [a.arg for a in main.args.args], \
                f"{rel(path)}: `make bench` calls main(quick=...)"
            needs_cuda = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "NEEDS_CUDA" for t in n.targets)
                             for n in tree.body)
            assert needs_cuda == (kind == "device"), f"{rel(path)}: NEEDS_CUDA = True exactly in bench/device/"


def test_the_bench_readme_names_every_benchmark_file():
    readme = (BENCH / "README.md").read_text()
    files = [p for p in py_files(BENCH) if p.name != "__init__.py" and p.parent != BENCH]
    missing = [rel(p) for p in files if rel(p).removeprefix("bench/") not in readme]
    assert not missing, f"bench/README.md does not describe {missing}"
    assert len(files) >= 25
