"""What a new user meets in the first hour (issue 30): the demo's --help and TensorBoard hint,
the ablations' --help against its recipe, the one-line errors of `moe_rl.eval` and
`tools/convert_checkpoint.py` naming the flag the user typed, and a wheel that carries the
shipped checkpoint and tokenizer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from moe_rl_testing import ROOT

TINY_BASE = ROOT / "moe_rl" / "assets" / "tiny_base"


def _exit_status(main, argv: list[str]) -> int:
    try:
        return main(argv) or 0
    except SystemExit as e:
        return e.code


def test_demo_help_lists_its_overrides(capsys):
    from moe_rl.demo import DEMO_OVERRIDES, main

    assert _exit_status(main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m moe_rl.demo" in out
    assert all(f"  {o}\n" in out for o in DEMO_OVERRIDES), out


def test_demo_tensorboard_hint_runs_as_printed():
    from moe_rl.demo import tensorboard_command

    exe, *rest = tensorboard_command(Path("runs/demo/tb")).split()
    assert rest == ["--logdir", "runs/demo/tb"]
    assert Path(exe).name == "tensorboard" and Path(exe).is_file()  # the venv's, not a bare name on PATH


def test_make_help_lists_every_target_in_one_line():
    """`make help` (make's default goal) names every .PHONY target, and the pattern target
    ablate-%, on a line of its own that says what it does."""
    makefile = (ROOT / "Makefile").read_text()
    phony = [t for line in makefile.splitlines() if line.startswith(".PHONY:") for t in line.split(":", 1)[1].split()]
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("make ")}
    assert "ablate-%" in makefile and "ablate-SETTING" in lines
    for target in phony:
        assert target in lines, f"make help does not list {target}:\n{out}"
        assert len(lines[target].split()) > 3, f"no description: {lines[target]!r}"
    assert len(lines) == len(out.splitlines()) == len(phony) + 1, out  # (one line each, nothing else)


def test_ablations_help_states_the_recipes_model(capsys):
    from moe_rl.ablations.__main__ import main

    model = yaml.safe_load((ROOT / "examples" / "ablations.yaml").read_text())["model"]
    assert _exit_status(main, ["--help"]) == 0
    out = capsys.readouterr().out
    assert f"{model['num_layers']} layers" in out
    assert f"{model['num_experts']} experts top-{model['moe_router_topk']}" in out


@pytest.mark.parametrize(("flag", "bad"), [("--data", "missing.jsonl"), ("--checkpoint", "missing_ckpt")])
def test_eval_missing_input_names_the_flag(flag, bad, tmp_path, capsys):
    from moe_rl.eval import main

    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n")
    args = {"--checkpoint": str(TINY_BASE), "--data": str(data), flag: str(tmp_path / bad)}
    assert _exit_status(main, [x for kv in args.items() for x in kv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m moe_rl.eval: error: {flag} {tmp_path / bad}: no such"), err
    assert "\n" not in err and "task.data_path" not in err and "init_checkpoint" not in err


def _convert_tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_convert_existing_dst_names_force(tmp_path, capsys):
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    status = _convert_tool().main(["--to", "hf", "--src", str(TINY_BASE), "--dst", str(dst)])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err == f"convert_checkpoint: error: --dst {dst} already exists; pass --force to replace it, or choose " \
                  "another --dst"
    assert (dst / "keep.txt").read_text() == "mine"


def test_wheel_carries_the_shipped_assets(tmp_path):
    """A non-editable install gets the checkpoint (its dotfile `.metadata` too) and the
    tokenizer, and the build warns about no package missing from `packages`."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "setup.py", src)
    shutil.copytree(ROOT / "moe_rl", src / "moe_rl", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".",
                            "-w", str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "absent from the `packages`" not in build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("moe_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assets = [p for d in ("moe_rl/assets", "moe_rl/tasks/assets") for p in (ROOT / d).rglob("*") if p.is_file()]
    assert any(p.name == ".metadata" for p in assets)
    missing = [str(p.relative_to(ROOT)) for p in assets if str(p.relative_to(ROOT)) not in names]
    assert not missing, f"not in the wheel: {missing}"
