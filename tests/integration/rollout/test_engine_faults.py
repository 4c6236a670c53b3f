"""An engine that fails mid-generation (issue 50): one line naming the engine rank and the
cause, the step not trained on, the last checkpoint the latest; with sampler.max_restarts the
engine rebuilt with the newest weights and the rollout retried, counted in
rollout/engine_restarts. The failure is injected by the test hook MOE_RL_TEST_ENGINE_FAIL_AT
(`moe_rl.runtime.fault_hooks`), which raises inside `Sampler.generate` as a real failure would.

One process runs in this process (`moe_rl_testing/in_process.py`); the separate placement runs under
torchrun with one learner rank and one engine rank (`moe_rl_testing/async_runs.py`), the transformers
sampler throughout (deterministic: a retried rollout is the one the failed call would have made)."""

from __future__ import annotations

import importlib
import json
import signal
import time
from pathlib import Path

import pytest

from moe_rl.checkpoints.directories import latest_checkpoint
from moe_rl.config import ConfigError, load_config
from moe_rl.runtime.fault_hooks import ENGINE_FAIL_ENV, InjectedEngineError, engine_fail_point
from moe_rl_testing import ROOT, forked
from moe_rl_testing.async_runs import command, env, rows
from moe_rl_testing.in_process import Ran, run_main

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "sampler.backend=transformers",
         "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false", "run.save_every=1",
         "run.steps=3", f"run.init_checkpoint={ROOT / 'moe_rl' / 'assets' / 'tiny_base'}"]
# (checkpoints are written in the background: the one before the failure, still in flight
# when the engine fails, is completed before the run stops, every rank having agreed on it)
LINE = "python -m moe_rl.train: error: engine rank {rank} failed while generating step {step}: injected engine failure"
BOUND_S = 60
"""How long the whole torchrun job may take to end after the failure (measured: under 1 s on
2 CPU cores; a hang guard, not a timing test)."""
HANG_S = 8
"""The hang tests' sampler.generate_timeout_s: every legitimate generate call of these runs (8
tokens for 16 responses of the tiny model) takes well under a second, a few on a loaded machine."""


def test_the_hook_fails_the_calls_it_names_and_nothing_unset(monkeypatch):
    monkeypatch.delenv(ENGINE_FAIL_ENV, raising=False)
    engine_fail_point()
    monkeypatch.setenv(ENGINE_FAIL_ENV, "2,3")
    outcomes = []
    for _ in range(4):
        try:
            engine_fail_point()
            outcomes.append("ok")
        except InjectedEngineError:
            outcomes.append("failed")
    assert outcomes == ["ok", "failed", "failed", "ok"]


def test_restarts_are_refused_where_the_engines_cannot_agree_on_them():
    with pytest.raises(ConfigError, match=r"sampler\.max_restarts=1 is not implemented with rl\.partial_rollouts"):
        load_config(RECIPE, ["sampler.placement=separate", "sampler.engine_ranks=1", "rl.max_staleness=1",
                             "rl.rollout_correction=tis", "rl.partial_rollouts=true", "sampler.max_restarts=1"])


def _train(out: Path, name: str, *args: str, fail_at: str = "") -> Ran:
    return run_main(importlib.import_module("moe_rl.train"),
                    ["--config", str(RECIPE), *SMALL, f"run.output_dir={out}", f"run.name={name}", *args],
                    env={ENGINE_FAIL_ENV: fail_at})


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(megatron_world, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("engine_faults")
    ran = _train(out, "ref")
    assert ran.returncode == 0, ran.stderr[-3000:]
    return _rows(out / "ref")


def test_a_failed_engine_stops_the_run_before_the_step_and_a_resume_continues(uninterrupted, tmp_path, caplog):
    """sampler.max_restarts=0: the generate call of step 2 fails; exit 3 with one line naming
    engine rank 0, step 1's row and checkpoint only; the resume trains steps 2 and 3 as the
    uninterrupted run did."""
    ran = _train(tmp_path, "r", fail_at="2")
    assert ran.returncode == 3, ran.stderr[-3000:]
    last = [ln for ln in ran.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith(LINE.format(rank=0, step=2)) and "sampler.max_restarts > 0" in last, last
    assert "Traceback" not in ran.stderr
    run = tmp_path / "r"
    assert [r["step"] for r in _rows(run)] == [1]
    assert latest_checkpoint(run).name == "step_000001"
    with caplog.at_level("INFO", logger="moe_rl.programs.rl"):
        resumed = _train(tmp_path, "r", "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_000001 at step 1" in caplog.text
    assert [r["reward/mean"] for r in _rows(run)] == [r["reward/mean"] for r in uninterrupted]


def test_a_rebuilt_engine_retries_the_step_as_the_failed_call_would_have(uninterrupted, tmp_path, caplog):
    """sampler.max_restarts=1: step 2's generate call fails, the engine is rebuilt with the
    learner's weights (pushed again) and the step retried with its seeds: every row equals
    the uninterrupted run's, and rollout/engine_restarts counts the restart from step 2 on."""
    with caplog.at_level("WARNING", logger="moe_rl.rollout"):
        ran = _train(tmp_path, "r", "sampler.max_restarts=1", fail_at="2")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "engine rank 0 failed while generating step 2" in caplog.text and "rebuilding the engines" in caplog.text
    got = _rows(tmp_path / "r")
    assert [r["rollout/engine_restarts"] for r in got] == [0, 1, 1]
    assert [r["rollout/engine_restarts"] for r in uninterrupted] == [0, 0, 0]
    for key in ("reward/mean", "learner/loss", "learner/grad_norm", "mismatch/k3"):
        assert [r[key] for r in got] == [r[key] for r in uninterrupted], key


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_separate_engine_rank_restarts_then_stops_every_rank_in_bounded_time(tmp_path):
    """One learner rank, one engine rank sampling one batch ahead (rl.max_staleness=1) and
    sampler.max_restarts=2. The engine's generate calls: 1 step 1 (at the start), 2 step 2
    (ahead, during step 1), 3 step 3 (ahead): fails, the engine is rebuilt and takes step 2's
    push as usual, step 3 is sampled when due instead: 4 fails too, and the rebuilt engine
    asks the learner for its weights again; 5 step 3; 6 step 4 (ahead): fails with no restart
    left, said at step 4's delivery, so every rank stops there: steps 1-3 trained and saved,
    one line naming the engine rank, and the job over within BOUND_S of step 3's row."""
    overrides = [*SMALL, "run.steps=5", "sampler.placement=separate", "sampler.engine_ranks=1", "rl.max_staleness=1",
                 "rl.rollout_correction=tis", "sampler.max_restarts=2"]
    run, err_path = tmp_path / "r", tmp_path / "r.stderr"
    proc = forked.popen(command(RECIPE, overrides, tmp_path, "r"), cwd=ROOT,
                        env={**env(), ENGINE_FAIL_ENV: "3,4,6"}, stderr=err_path)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < 300 and not (
            (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3):
        time.sleep(0.05)
    t_row = time.time()
    proc.wait(timeout=300)
    ended_after = time.time() - t_row
    stderr = err_path.read_text()
    assert proc.returncode != 0 and ended_after < BOUND_S, (ended_after, stderr[-5000:])
    lines = [ln for ln in stderr.splitlines() if ln.startswith("python -m moe_rl.train:")]
    assert len(lines) == 1 and lines[0].startswith(LINE.format(rank=1, step=4)), stderr[-5000:]
    assert "sampler.max_restarts=2" in lines[0] and 3 in forked.rank_exit_codes(proc, stderr).values()
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in got] == [0, 0, 2]
    assert [r["rollout/staleness_max"] for r in got] == [0, 1, 0]  # (step 3 sampled when due, with step 2's weights)
    assert latest_checkpoint(run).name == "step_000003"


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_killed_engine_rank_ends_the_job_in_bounded_time_and_a_resume_finishes_it(tmp_path):
    """The engine rank of a separate placement SIGKILLed in its 4th generate call (step 4,
    sampled ahead during step 3): torchrun ends the learner within BOUND_S, whose line says a
    peer ended rather than an internal error; the latest valid checkpoint is step 1's or
    2's (step 2's save may still be in flight: background saves finish at the next step's
    end), and run.resume=true finishes the run."""
    overrides = [*SMALL, "run.steps=4", "sampler.placement=separate", "sampler.engine_ranks=1", "rl.max_staleness=1",
                 "rl.rollout_correction=tis"]
    run = tmp_path / "r"
    killed = forked.run(command(RECIPE, overrides, tmp_path, "r"), cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env={**env(), "MOE_RL_TEST_KILL_AT": "generate#4@1"})
    ended_after = time.time() - (run / "metrics.jsonl").stat().st_mtime  # (from the last row: a bound on the kill)
    print(f"the job ended {ended_after:.1f} s after its last row")
    assert killed.returncode != 0 and forked.rank_exit_codes(killed).get(1) == -signal.SIGKILL, killed.stderr[-5000:]
    assert ended_after < BOUND_S, (ended_after, killed.stderr[-5000:])
    assert "internal error" not in killed.stderr, killed.stderr[-5000:]
    done = [r["step"] for r in rows(run)]
    latest = latest_checkpoint(run)
    assert done and latest is not None and int(latest.name[5:]) >= done[-1] - 2, (done, latest)
    resumed = forked.run([*command(RECIPE, overrides, tmp_path, "r"), "run.resume=true"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env=env())
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]


HANG_LINE = f"moe_rl: the engine on rank 0 hung while generating step 2: no result after {HANG_S} s"


def test_a_deadline_fires_only_for_a_block_that_outlives_it():
    import threading

    from moe_rl.runtime.watchdog import call_deadline

    fired = threading.Event()
    with call_deadline(60.0, fired.set):
        pass  # returns at once: the timer is cancelled
    with call_deadline(0.0, fired.set):  # 0: no deadline at all
        pass
    assert not fired.is_set()
    with call_deadline(0.05, fired.set):
        assert fired.wait(30)  # (the block outlives the deadline: on_hang ran, from the timer thread)


def test_a_hung_engine_ends_the_run_with_one_line_and_a_resume_continues(uninterrupted, tmp_path):
    """The generate call of step 2 never returns (the hang hook); with
    sampler.generate_timeout_s=HANG_S the process prints one line naming the engine rank and the
    call and exits 3 within the deadline plus a bounded margin; the resume from step 1's
    checkpoint trains steps 2 and 3 as the uninterrupted run did. (A background save still in
    flight when an engine hangs is lost with the process: this run saves in the foreground.)"""
    import sys

    from moe_rl.runtime.fault_hooks import ENGINE_HANG_ENV

    cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *SMALL, "run.async_save=false",
           f"run.output_dir={tmp_path}", "run.name=r"]
    t0 = time.monotonic()
    proc = forked.run([*cmd, f"sampler.generate_timeout_s={HANG_S}"], env={**env(), ENGINE_HANG_ENV: "2"},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    took = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith(HANG_LINE) and "run.resume=true" in last, last
    assert took < HANG_S + 5 * BOUND_S  # (a hang guard with the start-up in it, not a timing test)
    run = tmp_path / "r"
    assert [r["step"] for r in _rows(run)] == [1] and latest_checkpoint(run).name == "step_000001"
    resumed = forked.run([*cmd, "run.resume=true"], env=env(), capture_output=True, text=True, timeout=600,
                             cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["reward/mean"] for r in _rows(run)] == [r["reward/mean"] for r in uninterrupted]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_hung_separate_engine_rank_ends_every_rank_in_bounded_time(tmp_path):
    """One learner rank, one engine rank whose generate call of step 2 never returns: the
    engine rank prints the one line and exits 3 after sampler.generate_timeout_s; the
    learner rank, waiting for step 2's rollout in a collective, is ended by torchrun; step
    1's row and checkpoint are the run's."""
    from moe_rl.runtime.fault_hooks import ENGINE_HANG_ENV

    overrides = [*SMALL, "sampler.placement=separate", "sampler.engine_ranks=1", "run.async_save=false",
                 f"sampler.generate_timeout_s={HANG_S}"]
    t0 = time.monotonic()
    proc = forked.run(command(RECIPE, overrides, tmp_path, "r"), cwd=ROOT, capture_output=True, text=True,
                      timeout=600, env={**env(), ENGINE_HANG_ENV: "2"})
    took = time.monotonic() - t0
    assert proc.returncode != 0 and forked.rank_exit_codes(proc).get(1) == 3, proc.stderr[-5000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("moe_rl: the engine on rank")]
    assert len(lines) == 1 and lines[0].startswith(HANG_LINE.replace("rank 0", "rank 1")), proc.stderr[-5000:]
    assert took < HANG_S + 5 * BOUND_S  # (a hang guard with the start-up in it, not a timing test)
    run = tmp_path / "r"
    assert [r["step"] for r in rows(run)] == [1] and latest_checkpoint(run).name == "step_000001"


def test_a_hung_out_of_process_engine_is_killed_and_its_call_fails():
    """`Engines.guarded`: a score (or generate) call that outlives sampler.generate_timeout_s
    on an engine that can be killed (out of process) kills it; the pending call then fails
    as a killed worker's does (here: the fake worker's call returns an error once killed),
    which the restart budget then handles like any engine failure."""
    import threading
    from types import SimpleNamespace

    from moe_rl.config import SamplerConfig
    from moe_rl.rollout.engines import Engines

    class _Worker:
        in_process = False

        def __init__(self):
            self.killed = threading.Event()

        def score(self, prompts, responses, temperature=1.0):
            if not self.killed.wait(60):
                return [[0.0]]
            raise RuntimeError("engine core died")

        def kill(self):
            self.killed.set()

    engines = Engines.__new__(Engines)
    engines.sampler, engines.placement = _Worker(), SimpleNamespace(rank=0)
    engines.sampler_cfg = SamplerConfig(generate_timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine core died"):
        engines.guarded("checking the weights pushed to it").score([[1, 2]], [[3]])
    assert engines.sampler.killed.is_set() and time.monotonic() - t0 < 30
    assert engines.guarded("x").in_process is False  # (every other attribute is the engine's)
