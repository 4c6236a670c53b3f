"""Checkpoints written in the background (issue 50): the files hold the state of the step
that started the save, whatever the next steps change; a save is invisible until finished;
the run loop finishes or abandons a save in flight within run.stop_grace_s on a signal and
saves by wall time with run.save_every_minutes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from moe_rl.checkpoints.directories import latest_checkpoint
from moe_rl.config import load_config, to_dict
from moe_rl.loop import Program, RunLoop
from moe_rl.loop.interrupt import StoppedBySignal
from moe_rl_testing import ROOT
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss


def _adam_states(learner) -> list[dict]:
    parts = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
    return [state for part in parts for state in part.optimizer.state.values()]


def test_a_background_save_holds_the_state_it_started_with(megatron_world, tmp_path):
    """Weights and Adam moments changed in place right after the save starts (what the next
    optimizer step does on CPU) never reach its files; until finished it is no checkpoint."""
    from moe_rl.learner import load_checkpoint, parallel_layout
    from moe_rl.learner.checkpoint import start_checkpoint

    cfg = load_config(None, ["optimizer.lr=1e-2"])
    batch, adv_B = fixed_batch()
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = learner_of(cfg, layout)
        learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
        before = {k: v.detach().clone() for k, v in learner.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        path = tmp_path / "checkpoints" / "step_000001"
        t0 = time.monotonic()
        pending = start_checkpoint(learner, path, {"trainer_step": 1}, recipe=to_dict(cfg), background=True)
        with torch.no_grad():
            for p in learner.gpt.parameters():
                p.add_(1.0)
            for state in _adam_states(learner):
                state["exp_avg"].add_(1.0)
        assert latest_checkpoint(tmp_path) is None and not path.exists()
        assert pending.wait(60) and pending.step == 1
        time.sleep(0.5)  # (a step the write overlapped: not part of the save's own time)
        assert pending.finish() == path and latest_checkpoint(tmp_path) == path
        assert 0 < pending.seconds < time.monotonic() - t0 - 0.25  # (the sleep is not counted)
        fresh = learner_of(cfg, layout)
        load_checkpoint(fresh, path)
        loaded = {k: v for k, v in fresh.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        assert all(torch.equal(before[k], loaded[k]) for k in before)
        moments = [s["exp_avg"] for s in _adam_states(fresh)]
        assert moments and all(m.abs().max() < 0.5 for m in moments)  # (the live ones are all >= ~1 now)


class FakeSave:
    """A save in flight whose files are written `after_s` seconds after it started (None:
    never), and that took `took_s` when finished."""

    def __init__(self, step: int, after_s: float | None, took_s: float = 0.0) -> None:
        self.step, self.after_s = step, after_s
        self.started = time.monotonic()
        self.seconds = took_s
        self.finished = self.abandoned = False

    def done(self) -> bool:
        return self.after_s is not None and time.monotonic() - self.started >= self.after_s

    def wait(self, timeout: float | None = None) -> bool:
        end = time.monotonic() + (timeout or 0)
        while not self.done() and time.monotonic() < end:
            time.sleep(0.01)
        return self.done()

    def finish(self) -> Path:
        self.finished = True
        return Path()

    def abandon(self) -> None:
        self.abandoned = True


class SavingProgram(Program):
    """Steps of `step_s` seconds; step `signal_at` sends itself SIGTERM; background saves
    are FakeSaves written `write_s` after they start, taking `took_s`."""

    name = "saving"

    def __init__(self, *, write_s: float | None = 0.0, took_s: float = 0.0, step_s: float = 0.0,
                 signal_at: int = 0) -> None:
        self.write_s, self.took_s, self.step_s, self.signal_at = write_s, took_s, step_s, signal_at
        self.saves: list[tuple[int, bool, FakeSave]] = []

    def setup(self, resume_from: Path | None) -> int:
        return 0

    def step(self, step: int) -> dict[str, float]:
        time.sleep(self.step_s)
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"reward/mean": 0.0}

    def save(self, path: Path, meta: dict, background: bool = False) -> FakeSave:
        fake = FakeSave(meta["trainer_step"], self.write_s if background else 0.0, self.took_s)
        self.saves.append((meta["trainer_step"], background, fake))
        return fake


def _run(tmp_path: Path, program: SavingProgram, *overrides: str):
    cfg = load_config(ROOT / "examples" / "tiny_rspo.yaml",
                      ["logging.progress=false", "logging.tensorboard=false", f"run.output_dir={tmp_path}",
                       "run.name=saving", "run.steps=6", *overrides])
    return RunLoop(program, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()


def test_background_saves_finish_before_the_next_and_the_last_is_synchronous(tmp_path):
    program = SavingProgram(write_s=None)  # (never written by itself: each is finished by the next save)
    _run(tmp_path, program, "run.save_every=2")
    assert [(s, bg) for s, bg, _ in program.saves] == [(2, True), (4, True), (6, False)]
    assert all(f.finished and not f.abandoned for _, _, f in program.saves)


def test_saves_by_wall_time(tmp_path):
    program = SavingProgram(step_s=0.05)
    _run(tmp_path, program, "run.save_every=0", "run.save_every_minutes=0.001")  # (0.06 s: about every 2nd step)
    steps = [s for s, _, _ in program.saves]
    assert steps[-1] == 6 and 2 <= len(steps) <= 5 and steps == sorted(set(steps)), steps


@pytest.mark.parametrize(("write_s", "took_s", "told"), [
    (0.2, 0.0, "saved in {run}/checkpoints/step_000004; the save of step 3 in flight finished"),
    (None, 0.0, "not saved (the last save took 0.0 s, 0.0 s of run.stop_grace_s were left); the save of step 3 "
                "in flight was abandoned (not written within run.stop_grace_s=0.5 s); the latest checkpoint is none"),
    (0.0, 30.0, "not saved (the last save took 30.0 s, 0.5 s of run.stop_grace_s were left); the save of step 3 "
                "in flight finished; the latest checkpoint is none"),
])
def test_a_signal_finishes_or_abandons_the_save_in_flight_within_the_grace(tmp_path, caplog, write_s, took_s, told):
    """SIGTERM in step 4 with step 3's save in flight: it is finished when written within
    run.stop_grace_s, else abandoned; step 4 is then saved unless the last save took longer
    than what is left of the grace (an abandoned save spent all of it)."""
    program = SavingProgram(write_s=write_s, took_s=took_s, signal_at=4)
    t0 = time.monotonic()
    with pytest.raises(StoppedBySignal) as stopped:
        _run(tmp_path, program, "run.save_every=1", "run.stop_grace_s=0.5")
    assert stopped.value.code == 143 and time.monotonic() - t0 < 10
    assert f"stopped by SIGTERM after step 4 of 6, {told.format(run=tmp_path / 'saving')}; to continue" in caplog.text
    in_flight = program.saves[2][2]
    assert in_flight.step == 3 and in_flight.abandoned == (write_s is None)
