"""Routing capture, router shift and replay inside the megatron learner.

In-process (one rank): memory of the capture, gamma against hand computations, replay
exactness, the router's gradient under replay against an independent fixed-id router,
R3 alignment of vLLM-layout routing, and a reference model beside the policy. Under
torchrun: the same record, gamma and replay at TP=2, EP=2, PP=2 and TP=2 x EP=2.
"""

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.routing.record import align_sampler_routing
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss

L_MOE, K, E = 4, 2, 8


@pytest.fixture(scope="module")
def layout(megatron_world):
    from moe_rl.learner import parallel_layout

    cfg = load_config(None, ["parallel.micro_batch_size=4"])
    with parallel_layout(cfg.parallel, seed=9) as lay:
        yield lay


def make_learner(layout, *overrides, trainable=True):
    torch.manual_seed(9)
    return learner_of(load_config(None, ["parallel.micro_batch_size=4", *overrides]), layout, trainable=trainable)


def perturb_routers(learner, std=0.05, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in learner.taps.routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * std)


def router_log_probs(learner, batch):
    """Independent of the taps: capture each router's input with a pre-hook and compute
    log softmax(hidden @ W^T) over all experts: [L][S*B, E] (the router's token order)."""
    seen = []
    hooks = [r.register_forward_pre_hook(lambda m, args: seen.append((m, args[0].detach())))
             for r in learner.taps.routers]
    tokens = batch.tokens_BS
    with torch.no_grad():
        learner.gpt(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                    attention_mask=None)
    for h in hooks:
        h.remove()
    return [torch.log_softmax(x.reshape(-1, x.shape[-1]).float() @ m.weight.float().t(), -1) for m, x in seen]


def to_router_order(t_BS):
    """[B, S, ...] -> [S*B, ...] (megatron routes tokens s-major)."""
    return t_BS.transpose(0, 1).reshape(-1, *t_BS.shape[2:])


def test_capture_stores_tokens_x_layers_x_k_not_experts(layout):
    from moe_rl.learner import RoutingPlan

    learner = make_learner(layout)
    batch, _ = fixed_batch()
    rec = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    B, S = batch.batch_size, batch.seq_len
    assert rec.ids_RSLK.shape == (B, S, L_MOE, K) and rec.ids_RSLK.dtype == torch.uint8
    assert rec.logp_RSLK.shape == (B, S, L_MOE, K) and rec.logp_RSLK.dtype == torch.float32
    assert rec.fresh_ids_RSLK is None
    assert rec.nbytes == B * S * L_MOE * K * (1 + 4)  # never B*S*E
    # ids are distinct sorted sets; log-probs are log of probabilities
    assert (rec.ids_RSLK[..., 1] > rec.ids_RSLK[..., 0]).all()
    assert (rec.logp_RSLK <= 0).all() and (rec.logp_RSLK > -30).all()
    # and at every real token they are the router's top-k under log softmax over all
    # experts; positions past a sequence hold the placeholder ids 0..K-1 (padding is never
    # recorded: it routes to `spread_topk` ids)
    logr = router_log_probs(learner, batch)
    real_BS = torch.arange(S)[None, :] < batch.total_lens_B[:, None]
    real = to_router_order(real_BS)
    assert (rec.ids_RSLK[~real_BS] == torch.arange(K, dtype=torch.uint8)).all()
    for layer in range(L_MOE):
        top = torch.topk(logr[layer], K, dim=-1)
        ids = to_router_order(rec.ids_RSLK[:, :, layer]).long()
        assert torch.equal(ids[real], top.indices.sort(-1).values[real])
        assert torch.allclose(to_router_order(rec.logp_RSLK[:, :, layer])[real],
                              logr[layer].gather(1, ids)[real], atol=1e-6)


def test_gamma_is_one_when_the_router_did_not_move(layout):
    from moe_rl.learner import RoutingPlan

    learner = make_learner(layout)
    batch, _ = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    gamma = learner.score_whole(batch, routing=RoutingPlan(old=old)).router_shift_BT
    mask = batch.response_mask()
    assert (gamma[mask] - 1).abs().max() <= 1e-7


def test_gamma_matches_a_hand_computation_after_a_perturbation(layout):
    from moe_rl.learner import RoutingPlan

    learner = make_learner(layout)
    batch, _ = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    perturb_routers(learner)
    gamma = learner.score_whole(batch, routing=RoutingPlan(old=old)).router_shift_BT
    logr_new = router_log_probs(learner, batch)
    # gamma_n = exp(-(1/L) sum_l (1/K) sum_k |log r_new(e_lk) - log r_old(e_lk)|)
    drift = torch.zeros(batch.seq_len * batch.batch_size)
    for layer in range(L_MOE):
        ids = to_router_order(old.ids_RSLK[:, :, layer]).long()
        old_lp = to_router_order(old.logp_RSLK[:, :, layer])
        drift += (logr_new[layer].gather(1, ids) - old_lp).abs().mean(-1)
    gamma_pos_BS = torch.exp(-drift / L_MOE).reshape(batch.seq_len, batch.batch_size).t()
    # response token j is produced by position prompt_len + j - 1
    for b in range(batch.batch_size):
        p0 = int(batch.prompt_lens_B[b])
        for j in range(int(batch.response_lens_B[b])):
            assert gamma[b, j] == pytest.approx(float(gamma_pos_BS[b, p0 + j - 1]), abs=1e-6)
    mask = batch.response_mask()
    assert gamma[mask].min() < 0.99  # the perturbation was felt


def test_replay_routes_exactly_the_recorded_ids_and_fresh_routing_differs(layout):
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    learner = make_learner(layout)
    batch, _ = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    perturb_routers(learner)
    fresh = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    replayed = learner.score_whole(batch, routing=RoutingPlan(capture=True, replay=ReplayIds.from_record(old))).record
    assert not torch.equal(fresh.ids_RSLK, old.ids_RSLK)
    assert torch.equal(replayed.ids_RSLK, old.ids_RSLK)
    # under replay the router's own choice is kept too; in the first MoE layer (same input
    # as without replay) it is fresh routing, deeper layers see replayed hidden states
    assert torch.equal(replayed.fresh_ids_RSLK[:, :, 0], fresh.ids_RSLK[:, :, 0])
    # log-probs of the replayed experts come from the current router (checked where the
    # router's input does not depend on replay: the first MoE layer)
    logr = router_log_probs(learner, batch)
    ids = to_router_order(old.ids_RSLK[:, :, 0]).long()
    real = to_router_order(torch.arange(batch.seq_len)[None, :] < batch.total_lens_B[:, None])
    assert torch.allclose(to_router_order(replayed.logp_RSLK[:, :, 0])[real], logr[0].gather(1, ids)[real],
                          atol=1e-6)
    assert not torch.allclose(replayed.logp_RSLK, old.logp_RSLK)


def test_a_replay_megatron_does_not_take_stops_the_pass_naming_the_layer(layout, monkeypatch):
    """If megatron's router ignored the replayed ids (here: its RouterReplay computes its own
    top-k whatever the action), the pass's check (its device counters, read once the pass is
    over) raises, naming the first MoE layer and how many replayed tokens it routed elsewhere:
    in layer 0 (whose input replay cannot change) the tokens whose fresh top-k differs from
    the record's."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moe_rl.learner import RoutingPlan
    from moe_rl.learner.routing import ReplayError
    from moe_rl.routing.record import ReplayIds

    learner = make_learner(layout)
    batch, _ = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    perturb_routers(learner)
    fresh = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    real_RS = torch.arange(batch.seq_len)[None, :] < batch.total_lens_B[:, None]
    moved = (fresh.ids_RSLK[:, :, 0] != old.ids_RSLK[:, :, 0]).any(-1) & real_RS
    assert int(moved.sum()) > 0
    monkeypatch.setattr(RouterReplay, "get_replay_topk",
                        lambda self, scores, topk, num_groups, group_topk, default: default(scores, topk,
                                                                                           num_groups, group_topk))
    with pytest.raises(ReplayError, match=f"MoE layer 0 used other experts than the replayed ones on "
                                          f"{int(moved.sum())} of {int(real_RS.sum())} replayed tokens"):
        learner.score_whole(batch, routing=RoutingPlan(replay=ReplayIds.from_record(old)))


HOST_READS = ("__bool__", "__int__", "__float__", "item", "tolist", "cpu", "nonzero")


def test_a_router_call_reads_nothing_back_from_the_device(layout, monkeypatch):
    """Each tap runs inside every MoE layer's forward (and, under recompute, its backward): a
    value read back to the host there would make a GPU drain its queue at every layer. Under
    the busiest plan (capture, router shift, R2 replay, padding spread, full recompute) no
    tensor is read back inside any router call; what the pass needs is read once the pass
    is over. (Mask indexing, another hidden wait, is not caught here: test_host_overhead
    counts every kind of wait in a whole micro-batch.)"""
    from moe_rl_testing.learner_utils import replayed_updates

    learner = make_learner(layout, "model.recompute=full")
    reads: list[str] = []
    real = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def reading(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return real[name](self, *args, **kwargs)
        return read

    calls = {"n": 0}
    for router in learner.taps.routers:
        def watched(*args, _tap=router.routing, **kwargs):
            calls["n"] += 1
            with monkeypatch.context() as m:
                for name in HOST_READS:
                    m.setattr(torch.Tensor, name, reading(name))
                return _tap(*args, **kwargs)
        router.routing = watched
    replayed_updates(learner)
    # 4 layers x (the scoring pass's 3 micro-batches + 2 updates of 3, each routed twice)
    assert calls["n"] == 4 * (3 + 2 * 3 * 2)
    assert reads == []


def fixed_id_routing(ids_NK):
    """An independent router for the gradient check: Qwen3 gate weights (softmax over the
    logits of the given experts), scattered to [N, E], no top-k."""
    def routing(logits, padding_mask=None):
        logits_NE = logits.reshape(-1, logits.shape[-1])
        probs_NK = torch.softmax(logits_NE.gather(1, ids_NK).float(), dim=-1).type_as(logits_NE)
        probs = torch.zeros_like(logits_NE).scatter(1, ids_NK, probs_NK)
        routing_map = torch.zeros_like(logits_NE, dtype=torch.bool).scatter(1, ids_NK, True)
        return probs, routing_map
    return routing


def test_router_still_learns_under_replay(layout):
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    learner = make_learner(layout, "parallel.micro_batch_size=12")
    batch, adv_B = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    perturb_routers(learner)
    learner.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B},
                             routing=RoutingPlan(replay=ReplayIds.from_record(old)))
    got = [r.weight.main_grad.clone() for r in learner.taps.routers]
    # independent: swap every router's routing for the fixed-id function, plain autograd
    learner.model.zero_grad_buffer()
    learner.optimizer.zero_grad()
    taps = [r.routing for r in learner.taps.routers]
    try:
        for layer, r in enumerate(learner.taps.routers):
            r.routing = fixed_id_routing(to_router_order(old.ids_RSLK[:, :, layer]).long())
        tokens = batch.tokens_BS
        logits = learner.gpt(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                             attention_mask=None).float()
        logp_BSV = torch.log_softmax(logits, -1)
        loss = 0.0
        for b in range(batch.batch_size):
            p0 = int(batch.prompt_lens_B[b])
            for j in range(int(batch.response_lens_B[b])):
                loss = loss - adv_B[b] * logp_BSV[b, p0 + j - 1, tokens[b, p0 + j]]
        (loss / batch.response_lens_B.sum()).backward()
    finally:
        for r, tap in zip(learner.taps.routers, taps):
            r.routing = tap
    want = [r.weight.main_grad.clone() for r in learner.taps.routers]
    for g, w in zip(got, want):
        assert g.abs().max() > 1e-5  # non-zero: gate weights keep their gradient
        assert torch.allclose(g, w, atol=1e-7, rtol=1e-5)


def test_r3_alignment_replays_sampler_ids_onto_the_intended_tokens(layout):
    from moe_rl.batch import TokenBatch
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    learner = make_learner(layout)
    prompts = [[5, 6, 7], [9], [11, 12, 13, 14, 15]]
    responses = [[20, 21], [30, 31, 32, 33], []]
    batch = TokenBatch.from_lists(prompts, responses, response_width=4)
    rng = np.random.default_rng(0)
    routed = []  # vLLM layout: [prompt_len + response_len - 1, L, K], prompt included
    for p, r in zip(prompts, responses):
        n = len(p) + len(r) - 1
        routed.append(np.stack([rng.choice(E, size=(L_MOE, K), replace=False) for _ in range(n)]))
    ids, valid = align_sampler_routing(routed, batch, num_experts=E)
    assert valid.sum(1).tolist() == [4, 4, 4] and not valid[0, 4:].any() and not valid[2, 4]
    fresh = learner.score_whole(batch, routing=RoutingPlan(capture=True)).record
    got = learner.score_whole(batch, routing=RoutingPlan(
        capture=True, replay=ReplayIds(torch.arange(3), ids, valid))).record
    for b, arr in enumerate(routed):
        n = arr.shape[0]
        want = torch.as_tensor(np.sort(arr, axis=-1))
        assert torch.equal(got.ids_RSLK[b, :n].long(), want), b
        # positions vLLM never fed (the last token, right padding) route afresh
        assert torch.equal(got.ids_RSLK[b, n:], fresh.ids_RSLK[b, n:])


def test_r3_alignment_rejects_a_wrong_length():
    from moe_rl.batch import TokenBatch

    batch = TokenBatch.from_lists([[1, 2]], [[3, 4, 5]])
    with pytest.raises(ValueError, match=r"routed_experts\[0\] has shape \(5, 4, 2\); expected \[4, 4, 2\]"):
        align_sampler_routing([np.zeros((5, L_MOE, K), dtype=np.int64)], batch, num_experts=E)
    with pytest.raises(ValueError, match="outside"):
        align_sampler_routing([np.full((4, L_MOE, K), 9)], batch, num_experts=E)


def test_a_reference_model_in_the_same_process_does_not_break_replay(layout):
    from moe_rl.learner import RoutingPlan
    from moe_rl.routing.record import ReplayIds

    policy = make_learner(layout)
    ref = make_learner(layout, trainable=False)
    batch, _ = fixed_batch()
    old = policy.score_whole(batch, routing=RoutingPlan(capture=True)).record
    ref_before = ref.logprobs(batch)
    perturb_routers(policy)
    replayed = policy.score_whole(batch, routing=RoutingPlan(capture=True, replay=ReplayIds.from_record(old))).record
    assert torch.equal(replayed.ids_RSLK, old.ids_RSLK)
    assert torch.equal(ref.logprobs(batch), ref_before)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    assert not any(r.router_replay in RouterReplay.global_router_replay_instances
                   for r in policy.taps.routers + ref.taps.routers)


@pytest.mark.multiproc
@pytest.mark.slow
def test_record_gamma_and_replay_agree_across_layouts(tmp_path):
    torchrun("routing_worker.py", 4, str(tmp_path))  # (the one-process reference on rank 0 first)
    ref = torch.load(tmp_path / "reference.pt")
    for mbs in (12, 6, 3):  # 1, 2, 4 micro-batches
        assert torch.equal(ref[f"replayed_ids_mbs{mbs}"], ref["A_ids"])
    assert (ref["fresh_ids"] != ref["A_ids"]).any()
    for name, r in torch.load(tmp_path / "layouts.pt").items():
        assert r["A_ids_mismatch"] == 0 and r["A_logp_err"] <= 1e-6, (name, r)
        assert r["gamma_err"] <= 1e-6, (name, r)
        assert r["replay_mismatch"] == 0 and r["fresh_vs_ref_mismatch"] == 0, (name, r)
        assert r["fresh_vs_A_changed"] == 1.0, (name, r)


def test_r3_alignment_picks_the_moe_layers_out_of_vllms_decoder_layer_axis():
    from moe_rl.batch import TokenBatch

    batch = TokenBatch.from_lists([[1, 2]], [[3, 4]])
    # vLLM: one row per decoder layer; layer 0 is dense (zeros), layers 1..4 are MoE
    arr = np.zeros((3, 5, K), dtype=np.int64)
    for layer in range(1, 5):
        arr[:, layer] = [layer, layer + 2]
    ids, valid = align_sampler_routing([arr], batch, num_experts=E, moe_layers=[1, 2, 3, 4])
    assert ids.shape == (1, 4, 4, K) and valid[0].tolist() == [True, True, True, False]
    assert ids[0, 0, :, 0].tolist() == [1, 2, 3, 4] and ids[0, 0, :, 1].tolist() == [3, 4, 5, 6]


def test_on_policy_shortcut_scores_equal_the_old_logprob_pass(layout):
    """One update per rollout: the update's forward runs at the weights that scored the
    batch, so its logprobs and routing record equal the old-logprob pass's exactly, and the
    trainer skips that pass (`PolicyLossFn(on_policy=True)`, `UpdateResult.logp_BT`)."""
    from moe_rl.learner import RoutingPlan

    learner = make_learner(layout)
    batch, adv_B = fixed_batch()
    old = learner.score_whole(batch, routing=RoutingPlan(capture=True))
    own = learner.update(learner.own_rows(batch, {"adv_B": adv_B}), reinforce_loss(batch),
                         RoutingPlan(capture=True))
    assert torch.equal(own.logp_BT, old.logp_BT)
    assert torch.equal(own.record.rows, old.record.rows)
    assert torch.equal(own.record.ids_RSLK, old.record.ids_RSLK)
    assert torch.equal(own.record.logp_RSLK, old.record.logp_RSLK)
    # ... and the update did happen: the next score differs
    assert not torch.equal(learner.score_whole(batch).logp_BT, old.logp_BT)
