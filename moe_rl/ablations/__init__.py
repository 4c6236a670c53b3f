"""Reproducible ablations that can tell methods apart: off-policy GRPO, GRPO+R2, GRPO+R3,
GSPO, GMPO and RSPO (both gamma placements), each with and without TIS, plus on-policy GRPO
as the reference, several seeds each, on a model whose routing churns (the model section
of `examples/ablations.yaml`; `--help` prints it), with 95% intervals over seeds and the
differences that exceed them.

    python -m moe_rl.ablations run --all [--seeds 1,2,3]   # make ablations (resumable)
    python -m moe_rl.ablations run rspo-post-off --seeds 4,5   # make ablate-rspo-post-off SEEDS=4,5
    python -m moe_rl.ablations report                       # runs/ablations/REPORT.md, results.json, plots
    python -m moe_rl.ablations sweep --lrs 1e-4,2e-4,4e-4   # the lr sweep the report shows
    python -m moe_rl.ablations list

Modules: `settings` (what each setting overrides), `runner` (warm start, processes,
resume), `stats` (per-run summaries, intervals, comparisons), `report`, `sweep`.
"""

from moe_rl.ablations.settings import DEFAULT_SEEDS, REFERENCE, parse_seeds, settings

__all__ = ["DEFAULT_SEEDS", "REFERENCE", "parse_seeds", "settings"]
