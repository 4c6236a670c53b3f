"""The stress ablations' runs (docs/ablations/STRESS_PLAN.md): every setting at the
regime the sweep picked, the pre-registered second stage, a repeated run (bit-reproducibility)
and the 3-seed contrast at the comfortable rate, each finished run's result kept as a small
committed file so the experiment spans sessions.

    python -m moe_rl.ablations stress                  # everything missing, in the plan's order
    python -m moe_rl.ablations stress --block main --settings grpo-off,gspo-off --seeds 11-20

Blocks (runs under `runs/ablations/stress/<block>/<setting>/seed<k>/`, results under
`docs/ablations/stress/<block>/<setting>/seed<k>.json`):
    repeat    off-policy GRPO seed 1 again at the regime: compared with main's, bit for bit
    main      all 17 settings, seeds 1-10, at the regime (seed-major: a stop leaves whole seeds)
    stage2    seeds 11-20 of off-policy GRPO, GSPO, GRPO+R3 and RSPO post-clip (the plan's stage 2)
    contrast  all 17 settings, seeds 1-3, at the recipe's own lr (the committed report's rate)
    explore   the exploratory blocks between the two rates (`stress_explore`, the plan's change 6)
Each result names the commit and the warm start (`warm_start_id`) it ran on (the plan's change 7).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.ablations.result_commits import ResultCommits
from moe_rl.ablations.runner import MARKER, Run, ensure_base, run_all
from moe_rl.ablations.settings import OFF_POLICY_UPDATES, settings
from moe_rl.ablations.stress import (
    RESULTS,
    code_commit,
    collapse_counts,
    outcomes,
    pick_regime,
    sweep_files,
)
from moe_rl.ablations.stress_explore import explore_specs
from moe_rl.checkpoints import MANIFEST_FILE
from moe_rl.checkpoints.errors import CheckpointError
from moe_rl.checkpoints.manifest import read_manifest
from moe_rl.runtime.atomic import atomic_write_text

MAIN_SEEDS = tuple(range(1, 11))
STAGE2_SEEDS = tuple(range(11, 21))
STAGE2_SETTINGS = ("grpo-off", "gspo-off", "grpo-r3-off", "rspo-post-off")
"""The plan's pre-registered second stage: GRPO and the settings the design documents single out."""
CONTRAST_SEEDS = (1, 2, 3)
CONTRAST_LR = 2e-4
"""The committed 3-seed report's learning rate (examples/ablations.yaml's own)."""
KEPT_PREFIXES = ("reward/mean", "reward/zero_variance_frac", "learner/grad_norm", "policy/", "routing/flip_rate",
                 "routing/dlogr", "routing/gamma", "routing/frac_gamma", "routing/sampler_disagree_any",
                 "mismatch/k3", "response/length_mean")
"""Per-step metrics a result file keeps: the outcomes and the mechanism plots need them."""
_UNTIMED = ("time/", "seconds", "per_s")
"""Metric keys that measure wall time: everything else must repeat bit for bit."""


def regime(results: Path = RESULTS) -> tuple[float, int]:
    """(lr, updates per rollout) from the committed sweep files by the plan's rule: the smallest
    lr, at 4 updates first, collapsing at least half and not all seeds; failing that (step 3)
    the smallest lr at which any seed collapsed, in the same block order."""
    blocks = [(updates, collapse_counts(sweep_files(results, updates))) for updates in (OFF_POLICY_UPDATES, 8)]
    for updates, collapses in blocks:
        if (lr := pick_regime(collapses)) is not None:
            return lr, updates
    for updates, collapses in blocks:
        hit = [lr for lr, (c, _) in sorted(collapses.items()) if c > 0]
        if hit:
            return hit[0], updates
    raise SystemExit(f"no stress regime: no sweep result under {results} has a collapsed run; "
                     "run `python -m moe_rl.ablations stress-sweep` first")


@dataclass(frozen=True)
class Block:
    """One group of runs sharing a learning rate and a result directory."""

    name: str
    lr: float
    updates: int
    runs: tuple[Run, ...]


def plan(results: Path = RESULTS, names: list[str] | None = None, seeds: tuple[int, ...] | None = None,
         only: str | None = None) -> list[Block]:
    """The blocks in the plan's order (repeat, main, stage2, contrast), or one block with the
    given settings and seeds."""
    lr, updates = regime(results)
    extra = () if updates == OFF_POLICY_UPDATES else (f"rl.num_minibatches={updates}",)

    def runs(lr_: float, setting_names: list[str] | tuple[str, ...], seed_list: tuple[int, ...]) -> tuple[Run, ...]:
        # seed-major: a stop leaves whole seeds of every setting, not all seeds of a few
        return tuple(Run(n, s, (f"optimizer.lr={lr_:g}", *(extra if n.endswith("-off") else ())))
                     for s in seed_list for n in setting_names)

    every = list(settings())
    blocks = [Block("repeat", lr, updates, runs(lr, ["grpo-off"], (1,))),
              Block("main", lr, updates, runs(lr, every, MAIN_SEEDS)),
              Block("stage2", lr, updates, runs(lr, STAGE2_SETTINGS, STAGE2_SEEDS)),
              Block("contrast", CONTRAST_LR, OFF_POLICY_UPDATES, runs(CONTRAST_LR, every, CONTRAST_SEEDS))]
    explore = [Block(name, lr_, OFF_POLICY_UPDATES, runs(lr_, names_, seeds_))
               for name, lr_, names_, seeds_ in explore_specs(results, lr)]
    if only is None or only == "explore":
        if names or seeds:
            raise SystemExit("error: --settings/--seeds need --block (main, stage2, contrast or repeat)")
        return explore if only else blocks + explore
    chosen = {b.name: b for b in blocks}.get(only)
    if chosen is None:
        raise SystemExit(f"error: --block {only!r}: choose one of {', '.join(b.name for b in blocks)}, explore")
    unknown = [n for n in names or [] if n not in settings()]
    if unknown:
        raise SystemExit(f"error: --settings {','.join(unknown)}: unknown; valid: {', '.join(settings())}")
    picked_names = names or sorted({r.setting for r in chosen.runs}, key=every.index)
    picked_seeds = seeds or tuple(sorted({r.seed for r in chosen.runs}))
    return [Block(chosen.name, chosen.lr, chosen.updates, runs(chosen.lr, picked_names, picked_seeds))]


def metrics_digest(rows: list[dict[str, Any]]) -> str:
    """sha256 of every logged number except wall times: equal digests = the run repeated bit for bit."""
    kept = [{k: v for k, v in sorted(r.items()) if not any(t in k for t in _UNTIMED)} for r in rows]
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


def run_result(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """One run's result file: outcomes under the plan's definitions, the digest, kept metrics."""
    keys = sorted({k for r in rows for k in r if k.startswith(KEPT_PREFIXES)})
    return {**meta, **outcomes(rows), "metrics_sha256": metrics_digest(rows),
            "per_step": {k: [rounded(r.get(k)) for r in rows] for k in keys}}


def rounded(x: Any) -> Any:
    """A kept metric as a result file stores it: floats to 6 significant digits."""
    return float(f"{x:.6g}") if isinstance(x, float) else x


_PLACED = (".metadata",)
"""Checkpoint files whose bytes hold the directory they were written to (config.yaml is not hashed at all)."""


def warm_start_id(base: Path) -> str:
    """The warm start a run trained from, as the first 16 hex digits of a sha256 over its
    checkpoint manifest's file hashes, less the two files that hold the path it was written to
    (config.yaml, and torch.distributed.checkpoint's `.metadata`, whose bytes the tensors do not
    decide): the same SFT checkpoint gives the same id wherever it lies. The first blocks' warm
    start was never recorded and did not outlive its machine (STRESS_PLAN.md, change 7); this id
    keeps a block from mixing warm starts unseen again."""
    try:
        manifest = read_manifest(base)
    except CheckpointError as err:
        raise SystemExit(f"--base {base}: {err}") from None
    if manifest is None:
        raise SystemExit(f"--base {base}: cannot read the file hashes in {base / MANIFEST_FILE} (there is none); a "
                         "warm start made by moe_rl.sft has one, remake it with `python -m moe_rl.ablations stress` "
                         "and no --base")
    files = manifest["files"]
    text = json.dumps({name: f["sha256"] for name, f in sorted(files.items()) if name not in _PLACED})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def result_path(results: Path, block_name: str, run: Run) -> Path:
    return results / block_name / run.setting / f"seed{run.seed}.json"


class Recorder:
    """Writes each finished run's result file at once and hands it to `commits`, which commits
    the files in batches (only those paths: whatever else the working tree holds stays out)."""

    def __init__(self, runs_dir: Path, results: Path, blk: Block, code_commit: str, warm_start: str,
                 commits: ResultCommits) -> None:
        self.runs_dir, self.results, self.block, self.commits = runs_dir, results, blk, commits
        self.code_commit, self.warm_start = code_commit, warm_start
        self._lock = threading.Lock()

    def __call__(self, run: Run) -> None:
        d = run.directory(self.runs_dir)
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        seconds = json.loads((d / MARKER).read_text()).get("seconds")
        meta = {"block": self.block.name, "setting": run.setting, "seed": run.seed, "lr": self.block.lr,
                "updates": self.block.updates if run.setting.endswith("-off") else 1,
                "commit": self.code_commit, "warm_start": self.warm_start, "seconds": seconds}
        path = result_path(self.results, self.block.name, run)
        out = run_result(rows, meta)
        with self._lock:
            atomic_write_text(path, json.dumps(out, separators=(",", ":")) + "\n")
        state = "collapsed" if out["collapsed"] else "survived"
        self.commits.add(self.block.name, path, f"{run.setting} seed {run.seed} {state} "
                         f"(final reward {out['final_reward']:.3f})", bool(out["collapsed"]))


def missing(results: Path, blocks: list[Block]) -> int:
    """Runs of `blocks` without a result file."""
    return sum(not result_path(results, b.name, r).is_file() for b in blocks for r in b.runs)


def run_plan(out: Path, make_blocks: Callable[[], list[Block]], base: Path | None, jobs: int,
             results: Path = RESULTS, commit: bool = False, mix_warm_starts: bool = False) -> list[Run]:
    """Train what `make_blocks` names until nothing is missing: the plan is read again after
    each pass, since the exploratory rule adds blocks as its sweep's results land."""
    while before := missing(results, blocks := make_blocks()):
        failed = run_stress(out, blocks, base, jobs, results, commit, mix_warm_starts)
        if failed or missing(results, blocks) >= before:  # (no progress: stop rather than loop)
            return failed
    return []


def check_warm_start(results: Path, blocks: list[Block], base: Path, warm: str) -> None:
    """Refuse to add runs to a block whose recorded runs trained from another warm start (or
    from the first one, which was never recorded): a block is one condition unless the user
    says otherwise (--mix-warm-starts)."""
    for blk in blocks:
        if not missing(results, [blk]):
            continue
        seen = {json.loads(p.read_text()).get("warm_start") for p in (results / blk.name).glob("*/seed*.json")}
        if seen and warm not in seen:
            had = ", ".join(sorted(w or "one not recorded" for w in seen))
            raise SystemExit(f"block {blk.name}: its runs trained from warm start {had} and --base {base} is "
                             f"{warm}; make that warm start again (STRESS_PLAN.md, change 7) or pass "
                             "--mix-warm-starts to add runs the report tells apart")


def run_stress(out: Path, blocks: list[Block], base: Path | None, jobs: int, results: Path = RESULTS,
               commit: bool = False, mix_warm_starts: bool = False) -> list[Run]:
    """Train every missing run of `blocks` in order, recording (and committing) each as it lands."""
    base = ensure_base(out, base, os.cpu_count() or 1)
    sha, warm = code_commit(), warm_start_id(base)
    if not mix_warm_starts:
        check_warm_start(results, blocks, base, warm)
    failed: list[Run] = []
    commits = ResultCommits("stress", enabled=commit)
    try:
        for blk in blocks:
            runs_dir = out / "stress" / blk.name
            todo = [r for r in blk.runs if not result_path(results, blk.name, r).is_file()]
            print(f"== stress {blk.name}: lr {blk.lr:g}, {len(todo)} of {len(blk.runs)} run(s) missing", flush=True)
            recorder = Recorder(runs_dir, results, blk, sha, warm, commits)
            for r in todo:  # finished earlier but not recorded (stopped between the two)
                if r.done(runs_dir):
                    recorder(r)
            failed += run_all(todo, runs_dir, base, jobs, on_done=recorder)
            commits.flush(blk.name)
    finally:  # (a stop commits what landed before it)
        commits.flush()
    return failed
