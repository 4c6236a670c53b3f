"""PPO with a learned critic (issue 25): the critic's values against a plain forward, the
step's token advantages against `moe_rl.programs.ppo.gae`'s formulas, the value head's gradient against
its closed form, the critic's layout parity (TP2, EP2, PP2), the recipe checks, and a
killed PPO run that resumes bit-exactly (actor, critic, both optimizers)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.config import ConfigError, load_config, to_dict
from moe_rl.programs.ppo.critic_stage import OLD_VALUES, RETURNS, ValueLossFn
from moe_rl.programs.ppo.gae import gae, masked_whiten, token_rewards, whiten_by_moments
from moe_rl.rollout.types import SCORE
from moe_rl_testing import ROOT, forked
from moe_rl_testing.learner_utils import fixed_batch, plain_values

RECIPE = ROOT / "examples" / "tiny_ppo.yaml"
PPO = ["rl.advantage=gae", "rl.objective=grpo", "parallel.micro_batch_size=4"]


@pytest.fixture(scope="module")
def critic_factory(megatron_world):
    from moe_rl.learner import parallel_layout
    from moe_rl.programs.ppo.critic_stage import CriticStage

    stack = []

    def make(*overrides: str) -> CriticStage:
        cfg = load_config(None, [*PPO, *overrides])
        if not stack:
            ctx = parallel_layout(cfg.parallel, seed=5)
            stack.append((ctx, ctx.__enter__()))
        torch.manual_seed(5)
        stage = CriticStage(cfg.critic, cfg.rl, cfg.model, cfg.parallel, stack[0][1], run_steps=cfg.run.steps,
                            updates=4)
        stage.cfg = cfg  # (the recipe it was built from, for the tests' own checks)
        return stage

    yield make
    for ctx, _ in stack:
        ctx.__exit__(None, None, None)


def set_head(critic, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.gpt.value_head.weight.copy_(torch.randn(critic.gpt.value_head.weight.shape, generator=g) * 0.3)
        critic.gpt.value_head.bias.fill_(0.25)


def test_whitening_over_the_step_equals_the_one_rank_form():
    """Each data-parallel rank whitens its rows with the moments summed over every rank's:
    the result equals whitening all rows on one rank."""
    g = torch.Generator().manual_seed(1)
    adv_BT = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask_BT = torch.rand(6, 9, generator=g) < 0.7
    halves = [(adv_BT[:2][mask_BT[:2]]), (adv_BT[2:][mask_BT[2:]])]  # two ranks' valid tokens
    n, s, ss = (sum(f(a) for a in halves) for f in (lambda a: float(a.numel()), torch.sum, lambda a: (a * a).sum()))
    got = torch.cat([whiten_by_moments(adv_BT[:2], mask_BT[:2], n, s, ss),
                     whiten_by_moments(adv_BT[2:], mask_BT[2:], n, s, ss)])
    assert (got - masked_whiten(adv_BT, mask_BT)).abs().max() <= 1e-12
    assert got[~mask_BT].abs().max() == 0


def test_critic_starts_at_zero_with_a_frozen_output_layer(critic_factory):
    stage = critic_factory()
    critic = stage.critic
    tokens, _ = fixed_batch()
    assert critic.values(critic.own_rows(tokens)).abs().max() == 0  # the value head starts at zero
    trained = {n for n, p in critic.gpt.named_parameters() if p.requires_grad}
    assert "value_head.weight" in trained and "value_head.bias" in trained
    assert "output_layer.weight" not in trained  # bypassed: no gradient, no optimizer state
    params = {id(p) for group in critic.optimizer.param_groups for p in group["params"]}
    assert id(critic.gpt.output_layer.weight) not in params
    assert float(critic.optimizer.param_groups[0]["lr"]) == pytest.approx(stage.cfg.critic.optimizer.lr)


@pytest.mark.parametrize("kl_in_reward,whiten", [(False, True), (True, False)])
def test_step_advantages_follow_the_documents_formulas(critic_factory, kl_in_reward, whiten):
    stage = critic_factory("rl.gae_gamma=0.9", "rl.gae_lambda=0.8", f"rl.kl_in_reward={kl_in_reward}",
                           "rl.kl_coef=0.05", f"rl.whiten_advantages={whiten}")
    critic = stage.critic
    set_head(critic, 3)
    tokens, _ = fixed_batch()
    g = torch.Generator().manual_seed(4)
    score_B = torch.rand(tokens.batch_size, generator=g)
    old_BT, ref_BT = (-torch.rand(tokens.batch_size, tokens.response_width, generator=g) for _ in range(2))
    mask_BT = tokens.response_mask()
    batch = critic.own_rows(tokens, {SCORE: score_B})
    batch = dataclasses.replace(batch, old_logp_BT=old_BT * mask_BT, ref_logp_BT=ref_BT * mask_BT)
    out, metrics = stage.advantages(batch, lambda x: [x])

    values_BT = plain_values(critic, tokens)
    assert (out.extras[OLD_VALUES] - values_BT).abs().max() <= 1e-5
    kl_BT = (old_BT - ref_BT) * mask_BT if kl_in_reward else None
    rewards_BT = token_rewards(score_B, mask_BT, kl_BT, 0.05 if kl_in_reward else 0.0)
    adv_BT, returns_BT = gae(rewards_BT, values_BT.double(), mask_BT, 0.9, 0.8)
    assert (out.extras[RETURNS] - returns_BT).abs().max() <= 1e-5
    want = masked_whiten(adv_BT, mask_BT) if whiten else adv_BT
    assert out.adv_B.shape == mask_BT.shape and (out.adv_B - want).abs().max() <= 1e-5
    r, d = returns_BT[mask_BT], (returns_BT - values_BT)[mask_BT]
    assert metrics["critic/explained_variance"] == pytest.approx(float(1 - d.var() / r.var()), abs=1e-5)
    assert metrics["critic/returns_mean"] == pytest.approx(float(r.mean()), abs=1e-6)
    assert metrics["critic/values_mean"] == pytest.approx(float(values_BT[mask_BT].mean()), abs=1e-6)


def test_the_adaptive_kl_weight_follows_the_controller_and_is_kept(critic_factory):
    """With rl.kl_target the step's rewards use the current weight, then the weight becomes
    beta (1 + clip(KL / target - 1, -0.2, 0.2) B / horizon), KL the step's mean summed k1
    per response; the next step's rewards use it, and a checkpoint's metadata carries it."""
    tokens, _ = fixed_batch()
    g = torch.Generator().manual_seed(9)
    mask_BT = tokens.response_mask()
    ref_BT = -torch.rand(tokens.batch_size, tokens.response_width, generator=g)
    old_BT = ref_BT + 0.1 * torch.rand(ref_BT.shape, generator=g)  # (k1 > 0 on every token)
    kl_BT = (old_BT.double() - ref_BT.double()) * mask_BT  # (in fp64, as the stage takes it)
    responses = int(mask_BT.any(dim=1).sum())
    kl = float(kl_BT.sum()) / responses
    target = kl / 1.1  # an error of 0.1: inside the clip
    stage = critic_factory("rl.kl_in_reward=true", "rl.kl_coef=0.05", f"rl.kl_target={target!r}",
                           "rl.kl_horizon=20", "rl.whiten_advantages=false")
    set_head(stage.critic, 3)
    score_B = torch.rand(tokens.batch_size, generator=g)
    batch = stage.critic.own_rows(tokens, {SCORE: score_B})
    batch = dataclasses.replace(batch, old_logp_BT=old_BT * mask_BT, ref_logp_BT=ref_BT * mask_BT)
    values_BT = plain_values(stage.critic, tokens).double()
    beta = 0.05
    for _ in range(2):
        out, metrics = stage.advantages(batch, lambda x: [x])
        _, returns_BT = gae(token_rewards(score_B, mask_BT, kl_BT, beta), values_BT, mask_BT, 1.0, 0.95)
        assert (out.extras[RETURNS] - returns_BT).abs().max() <= 1e-5
        assert metrics["critic/kl_coef"] == beta
        assert metrics["critic/kl_per_response"] == pytest.approx(kl, rel=1e-12)
        beta *= 1 + (kl / target - 1) * responses / 20
        assert stage.kl_coef == pytest.approx(beta, rel=1e-12)
    assert stage.state() == {"kl_coef": stage.kl_coef}
    stage.restore({"kl_coef": 0.125})
    assert stage.kl_coef == 0.125
    fixed = critic_factory("rl.kl_in_reward=true", "rl.kl_coef=0.05")
    fixed.restore({"kl_coef": 0.125})  # (a fixed weight is the recipe's, whatever a checkpoint says)
    assert fixed.state() == {} and fixed.kl_coef == 0.05
    fixed.advantages(batch, lambda x: [x])
    assert fixed.kl_coef == 0.05


def test_first_value_gradient_has_its_closed_form(critic_factory):
    """With the value head at zero and V_old = 0: L = coef/N sum_t 0.5 R_t^2 at V = 0, so
    dL/dw = -coef/N sum_t R_t h_t, dL/db = -coef/N sum_t R_t, and the transformer gets none."""
    stage = critic_factory("critic.value_loss_coef=0.5")
    critic = stage.critic
    tokens, _ = fixed_batch()
    mask_BT = tokens.response_mask()
    returns_BT = torch.randn(mask_BT.shape, generator=torch.Generator().manual_seed(6)) * mask_BT
    critic.forward_backward(tokens, ValueLossFn(stage.cfg.critic),
                            extras={OLD_VALUES: torch.zeros_like(returns_BT), RETURNS: returns_BT})
    with torch.no_grad():  # h at each scoring slot: values of a head that reads one coordinate at a time
        pos = torch.arange(tokens.seq_len).expand_as(tokens.tokens_BS)
        hidden_BSH = critic.gpt(input_ids=tokens.tokens_BS, position_ids=pos, attention_mask=None).double()
    want_w = torch.zeros(hidden_BSH.shape[-1], dtype=torch.float64)
    for b in range(tokens.batch_size):
        p0 = int(tokens.prompt_lens_B[b])
        for j in range(int(tokens.response_lens_B[b])):
            want_w -= float(returns_BT[b, j]) * hidden_BSH[b, p0 + j - 1]
    n = float(mask_BT.sum())
    head = critic.gpt.value_head
    assert (head.weight.main_grad.double() - 0.5 * want_w / n).abs().max() <= 1e-6
    assert float(head.bias.main_grad) == pytest.approx(-0.5 * float(returns_BT.sum()) / n, abs=1e-6)
    body = [p.main_grad.abs().max() for name, p in critic.gpt.named_parameters()
            if p.requires_grad and not name.startswith("value_head")]
    assert max(body) == 0


def test_a_ppo_checkpoint_starts_the_next_critic_with_its_value_head(critic_factory, tmp_path):
    """critic.init_checkpoint: a PPO run's checkpoint (a value-pretraining run's) gives the
    critic saved in it, transformer and value head, so the next run's first values are the
    saved critic's; a policy checkpoint gives its transformer with the head at zero."""
    from moe_rl.learner import Learner, save_checkpoint
    from moe_rl.learner.start import load_critic_start

    stage = critic_factory()
    saved = stage.critic
    set_head(saved, 3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # (a transformer unlike the actor's, so that the body is seen to load too)
        for param in saved.gpt.decoder.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.05)
    tokens, _ = fixed_batch()
    want_BT = plain_values(saved, tokens)
    actor = Learner(stage.cfg.model, stage.cfg.parallel, saved.layout)
    save_checkpoint(actor, tmp_path / "ppo", include_optimizer=False, recipe=to_dict(stage.cfg), components={"critic": saved})
    save_checkpoint(actor, tmp_path / "policy", include_optimizer=False, recipe=to_dict(stage.cfg))

    fresh = critic_factory().critic
    assert plain_values(fresh, tokens).abs().max() == 0
    load_critic_start(fresh, str(tmp_path / "ppo"), trust=False)
    assert fresh.step == 0
    assert (plain_values(fresh, tokens) - want_BT).abs().max() <= 1e-6 * want_BT.abs().max()
    load_critic_start(fresh, str(tmp_path / "policy"), trust=False)
    assert plain_values(fresh, tokens).abs().max() == 0  # the head: not in a policy's weights, so zero
    assert float(fresh.gpt.value_head.weight.abs().max()) == 0


@pytest.mark.parametrize("overrides,needle", [
    (["rl.advantage=gae", "rl.objective=rspo"], "rl.objective=rspo is sequence-level"),
    (["rl.advantage=gae", "rl.objective=grpo", "critic.init_checkpoint=/nonexistent"],
     "critic.init_checkpoint=/nonexistent does not exist"),
    (["rl.advantage=nope"], "rl.advantage='nope' is unknown"),
])
def test_preflight_refuses_a_ppo_recipe_that_cannot_run(overrides, needle):
    from moe_rl.preflight import check_advantage

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        check_advantage(load_config(RECIPE, overrides))


@pytest.mark.parametrize("overrides,needle", [
    (["rl.kl_in_reward=true", "rl.advantage=grpo"], "rl.kl_in_reward puts the KL penalty"),
    (["rl.kl_in_reward=true"], "rl.kl_in_reward=true needs rl.kl_coef > 0"),
    (["rl.dynamic_sampling=true"], "rl.dynamic_sampling drops groups"),
    (["critic.warmup_steps=201"], "critic.warmup_steps=201 is more than run.steps=200 (equal: a value-pretraining"),
    (["rl.gae_lambda=1.5"], "rl.gae_gamma and rl.gae_lambda must be in [0, 1]"),
    (["critic.value_clip=0"], "critic.value_clip must be > 0"),
    (["critic.epochs=0"], "critic.epochs must be >= 1"),
    (["critic.num_minibatches=-1"], "critic.num_minibatches must be >= 0 (0: rl.num_minibatches)"),
    (["rl.kl_target=0.1"], "rl.kl_target adapts the weight of the KL in GAE's per-token reward: it needs "
                           "rl.kl_in_reward=true"),
    (["rl.kl_horizon=0"], "rl.kl_target must be >= 0 and rl.kl_horizon >= 1, got 0.0 and 0"),
])
def test_recipe_checks_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    assert needle in str(err.value)


@pytest.mark.slow
@pytest.mark.multiproc
def test_critic_values_and_update_match_one_process_at_tp2_ep2_pp2(tmp_path):
    """The critic's values and one value-loss update at TP2, EP2 (data parallel 2) and PP2
    equal the one-process run's (moe_rl_testing/workers/critic_layouts.py); so do the reward model's
    scores and one update of its pair surrogate on the same value model."""
    from moe_rl_testing.dist_helpers import torchrun

    torchrun("critic_layouts.py", 2, str(tmp_path))  # (the one-process reference on rank 0 first)
    ref = torch.load(tmp_path / "reference.pt")["reference"]
    assert ref["values"].abs().max() > 0.1 and (ref["values_after"] - ref["values"]).abs().max() > 1e-2
    for name, lay in torch.load(tmp_path / "layouts.pt").items():
        assert (lay["values"] - ref["values"]).abs().max() <= 1e-6, name
        assert lay["metrics"]["critic/value_loss"] == pytest.approx(ref["metrics"]["critic/value_loss"], abs=1e-6)
        assert lay["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
        assert (lay["values_after"] - ref["values_after"]).abs().max() <= 1e-4, name
        # (scores up to |2.3| after the critic's update: fp32 sums in another order, relative)
        assert (lay["rm"]["scores"] - ref["rm"]["scores"]).abs().max() <= 1e-6 * ref["rm"]["scores"].abs().max(), name
        assert lay["rm"]["grad_norm"] == pytest.approx(ref["rm"]["grad_norm"], rel=1e-5), name
        assert (lay["rm"]["scores_after"] - ref["rm"]["scores_after"]).abs().max() <= 1e-4, name
    assert (ref["rm"]["scores_after"] - ref["rm"]["scores"]).abs().max() > 1e-2


def _ppo_cmd(out: Path, name: str, *extra: str) -> list[str]:
    small = ["rl.prompts_per_step=4", "rl.group_size=4", "sampler.max_new_tokens=8", "critic.warmup_steps=1",
             "critic.epochs=2", "critic.num_minibatches=3", "run.save_every=1", "run.export_hf=false",
             "logging.progress=false", "logging.tensorboard=false"]
    return [sys.executable, "-m", "moe_rl.train", "--config", str(RECIPE), *small, f"run.output_dir={out}",
            f"run.name={name}", *extra]


@pytest.mark.slow
def test_killed_ppo_run_resumes_bit_exactly(tmp_path):
    """A run that lost its last step (its step-3 checkpoint is the newest left, as after a
    kill during step 4), then run.resume=true: the same metric rows as an uninterrupted run
    and the same final checkpoint, tensor for tensor: actor, critic and both optimizers,
    and the adaptive KL weight. (A real SIGKILL at each point of a save, and the rows logged
    past the newest checkpoint, are test_checkpoint_safety's chaos test.)"""
    from moe_rl.convert.dcp import DcpCheckpoint
    from tests.integration.checkpoints.test_checkpoint_safety import NOISY, child_env

    env = child_env(OMP_NUM_THREADS="1")
    # (with the adaptive KL weight in the reward: its value is part of what a checkpoint keeps)
    kl = ("run.steps=4", "rl.kl_in_reward=true", "rl.kl_coef=0.05", "rl.kl_target=0.001", "rl.kl_horizon=10")
    ref = forked.run(_ppo_cmd(tmp_path, "ref", *kl), cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ref", cut)
    shutil.rmtree(cut / "checkpoints" / "step_000004")
    (cut / "metrics.jsonl").write_text("".join((cut / "metrics.jsonl").read_text().splitlines(True)[:3]))
    resumed = forked.run(_ppo_cmd(tmp_path, "cut", *kl, "run.resume=true"), cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {cut / 'checkpoints' / 'step_000003'}" in resumed.stderr
    rows = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(rows, ref_rows):
        assert {k: v for k, v in a.items() if not k.startswith(NOISY)} == \
               {k: v for k, v in b.items() if not k.startswith(NOISY)}, a["step"]
    assert rows[0]["policy/updates"] == 0 and rows[-1]["policy/updates"] == 2  # the critic's warm-up step
    assert all(r["critic/updates"] == 6 for r in rows)  # critic.epochs x critic.num_minibatches
    a, b = (DcpCheckpoint(tmp_path / run / "checkpoints" / "step_000004") for run in ("cut", "ref"))
    assert a.tensors == b.tensors
    for part in ("critic.value_head.weight", "critic.decoder.", "optimizer.state.exp_avg.critic.", "exp_avg.decoder"):
        assert any(part in k for k in a.tensors), part
    for key in a.tensors:
        assert torch.equal(a.read(key), b.read(key)), key
    meta_a, meta_b = (json.loads((c.path / "moe_rl.json").read_text()) for c in (a, b))
    assert meta_a["critic"] == meta_b["critic"] and meta_a["critic"]["step"] == 24  # 4 steps x 2 epochs x 3 batches
    assert meta_a["scheduler"] == meta_b["scheduler"]
    # the KL weight moved every step (16 responses a step, horizon 10: x(1 +- 0.32) at a clipped error)
    weights = [r["critic/kl_coef"] for r in rows]
    assert weights[0] == 0.05 and len(set(weights)) == 4 and meta_a["kl_coef"] == meta_b["kl_coef"] != weights[-1]


@pytest.mark.slow
def test_a_value_pretraining_run_trains_the_critic_alone_and_starts_the_next_one(tmp_path):
    """critic.warmup_steps = run.steps: every step trains the critic only (the saved actor
    is the starting policy, tensor for tensor); a run started from its checkpoint
    (critic.init_checkpoint) values its first rollouts with that critic, not a zero head."""
    from moe_rl.convert.dcp import DcpCheckpoint
    from tests.integration.checkpoints.test_checkpoint_safety import child_env

    env = child_env(OMP_NUM_THREADS="1")
    value = forked.run(_ppo_cmd(tmp_path, "value", "run.steps=2", "critic.warmup_steps=2"), cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=900)
    assert value.returncode == 0, value.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "value" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy/updates"] for r in rows] == [0, 0] and all(r["critic/updates"] == 6 for r in rows)
    assert rows[0]["critic/values_mean"] == 0  # (the run's own critic starts at a zero head)
    saved = DcpCheckpoint(tmp_path / "value" / "checkpoints" / "step_000002")
    start = DcpCheckpoint(ROOT / "moe_rl" / "assets" / "tiny_base")
    weights = [k for k in start.tensors if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert weights and all(torch.equal(saved.read(k), start.read(k)) for k in weights)
    assert not torch.equal(saved.read("critic.decoder.final_layernorm.weight"), start.read("decoder.final_layernorm.weight"))

    ppo = forked.run(_ppo_cmd(tmp_path, "ppo", "run.steps=1", f"critic.init_checkpoint={saved.path}"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert ppo.returncode == 0, ppo.stderr[-3000:]
    first = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["critic/values_mean"] != 0


def test_value_loss_gradient_reaches_the_transformer_as_autograd_says(critic_factory):
    """With a non-zero value head, the learner's gradient of the value loss (packed
    micro-batches, megatron's schedule) equals autograd of the same loss on a plain padded
    forward, for the head and for every transformer weight."""
    stage = critic_factory()
    critic = stage.critic
    set_head(critic, 8)
    tokens, _ = fixed_batch()
    mask_BT = tokens.response_mask()
    returns_BT = torch.rand(mask_BT.shape, generator=torch.Generator().manual_seed(9)) * mask_BT
    old_BT = plain_values(critic, tokens) * mask_BT
    critic.forward_backward(tokens, ValueLossFn(stage.cfg.critic), extras={OLD_VALUES: old_BT, RETURNS: returns_BT})
    got = {n: p.main_grad.clone() for n, p in critic.gpt.named_parameters() if p.requires_grad}

    from moe_rl.programs.ppo.gae import clipped_value_loss

    critic.model.zero_grad_buffer()  # (DDP's hooks accumulate the plain backward there too)
    pos = torch.arange(tokens.seq_len).expand_as(tokens.tokens_BS)
    hidden_BSH = critic.gpt(input_ids=tokens.tokens_BS, position_ids=pos, attention_mask=None).float()
    idx = [(b, int(tokens.prompt_lens_B[b]) + j - 1, j) for b in range(tokens.batch_size)
           for j in range(int(tokens.response_lens_B[b]))]
    values_BT = torch.zeros(mask_BT.shape).index_put(
        (torch.tensor([b for b, _, _ in idx]), torch.tensor([j for _, _, j in idx])),
        critic.gpt.value_head(hidden_BSH[[b for b, _, _ in idx], [s for _, s, _ in idx]]))
    loss, _ = clipped_value_loss(values_BT, old_BT, returns_BT, mask_BT, stage.cfg.critic.value_clip)
    loss.backward()
    scale = max(float(g.abs().max()) for g in got.values())
    assert scale > 0
    for name, p in critic.gpt.named_parameters():
        if p.requires_grad:
            assert (got[name] - p.main_grad).abs().max() <= 1e-5 * scale, name
    assert float(got["decoder.layers.0.self_attention.linear_qkv.weight"].abs().max()) > 0
