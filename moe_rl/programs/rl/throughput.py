"""The RL step's learner throughput metrics, what a slow job shows before it is profiled
(docs/step.md, "Throughput"; the engines' are the collector's, `perf/engine_*`):

- `perf/learner_tokens`: real tokens (prompt + response, no padding) the actor's updates
  trained on this step, every mini-batch of every epoch, over every data-parallel rank;
- `perf/learner_tokens_per_s_per_gpu`: those over the updates' own seconds (forward,
  backward and optimizer step of each; not the scoring pass, the critic's updates or the
  weight sync) and the learner's GPUs (its ranks, tp x pp x dp: processes on CPU);
- `perf/mfu_learner`, on a GPU `moe_rl.plan.flops` knows: the updates' model FLOPs (the
  count the GPU benchmarks use) over those seconds x GPUs x the GPU's dense bf16 peak.

A step that does not train the actor (PPO's critic warm-up) logs none of them.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from moe_rl.plan.flops import mfu, peak_bf16_flops, train_flops_from_sums


def device_peak() -> float | None:
    """This process's GPU's dense bf16 peak, FLOP/s; None on CPU or a GPU the table lacks."""
    if not torch.cuda.is_available():
        return None
    return peak_bf16_flops(torch.cuda.get_device_name())


def learner_perf(model: Any, works: Sequence[Any], gpus: int, peak: float | None) -> dict[str, float]:
    """The perf/learner_* metrics of the actor's updates of a step (`works`: each update's
    `PassWork`), on `gpus` learner ranks whose bf16 peak is `peak` (None: no MFU)."""
    if not works:
        return {}
    work = functools.reduce(operator.add, works)
    out = {"perf/learner_tokens": work.tokens,
           "perf/learner_tokens_per_s_per_gpu": work.tokens / work.seconds / gpus if work.seconds > 0 else 0.0}
    if peak:
        out["perf/mfu_learner"] = mfu(train_flops_from_sums(model, work.tokens, work.squares), work.seconds, gpus, peak)
    return out
