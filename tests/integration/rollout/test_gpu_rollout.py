"""The rollout's GPU-only parts, run on a CUDA machine (`pytest -m gpu`); skipped on CPU.

- vLLM sleep mode frees the engine's GPU memory after a rollout and wakes with the same
  weights (the memory handoff to the learner);
- the rank-local weight sync assembles full tensors on the GPU (no pageable-host round trip);
- a trainer step with the engine asleep during the update gives the same rewards as awake;
- expert-parallel rollout inside a 2-GPU rollout group (needs 2 GPUs);
- the asynchronous weight push stages each tensor on the current CUDA stream, so the next
  update's in-place writes cannot reach what NCCL sends (`rollout.weight_sync._packed`);
- vLLM's routed experts under in-flight updates (issue #46; segments, and the streaming engine
  with the KV kept) and across a multi-turn episode
  (issue #49): each position keeps the routes of the computation that fed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl_testing import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from moe_rl_testing.sampler_utils import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("gpu_tiny") / "hf")


def test_sleep_frees_gpu_memory_and_wakes_with_the_same_weights(tiny_dir):
    from moe_rl.sampler import VLLMEngineConfig, make_sampler

    s = make_sampler(tiny_dir, VLLMEngineConfig(precision="bf16", gpu_memory_utilization=0.3, sleep_mode=True))
    prompts = [[5, 6, 7, 8]] * 4
    before = s.generate(prompts, n=2, max_new_tokens=8, seed=3)
    free_awake = torch.cuda.mem_get_info()[0]
    s.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_awake > 0.1 * torch.cuda.mem_get_info()[1]  # most of vLLM's 30% is back
    s.wake_up()
    after = s.generate(prompts, n=2, max_new_tokens=8, seed=3)
    assert after.response_token_ids == before.response_token_ids
    s.close()


def test_rank_local_sync_assembles_on_the_gpu(megatron_world):
    from moe_rl.config import load_config
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.learner.gather import SyncTraffic
    from moe_rl_testing.learner_utils import learner_of

    cfg = load_config(ROOT / "examples/tiny_rspo.yaml", ["model.params_dtype=bf16"])
    with parallel_layout(cfg.parallel, seed=1) as layout:
        learner = learner_of(cfg, layout)
        traffic = SyncTraffic()
        devices = {t.device.type for _, t in hf_named_tensors(learner, dst=None, traffic=traffic)}
    assert devices == {"cuda"} and traffic.bytes_received == 0


def _train(out: Path, name: str, nproc: int, *overrides: str) -> list[dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launch, "-m", "moe_rl.train", "--config", str(ROOT / "examples/tiny_rspo.yaml"),
           "rl.prompts_per_step=8", "rl.group_size=4", "run.steps=2", "logging.progress=false",
           f"run.output_dir={out}", f"run.name={name}", *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def test_sleeping_between_steps_changes_nothing_but_memory(tmp_path):
    awake = _train(tmp_path, "awake", 1)
    asleep = _train(tmp_path, "asleep", 1, "sampler.sleep_between_steps=true")
    assert [r["reward/mean"] for r in asleep] == [r["reward/mean"] for r in awake]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_rollout_group_of_two(tmp_path):
    rows = _train(tmp_path, "ep_rollout", 2, "sampler.tensor_parallel_size=2", "sampler.expert_parallel=true")
    assert all(r["sampler/engines"] == 1 for r in rows)
    assert all(r["mismatch/dp_max"] < 5e-2 for r in rows)  # bf16 engine vs bf16 learner


def test_push_staging_is_ordered_before_the_next_update_on_the_stream():
    """What `broadcast_buckets` hands to an asynchronous NCCL broadcast is a copy queued on the
    current stream: an in-place update queued after it (the learner's next step) leaves the
    staged tensor as it was at the push."""
    from moe_rl.weights.sync import _metas, _packed, _unpacked

    dev = torch.device("cuda", torch.cuda.current_device())
    weight = torch.randn(4096, 1024, device=dev)
    before = weight.clone()
    metas = _metas([("w", weight)])
    flat = _packed([("w", weight)], metas, dev)
    weight.mul_(-3.0).add_(1.0)  # queued after the copy on the same stream
    torch.cuda.synchronize()
    staged = _unpacked(flat, metas)[0][1]
    assert staged.data_ptr() != weight.data_ptr()
    assert torch.equal(staged, before) and not torch.equal(weight, before)


def test_vllm_routes_every_position_of_a_multi_turn_episode(tmp_path_factory):
    """Issue #49 with vLLM's routed experts (CPU has none): episodes of up to 3 turns on the
    tool tokenizer's tiny model, fp32, each position's routes the round's that first fed it
    (`moe_rl.rollout.pool`); with fixed weights that is vLLM's own prefill routing of the whole
    episode, which a 1-token generate on it returns (positions whose top-k is a numerical tie
    aside)."""
    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.sampler.hf_backend import HFSampler
    from tests.integration.rollout.test_episodes import (
        check_episode_routes,
        episode_cfg,
        run_episodes,
        tool_moe,
    )

    path = tool_moe.__wrapped__(tmp_path_factory)
    s = make_sampler(path, VLLMEngineConfig(precision="fp32", gpu_memory_utilization=0.3, return_routed_experts=True))
    _, _, groups, _ = run_episodes(s, episode_cfg(), num=3, seed=5)
    def whole(seq: list[int]):  # vLLM's prefill routing of the episode: a 1-token generate on it
        return s.generate([seq[:-1]], n=1, max_new_tokens=1, temperature=0.0,
                          prompt_seeds=[0]).routed_experts[0][: len(seq) - 1]

    ref = HFSampler(path)
    assert check_episode_routes(groups, ref, whole, margin=1e-3, multi_turn_only=True) >= 1
    s.close()


def test_vllm_routes_of_a_response_spanning_a_weight_update(tiny_dir, tmp_path):
    """Issue #46 with vLLM's routed experts (CPU has none): a pool decodes segments of 4
    tokens on vLLM (fp32), the weights replaced after the first. Every token keeps the
    version and log-prob of the computation that drew it (the old weights' for tokens 0-3,
    the new weights' after, teacher-forced by transformers), and the routes of the positions
    fed in segment 0 are the old model's, the rest the new one's: what R3 replays per position.
    Sequences whose top-k is a numerical tie under either model are left out of the route check."""
    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.sampler.hf_backend import HFSampler
    from moe_rl_testing.sampler_utils import perturbed, prompts, save_stream
    from tests.integration.rollout.test_rollout_pool import T, _pool, check_spanning

    new_dir = save_stream(perturbed(tiny_dir, scale=0.1), tiny_dir, tmp_path / "new")
    s = make_sampler(tiny_dir, VLLMEngineConfig(precision="fp32", gpu_memory_utilization=0.3, return_routed_experts=True))
    old, new = HFSampler(tiny_dir), HFSampler(new_dir)
    pool = _pool(prompts(4, length=6, seed=3), segment=4, seed=5)
    pool.segment(s, 0, T, 1.0)
    s.update_weights(perturbed(tiny_dir, scale=0.1))
    while pool.running:
        pool.segment(s, 1, T, 1.0)
    s.close()
    assert check_spanning(pool, old, new, atol=2e-3, margin=1e-3, any_order=True) >= 3


def test_vllm_routes_of_a_streamed_response_with_the_kv_kept_across_an_update(tiny_dir, tmp_path):
    """rl.inflight_kv=keep with vLLM's routed experts (CPU has none): six streaming requests
    are paused after 4+ tokens, the weights replaced, and resumed with their KV kept. A
    position fed before the pause keeps the old model's routes; a later one those of the new
    weights reading the old KV (transformers: the old model's cache fed to the new one), and
    so do the tokens' log-probs. Near-ties under either model are left out of the route check."""
    import numpy as np

    from moe_rl.sampler import VLLMEngineConfig, make_sampler
    from moe_rl.sampler.hf_backend import HFSampler
    from moe_rl_testing.sampler_utils import perturbed, prompts, router_margin, save_stream
    from tests.integration.rollout.test_rollout_pool import _routes
    from tests.integration.sampler.test_sampler_vllm_stream import kept_kv_logprobs

    new_dir = save_stream(perturbed(tiny_dir, scale=0.1), tiny_dir, tmp_path / "new")
    s = make_sampler(tiny_dir, VLLMEngineConfig(precision="fp32", gpu_memory_utilization=0.3, return_routed_experts=True,
                                                streaming=True, eos_token_ids=()))
    P, got = prompts(6, length=8, seed=3), {}
    for i, p in enumerate(P):
        s.submit(f"r{i}", p, seed=100 + i, max_new_tokens=24, ignore_eos=True)
        got[f"r{i}"] = {"tokens": [], "logprobs": [], "epochs": [], "routed": None}

    def poll_until(done) -> None:
        while not done():
            for d in s.poll(0.01):
                g = got[d.request_id]
                g["tokens"] += d.tokens
                g["logprobs"] += d.logprobs
                g["epochs"] += d.epochs
                g["routed"] = d.routed if d.routed is not None else g["routed"]

    poll_until(lambda: min(len(g["tokens"]) for g in got.values()) >= 4)
    s.update_weights(perturbed(tiny_dir, scale=0.1))
    poll_until(lambda: all(g["routed"] is not None for g in got.values()))
    s.close()
    old, new = HFSampler(tiny_dir), HFSampler(new_dir)
    checked = 0
    for p, g in zip(P, got.values()):
        tokens, k = g["tokens"], g["epochs"].count(0)
        assert len(tokens) == 24 and 4 <= k < 24 and g["epochs"] == [0] * k + [1] * (24 - k)
        assert g["routed"].shape[0] == len(p) + 24 - 1
        want = old.score([p], [tokens[:k]])[0] + kept_kv_logprobs(old.model, new.model, p, tokens, k)
        torch.testing.assert_close(g["logprobs"], want, atol=2e-3, rtol=0)
        if min(router_margin(m.model, p, tokens) for m in (old, new)) <= 1e-3:
            continue
        checked += 1
        fed_old = len(p) + k - 1
        ref = np.concatenate([_routes(old, p + tokens)[:fed_old], _kept_kv_routes(old, new, p + tokens, fed_old)])
        np.testing.assert_array_equal(np.sort(g["routed"], -1), np.sort(ref, -1))
    assert checked >= 3


def _kept_kv_routes(old, new, seq: list[int], fed_old: int):
    """Routed experts of positions fed_old .. len(seq) - 2 when the new model reads the old
    model's cache of the positions before them ([len - 1 - fed_old, L, K])."""
    with torch.no_grad():
        cache = old.model(torch.tensor([seq[:fed_old]]), use_cache=True).past_key_values
        caps = new._routers
        caps.enabled, caps.calls = True, []
        caps.new_call()
        new.model(torch.tensor([seq[fed_old:-1]]), past_key_values=cache, use_cache=True)
        caps.enabled = False
    return caps.stacked(caps.calls.pop(), 1)[0].numpy()
