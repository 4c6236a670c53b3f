"""Ctrl-C / SIGTERM during training (issue 30): the step in progress finishes, a checkpoint
is written, the process exits 130 / 143, and `run.resume=true` continues the same run
without losing a metrics row; a second signal stops at once; the progress bar shows the
step it counts.

The first tests drive the one run loop (`moe_rl.loop.RunLoop`) around a scripted program,
in-process; the
last ones send the signal to a `python -m moe_rl.train` subprocess after it has logged a
step, as a user pressing Ctrl-C would."""

from __future__ import annotations

import functools
import importlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_rl.config import load_config, to_dict
from moe_rl.loop import Program, RunLoop, interrupt
from moe_rl.loop.interrupt import StoppedBySignal
from moe_rl_testing import ROOT, forked
from moe_rl_testing.in_process import run_main

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "sampler.backend=transformers",
         "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false", f"run.init_checkpoint={BASE}"]


class ScriptedProgram(Program):
    """A program whose step k reports reward k/100 and whose saves are recorded; `signals`
    maps a step to the signals this process sends itself during that step."""

    name = "scripted"

    def __init__(self, signals: dict[int, list[int]] | None = None) -> None:
        self.signals = signals or {}
        self.saved: list[int] = []

    def setup(self, resume_from: Path | None) -> int:
        return 0

    def step(self, step: int) -> dict[str, float]:
        for sig in self.signals.get(step, []):
            os.kill(os.getpid(), sig)
        return {"reward/mean": step / 100}

    def save(self, path: Path, meta: dict, background: bool = False) -> None:
        self.saved.append(meta["trainer_step"])  # (None: a save complete at once)

    def summary(self, history: list[dict]) -> dict:
        return {"finished": True}

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3g}"}


def scripted_run(tmp_path: Path, *overrides: str, signals: dict[int, list[int]] | None = None):
    """The one run loop around a ScriptedProgram, in a fresh run directory: (program, summary)."""
    cfg = load_config(RECIPE, [*SMALL, "run.save_every=4", "run.steps=10", f"run.output_dir={tmp_path}",
                               "run.name=scripted", "run.overwrite=true", *overrides])
    program = ScriptedProgram(signals)
    try:
        return program, RunLoop(program, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()
    except BaseException as e:
        e.program = program
        raise


def test_without_a_signal_the_loop_saves_on_its_cadence(tmp_path):
    program, summary = scripted_run(tmp_path)
    assert summary["finished"] is True and summary["steps"] == 10
    assert program.saved == [4, 8, 10]
    rows = _rows(tmp_path / "scripted")
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[3]["reward/mean"] == 0.04


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_saves_and_exits_with_its_status(tmp_path, sig, status, caplog):
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    with pytest.raises(StoppedBySignal) as stopped:
        scripted_run(tmp_path, signals={6: [sig]})
    assert stopped.value.code == status
    assert stopped.value.program.saved == [4, 6]  # the periodic one, then the step the signal came in
    assert f"stopped by {sig.name} after step 6 of 10" in caplog.text and "run.resume=true" in caplog.text
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # restored


def test_the_same_signal_again_at_once_is_the_same_request_another_is_not(tmp_path):
    with pytest.raises(StoppedBySignal) as stopped:  # a launcher forwarding it
        scripted_run(tmp_path, signals={3: [signal.SIGTERM, signal.SIGTERM]})
    assert stopped.value.program.saved == [3]
    with pytest.raises(SystemExit) as stopped:
        scripted_run(tmp_path, signals={3: [signal.SIGINT, signal.SIGTERM]})
    assert stopped.value.code == 143 and not isinstance(stopped.value, StoppedBySignal)
    assert stopped.value.program.saved == []


def test_a_second_signal_stops_at_once_without_saving(tmp_path, monkeypatch):
    monkeypatch.setattr(interrupt, "REPEAT_WINDOW_S", 0.0)
    with pytest.raises(KeyboardInterrupt) as stopped:
        scripted_run(tmp_path, signals={3: [signal.SIGINT, signal.SIGINT]})
    assert stopped.value.program.saved == []
    with pytest.raises(SystemExit) as stopped:
        scripted_run(tmp_path, signals={3: [signal.SIGTERM, signal.SIGTERM]})
    assert stopped.value.code == 143 and not isinstance(stopped.value, StoppedBySignal)
    assert stopped.value.program.saved == []


def test_a_signal_during_the_last_step_lets_the_run_finish(tmp_path):
    program, summary = scripted_run(tmp_path, signals={10: [signal.SIGINT]})
    assert summary["finished"] is True and program.saved == [4, 8, 10]


def test_the_progress_bar_shows_the_step_it_counts(tmp_path, monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", functools.partial(tqdm.auto.tqdm, mininterval=0, miniters=1))  # draw all
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    scripted_run(tmp_path, "logging.progress=true")
    drawn = re.findall(r"(\d+)/10 \[[^\]]*reward=([0-9.]+)", sys.stderr.getvalue())
    assert [int(k) for k, _ in drawn if k != "0"][:10] == list(range(1, 11))
    assert all(float(reward) == int(k) / 100 for k, reward in drawn if k != "0"), drawn
    assert sys.stderr.getvalue().count("\n") == 1  # closed once: one final line


# --------------------------------------------------------------------------- a real process


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOE_RL_TEST_KILL_AT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _train_argv(out: Path, *extra: str) -> list[str]:
    return ["--config", str(RECIPE), *SMALL, f"run.output_dir={out}", *extra]


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_rl.train", *_train_argv(out, *extra)]
    return forked.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _interrupt(out: Path, name: str, after_rows: int, signals: list[tuple[float, int]], *extra: str) -> tuple[int, str]:
    """Start training run `name`, wait until its metrics.jsonl holds `after_rows` rows, then
    send each (delay, signal) in turn. Returns its exit status and stderr."""
    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *SMALL, f"run.output_dir={out}",
           f"run.name={name}", *extra]
    err = out / f"{name}.stderr"  # a file, not a pipe: a full pipe would stall the child
    proc = forked.popen(cmd, cwd=ROOT, env=_env(), stderr=err)
    metrics, t0 = out / name / "metrics.jsonl", time.time()
    while proc.poll() is None and time.time() - t0 < 240:
        if metrics.exists() and metrics.read_text().count("\n") >= after_rows:
            break
        time.sleep(0.05)
    for delay, sig in signals:
        time.sleep(delay)
        proc.send_signal(sig)
    proc.wait(timeout=240)
    return proc.returncode, err.read_text()


@pytest.mark.slow
def test_ctrl_c_then_resume_keeps_every_row_and_continues_the_same_run(tmp_path):
    steps = ["run.steps=6", "run.save_every=4"]
    ref = _train(tmp_path, "run.name=ref", "run.resume=true", *steps)  # resume in an empty directory
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "run.resume=true: nothing to resume in" in ref.stderr and "starting a fresh run" in ref.stderr
    status, err = _interrupt(tmp_path, "cut", 2, [(0.0, signal.SIGINT)], *steps)
    assert status == 130, err[-3000:]
    stopped = int(re.search(r"stopped by SIGINT after step (\d+) of 6", err).group(1))
    assert 2 <= stopped < 6 and "run.resume=true" in err
    run = tmp_path / "cut"
    assert (run / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()
    assert [r["step"] for r in _rows(run)] == list(range(1, stopped + 1))
    resumed = _train(tmp_path, "run.name=cut", "run.resume=true", *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, ref_rows = _rows(run), _rows(tmp_path / "ref")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref_rows]
    assert [r["learner/loss"] for r in rows] == pytest.approx([r["learner/loss"] for r in ref_rows], abs=1e-6)
    assert [r["learner/grad_norm"] for r in rows] == pytest.approx([r["learner/grad_norm"] for r in ref_rows],
                                                                   rel=1e-5)


def test_resume_with_logged_steps_and_no_checkpoint_refuses_and_changes_nothing(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.25}) + "\n" for s in (1, 2, 3)))
    (run / "run.json").write_text('{"run_id": "abc"}\n')
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = _train_argv(tmp_path, "run.name=r", "run.resume=true", "run.steps=4")
    proc = run_main(importlib.import_module("moe_rl.train"), argv)  # (this process: main as its command line runs it)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "has no checkpoint to continue from, only 3 logged steps (up to step 3" in lines[0]
    assert "run.resume=false run.overwrite=true" in lines[0]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_leaves_nothing_half_written(tmp_path):
    from moe_rl.checkpoints.directories import is_complete, step_dirs

    # long steps (1-3 s here), so that the second signal, 0.2 s after the first, lands mid-step or
    # mid-save; the first comes just after step 2 was logged (step 1 is saved by then), and a
    # SIGTERM is no repeat of it, however soon
    status, err = _interrupt(tmp_path, "r", 2, [(0.0, signal.SIGINT), (0.2, signal.SIGTERM)], "run.steps=50", "run.save_every=1", "rl.prompts_per_step=16", "rl.group_size=8",
                             "sampler.max_new_tokens=40")
    assert status == 143, err[-3000:]
    assert "second SIGTERM: stopping now" in err and "stopped by SIGINT" not in err
    run = tmp_path / "r"
    rows = _rows(run)  # every line is whole
    saved = [s for s, p in step_dirs(run / "checkpoints") if is_complete(p)]
    # the cut step has none, nor has the one before it when its save was still in flight (run.async_save)
    assert not saved or saved[-1] >= rows[-1]["step"] - 2, (saved, rows[-1]["step"])
    assert all(is_complete(p) for _, p in step_dirs(run / "checkpoints"))  # (temp dirs are not step_<n>)


@pytest.mark.slow
def test_ctrl_c_stops_sft_after_the_step_and_a_resume_finishes_it(tmp_path):
    """SFT runs in the one loop: Ctrl-C saves the step in progress (a resumable checkpoint,
    exit 130, the loop's line); `run.resume=true` continues from it, logging every step once,
    and the finished run writes the model-only base."""
    cmd = [sys.executable, "-m", "moe_rl.sft", "--config", str(ROOT / "examples" / "tiny_sft.yaml"),
           f"run.output_dir={tmp_path}", "run.name=s", "run.steps=200", "sft.batch_size=8", "run.eval_every=1",
           "sft.eval_problems=8", "sft.target_reward=0", "logging.progress=false", "logging.tensorboard=false"]
    proc = forked.popen(cmd, cwd=ROOT, env=_env(), stderr=tmp_path / "stderr")
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < 240 and "sft step 1:" not in (tmp_path / "stderr").read_text():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=240)
    text = (tmp_path / "stderr").read_text()
    found = re.search(r"stopped by SIGINT after step (\d+) of 200, saved in (\S+);", text)
    assert proc.returncode == 130 and found, text[-3000:]
    step = int(found.group(1))
    assert Path(found.group(2)) == tmp_path / "s" / "checkpoints" / f"step_{step:06d}"
    assert (Path(found.group(2)) / "manifest.json").is_file() and not (tmp_path / "s" / "base").exists()
    assert [r["step"] for r in _rows(tmp_path / "s")] == list(range(step + 1))  # (step 0: the start's evaluation)
    done = forked.run([*cmd, "run.resume=true", f"run.steps={step + 2}"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "s")] == list(range(step + 3))
    meta = json.loads((tmp_path / "s" / "base" / "moe_rl.json").read_text())
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert meta["sft"]["step"] == summary["steps"] == step + 2 and meta["has_optimizer"] is False
