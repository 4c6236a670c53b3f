"""Every command in a shell block of README.md and docs/**/*.md runs, in a fast form, from
the repository root with the venv's bin/ first on PATH (a shell after `source
.venv/bin/activate`), so the documentation cannot drift from the code (issue 30). One case
per command, id `file:line`. The fast forms still parse the documented arguments, so a
misspelt flag or key, or a recipe that does not exist, fails its case (FAST_FORMS):

| documented | run as |
|---|---|
| `python -m moe_rl.{train,sft,eval,dpo,reward_model} ARGS` | `... ARGS --check` (recipe, inputs, layout; nothing built) |
| `torchrun ... --nproc-per-node N -m moe_rl.train ARGS` | `python -m moe_rl.train ARGS --check --nproc N` |
| `python -m moe_rl.plan ARGS`, `python tools/{convert_checkpoint,value_ceiling,make_preference_data}.py ARGS` | as written (seconds), all in one child process (IN_ONE_CHILD) |
| `make TARGET VAR=...` | `make -n` (the target exists; `ablate-NAME` names a setting) |
| `tensorboard ...`; `source FILE` | the executable is in the venv; FILE exists |
| the programs in NOT_RUN_AS_WRITTEN | what it says instead, with the reason |
| a command of a RUN_FOR_REAL recipe | not here: tests/integration/test_hf_recipes.py runs it as written, for 2 steps |

Outputs (`--dst`, `--out`, `sft.output=`) go to a temp dir; the paths in STAND_INS stand
for the reader's own files or an earlier command's output and are replaced by tiny real
ones. Install and test commands (`make install/test/test-fast/test-integration`, `pytest`, `pip`) are not run.
A command of a program with no fast form fails: give it one in FAST_FORMS.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import sys
from pathlib import Path

import pytest

from moe_rl_testing import ROOT, forked
from moe_rl_testing.dist_helpers import WORKERS
from moe_rl_testing.doc_commands import DocCommand, doc_commands, redirect_outputs, replace_paths
from moe_rl_testing.in_process import load_tool, run_main

VENV_BIN = Path(sys.executable).parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXCEPTED_MAKE_TARGETS = {"install", "test", "test-fast", "test-integration"}
Env = tuple[tuple[str, str], ...]
# Documented placeholder -> its stand-in ({hf}, {prompts}, {plan_models}: made by `stand_ins`).
STAND_INS = {
    "DIR": "{hf}",                            # README: your Hugging Face MoE directory
    "/models/Qwen3-30B-A3B": "{hf}",          # docs/models.md: the same
    "runs/hf_rspo/hf": "{hf}",                # what a hf_rspo run exports
    "/tmp/tiny_hf": "{hf}",                   # README: what the convert command above it writes
    "runs/tiny_base": "moe_rl/assets/tiny_base",  # README: what the sft command above it writes
    # docs/ppo_dpo.md: what `make rm-demo` writes (a checkpoint of the same model; --check
    # reads where it is and what model it holds, not its value head)
    "runs/tiny_rm/checkpoints/step_000300": "moe_rl/assets/tiny_base",
    "runs/tiny_value/checkpoints/step_001500": "moe_rl/assets/tiny_base",  # what tiny_value.yaml writes
    "train.jsonl": "{prompts}", "/data/math/train.jsonl": "{prompts}", "test.jsonl": "{prompts}",
    "/tmp/plan_models": "{plan_models}",      # docs/plan.md: what the table command writes
    "/models/GLM-4.5-Air": "{plan_models}/GLM-4.5-Air",
    "RECIPE": "examples/gpu/glm45_air.yaml",
}
# Programs whose documented commands cannot run as written here: why, and what is checked.
NOT_RUN_AS_WRITTEN = {
    "sbatch": "submits to a SLURM cluster: the script parses (bash -n) and the overrides load with its recipe; "
              "tests/integration/examples/test_slurm.py runs it in a faked allocation",
    "moe_rl.plan.table": "plans every layout of 3 models at 3 GPU counts (~4 min on 2 cores): its flags "
                         "parse and its recipe loads, in-process, without the planning",
    "tools/measure_mismatch.py": "samples and scores 128 prompts x 8 (minutes): its flags and settings parse, "
                                 "in-process, without the measurement",
    "tools/gpu/stage_wheels.sh": "downloads wheels from a package registry: the script's --help runs",
    "tools/gpu/lease.sh": "installs and runs on a lent GPU machine: the script's --help runs",
    "vllm": "serves a model on CUDA GPUs: the vllm executable is in the venv",
    "moe_rl.serve": "serves until Ctrl-C: its flags parse, in-process, without serving "
                    "(tests/integration/rollout/test_agent_gateway.py serves the tool base)",
    "examples/agents/calculator_agent.py": "calls a served endpoint: the agent module loads and has `solve`",
}
# Recipes whose documented commands tests/integration/test_hf_recipes.py runs as written for 2 real steps
# (stand-ins for their paths, test-sized batches), which a --check here would only repeat.
RUN_FOR_REAL = frozenset({"examples/hf_sft.yaml", "examples/hf_dpo.yaml", "examples/hf_rm.yaml", "examples/hf_ppo.yaml"})
SLOW = ("Qwen3-235B-A22B", "GLM-4.5-Air")  # plans of the large models: 10-20 s each on 2 cores
# Programs whose documented commands run as written, every selected one of them in ONE child
# process (moe_rl_testing/workers/doc_commands_worker.py: each command's own main(argv) in turn, from
# the repository root with the venv first on PATH), not one interpreter start-up (torch,
# megatron: ~4 s) per command; the planner's meta-device builds are cached across its
# commands too. Not this process: the planner joins a fake process group, which a pytest
# process holding the session's gloo world (conftest `megatron_world`) cannot, and
# `convert_checkpoint --to megatron` starts a world of its own. The planner's commands run
# first, before any tool could leave a world behind.
IN_ONE_CHILD = ("moe_rl.plan", "tools/make_preference_data.py", "tools/convert_checkpoint.py",
                "tools/value_ceiling.py")


def _excepted(argv: tuple[str, ...]) -> bool:
    words = [w for w in argv if not w.startswith("-")]
    return (argv[0] == "make" and len(words) > 1 and words[1] in EXCEPTED_MAKE_TARGETS) or "pytest" in words \
        or argv[0] == "pip" or argv[1:3] == ("-m", "pip") or not RUN_FOR_REAL.isdisjoint(argv)


def _cases() -> list:
    cases = []
    for path in DOC_FILES:
        for cmd in doc_commands(path, ROOT):
            if not _excepted(cmd.argv):
                slow = any(s in cmd.text for s in SLOW)
                cases.append(pytest.param(cmd, id=cmd.where, marks=[pytest.mark.slow] if slow else []))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """STAND_INS made real: a random-init Qwen3-MoE directory with its own tokenizer, a
    JSONL of math prompts, the published config.json files the planner reads."""
    from moe_rl.plan.published import CONFIGS, write_config_dir
    from moe_rl_testing.hf_fixtures import make_hf_model_dir, write_math_jsonl

    tmp = tmp_path_factory.mktemp("stand_ins")
    for name in CONFIGS:
        write_config_dir(name, tmp / "plan_models" / name)
    made = {"hf": make_hf_model_dir(tmp / "hf"), "prompts": write_math_jsonl(tmp / "prompts.jsonl"),
            "plan_models": tmp / "plan_models"}
    return {doc: real.format(**made) for doc, real in STAND_INS.items()}


def _environ(env: Env = ()) -> dict[str, str]:
    return {**os.environ, **dict(env), "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(argv: list[str], env: Env = (), timeout: int = 300) -> str:
    """Run from the repository root with the venv first on PATH; fail with the output unless
    the exit status is 0. Returns stdout."""
    proc = forked.run(argv, cwd=ROOT, env=_environ(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _in_one_child(argv: tuple[str, ...], env: Env) -> None:
    """Stands in FAST_FORMS for the IN_ONE_CHILD programs: the `one_child` fixture runs them."""
    raise AssertionError("run by the one_child fixture")


@pytest.fixture(scope="module")
def one_child(request, stand_ins: dict[str, str], tmp_path_factory) -> dict[str, dict]:
    """where -> {"status", "stdout", "stderr"} of every selected command of the IN_ONE_CHILD
    programs, run as written (outputs in a directory of its own, stand-ins in place) by one
    child process; the planner's first."""
    cmds = [item.callspec.params["cmd"] for item in request.session.items
            if item.path == request.path and getattr(item, "originalname", "") == "test_documented_command_runs"
            and program(item.callspec.params["cmd"].argv) in IN_ONE_CHILD]
    cmds.sort(key=lambda c: program(c.argv) != "moe_rl.plan")  # stable: document order within each
    tmp = tmp_path_factory.mktemp("one_child")
    jobs = []
    for i, cmd in enumerate(cmds):
        (tmp / str(i)).mkdir()
        argv = replace_paths(redirect_outputs(cmd.argv, tmp / str(i)), stand_ins)
        prog = program(argv)
        jobs.append({"where": cmd.where, "program": prog, "argv": list(argv[argv.index(prog) + 1:]),
                     "env": dict(cmd.env)})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = forked.run([sys.executable, str(WORKERS / "doc_commands_worker.py"),
                           str(tmp / "jobs.json"), str(tmp / "out.json")],
                          cwd=ROOT, env=_environ(), capture_output=True, text=True, timeout=1200)
    results = json.loads((tmp / "out.json").read_text()) if (tmp / "out.json").is_file() else {}
    crashed = f"the child process exited {proc.returncode} before this command's result\n{proc.stderr[-3000:]}"
    return {job["where"]: results.get(job["where"], {"status": None, "stdout": "", "stderr": crashed})
            for job in jobs}


def _check_moe_rl(argv: tuple[str, ...], env: Env, nproc: int | None = None) -> None:
    """`python -m moe_rl.X ARGS` -> the same with --check (and --nproc for a torchrun launch),
    run in this process (`X.main`): a --check builds nothing, so the process boundary adds
    only the seconds of importing torch again."""
    extra = ["--check", *(["--nproc", str(nproc)] if nproc else [])]
    assert argv[:2] == ("python", "-m"), argv
    out = _main_in_process(importlib.import_module(argv[2]), [*argv[3:], *extra], env)
    assert " OK: " in out, out


def _main_in_process(module, argv: list[str], env: Env) -> str:
    """`module.main(argv)` from the repository root with `env` set, as its command line would
    run it (`in_process.run_main`); fails with its output unless it exits 0. Returns what it
    printed."""
    ran = run_main(module, argv, env)
    assert not ran.returncode, f"{module.__name__} {' '.join(argv)}: exit {ran.returncode}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    return ran.stdout


def _torchrun(argv: tuple[str, ...], env: Env) -> None:
    """`torchrun [opts] -m MODULE ARGS` -> MODULE's --check for the world torchrun would start."""
    m = argv.index("-m")
    opts = dict(itertools.pairwise(argv[1:m]))  # each word -> the word after it
    nproc = opts.get("--nproc-per-node") or opts.get("--nproc_per_node")
    assert nproc and nproc.isdigit(), f"torchrun without a numeric --nproc-per-node: {argv}"
    assert argv[m + 1] in ("moe_rl.train", "moe_rl.sft", "moe_rl.dpo", "moe_rl.reward_model"), f"no --check for torchrun -m {argv[m + 1]}"
    _check_moe_rl(("python", *argv[m:]), env, nproc=int(nproc))


def _make(argv: tuple[str, ...], env: Env) -> None:
    """`make TARGET VAR=...` -> a dry run (an unknown target fails); `ablate-NAME` names a setting."""
    _run(["make", "-n", *argv[1:]], env)
    from moe_rl.ablations.settings import parse_seeds, settings

    for word in argv[1:]:
        if word.startswith("ablate-"):
            assert word.removeprefix("ablate-") in settings(), f"{word}: no such setting; {list(settings())}"
        if word.startswith("SEEDS="):
            parse_seeds(word.removeprefix("SEEDS="))


def _load(path_or_module: str):
    return load_tool(path_or_module) if path_or_module.endswith(".py") else importlib.import_module(path_or_module)


def _main_without_work(module, body: str, argv: tuple[str, ...], stand_in) -> None:
    """The program's own main(argv), in this process, with `body` (the function that does
    the work once the flags are parsed) replaced by `stand_in(args) -> exit status`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, body, stand_in)
        _main_in_process(module, list(argv), ())


def _plan_table(argv: tuple[str, ...], env: Env) -> None:
    from moe_rl.config import load_recipe

    _main_without_work(_load("moe_rl.plan.table"), "_table", argv[3:],
                       lambda args: (load_recipe(args.config, []), 0)[1])


def _measure_mismatch(argv: tuple[str, ...], env: Env) -> None:
    """The rows (--settings / --sweep / --layout) parse against the shipped model's recipe,
    standing in for the documented checkpoint's (which an earlier command would have made)."""
    from moe_rl.mismatch.sources import SHIPPED_CHECKPOINT, resolve_checkpoint

    tool, recipe = _load(argv[1]), resolve_checkpoint(SHIPPED_CHECKPOINT).cfg
    _main_without_work(tool, "measure", argv[2:], lambda args: (tool.settings_from_args(args, recipe), 0)[1])


def _serve(argv: tuple[str, ...], env: Env) -> None:
    _main_without_work(_load("moe_rl.serve"), "serve_forever", argv[3:], lambda args: 0)


def _agent_module(argv: tuple[str, ...], env: Env) -> None:
    assert callable(getattr(_load(argv[1]), "solve", None)), f"{argv[1]} has no solve(problem, client, task)"


def _executable(argv: tuple[str, ...], env: Env) -> None:
    exe = VENV_BIN / argv[0]
    assert exe.is_file() and os.access(exe, os.X_OK), f"{argv[0]} is not installed in {VENV_BIN}"


def _sbatch(argv: tuple[str, ...], env: Env) -> None:
    """`sbatch [opts] SCRIPT [key=value ...]` -> SCRIPT parses and its recipe loads with the overrides."""
    from moe_rl.config import load_config

    script = next(Path(w) for w in argv if w.endswith(".sbatch"))
    _run(["bash", "-n", str(script)])
    recipe = re.search(r"examples/gpu/\w+\.yaml", (ROOT / script).read_text()).group(0)
    load_config(ROOT / recipe, [w for w in argv[argv.index(str(script)) + 1:] if "=" in w])


def _help_runs(argv: tuple[str, ...], env: Env) -> None:
    _run([argv[0], "--help"])


def _sourced_file_exists(argv: tuple[str, ...], env: Env) -> None:
    assert (ROOT / argv[1]).is_file(), f"{argv[1]} does not exist: run make install"


def program(argv: tuple[str, ...]) -> str:
    """What a documented command runs: `moe_rl.plan`, `tools/convert_checkpoint.py`, `make`, ..."""
    if argv[0] == "python":
        return argv[2] if argv[1] == "-m" else argv[1]
    return argv[0]


FAST_FORMS = {
    "moe_rl.train": _check_moe_rl, "moe_rl.sft": _check_moe_rl, "moe_rl.eval": _check_moe_rl,
    "moe_rl.dpo": _check_moe_rl, "moe_rl.reward_model": _check_moe_rl,
    **dict.fromkeys(IN_ONE_CHILD, _in_one_child),
    "torchrun": _torchrun,
    "make": _make,
    "tensorboard": _executable, "source": _sourced_file_exists,
    # NOT_RUN_AS_WRITTEN
    "moe_rl.plan.table": _plan_table, "tools/measure_mismatch.py": _measure_mismatch,
    "tools/gpu/stage_wheels.sh": _help_runs, "tools/gpu/lease.sh": _help_runs, "vllm": _executable,
    "sbatch": _sbatch, "moe_rl.serve": _serve, "examples/agents/calculator_agent.py": _agent_module,
}


@pytest.mark.parametrize("cmd", CASES)
def test_documented_command_runs(cmd: DocCommand, stand_ins: dict[str, str], tmp_path: Path, request) -> None:
    fast_form = FAST_FORMS.get(program(cmd.argv))
    if fast_form is None:
        pytest.fail(f"{cmd.where}: no fast form for `{cmd.text}`: add one to FAST_FORMS in {Path(__file__).name}")
    if fast_form is _in_one_child:
        r = request.getfixturevalue("one_child")[cmd.where]
        assert r["status"] == 0, f"{cmd.text}\nexit {r['status']}\n{r['stdout'][-3000:]}\n{r['stderr'][-3000:]}"
        return
    fast_form(replace_paths(redirect_outputs(cmd.argv, tmp_path), stand_ins), cmd.env)


def test_every_doc_with_shell_blocks_yields_commands() -> None:
    """The extraction finds the commands (so an empty parametrization cannot pass silently)."""
    where = {c.values[0].where.split(":")[0] for c in CASES}
    assert {"README.md", "docs/plan.md", "docs/models.md", "docs/ablations/README.md"} <= where
    torchrun = [c.values[0] for c in CASES if c.values[0].argv[0] == "torchrun"]
    assert torchrun and torchrun[0].argv[-1] == "parallel.expert_model_parallel_size=2"  # continuation joined


def test_extraction_joins_continuations_and_reads_optional_flags(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("""text
```python
python -m not_shell
```
```bash
A=1 python -m moe_rl.eval --checkpoint runs/x/hf \\
    --data test.jsonl [--k 8]   # a comment
                                # a comment line alone
make demo
```
""")
    first, second = doc_commands(doc, tmp_path)
    assert (first.where, first.env) == ("doc.md:6", (("A", "1"),))
    assert first.argv == ("python", "-m", "moe_rl.eval", "--checkpoint", "runs/x/hf", "--data", "test.jsonl",
                          "--k", "8")
    assert (second.where, second.argv) == ("doc.md:9", ("make", "demo"))
    moved = replace_paths(redirect_outputs(("x", "--dst", "/tmp/out", "sft.output=runs/b", "run.init_checkpoint=DIR/c"),
                                           tmp_path), {"DIR": "/real"})
    assert moved == ("x", "--dst", f"{tmp_path}/out", f"sft.output={tmp_path}/b", "run.init_checkpoint=/real/c")
