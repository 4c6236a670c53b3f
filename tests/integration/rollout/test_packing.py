"""Packed micro-batches (megatron's THD layout) against the padded reference: the model
input maps, padding spread over the experts, and learner parity (log-probs, gradients,
R2 / R3 replay) at every layout, for a Qwen3-MoE and a GLM-4.5-shaped model."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_rl.batch import TokenBatch
from moe_rl.learner.model_input import packed_input, padded_input
from moe_rl.learner.routing.tokens import spread_topk
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.learner_utils import fixed_batch


def _batch() -> TokenBatch:
    return TokenBatch.from_lists([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], []], response_width=3)


def test_packed_input_restarts_positions_and_aligns_segments():
    batch = _batch()  # real lengths 5, 4, 2
    inp = packed_input(batch, multiple=2, row_valid_B=torch.tensor([True, True, True]))
    assert inp.cu_seqlens.tolist() == [0, 6, 10, 12] and inp.max_seqlen == 6
    assert inp.tokens.tolist() == [[5, 6, 7, 11, 12, 0, 8, 13, 14, 15, 9, 10]]
    assert inp.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]]
    assert inp.real_N.tolist() == [True] * 5 + [False] + [True] * 6
    assert inp.real_tokens == 11 and inp.slots == 12
    # the slot scoring response token j is the one just before it in the same segment
    targets = batch.response_tokens()
    mask = batch.response_mask()
    flat = inp.tokens.reshape(-1)
    assert torch.equal(flat[inp.logit_index_BT[mask] + 1], targets[mask])


def test_a_padding_row_takes_one_aligned_segment_and_no_real_slot():
    batch = _batch()
    inp = packed_input(batch, multiple=4, row_valid_B=torch.tensor([True, False, True]))
    assert inp.cu_seqlens.tolist() == [0, 8, 12, 16]
    assert not inp.real_N[8:12].any() and int(inp.real_N.sum()) == 7


def test_padded_input_slots_are_s_major_like_the_router():
    batch = _batch()
    inp = padded_input(batch, seq_len=6, row_valid_B=torch.tensor([True, True, False]))
    assert inp.tokens.shape == (3, 6) and inp.cu_seqlens is None
    assert inp.rows_N[:6].tolist() == [0, 1, 2, 0, 1, 2] and inp.pos_N[:6].tolist() == [0, 0, 0, 1, 1, 1]
    assert int(inp.real_N.sum()) == 5 + 4  # the padding row holds no real slot
    flat = inp.tokens.reshape(-1)  # logits come back b-major
    mask = batch.response_mask()
    assert torch.equal(flat[inp.logit_index_BT[mask] + 1], batch.response_tokens()[mask])


@pytest.mark.parametrize("experts, topk", [(8, 2), (64, 8), (6, 4)])
def test_padding_spreads_evenly_over_every_expert(experts, topk):
    ids = spread_topk(torch.arange(3, 3 + experts * 5), experts, topk)
    assert (ids[:, 1:] > ids[:, :-1]).all()  # distinct, sorted
    load = torch.bincount(ids.reshape(-1), minlength=experts)
    assert int(load.max() - load.min()) == 0  # a whole number of rounds: exactly even


def test_length_groups_bound_the_padding_cost():
    from moe_rl.learner.packed_attention import length_groups

    # short rollouts share one call: 17^2 - 12^2 = 145 <= 1024
    assert length_groups([12, 17, 15, 14, 16, 13]) == [[1, 4, 2, 3, 5, 0]]
    # 40^2 - 30^2 = 700 joins; 40^2 - 20^2 = 1200 does not, and starts the next group
    assert length_groups([20, 40, 30, 12]) == [[1, 2], [0, 3]]
    assert length_groups([300, 299, 298]) == [[0, 1], [2]] and length_groups([]) == []
    # (the packed-attention test below: 40^2 - 35^2 = 375, 40^2 - 3^2 = 1591: two groups)
    assert length_groups([40, 3, 3, 1, 35]) == [[0, 4], [1, 2, 3]]
    assert length_groups([9, 3], waste=72) == [[0, 1]] and length_groups([9, 3], waste=71) == [[0], [1]]


def test_packed_attention_equals_one_call_per_sequence(megatron_world):
    """Grouped, right-padded attention over packed segments (two groups here) gives each
    segment's own causal attention: the output and the gradients of q, k, v."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_rl.config import load_config
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.packed_attention import PackedDotProductAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            kv_channels=16, attention_dropout=0.0)
    with parallel_layout(load_config(None, []).parallel, seed=1):
        attn = PackedDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self")
        cu = torch.tensor([0, 40, 43, 46, 47, 82], dtype=torch.int32)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(82, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
        w = torch.randn(82, 1, 64, generator=g)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=40,
                                 max_seqlen_kv=40)
        got = attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
        # the next layer of the micro-batch (the same params object) reuses its segment groups
        groups = params.moe_rl_segment_groups
        assert [(gr.longest, gr.g) for gr in groups] == [(40, 2), (3, 3)]
        assert torch.equal(attn(q, k, v, None, AttnMaskType.causal, packed_seq_params=params), got)
        assert params.moe_rl_segment_groups is groups
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        bounds = cu.tolist()
        want = torch.cat([DotProductAttention.forward(attn, q[a:b, None], k[a:b, None], v[a:b, None], None,
                                                      AttnMaskType.causal) for a, b in itertools.pairwise(bounds)])
        want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
        assert got.shape == want.shape == (82, 1, 64)
        assert torch.allclose(got, want, rtol=0, atol=1e-6)
        for a, b in zip(grads, want_grads):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_packing_is_the_default_and_the_padded_path_is_kept():
    from moe_rl.config import load_config

    assert load_config(None, []).parallel.packing is True
    assert load_config(None, ["parallel.packing=false"]).parallel.packing is False


def test_replay_that_does_not_cover_the_rows_is_an_error(megatron_world):
    from moe_rl.config import load_config
    from moe_rl.learner import Learner, RoutingPlan, parallel_layout
    from moe_rl.learner.routing import ReplayError
    from moe_rl.routing.record import ReplayIds

    cfg = load_config(None, ["parallel.micro_batch_size=4"])
    with parallel_layout(cfg.parallel, seed=3) as layout:
        learner = Learner(cfg.model, cfg.parallel, layout)
        batch, _ = fixed_batch()
        record = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
        keep = record.rows != 4  # the replay source lost a row
        partial = ReplayIds(record.rows[keep], record.ids_RSLK[keep])
        with pytest.raises(ReplayError, match="replayed tokens on this rank's micro-batch"):
            learner.score_whole(batch, routing=RoutingPlan(replay=partial))


LAYOUTS = {"one": 1, "tp2": 2, "pp2": 2, "ep2": 2, "tp2ep2": 4, "tp2pp2": 4}


MODELS = ("qwen3", "glm4")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each (layout, model)'s worst differences; the first request for a world size runs
    every layout and model of that size in one torchrun launch."""
    out = tmp_path_factory.mktemp("packing")
    cache = {}

    def run(layout: str, model: str) -> dict:
        if (layout, model) not in cache:
            nproc = LAYOUTS[layout]
            combos = [f"{name}:{m}" for name, n in LAYOUTS.items() if n == nproc for m in MODELS]
            torchrun("packing_worker.py", nproc, str(out), *combos, timeout=900)
            cache.update({tuple(c.split(":")): torch.load(out / f"{c.replace(':', '-')}.pt") for c in combos})
        return cache[layout, model]

    return run


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_padded(results, layout, model):
    r = results(layout, model)
    assert r["logp"] < 1e-6, r
    assert r["grad"] < 1e-6, r  # relative to the largest gradient entry
    for mode in ("R2", "R3"):
        assert r[f"{mode}_logp"] < 1e-6, r
        assert r[f"{mode}_used_differs"] == 0, r  # the used routing is the replayed one
    # a token budget: the same gradient, as many micro-batches on every rank (several here)
    assert r["budget_grad"] < 1e-6, r
    assert r["budget_microbatches"] == r["budget_microbatches_min"] > 1, r
    # the load-balancing and z losses and the expert-bias update count real tokens only
    assert r["balancing_grad"] < 1e-6, r
    assert r["bias_update_differs"] == 0, r
    assert (r["bias_updated_min"] > 0) if model == "glm4" else (r["bias_updated_min"] == -1), r  # (it acted)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one", "tp2"])
def test_chunked_head_equals_full_logits(results, layout):
    """Log-probs and gradients of the chunked vocabulary-parallel head (5-token chunks) equal
    megatron's full-logits cross entropy; no log-prob is positive, no entropy negative."""
    r = results(layout, "qwen3")
    assert r["chunk_logp"] < 1e-6 and r["chunk_grad"] < 1e-6, r
    assert r["chunk_logp_max"] <= 0 and r["chunk_entropy_min"] >= 0, r
