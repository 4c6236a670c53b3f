"""The RL trainer under torchrun (2 processes, gloo) at every placement of learner and
engines (`PLACEMENTS`: a vLLM engine per rank at DP2/EP2/TP2, a transformers engine per rank
at DP2, one engine over both ranks, an engine-only rank), in one parametrized test.

Against the one-process run of the same recipe and seed:
- step 1's rollouts are the same whatever the number of engines (per-prompt seeds: token
  ids identical; vLLM's logprobs identical, the transformers sampler's within 1e-5, its
  batched padding being the only difference); later steps sample from weights updated at
  another learner layout: the same tokens, logprobs within that layout parity (1e-4), and
  identical rewards;
- training agrees to the learner's layout parity (gradient norms to 1e-5 relative);
- after each weight sync, every engine's logprobs equal the learner's (max |dp| < 1e-4 over
  the samples of both engines);
- no run hangs (each has a timeout): the weight sync's collectives are driven by the
  trainer, never by how an engine consumes the stream.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from moe_rl.sampler._cpu_shm import SHM_DIR, segment_files
from moe_rl_testing import ROOT, forked

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
COMMON = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "logging.progress=false",
          "logging.tensorboard=false", "logging.rollouts_every=1", f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"]
LAYOUTS = {"dp2": [], "ep2": ["parallel.expert_model_parallel_size=2"], "tp2": ["parallel.tensor_model_parallel_size=2"]}
REFERENCE_STEPS = 3

pytestmark = [pytest.mark.multiproc, pytest.mark.vllm, pytest.mark.slow]


def train(out: Path, name: str, nproc: int, *overrides: str, timeout: float = 420) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "moe_rl.train", "--config", str(RECIPE), *COMMON, f"run.output_dir={out}",
           f"run.name={name}", *overrides]
    proc = forked.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def rollout(out: Path, name: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / name / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]


class _References(dict):
    """The one-process, one-engine run of each sampler backend, trained when first asked for
    (a selected subset of the placements trains only the references it needs)."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def __missing__(self, backend: str) -> tuple[Path, list[dict]]:
        self[backend] = (self.out, train(self.out, backend, 1, f"sampler.backend={backend}",
                                         f"run.steps={REFERENCE_STEPS}"))
        return self[backend]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> _References:
    """One process, one engine: the runs every placement is compared with."""
    return _References(tmp_path_factory.mktemp("reference"))


@dataclass(frozen=True)
class Placement:
    """One way of placing learner and engines on 2 processes, and how close to the
    one-process run its numbers must be."""

    overrides: tuple[str, ...]
    """Recipe overrides (on top of `sampler.backend`)."""
    engines: int
    """`sampler/engines` logged every step."""
    backend: str = "vllm"
    steps: int = 3
    rollout_steps: int | None = None
    """Steps whose rollouts are compared token for token (None: every step)."""
    first_gap: float = 0.0
    """Largest sampler-logprob gap at step 1 (the same starting weights)."""
    learner: str = "parity"
    """"parity": loss and gradient norm to the learner's layout parity; "exact": every learner
    number identical (the learner alone on one rank); "": not compared."""


def _colocated(layout: str, backend: str) -> Placement:
    """An engine on every rank and the learner at `layout` over both."""
    return Placement(tuple(LAYOUTS[layout]), engines=2, backend=backend, first_gap=0.0 if backend == "vllm" else 1e-5)


PLACEMENTS = {
    **{f"{layout}-vllm": _colocated(layout, "vllm") for layout in LAYOUTS},
    # a transformers engine per rank: at DP2 only. The weight sync is the learner's gather at
    # its layout (ep2-vllm, tp2-vllm) then the engine's load of the full tensors (this one),
    # independent of each other; transformers engines at EP2 also train in the R3 test below.
    "dp2-transformers": _colocated("dp2", "transformers"),
    # one vLLM engine sharded over both ranks (external_launcher, in its own torch.distributed
    # world, the trainer's hidden): logprobs to TP's reduction-order rounding
    "rollout-tp2": Placement(("sampler.tensor_parallel_size=2",), engines=1, rollout_steps=1, first_gap=1e-5,
                             learner=""),
    # rank 0 trains alone (megatron's world is just it), rank 1 hosts the engine only and
    # receives the weights by broadcast, with delta pushes: pushes 1 and 3 send every element,
    # push 2 only the changed ones. The engine rebuilds the same weights from both kinds, so
    # everything is the one-process run's, bit for bit (one run covers the whole push and the
    # delta: a separate run of whole pushes only was the same numbers twice)
    "separate-delta": Placement(("sampler.placement=separate", "sampler.engine_ranks=1", "sampler.sync=delta",
                                 "sampler.full_sync_every=2"), engines=1, learner="exact"),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_placement_matches_one_process(reference, tmp_path, name):
    p = PLACEMENTS[name]
    before = segment_files()
    rows = train(tmp_path, name, 2, f"sampler.backend={p.backend}", f"run.steps={p.steps}", *p.overrides)
    # the sharded engine's segment names were unlinked once it was up: the next run of the same
    # layout on this machine can create them again (a name left behind failed it with errno 17)
    assert segment_files() <= before
    ref_dir, ref = reference[p.backend]
    assert [r["step"] for r in rows] == list(range(1, p.steps + 1))
    assert all(r["sampler/engines"] == p.engines for r in rows)
    for step in range(1, (p.rollout_steps or p.steps) + 1):
        mine, theirs = rollout(tmp_path, name, step), rollout(ref_dir, p.backend, step)
        assert [r["response_ids"] for r in mine] == [r["response_ids"] for r in theirs], f"step {step}"
        lp_gap = max(abs(a - b) for x, y in zip(mine, theirs)
                     for a, b in zip(x["sampler_logprobs"], y["sampler_logprobs"]))
        # step 1: the same starting weights; later: weights updated at this learner layout
        limit = p.first_gap if step == 1 else max(p.first_gap, 1e-4)
        assert lp_gap == 0.0 if limit == 0.0 else lp_gap < limit, (step, lp_gap)
    for r, q in zip(rows, ref):
        assert r["reward/mean"] == q["reward/mean"]
        assert r["mismatch/dp_max"] < 1e-4  # every engine holds the learner's weights (fp32)
        if p.learner == "parity":
            assert r["learner/grad_norm"] == pytest.approx(q["learner/grad_norm"], rel=1e-5)
            assert r["learner/loss"] == pytest.approx(q["learner/loss"], abs=1e-6)
        elif p.learner == "exact":
            for key in ("learner/loss", "learner/grad_norm", "mismatch/dp_max", "policy/clip_frac"):
                assert r[key] == q[key], key
    if "sampler.sync=delta" in p.overrides:
        assert [r["sync/delta_frac"] == 1.0 for r in rows] == [True, False, True]  # whole, delta, whole
        assert 0 < rows[1]["sync/delta_frac"] < 1
    if p.engines == 2:
        assert rows[-1]["sync/bytes_streamed"] > 0
    if name.startswith("dp2-"):
        assert rows[-1]["sync/bytes_received"] == 0  # a data-parallel replica holds everything


def test_a_leftover_segment_name_fails_the_sharded_engine_with_one_line(tmp_path):
    # what an engine killed while starting leaves: its group's names (vLLM's naming for a
    # 2-rank tensor-parallel group under external_launcher)
    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1"]
    segments = [shared_memory.SharedMemory(name=n, create=True, size=64) for n in names]
    try:
        with pytest.raises(AssertionError) as failed:
            train(tmp_path, "leftover", 2, "sampler.backend=vllm", "run.steps=1", "sampler.tensor_parallel_size=2",
                  timeout=180)
        lines = [ln for ln in str(failed.value).splitlines() if "moe_rl.train: error:" in ln]
        assert lines and all(ln.endswith("remove them once no such run is starting") for ln in lines), failed.value
        assert all(str(SHM_DIR / n) in lines[0] for n in names)
        assert {p.name for p in segment_files()} == set(names)  # not ours to remove
    finally:
        for seg in segments:
            seg.close()
            seg.unlink()


def test_r3_with_a_transformers_engine_per_rank(tmp_path):
    rows = train(tmp_path, "r3", 2, "sampler.backend=transformers", "rl.replay=R3", "rl.num_minibatches=2",
                 "run.steps=2", *LAYOUTS["ep2"])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sampler/engines"] == 2 and r["policy/updates"] == 2
        assert r["mismatch/dp_max"] < 1e-4  # both engines hold the EP2 learner's weights (fp32)
        # the sampler's routing of both engines reached the learner: in fp32 they agree
        assert r["routing/sampler_disagree_any"] < 0.02
        assert r["routing/gamma_min"] < 1  # the second mini-batch saw a moved router
