"""The learner's gradient buffers and optimizer states to host memory and back
(`optimizer.offload_during_rollout`): the device storage is really released, every view
(parameters' main_grad, the optimizer's states) survives, the round trip is bit-exact and
training continues as if nothing happened."""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss


def test_offload_needs_a_colocated_synchronous_run():
    with pytest.raises(ConfigError, match="offload_during_rollout is for colocated, synchronous runs"):
        load_config(None, ["optimizer.offload_during_rollout=true", "sampler.placement=separate",
                           "sampler.engine_ranks=1"])


def test_the_round_trip_releases_the_storage_and_is_bit_exact(megatron_world):
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.offload import HostOffload, offloadable_tensors

    cfg = load_config(None, [])
    batch, adv_B = fixed_batch()
    with parallel_layout(cfg.parallel, seed=2) as layout:
        torch.manual_seed(2)
        moved, kept = learner_of(cfg, layout), learner_of(cfg, layout)
        kept.model.load_state_dict(moved.model.state_dict())
        for learner in (moved, kept):
            learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})  # Adam states exist
        before = [t.clone() for t in offloadable_tensors(moved)]
        off = HostOffload(moved)
        released = off.offload()
        assert released == sum(t.numel() * t.element_size() for t in before) > 0
        assert all(t.untyped_storage().nbytes() == 0 for t, _, _ in off._host)
        off.reload()
        after = list(offloadable_tensors(moved))
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        m1 = moved.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
        m2 = kept.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
        assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
        for p, q in zip(moved.model.parameters(), kept.model.parameters()):
            assert torch.equal(p, q)
