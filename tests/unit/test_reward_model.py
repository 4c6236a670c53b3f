"""The reward model (PPO's critic's starting point): which slots a pair compares, the
Bradley-Terry loss and its gradient against closed forms written with `math`, the learner's
row-local surrogate against autograd of the pair loss, and a run that learns, resumes
bit-exactly and starts PPO's critic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moe_rl.batch import TokenBatch
from moe_rl.config import ConfigError, load_config, to_dict
from moe_rl.programs.reward_model.loss import (
    COEF_KEY,
    compared_slots,
    pair_loss,
    score_coefficients,
    score_pair_metrics,
    score_surrogate_loss,
)
from moe_rl_testing import ROOT
from moe_rl_testing.learner_utils import rl_updates

RECIPE = ROOT / "examples" / "tiny_rm.yaml"
EOS = 2

# 3 pairs: chosen rows 0-2, rejected rows 3-5 (the layout of moe_rl.programs.preference.data.encode_pairs)
PROMPTS = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
CHOSEN = [[5, 6, 7, 8, EOS], [5, 6, 7, EOS], [1, 2, EOS]]
REJECTED = [[5, 6, 9, 8, EOS], [5, 6, 7, 8, EOS], [1, 3, EOS]]


def pairs_batch() -> TokenBatch:
    return TokenBatch.from_lists(PROMPTS + PROMPTS, CHOSEN + REJECTED)


def test_compared_slots_by_hand():
    """divergence: pair 0 differs at token 2, so slots 3..4 (prefixes holding it); pair 1 is
    chosen's EOS against a fourth digit, leaving no common slot after it: the last slots
    (3 and 4); pair 2 differs at token 1: slot 2 only. last: each response's last slot."""
    tokens = pairs_batch()
    c, r = compared_slots(tokens, "divergence")
    assert [row.nonzero().flatten().tolist() for row in c] == [[3, 4], [3], [2]]
    assert [row.nonzero().flatten().tolist() for row in r] == [[3, 4], [4], [2]]
    c, r = compared_slots(tokens, "last")
    assert [row.nonzero().flatten().tolist() for row in c] == [[4], [3], [2]]
    assert [row.nonzero().flatten().tolist() for row in r] == [[4], [4], [2]]
    with pytest.raises(ValueError, match="divergence, last"):
        compared_slots(tokens, "first")


@pytest.mark.parametrize("compare", ["divergence", "last"])
def test_pair_loss_and_gradient_match_closed_forms(compare):
    tokens = pairs_batch()
    g = torch.Generator().manual_seed(3)
    scores = (torch.randn(6, tokens.response_width, generator=g, dtype=torch.float64) * tokens.response_mask())
    c, r = compared_slots(tokens, compare)
    slots = [list(zip(c[p].nonzero().flatten().tolist(), r[p].nonzero().flatten().tolist())) for p in range(3)]
    s = scores.tolist()
    want_loss, want_grad = 0.0, [[0.0] * tokens.response_width for _ in range(6)]
    for p, pairs in enumerate(slots):
        for tc, tr in pairs:
            z = s[p][tc] - s[3 + p][tr]
            want_loss += math.log1p(math.exp(-z)) / len(pairs) / 3
            d = 1 / (1 + math.exp(z)) / len(pairs) / 3   # sigmoid(-z) / (n_p P)
            want_grad[p][tc] -= d
            want_grad[3 + p][tr] += d
    x = scores.clone().requires_grad_(True)
    loss = pair_loss(x, c, r)
    loss.backward()
    assert float(loss) == pytest.approx(want_loss, abs=1e-12)
    assert torch.allclose(x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(score_coefficients(scores, c, r), x.grad, atol=1e-15)
    m = score_pair_metrics(scores, tokens, c, r)
    last = [s[b][int(tokens.response_lens_B[b]) - 1] for b in range(6)]
    assert m["rewards/chosen"] == pytest.approx(sum(last[:3]) / 3, abs=1e-12)
    assert m["rewards/margins"] == pytest.approx(sum(last[p] - last[3 + p] for p in range(3)) / 3, abs=1e-12)
    assert m["rewards/accuracies"] == pytest.approx(sum(last[p] > last[3 + p] for p in range(3)) / 3)
    flat = [s[p][tc] - s[3 + p][tr] for p in range(3) for tc, tr in slots[p]]
    assert m["rewards/slot_accuracies"] == pytest.approx(sum(z > 0 for z in flat) / len(flat))


def test_the_surrogate_gradient_is_the_pair_loss_gradient(megatron_world):
    """Rows split over micro-batches of one row (a pair's two rows never share one): the
    learner's gradient of the surrogate equals autograd of the pair loss on a plain padded
    forward of the value model, for the head and every transformer weight (1e-6 of the
    largest entry: fp32 sums in another order)."""
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.critic import ValueModel
    from tests.integration.programs.ppo.test_ppo import set_head

    tokens = pairs_batch()
    cfg = load_config(None, ["parallel.micro_batch_size=1"])
    with parallel_layout(cfg.parallel, seed=5) as layout:
        torch.manual_seed(5)
        model = ValueModel(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=rl_updates(cfg))
        set_head(model, 4)
        c, r = compared_slots(tokens, "divergence")
        scores = model.logprobs(tokens)
        assert torch.allclose(scores, plain_scores(model, tokens).detach(), atol=1e-5)
        model.forward_backward(tokens, score_surrogate_loss, extras={COEF_KEY: score_coefficients(scores, c, r)})
        got = {n: p.main_grad.clone() for n, p in model.gpt.named_parameters() if p.requires_grad}
        model.model.zero_grad_buffer()
        pair_loss(plain_scores(model, tokens), c, r).backward()
        want = {n: p.main_grad.clone() for n, p in model.gpt.named_parameters() if p.requires_grad}
    scale = max(float(t.abs().max()) for t in want.values())
    assert scale > 1e-4
    assert max(float((got[n] - want[n]).abs().max()) for n in got) <= 1e-6 * scale
    assert float(got["decoder.layers.0.self_attention.linear_qkv.weight"].abs().max()) > 0


def plain_scores(model, tokens: TokenBatch) -> torch.Tensor:
    """Differentiable reference: h . w + b of the final hidden state at each response
    token's scoring position (the position before it)."""
    pos = torch.arange(tokens.seq_len).expand_as(tokens.tokens_BS)
    hidden_BSH = model.gpt(input_ids=tokens.tokens_BS, position_ids=pos, attention_mask=None).float()
    rows, slots, cols = zip(*[(b, int(tokens.prompt_lens_B[b]) + j - 1, j) for b in range(tokens.batch_size)
                              for j in range(int(tokens.response_lens_B[b]))])
    values_N = model.gpt.value_head(hidden_BSH[list(rows), list(slots)])
    return torch.zeros(tokens.batch_size, tokens.response_width).index_put((torch.tensor(rows), torch.tensor(cols)),
                                                                           values_N)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"rm\.batch_size"):
        load_config(None, ["rm.batch_size=0"])
    with pytest.raises(ConfigError, match=r"rm\.compare"):
        load_config(None, ["rm.compare=first"])


def _fit(overrides: list[str]):
    from moe_rl.cli import load_resolved
    from moe_rl.loop import RunLoop
    from moe_rl.programs.reward_model.program import RewardModelProgram

    cfg = load_resolved(RECIPE, overrides)
    program = RewardModelProgram.build(cfg)
    RunLoop(program, run=cfg.run, logging_cfg=cfg.logging, recipe=to_dict(cfg)).run()
    return program


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


@pytest.mark.slow
def test_run_learns_resumes_bit_exactly_and_starts_the_critic(megatron_world, tmp_path):
    """A run of 2 steps resumed to 4 (evaluating less often) equals a 4-step run (the value
    head starting random, from run.seed); with rm.head_init_scale=0 the zero head scores
    every slot alike at step 0 (held-out loss log 2, no slot ordered right); PPO's critic
    started from the final checkpoint has the reward model's transformer, a zero value head
    and the RNG state it had before the load. (That the model learns: `make rm-demo` in
    docs/ppo_dpo.md, held-out accuracy 0.969 after 300 steps, too many for a test.)"""
    base = [f"run.output_dir={tmp_path}", "rm.batch_size=16", "run.eval_every=2", "rm.eval_max_pairs=32",
            "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant", "logging.progress=false",
            "run.save_every=2"]
    whole = _fit([*base, "run.name=whole", "run.steps=4"])
    _fit([*base, "run.name=resumed", "run.steps=2"])
    # (a resume may change how often it evaluates: every 3 steps from here, so step 3 has held-out rows)
    resumed = _fit([*base, "run.name=resumed", "run.steps=4", "run.resume=true", "run.eval_every=3"])
    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == list(range(5))
    assert "eval/loss" not in a[3] and "eval/loss" in b[3]
    for step in (3, 4):
        assert {k: v for k, v in a[step].items() if not k.startswith(("time/", "eval/"))} == \
               {k: v for k, v in b[step].items() if not k.startswith(("time/", "eval/"))}
    assert {k: v for k, v in a[4].items() if k.startswith("eval/")} == {k: v for k, v in b[4].items()
                                                                         if k.startswith("eval/")}
    sa, sb = whole.model.gpt.state_dict(), resumed.model.gpt.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    assert a[0]["eval/loss"] != pytest.approx(math.log(2), abs=1e-6)  # (the random head already ranks)
    zero = _rows(_fit([*base, "run.name=zero_head", "run.steps=1", "rm.head_init_scale=0"]).run.run_dir)
    assert zero[0]["eval/rewards/slot_accuracies"] == 0.0
    assert zero[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-12)
    assert a[4]["eval/loss"] != a[0]["eval/loss"] and a[4]["rewards/margins"] != 0
    for key in ("learner/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "rewards/slot_accuracies", "learner/grad_norm"):
        assert key in a[4], key
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["final_checkpoint"].endswith("step_000004") and not (tmp_path / "whole" / "hf").exists()

    from moe_rl.cli import load_resolved
    from moe_rl.learner import load_start, parallel_layout
    from moe_rl.learner.critic import VALUE_HEAD_KEYS, Critic

    cfg = load_resolved(ROOT / "examples" / "tiny_ppo.yaml", [])
    with parallel_layout(cfg.parallel, seed=1) as layout:
        critic = Critic(cfg.model, cfg.parallel, layout, optimizer=cfg.critic.optimizer, total_updates=rl_updates(cfg))
        rng = torch.get_rng_state()
        load_start(critic, summary["final_checkpoint"], False, optional=(VALUE_HEAD_KEYS,))
        # (starting weights carry no RNG state into the run; a resume restores the saved one)
        assert torch.equal(torch.get_rng_state(), rng)
        sc = critic.gpt.state_dict()
    assert torch.equal(sc["decoder.layers.1.self_attention.linear_qkv.weight"],
                       sa["decoder.layers.1.self_attention.linear_qkv.weight"])
    assert float(sc["value_head.weight"].abs().max()) == 0 and float(sa["value_head.weight"].abs().max()) > 0


def test_the_value_head_starts_random_from_the_seed(megatron_world):
    """init_value_head: N(0, std^2) weights from the seed (the same on every build), bias 0;
    an unknown scale is one line."""
    from moe_rl.cli import load_resolved
    from moe_rl.learner import parallel_layout
    from moe_rl.learner.critic import ValueModel

    cfg = load_resolved(RECIPE, [])
    heads = []
    with parallel_layout(cfg.parallel, seed=1) as layout:
        for seed in (7, 7, 8):
            model = ValueModel(cfg.model, cfg.parallel, layout, optimizer=cfg.optimizer, total_updates=1)
            model.init_value_head(0.5, seed)
            heads.append((model.gpt.value_head.weight.detach().clone(), model.gpt.value_head.bias.detach().clone()))
    (w7, b7), (w7b, _), (w8, _) = heads
    assert torch.equal(w7, w7b) and not torch.equal(w7, w8) and float(b7.abs().max()) == 0
    assert w7.numel() == 128 and 0.4 < float(w7.std()) < 0.6  # (128 draws of N(0, 0.25): std within 20%)
    with pytest.raises(ConfigError, match=r"rm\.head_init_scale must be >= 0"):
        load_resolved(RECIPE, ["rm.head_init_scale=-1"])
