"""What checkpoints cost the training loop (issue #50): the tiny RL recipe
(`examples/tiny_rspo.yaml`, transformers sampler, one process) saving every step and every
4 steps, written synchronously (run.async_save=false) against in the background (the
default), and without periodic saves (only the last, in every mode), in interleaved rounds.
A background save still blocks for its start (the plan and a host copy of the tensors) and
its finish (metadata, manifest, rename); its data files are written and hashed by a thread,
and at most one save is in flight, so saving more often than a save takes to write waits
for the previous one.

Wall seconds per step come from summary.json (`wall_seconds / steps`: the step, its
evaluation-free loop and every save the loop waits for); the blocking cost of a save is the
difference to the run without periodic saves.

    python -m bench.cpu.bench_checkpoint_save            # 3 rounds of 16 steps
    python -m bench.run_all checkpoint_save --quick  # smoke: see QUICK_MODES
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_rl_testing import ROOT
from moe_rl_testing.bench_common import at_once, markdown_table, write_results

COMMON = ["rl.prompts_per_step=8", "rl.group_size=4", "sampler.max_new_tokens=16", "sampler.backend=transformers",
          "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false",
          "run.init_checkpoint=moe_rl/assets/tiny_base"]
MODES = {
    "no periodic save": ["run.save_every=0"],
    "every step, synchronous": ["run.save_every=1", "run.async_save=false"],
    "every step, background": ["run.save_every=1", "run.async_save=true"],
    # a save written over the steps until the next one (a GPU run's case: steps longer than a save)
    "every 4 steps, synchronous": ["run.save_every=4", "run.async_save=false"],
    "every 4 steps, background": ["run.save_every=4", "run.async_save=true"],
}
# --quick (make bench-smoke): one run per save path (synchronous, background with a save in
# flight at the next), 3 steps each, no baseline run; the blocking table's tiny model only,
# both modes in one process. Its figures are not results (no baseline: the cost columns are nan).
QUICK_MODES = ("every step, synchronous", "every step, background")


def run(overrides: list[str], steps: int, threads: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "moe_rl.train", "--config", str(ROOT / "examples" / "tiny_rspo.yaml"), *COMMON,
               f"run.steps={steps}", f"run.output_dir={tmp}", "run.name=bench", *overrides]
        env = dict(os.environ, TORCHDYNAMO_DISABLE="1", **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        summary = json.loads((Path(tmp) / "bench" / "summary.json").read_text())
        rows = [json.loads(x) for x in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_per_step": summary["wall_seconds"] / steps,
            "step_median": statistics.median(r["time/step"] for r in rows),
            "rewards": [r["reward/mean"] for r in rows]}


BLOCKING_MODELS = {
    "tiny (0.5 M parameters)": [],
    "larger (24 M parameters)": ["model.num_layers=8", "model.hidden_size=256", "model.kv_channels=64",
                                 "model.ffn_hidden_size=1024", "model.moe_ffn_hidden_size=512"],
}
BLOCKING_SCRIPT = """
import json, sys, time
import torch
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss
from moe_rl.config import load_config
from moe_rl.learner import init_distributed, parallel_layout
from moe_rl.learner.checkpoint import start_checkpoint
from moe_rl.config import to_dict
init_distributed()
modes, out, step_s, saves = sys.argv[1].split(","), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
cfg = load_config(None, sys.argv[5:])
batch, adv = fixed_batch()
with parallel_layout(cfg.parallel, seed=1) as layout:
    learner = learner_of(cfg, layout)
    learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv})
    params = sum(p.numel() for p in learner.gpt.parameters())
    runs = {}
    for mode in modes:  # ("0": synchronous, "1": background; one per process unless --quick)
        blocked, own = [], []
        for i in range(saves):
            t0 = time.perf_counter()
            pending = start_checkpoint(learner, f"{out}/{mode}/step_{i}", {"trainer_step": i}, recipe=to_dict(cfg),
                                       background=mode == "1")
            t1 = time.perf_counter()
            time.sleep(step_s)  # an accelerator-bound step: the host is idle
            t2 = time.perf_counter()
            pending.finish()
            blocked.append(t1 - t0 + time.perf_counter() - t2)
            own.append(pending.seconds)
        runs[mode] = {"params": params, "blocked": blocked, "own": own}
print(json.dumps(runs))
"""


def blocked_per_save(backgrounds: list[bool], overrides: list[str], step_s: float, saves: int) -> list[dict]:
    """Seconds the loop waits per save (its start, and its finish after a step of `step_s`
    seconds that leaves the host idle, as a GPU step does), per mode in `backgrounds`, in one
    fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        modes = ",".join(str(int(b)) for b in backgrounds)
        proc = subprocess.run([sys.executable, "-c", BLOCKING_SCRIPT, modes, tmp, str(step_s),
                               str(saves), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        runs = json.loads(proc.stdout.strip().splitlines()[-1])
        return [runs[str(int(b))] for b in backgrounds]


def blocking_table(quick: bool) -> tuple[str, dict]:
    saves, step_s = (2, 0.5) if quick else (5, 2.0)
    models = dict(list(BLOCKING_MODELS.items())[:1]) if quick else BLOCKING_MODELS
    rows, data = [], {}
    for name, overrides in models.items():
        if quick:  # (both modes in one process)
            sync, bg = blocked_per_save([False, True], overrides, step_s, saves)
        else:  # (a fresh process per mode)
            sync, bg = (blocked_per_save([b], overrides, step_s, saves)[0] for b in (False, True))
        med = {k: statistics.median(r["blocked"]) for k, r in (("sync", sync), ("bg", bg))}
        own = statistics.median(bg["own"])
        rows.append([name, med["sync"], med["bg"], own, med["bg"] / med["sync"]])
        data[name] = {"params": sync["params"], "synchronous": sync, "background": bg}
    md = markdown_table(["model (one process)", "blocked per save, synchronous s", "blocked per save, background s",
                         "background save's own time s", "background / synchronous"], rows)
    return md, {"step_seconds": step_s, "saves": saves, "models": data}


def main(quick: bool = False) -> None:
    rounds, steps = (1, 3) if quick else (3, 16)
    modes = {m: MODES[m] for m in QUICK_MODES} if quick else MODES
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(rounds):  # (quick: the runs at once, moe_rl_testing.bench_common.at_once)
        done = at_once({mode: functools.partial(run, overrides, steps, 1 if quick else None)
                        for mode, overrides in modes.items()}, enabled=quick)  # (quick: a thread each)
        for mode, r in done.items():
            results[mode].append(r)
    base = statistics.median(r["wall_per_step"] for r in results.get("no periodic save", [{"wall_per_step": math.nan}]))
    table, data = [], {}
    for mode, runs in results.items():
        wall = statistics.median(r["wall_per_step"] for r in runs)
        step = statistics.median(r["step_median"] for r in runs)
        data[mode] = {"wall_per_step": [r["wall_per_step"] for r in runs], "step_median": step}
        table.append([mode, wall, step, wall - base, wall / base])
    same = len({tuple(r["rewards"]) for runs in results.values() for r in runs}) == 1
    notes = (f"{rounds} interleaved rounds of {steps} steps, medians over rounds. `s/step (wall)`: summary.json's "
             "wall_seconds / steps (everything the loop waits for, saves included); `time/step`: the logged step "
             "alone (a background save's copy and its write's competition for the 2 CPUs show there). "
             f"Every run logs the same rewards: {same}.")
    md = markdown_table(["mode", "s/step (wall)", "time/step median", "save cost s/step", "vs no save"], table)
    blocking_md, blocking = blocking_table(quick)
    notes += (f"\n\nWhat a save blocks when the step leaves the host idle (a GPU step), in process: a save "
              f"started, a {blocking['step_seconds']:g} s sleep standing for the step, the save finished; median of "
              f"{blocking['saves']} saves. Synchronous: the whole save. Background: its start (the plan, a host copy "
              "of every tensor, megatron's common files) and finish (metadata, manifest, rename); the data files "
              "are written and hashed during the sleep.\n\n" + blocking_md +
              "\nOn this 2-CPU machine the RL step itself keeps both CPUs busy, so a background write competes "
              "with it (time/step rises) and the wall time per step stays that of synchronous saves (the rounds "
              "above); the saving shows where the step leaves the host idle.")
    print(md + "\n" + notes)
    write_results("checkpoint_save", {"rounds": rounds, "steps": steps, "modes": data, "same_rewards": same,
                                      "blocking": blocking}, md, notes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
