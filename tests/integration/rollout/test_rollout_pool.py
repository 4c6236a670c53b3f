"""Segmented decoding (`moe_rl.rollout.pool`, issue #46) on the transformers sampler: a
response that spans a weight update keeps, for every token, the log-prob, version and
routes of the computation that drew it; one segment of the whole budget is the synchronous
rollout; the staleness bound drops whole groups; a saved pool loads back as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.rollout.pool import PartialResponse, PoolGroup, RolloutPool, segment_seed
from moe_rl.sampler import HFEngineConfig, make_sampler
from moe_rl.sampler.base import base_seeds
from moe_rl.sampler.hf_backend import HFSampler
from moe_rl_testing.sampler_utils import (
    build_tiny_moe,
    perturbed,
    prompts,
    router_margin,
    save_stream,
)

G, BUDGET, T = 3, 12, 0.9


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def new_dir(tiny_dir, tmp_path_factory):
    return save_stream(perturbed(tiny_dir, scale=0.1), tiny_dir, tmp_path_factory.mktemp("new"))


def _pool(sampler_prompts: list[list[int]], segment: int, seed: int = 11) -> RolloutPool:
    pool = RolloutPool(BUDGET, segment)
    for i, (p, s) in enumerate(zip(sampler_prompts, base_seeds(seed, len(sampler_prompts), G))):
        pool.admit((1, 0, i), p, s, G)
    return pool


def _routes(sampler: HFSampler, seq: list[int]) -> np.ndarray:
    """Teacher-forced routed experts of every position of `seq` fed ([len - 1, L, K])."""
    caps = sampler._routers
    caps.enabled, caps.calls = True, []
    caps.new_call()
    with torch.no_grad():
        sampler.model(torch.tensor([seq[:-1]]))
    caps.enabled = False
    return caps.stacked(caps.calls.pop(), 1)[0].numpy()


def test_one_segment_of_the_whole_budget_is_the_synchronous_rollout(tiny_dir):
    """Segment 0 of response j draws with base + j, as one `generate` call does, so a pool
    decoding the whole budget in one segment samples exactly the synchronous rollout."""
    hf = make_sampler(tiny_dir, HFEngineConfig(batch_size=16))
    ps = prompts(4, length=6)
    pool = _pool(ps, segment=BUDGET)
    assert pool.segment(hf, 0, T, 1.0) > 0 and not pool.running
    ref = hf.generate(ps, n=G, max_new_tokens=BUDGET, temperature=T, prompt_seeds=base_seeds(11, 4, G))
    got = [r for g in pool.done for r in g.responses]
    assert [r.tokens for r in got] == ref.response_token_ids
    assert [r.logprobs for r in got] == ref.logprobs
    assert [r.finish for r in got] == ref.finish_reasons
    assert all(np.array_equal(r.routed, e) for r, e in zip(got, ref.routed_experts))
    assert all(r.versions == [0] * len(r.tokens) and r.segments == 1 for r in got)
    assert segment_seed(100, 2, 0) == 102 and segment_seed(100, 2, 1) != segment_seed(100, 2, 2)


def test_a_response_spanning_a_weight_update_keeps_each_tokens_own_computation(tiny_dir, new_dir):
    """Segments of 4 tokens, the weights replaced after the first: tokens 0-3 carry version
    0 and the old weights' log-prob, the later ones version 1 and the new weights'
    (teacher-forced over the whole prefix: the continuation recomputed the old KV); the
    routes of the positions fed in segment 0 are the old model's, the rest the new one's
    (R3 replays, per position, the computation that produced the next token's log-prob)."""
    hf = make_sampler(tiny_dir, HFEngineConfig(batch_size=16))
    old, new = HFSampler(tiny_dir), HFSampler(new_dir)
    ps = prompts(4, length=6, seed=3)
    pool = _pool(ps, segment=4, seed=5)
    pool.segment(hf, 0, T, 1.0)
    hf.update_weights(perturbed(tiny_dir, scale=0.1))
    while pool.running:
        pool.segment(hf, 1, T, 1.0)
    assert check_spanning(pool, old, new, atol=1e-4, margin=1e-5) >= 3


def check_spanning(pool: RolloutPool, old: HFSampler, new: HFSampler, *, atol: float, margin: float,
                   any_order: bool = False) -> int:
    """Every response of `pool`, decoded in segments of 4 with the weights replaced after the
    first: versions 0 then 1, each token's log-prob the old or the new model's (teacher-forced),
    and, where no top-k is within `margin` of a tie under either model, the routes of the
    positions fed in segment 0 the old model's and the rest the new one's. Returns how many
    responses spanning both versions had their routes checked. `any_order`: a position's top-k
    experts compared as a set (another engine may list them in another order; the learner
    replays them as a set)."""
    rows = [(g.prompt, r) for g in pool.done for r in g.responses]
    P, R = [p for p, _ in rows], [r.tokens for _, r in rows]
    old_lp, new_lp = old.score(P, R, T), new.score(P, R, T)
    spanning = 0
    for (prompt, r), lp0, lp1 in zip(rows, old_lp, new_lp):
        n0 = min(4, len(r.tokens))
        assert len(r.tokens) <= BUDGET and r.versions == [0] * n0 + [1] * (len(r.tokens) - n0)
        torch.testing.assert_close(r.logprobs, lp0[:n0] + lp1[n0:], atol=atol, rtol=0)
        seq = prompt + r.tokens
        assert r.routed.shape[0] == len(seq) - 1
        if n0 < len(r.tokens) and min(router_margin(m.model, prompt, r.tokens) for m in (old, new)) > margin:
            spanning += 1
            cut = len(prompt) + n0 - 1  # positions fed in segment 0
            got, ref = r.routed, np.concatenate([_routes(old, seq)[:cut], _routes(new, seq)[cut:]])
            if any_order:
                got, ref = np.sort(got, -1), np.sort(ref, -1)
            np.testing.assert_array_equal(got, ref)
    return spanning


def test_the_staleness_bound_drops_whole_groups_and_counts_their_responses():
    pool = RolloutPool(BUDGET, 4)
    for i, first in enumerate([3, 5, None]):
        responses = [PartialResponse([7], [-0.5], [first]) if first is not None else PartialResponse()
                     for _ in range(G)]
        responses[0].versions = [first + 1] if first is not None else []
        pool.running.append(PoolGroup((1, 0, i), [1, 2], 9, responses))
    pool.done.append(PoolGroup((1, 0, 3), [1], 9, [PartialResponse([7], [-0.5], [2], finish="stop")]))
    assert [g.oldest for g in pool.running] == [3, 5, None]
    pool.drop_older_than(4)
    assert [g.key[2] for g in pool.running] == [1, 2] and pool.done == [] and pool.dropped_stale == G + 1
    taken = pool.take(1)
    assert taken == [] and [r.carried for g in pool.running for r in g.responses] == [True] * G + [False] * G


def test_a_saved_pool_loads_back_as_it_was():
    r = PartialResponse([5, 6], [-0.25, -0.5], [2, 3], np.arange(12, dtype=np.uint8).reshape(3, 2, 2), None, 2, True)
    pool = RolloutPool(BUDGET, 4)
    pool.running.append(PoolGroup((4, 0, 1), [1, 2], 77, [r, PartialResponse()]))
    pool.done.append(PoolGroup((3, 0, 0), [1], 5, [PartialResponse([9], [-1.0], [1], None, "stop", 1)]))
    pool.dropped_stale = 6
    back = RolloutPool(BUDGET, 4)
    back.load_json(pool.to_json())
    assert back.running[0].responses[0].routed.dtype == np.uint8
    assert [g.to_json() for g in back.running + back.done] == [g.to_json() for g in pool.running + pool.done]
    assert back.dropped_stale == 6
