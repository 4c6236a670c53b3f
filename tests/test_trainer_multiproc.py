"""The RL trainer under torchrun (2 processes, gloo), with an engine on every rank.

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
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
COMMON = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "logging.progress=false",
          "logging.tensorboard=false", "logging.rollouts_every=1", f"run.init_checkpoint={ROOT / 'moe_rl/assets/tiny_base'}"]
LAYOUTS = {"dp2": [], "ep2": ["parallel.expert_model_parallel_size=2"], "tp2": ["parallel.tensor_model_parallel_size=2"]}
REFERENCE_STEPS = 5

pytestmark = [pytest.mark.multiproc, pytest.mark.vllm, pytest.mark.slow]


def train(out: Path, name: str, nproc: int, *overrides: str, timeout: float = 420) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "moe_rl.train", "--config", str(RECIPE), *COMMON, f"run.output_dir={out}",
           f"run.name={name}", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def rollout(out: Path, name: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / name / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """One process, one engine: the runs every layout is compared with."""
    out = tmp_path_factory.mktemp("reference")
    return {backend: (out, train(out, backend, 1, f"sampler.backend={backend}", f"run.steps={REFERENCE_STEPS}"))
            for backend in ("vllm", "transformers")}


@pytest.mark.parametrize("backend", ["vllm", "transformers"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_match_one(reference, tmp_path, layout, backend):
    steps = REFERENCE_STEPS if (layout, backend) == ("dp2", "vllm") else 3
    rows = train(tmp_path, layout, 2, f"sampler.backend={backend}", f"run.steps={steps}", *LAYOUTS[layout])
    ref_dir, ref = reference[backend]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sampler/engines"] == 2 for r in rows)
    for step in range(1, steps + 1):
        mine, theirs = rollout(tmp_path, layout, step), rollout(ref_dir, backend, step)
        assert [r["response_ids"] for r in mine] == [r["response_ids"] for r in theirs], f"step {step}"
        lp_gap = max(abs(a - b) for x, y in zip(mine, theirs)
                     for a, b in zip(x["sampler_logprobs"], y["sampler_logprobs"]))
        if step == 1:  # the same starting weights: the engines' split changes nothing
            assert lp_gap == 0.0 if backend == "vllm" else lp_gap < 1e-5, (step, lp_gap)
        else:  # weights updated at this layout: equal to the learner's layout parity
            assert lp_gap < 1e-4, (step, lp_gap)
    for r, q in zip(rows, ref):
        assert r["reward/mean"] == q["reward/mean"]
        assert r["learner/grad_norm"] == pytest.approx(q["learner/grad_norm"], rel=1e-5)
        assert r["learner/loss"] == pytest.approx(q["learner/loss"], abs=1e-6)
        assert r["mismatch/dp_max"] < 1e-4  # every engine holds the learner's weights (fp32)
    assert rows[-1]["sync/bytes_streamed"] > 0
    if layout == "dp2":
        assert rows[-1]["sync/bytes_received"] == 0  # a data-parallel replica holds everything


def test_r3_with_a_transformers_engine_per_rank(tmp_path):
    rows = train(tmp_path, "r3", 2, "sampler.backend=transformers", "rl.replay=R3", "rl.num_minibatches=2",
                 "run.steps=2", *LAYOUTS["ep2"])
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sampler/engines"] == 2 and r["policy/updates"] == 2
        # the sampler's routing of both engines reached the learner: in fp32 they agree
        assert r["routing/sampler_disagree_any"] < 0.02
        assert r["routing/gamma_min"] < 1  # the second mini-batch saw a moved router


def test_rollout_tensor_parallel_engine_over_two_processes(reference, tmp_path):
    """sampler.tensor_parallel_size=2: one vLLM engine sharded over both ranks through its
    external_launcher backend, in its own torch.distributed world (the trainer's hidden).
    Same tokens and rewards as one engine on one process; logprobs to TP's reduction-order
    rounding; after each sync both shards hold the learner's weights."""
    rows = train(tmp_path, "rtp2", 2, "sampler.backend=vllm", "sampler.tensor_parallel_size=2", "run.steps=3")
    ref_dir, ref = reference["vllm"]
    assert all(r["sampler/engines"] == 1 for r in rows)
    mine, theirs = rollout(tmp_path, "rtp2", 1), rollout(ref_dir, "vllm", 1)
    assert [r["response_ids"] for r in mine] == [r["response_ids"] for r in theirs]
    gap = max(abs(a - b) for x, y in zip(mine, theirs) for a, b in zip(x["sampler_logprobs"], y["sampler_logprobs"]))
    assert gap < 1e-5
    for r, q in zip(rows, ref):
        assert r["reward/mean"] == q["reward/mean"]
        assert r["mismatch/dp_max"] < 1e-4


def test_separate_placement_matches_one_process(reference, tmp_path):
    """sampler.placement=separate with 2 processes: rank 0 trains alone (megatron's world is
    just it), rank 1 hosts the engine only and receives the weights by broadcast. Same
    engine, same learner numerics as one process: every logged number but the timings is
    identical to the one-process run."""
    rows = train(tmp_path, "sep", 2, "sampler.backend=vllm", "sampler.placement=separate", "sampler.engine_ranks=1",
                 "run.steps=3")
    _, ref = reference["vllm"]
    for r, q in zip(rows, ref):
        assert r["sampler/engines"] == 1
        for key in ("reward/mean", "learner/loss", "learner/grad_norm", "mismatch/dp_max", "policy/clip_frac"):
            assert r[key] == q[key], key
