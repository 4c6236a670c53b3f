"""The RL step's sampler-learner mismatch metrics, over every data-parallel rank's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_rl.diagnostics import combine_mismatch_summaries, compute_mismatch
from moe_rl.rollout.types import VERSION_SPAN
from moe_rl.step_batch import StepBatch

if TYPE_CHECKING:
    from moe_rl.learner.protocols import PolicyLearner


def mismatch_metrics(learner: PolicyLearner, batch: StepBatch, step: int, max_staleness: int,
                     by_span: bool = False) -> dict[str, float]:
    """Sampler-learner mismatch over every data-parallel rank's rows (each rank measures its
    own; the scalars are combined by count), split by staleness under asynchronous rollout
    (`mismatch/k3_stale0`, ...: by the row's oldest token), with `by_span` by the versions
    within a response (`mismatch/k3_span0`: one version, `_span1plus`: several), and the
    routing disagreement. Collective over the data-parallel ranks."""
    mask_BT, sampler_BT, old_BT = batch.response_mask(), batch.sampler_logp_BT, batch.old_logp_BT
    assert sampler_BT is not None and old_BT is not None  # (a scored batch of sampled rows)
    mine = compute_mismatch(sampler_BT, old_BT, mask_BT, check_values=False)
    metrics = combine_mismatch_summaries(learner.dp_gather_object(mine.summary()))

    def part(name: str, rows: torch.Tensor) -> None:
        p = compute_mismatch(sampler_BT[rows], old_BT[rows], mask_BT[rows], check_values=False)
        whole = combine_mismatch_summaries(learner.dp_gather_object(p.summary()))
        metrics[f"mismatch/k3_{name}"] = whole["mismatch/k3"]
        metrics[f"mismatch/num_tokens_{name}"] = whole["mismatch/num_tokens"]

    for stale in range(1 + max_staleness) if max_staleness else ():
        assert batch.version_B is not None  # (asynchronous rollout: every row's policy version)
        part(f"stale{stale}", (step - 1) - batch.version_B == stale)
    if by_span:
        span_B = batch.extras[VERSION_SPAN]
        part("span0", span_B == 0)
        part("span1plus", span_B > 0)
    if batch.sampler_routing is not None and batch.old_routing is not None:
        metrics.update(learner.sampler_disagreement(batch.old_routing, batch))
    return metrics
