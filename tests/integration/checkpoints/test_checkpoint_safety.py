"""Nothing lost, nothing executed (issue 15): manifests, complete-or-invisible checkpoints,
run-directory ownership and retention, the restricted metadata reader, and the chaos test
(a real training process SIGKILLed at many points, resumed each time, bit-exact).

The chaos test drives the test hook `MOE_RL_TEST_KILL_AT=<point>[#<n>]`
(`moe_rl.runtime.fault_hooks.kill_point`): the process SIGKILLs itself the n-th time it
reaches a named point of a save.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from moe_rl.checkpoints import MANIFEST_FILE
from moe_rl.checkpoints.directories import latest_checkpoint
from moe_rl.checkpoints.errors import CheckpointError
from moe_rl.checkpoints.manifest import digest_files, list_files, verify_share, write_manifest
from moe_rl.checkpoints.temps import remove_temps
from moe_rl.checkpoints.trust import ensure_verified
from moe_rl.config import ConfigError, load_config, to_dict
from moe_rl.loop.rundir import RunDirectory
from moe_rl_testing import ROOT, forked

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
BASE = ROOT / "moe_rl" / "assets" / "tiny_base"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "sampler.backend=transformers",
         "run.save_every=1", "logging.progress=false", "logging.tensorboard=false", f"run.init_checkpoint={BASE}"]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the one-process world an in-process learner test
    may have set up (a child would try to listen on the same MASTER_PORT)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOE_RL_TEST_KILL_AT")}
    return {**env, **extra}


def fake_checkpoint(dst: Path, step: int = 1, run_id: str | None = "r1", manifest: bool = True) -> Path:
    """A copy of the shipped base as a checkpoint of `run_id` at `step` (manifest rewritten)."""
    shutil.copytree(BASE, dst)
    meta = json.loads((dst / "moe_rl.json").read_text())
    meta.update(step=step, trainer_step=step, run_id=run_id)
    (dst / "moe_rl.json").write_text(json.dumps(meta))
    (dst / MANIFEST_FILE).unlink()
    if manifest:
        write_manifest(dst, digest_files(dst, list_files(dst)))
    return dst


def make_cfg(tmp_path: Path, *overrides: str):
    return load_config(RECIPE, [*SMALL, f"run.output_dir={tmp_path}", "run.name=r", *overrides])


def run_directory(cfg) -> RunDirectory:
    """The run directory of a recipe, as the run loop builds it."""
    return RunDirectory(cfg.run, cfg.logging, to_dict(cfg))


# --------------------------------------------------------------------------- manifests


def test_shipped_base_checkpoint_verifies():
    assert verify_share(BASE) is None
    manifest = json.loads((BASE / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == list_files(BASE)  # every file but config.yaml and itself


def test_manifest_names_the_damaged_file(tmp_path):
    ck = fake_checkpoint(tmp_path / "c")
    assert verify_share(ck) is None
    shard = ck / "__0_1.distcp"
    data = bytearray(shard.read_bytes())
    data[100_000:100_256] = b"\xff" * 256  # issue 15 item 4: 256 bytes overwritten inside a shard
    shard.write_bytes(bytes(data))
    assert verify_share(ck) == (f"checkpoint file {shard} is corrupt (its SHA-256 differs from manifest.json); "
                                "restore the checkpoint from a copy (or resume from an older one)")
    shard.write_bytes(bytes(data[:1000]))
    assert "is truncated (1000 bytes, manifest.json says" in verify_share(ck)
    shard.unlink()
    assert "is missing (manifest.json lists it)" in verify_share(ck)
    fake_checkpoint(tmp_path / "d")
    (tmp_path / "d" / "rng_state.pt").write_bytes(b"x")
    assert "rng_state.pt is not in manifest.json" in verify_share(tmp_path / "d")
    (tmp_path / "d" / MANIFEST_FILE).write_text('{"files": ')
    with pytest.raises(CheckpointError, match=r"manifest\.json is damaged"):
        verify_share(tmp_path / "d")


def test_no_manifest_needs_trust_and_a_bad_manifest_is_never_trusted(tmp_path):
    ck = fake_checkpoint(tmp_path / "c", manifest=False)
    with pytest.raises(CheckpointError, match=r"has no manifest.json.*--trust"):
        ensure_verified(ck)
    assert ensure_verified(ck, trust=True) is False  # accepted, read the trusting way
    bad = fake_checkpoint(tmp_path / "b")
    (bad / "common.pt").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match=r"common\.pt is truncated"):
        ensure_verified(bad, trust=True)


def test_kill_hook_fires_at_the_nth_hit_of_its_point_only():
    """The chaos hook counts hits of the named point alone (other points pass through)."""
    code = ("from moe_rl.runtime.fault_hooks import kill_point as k\n"
            "for p in ('save.file', 'save.meta', 'save.file', 'save.file'):\n"
            "    k(p); print(p, flush=True)")
    proc = forked.run([sys.executable, "-c", code], env=child_env(MOE_RL_TEST_KILL_AT="save.file#3"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["save.file", "save.meta", "save.file"]
    for rank, killed in (("0", False), ("1", True)):  # `@<rank>`: on that global rank only
        proc = forked.run([sys.executable, "-c", code], env={**child_env(MOE_RL_TEST_KILL_AT="save.file#2@1"),
                                                                 "RANK": rank}, capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode == -signal.SIGKILL) == killed and proc.stdout.count("save.file") == (1 if killed else 3)


def test_crafted_metadata_pickle_is_never_executed(tmp_path):
    """Even with a manifest that matches it: the restricted unpickler builds DCP metadata only."""
    from moe_rl.convert.dcp import DcpCheckpoint, load_metadata

    marker = tmp_path / "pwned"
    ck = fake_checkpoint(tmp_path / "c", manifest=False)
    (ck / ".metadata").write_bytes(_evil_pickle(marker))
    write_manifest(ck, digest_files(ck, list_files(ck)))
    with pytest.raises(CheckpointError, match=r"not plain DCP metadata \(global posix.system"):
        load_metadata(ck / ".metadata")
    with pytest.raises(CheckpointError, match="not plain DCP metadata"):
        DcpCheckpoint(ck)
    assert not marker.exists()
    assert load_metadata(BASE / ".metadata").state_dict_metadata  # the real one reads


def _evil_pickle(marker: Path) -> bytes:
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps(Evil())


# --------------------------------------------------------------------------- directories


def test_latest_checkpoint_sees_only_complete_checkpoints_of_the_run(tmp_path):
    ckpts = tmp_path / "checkpoints"
    fake_checkpoint(ckpts / "step_000001", 1)
    fake_checkpoint(ckpts / "step_000002.tmp-1234abcd", 2)        # killed before the rename
    fake_checkpoint(ckpts / "step_000003", 3, manifest=False)     # no manifest: never complete
    fake_checkpoint(ckpts / "step_000004", 4, run_id="other")
    assert latest_checkpoint(tmp_path, "r1") == ckpts / "step_000001"
    assert latest_checkpoint(tmp_path) == ckpts / "step_000004"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_stale_temps_are_removed_and_a_cut_replacement_is_undone(tmp_path):
    for name in ("step_000001.tmp-aa", "step_000002.deleting-bb", "step_000003.old-cc", "sampler_hf.tmp-dd"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004.old-ee").mkdir()
    removed = remove_temps(tmp_path, "step_*")
    assert len(removed) == 4
    # step_000003 was moved aside for a replacement that never arrived: it comes back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sampler_hf.tmp-dd", "step_000003", "step_000004"]


def test_fresh_start_in_a_used_directory_is_refused_or_moved_aside(tmp_path):
    run = tmp_path / "r"
    fake_checkpoint(run / "checkpoints" / "step_000005", 5, run_id="old")
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run; continue it with run.resume=true, or "
                                          r"start over with run.overwrite=true"):
        run_directory(make_cfg(tmp_path)).prepare(resume=False)
    rd = run_directory(make_cfg(tmp_path, "run.overwrite=true"))
    assert rd.prepare(resume=False) is None
    rd.close()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("r.overwritten-")]
    assert len(moved) == 1 and (moved[0] / "checkpoints" / "step_000005" / "moe_rl.json").is_file()
    assert rd.run_id != "old" and not (run / "checkpoints").exists()


def test_retention_deletes_only_this_runs_older_checkpoints(tmp_path):
    ckpts = tmp_path / "r" / "checkpoints"
    fake_checkpoint(ckpts / "step_000009", 9, run_id="other")
    for s in (1, 2, 3):
        fake_checkpoint(ckpts / f"step_{s:06d}", s, run_id="mine")
    rd = run_directory(make_cfg(tmp_path))
    rd.run_id = "mine"
    rd.rotate_checkpoints()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003", "step_000009"]


def test_resume_with_a_different_recipe_is_refused_naming_the_fields(tmp_path):
    from moe_rl.config import save_config

    ck = fake_checkpoint(tmp_path / "r" / "checkpoints" / "step_000002", 2, run_id="mine")
    save_config(make_cfg(tmp_path), ck / "config.yaml")
    (tmp_path / "r" / "run.json").write_text('{"run_id": "mine"}')
    ok = run_directory(make_cfg(tmp_path, "run.steps=80", "logging.jsonl=false", "run.save_every=5"))
    assert ok.prepare(resume=True) == ck and ok.run_id == "mine"
    ok.close()
    with pytest.raises(ConfigError, match=r"differs from the run's \(.*step_000002/config.yaml\) in rl.group_size "
                                          r"\(4 -> 8\), rl.objective \('rspo' -> 'gspo'\); resume with the saved"):
        run_directory(make_cfg(tmp_path, "rl.group_size=8", "rl.objective=gspo")).prepare(resume=True)


def test_a_longer_resume_keeps_a_decaying_schedule_and_says_so():
    """Resuming with more run.steps keeps the saved schedule (megatron-core loads it): the
    next learning rate is the saved schedule's, and the resume says so in one line; a
    constant schedule, or the same length, has nothing to say."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from moe_rl.learner.optimizer import schedule_kept_note

    def scheduler(style: str, total: int) -> OptimizerParamScheduler:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=2,
                                       lr_decay_steps=total, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                       wd_incr_steps=total, wd_incr_style="constant")

    saved = scheduler("cosine", 10)
    saved.step(increment=6)
    longer = scheduler("cosine", 20)
    note = schedule_kept_note(saved.state_dict(), longer)
    assert note == ("the learning rate keeps its saved schedule (cosine decay over 10 updates after 2 of warm-up, at "
                    "update 6), not the 20 this run.steps would give: it stays at min_lr past the saved end; to "
                    "decay over the new length, start a new run (another run.name) from this checkpoint "
                    "(run.init_checkpoint)")
    longer.load_state_dict(saved.state_dict())
    saved.step(increment=1)
    longer.step(increment=1)
    # cosine over updates 2..10 at update 7: min + (max - min) * 0.5 * (1 + cos(pi * 5 / 8))
    expected = 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 5 / 8))
    assert longer.get_lr(longer.optimizer.param_groups[0]) == pytest.approx(expected, rel=1e-12)
    assert saved.get_lr(saved.optimizer.param_groups[0]) == pytest.approx(expected, rel=1e-12)
    assert schedule_kept_note(saved.state_dict(), scheduler("cosine", 10)) is None
    assert schedule_kept_note(scheduler("constant", 10).state_dict(), scheduler("constant", 20)) is None


def test_resume_from_a_checkpoint_without_manifest_needs_trust(tmp_path):
    from moe_rl.config import save_config

    ck = fake_checkpoint(tmp_path / "r" / "checkpoints" / "step_000001", 1, run_id=None, manifest=False)
    save_config(make_cfg(tmp_path), ck / "config.yaml")
    with pytest.raises(CheckpointError, match=r"step_000001 has no manifest.json .* run.trust_checkpoint=true"):
        run_directory(make_cfg(tmp_path)).prepare(resume=True)
    rd = run_directory(make_cfg(tmp_path, "run.trust_checkpoint=true"))
    assert rd.prepare(resume=True).name == "step_000001"
    rd.close()


def _write_rows(run: Path, steps: range, tail: str = "") -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in steps)
                                       + tail)


def test_resume_moves_the_rows_logged_after_its_checkpoint_aside(tmp_path, caplog):
    run = tmp_path / "r"
    from moe_rl.config import save_config

    save_config(make_cfg(tmp_path), fake_checkpoint(run / "checkpoints" / "step_000002", 2, run_id="mine")
                / "config.yaml")
    (run / "run.json").write_text('{"run_id": "mine"}')
    _write_rows(run, range(1, 6), tail='{"step": 6, "rew')  # a kill cut the last line short
    rd = run_directory(make_cfg(tmp_path))
    assert rd.prepare(resume=True).name == "step_000002"
    rd.start_logging(2)
    rd.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [row["step"] for row in rd.history] == [1, 2]
    aside = list(run.glob("metrics.jsonl.after-step-2-*"))
    assert len(aside) == 1
    assert aside[0].read_text().splitlines() == [json.dumps({"step": s, "reward/mean": s / 10}) for s in (3, 4, 5)] \
        + ['{"step": 6, "rew']
    assert "4 rows of metrics.jsonl logged after step 2" in caplog.text


def test_logged_steps_without_a_checkpoint_are_never_dropped(tmp_path):
    run = tmp_path / "r"
    _write_rows(run, range(1, 4))
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"run.resume=true but .*/r has no checkpoint to continue from, only 3 "
                                          r"logged steps \(up to step 3 in metrics.jsonl.*run.resume=false "
                                          r"run.overwrite=true"):
        run_directory(make_cfg(tmp_path)).prepare(resume=True)
    with pytest.raises(ConfigError, match=r"/r holds an earlier run \(3 steps in metrics.jsonl, no checkpoint\); "
                                          r"start over with run.overwrite=true"):
        run_directory(make_cfg(tmp_path)).prepare(resume=False)
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert (run / "metrics.jsonl").read_bytes() == before
    rd = run_directory(make_cfg(tmp_path, "run.overwrite=true"))
    assert rd.prepare(resume=False) is None
    rd.close()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("r.overwritten-")]
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_bytes() == before


def test_resume_in_an_empty_directory_starts_fresh_and_says_so(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    rd = run_directory(make_cfg(tmp_path))
    assert rd.prepare(resume=True) is None
    rd.close()
    assert f"run.resume=true: nothing to resume in {tmp_path / 'r'} yet; starting a fresh run from {BASE}" \
        in caplog.text
    with pytest.raises(ConfigError, match=r"no checkpoint yet, and run.init_checkpoint is empty"):
        run_directory(make_cfg(tmp_path / "other", "run.init_checkpoint=")).prepare(resume=True)


def test_a_second_process_in_the_same_run_directory_is_refused(tmp_path):
    first = run_directory(make_cfg(tmp_path))
    first.prepare(resume=False)
    code = ("import sys; from moe_rl.config import load_config, to_dict; from moe_rl.loop.rundir import RunDirectory\n"
            f"cfg = load_config({str(RECIPE)!r}, {[*SMALL, f'run.output_dir={tmp_path}', 'run.name=r']!r})\n"
            "try:\n    RunDirectory(cfg.run, cfg.logging, to_dict(cfg)).prepare(resume=True)\nexcept Exception as e:\n    print(e); sys.exit(3)\n")
    proc = forked.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=child_env())
    first.close()
    assert proc.returncode == 3 and "is in use by another running process" in proc.stdout


def test_run_directory_validation():
    for override, message in [("run.name=../../x", "run.name='../../x' must be a relative name inside"),
                              ("run.name=/abs/x", "run.name='/abs/x' must be a relative name"),
                              ("run.save_every=-1", "run.save_every must be >= 0"),
                              ("run.steps=0", "run.steps must be >= 1"),
                              ("run.seed=-3", "run.seed must be in [0, 2**63)")]:
        with pytest.raises(ConfigError, match=re_escape(message)):
            load_config(RECIPE, [override])
    with pytest.raises(ConfigError, match="contradict each other"):
        load_config(RECIPE, ["run.resume=true", "run.overwrite=true"])


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# --------------------------------------------------------------------------- save / load in process


def test_save_writes_no_processes_and_load_refuses_damage(megatron_world, tmp_path):
    """A save starts no writer process, no multiprocessing manager and no resource tracker
    (megatron's default save left two orphans per kill); a damaged checkpoint is refused
    before anything is read; a model-only save of the base is identical tensor for tensor."""
    import psutil
    import torch

    from moe_rl.convert.dcp import DcpCheckpoint
    from moe_rl.learner import Learner, load_checkpoint, parallel_layout, save_checkpoint

    cfg = load_config(BASE / "config.yaml")
    with parallel_layout(cfg.parallel, seed=1) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        load_checkpoint(learner, BASE, load_optimizer=False)
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        out = save_checkpoint(learner, tmp_path / "c", include_optimizer=False, recipe=to_dict(cfg))
        assert {p.pid for p in psutil.Process().children(recursive=True)} == before
        from multiprocessing import resource_tracker

        assert resource_tracker._resource_tracker._pid is None
        assert verify_share(out) is None and not list(tmp_path.glob("c.tmp-*"))
        a, b = DcpCheckpoint(BASE), DcpCheckpoint(out)
        assert a.tensors == b.tensors
        assert all(torch.equal(a.read(k), b.read(k)) for k in a.tensors)
        bad = tmp_path / "bad"
        shutil.copytree(out, bad)
        (bad / "__0_0.distcp").write_bytes(b"\0" * 10)
        with pytest.raises(CheckpointError, match=r"__0_0.distcp is truncated \(10 bytes"):
            load_checkpoint(learner, bad, load_optimizer=False)
        (tmp_path / "notckpt").mkdir()
        (tmp_path / "notckpt" / "mine.txt").write_text("keep me")
        with pytest.raises(CheckpointError, match="exists and is not a moe_rl checkpoint"):
            save_checkpoint(learner, tmp_path / "notckpt", include_optimizer=False, recipe=to_dict(cfg))
        assert (tmp_path / "notckpt" / "mine.txt").read_text() == "keep me"


# --------------------------------------------------------------------------- chaos


def _train_argv(out: Path, name: str, *extra: str) -> list[str]:
    return ["--config", str(RECIPE), *SMALL, f"run.output_dir={out}", f"run.name={name}", *extra]


def _train_cmd(out: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moe_rl.train", *_train_argv(out, name, *extra)]


@pytest.mark.slow
def test_training_starts_from_a_trusted_checkpoint_without_manifest(tmp_path, megatron_world):
    """Trust is passed to each reader of the checkpoint (the learner's load, the sampler's
    conversion); no reader relies on another having been told. (`moe_rl.train`'s main in
    this process, as its command line runs it.)"""
    import importlib

    from moe_rl_testing.in_process import run_main

    bare = fake_checkpoint(tmp_path / "bare", manifest=False)
    argv = _train_argv(tmp_path, "t", "run.steps=1", f"run.init_checkpoint={bare}")
    train = importlib.import_module("moe_rl.train")
    refused = run_main(train, argv)
    assert refused.returncode == 2 and f"checkpoint {bare} has no manifest.json" in refused.stderr, refused.stderr
    ok = run_main(train, [*argv, "run.trust_checkpoint=true", "run.overwrite=true"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "t" / "sampler_hf" / "config.json").is_file()  # converted from the trusted checkpoint


def _tagged(tag: str) -> list[int]:
    """Live processes started by one launch (they inherit its environment tag)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("MOE_RL_CHAOS_TAG") == tag:
                found.append(p.info["pid"])
        except (psutil.Error, OSError):
            continue
    return found


def _launch(out: Path, kill: str, first: bool, steps: int) -> tuple[int, str]:
    """One training process under a kill plan: a kill_point name for the test hook
    (`moe_rl.runtime.fault_hooks`, `<point>[#<n>]`) or `none`. Returns its exit status and
    the tail of its stderr after checking nothing it started lives."""
    tag = uuid.uuid4().hex
    env = child_env(MOE_RL_CHAOS_TAG=tag)
    if kill != "none":
        env["MOE_RL_TEST_KILL_AT"] = kill
    start = ["run.resume=false"] if first else ["run.resume=true"]
    if not first and latest_checkpoint(out / "chaos") is None and run_directory(make_cfg(out, "run.name=chaos")).logged_steps():
        start = ["run.resume=false", "run.overwrite=true"]  # steps logged, none saved: a resume refuses
    cmd = _train_cmd(out, "chaos", f"run.steps={steps}", *start)
    errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the child
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    proc.wait(timeout=300)
    errors.seek(0)
    err = errors.read()[-3000:]
    deadline = time.time() + 5  # orphans may take a moment to notice; none may outlive this
    while _tagged(tag) and time.time() < deadline:
        time.sleep(0.1)
    assert not _tagged(tag), f"processes left after kill plan {kill}\n{err}"
    assert proc.returncode in (0, -signal.SIGKILL), f"{kill}: exit {proc.returncode}\n{err}"
    return proc.returncode, err


NOISY = ("time/", "sampler/sample_seconds", "sync/seconds", "learner/tokens_per_s", "perf/")

# Every kill lands at a named point (no timers: where a timer lands depends on the machine's
# speed): at start-up, mid-step (an update's gradients computed, not applied), after a
# step is logged and before its save, at a save's start, in its background write (after a
# data file), in its finish (after megatron's metadata, after the manifest but before the
# rename) and just after the rename. (moe_rl.json and config.yaml are written between those
# two finish points: a kill there leaves what a kill before the rename leaves.) Each launch
# resumes from the newest checkpoint left.
KILL_PLANS = ["start", "save.file#1", "save.manifest", "save.renamed", "step.logged#2", "save.dcp#2", "update#2",
              "save.begin"]
# The newest checkpoint after each plan, derived from the plans. Saves run in the background
# (run.async_save, the default): step n's files are written while step n+1 runs, and with
# save_every=1 its finish (megatron's metadata, moe_rl.json, config.yaml, the manifest, the
# rename) always comes at step n+1's end, before step n+1's save begins. So a save.file kill
# lands in a background write, a step.logged or update kill leaves the save in flight
# unfinished, and each plan adds the saves it finishes before its kill: nothing until
# save.renamed (step 1's, finished after step 2), then 1 (step 2's save in flight at step 3's
# log), 2 (step 2's finished, step 3's killed at its megatron metadata), and no more: the
# update kill comes in step 4 with step 3's save in flight, the last kill at step 3's save.
SAVED_AFTER = [0, 0, 0, 1, 1, 2, 2, 2]


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path):
    steps = 8  # more than the kill plans reach, so every hook fires
    ref = forked.run(_train_cmd(tmp_path, "ref", f"run.steps={steps}"), cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=child_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    run, ref_run = tmp_path / "chaos", tmp_path / "ref"
    history = []  # (plan, exit status, newest checkpoint, stderr tail): every assertion's message
    for i, plan in enumerate(KILL_PLANS):
        status, err = _launch(tmp_path, plan, i == 0, steps)
        latest = latest_checkpoint(run)
        history.append((plan, status, int(latest.name[5:]) if latest else 0, err))
    told = "\n".join(f"{plan}: exit {status}, newest checkpoint {saved}\n{err[-600:]}"
                      for plan, status, saved, err in history)
    assert [h[1] for h in history] == [-signal.SIGKILL] * len(KILL_PLANS), told
    assert [h[2] for h in history] == SAVED_AFTER, told
    status, err = _launch(tmp_path, "none", False, steps)
    assert status == 0, f"{told}\nfinal resume:\n{err}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(line) for line in (ref_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), told
    for a, b in zip(rows, ref_rows):
        assert {k: v for k, v in a.items() if not k.startswith(NOISY)} == \
               {k: v for k, v in b.items() if not k.startswith(NOISY)}, f"step {a['step']}\n{told}"
    _assert_same_final_checkpoint(run, ref_run, steps)
    left = [p for p in run.rglob("*") if any(m in p.name for m in (".tmp-", ".old-", ".deleting-"))
            or (p.name.startswith(".") and p.name.endswith(".tmp"))]
    assert not left, told
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{s:06d}" for s in (steps - 1, steps)]


def _assert_same_final_checkpoint(run: Path, ref_run: Path, step: int) -> None:
    """Model and optimizer state (every tensor) and the LR schedule, bit for bit."""
    import torch

    from moe_rl.convert.dcp import DcpCheckpoint

    a = DcpCheckpoint(run / "checkpoints" / f"step_{step:06d}")
    b = DcpCheckpoint(ref_run / "checkpoints" / f"step_{step:06d}")
    assert a.tensors == b.tensors and any("optimizer" in k for k in a.tensors)
    for key in a.tensors:
        assert torch.equal(a.read(key), b.read(key)), key
    meta_a, meta_b = (json.loads((c.path / "moe_rl.json").read_text()) for c in (a, b))
    assert meta_a["scheduler"] == meta_b["scheduler"] and meta_a["step"] == meta_b["step"]


_SAVE_THREADS = """
import os, sys, torch
from moe_rl.config import load_config
from moe_rl.learner import Learner, init_distributed, parallel_layout, save_checkpoint
from moe_rl.config import to_dict
torch.set_num_threads(2)
init_distributed()
cfg = load_config(sys.argv[1], ["model.num_layers=24"])  # (metadata > 32 KB: a parallel copy)
with parallel_layout(cfg.parallel, seed=1) as layout:
    learner = Learner(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=1)  # (never steps)
    before = len(os.listdir("/proc/self/task"))
    save_checkpoint(learner, sys.argv[2], recipe=to_dict(cfg))
    print(before, len(os.listdir("/proc/self/task")), torch.get_num_threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_save_starts_no_openmp_team_on_gloos_threads(tmp_path):
    """megatron's metadata gather copies its bytes on a gloo worker thread (over 32 KB at 24
    layers: a parallel copy). At two torch threads that thread would open an OpenMP team of
    its own (a new thread, and from then on libgomp's shortened spin for every team: 2.5x
    slower updates on 2 CPUs). The save runs at one thread, so no thread appears, and the
    caller's count is back after it. A fresh process: gloo's threads in this one may have
    opened their teams in earlier tests."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "OMP_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", _SAVE_THREADS, str(BASE / "config.yaml"), str(tmp_path / "c")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, threads = map(int, proc.stdout.split()[-3:])
    assert after == before and threads == 2
