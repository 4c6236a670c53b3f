"""Full activation recompute (`model.recompute=full`) in the megatron learner.

Recompute re-runs every transformer layer in the backward, so each router routes twice per
training micro-batch; the routing taps force the re-run to the ids the forward used and
record, measure and count nothing there. Shown here: an update with routing capture,
router-shift statistics and R2 replay is the same, bit for bit, with and without recompute
(one process in-process; TP2, EP2 and PP2 under torchrun), the routers really re-ran, the
expert-bias count sees each real token once, and the forward keeps only the layers' inputs.
"""

import pytest
import torch

from moe_rl.config import load_config
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.learner_utils import (
    counting_router_reruns,
    fixed_batch,
    learner_of,
    reinforce_loss,
    replayed_updates,
)

BASE = ["parallel.micro_batch_size=4"]


@pytest.fixture(scope="module")
def layout(megatron_world):
    from moe_rl.learner import parallel_layout

    with parallel_layout(load_config(None, BASE).parallel, seed=9) as lay:
        yield lay


@pytest.fixture
def reruns():
    with counting_router_reruns() as count:
        yield count


def make_learner(layout, *overrides):
    torch.manual_seed(9)
    return learner_of(load_config(None, [*BASE, *overrides]), layout)


def test_an_update_is_bit_identical_with_full_recompute(layout, reruns):
    plain = make_learner(layout)
    a = replayed_updates(plain)
    assert reruns["n"] == 0
    full = make_learner(layout, "model.recompute=full")
    b = replayed_updates(full)
    # every router of every micro-batch re-ran once per update: 4 MoE layers x 3 micro-batches x 2
    assert b[0].metrics["microbatches"] == 3 and reruns["n"] == 4 * 3 * 2
    for x, y in zip(a, b):
        assert {k: v for k, v in x.metrics.items() if k != "tokens_per_s"} == \
            {k: v for k, v in y.metrics.items() if k != "tokens_per_s"}
        assert torch.equal(x.logp_BT, y.logp_BT)
        assert torch.equal(x.record.ids_RSLK, y.record.ids_RSLK)
        assert torch.equal(x.record.logp_RSLK, y.record.logp_RSLK)
    assert a[1].metrics["routing/flip_rate_mean"] > 0.5  # (the shift statistics measured something)
    for (name, p), q in zip(plain.gpt.named_parameters(), full.gpt.parameters()):
        assert torch.equal(p, q), name
    assert (a[1].logp_BT - a[0].logp_BT).abs().max() > 1e-3  # (the updates moved the weights)


def test_the_expert_bias_counts_each_real_token_once_under_recompute(layout, reruns, monkeypatch):
    """Aux-loss-free balancing counts the tokens each expert took in a step. megatron-core 0.16
    counts whenever gradients are on, which a recomputed layer's re-run is; the taps count in
    the forward only: each of the 86 real tokens, K = 2 times per layer, with and without."""
    import importlib

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # (the package re-exports
    # a function under the module's name)
    counts = []
    real = finalize.get_updated_expert_bias

    def spy(tokens_per_expert, expert_bias, rate):
        counts.append(tokens_per_expert.clone())
        return real(tokens_per_expert, expert_bias, rate)

    monkeypatch.setattr(finalize, "get_updated_expert_bias", spy)
    batch, adv_B = fixed_batch()
    real_tokens = int(batch.total_lens_B.sum())
    sigmoid = ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
               "model.moe_router_bias_update_rate=0.001"]
    biases = []
    for extra in ([], ["model.recompute=full"]):
        learner = make_learner(layout, *sigmoid, *extra)
        learner.update(learner.own_rows(batch, {"adv_B": adv_B}), reinforce_loss(batch))
        biases.append(torch.stack([r.expert_bias.clone() for r in learner.taps.routers]))
    assert reruns["n"] == 4 * 3
    assert len(counts) == 2 and torch.equal(counts[0], counts[1])
    assert counts[1].shape == (4, 8) and (counts[1].sum(dim=1) == 2 * real_tokens).all()
    assert torch.equal(biases[0], biases[1])


def saved_by_the_forward(learner, update) -> int:
    """Bytes of the storages autograd saves while `update()` runs, outside any backward (the
    forward's, not a recomputed layer's own), parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in learner.gpt.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        update()
    return sum(storages.values())


def test_the_forward_keeps_only_each_layers_input(layout):
    """With recompute, each of the 4 layers keeps its [tokens, 1, h] input and little else, a
    small fraction of what the layers keep without it."""
    batch, adv_B = fixed_batch()
    saved = {}
    for mode in ("none", "full"):
        learner = make_learner(layout, "parallel.micro_batch_size=12", f"model.recompute={mode}")
        rows = learner.own_rows(batch, {"adv_B": adv_B})
        saved[mode] = saved_by_the_forward(learner, lambda: learner.update(rows, reinforce_loss(batch)))  # noqa: B023
    inputs = 4 * int(batch.total_lens_B.sum()) * 64 * 4  # layers x tokens x h x fp32 (one packed micro-batch)
    assert inputs <= saved["full"] <= 2 * inputs
    assert saved["full"] < saved["none"] / 10


@pytest.mark.multiproc
@pytest.mark.slow
def test_recompute_is_bit_identical_at_tp2_ep2_pp2(tmp_path):
    torchrun("recompute_layouts.py", 2, str(tmp_path))
    result = torch.load(tmp_path / "recompute_layouts.pt")
    assert set(result) == {"tp2", "ep2", "pp2"}
    for name, r in result.items():
        assert r["worst"] == {"logp": 0.0, "metrics": 0.0, "params": 0.0, "record_ids": 0.0,
                              "record_logp": 0.0}, name
        assert r["reruns_plain"] == 0
        assert r["reruns_full"] == r["routers"] * r["microbatches"] * 2, name
        assert "routing/gamma_mean" in r["metrics_keys"]
    assert result["pp2"]["microbatches"] == 6 and result["pp2"]["routers"] == 2  # 1F1B: 2 stages x 2 layers
