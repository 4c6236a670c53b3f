"""The package's dependency rules and size limits, read from the source with `ast` (no
imports, so this runs in `make test-fast` in well under a second).

- megatron.core is imported only under moe_rl/learner/, vllm only under moe_rl/sampler/;
- the engine-free libraries (objectives/, advantages.py, routing/, diagnostics/metrics.py,
  diagnostics/report.py) import neither the learner nor the sampler, not even through
  another moe_rl module;
- nothing under moe_rl/ imports the trainer but the two programs that run it;
- no function in moe_rl/ is longer than MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "moe_rl"
MAX_FUNCTION_LINES = 80
ENGINE_FREE = ["moe_rl.objectives", "moe_rl.advantages", "moe_rl.routing", "moe_rl.diagnostics.metrics",
               "moe_rl.diagnostics.report"]
TRAINER_RUNNERS = {"moe_rl.train", "moe_rl.demo"}  # the CLIs whose job is to run it


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@cache
def imports(module: str) -> frozenset[str]:
    """Every module name `module` imports, at any depth of its code (lazy imports count)."""
    path = MODULES[module]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return frozenset(out)


def internal(names: frozenset[str]) -> set[str]:
    return {n for n in names if n in MODULES}


def closure(module: str) -> set[str]:
    """moe_rl modules reachable from `module` through imports (packages' __init__ included)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)]
        todo += [p for p in parents if p in MODULES]
        todo += list(internal(imports(m)))
    return seen - {module}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_rule_reader_sees_real_imports():
    assert "megatron.core" in {n.rsplit(".", 1)[0] for n in imports("moe_rl.learner.engine")} | imports(
        "moe_rl.learner.engine")
    assert "moe_rl.learner.engine" in closure("moe_rl.trainer")
    assert len(MODULES) > 60


@pytest.mark.parametrize(("third_party", "home"), [("megatron", "moe_rl.learner"), ("vllm", "moe_rl.sampler")])
def test_engines_are_imported_only_by_their_package(third_party, home):
    offenders = {m: sorted(n for n in imports(m) if n.split(".")[0] == third_party)
                 for m in MODULES if not under(m, home)}
    assert not {m: v for m, v in offenders.items() if v}


@pytest.mark.parametrize("library", ENGINE_FREE)
def test_engine_free_libraries_reach_neither_learner_nor_sampler(library):
    modules = [m for m in MODULES if under(m, library)]
    assert modules
    for m in modules:
        bad = sorted(d for d in closure(m) | {m} if under(d, "moe_rl.learner") or under(d, "moe_rl.sampler"))
        assert not bad, f"{m} reaches {bad}"


def test_nothing_imports_the_trainer():
    importers = {m for m in MODULES if "moe_rl.trainer" in imports(m) and m != "moe_rl.trainer"}
    assert importers <= TRAINER_RUNNERS, importers - TRAINER_RUNNERS


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)
