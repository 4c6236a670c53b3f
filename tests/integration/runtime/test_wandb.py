"""Weights & Biases logging (issue 48, `logging.wandb`), offline as CI runs it: no network,
no account, no key (WANDB_MODE=offline, wandb's own settings and caches in the test's tmp).

The short trainings run in this process (`moe_rl_testing/in_process.py`): 3 RL steps then a resume
for one more, and 2 DPO steps. wandb 0.31 offline writes a run's data only to its
transaction log, `<run>/wandb/offline-run-<time>-<id>/run-<id>.wandb` (no
wandb-summary.json or config.yaml under files/ until `wandb sync`); it is read with wandb's
own reader, `wandb leet inspect --json [--summary]` (wandb-core's inspector, called
directly: the CLI would only add the seconds of importing wandb)."""

from __future__ import annotations

import importlib
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_rl.config import ConfigError, load_config, save_config, to_dict
from moe_rl.loop import Program, RunLoop
from moe_rl.loop.interrupt import StoppedBySignal
from moe_rl.loop.rundir import RunDirectory
from moe_rl.runtime.failures import RunFaultError
from moe_rl.runtime.wandb_log import WandbRun, exit_code
from moe_rl_testing import ROOT
from moe_rl_testing.in_process import run_main

RL_RECIPE, DPO_RECIPE = ROOT / "examples" / "tiny_rspo.yaml", ROOT / "examples" / "tiny_dpo.yaml"
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
TRACKED = ["logging.wandb=true", "logging.wandb_project=moe-rl-tests", "logging.wandb_group=issue48",
           "logging.wandb_tags=[tiny, offline]", "logging.progress=false", "logging.tensorboard=false",
           "run.export_hf=false", f"run.init_checkpoint={BASE}"]
RL_SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "sampler.backend=transformers"]
DPO_SMALL = ["dpo.batch_size=4", "run.eval_every=2", "dpo.eval_max_pairs=8"]


@pytest.fixture
def offline(tmp_path, monkeypatch) -> None:
    """WANDB_MODE=offline, wandb's settings and caches in tmp, no key or run id from outside."""
    home = tmp_path / "wandb_home"
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*"))


def _inspect(offline_dir: Path, *flags: str) -> str:
    """What `wandb leet inspect <offline_dir> --json <flags>` prints."""
    from wandb.util import get_core_path

    (log,) = offline_dir.glob("run-*.wandb")
    argv = [get_core_path(), "leet", "inspect", "--no-observability", "--json", *flags, "--run-file", str(log),
            str(offline_dir.parent)]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def _numbers(row: dict) -> dict[str, float]:
    """What TensorBoard gets of a metrics.jsonl row: each finite number but the step."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, float) and math.isfinite(v)}


def _check_offline_run(offline_dir: Path, run: Path, first_step: int = 1) -> dict:
    """The offline run finished under the run's id, its config is the resolved recipe (and
    versions), and its summary holds the last metrics.jsonl row's values and the names of
    every row it logged (from `first_step`) as TensorBoard has them. Returns its run record
    (what it asked wandb for)."""
    state = json.loads(_inspect(offline_dir, "--summary"))
    assert (state["state"], state["exit_code"], state["run_id"]) == ("finished", 0, _run_id(run))
    config = dict(state["config"])
    versions = config.pop("versions")
    assert config == yaml.safe_load((run / "config.yaml").read_text())
    assert {"python", "moe_rl", "torch", "wandb"} <= set(versions)
    rows = [r for r in _rows(run) if r["step"] >= first_step]
    summary, expected = state["summary"], _numbers(rows[-1])
    assert len(expected) > 10
    assert {k: summary.get(k) for k in expected} == expected
    assert summary["_step"] == rows[-1]["step"]
    assert {k for k in summary if not k.startswith("_")} == {k for r in rows for k in _numbers(r)}
    records = [json.loads(line) for line in _inspect(offline_dir).splitlines()]
    return next(r["run"] for r in records if r["type"] == "run")


def _run_id(run: Path) -> str:
    return json.loads((run / "run.json").read_text())["run_id"]


def test_rl_and_dpo_runs_log_offline_and_a_resume_asks_for_the_same_run(megatron_world, tmp_path, offline):
    train, dpo = importlib.import_module("moe_rl.train"), importlib.import_module("moe_rl.dpo")
    rl = [*TRACKED, *RL_SMALL, f"run.output_dir={tmp_path}", "run.name=rl"]
    ran = run_main(train, ["--config", str(RL_RECIPE), *rl, "run.steps=3"])
    assert ran.returncode == 0, ran.stderr[-3000:]
    run = tmp_path / "rl"
    (first,) = _offline_runs(run)
    asked = _check_offline_run(first, run)
    assert {k: asked.get(k) for k in ("project", "display_name", "run_group", "tags", "run_id", "resume")} == {
        "project": "moe-rl-tests", "display_name": "rl", "run_group": "issue48", "tags": ["tiny", "offline"],
        "run_id": _run_id(run), "resume": True}

    ran = run_main(train, ["--config", str(RL_RECIPE), *rl, "run.steps=4", "run.resume=true"])
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    first_again, second = _offline_runs(run)  # each offline start keeps its own directory
    assert first_again == first and second.name.endswith(_run_id(run))
    asked = _check_offline_run(second, run, first_step=4)
    assert (asked["run_id"], asked["resume"]) == (_run_id(run), True)

    ran = run_main(dpo, ["--config", str(DPO_RECIPE), *TRACKED, *DPO_SMALL, f"run.output_dir={tmp_path}",
                         "run.name=dpo", "run.steps=2"])
    assert ran.returncode == 0, ran.stderr[-3000:]
    (dpo_run,) = _offline_runs(tmp_path / "dpo")
    _check_offline_run(dpo_run, tmp_path / "dpo", first_step=0)
    assert "eval/rewards/accuracies" in _rows(tmp_path / "dpo")[-1]


class Failing(Program):
    """Step 1 logs a reward, step 2 raises `error`."""

    name = "failing"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def setup(self, resume_from: Path | None) -> int:
        return 0

    def step(self, step: int) -> dict[str, float]:
        if step == 2:
            raise self.error
        return {"reward/mean": 0.5}


class Recorder:
    """Stands in for a WandbRun: what the run directory sends it."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.images: list[tuple[int, dict]] = []
        self.ended: list[BaseException | None] = []

    def log(self, step: int, scalars: dict, images: dict) -> None:
        self.logged.append((step, scalars))
        self.images.append((step, images))

    def finish(self, error: BaseException | None = None) -> None:
        self.ended.append(error)


def test_the_loop_ends_the_wandb_run_with_what_ended_the_run(tmp_path, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(WandbRun, "start", classmethod(lambda cls, *a: recorder))
    cfg = load_config(RL_RECIPE, [*TRACKED, f"run.output_dir={tmp_path}", "run.name=failing", "run.steps=3"])
    fault = RunFaultError("updates stay non-finite", everywhere=True)
    with pytest.raises(RunFaultError):
        RunLoop(Failing(fault), run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()
    assert [step for step, _ in recorder.logged] == [1] and recorder.logged[0][1]["reward/mean"] == 0.5
    assert recorder.ended == [fault] and exit_code(fault) == 3


def test_the_routing_heat_map_goes_to_wandb_as_to_tensorboard(tmp_path, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(WandbRun, "start", classmethod(lambda cls, *a: recorder))
    cfg = load_config(RL_RECIPE, [*TRACKED, f"run.output_dir={tmp_path}", "logging.tensorboard=true",
                                  "logging.heatmap_every=2"])
    run_dir = RunDirectory(cfg.run, cfg.logging, to_dict(cfg))
    run_dir.prepare(resume=False)
    run_dir.start_logging(0)
    layers = cfg.model.num_layers - cfg.model.num_dense_layers
    for step in (1, 2):
        run_dir.log(step, {"step": step, **{f"routing/flip_rate_layer{i}": 0.1 * step for i in range(layers)}})
    run_dir.close()
    assert [(step, sorted(images)) for step, images in recorder.images] == [(1, []), (2, ["routing/flip_rate_heatmap"])]
    img = recorder.images[1][1]["routing/flip_rate_heatmap"]
    assert img.ndim == 3 and img.shape[2] in (3, 4) and img.dtype == np.uint8
    assert recorder.logged[1][1] == {f"routing/flip_rate_layer{i}": 0.2 for i in range(layers)}
    assert list((cfg.run_dir / "tb").glob("events.out.tfevents.*")) and recorder.ended == [None]


class FakeRun:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mark_preempting(self) -> None:
        self.calls.append(("mark_preempting",))

    def finish(self, exit_code: int) -> None:
        self.calls.append(("finish", exit_code))


@pytest.mark.parametrize(("error", "calls"), [
    (None, [("finish", 0)]),
    (StoppedBySignal(signal.SIGTERM), [("mark_preempting",), ("finish", 143)]),
    (StoppedBySignal(signal.SIGINT), [("mark_preempting",), ("finish", 130)]),
    (ConfigError("a bad key"), [("finish", 2)]),
    (RuntimeError("a bug"), [("finish", 1)]),
])
def test_a_stop_by_signal_is_preempting_and_an_error_fails_the_run(error, calls):
    fake = FakeRun()
    WandbRun(fake).finish(error)
    assert fake.calls == calls


def test_wandb_keys_are_checked_when_the_recipe_loads(tmp_path):
    cfg = load_config(RL_RECIPE, ["logging.wandb_tags=[a, b]"])
    assert cfg.logging.wandb_tags == ("a", "b")
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    for override, needle in [("logging.wandb_tags=a", r"logging\.wandb_tags: expected a list"),
                             ("logging.wandb_tags=[1]", r"logging\.wandb_tags\[0\]: expected a string"),
                             ("logging.wandb_tags=['']", r"logging\.wandb_tags: '' must be a non-empty tag"),
                             ("logging.wandb_project=a/b", r"logging\.wandb_project='a/b': W&B names"),
                             ("logging.wandb_project=''", r"logging\.wandb_project must not be empty")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(RL_RECIPE, [override])


def test_wandb_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # (how Python sees a package that is not installed)
    ran = run_main(importlib.import_module("moe_rl.train"),
                   ["--config", str(RL_RECIPE), "logging.wandb=true", "--check"])
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines() == [
        "python -m moe_rl.train: config error: logging.wandb=true needs the wandb package: "
        "pip install 'moe_rl[wandb]' (or set logging.wandb=false)"]
