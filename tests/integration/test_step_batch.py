"""A step's batch as data-parallel ranks hold it: row ownership, selection, micro-batches,
the all-to-all that delivers rows, scalar-only reductions and the no-signal warning."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from moe_rl.diagnostics import combine_mismatch_summaries, compute_mismatch
from moe_rl.learner.microbatch import BatchTotals, split_micro_batches
from moe_rl.rollout.learning_signal import REPEAT_EVERY, LearningSignalWatch
from moe_rl.step_batch import StepBatch, dp_rank_of_row, dp_rows
from moe_rl_testing.dist_helpers import torchrun
from moe_rl_testing.learner_utils import fixed_batch


def _step_batch() -> StepBatch:
    tokens, adv_B = fixed_batch()
    B, T = tokens.batch_size, tokens.response_width
    logp_BT = -torch.rand(B, T, generator=torch.Generator().manual_seed(1)) * tokens.response_mask()
    return StepBatch.whole(tokens, adv_B=adv_B, sampler_logp_BT=logp_BT, version_B=torch.arange(B))


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_every_row_has_exactly_one_data_parallel_rank(dp):
    held = torch.cat([dp_rows(12, d, dp) for d in range(dp)])
    assert sorted(held.tolist()) == list(range(12))
    for d in range(dp):
        assert (dp_rank_of_row(dp_rows(12, d, dp), dp) == d).all()


def test_take_keeps_the_held_rows_in_order_with_every_field():
    whole = _step_batch()
    mine = whole.take(dp_rows(12, 1, 3))  # rows 1, 4, 7, 10
    assert mine.row_ids_B.tolist() == [1, 4, 7, 10] and mine.step_rows == 12
    part = mine.take(torch.tensor([10, 0, 4, 5]))  # 0 and 5 are held elsewhere: skipped
    assert part.row_ids_B.tolist() == [4, 10]
    for name in ("adv_B", "sampler_logp_BT", "version_B"):
        assert torch.equal(getattr(part, name), getattr(whole, name)[[4, 10]])
    assert torch.equal(part.tokens.tokens_BS, whole.tokens.tokens_BS[[4, 10]])


def test_a_batch_refuses_fields_of_another_length():
    tokens, adv_B = fixed_batch()
    with pytest.raises(ValueError, match="adv_B has 11 rows"):
        StepBatch.whole(tokens, adv_B=adv_B[:11])


def test_micro_batches_are_as_many_as_the_fullest_rank_needs_and_padding_is_empty():
    batch = _step_batch().take(dp_rows(12, 0, 5))  # rows 0, 5, 10: 3 rows where the fullest has 3
    totals = BatchTotals.of(batch.tokens)
    mbs = split_micro_batches(batch, micro_batch_size=2, most_rows=4, seq_len=16, totals=totals)
    assert len(mbs) == 2 and all(m.batch.batch_size == 2 for m in mbs)
    assert [m.rows_B.tolist() for m in mbs] == [[0, 5], [10, -1]]
    assert [m.batch_pos_B.tolist() for m in mbs] == [[0, 1], [2, -1]]
    pad = mbs[1]
    assert int(pad.batch.response_lens_B[1]) == 0 and float(pad.step.adv_B[1]) == 0.0
    assert pad.batch.seq_len == 16 and torch.equal(pad.batch.tokens_BS[0, : batch.tokens.seq_len],
                                                   batch.tokens.tokens_BS[2])


def test_mismatch_of_disjoint_parts_combines_to_the_whole():
    g = torch.Generator().manual_seed(3)
    B, T = 9, 7
    lens = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    s = -torch.rand(B, T, generator=g) * 3 * mask
    learner = (s + 0.2 * torch.randn(B, T, generator=g)).clamp(max=0) * mask
    whole = compute_mismatch(s, learner, mask).summary()
    parts = [compute_mismatch(s[i::3], learner[i::3], mask[i::3]).summary() for i in range(3)]
    combined = combine_mismatch_summaries(parts)
    assert combined.keys() == whole.keys()
    for k, v in whole.items():
        assert combined[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_no_learning_signal_is_said_the_first_time_and_every_ten_steps(caplog):
    watch = LearningSignalWatch(dynamic_sampling=False)
    caplog.set_level(logging.WARNING, logger="moe_rl.rollout")
    watch.observe(1, 0.5)
    for step in range(2, 2 + REPEAT_EVERY + 1):
        watch.observe(step, 1.0)
    lines = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 2", f"step {2 + REPEAT_EVERY}"]
    assert "rl.dynamic_sampling" in lines[0] and "rl.group_size" in lines[0]
    watch.observe(20, 0.0)  # signal again: the next silent step warns at once
    watch.observe(21, 1.0)
    assert sum("no learning signal" in r.getMessage() for r in caplog.records) == 3


def test_a_critics_advantages_never_lack_signal_for_equal_group_rewards(caplog):
    """With rl.advantage=gae (one sample per prompt makes every group 'equal') the warning
    would be false: each row's advantage is its returns minus the critic's values."""
    watch = LearningSignalWatch(dynamic_sampling=False, group_advantages=False)
    caplog.set_level(logging.WARNING, logger="moe_rl.rollout")
    for step in range(1, 2 + REPEAT_EVERY):
        watch.observe(step, 1.0)
    assert not [r for r in caplog.records if "no learning signal" in r.getMessage()]


def test_zero_variance_fraction_counts_groups_with_equal_rewards():
    from moe_rl.config import load_config
    from moe_rl.rollout.packing import plan_step
    from moe_rl.rollout.types import GroupSummary

    cfg = load_config(None, ["rl.group_size=2", "rl.prompts_per_step=3"])
    groups = [GroupSummary(3, (2, 2), (1.0, 1.0), ("stop", "stop")),
              GroupSummary(3, (1, 4), (0.0, 1.0), ("stop", "length")),
              GroupSummary(2, (5, 1), (0.0, 0.0), ("stop", "stop"))]
    plan = plan_step(groups, groups, 1, cfg.rl, cfg.parallel.tensor_model_parallel_size)
    assert plan.stats["reward/zero_variance_frac"] == pytest.approx(2 / 3)
    assert plan.seq_len == 7 and plan.rows == 6  # longest prompt + response: 3 + 4
    assert plan.adv_R[:2].abs().sum() == 0 and plan.adv_R[4:].abs().sum() == 0
    torch.testing.assert_close(plan.adv_R[2:4], torch.tensor([-0.5, 0.5]) / (0.5 ** 0.5 + 1e-6))


@pytest.mark.multiproc
def test_the_exchange_delivers_each_message_to_its_rank_only(tmp_path):
    out = tmp_path / "exchange.json"
    torchrun("exchange_worker.py", 3, str(out), timeout=300)
    everyone = json.loads(out.read_text())
    for rank, seen in enumerate(everyone):
        got = seen["got"]
        assert len(got) == 3
        for src, msg in enumerate(got):
            if rank == 0 and src == 1:
                assert msg == []
                continue
            assert msg == {"src": src, "dst": rank, "payload": list(range(src * 100 + rank))}
    assert sorted(r for seen in everyone for r in seen["rows"]) == list(range(10))
