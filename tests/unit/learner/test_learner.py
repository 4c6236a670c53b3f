"""The learner in one process: logprobs, gradients and the Adam step against plain torch."""

import dataclasses
import gc
import weakref

import pytest
import torch

from moe_rl.config import load_config
from moe_rl_testing.learner_utils import fixed_batch, learner_of, reinforce_loss


@pytest.fixture(scope="module")
def learner_factory(megatron_world):
    from moe_rl.learner import Learner, parallel_layout

    stack = []

    def make(*overrides: str) -> "Learner":
        cfg = load_config(None, ["parallel.micro_batch_size=4", *overrides])
        if not stack:
            ctx = parallel_layout(cfg.parallel, seed=5)
            stack.append((ctx, ctx.__enter__()))
        torch.manual_seed(5)
        return learner_of(cfg, stack[0][1])

    yield make
    for ctx, _ in stack:
        ctx.__exit__(None, None, None)


def plain_logprobs(learner, batch, temperature=1.0):
    """Reference: the model's logits, log-softmax, gather at each response token."""
    tokens = batch.tokens_BS
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = learner.gpt(input_ids=tokens, position_ids=pos, attention_mask=None).float()
    logp_BSV = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.zeros(batch.batch_size, batch.response_width)
    for b in range(batch.batch_size):
        p0 = int(batch.prompt_lens_B[b])
        for j in range(int(batch.response_lens_B[b])):
            out[b, j] = logp_BSV[b, p0 + j - 1, tokens[b, p0 + j]]
    return out


def main_grads(learner) -> dict[str, torch.Tensor]:
    return {n: p.main_grad.clone() for n, p in learner.gpt.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_plain_forward(learner_factory, temperature):
    learner = learner_factory()
    batch, _ = fixed_batch()
    got = learner.logprobs(batch, temperature=temperature)
    with torch.no_grad():
        want = plain_logprobs(learner, batch, temperature)
    assert got.shape == (12, 10)
    assert (got - want).abs().max() <= 1e-5
    assert got[~batch.response_mask()].abs().max() == 0
    assert (got[batch.response_mask()] < 0).all()


def test_bad_temperature_is_refused(learner_factory):
    learner = learner_factory()
    batch, _ = fixed_batch()
    with pytest.raises(ValueError, match="temperature"):
        learner.logprobs(batch, temperature=0.0)


def test_a_trainable_learner_needs_its_schedules_length():
    """An optimizer section makes a learner trainable, and then its schedule's length is the
    caller's count: none (or < 1) is a one-line error, before anything is built; a frozen
    learner (no optimizer) takes no count."""
    from moe_rl.learner import Learner

    cfg = load_config(None, [])
    for bad in (None, 0):
        with pytest.raises(ValueError, match="trainable learner needs total_updates >= 1"):
            Learner(cfg.model, cfg.parallel, None, optimizer=cfg.optimizer, total_updates=bad)
    with pytest.raises(ValueError, match="without an optimizer is frozen"):
        Learner(cfg.model, cfg.parallel, None, total_updates=10)


def test_gradient_equals_autograd_of_the_whole_batch_loss(learner_factory):
    learner = learner_factory()
    batch, adv_B = fixed_batch()
    learner.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    got = main_grads(learner)
    learner.model.zero_grad_buffer()
    logp = plain_logprobs(learner, batch)
    loss = -(adv_B[:, None] * logp).sum() / batch.response_lens_B.sum()
    loss.backward()
    want = main_grads(learner)
    for name in got:
        assert torch.allclose(got[name], want[name], atol=1e-7, rtol=1e-5), name
    assert max(g.abs().max() for g in got.values()) > 1e-4


def test_a_discarded_learner_is_freed_after_a_training_step(learner_factory):
    """A learner that trained once and is dropped leaves nothing behind: megatron's token
    dispatcher kept the last forward's routing tensors, whose autograd graph held DDP's
    hooks and so the whole model (on an H100 each discarded learner kept ~8 GiB)."""
    learner = learner_factory()
    batch, adv_B = fixed_batch()
    learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    model = weakref.ref(learner.gpt)
    del learner
    gc.collect()
    assert model() is None


def test_the_weight_stream_reads_the_weights_after_each_update(learner_factory):
    """The learner's shard list is built once and kept (views of the parameters): after an
    update the HF stream carries the new weights, the same as a fresh build of the list."""
    from moe_rl.learner.export import hf_named_tensors
    from moe_rl.learner.gather import _SHARDS_ATTR

    learner = learner_factory()
    before = {n: t.clone() for n, t in hf_named_tensors(learner)}
    assert _SHARDS_ATTR in learner.gpt.__dict__  # kept: every piece is a view
    batch, adv_B = fixed_batch()
    learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    after = dict(hf_named_tensors(learner))
    del learner.gpt.__dict__[_SHARDS_ATTR]
    fresh = dict(hf_named_tensors(learner))
    assert after.keys() == fresh.keys() == before.keys()
    assert all(torch.equal(after[n], fresh[n]) for n in after)
    assert sum(not torch.equal(after[n], before[n]) for n in after) > len(after) // 2


@pytest.mark.parametrize("mbs", [1, 3, 12])
def test_micro_batching_does_not_change_the_gradient(learner_factory, mbs):
    batch, adv_B = fixed_batch()
    whole = learner_factory("parallel.micro_batch_size=12")
    whole.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    split = learner_factory(f"parallel.micro_batch_size={mbs}")
    split.gpt.load_state_dict(whole.gpt.state_dict())
    split.forward_backward(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    a, b = main_grads(whole), main_grads(split)
    assert max((a[n] - b[n]).abs().max() for n in a) <= 1e-6


def test_first_adam_step_matches_the_closed_form(learner_factory):
    """Adam's first step is p - lr * g / (|g| + eps) (bias-corrected moments of one grad),
    with g the gradient clipped to global norm 0.5."""
    learner = learner_factory("optimizer.lr=1e-2", "optimizer.clip_grad=0.5", "optimizer.adam_eps=1e-3")
    batch, adv_B = fixed_batch()
    before = {n: p.detach().clone() for n, p in learner.gpt.named_parameters()}
    metrics = learner.train_step(batch, reinforce_loss(batch), extras={"adv_B": adv_B})
    after = {n: p.detach().clone() for n, p in learner.gpt.named_parameters()}
    # the reference gradient, from plain autograd at the weights before the step
    learner.model.zero_grad_buffer()
    learner.optimizer.zero_grad()  # the fp32 optimizer points .grad at main_grad
    with torch.no_grad():
        for n, p in learner.gpt.named_parameters():
            p.copy_(before[n])
    logp = plain_logprobs(learner, batch)
    (-(adv_B[:, None] * logp).sum() / batch.response_lens_B.sum()).backward()
    grads = main_grads(learner)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > 0.5  # so the clip is active
    coeff = 0.5 / (norm + 1e-6)
    for n in before:
        g = grads[n] * coeff
        expected = before[n] - 1e-2 * g / (g.abs() + 1e-3)
        assert torch.allclose(after[n], expected, atol=1e-6), n
    assert metrics["update_skipped"] == 0.0


def test_config_errors_come_before_any_process_group_work():
    from moe_rl.config import ConfigError, load_config, validate_layout

    with pytest.raises(ConfigError, match=r"num_experts=6 is not divisible by parallel\.expert_model_parallel_size=4"):
        load_config(None, ["model.num_experts=6", "parallel.expert_model_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 is not divisible by parallel\.tensor_model_parallel_size=3"):
        load_config(None, ["parallel.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError, match="sequence_parallel=false"):
        load_config(None, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false"])
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        validate_layout(load_config(None, ["parallel.tensor_model_parallel_size=2"]), 3)
    assert validate_layout(load_config(None, ["parallel.expert_model_parallel_size=2"]), 4) == 4
    assert dataclasses.is_dataclass(load_config(None))
