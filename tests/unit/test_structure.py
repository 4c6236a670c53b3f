"""The package's dependency rules and size limits, read from the source with `ast` (no
imports, so this runs in `make test-fast` in well under a second).

- megatron.core is imported only under moe_rl/learner/, vllm only under moe_rl/sampler/;
- the engine-free libraries (objectives/, advantages.py, routing/, diagnostics/metrics.py,
  diagnostics/report.py) import neither the learner nor the sampler, not even through
  another moe_rl module;
- nothing under moe_rl/ imports the RL program but the two entry points that run it;
- no import cycle among moe_rl modules, lazy (function-level) imports included;
- the config package is a leaf: it imports nothing of moe_rl but LEAF_UTILITIES;
- no function in moe_rl/ is longer than MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from moe_rl_testing import ROOT

PKG = ROOT / "moe_rl"
MAX_FUNCTION_LINES = 80
ENGINE_FREE = ["moe_rl.objectives", "moe_rl.advantages", "moe_rl.routing", "moe_rl.diagnostics.metrics",
               "moe_rl.diagnostics.report"]
TRAINER_RUNNERS = {"moe_rl.train", "moe_rl.demo"}  # the CLIs whose job is to run the RL program
LEAF_UTILITIES = {"moe_rl.runtime.atomic", "moe_rl.runtime.registry"}  # import nothing of moe_rl themselves


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
    assert "moe_rl.learner.engine" in closure("moe_rl.programs.rl.learner_role")
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


def test_nothing_imports_the_rl_program():
    importers = {m for m in MODULES if "moe_rl.programs.rl" in imports(m) and not under(m, "moe_rl.programs.rl")}
    assert importers <= TRAINER_RUNNERS, importers - TRAINER_RUNNERS


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports made absolute."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def import_edges(module: str) -> dict[str, int]:
    """{moe_rl module `module` imports: line of the first such import}, at any depth of its
    code. `from pkg import name` is an edge to pkg.name when that is a module, else to pkg.
    A package's __init__ running before its submodules is not an edge: only what the code
    names is, so a package that imports its own submodules is not a cycle by itself."""
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != module:
                edges.setdefault(target, node.lineno)
    return edges


def import_cycles() -> list[list[str]]:
    """Each strongly connected group of modules (Tarjan), as one cycle through it: a list of
    modules whose last imports the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in import_edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a group: pop it off the stack
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for m in sorted(MODULES):
        if m not in index:
            visit(m)
    return [_cycle_in(g) for g in groups]


def _cycle_in(group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first inside the group)."""
    start = min(group)
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop(0)
        for w in import_edges(m):
            if w == start:
                return paths[m]
            if w in group and w not in paths:
                paths[w] = [*paths[m], w]
                todo.append(w)
    raise AssertionError(f"no cycle through {start}")


def describe_cycle(cycle: list[str]) -> str:
    """`a (line 3) -> b (line 10) -> a`: each module and the line of its import of the next."""
    hops = [f"{m}:{import_edges(m)[nxt]}" for m, nxt in zip(cycle, [*cycle[1:], cycle[0]], strict=True)]
    return " -> ".join(hops) + f" -> {cycle[0]}"


def test_the_cycle_finder_finds_a_lazy_cycle(monkeypatch):
    fake = {"moe_rl.a": "from moe_rl.b import x\n", "moe_rl.b": "def f():\n    import moe_rl.a\n"}
    monkeypatch.setattr(f"{__name__}.MODULES", {**MODULES, **{m: _Source(t) for m, t in fake.items()}})
    import_edges.cache_clear()
    try:
        cycles = [c for c in import_cycles() if set(c) & set(fake)]
        assert [describe_cycle(c) for c in cycles] == ["moe_rl.a:1 -> moe_rl.b:2 -> moe_rl.a"]
    finally:
        import_edges.cache_clear()


class _Source:
    """A stand-in for a module's Path in MODULES (read_text and name are all that is used)."""

    name = "fake.py"

    def __init__(self, text: str) -> None:
        self.text = text

    def read_text(self) -> str:
        return self.text


def test_no_import_cycles():
    cycles = [describe_cycle(c) for c in import_cycles()]
    assert not cycles, "import cycles (module:line of the import of the next):\n" + "\n".join(cycles)


def test_the_config_package_is_a_leaf():
    outside = {m: sorted(d for d in import_edges(m) if not under(d, "moe_rl.config") and d not in LEAF_UTILITIES)
               for m in MODULES if under(m, "moe_rl.config")}
    assert not {m: v for m, v in outside.items() if v}
    for leaf in LEAF_UTILITIES:
        assert not import_edges(leaf), f"{leaf} is meant to import nothing of moe_rl"


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


def test_the_rollout_reaches_neither_a_program_nor_the_learner():
    """The rollout package samples, scores and packs; the weight transport that sees the
    learner lives above it (`moe_rl.weights`), and what a program (PPO) needs of a step's
    rows comes through the rows, not through an import of the program."""
    for m in (m for m in MODULES if under(m, "moe_rl.rollout")):
        bad = sorted(d for d in closure(m) if under(d, "moe_rl.learner") or under(d, "moe_rl.programs")
                     or under(d, "moe_rl.weights"))
        assert not bad, f"{m} reaches {bad}"


def test_the_loop_knows_no_program():
    """The one run loop drives programs through `Program`; it imports none of them."""
    for m in (m for m in MODULES if under(m, "moe_rl.loop")):
        bad = sorted(d for d in closure(m) if under(d, "moe_rl.programs") or under(d, "moe_rl.learner"))
        assert not bad, f"{m} reaches {bad}"


def test_no_program_compares_advantage_names():
    """PPO is a registered component: which estimator needs a critic is the advantage
    registry's word (`RLConfig.uses_critic`), never a comparison with the name `gae`."""
    import re

    pattern = re.compile(r"""(==|!=)\s*["']gae["']|["']gae["']\s*(==|!=)""")
    offenders = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


MAX_MODULE_LINES = 500
REPO = PKG.parent
OUTSIDE_REFERENCES = re.compile(r"\.\./shared|\bshared/(DESIGN|OBJECTIVES|seeds)|\bseeds?/\d{3}|\bseed 00\d\b|"
                                r"DESIGN\.md|OBJECTIVES\.md|\bDESIGN in\b")
HISTORY = re.compile(r"\b[Ii]ssues? #?\d+|\(#\d+\)|\b20\d\d-\d\d-\d\d\b|\bround[ -]\d\b")
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "ablations" / "README.md",
             REPO / "docs" / "mismatch" / "README.md", REPO / "CONTRIBUTING.md"]
"""The user's pages. Generated reports (REPORT.md, STRESS.md, SWEEP.md), pre-registered plans
(a dated record by design) and lab notes (docs/notes/) keep their dates."""


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(REPO)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (a module that long holds two ideas): {long}"


def _help_lines() -> list[str]:
    """`make help`'s lines (the Makefile's echo lines under the help target)."""
    text = (REPO / "Makefile").read_text()
    block = text.split("\nhelp:\n", 1)[1].split("\n\n", 1)[0]
    return [ln for ln in block.splitlines() if "@echo" in ln]


@pytest.mark.parametrize("pattern", [OUTSIDE_REFERENCES, HISTORY], ids=["outside-references", "history"])
def test_the_package_and_its_docs_are_self_contained(pattern):
    """Nothing in moe_rl/, `make help` or the user's docs points outside the repository
    (design documents, seeds) or to the project's history (issue numbers, dates, rounds):
    the formulas live in docs/objectives.md, history in git, lab notes in docs/notes/."""
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in [*MODULES.values(), *USER_DOCS]
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    offenders += [f"make help: {ln.strip()}" for ln in _help_lines() if pattern.search(ln)]
    assert not offenders, offenders


def test_loggers_are_named_after_their_modules():
    named = [f"{p.relative_to(REPO)}" for p in MODULES.values()
             if re.search(r"""^log(ger)? = logging\.getLogger\(["']""", p.read_text(), re.M)]
    assert not named, f"use logging.getLogger(__name__): {named}"


def test_no_two_public_functions_share_a_name():
    """A name says what a function is: two public module-level functions with one name (two
    `check_recipe`s) make a reader guess which one a call means. The exceptions are the
    interfaces a folder's modules share by convention (an entry point's `main` and `run`, a
    megatron patch's `apply`) and the registries' entries (an objective and an advantage
    estimator may share a method's name: `grpo`)."""
    allowed = {"main", "run", "apply", "grpo", "dr_grpo"}
    seen: dict[str, list[str]] = {}
    for m, path in MODULES.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(m)
    shared = {name: where for name, where in seen.items() if len(where) > 1 and name not in allowed}
    assert not shared, shared


# The modules that may see the whole recipe: the entry point and its checks, the program
# interface's check hook and the programs' factories, and the tools that read a whole
# recipe (the planner, the mismatch tool, the export). Every other component is built from
# the sections it reads and explicit values, as the learner is.
ROOT_CONFIG_MODULES = {
    "moe_rl.cli",                          # loads the recipe, runs the program's check
    "moe_rl.preflight",                    # the checks that span the whole run
    "moe_rl.loop.program",                 # Program.check: the one hook for a program's checks
    "moe_rl.programs.rl",                  # the RL program's factory
    "moe_rl.programs.rl.learner_role",     # its check and build
    "moe_rl.programs.sft",                 # the SFT program's check and factory
    "moe_rl.programs.preference.program",  # DPO's and the reward model's check and factory
    "moe_rl.plan.planner",                 # plans a whole recipe
    "moe_rl.mismatch.sources",             # scores a recipe's learner against its samplers
    "moe_rl.convert.hf_export",            # exports a run from its saved recipe
}
ROOT_CONFIG_NAMES = {"cfg"}  # megatron's own `config` parameters are not ours


def _takes_root_config(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = fn.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        if re.search(r"(?<![\w.])Config\b", note) or (arg.arg in ROOT_CONFIG_NAMES and not note):
            return True
    return False


def root_config_takers() -> set[str]:
    """Modules outside config/ with a function taking the root `Config` (by its annotation,
    in a Callable or a container too, or an unannotated parameter named like it)."""
    found = set()
    for module, path in MODULES.items():
        if under(module, "moe_rl.config"):
            continue
        tree = ast.parse(path.read_text())
        fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        fields = [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                  and re.search(r"(?<![\w.])Config\b", ast.unparse(n.annotation))]
        if fields or any(_takes_root_config(fn) for fn in fns):
            found.add(module)
    return found


def test_the_root_config_reaches_only_entry_points_checks_and_factories():
    found = root_config_takers()
    extra = sorted(found - ROOT_CONFIG_MODULES)
    assert not extra, ("these modules take the whole Config; build them from the sections they read "
                       f"(or list a new entry point here): {extra}")
    # (the reader sees the ones that do: the list shrinks when one stops, it never rots)
    assert found == ROOT_CONFIG_MODULES, f"no longer take the root config: {sorted(ROOT_CONFIG_MODULES - found)}"
    assert len(ROOT_CONFIG_MODULES) <= 10


def test_the_type_checker_exempts_no_module_of_the_package():
    """mypy.ini (what `make lint` runs after ruff) checks every module of moe_rl: no
    `ignore_errors` anywhere, no section for a moe_rl module, and missing imports ignored only
    for third-party packages, each named (no global `ignore_missing_imports`)."""
    import configparser

    ini = configparser.ConfigParser()
    ini.read(REPO / "mypy.ini")
    assert ini["mypy"]["files"].split(",") == ["moe_rl"] and ini["mypy"].getboolean("check_untyped_defs")
    assert "ignore_missing_imports" not in ini["mypy"] and "ignore_errors" not in ini["mypy"]
    for section in ini.sections():
        patterns = [p.strip() for p in section.removeprefix("mypy-").split(",")]
        assert section == "mypy" or not any(p.split(".")[0] in ("moe_rl", "*") for p in patterns), section
        assert not ini[section].getboolean("ignore_errors", fallback=False), section
    make_lint = (REPO / "Makefile").read_text().split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check" in make_lint and make_lint.index("ruff check") < make_lint.index("mypy")
